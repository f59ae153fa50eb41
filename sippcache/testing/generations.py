"""Generations: an entry is never replaced by one computed earlier."""

from __future__ import annotations

import time

from sippcache import CacheBackend

from .fixtures import BackendFixtures, blob_of


class GenerationTests(BackendFixtures):
    """The `generation` store option and its default, the time of the store."""

    def test_an_older_generation_never_replaces_a_newer_one(self, cache: CacheBackend) -> None:
        assert cache.store([1, 2], b"newer", generation=20) is True
        assert cache.store([1, 2], b"older", generation=10) is False
        assert blob_of(cache.lookup([1, 2])) == b"newer"
        assert next(iter(cache.entries())).generation == 20
        assert cache.stats().stale == 1
        assert cache.store([1, 2], b"newest", generation=30) is True
        assert blob_of(cache.lookup([1, 2])) == b"newest"
        assert cache.store([1, 2], b"same generation", generation=30) is True  # ties replace

    def test_default_generation_is_the_time_of_the_store(self, cache: CacheBackend) -> None:
        before = time.time_ns()
        cache.store([1], b"x")
        assert before <= next(iter(cache.entries())).generation <= time.time_ns()
        assert cache.store([1], b"from the past", generation=before - 10**9) is False
