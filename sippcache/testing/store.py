"""Storing, exact lookups, overwriting, deleting, clearing and closing, and the
`Match` a hit hands out.
"""

from __future__ import annotations

import random

import pytest

from sippcache import CacheBackend, CacheClosed

from .fixtures import BackendFixtures, Opener, blob_of


class StoreTests(BackendFixtures):
    """The basic operations on whole keys, and how long a `Match` stays valid."""

    def test_implements_protocol(self, cache: CacheBackend) -> None:
        assert isinstance(cache, CacheBackend)
        assert isinstance(type(cache).persistent, bool)

    def test_empty_store_misses(self, cache: CacheBackend) -> None:
        assert len(cache) == 0
        assert cache.lookup([1, 2, 3]) is None
        assert cache.lookup([1, 2, 3], partial=True) is None
        assert cache.stats().entries == 0

    def test_store_then_exact_lookup(self, cache: CacheBackend) -> None:
        cache.store([5, 6, 7], b"state")
        match = cache.lookup([5, 6, 7])
        assert match is not None
        with match:
            assert match.length == 3
            assert tuple(match.key) == (5, 6, 7)
            assert bytes(match.blob) == b"state"
        assert len(cache) == 1

    def test_blob_is_copied_on_store(self, cache: CacheBackend) -> None:
        data = bytearray(b"original")
        cache.store([3], data)
        data[:] = b"mutated!"
        assert blob_of(cache.lookup([3])) == b"original"
        cache.store([4], memoryview(b"abcdef")[1:4])
        assert blob_of(cache.lookup([4])) == b"bcd"

    def test_overwrite_replaces(self, cache: CacheBackend) -> None:
        cache.store([1, 2], b"old")
        cache.store([1, 2], b"new, longer")
        assert len(cache) == 1
        assert blob_of(cache.lookup([1, 2, 3])) == b"new, longer"
        assert cache.stats().bytes == len(b"new, longer") + 2 * 4

    def test_delete(self, cache: CacheBackend) -> None:
        cache.store([1], b"a")
        cache.store([1, 2], b"ab")
        assert cache.delete([1, 2]) is True
        assert cache.delete([1, 2]) is False
        assert cache.delete([1, 2, 3]) is False
        assert blob_of(cache.lookup([1, 2, 3])) == b"a"
        assert len(cache) == 1

    def test_clear(self, cache: CacheBackend) -> None:
        for i in range(10):
            cache.store([i, i], b"x" * (i + 1), namespace=f"ns{i % 3}")
        cache.clear()
        assert len(cache) == 0
        assert cache.stats().bytes == 0
        assert cache.lookup([1, 1], namespace="ns1") is None
        cache.store([1, 1], b"again", namespace="ns1")
        assert blob_of(cache.lookup([1, 1], namespace="ns1")) == b"again"

    def test_large_blob(self, cache: CacheBackend) -> None:
        blob = random.Random(2).randbytes(24 * 1024 * 1024)
        cache.store([1, 2, 3], blob)
        match = cache.lookup([1, 2, 3, 4])
        assert match is not None
        with match:
            assert len(match.blob) == len(blob)
            assert bytes(match.blob) == blob

    def test_an_open_match_outlives_delete_overwrite_eviction_and_clear(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=5000)
        blobs = {i: bytes([i]) * 1000 for i in range(4)}
        for i, blob in blobs.items():
            cache.store([i], blob)
        held = {i: cache.lookup([i], touch=False) for i in blobs}
        cache.delete([0])
        cache.store([1], b"replaced" * 100)
        for i in range(10, 20):  # evicts 2 and 3
            cache.store([i], bytes(1000))
        assert cache.lookup([2], touch=False) is None
        cache.clear()
        for i, match in held.items():
            assert match is not None
            with match:
                assert bytes(match.blob) == blobs[i]

    def test_close(self, open_cache: Opener) -> None:
        cache = open_cache()
        with cache:
            cache.store([1], b"x")
        for call in (lambda: cache.store([1], b"x"), lambda: cache.lookup([1]), lambda: len(cache), cache.namespaces):
            with pytest.raises(CacheClosed):
                call()
        cache.close()  # idempotent

    def test_match_release_is_idempotent(self, cache: CacheBackend) -> None:
        cache.store([1], b"x")
        match = cache.lookup([1])
        assert match is not None
        match.release()
        match.release()
