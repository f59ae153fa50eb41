"""`sippcache serve` when its store fails while serving: requests are still answered
(the cache costs speed only) and the failures show in the metrics.

The disk fills for real, from the server's point of view: its process runs with
a lowered file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored), so LMDB's writes past
it fail with EFBIG the way they fail on a full disk (chmod would not do: the
tests run as root). Redis fails for real too: the server process is killed.
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

import sippcache
from harness.servers import QUESTIONS, Conversation, gemma_args

pytestmark = pytest.mark.gemma


def file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec: both survive exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_full_disk_costs_speed_only(gemma_model: Path, servers, tmp_path: Path, parallel: int) -> None:
    server = servers(
        gemma_args(gemma_model, f"lmdb://{tmp_path}/store", parallel=parallel), preexec_fn=file_size_limit(6_000_000)
    )
    client = server.client()
    # A short prompt: its entries (under 2 MB each: state and logits) still fit.
    short = "The keeper's log, day 12, at dawn: the schooner Eider passed the cape under a grey sky, and"
    first = client.completions.create(model="gemma", prompt=short, temperature=0, max_tokens=8).choices[0].text
    server.settle()
    assert server.model_stats()["entries_written"] >= 1 and server.model_stats()["write_failures"] == 0
    # Longer prompts: each entry is a few MB, past the limit: every write fails.
    conversation = Conversation("full")
    answers = [conversation.turn(server, question)[0] for question in QUESTIONS[:2]]
    server.settle()
    stats = server.model_stats()
    assert stats["write_failures"] >= 2, stats
    metrics = server.metrics()
    assert metrics['sippcache_backend_errors_total{kind="write",model="gemma"}'] == stats["write_failures"]
    assert all(isinstance(answer, str) for answer in answers) and server.process.poll() is None
    # Lookups go on working (the store evicts to make room when a write fails, so
    # what they find may be gone), and the answers do not change.
    before = server.model_stats()
    client.completions.create(
        model="gemma", prompt="Unrelated text to move the live context elsewhere, please.", temperature=0, max_tokens=2
    )
    again = client.completions.create(model="gemma", prompt=short, temperature=0, max_tokens=8).choices[0].text
    assert again == first
    after = server.model_stats()
    assert after["lookups"] == before["lookups"] + 2 and after["backend_errors"] == 0, after
    assert server.stats()["backend_errors"] >= 2


@pytest.mark.parametrize("parallel", [1, 4])
def test_redis_going_down_costs_speed_only(gemma_model: Path, servers, tmp_path: Path, parallel: int) -> None:
    info = sippcache.backends().get("redis")
    assert info is not None and info.usable, (
        "the sippcache-redis plugin is not installed (the test command installs it)"
    )
    from sippcache_redis.servers import ValkeyServer

    with ValkeyServer(tmp_path / "valkey") as valkey:
        url = valkey.url + "?prefix=serve-faults"
        server = servers(gemma_args(gemma_model, url, parallel=parallel))
        conversation = Conversation("redis")
        conversation.turn(server, QUESTIONS[0])
        server.settle()
        written = server.model_stats()["entries_written"]
        assert written >= 1
        valkey.kill()
        answer, did = conversation.turn(server, QUESTIONS[1])  # answered, from the live context and evaluation
        assert isinstance(answer, str) and did["tokens_reused"] == 0
        other = Conversation("other")
        other.turn(server, QUESTIONS[0])  # a miss everywhere: evaluated in full
        server.settle()
        stats = server.stats()
        store = next(iter(stats["stores"].values()))
        assert store["errors"] > 0, store
        assert stats["backend_errors"] > 0
        metrics = server.metrics()
        assert sum(v for k, v in metrics.items() if k.startswith("sippcache_store_errors_total{")) > 0
        # Back up (empty, no persistence): the server stores again.
        valkey.start()
        server.settle()
        conversation.turn(server, QUESTIONS[2])
        server.settle()
        assert server.model_stats()["entries_written"] > written
        assert server.process.poll() is None
