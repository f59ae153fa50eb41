"""The llama-cpp-python layer restores a stored state only where it beats computing (`restore="auto"`):
decided from llama.cpp's own prefill timings and the restores done (`sippcache.rates`). Here the rates
are preset to each side of the rule, and what llama.cpp evaluated (its own counters) shows which way
it went; the logits are the never-cached path's either way."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sippcache.llama import CacheOptions, PrefixCache
from sippcache.rates import MODE_ENVIRONMENT_VARIABLE, mode_from_environment
from tests.llama_tools import last_logits, reference_logits, start_counting, tokens_evaluated


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


def stored(make_llama: Any, model: Path, url: str, tokens: list[int]) -> None:
    with PrefixCache(make_llama(model), url) as first:
        first.prefill(tokens)


def preset(cache: PrefixCache, *, restore_seconds: float, prefill_seconds_a_token: float) -> None:
    """What earlier requests would have measured: a 600-token state of 300 KB loading in
    `restore_seconds`, and 1,000 computed tokens at `prefill_seconds_a_token`."""
    cache.rates.record_size("", 600, 300_000)
    cache.rates.record_restore("", nbytes=300_000, seconds=restore_seconds, tokens=600)
    cache.rates.record_prefill("", 1000, 1000 * prefill_seconds_a_token)


@pytest.mark.parametrize("faster", ["restoring", "computing"])
def test_auto_restores_only_where_restoring_is_faster(
    make_llama: Any, tiny_model: Path, tmp_path: Path, faster: str
) -> None:
    url, tokens = f"lmdb://{tmp_path}/store", prompt(600)
    stored(make_llama, tiny_model, url, tokens)
    query = tokens + prompt(20, seed=1)[1:]
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url, restore="auto") as cache:
        if faster == "restoring":
            preset(cache, restore_seconds=0.001, prefill_seconds_a_token=0.01)
        else:
            preset(cache, restore_seconds=10.0, prefill_seconds_a_token=1e-6)
        start_counting(llm.ctx)
        reused = cache.prefill(query)
        evaluated, stats = tokens_evaluated(llm.ctx), cache.stats()
    if faster == "restoring":
        assert reused >= 599 and evaluated == len(query) - reused and stats["hits"] == 1
        assert stats["restores_skipped"] == 0
    else:
        assert reused == 0 and evaluated == len(query) and stats["hits"] == 0
        assert stats["restores_skipped"] == stats["skipped_slower_than_prefill"] == 1
    if reused:
        _, split = reference_logits(make_llama, tiny_model, query, (reused,))
        np.testing.assert_array_equal(last_logits(llm), split)
    else:  # the never-cached path: the same prefill on an empty store
        cold = make_llama(tiny_model)
        with PrefixCache(cold, "ram://") as empty:
            empty.prefill(query)
        np.testing.assert_array_equal(last_logits(llm), last_logits(cold))


def test_never_stores_but_does_not_restore(make_llama: Any, tiny_model: Path, tmp_path: Path) -> None:
    url, tokens = f"lmdb://{tmp_path}/store", prompt(300)
    with PrefixCache(make_llama(tiny_model), url, restore="never") as cache:
        cache.prefill(tokens)
        cache.flush()
        assert cache.stats()["entries_written"] == 1
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url, restore="never") as cache:
        start_counting(llm.ctx)
        assert cache.prefill(tokens) == 0
        assert tokens_evaluated(llm.ctx) == len(tokens)
        assert cache.stats()["skipped_never"] == 1


def test_nothing_measured_restores(make_llama: Any, tiny_model: Path, tmp_path: Path) -> None:
    """A new process knows no rates yet: it restores, and that restore teaches it."""
    url, tokens = f"lmdb://{tmp_path}/store", prompt(300)
    stored(make_llama, tiny_model, url, tokens)
    with PrefixCache(make_llama(tiny_model), url, restore="auto") as cache:
        assert cache.prefill(tokens) == 299
        measured = cache.rates.measured("")
    assert measured.restore_samples == 1


def test_the_mode_comes_from_the_environment_where_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENVIRONMENT_VARIABLE, "never")
    assert mode_from_environment() == "never"
    monkeypatch.delenv(MODE_ENVIRONMENT_VARIABLE)
    assert mode_from_environment() == "auto"
    monkeypatch.setenv(MODE_ENVIRONMENT_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="SIPPCACHE_RESTORE='sometimes'"):
        mode_from_environment()
    with pytest.raises(ValueError, match="restore must be one of auto, always, never"):
        CacheOptions(restore="sometimes")  # type: ignore[arg-type]
