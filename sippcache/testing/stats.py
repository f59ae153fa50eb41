"""What a store reports about itself: `stats()` counters and the `entries()` listing."""

from __future__ import annotations

import time

from sippcache import CacheBackend

from .fixtures import BackendFixtures, blob_of


class StatsTests(BackendFixtures):
    """`stats()` and `entries()` agree with the operations done."""

    def test_stats_counts(self, cache: CacheBackend) -> None:
        cache.store([1, 2], b"abc")
        blob_of(cache.lookup([1, 2, 3]))
        assert cache.lookup([9]) is None
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.hits, stats.misses, stats.stores) == (1, 3 + 8, 1, 1, 1)

    def test_entries_lists_every_entry_least_recently_used_first(self, cache: CacheBackend) -> None:
        before = time.time()
        cache.store([1, 2], b"aa", namespace="x")
        cache.store([3], b"bbb", namespace="y")
        cache.store([4, 5, 6], b"c", namespace="x")
        assert cache.lookup([1, 2], namespace="x") is not None  # now the most recent
        listed = list(cache.entries())
        assert [(e.namespace, tuple(e.key), e.size) for e in listed] == [
            ("y", (3,), 3 + 4),
            ("x", (4, 5, 6), 1 + 12),
            ("x", (1, 2), 2 + 8),
        ]
        assert all(before - 1 <= e.created <= e.last_used <= time.time() + 1 for e in listed)
        assert [tuple(e.key) for e in cache.entries(namespace="x")] == [(4, 5, 6), (1, 2)]
        assert list(cache.entries(namespace="nobody")) == []
