"""The llama-cpp-python layer restores a stored state only where it beats computing (`restore="auto"`):
decided from llama.cpp's own prefill timings and the restores done (`sippcache.state.rates`). Here the rates
are preset to each side of the rule, and what llama.cpp evaluated (its own counters) shows which way
it went; the logits are the never-cached path's either way."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.llama_tools import last_logits, reference_logits, start_counting, tokens_evaluated
from sippcache.llama import CacheOptions, PrefixCache, seqcache
from sippcache.state.rates import MODE_ENVIRONMENT_VARIABLE, RATES_DIR_ENVIRONMENT_VARIABLE, mode_from_environment


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


# -- rates kept across processes --------------------------------------------------------------------


def test_a_restarted_process_decides_from_the_rates_kept_before(
    make_llama: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """The rates a cache measured are written to `rates_dir` when it closes; the next cache with the
    same model, settings and store starts from them: kept rates that say restores are slow decline
    the restore a fresh process would have done blindly, and the logits are the never-cached path's."""
    url, tokens, rates_dir = f"lmdb://{tmp_path}/store", prompt(600), tmp_path / "rates"
    stored(make_llama, tiny_model, url, tokens)
    with PrefixCache(make_llama(tiny_model), url, restore="auto", rates_dir=rates_dir) as first:
        preset(first, restore_seconds=10.0, prefill_seconds_a_token=1e-6)
        path = first.rates_path
    assert path is not None and Path(path).parent == rates_dir and Path(path).is_file()
    query = tokens + prompt(20, seed=1)[1:]
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url, restore="auto", rates_dir=rates_dir) as second:
        assert second.rates_path == path
        assert second.rates.measured("").restore_samples == 1
        start_counting(llm.ctx)
        assert second.prefill(query) == 0
        assert tokens_evaluated(llm.ctx) == len(query)
        assert second.stats()["skipped_slower_than_prefill"] == 1
    cold = make_llama(tiny_model)
    with PrefixCache(cold, "ram://") as empty:
        empty.prefill(query)
    np.testing.assert_array_equal(last_logits(llm), last_logits(cold))

    # Without the kept rates the same process restores (nothing measured yet).
    with PrefixCache(make_llama(tiny_model), url, restore="auto", rates_dir="") as forgot:
        assert forgot.rates_path is None
        assert forgot.prefill(query) >= 599


def test_rates_are_kept_apart_by_what_sets_the_speed(make_llama: Any, tiny_model: Path, tmp_path: Path) -> None:
    """Another thread count, or another store, is another place: its rates are its own."""
    rates_dir = tmp_path / "rates"
    paths = set()
    for url, threads in (("ram://", 1), ("ram://", 2), (f"lmdb://{tmp_path}/store", 1)):
        with PrefixCache(make_llama(tiny_model, n_threads=threads), url, rates_dir=rates_dir) as cache:
            paths.add(cache.rates_path)
            assert cache.rates.largest_state("") is None  # nothing kept for this place yet
            cache.prefill(prompt(300))  # its state taken: its size is a sample
            assert cache.rates.largest_state("") is not None
    assert len(paths) == 3 and {Path(p).name for p in paths} == {p.name for p in rates_dir.iterdir()}
    with PrefixCache(make_llama(tiny_model, n_threads=2), "ram://", rates_dir=rates_dir) as again:
        assert again.rates.largest_state("") is not None


def test_the_rates_folder_comes_from_the_environment_where_none_is_given(
    make_llama: Any, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RATES_DIR_ENVIRONMENT_VARIABLE, str(tmp_path / "here"))
    with PrefixCache(make_llama(tiny_model), "ram://") as cache:
        cache.prefill(prompt(300))
        path = cache.rates_path
    assert path is not None and Path(path).parent == tmp_path / "here" and Path(path).is_file()
    monkeypatch.setenv(RATES_DIR_ENVIRONMENT_VARIABLE, "")  # '': not kept
    with PrefixCache(make_llama(tiny_model), "ram://") as cache:
        assert cache.rates_path is None
    with pytest.raises(TypeError, match="rates_dir must be a str or a path, not int"):
        CacheOptions(rates_dir=3)  # type: ignore[arg-type]


def test_the_join_buffer_is_made_ahead_for_the_largest_state_kept(
    make_llama: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """A new process whose kept rates saw states here makes its join buffer for the largest of
    them at start (pages made in a helper thread): its first restore from chunks joins into it,
    and computes what the never-cached path does."""
    url, tokens, rates_dir = f"lmdb://{tmp_path}/store", prompt(600), tmp_path / "rates"
    with PrefixCache(make_llama(tiny_model), url, rates_dir=rates_dir) as first:
        assert first._states._joins.ahead is None  # nothing kept yet
        first.prefill(tokens)
        first.flush()
        largest = first.rates.largest_state("")
        # A state this large was snapshotted: its join buffer is made ahead for this process too.
        assert largest is not None and first._states._ahead_for == largest
        assert first.rates.measured("").save_samples == 1  # stored whole (all new): its time prices restores
    assert largest is not None
    query = tokens + prompt(20, seed=1)[1:]
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url, rates_dir=rates_dir) as second:
        ahead = second._states._joins.ahead
        assert ahead is not None
        made = ahead.result(60)
        assert len(made) == largest
        reused = second.prefill(query).restored
        assert reused >= 599 and second._states._joins.buffer is made  # joined into the buffer made ahead
    _, split = reference_logits(make_llama, tiny_model, query, (reused,))
    np.testing.assert_array_equal(last_logits(llm), split)
    with PrefixCache(make_llama(tiny_model), url, rates_dir="") as unkept:
        assert unkept._states._joins.ahead is None


def test_a_join_buffer_that_cannot_be_made_ahead_costs_nothing_but_its_gain(
    make_llama: Any, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Making the buffer ahead fails (no memory for it): logged, and the first restore makes its own."""
    url, tokens, rates_dir = f"lmdb://{tmp_path}/store", prompt(600), tmp_path / "rates"
    with PrefixCache(make_llama(tiny_model), url, rates_dir=rates_dir) as first:
        first.prefill(tokens)
    made = seqcache._anonymous

    def no_memory(nbytes: int, *, populate: bool = False, room: int = 0) -> Any:
        if populate:
            raise MemoryError("no room")
        return made(nbytes, room=room)

    monkeypatch.setattr(seqcache, "_anonymous", no_memory)
    query = tokens + prompt(20, seed=1)[1:]
    llm = make_llama(tiny_model)
    with PrefixCache(llm, url, rates_dir=rates_dir) as second:
        assert second._states._joins.ahead is not None
        reused = second.prefill(query).restored
        assert reused >= 599
    assert "the join buffer made ahead failed: no room" in caplog.text
    _, split = reference_logits(make_llama, tiny_model, query, (reused,))
    np.testing.assert_array_equal(last_logits(llm), split)
