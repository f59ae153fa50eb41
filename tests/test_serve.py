"""`sippcache serve` end to end: a real server process on 127.0.0.1, real HTTP, the
official `openai` client, the real gemma-3-270m model, real stores.

What is checked: answers from a warm cache are token-for-token those from an
empty one (greedy, seeded sampling, streaming, completions, prompt logprobs);
interleaved conversations reuse their earlier turns (read from /metrics);
a restarted server and a second server on the same store (LMDB, and Redis)
continue old conversations warm; a client hanging up mid-stream leaves the
server serving.

The helpers here (`Server`, `Conversation`, ...) are shared by the other
tests/test_serve_*.py files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gemma

ROOT = Path(__file__).resolve().parent.parent
N_CTX = 4096
#: A system prompt of about 190 tokens: long enough that reuse shows, short enough for 2 shared cores.
SYSTEM = (
    "You are the archivist of a lighthouse on the northern cape. You keep the keeper's log: every ship that "
    "passed, its flag, the hour, the weather and the state of the sea. Answer questions about the log briefly "
    "and plainly, in one or two sentences, and say so when the log does not tell. "
) * 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `python -m sippcache.server` process (or any command) on a free loopback port.

    Started in its own session so that `stop()` reaches its children too; stopped
    with SIGINT (uvicorn's graceful shutdown, after which pending cache writes are
    flushed), then SIGKILL if it does not exit.
    """

    def __init__(
        self, args: Sequence[str], log_path: Path, *, module: str = "sippcache.server",
        env: dict[str, str] | None = None, preexec_fn: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", module, *args]
        if "--verbose" not in args and "--config_file" not in args:
            command += ["--verbose", "false"]
        # HOST and PORT win over settings, with or without a config file (as upstream).
        env = {"HOST": "127.0.0.1", "PORT": str(self.port), **(env or {})}
        self._log = open(log_path, "ab")  # noqa: SIM115  # the server's log for its whole life: closed in stop()
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env}, preexec_fn=preexec_fn,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.get("/v1/models", timeout=5)
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")

    def get(self, path: str, timeout: float = 60) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.read()

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def stats(self) -> dict[str, Any]:
        """This server's /v1/cache/stats."""
        return json.loads(self.get("/v1/cache/stats"))

    def model_stats(self, alias: str | None = None) -> dict[str, Any]:
        models = self.stats()["models"]
        return models[alias] if alias is not None else next(iter(models.values()))

    def metrics(self) -> dict[str, float]:
        """This server's /metrics, as {'name{labels}': value}."""
        return parse_metrics(self.get("/metrics").decode())

    def settle(self, timeout: float = 60) -> None:
        """Wait until the background writes of the last request reached the store
        (entries_written stops moving; a write of a few MB takes milliseconds)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            now = sum(m["entries_written"] + m["write_failures"] for m in self.stats()["models"].values())
            if now == last:
                return
            last = now
            time.sleep(0.5)

    def stop(self) -> int:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self._log.close()
        return self.process.returncode


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start servers (`start(args)`); every one is stopped at teardown."""
    started: list[Server] = []

    def start(args: Sequence[str], **kwargs: Any) -> Server:
        server = Server(args, tmp_path / f"server-{len(started)}.log", **kwargs)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


def gemma_args(gemma: Path, cache: str, *extra: str) -> list[str]:
    return ["--model", str(gemma), "--model_alias", "gemma", "--n_ctx", str(N_CTX), "--cache", cache, *extra]


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def delta(before: dict[str, Any], after: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {key: after[key] - before[key] for key in keys}


class Conversation:
    """A chat whose turns go to whichever server is given (greedy, short answers)."""

    def __init__(self, name: str, system: str = SYSTEM) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": f"{system}This is conversation {name}."}]
        self.prompt_tokens: list[int] = []
        self.answers: list[str] = []

    def turn(self, server: Server, question: str, *, max_tokens: int = 12) -> tuple[str, dict[str, Any]]:
        """Ask `question`; (the answer, what the cache did for it: deltas of the model's counters)."""
        before = server.model_stats()
        self.messages.append({"role": "user", "content": question})
        reply = server.client().chat.completions.create(
            model="gemma", messages=self.messages, temperature=0, max_tokens=max_tokens
        )
        answer = reply.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": answer})
        self.prompt_tokens.append(reply.usage.prompt_tokens)
        self.answers.append(answer)
        counted = ("tokens_reused", "context_tokens_reused", "tokens_evaluated", "hits")
        return answer, delta(before, server.model_stats(), *counted)


QUESTIONS = [
    "Which ship passed first on the morning of the storm?",
    "What flag did she fly?",
    "How high was the sea that hour?",
    "Did the keeper note the wind?",
]


def assert_warm(conversation: Conversation, did: dict[str, Any], *, slack: int = 8) -> None:
    """The last turn reused everything the previous turn's prompt held, and evaluated
    only what is new: the previous answer and the new question."""
    previous, now = conversation.prompt_tokens[-2], conversation.prompt_tokens[-1]
    reused = did["tokens_reused"] + did["context_tokens_reused"]
    assert did["tokens_reused"] > 0, did
    assert reused >= previous - slack, (did, previous, now)
    assert did["tokens_evaluated"] <= now - previous + slack, (did, previous, now)


# -- the tests ------------------------------------------------------------------------------


def requests_of_every_kind(server: Server) -> dict[str, Any]:
    """Chat (plain, streamed, seeded sampling), completion, and prompt logprobs; what each answered."""
    client = server.client()
    out: dict[str, Any] = {}
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name the first ship in the log."}]
    reply = client.chat.completions.create(model="gemma", messages=chat, temperature=0, max_tokens=16)
    out["chat"] = reply.choices[0].message.content
    streamed = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What was the weather on day 3?"}]
    chunks = client.chat.completions.create(model="gemma", messages=streamed, temperature=0, max_tokens=16, stream=True)
    out["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    sampled = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the keeper."}]
    reply = client.chat.completions.create(
        model="gemma", messages=sampled, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16
    )
    out["chat_seeded"] = reply.choices[0].message.content
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which flags are in the log?"}]
    reply = client.chat.completions.create(
        model="gemma", messages=asked, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    out["chat_logprobs"] = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                            for t in reply.choices[0].logprobs.content]  # fmt: skip
    # Short: upstream computes prompt logprobs in pure Python (a sort of the vocabulary per token).
    prompt = "The keeper's log, day 12, at dawn: the schooner Eider passed the cape under a grey sky, and"
    completion = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=16)
    out["completion"] = completion.choices[0].text
    streamed_text = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=16, stream=True)
    out["completion_stream"] = "".join(c.choices[0].text for c in streamed_text)
    # The prompt's own logprobs (echo): same prompt as above, so a warm server has it cached.
    reply = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=4, echo=True, logprobs=2)
    out["echo_logprobs"] = reply.choices[0].logprobs.token_logprobs
    out["echo_text"] = reply.choices[0].text
    return out


def test_warm_answers_equal_empty_cache_answers(gemma_model: Path, servers, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    cold_server = servers(gemma_args(gemma_model, url))
    cold = requests_of_every_kind(cold_server)
    cold_stats = cold_server.model_stats()
    assert all(cold[k] for k in ("chat", "chat_stream", "completion")), cold  # the model said something
    assert cold["completion_stream"] == cold["completion"]
    cold_server.stop()

    warm_server = servers(gemma_args(gemma_model, url))
    warm = requests_of_every_kind(warm_server)
    stats = warm_server.model_stats()
    assert warm == cold  # token for token, logprobs bit for bit
    assert stats["hits"] >= 5 and stats["tokens_reused"] > cold_stats["tokens_reused"] + 3 * 150, (cold_stats, stats)
    # Each repeated prompt was answered from its stored logits, evaluating nothing,
    # except the prompt-logprobs request, which is evaluated in full on purpose.
    echo_prompt_tokens = len(cold["echo_logprobs"]) - 4
    assert stats["logits_hits"] >= 5 and stats["tokens_evaluated"] <= echo_prompt_tokens + 4, stats
    assert "/v1/cache/stats" in json.loads(warm_server.get("/openapi.json"))["paths"]  # /docs keeps working


def test_interleaved_conversations_reuse_earlier_turns_and_survive_a_restart(
    gemma_model: Path, servers, tmp_path: Path
) -> None:
    url = f"lmdb://{tmp_path}/store"
    server = servers(gemma_args(gemma_model, url))
    conversations = [Conversation(name) for name in "ABC"]
    for round_, question in enumerate(QUESTIONS[:3]):
        for conversation in conversations:
            _, did = conversation.turn(server, question)
            if round_ > 0:
                assert_warm(conversation, did)
    metrics = server.metrics()
    assert metrics['sippcache_hits_total{model="gemma"}'] >= 6
    assert metrics['sippcache_tokens_reused_total{model="gemma"}'] > 6 * 150
    assert metrics['sippcache_restore_seconds_count{model="gemma"}'] >= 6
    # A's next turn, before the restart: the reference for the same turn after it.
    a, b = conversations[0], conversations[1]
    a.turn(server, QUESTIONS[3])
    server.stop()

    server = servers(gemma_args(gemma_model, url))
    # B's next turn was never asked: served warm from what the first server stored.
    _, did = b.turn(server, QUESTIONS[3])
    assert_warm(b, did)
    # A's fourth turn again on the new server: the answer given before the restart,
    # with everything but the prompt's last token restored.
    before = server.model_stats()
    reply = server.client().chat.completions.create(
        model="gemma", messages=a.messages[:-1], temperature=0, max_tokens=12
    )
    did = delta(before, server.model_stats(), "tokens_reused", "tokens_evaluated")
    assert reply.choices[0].message.content == a.answers[-1]
    assert did["tokens_reused"] >= a.prompt_tokens[-1] - 2 and did["tokens_evaluated"] <= 2, did


def test_two_servers_share_one_lmdb_store(gemma_model: Path, servers, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    first, second = servers(gemma_args(gemma_model, url)), servers(gemma_args(gemma_model, url))
    continue_across(first, second)


def test_two_servers_share_one_redis(gemma_model: Path, servers, tmp_path: Path) -> None:
    import sippcache

    info = sippcache.backends().get("redis")
    assert info is not None and info.usable, (
        "the sippcache-redis plugin is not installed (the test command installs it)"
    )
    from sippcache_redis.servers import ValkeyServer

    with ValkeyServer(tmp_path / "valkey") as valkey:
        url = valkey.url + "?prefix=serve-test"
        first, second = servers(gemma_args(gemma_model, url)), servers(gemma_args(gemma_model, url))
        continue_across(first, second)


def continue_across(first: Server, second: Server) -> None:
    """A conversation started on one server continues warm on the other, and back."""
    conversation = Conversation("shared")
    conversation.turn(first, QUESTIONS[0])
    conversation.turn(first, QUESTIONS[1])
    first.settle()
    _, did = conversation.turn(second, QUESTIONS[2])
    assert_warm(conversation, did)
    second.settle()
    _, did = conversation.turn(first, QUESTIONS[3])
    assert_warm(conversation, did)


def test_client_hanging_up_mid_stream_leaves_the_server_serving(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(gemma_args(gemma_model, f"lmdb://{tmp_path}/store"))
    client = server.client()
    prompt = SYSTEM + "\nWrite the whole log of day 40, hour by hour:"
    stream = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=400, stream=True)
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    stream.close()  # hang up
    reply = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=8)
    assert reply.choices[0].text
    reference = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=8)
    assert reply.choices[0].text == reference.choices[0].text
    assert server.process.poll() is None
    assert server.metrics()  # and /metrics still answers
