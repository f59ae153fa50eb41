"""`sippcache serve` with a config file of several models and alias swapping: each
model's entries stay in its own namespace, each answers as it does uncached, and
swapping back to a model (upstream's proxy freed it meanwhile) is warm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sippcache
from harness.servers import briefed, delta
from sippcache.state.chunkentries import NAMESPACE_MARK

pytestmark = pytest.mark.gemma

KEYS = ("lookups", "hits", "tokens_reused", "tokens_evaluated", "entries_written")


@pytest.mark.parametrize("parallel", ["1", "4"])  # one at a time, and batched (swaps wait for the others)
def test_two_models_and_alias_swapping(
    gemma_model: Path, tiny_model: Path, servers, tmp_path: Path, parallel: str
) -> None:
    store, tiny_store = f"lmdb://{tmp_path}/store", f"lmdb://{tmp_path}/tiny-store"
    config = tmp_path / "models.json"
    config.write_text(
        json.dumps(
            {
                "models": [
                    {"model": str(gemma_model), "model_alias": "gemma", "n_ctx": 2048, "verbose": False},
                    # The same file with a quantized K cache: another fingerprint, so another namespace.
                    {
                        "model": str(gemma_model),
                        "model_alias": "gemma-q8k",
                        "n_ctx": 1024,
                        "type_k": 8,
                        "verbose": False,
                    },
                    {
                        "model": str(tiny_model),
                        "model_alias": "tiny",
                        "n_ctx": 512,
                        "verbose": False,
                        "cache_url": tiny_store,
                    },
                ]
            }
        )
    )
    server = servers(["--config_file", str(config), "--cache", store, "--parallel", parallel])
    client = server.client()
    messages = [briefed("Which ship passed at noon?")]
    tiny_prompt = " ".join(f"w{i}" for i in range(40))

    def ask(alias: str) -> tuple[str, dict[str, int]]:
        before = server.model_stats(alias)
        if alias == "tiny":  # no chat template: a completion
            completion = client.completions.create(model=alias, prompt=tiny_prompt, temperature=0, max_tokens=8)
            text = completion.choices[0].text
        else:
            reply = client.chat.completions.create(model=alias, messages=messages, temperature=0, max_tokens=12)
            text = reply.choices[0].message.content or ""
        return text, delta(before, server.model_stats(alias), *KEYS)

    # First answers, each model loaded in turn with nothing of its own in the cache: uncached.
    cold = {}
    for alias in ("gemma", "gemma-q8k", "tiny"):
        cold[alias], did = ask(alias)
        assert did["hits"] == 0 and did["tokens_reused"] == 0, (alias, did)  # gemma's entries are no use to gemma-q8k
        server.settle()
    assert cold["gemma"] and cold["tiny"]
    stats = server.stats()["models"]
    assert stats["gemma"]["namespace"] != stats["gemma-q8k"]["namespace"]
    assert stats["gemma"]["store"] == stats["gemma-q8k"]["store"] == store and stats["tiny"]["store"] == tiny_store
    assert [alias for alias, row in stats.items() if row["loaded"]] == ["tiny"]

    # Swapping back: each model was freed and is loaded again, and is warm from the store.
    for alias in ("gemma", "gemma-q8k", "tiny"):
        answer, did = ask(alias)
        assert answer == cold[alias], alias
        assert did["hits"] == 1 and did["tokens_reused"] > 0 and did["tokens_evaluated"] <= 1, (alias, did)
    stats = server.stats()["models"]
    assert all(stats[alias]["lookups"] == 2 for alias in stats)  # counts survive unloading
    metrics = server.metrics()
    assert metrics['sippcache_model_loaded{model="tiny"}'] == 1
    assert metrics['sippcache_model_loaded{model="gemma"}'] == 0
    assert metrics['sippcache_hits_total{model="gemma-q8k"}'] == 1
    server.stop()

    # What each store holds: the two gemma namespaces in one, the tiny model's in the other (each
    # with the namespace of its chunks beside it).
    with sippcache.open(store) as cache:
        owners = {e.namespace.split(NAMESPACE_MARK)[0] for e in cache.entries()}
        assert owners == {stats["gemma"]["namespace"], stats["gemma-q8k"]["namespace"]}
    with sippcache.open(tiny_store) as cache:
        assert {e.namespace.split(NAMESPACE_MARK)[0] for e in cache.entries()} == {stats["tiny"]["namespace"]}
