"""Pinned entries: never evicted, counted against the budgets, refused beyond them."""

from __future__ import annotations

import pytest

import sippcache
from sippcache import CacheBackend

from .fixtures import BackendFixtures, Opener, blob_of


class PinTests(BackendFixtures):
    """`pinned=True`, `pin` and `unpin`."""

    def test_pinned_entry_survives_a_flood(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=20_000)
        system = list(range(1000, 1500))  # 500 tokens: 2,000 key bytes + 1,000 blob bytes
        assert cache.store(system, b"s" * 1000, pinned=True)
        for i in range(400):  # 400 kB of one-off prompts through a 20 kB budget
            cache.store([i, i + 1, i + 2], bytes(1000))
            assert cache.stats().bytes <= 20_000
        assert blob_of(cache.lookup(system + [7])) == b"s" * 1000
        entry = next(e for e in cache.entries() if tuple(e.key) == tuple(system))
        assert entry.pinned
        stats = cache.stats()
        assert (stats.pinned, stats.pinned_bytes) == (1, 3000) and stats.evictions > 300

    def test_pin_and_unpin(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        cache.store([1], bytes(1000))
        assert cache.pin([1]) is True
        assert cache.pin([1]) is True  # already pinned
        assert cache.pin([9]) is False and cache.unpin([9]) is False
        assert cache.pin([1], namespace="other") is False
        for i in range(2, 10):
            cache.store([i], bytes(1000))
        assert cache.lookup([1], touch=False) is not None
        assert cache.unpin([1]) is True
        assert not next(e for e in cache.entries() if tuple(e.key) == (1,)).pinned
        for i in range(10, 14):
            cache.store([i], bytes(1000))
        assert cache.lookup([1], touch=False) is None
        assert cache.stats().pinned == 0

    def test_peek_tells_a_pinned_entry_or_says_it_cannot(self, cache: CacheBackend) -> None:
        """A caller deleting the entries a longer state supersedes (`sippcache.state.chunks`) keeps
        those a peek does not report as unpinned: a backend may answer None, never a wrong bool."""
        cache.store([1, 2], b"pinned", pinned=True)
        cache.store([1, 2, 3], b"not pinned")
        pinned, loose = cache.peek([1, 2, 9]), cache.peek([1, 2, 3, 4])
        assert pinned is not None and pinned.pinned in (True, None)
        assert loose is not None and loose.pinned in (False, None)
        assert cache.unpin([1, 2])
        again = cache.peek([1, 2])
        assert again is not None and again.pinned in (False, None)

    def test_a_store_keeps_a_pin(self, cache: CacheBackend) -> None:
        cache.store([1, 2], b"old", pinned=True)
        cache.store([1, 2], b"new")
        assert blob_of(cache.lookup([1, 2])) == b"new"
        assert next(iter(cache.entries())).pinned

    def test_pins_beyond_the_budget_are_refused(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=2500)
        assert cache.store([1], bytes(1000), pinned=True)
        assert cache.store([2], bytes(1000), pinned=True)
        with pytest.raises(sippcache.CacheFull, match="pin"):
            cache.store([3], bytes(1000), pinned=True)
        assert cache.lookup([3], touch=False) is None
        assert cache.lookup([1], touch=False) is not None and cache.lookup([2], touch=False) is not None
        assert cache.stats().pinned == 2
        assert cache.store([6], bytes(600)) is False  # no unpinned room left
        assert cache.stats().refused >= 1

    def test_pinned_entries_count_against_max_entries(self, open_cache: Opener) -> None:
        cache = open_cache(max_entries=2)
        cache.store([1], b"a", pinned=True)
        cache.store([2], b"b", pinned=True)
        with pytest.raises(sippcache.CacheFull):
            cache.store([3], b"c", pinned=True)
        assert cache.store([4], b"d") is False
        assert len(cache) == 2
