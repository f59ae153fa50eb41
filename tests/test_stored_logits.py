"""Stored logits: an exact repeat evaluates nothing and samples what the cold path samples.

Each warm run happens in a new process (a restart), and proves it skipped the
work with llama.cpp's own counters (`llama_perf_context`, read after
`llama_synchronize`, which is when llama.cpp updates them): no time spent on
prompt or single-token evaluation before the first token. llama.cpp reports the
counts as max(1, n), so "nothing evaluated" reads n_p_eval == n_eval == 1 with
both times exactly 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from itertools import islice
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

import sippcache
from harness.llama_tools import last_logits
from sippcache import frame
from sippcache.llama import Llama as SippLlama
from sippcache.llama import LlamaCache, PrefillResult, PrefixCache
from sippcache.state import chunkentries

#: Sampler settings a caller may use; `seed` is set on the model first.
SAMPLERS: dict[str, dict[str, Any]] = {
    "greedy": dict(temp=0.0),
    "seeded": dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234),
    "top-k 3": dict(temp=1.5, top_k=3, top_p=1.0, min_p=0.0, seed=7),
    "top-p": dict(temp=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=11),
    "min-p": dict(temp=1.2, top_k=0, top_p=1.0, min_p=0.2, seed=5),
    "repeat penalty": dict(temp=0.7, repeat_penalty=1.5, seed=3),
    "logit bias": dict(temp=0.9, seed=21, logit_bias={"65": 8.0, "66": 6.0}),
    "grammar": dict(temp=0.9, seed=8, grammar="root ::= [a-c] [x-z]+"),
}

#: Runs in a new process: prefill the prompt (restoring from the cache), record
#: llama.cpp's counters, then generate with each sampler setting.
_CHILD = textwrap.dedent(
    """
    import json, sys
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar
    from sippcache.llama import Llama, PrefixCache
    from tests.test_stored_logits import generate
    model, url, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tokens, samplers, count = json.loads(sys.stdin.read())
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=512, verbose=False)
    out = {}
    with PrefixCache(llm, url) as cache:
        for name, options in samplers.items():
            llama_cpp.llama_perf_context_reset(llm.ctx)
            result = cache.prefill(tokens)
            llama_cpp.llama_synchronize(llm.ctx)
            perf = llama_cpp.llama_perf_context(llm.ctx)
            out[name] = {"restored": result.restored, "evaluated": result.evaluated,
                         "logits_from_store": result.logits_from_store,
                         "perf": [perf.n_p_eval, perf.t_p_eval_ms, perf.n_eval, perf.t_eval_ms],
                         "tokens": generate(llm, tokens, options, count)}
    print(json.dumps(out))
    """
)


def generate(llm: Any, tokens: list[int], options: dict[str, Any], count: int) -> list[int]:
    """`count` tokens of `llm.generate(tokens, ...)` with these sampler settings."""
    from llama_cpp.llama_grammar import LlamaGrammar

    options = dict(options)
    if "seed" in options:
        llm.set_seed(options.pop("seed"))
    if "grammar" in options:
        options["grammar"] = LlamaGrammar.from_string(options["grammar"], verbose=False)
    if "logit_bias" in options:
        bias = {int(k): v for k, v in options.pop("logit_bias").items()}

        def add_bias(_ids: Any, scores: np.ndarray) -> np.ndarray:
            scores = scores.copy()
            for token, value in bias.items():
                scores[token] += value
            return scores

        options["logits_processor"] = llama_cpp.LogitsProcessorList([add_bias])
    return [int(t) for t in islice(llm.generate(tokens, **options), count)]


def warm_in_new_process(
    model: Path, url: str, tokens: list[int], count: int, n_ctx: int = 2048, samplers: Any = None
) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), url, str(n_ctx)],
        cwd=root,
        input=json.dumps([tokens, samplers or SAMPLERS, count]),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def cold(
    make_llama: Any, model: Path, tokens: list[int], count: int, samplers: Any = None, **kwargs: Any
) -> dict[str, list[int]]:
    """What a never-cached llama_cpp.Llama generates with each sampler setting."""
    out = {}
    for name, options in (samplers or SAMPLERS).items():
        llm = make_llama(model, **kwargs)
        out[name] = generate(llm, tokens, options, count)
    return out


def prompt(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path}/cache"


def test_exact_repeat_in_a_new_process_evaluates_nothing_and_samples_the_same(make_llama, tiny_model, url) -> None:
    tokens = prompt(700)
    expected = cold(make_llama, tiny_model, tokens, count=12)
    assert len({tuple(t) for t in expected.values()}) > 3  # the settings do sample differently
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url) as pc:
        first = pc.prefill(tokens)
    assert (first.restored, first.evaluated, first.logits_from_store) == (0, 700, False)
    warm = warm_in_new_process(tiny_model, url, tokens, count=12)
    for name, run in warm.items():
        assert run["tokens"] == expected[name], name
        assert (run["restored"], run["evaluated"], run["logits_from_store"]) == (700, 0, True), name
        assert run["perf"] == [1, 0.0, 1, 0.0], name  # llama.cpp evaluated nothing (counts floor at 1)


def test_stored_logits_are_the_evaluated_ones(make_llama, tiny_model, url) -> None:
    tokens = prompt(500)
    plain = make_llama(tiny_model)
    plain.eval(tokens)
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url) as pc:
        pc.prefill(tokens)
        pc.flush()
        with pc.cache.lookup(tokens, namespace=pc.namespace) as match:
            entry = frame.decode(match.blob)
            assert entry.roles == ("cells", "caches", "logits") and len(match.key) == 500  # a chunked state's tail
            np.testing.assert_array_equal(np.frombuffer(entry.section("logits"), dtype=np.float32), last_logits(plain))
            del entry


def test_prefill_result(make_llama, tiny_model, url) -> None:
    tokens = prompt(400)
    llm = make_llama(tiny_model, cls=SippLlama)
    with PrefixCache(llm, url) as pc:
        miss = pc.prefill(tokens)
        assert isinstance(miss, PrefillResult) and miss == 0 and str(miss) == "0"
        again = pc.prefill(tokens)  # the context already holds it: nothing to do
        assert (int(again), again.live, again.restored, again.evaluated) == (400, 400, 0, 0)
        longer = pc.prefill(tokens + [5, 6, 7])  # a conversation's next turn: its entry supersedes the first's
        assert (longer.live, longer.evaluated, longer.logits_from_store) == (400, 3, False)
        pc.flush()
    llm = make_llama(tiny_model, cls=SippLlama)
    with PrefixCache(llm, url) as pc:
        hit = pc.prefill(tokens + [5, 6, 7])
        assert hit == 403 and hit.logits_from_store and hit.restore_seconds > 0
        assert "logits_from_store=True" in repr(hit)
        stats = pc.stats()
        assert (stats["lookups"], stats["hits"], stats["logits_hits"], stats["tokens_evaluated"]) == (1, 1, 1, 0)


def test_a_plain_llama_never_samples_stored_logits(make_llama, tiny_model, url) -> None:
    """llama_cpp.Llama samples only from its context, so the last token is evaluated."""
    tokens = prompt(300)
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url) as pc:
        pc.prefill(tokens)
    plain = make_llama(tiny_model)
    with PrefixCache(plain, url) as pc:
        result = pc.prefill(tokens)
    assert not result.logits_from_store and result.evaluated == 1 and result.restored == 299
    reference = make_llama(tiny_model)
    reference.eval(tokens[:-1])
    reference.eval(tokens[-1:])
    np.testing.assert_array_equal(last_logits(plain), last_logits(reference))


def test_continuation_after_a_stored_logits_hit(make_llama, tiny_model, url) -> None:
    """The state restored with the logits continues exactly: a longer prompt next, and sample() works."""
    tokens = prompt(300)
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url) as pc:
        pc.prefill(tokens)
    llm = make_llama(tiny_model, cls=SippLlama)
    plain = make_llama(tiny_model)
    plain.eval(tokens)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(tokens).logits_from_store
        assert llm.sample(temp=0.0) == plain.sample(temp=0.0)
        llm.eval([42, 43])
        plain.eval([42, 43])
        np.testing.assert_array_equal(last_logits(llm), last_logits(plain))


#: llama-cpp-python's completion paths, each with sampler settings that matter.
COMPLETIONS = {
    "completion": lambda llm, text, stream: llm.create_completion(
        text, max_tokens=6, temperature=0.9, top_k=20, seed=99, logit_bias={65: 3.0}, stream=stream
    ),
    "chat": lambda llm, text, stream: llm.create_chat_completion(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}],
        max_tokens=6,
        temperature=0.0,
        stream=stream,
    ),
}


def completion_text(response: Any, stream: bool) -> str:
    if not stream:
        choice = response["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    parts = []
    for chunk in response:
        choice = chunk["choices"][0]
        parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(COMPLETIONS))
def test_llama_cache_completions_repeat_without_evaluating(make_llama, tiny_model, url, path, stream) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 15
    run = COMPLETIONS[path]
    options = dict(chat_format="chatml")
    expected = completion_text(run(make_llama(tiny_model, **options), text, stream), stream)
    for attempt in range(2):  # the second model instance starts empty, like a new process
        llm = make_llama(tiny_model, cls=SippLlama, **options)
        cache = LlamaCache(url)
        llm.set_cache(cache)
        llama_cpp.llama_perf_context_reset(llm.ctx)
        assert completion_text(run(llm, text, stream), stream) == expected
        stats = cache.prefix_cache(llm).stats()
        llama_cpp.llama_synchronize(llm.ctx)
        perf = llama_cpp.llama_perf_context(llm.ctx)
        if attempt == 0:
            assert perf.n_p_eval > 100 and perf.t_p_eval_ms > 0  # the cold prompt was evaluated
        else:
            assert stats["logits_hits"] == 1 and stats["tokens_evaluated"] == 0
            assert perf.t_p_eval_ms == 0.0  # the prompt was not evaluated; only generated tokens were
            assert perf.n_eval == 5  # 6 tokens, the first from the stored logits
        cache.close()


def test_completions_in_a_row_continue_from_stored_logits(make_llama, tiny_model, url) -> None:
    """max_tokens=1 leaves the context at the prompt, its logits only stored: the
    snapshot after the completion keeps them, and a repeat still matches."""
    text = "Pack my box with five dozen liquor jugs. " * 12
    expected = [make_llama(tiny_model).create_completion(text, max_tokens=1, temperature=0.0)["choices"][0]["text"]]
    llm = make_llama(tiny_model, cls=SippLlama)
    cache = LlamaCache(url)
    llm.set_cache(cache)
    for _ in range(3):
        assert [llm.create_completion(text, max_tokens=1, temperature=0.0)["choices"][0]["text"]] == expected
    cache.close()


def test_the_completion_state_copy_is_skipped_but_save_state_still_works(make_llama, tiny_model, url, monkeypatch):
    llm = make_llama(tiny_model, cls=SippLlama)
    cache = LlamaCache(url)
    llm.set_cache(cache)
    copies = []
    real = llama_cpp.llama_state_get_data
    monkeypatch.setattr(llama_cpp, "llama_state_get_data", lambda *a: copies.append(1) or real(*a))
    llm.create_completion("Sphinx of black quartz, judge my vow. " * 8, max_tokens=3, temperature=0.0)
    assert copies == []  # llama-cpp-python's save_state() for the cache copied nothing
    state = llm.save_state()
    assert copies == [1] and state.llama_state_size > 0 and state.n_tokens == llm.n_tokens
    cache.close()


class CountingLlama(SippLlama):
    """sippcache's Llama, counting the whole-context states it is asked for."""

    saved = 0

    def save_state(self) -> llama_cpp.llama.LlamaState:
        self.saved += 1
        return super().save_state()


@pytest.mark.parametrize("path", sorted(COMPLETIONS))
def test_completions_with_llama_cache_make_no_whole_context_state(make_llama, tiny_model, url, monkeypatch, path):
    """llama-cpp-python hands its cache `save_state()` after each completion; with a
    LlamaCache (which stores the sequence itself) sippcache's Llama is never asked for
    it, and llama.cpp's whole-context copy (llama_state_get_size/get_data, through
    either binding) is never made. What is stored is what the hook stores: the context."""
    made = []
    for module in (llama_cpp, llama_cpp.llama_cpp):
        for name in ("llama_state_get_size", "llama_state_get_data"):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, real=real, name=name: made.append(name) or real(*a))
    text = "Sphinx of black quartz, judge my vow. " * 8
    llm = make_llama(tiny_model, cls=CountingLlama, chat_format="chatml")
    cache = LlamaCache(url)
    llm.set_cache(cache)
    for stream in (False, True, False):
        completion_text(COMPLETIONS[path](llm, text, stream), stream)
        pc = cache.prefix_cache(llm)
        pc.flush()
        context = [int(t) for t in llm.input_ids[: llm.n_tokens]]
        assert pc.cache.peek(context, namespace=pc.namespace, partial=False).length == len(context)
    assert (llm.saved, made) == (0, [])
    assert cache.prefix_cache(llm).stats()["logits_hits"] >= 1  # the repeats restored the prompt
    assert llm.save_state().n_tokens == llm.n_tokens and llm.saved == 1  # still there for callers
    assert "llama_state_get_data" in made
    cache.close()


def test_old_format_entries_still_load(make_llama, tiny_model) -> None:
    """An entry written by sippcache 0.1 (frame version 1: the state of the prompt
    minus its last token, no logits) is restored; the last token is evaluated."""
    tokens = prompt(300)
    cache = sippcache.open("ram://")
    with PrefixCache(make_llama(tiny_model), cache, chunk_tokens=0) as pc:  # plain Llama: prompt minus one, whole
        pc.prefill(tokens)
        pc.flush()
        namespace, digest = pc.namespace, pc.fingerprint.digest
        with cache.lookup(tokens[:-1], namespace=namespace) as match:
            state = bytes(frame.decode(match.blob).section("state"))
    cache.clear()
    v1 = bytearray(frame.encode(tokens[:-1], [state], fingerprint=digest, kind="llama.seq"))  # no roles, no MAC
    v1[8:10] = (1).to_bytes(2, "little")  # exactly the version 1 layout
    assert frame.decode(bytes(v1)).roles == ("",)
    cache.store(tokens[:-1], bytes(v1), namespace=namespace)
    llm = make_llama(tiny_model, cls=SippLlama)
    reference = make_llama(tiny_model)
    reference.eval(tokens[:-1])
    reference.eval(tokens[-1:])
    with PrefixCache(llm, cache) as pc:
        result = pc.prefill(tokens)
        assert (result.restored, result.evaluated, result.logits_from_store) == (299, 1, False)
    np.testing.assert_array_equal(last_logits(llm), last_logits(reference))


def test_with_a_secret_entries_without_its_mac_are_misses(make_llama, tiny_model, tmp_path) -> None:
    tokens = prompt(300)
    url = f"lmdb://{tmp_path}/shared"
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url, secret="ours") as pc:
        pc.prefill(tokens)
        pc.flush()
        with pc.cache.lookup(tokens, namespace=pc.namespace) as match:
            assert frame.decode(match.blob, secret="ours").authenticated
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url, secret="ours") as pc:
        assert pc.prefill(tokens).logits_from_store
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url, secret="theirs") as pc:
        result = pc.prefill(tokens)
        assert result.restored == 0 and pc.stats()["corrupt_entries"] >= 1
    # An attacker with write access plants a well-formed entry without a MAC: a miss.
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url) as planter:  # no secret
        planter.prefill(prompt(200, seed=4))
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), url, secret="ours") as pc:
        assert pc.prefill(prompt(200, seed=4)).restored == 0


def test_secret_from_the_environment(make_llama, tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SIPPCACHE_SECRET", "from-env")
    with PrefixCache(make_llama(tiny_model, cls=SippLlama), f"lmdb://{tmp_path}/c") as pc:
        pc.prefill(prompt(100))
        pc.flush()
        with pc.cache.lookup(prompt(100), namespace=pc.namespace) as match:
            assert frame.decode(match.blob, secret="from-env").authenticated


def test_the_background_writer_never_replaces_a_newer_entry(make_llama, tiny_model) -> None:
    """A snapshot queued behind a slow store is older than a state another writer
    stored meanwhile: the older one must not win."""
    tokens = prompt(300)
    cache = sippcache.open("ram://")
    release = threading.Event()
    real_store = cache.store

    def slow_store(*args: Any, **kwargs: Any) -> bool:
        release.wait(30)
        return real_store(*args, **kwargs)

    with PrefixCache(make_llama(tiny_model, cls=SippLlama), cache) as pc:
        cache.store = slow_store  # type: ignore[method-assign]
        pc.prefill(tokens)  # its snapshot waits in the writer
        newer = b"a newer state from another writer"
        assert real_store(tokens, newer, namespace=pc.namespace)
        release.set()
        pc.flush()
        with cache.lookup(tokens, namespace=pc.namespace) as match:
            assert bytes(match.blob) == newer
        assert cache.stats().stale == 1


def test_pinned_prompt_survives_a_flood(make_llama, tiny_model) -> None:
    system = prompt(400, seed=1)
    cache = sippcache.open("ram://?max_bytes=3MiB")  # room for a handful of the tiny model's states
    llm = make_llama(tiny_model, cls=SippLlama)
    with PrefixCache(llm, cache) as pc:
        pc.prefill(system, pin=True)
        for i in range(30):  # one-off prompts, far over budget
            pc.prefill(prompt(400, seed=100 + i))
        pc.flush()
        assert cache.stats().evictions > 10
        pinned = [e for e in cache.entries() if e.pinned]  # the prompt's tail and its chain of chunks
        assert sorted((chunkentries.is_chunk_namespace(e.namespace), len(e.key)) for e in pinned) == [
            (False, 400),
            *((True, n) for n in range(64, 400, 64)),
        ]
        result = pc.prefill(system + [9, 10, 11])
        assert result.restored == 400
        # That prefill's state is written on the writer thread; landing between the unpin and the
        # pin, its write could evict the prompt's entries, unpinned then (a 2-core run did: pin False).
        pc.flush()
        assert pc.unpin(system) is True and pc.pin(system) is True
        assert pc.pin(prompt(50, seed=999)) is False  # never stored


def test_bad_options(make_llama, tiny_model) -> None:
    llm = make_llama(tiny_model, cls=SippLlama)
    with pytest.raises(TypeError, match="secret"):
        PrefixCache(llm, "ram://", secret=b"")
    with pytest.raises(TypeError, match="secret"):
        PrefixCache(llm, "ram://", secret=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_prefill"):
        PrefixCache(llm, "ram://", on_prefill="print")  # type: ignore[arg-type]


def test_on_prefill_sees_every_prefill_and_never_fails_one(make_llama, tiny_model, caplog) -> None:
    seen: list[PrefillResult] = []
    llm = make_llama(tiny_model, cls=SippLlama)
    with PrefixCache(llm, "ram://", on_prefill=seen.append) as pc:
        pc.prefill(prompt(100))
        pc.prefill(prompt(100))
    assert [(r.evaluated, r.live) for r in seen] == [(100, 0), (0, 100)]

    def broken(result: PrefillResult) -> None:
        raise RuntimeError("observer bug")

    with PrefixCache(make_llama(tiny_model, cls=SippLlama), "ram://", on_prefill=broken) as pc:
        assert pc.prefill(prompt(100)) == 0
    assert "observer bug" in caplog.text


# -- gemma-3-270m: a real model, with a 262k vocabulary and a sliding window --------------------

GEMMA_SAMPLERS = {name: SAMPLERS[name] for name in ("greedy", "seeded", "logit bias", "grammar")}


@pytest.fixture(scope="module")
def gemma_prompt(gemma_model: Path) -> list[int]:
    vocab = llama_cpp.Llama(model_path=str(gemma_model), n_ctx=4096, vocab_only=True, verbose=False)
    text = " ".join(f"entry {i}: the keeper saw ship number {i * 7} pass the cape." for i in range(60))
    ids = vocab.tokenize(text.encode())
    vocab.close()
    return ids[:900]


@pytest.mark.gemma
def test_gemma_exact_repeat_in_a_new_process(gemma_model, make_llama, gemma_prompt, tmp_path) -> None:
    url = f"lmdb://{tmp_path}/cache"
    expected = cold(make_llama, gemma_model, gemma_prompt, 8, GEMMA_SAMPLERS, n_ctx=4096)
    with PrefixCache(make_llama(gemma_model, cls=SippLlama, n_ctx=4096), url) as pc:
        assert pc.prefill(gemma_prompt).evaluated == 900
    warm = warm_in_new_process(gemma_model, url, gemma_prompt, 8, n_ctx=4096, samplers=GEMMA_SAMPLERS)
    for name, run in warm.items():
        assert run["tokens"] == expected[name], name
        assert (run["restored"], run["evaluated"], run["logits_from_store"]) == (900, 0, True), name
        assert run["perf"] == [1, 0.0, 1, 0.0], name


@pytest.mark.gemma
@pytest.mark.parametrize("stream", [False, True])
def test_gemma_chat_repeat_with_llama_cache(gemma_model, make_llama, tmp_path, stream) -> None:
    text = "The lighthouse keeper logged every ship. Which ship passed first, and why does it matter? " * 20
    run = COMPLETIONS["chat"]
    expected = completion_text(run(make_llama(gemma_model, n_ctx=4096), text, stream), stream)
    for attempt in range(2):
        llm = make_llama(gemma_model, cls=SippLlama, n_ctx=4096)
        cache = LlamaCache(f"lmdb://{tmp_path}/cache")
        llm.set_cache(cache)
        assert completion_text(run(llm, text, stream), stream) == expected
        llama_cpp.llama_synchronize(llm.ctx)
        if attempt == 1:
            assert cache.prefix_cache(llm).stats()["logits_hits"] == 1
            assert llama_cpp.llama_perf_context(llm.ctx).t_p_eval_ms == 0.0
        cache.close()
