"""The llama-cpp-python adapter on a real (tiny, generated) llama.cpp model.

Every hit is checked against the never-cached path: bit-identical logits
where the batch split is the same, and within float noise otherwise.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

import sippcache
from harness.llama_tools import last_logits, prefill_in_new_process, reference_logits
from sippcache import frame
from sippcache.llama import Llama as SippLlama
from sippcache.llama import LlamaCache, PrefixCache
from sippcache.state import chunkentries


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


def assert_close(a: np.ndarray, b: np.ndarray) -> None:
    assert int(np.argmax(a)) == int(np.argmax(b))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path}/cache"


def test_miss_then_hit_in_a_fresh_context(make_llama, tiny_model, url) -> None:
    tokens = prompt(600)
    whole, split = reference_logits(make_llama, tiny_model, tokens)
    with PrefixCache(make_llama(tiny_model), url) as first:
        assert first.prefill(tokens) == 0
        assert_close(last_logits(first.llm), whole)
        first.flush()
        assert first.stats()["entries_written"] == 1
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url) as second:
        assert second.prefill(tokens) == 599
        assert llm.n_tokens == 600 and list(llm.input_ids[:600]) == tokens
        np.testing.assert_array_equal(last_logits(llm), split)  # same split: bit-identical
        stats = second.stats()
        assert (stats["hits"], stats["tokens_reused"], stats["tokens_evaluated"]) == (1, 599, 1)
        assert stats["bytes_read"] > 0 and stats["restore_seconds"] > 0


def test_longer_query_reuses_the_stored_prefix(make_llama, tiny_model, url) -> None:
    base = prompt(400)
    longer = base + prompt(150, seed=1)[1:]
    whole, _ = reference_logits(make_llama, tiny_model, longer)
    with PrefixCache(make_llama(tiny_model), url) as pc:
        pc.prefill(base)
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(longer) == 399
        assert_close(last_logits(llm), whole)


def test_diverging_query_truncates_a_longer_entry(make_llama, tiny_model, url) -> None:
    a = prompt(500)
    b = a[:300] + prompt(100, seed=2)[1:]
    whole, same_split = reference_logits(make_llama, tiny_model, b, splits=(300,))
    with PrefixCache(make_llama(tiny_model), url) as pc:
        pc.prefill(a)
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(b) == 300  # the longest common prefix, from the 499-token entry
    # Not a sliding-window model: truncating the restored state is exact.
    np.testing.assert_array_equal(last_logits(llm), same_split)
    assert_close(last_logits(llm), whole)


def test_live_context_is_reused_without_the_cache(make_llama, tiny_model) -> None:
    a = prompt(300)
    b = a[:200] + prompt(50, seed=3)[1:]
    whole, _ = reference_logits(make_llama, tiny_model, b)
    llm = make_llama(tiny_model)
    with PrefixCache(llm, "ram://") as pc:
        pc.prefill(a)
        pc.cache.clear()
        assert pc.prefill(b) == 200
        assert pc.stats()["context_tokens_reused"] == 200
        assert_close(last_logits(llm), whole)


def test_generation_continues_after_prefill(make_llama, tiny_model, url) -> None:
    tokens = prompt(300)
    plain = make_llama(tiny_model)
    plain.eval(tokens)
    expected = [plain.sample(temp=0.0) for _ in range(1)]
    with PrefixCache(make_llama(tiny_model), url) as pc:
        pc.prefill(tokens)
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(tokens) == 299
        assert [llm.sample(temp=0.0)] == expected
        generated = llm.generate(tokens, temp=0.0)
        assert next(generated) == expected[0]


def test_restart_in_another_process(tiny_model, url, make_llama) -> None:
    tokens = prompt(700)
    _, split = reference_logits(make_llama, tiny_model, tokens)
    first = prefill_in_new_process(tiny_model, url, tokens)
    second = prefill_in_new_process(tiny_model, url, tokens)
    assert (first[0], first[2]) == (0, 700) and (second[0], second[2]) == (699, 1)
    np.testing.assert_array_equal(second[1], split)


def test_other_weights_never_hit(make_llama, tiny_model, tiny_model_other_weights, url) -> None:
    tokens = prompt(300)
    with PrefixCache(make_llama(tiny_model), url) as pc:
        pc.prefill(tokens)
    with PrefixCache(make_llama(tiny_model_other_weights), url) as pc:
        assert pc.prefill(tokens) == 0


@pytest.mark.parametrize(
    "change", [dict(type_k=llama_cpp.GGML_TYPE_F32), dict(type_v=llama_cpp.GGML_TYPE_F32), dict(flash_attn=True)]
)
def test_other_cache_settings_never_hit(make_llama, tiny_model, url, change) -> None:
    tokens = prompt(300)
    with PrefixCache(make_llama(tiny_model), url) as pc:
        pc.prefill(tokens)
    llm = make_llama(tiny_model, **change)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(tokens) == 0
        _, split = reference_logits(make_llama, tiny_model, tokens, **change)
        np.testing.assert_array_equal(last_logits(llm), split)


def test_another_library_version_never_hits(make_llama, tiny_model, url, monkeypatch) -> None:
    tokens = prompt(300)
    with PrefixCache(make_llama(tiny_model), url) as pc:
        pc.prefill(tokens)
    monkeypatch.setattr(llama_cpp, "__version__", "99.0.0")
    with PrefixCache(make_llama(tiny_model), url) as pc:
        assert pc.prefill(tokens) == 0


def test_scopes_are_isolated(make_llama, tiny_model, url) -> None:
    tokens = prompt(300)
    with PrefixCache(make_llama(tiny_model), url, scope="tenant-a") as pc:
        pc.prefill(tokens)
    with PrefixCache(make_llama(tiny_model), url, scope="tenant-b") as pc:
        assert pc.prefill(tokens) == 0
    with PrefixCache(make_llama(tiny_model), url, scope="tenant-a") as pc:
        assert pc.prefill(tokens) == 299


def flip_a_byte(cache: sippcache.CacheBackend, tokens: list[int], namespace: str, at: int) -> None:
    """Store the entry under `tokens` again with its byte `at` flipped: its checksum fails."""
    with cache.lookup(tokens, namespace=namespace) as match:  # type: ignore[union-attr]
        damaged = bytearray(match.blob)
    damaged[at] ^= 0xFF
    cache.store(tokens, damaged, namespace=namespace)


def assert_a_miss_that_drops_one(make_llama, tiny_model, cache: sippcache.CacheBackend, tokens: list[int]) -> None:
    """A new PrefixCache on `cache` restores nothing for `tokens`, counts one corrupt entry, and
    computes the never-cached logits."""
    llm = make_llama(tiny_model)
    whole, _ = reference_logits(make_llama, tiny_model, tokens)
    with PrefixCache(llm, cache) as pc:
        assert pc.prefill(tokens) == 0
        assert pc.stats()["corrupt_entries"] == 1
        assert_close(last_logits(llm), whole)


def test_corrupt_entry_is_a_miss_and_dropped(make_llama, tiny_model, caplog) -> None:
    tokens = prompt(300)
    cache = sippcache.open("ram://")
    with PrefixCache(make_llama(tiny_model), cache) as pc:
        pc.prefill(tokens)
        pc.flush()
        namespace = pc.namespace
    flip_a_byte(cache, tokens[:-1], namespace, -100)  # one bit pattern inside the KV payload
    with caplog.at_level(logging.WARNING, logger="sippcache"):
        assert_a_miss_that_drops_one(make_llama, tiny_model, cache, tokens)
    assert "corrupt" in caplog.text
    decoded = frame.decode(cache.lookup(tokens[:-1], namespace=namespace).blob)  # dropped, then stored afresh
    assert decoded.kind == "llama.seq.tail"  # 299 tokens: four chunks of 64 and this tail


def test_a_damaged_chunk_found_while_joining_is_a_miss_and_dropped(make_llama, tiny_model) -> None:
    """A chunk's payload is checked on another thread while the state is joined: a damaged one
    makes the restore a miss (llama.cpp never gets the bytes) and is deleted; the prompt's state,
    stored again, writes it afresh."""
    tokens = prompt(300)
    cache = sippcache.open("ram://")
    with PrefixCache(make_llama(tiny_model), cache) as pc:
        pc.prefill(tokens)
        pc.flush()
    at = next(e.namespace for e in cache.entries() if chunkentries.is_chunk_namespace(e.namespace))
    flip_a_byte(cache, tokens[:128], at, -5)
    assert_a_miss_that_drops_one(make_llama, tiny_model, cache, tokens)
    with cache.lookup(tokens[:128], namespace=at) as again:  # type: ignore[union-attr]
        assert frame.decode(again.blob).kind == "llama.seq.chunk"


def test_a_well_formed_entry_for_other_positions_is_dropped(make_llama, tiny_model) -> None:
    """A forged entry (valid checksums, but a state of 299 tokens under a 300-token key)
    is never used: the restored positions must be exactly the key's."""
    tokens = prompt(301)
    cache = sippcache.open("ram://")
    with PrefixCache(make_llama(tiny_model), cache, chunk_tokens=0) as pc:  # a whole state to forge from
        pc.prefill(tokens[:300])
        pc.flush()
        namespace, digest = pc.namespace, pc.fingerprint.digest
        match = cache.lookup(tokens[:299], namespace=namespace)
        state = bytes(frame.decode(match.blob).sections[0])
    cache.clear()
    forged = frame.encode(tokens[:300], [state], fingerprint=digest, kind="llama.seq")
    cache.store(tokens[:300], forged, namespace=namespace)
    llm = make_llama(tiny_model)
    _, split = reference_logits(make_llama, tiny_model, tokens)
    with PrefixCache(llm, cache) as pc:
        assert pc.prefill(tokens) == 0
        assert pc.stats()["rejected_entries"] == 1
    np.testing.assert_array_equal(last_logits(llm), split)


@pytest.mark.parametrize("chunk_tokens", [0, 128])
def test_entries_are_framed_sequence_states(make_llama, tiny_model, chunk_tokens) -> None:
    """Whole (`chunk_tokens=0`): one entry, the sequence's state. In chunks: a tail under the
    prompt's tokens and a chunk entry under each multiple of 128 below it, in a namespace of
    their own; together they hold one sequence's state, not the context's."""
    tokens = prompt(300)
    cache = sippcache.open("ram://")
    llm = make_llama(tiny_model)
    with PrefixCache(llm, cache, chunk_tokens=chunk_tokens) as pc:
        pc.prefill(tokens)
        pc.flush()
        match = cache.lookup(tokens, namespace=pc.namespace)
    entry = frame.decode(match.blob)
    assert entry.tokens == tuple(tokens[:-1]) and entry.fingerprint == pc.fingerprint.digest
    parts = [frame.decode(cache.lookup(e.key, namespace=e.namespace).blob) for e in cache.entries()]
    if chunk_tokens:
        assert entry.kind == "llama.seq.tail"
        chunk_entries = [e for e in cache.entries() if chunkentries.is_chunk_namespace(e.namespace)]
        assert sorted(len(e.key) for e in chunk_entries) == [128, 256]
        assert {p.kind for p in parts} == {"llama.seq.tail", "llama.seq.chunk"}
    else:
        assert entry.kind == "llama.seq" and len(parts) == 1
    assert sum(p.payload_size for p in parts) < llama_cpp.llama_state_get_size(llm.ctx)  # a sequence, not the context


@pytest.mark.parametrize("chunk_tokens", [0, 128])
def test_checkpoints_and_min_tokens(make_llama, tiny_model, chunk_tokens) -> None:
    """Checkpoints every 256 tokens, then the prompt's end. Whole states keep them all; in
    chunks, the prompt's end supersedes them (restored and cut back, it gives each of them)."""
    cache = sippcache.open("ram://")
    options = dict(checkpoint_interval=256, min_tokens=8, chunk_tokens=chunk_tokens)
    with PrefixCache(make_llama(tiny_model), cache, **options) as pc:
        pc.prefill(prompt(1000))
        pc.prefill(prompt(5, seed=9))  # shorter than min_tokens: nothing stored
        pc.flush()
        assert pc.stats()["entries_written"] == 4
        states = sorted(len(e.key) for e in cache.entries() if not chunkentries.is_chunk_namespace(e.namespace))
    assert states == ([256, 512, 768, 999] if not chunk_tokens else [999])


def test_checkpoints_stay_within_half_the_budget(make_llama, tiny_model) -> None:
    llm = make_llama(tiny_model)
    cache = sippcache.open("ram://?max_bytes=2MiB")  # a 1,000-token state of the tiny model is ~0.5 MB
    with PrefixCache(llm, cache, checkpoint_interval=100) as pc:
        pc.prefill(prompt(1500))
        pc.flush()
        written = pc.stats()["entries_written"]
        keys = sorted(len(e.key) for e in cache.entries())
    assert keys[-1] == 1499  # the prompt-minus-one snapshot is always offered
    intermediate = [e.size for e in cache.entries() if len(e.key) != 1499]
    assert intermediate and sum(intermediate) <= 1024 * 1024
    assert written < 15  # not every 100 tokens: the budget stopped them


def test_bad_input(make_llama, tiny_model) -> None:
    llm = make_llama(tiny_model)
    with PrefixCache(llm, "ram://") as pc:
        with pytest.raises(ValueError, match="empty"):
            pc.prefill([])
        with pytest.raises(ValueError, match="position 1"):
            pc.prefill([1, -5])
        with pytest.raises(ValueError, match="n_ctx"):
            pc.prefill(prompt(3000))
    with pytest.raises(ValueError):
        PrefixCache(llm, "ram://", min_tokens=0)
    with pytest.raises(sippcache.UnknownBackend):
        PrefixCache(llm, "nosuch://")


def test_a_failing_store_never_fails_the_request(make_llama, tiny_model, caplog) -> None:
    tokens = prompt(200)
    cache = sippcache.open("ram://")
    llm = make_llama(tiny_model)
    whole, _ = reference_logits(make_llama, tiny_model, tokens)
    with PrefixCache(llm, cache) as pc:
        cache.close()  # every store now raises CacheClosed
        with caplog.at_level(logging.WARNING, logger="sippcache"):
            assert pc.prefill(tokens) == 0
            pc.flush()
        assert pc.stats()["write_failures"] == 1
        assert_close(last_logits(llm), whole)
    assert "could not store" in caplog.text


def test_restore_from_lmdb_is_zero_copy(make_llama, tiny_model, url, monkeypatch) -> None:
    """A whole entry is handed to llama.cpp as a view of LMDB's map (a chunked one is joined
    into one buffer first: tests/test_chunks.py)."""
    tokens = prompt(400)
    with PrefixCache(make_llama(tiny_model), url, chunk_tokens=0) as pc:
        pc.prefill(tokens)
    llm = make_llama(tiny_model)
    pc = PrefixCache(llm, url, chunk_tokens=0)
    blobs, pointers = [], []
    real_lookup, real_set = pc.cache.lookup, llama_cpp.llama_state_seq_set_data

    def lookup(*args, **kwargs):
        match = real_lookup(*args, **kwargs)
        if match is not None:
            assert isinstance(match.blob, memoryview)
            view = np.frombuffer(match.blob, dtype=np.uint8)
            blobs.append((view.ctypes.data, view.nbytes))
            del view
        return match

    def set_data(ctx, src, size, seq):
        pointers.append(ctypes_address(src))
        return real_set(ctx, src, size, seq)

    monkeypatch.setattr(pc.cache, "lookup", lookup)
    monkeypatch.setattr(llama_cpp, "llama_state_seq_set_data", set_data)
    assert pc.prefill(tokens) == 399
    pc.close()
    assert pointers and any(start < pointers[0] < start + size for start, size in blobs)


def ctypes_address(pointer) -> int:
    import ctypes

    return ctypes.cast(pointer, ctypes.c_void_p).value


@pytest.mark.parametrize("llama_class", [llama_cpp.Llama, SippLlama])
def test_llama_cache_drop_in(make_llama, tiny_model, url, llama_class) -> None:
    a, b = "The quick brown fox jumps over the lazy dog. " * 20, "Pack my box with five dozen liquor jugs. " * 20
    plain = make_llama(tiny_model)
    expected = {p: plain.create_completion(p, max_tokens=4, temperature=0.0)["choices"][0]["text"] for p in (a, b)}
    llm = make_llama(tiny_model, cls=llama_class)
    cache = LlamaCache(url).bind(llm)  # a plain llama_cpp.Llama's set_cache cannot bind it
    llm.set_cache(cache)
    for p in (a, b, a):
        assert llm.create_completion(p, max_tokens=4, temperature=0.0)["choices"][0]["text"] == expected[p]
    stats = cache.prefix_cache(llm).stats()
    # With sippcache's Llama the repeat restores the whole prompt with its logits; else all but the last token.
    whole = llama_class is SippLlama
    assert stats["hits"] == 1 and stats["logits_hits"] == int(whole)
    assert stats["tokens_reused"] == len(llm.tokenize(a.encode())) - (0 if whole else 1)
    cache.close()
    # a new process-like start: another model instance, same store
    again = make_llama(tiny_model, cls=llama_class)
    cache = LlamaCache(url, llm=again)
    again.set_cache(cache)
    assert again.create_completion(b, max_tokens=4, temperature=0.0)["choices"][0]["text"] == expected[b]
    assert cache.prefix_cache(again).stats()["hits"] == 1
    cache.close()


def test_llama_cache_serves_the_model_it_is_bound_to(make_llama, tiny_model, url) -> None:
    """llama-cpp-python's hook passes only tokens: a LlamaCache bound to a model serves it (the
    fast path); unbound, it keeps llama-cpp-python's own states (test_llama_dropin.py)."""
    text = "The quick brown fox jumps over the lazy dog. " * 10
    plain, other = make_llama(tiny_model), make_llama(tiny_model)
    unbound = LlamaCache(url)
    plain.set_cache(unbound)  # llama_cpp.Llama.set_cache cannot bind it: the whole-state fallback
    expected = plain.create_completion(text, max_tokens=2, temperature=0.0)["choices"][0]["text"]
    assert unbound.stats()["entries_written"] == 1
    with pytest.raises(RuntimeError, match=r"bind\(llm\)"):
        unbound.prefix_cache()  # the explicit API needs the model
    assert unbound.bind(plain) is unbound and unbound.bind(plain) is unbound  # binding again to it: fine
    assert unbound._prefix_cache is not None  # made when bound, not in the first request (issue 53)
    assert plain.create_completion(text, max_tokens=2, temperature=0.0)["choices"][0]["text"] == expected
    assert unbound.stats() == unbound.prefix_cache().stats()  # bound: the fast path's counters
    with pytest.raises(ValueError, match="one LlamaCache per model"):
        unbound.bind(other)
    with pytest.raises(ValueError, match="another model"):
        unbound.prefix_cache(other)
    assert unbound.prefix_cache(plain) is unbound.prefix_cache()
    unbound.close()
    sipp = make_llama(tiny_model, cls=SippLlama)
    bound = LlamaCache(url)
    sipp.set_cache(bound)  # sippcache's Llama binds it
    assert bound.prefix_cache().llm is sipp
    with pytest.raises(ValueError, match="one LlamaCache per model"):
        make_llama(tiny_model, cls=SippLlama).set_cache(bound)
    with pytest.raises(TypeError, match="llm must be"):
        LlamaCache(url, llm="model.gguf")  # type: ignore[arg-type]
    bound.close()


@pytest.mark.parametrize("llama_class", [llama_cpp.Llama, SippLlama])
def test_verbose_cache_lines_tell_the_truth(make_llama, tiny_model, url, llama_class, capsys) -> None:
    """llama-cpp-python prints "cache miss" on a KeyError and "cache hit" after loading
    what the cache answered. sippcache's Llama loads the answer by prefilling it, so
    "cache hit" means restored from the cache; a plain llama_cpp.Llama (which would load
    a copied state) finds the prompt already in its context and prints neither line."""
    text = "Pack my box with five dozen liquor jugs. " * 12

    def lines(llm: llama_cpp.Llama) -> list[str]:
        llm.create_completion(text, max_tokens=2, temperature=0.0)
        err = capsys.readouterr().err
        return [line for line in err.splitlines() if line.startswith("Llama._create_completion: cache")]

    first = make_llama(tiny_model, cls=llama_class, verbose=True)
    first.set_cache(LlamaCache(url, llm=first))
    assert lines(first)[:1] == ["Llama._create_completion: cache miss"]
    first.cache.close()
    again = make_llama(tiny_model, cls=llama_class, verbose=True)
    cache = LlamaCache(url, llm=again)
    again.set_cache(cache)
    said = lines(again)
    assert "Llama._create_completion: cache miss" not in said
    assert ("Llama._create_completion: cache hit" in said) == (llama_class is SippLlama)
    assert cache.prefix_cache().stats()["hits"] == 1
    cache.close()


def test_sipp_llama_save_state_has_no_scores(make_llama, tiny_model) -> None:
    llm = make_llama(tiny_model, cls=SippLlama)
    tokens = prompt(100)
    llm.eval(tokens)
    state = llm.save_state()
    assert state.scores.size == 0 and state.n_tokens == 100
    other = make_llama(tiny_model, cls=SippLlama)
    other.load_state(state)
    other.eval(prompt(10, seed=5)[1:])
    llm.eval(prompt(10, seed=5)[1:])
    np.testing.assert_array_equal(last_logits(other), last_logits(llm))
