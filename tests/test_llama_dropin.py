"""`LlamaCache` as a drop-in for `LlamaRAMCache` on a plain `llama_cpp.Llama`, unbound.

llama-cpp-python's own usage, ``llm.set_cache(LlamaCache(url))``, with no
`bind`: the cache keeps the whole-context states llama-cpp-python hands it and
answers the one sharing the longest common prefix, as `LlamaRAMCache` does. A
hit must leave the model computing exactly what it computes with
`LlamaRAMCache` (same text, same logits, same scores) and what a never-cached
run computes. (The bound paths are in test_llama_tiny.py and
test_stored_logits.py; gemma in test_llama_gemma.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_cache import LlamaRAMCache

import sippcache
from harness.llama_tools import last_logits
from sippcache import frame
from sippcache.llama import Llama as SippLlama
from sippcache.llama import LlamaCache, wholestate

A = "The quick brown fox jumps over the lazy dog. " * 20
B = "Pack my box with five dozen liquor jugs. " * 20
A_THEN_OTHER = A[:400] + "Something else entirely now, and then some more. " * 5  # shares A's first ~400 characters
PROMPTS = (A, B, A, A_THEN_OTHER)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path}/cache"


def complete(llm: Any, text: str, **kwargs: Any) -> dict[str, Any]:
    """One completion, with what the context evaluated for it (`n_p_eval`), its last logits,
    and what it holds afterwards."""
    llama_cpp.llama_perf_context_reset(llm.ctx)
    kwargs.setdefault("max_tokens", 6)
    out = llm.create_completion(text, temperature=0.0, **kwargs)
    return {
        "choice": out["choices"][0],
        "evaluated": llama_cpp.llama_perf_context(llm.ctx).n_p_eval,
        "logits": last_logits(llm),
        "held": [int(t) for t in llm.input_ids[: llm.n_tokens]],
    }


def cold(make_llama, model: Path, text: str, **kwargs: Any) -> dict[str, Any]:
    """The never-cached run: a new model, no cache."""
    return complete(
        make_llama(model, **{k: v for k, v in kwargs.items() if k == "logits_all"}),
        text,
        **{k: v for k, v in kwargs.items() if k != "logits_all"},
    )


def test_plain_llama_with_an_unbound_llama_cache(make_llama, tiny_model, url) -> None:
    """llama-cpp-python's own usage works (it raised RuntimeError 'not bound to a model'), and a
    hit computes what LlamaRAMCache's computes and what a never-cached run computes, bit for bit."""
    ram = make_llama(tiny_model)
    ram.set_cache(LlamaRAMCache())
    llm = make_llama(tiny_model)
    cache = LlamaCache(url)
    llm.set_cache(cache)  # no bind: llama_cpp.Llama.set_cache only assigns it
    for i, text in enumerate(PROMPTS):
        ours, theirs, never = complete(llm, text), complete(ram, text), cold(make_llama, tiny_model, text)
        assert ours["choice"]["text"] == theirs["choice"]["text"] == never["choice"]["text"], i
        np.testing.assert_array_equal(ours["logits"], theirs["logits"])
        np.testing.assert_array_equal(ours["logits"], never["logits"])
        assert ours["held"] == theirs["held"] == never["held"]
        assert ours["evaluated"] == theirs["evaluated"], i  # the same restore, the same work
    stats = cache.stats()
    assert stats["hits"] == 2 and stats["misses"] == 2  # A again, and A_THEN_OTHER (on A's entry)
    assert complete(llm, B)["evaluated"] == 1  # an exact repeat evaluates only the last prompt token
    assert stats["entries_written"] == 3  # A, B, A_THEN_OTHER: A's repeat holds the same tokens
    with pytest.raises(RuntimeError, match="not bound"):
        cache.prefix_cache()  # the explicit API needs the model
    cache.close()


def test_unbound_entries_leave_out_empty_scores(make_llama, tiny_model, url) -> None:
    """What is stored: the whole-context state as kind llama.whole, under the tokens it holds,
    and llama-cpp-python's scores array only when it holds something (logits_all=True)."""
    for logits_all in (False, True):
        llm = make_llama(tiny_model, logits_all=logits_all)
        cache = LlamaCache(url, scope=f"logits_all={logits_all}")
        llm.set_cache(cache)
        complete(llm, A)
        held = [int(t) for t in llm.input_ids[: llm.n_tokens]]
        with sippcache.open(url) as store:
            match = store.lookup(held, namespace=wholestate.namespace(cache.whole_states().scope))
            assert match is not None and match.key == tuple(held)
            with match:
                entry = frame.decode(match.blob)
                assert entry.kind == "llama.whole" and entry.meta["n_vocab"] == llm.n_vocab()
                if logits_all:
                    assert entry.roles == ("state", "scores")
                    assert len(entry.section("scores")) == 4 * llm.n_vocab() * llm.n_tokens
                else:
                    assert entry.roles == ("state",)
                del entry
        cache.close()


def test_unbound_hit_with_logits_all_keeps_echoed_logprobs(make_llama, tiny_model, url) -> None:
    """With logits_all=True, the prompt's logprobs after a hit come from the stored scores: the
    same as after a LlamaRAMCache hit, bit for bit, and as never cached (where only the last
    prompt token, evaluated alone after a hit by both caches, moves by float noise)."""
    answers = {}
    for name, cache in (("ram", LlamaRAMCache()), ("ours", LlamaCache(url))):
        first = make_llama(tiny_model, logits_all=True)
        first.set_cache(cache)
        never = complete(first, A, logprobs=3, echo=True)
        again = make_llama(tiny_model, logits_all=True)  # a new model: the hit must come from the cache
        again.set_cache(cache)
        answers[name] = complete(again, A, logprobs=3, echo=True)
        assert answers[name]["evaluated"] == 1
    assert answers["ours"]["choice"] == answers["ram"]["choice"]  # text, tokens, logprobs, top logprobs, offsets
    got, expected = answers["ours"]["choice"], never["choice"]
    assert got["text"] == expected["text"] and got["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
    np.testing.assert_allclose(
        got["logprobs"]["token_logprobs"][1:], expected["logprobs"]["token_logprobs"][1:], rtol=1e-5, atol=1e-5
    )
    assert cache.stats()["hits"] == 1
    cache.close()


_PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import llama_cpp
    from sippcache.llama import LlamaCache
    model, url, text = sys.argv[1], sys.argv[2], sys.stdin.read()
    llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=512, verbose=True)
    llm.set_cache(LlamaCache(url))
    llama_cpp.llama_perf_context_reset(llm.ctx)
    out = llm.create_completion(text, max_tokens=6, temperature=0.0)
    evaluated = llama_cpp.llama_perf_context(llm.ctx).n_p_eval
    stats = llm.cache.stats()
    llm.cache.close()
    print(json.dumps({"text": out["choices"][0]["text"], "evaluated": evaluated, "stats": stats}))
    """
)


def test_unbound_llama_cache_persists_across_processes(make_llama, tiny_model, url) -> None:
    def run() -> tuple[dict[str, Any], list[str]]:
        done = subprocess.run(
            [sys.executable, "-c", _PROCESS_SCRIPT, str(tiny_model), url],
            input=A,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("Llama._create_completion: cache")]
        return json.loads(done.stdout.strip().splitlines()[-1]), said

    never = cold(make_llama, tiny_model, A)
    first, said = run()
    assert first["stats"]["misses"] == 1 and first["stats"]["entries_written"] == 1
    assert "Llama._create_completion: cache miss" in said
    second, said = run()
    assert second["stats"]["hits"] == 1 and second["evaluated"] == 1
    assert "Llama._create_completion: cache hit" in said  # llama-cpp-python loaded what the store answered
    assert first["text"] == second["text"] == never["choice"]["text"]


def test_unbound_streamed_completions(make_llama, tiny_model, url) -> None:
    def streamed(llm: Any, text: str) -> str:
        chunks = llm.create_completion(text, max_tokens=6, temperature=0.0, stream=True)
        return "".join(chunk["choices"][0]["text"] for chunk in chunks)

    expected = [streamed(make_llama(tiny_model), text) for text in (A, B)]
    llm = make_llama(tiny_model)
    cache = LlamaCache(url)
    llm.set_cache(cache)
    assert [streamed(llm, A), streamed(llm, B)] == expected
    llama_cpp.llama_perf_context_reset(llm.ctx)
    assert streamed(llm, A) == expected[0]
    assert llama_cpp.llama_perf_context(llm.ctx).n_p_eval == 1  # the repeat of A: restored
    assert cache.stats()["hits"] == 1 and cache.stats()["entries_written"] == 2
    cache.close()


def test_unbound_entries_are_apart_and_never_fail_a_completion(make_llama, tiny_model, url) -> None:
    """Scopes keep unbound entries apart, a bound cache never sees them, and a damaged one is a miss."""
    expected = cold(make_llama, tiny_model, A)["choice"]["text"]
    llm = make_llama(tiny_model)
    cache = LlamaCache(url, scope="tenant-a")
    llm.set_cache(cache)
    complete(llm, A)
    held = [int(t) for t in llm.input_ids[: llm.n_tokens]]
    cache.close()
    other = make_llama(tiny_model)
    other.set_cache(LlamaCache(url, scope="tenant-b"))
    assert complete(other, A)["choice"]["text"] == expected and other.cache.stats()["hits"] == 0  # type: ignore[union-attr]
    other.cache.close()  # type: ignore[union-attr]
    bound = make_llama(tiny_model, cls=SippLlama)
    bound.set_cache(LlamaCache(url, scope="tenant-a"))
    assert complete(bound, A)["choice"]["text"] == expected and bound.cache.stats()["hits"] == 0  # type: ignore[union-attr]
    bound.cache.close()  # type: ignore[union-attr]
    with sippcache.open(url) as store:  # damage the payload of tenant-a's entry
        namespace = wholestate.namespace("tenant-a")
        with store.lookup(held, namespace=namespace) as match:  # type: ignore[union-attr]
            blob = bytearray(match.blob)
        blob[-100] ^= 0xFF
        store.store(held, bytes(blob), namespace=namespace)
    again = make_llama(tiny_model)
    cache = LlamaCache(url, scope="tenant-a")
    again.set_cache(cache)
    assert complete(again, A)["choice"]["text"] == expected
    assert cache.stats()["hits"] == 0 and cache.stats()["corrupt_entries"] == 1
    assert cache.stats()["entries_written"] == 1  # the damaged entry was dropped and made again
    cache.close()
