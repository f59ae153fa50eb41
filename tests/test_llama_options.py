"""`CacheOptions`: one checked value for every llama.cpp layer constructor."""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

import sippcache
from sippcache.llama import CacheOptions, LlamaCache, PrefixCache, Sampling, SessionPool, seqcache
from sippcache.llama import Llama as SippLlama
from sippcache.llama.batch import BatchEngine, Job
from sippcache.llama.checkpoints import checkpoint_positions
from sippcache.llama.fingerprint import llama_fingerprint
from sippcache.llama.options import FIELDS, MAX_SCOPE_BYTES, CacheSettings
from sippcache.llama.seqcache import Restored, SequenceCache, check_prompt
from sippcache.llama.states import MemoryKind


def test_defaults() -> None:
    options = CacheOptions()
    assert (options.scope, options.min_tokens, options.checkpoint_interval, options.max_pending_writes) == (
        "default",
        16,
        2048,
        4,
    )
    assert options.secret is None and options.restore is None  # None: $SIPPCACHE_RESTORE, else "auto"
    assert options.chunk_tokens == 64
    assert options.rates_dir is None  # None: $SIPPCACHE_RATES_DIR, else rates/ in the user cache
    assert FIELDS == (
        "scope",
        "min_tokens",
        "checkpoint_interval",
        "max_pending_writes",
        "secret",
        "restore",
        "chunk_tokens",
        "rates_dir",
    )
    assert set(CacheSettings.__annotations__) == set(FIELDS), "the keyword form lists exactly the fields"


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(scope=5), TypeError, "scope must be a str, not int"),
        (dict(scope=None), TypeError, "scope must be a str, not NoneType"),
        (dict(scope="x" * (MAX_SCOPE_BYTES + 1)), ValueError, f"scope must be at most {MAX_SCOPE_BYTES} bytes"),
        (dict(scope="bad \ud800"), ValueError, "scope must be valid text"),
        (dict(min_tokens=0), ValueError, "min_tokens must be at least 1, got 0"),
        (dict(min_tokens="16"), TypeError, "min_tokens must be an int, not str"),
        (dict(min_tokens=True), TypeError, "min_tokens must be an int, not bool"),
        (dict(min_tokens=16.0), TypeError, "min_tokens must be an int, not float"),
        (dict(checkpoint_interval=-1), ValueError, "checkpoint_interval must be at least 1, got -1"),
        (dict(checkpoint_interval=None), TypeError, "checkpoint_interval must be an int, not NoneType"),
        (dict(max_pending_writes=0), ValueError, "max_pending_writes must be at least 1, got 0"),
        (dict(max_pending_writes="4"), TypeError, "max_pending_writes must be an int, not str"),
        (dict(secret=b""), TypeError, "secret must be a non-empty str or bytes, not an empty value"),
        (dict(secret=""), TypeError, "secret must be a non-empty str or bytes, not an empty value"),
        (dict(secret=42), TypeError, "secret must be a non-empty str or bytes, not int"),
        (dict(chunk_tokens=-1), ValueError, "chunk_tokens must be at least 0 (0: whole states), got -1"),
        (dict(chunk_tokens=True), TypeError, "chunk_tokens must be an int, not bool"),
        (dict(chunk_tokens="128"), TypeError, "chunk_tokens must be an int, not str"),
    ],
)
def test_each_bad_value_is_refused_naming_the_option(changes: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        CacheOptions(**changes)
    with pytest.raises(error, match=re.escape(message)):  # a copy is checked as a new value is
        CacheOptions().replace(**changes)


def test_frozen_hashable_and_the_secret_stays_out_of_repr() -> None:
    options = CacheOptions(scope="tenant-a", secret="hunter2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.scope = "tenant-b"  # type: ignore[misc]
    assert options == CacheOptions(scope="tenant-a", secret="hunter2")
    assert len({options, CacheOptions(scope="tenant-a", secret="hunter2")}) == 1
    assert "hunter2" not in repr(options) and "tenant-a" in repr(options)
    assert options.replace(min_tokens=8) == CacheOptions(scope="tenant-a", min_tokens=8, secret="hunter2")


def test_build_takes_options_or_keywords_not_both() -> None:
    options = CacheOptions(scope="a")
    assert CacheOptions.build(options, {}) is options
    assert CacheOptions.build(None, {"scope": "a"}) == options
    assert CacheOptions.build(None, {}) == CacheOptions()
    with pytest.raises(TypeError, match="not both"):
        CacheOptions.build(options, {"min_tokens": 8})
    with pytest.raises(TypeError, match=r"'scop'.*cache options: scope, min_tokens"):
        CacheOptions.build(None, {"scop": "a"})
    with pytest.raises(TypeError, match="options must be a CacheOptions, not dict"):
        CacheOptions.build({"scope": "a"}, {})  # type: ignore[arg-type]


# -- every constructor takes the value --------------------------------------------------------


def test_prefix_cache_takes_options_or_keywords(make_llama, tiny_model: Path) -> None:
    llm = make_llama(tiny_model, n_ctx=256)
    options = CacheOptions(scope="tenant-a", min_tokens=8, checkpoint_interval=64, max_pending_writes=2)
    with PrefixCache(llm, "ram://", options=options) as pc:
        assert pc.options is options and pc._states.options is options
        assert (pc.scope, pc.min_tokens, pc.checkpoint_interval) == ("tenant-a", 8, 64)
        assert pc.namespace.endswith("/tenant-a")
        assert pc._states._writer._max_pending == 2
    with PrefixCache(llm, "ram://", scope="tenant-a", min_tokens=8, checkpoint_interval=64, max_pending_writes=2) as pc:
        assert pc.options == options
    with pytest.raises(TypeError, match="not both"):
        PrefixCache(llm, "ram://", options=options, scope="tenant-b")
    with pytest.raises(TypeError, match="'scop'"):
        PrefixCache(llm, "ram://", scop="tenant-b")  # type: ignore[call-arg]


def test_llama_cache_takes_options_and_honours_max_pending_writes(make_llama, tiny_model: Path) -> None:
    """`LlamaCache` had no `max_pending_writes`: now every option reaches its `PrefixCache`."""
    llm = make_llama(tiny_model, cls=SippLlama, n_ctx=256)
    cache = LlamaCache("ram://", llm=llm, max_pending_writes=1, scope="s", secret="k", checkpoint_interval=32)
    try:
        assert cache.options == CacheOptions(scope="s", max_pending_writes=1, secret="k", checkpoint_interval=32)
        prefix_cache = cache.prefix_cache(llm)
        assert prefix_cache.options is cache.options
        assert prefix_cache._states._writer._max_pending == 1
        assert prefix_cache._states.secret == b"k"
    finally:
        cache.close()
    options = CacheOptions(max_pending_writes=3)
    cache = LlamaCache("ram://", llm=llm, options=options)
    try:
        assert cache.prefix_cache(llm)._states._writer._max_pending == 3
    finally:
        cache.close()
    with pytest.raises(TypeError, match="not both"):
        LlamaCache("ram://", options=options, max_pending_writes=2)
    with pytest.raises(ValueError, match="max_pending_writes must be at least 1"):
        LlamaCache("ram://", max_pending_writes=0)


def test_session_pool_takes_options_and_passes_other_keywords_to_llama(tiny_model: Path) -> None:
    options = CacheOptions(scope="pool", min_tokens=8, max_pending_writes=2)
    with SessionPool(tiny_model, "ram://", slots=1, options=options) as pool:
        assert pool.options is options and pool._states.options is options
        assert pool.namespace.endswith("/pool") and pool._states._writer._max_pending == 2
    # The fields as keywords build the options; any other keyword is a llama option.
    with SessionPool(
        tiny_model, "ram://", slots=1, scope="pool", min_tokens=8, max_pending_writes=2, n_threads=1
    ) as pool:
        assert pool.options == options
        assert pool.llm.n_threads == 1
    with pytest.raises(TypeError, match="not both"):
        SessionPool(tiny_model, "ram://", options=options, scope="other")


def test_session_pool_refuses_bad_options_before_loading_the_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_interval must be at least 1"):
        SessionPool(tmp_path / "no-such-model.gguf", f"lmdb://{tmp_path / 'store'}", checkpoint_interval=0)
    assert list(tmp_path.iterdir()) == []


def test_sequence_cache_takes_options(tiny_model: Path) -> None:
    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=64, verbose=False)
    try:
        common = dict(fingerprint=llama_fingerprint(llm), kind=MemoryKind(), n_vocab=llm.n_vocab())
        cache = SequenceCache("ram://", **common)  # type: ignore[arg-type]
        assert cache.options == CacheOptions() and cache.namespace.endswith("/default")
        cache.close()
        options = CacheOptions(scope="seq", min_tokens=4)
        cache = SequenceCache("ram://", options=options, **common)  # type: ignore[arg-type]
        assert cache.options is options and cache.min_tokens == 4 and cache.namespace.endswith("/seq")
        cache.close()
        with pytest.raises(TypeError, match="options must be a CacheOptions"):
            SequenceCache("ram://", options={"scope": "x"}, **common)  # type: ignore[arg-type]
    finally:
        llm.close()


# -- one token check ------------------------------------------------------------------------------


def test_check_prompt() -> None:
    assert check_prompt([1, 2, 3], 10) == [1, 2, 3]
    assert check_prompt(np.array([4, 5], dtype=np.int64), 10) == [4, 5]
    with pytest.raises(ValueError, match="cannot run an empty prompt"):
        check_prompt([], 10)
    with pytest.raises(ValueError, match=re.escape("token id 12 at position 2 is outside the vocabulary (n_vocab=10)")):
        check_prompt([1, 2, 12, 13], 10)
    with pytest.raises(ValueError, match="position 1"):
        check_prompt([1, -5], 10)
    with pytest.raises(TypeError):
        check_prompt("hello", 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^session 'a': token at position 1 is float"):
        check_prompt([1, 2.5], 10, what="session 'a': ")  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^session 'a': cannot run an empty prompt"):
        check_prompt([], 10, what="session 'a': ")


def test_prefix_cache_pool_and_engine_check_tokens_alike(make_llama, tiny_model: Path) -> None:
    """The same check, so the same message: the position of the first id outside the vocabulary."""
    llm = make_llama(tiny_model, n_ctx=256)
    n_vocab = llm.n_vocab()
    bad = [1, 2, n_vocab + 3, 4]
    expected = re.escape(f"token id {n_vocab + 3} at position 2 is outside the vocabulary (n_vocab={n_vocab})")
    with PrefixCache(llm, "ram://") as pc, pytest.raises(ValueError, match=expected):
        pc.prefill(bad)
    with SessionPool(llm, "ram://", slots=1) as pool:
        with pytest.raises(ValueError, match="^session 'a': " + expected):
            pool.generate({"a": bad})
        engine = pool._engine
        assert engine is not None
        with pytest.raises(ValueError, match="^" + expected):
            engine.check(Job(bad, None, 4))
        with pytest.raises(ValueError, match="cannot run an empty prompt"):
            engine.check(Job([], None, 4))


# -- one checkpoint plan ------------------------------------------------------------------------


def test_checkpoint_positions() -> None:
    plan = functools.partial(checkpoint_positions, interval=64, min_tokens=16)
    assert plan(0, 0, 200) == [64, 128, 192]
    assert plan(0, 0, 192) == [64, 128]  # the end is the final snapshot, not a checkpoint
    assert plan(70, 0, 200) == [128, 192]  # from a restored prefix on
    assert plan(0, 100, 200) == [64, 96, 128, 192]  # where the prompt leaves a stored entry, aligned to 32
    assert plan(0, 40, 200) == [32, 64, 128, 192]  # 40 aligned down to 32
    assert plan(0, 20, 200) == [64, 128, 192]  # 20 aligned down to 0: no branch checkpoint
    assert plan(40, 40, 200) == [64, 128, 192]  # a branch before the start: none
    assert checkpoint_positions(0, 40, 200, interval=64, min_tokens=33) == [64, 128, 192]  # 32 < min_tokens
    assert plan(0, 0, 200) == checkpoint_positions(0, 0, 200, interval=64, min_tokens=1)
    assert checkpoint_positions(0, 0, 200, interval=64, min_tokens=100) == [128, 192]
    assert checkpoint_positions(0, 0, 5000, interval=2048, min_tokens=16) == [2048, 4096]


def test_adapter_pool_and_engine_follow_one_checkpoint_plan(
    make_llama, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold prompt of 200 tokens, checkpoints every 64: each path stores the plan's
    checkpoints and the whole prompt (with its logits), and each got them from one function.
    (Whole states: in chunks the prompt's end supersedes the checkpoints: test_llama_tiny.py.)"""
    calls: list[str] = []
    plan = seqcache.checkpoint_positions

    def spy(*args: Any, **kwargs: Any) -> list[int]:
        calls.append(caller)
        return plan(*args, **kwargs)

    monkeypatch.setattr(seqcache, "checkpoint_positions", spy)
    options = CacheOptions(checkpoint_interval=64, min_tokens=16, chunk_tokens=0)
    tokens = [1] + [random.Random(7).randrange(3, 250) for _ in range(199)]
    expected = [*plan(0, 0, 200, interval=64, min_tokens=16), 200]
    assert expected == [64, 128, 192, 200]
    llm = make_llama(tiny_model, cls=SippLlama, n_ctx=512)

    caller = "adapter"
    store = sippcache.open("ram://")
    with PrefixCache(llm, store, options=options) as pc:
        pc.prefill(tokens)
    assert sorted(len(e.key) for e in store.entries()) == expected

    caller = "pool"
    store = sippcache.open("ram://")
    with SessionPool(llm, store, slots=1, options=options, park_on_close=False) as pool:
        pool.generate({"a": tokens}, max_tokens=1)
    assert sorted(len(e.key) for e in store.entries()) == expected

    caller = "engine"
    store = sippcache.open("ram://")
    cache = SequenceCache(
        store, fingerprint=llama_fingerprint(llm), kind=MemoryKind(), n_vocab=llm.n_vocab(), options=options
    )
    engine = BatchEngine(llm, cache, slots=1, n_ctx=512, chunk=128)
    chain = Sampling().chain(llm.n_vocab())
    try:
        job = Job(tokens, chain, 1)
        engine.submit(job)
        while job.state != "done":
            engine.step()
        cache.flush()
    finally:
        engine.free()
        cache.close()
        llama_cpp.llama_sampler_free(chain)
    assert sorted(len(e.key) for e in store.entries()) == expected
    assert calls == ["adapter", "pool", "engine"]


# -- what a restore loaded --------------------------------------------------------------------


def test_restore_says_what_it_loaded(make_llama, tiny_model: Path) -> None:
    """`SequenceCache.restore` answers a `Restored`: the tokens the sequence holds, and the
    stored logits only when asked for (it used to answer the logits, or True)."""
    tokens = [1] + [random.Random(3).randrange(3, 250) for _ in range(59)]
    store = sippcache.open("ram://")
    with PrefixCache(make_llama(tiny_model, cls=SippLlama, n_ctx=256), store) as pc:
        pc.prefill(tokens)
    llm = make_llama(tiny_model, cls=SippLlama, n_ctx=256)
    cache = SequenceCache(store, fingerprint=llama_fingerprint(llm), kind=MemoryKind(), n_vocab=llm.n_vocab())
    try:
        for with_logits, length in ((True, 60), (False, 60), (False, 40)):
            found = cache.lookup(tokens, partial=False)
            assert found is not None
            with found:
                restored = cache.restore(llm.ctx, 0, found, length, with_logits=with_logits)
            assert isinstance(restored, Restored) and restored.length == length
            if with_logits:
                assert restored.logits is not None and restored.logits.shape == (llm.n_vocab(),)
            else:
                assert restored.logits is None
    finally:
        cache.close()
