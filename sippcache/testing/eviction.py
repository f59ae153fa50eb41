"""Staying within `max_bytes` and `max_entries`: the eviction order (superseded
entries first, then priority, then recency) and refusing what can never fit.
"""

from __future__ import annotations

import logging
import random

import pytest

from sippcache import CacheBackend

from .fixtures import BackendFixtures, Opener, blob_of


class EvictionTests(BackendFixtures):
    """Budgets hold, and the right entry goes when one must."""

    def test_max_bytes_evicts_least_recently_used(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i], bytes(1000))  # 1004 bytes each with the key
        assert blob_of(cache.lookup([0])) is not None  # entry 0 becomes the most recent
        cache.store([3], bytes(1000))
        assert cache.lookup([1]) is None  # the least recently used went
        for i in (0, 2, 3):
            assert cache.lookup([i]) is not None
        stats = cache.stats()
        assert stats.entries == 3 and stats.bytes <= 3500 and stats.evictions >= 1

    def test_lookup_without_touch_leaves_recency_alone(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i], bytes(1000))
        assert blob_of(cache.lookup([0], touch=False)) is not None
        cache.store([3], bytes(1000))
        assert cache.lookup([0]) is None and cache.lookup([1]) is not None
        assert [tuple(e.key) for e in cache.entries()][-1] == (1,)

    def test_byte_budget_holds_under_churn(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=20_000)
        rng = random.Random(3)
        for i in range(300):
            cache.store([rng.randrange(50), i], bytes(rng.randrange(1, 3000)))
            if i % 7 == 0:
                cache.lookup([rng.randrange(50)], partial=True)
            assert cache.stats().bytes <= 20_000
        assert len(cache) > 0

    def test_oversized_entry_refused_without_evicting(
        self, open_cache: Opener, caplog: pytest.LogCaptureFixture
    ) -> None:
        cache = open_cache(max_bytes=10_000)
        cache.store([1], bytes(3000))
        cache.store([2], bytes(3000))
        with caplog.at_level(logging.WARNING, logger="sippcache"):
            cache.store([3], bytes(10_000))
        assert "max_bytes" in caplog.text
        assert cache.lookup([3]) is None
        assert cache.lookup([1]) is not None and cache.lookup([2]) is not None
        assert len(cache) == 2 and cache.stats().refused == 1

    def test_max_entries(self, open_cache: Opener) -> None:
        cache = open_cache(max_entries=5)
        for i in range(8):
            cache.store([i], b"x")
        assert len(cache) == 5
        assert cache.lookup([2]) is None and cache.lookup([3]) is not None

    def test_default_priority_is_the_token_count(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3], b"x")
        cache.store([4], b"y", priority=7.5)
        info = {tuple(e.key): e for e in cache.entries()}
        assert info[(1, 2, 3)].priority == 3 and info[(4,)].priority == 7.5
        assert not info[(1, 2, 3)].pinned

    def test_lowest_priority_is_evicted_first(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)  # room for three 1,004-byte entries
        for key, priority in (([1], 30), ([2], 10), ([3], 20)):
            cache.store(key, bytes(1000), priority=priority)
        cache.store([4], bytes(1000), priority=40)
        assert cache.lookup([2], touch=False) is None
        cache.store([5], bytes(1000), priority=40)
        assert cache.lookup([3], touch=False) is None
        assert all(cache.lookup([k], touch=False) is not None for k in (1, 4, 5))
        assert cache.stats().evictions == 2

    def test_equal_priorities_evict_least_recently_used(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i], bytes(1000), priority=5)
        assert blob_of(cache.lookup([0])) is not None
        cache.store([3], bytes(1000), priority=5)
        assert cache.lookup([1], touch=False) is None
        assert all(cache.lookup([k], touch=False) is not None for k in (0, 2, 3))

    def test_touch_counts_as_a_use(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i, i], bytes(1000))
        assert cache.touch([0, 0]) is True
        assert cache.touch([0]) is False and cache.touch([0, 0, 0]) is False  # exactly the key, or nothing
        assert cache.touch([0, 0], namespace="other") is False and cache.touch([]) is False
        assert (cache.stats().hits, cache.stats().misses) == (0, 0)  # a touch is not a lookup
        cache.store([3, 3], bytes(1000))
        assert cache.lookup([1, 1], touch=False) is None
        assert cache.lookup([0, 0], touch=False) is not None

    def test_superseded_entry_goes_first(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=4 * 1100)  # room for four entries of 1,000 + 4 * 20 bytes
        old = list(range(100, 120))
        cache.store(list(range(500, 520)), bytes(1000))  # the oldest
        cache.store(old, bytes(1000))
        cache.store(old[:15] + list(range(600, 605)), bytes(1000))  # shares 15 of old's 20 tokens
        cache.store(list(range(700, 720)), bytes(1000))
        cache.store(list(range(800, 820)), bytes(1000))  # over budget: `old` goes, not the oldest
        assert cache.lookup(old, touch=False) is None
        assert cache.lookup(list(range(500, 520)), touch=False) is not None

    def test_a_use_clears_supersession(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=4 * 1100)
        old = list(range(100, 120))
        cache.store(list(range(500, 520)), bytes(1000))
        cache.store(old, bytes(1000))
        cache.store(old + [1, 2, 3], bytes(1000))  # the next turn: supersedes `old`
        assert blob_of(cache.lookup(old + [9])) is not None  # used again: valuable again
        cache.store(list(range(700, 720)), bytes(1000))
        cache.store(list(range(800, 820)), bytes(1000))
        assert cache.lookup(old, touch=False) is not None
        assert cache.lookup(list(range(500, 520)), touch=False) is None

    def test_a_shorter_entry_supersedes_nothing(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3 * 1100)
        cache.store(list(range(500, 520)), bytes(1000))
        cache.store(list(range(100, 120)), bytes(1000))
        cache.store(list(range(100, 110)), bytes(1040))  # a checkpoint inside the entry above
        cache.store(list(range(700, 720)), bytes(1000))
        assert cache.lookup(list(range(500, 520)), touch=False) is None  # plain LRU
        assert cache.lookup(list(range(100, 120)), touch=False) is not None
