"""Namespaces: the same tokens in two namespaces are two entries that never meet."""

from __future__ import annotations

from sippcache import CacheBackend

from .fixtures import BackendFixtures, blob_of


class NamespaceTests(BackendFixtures):
    """Namespaces isolate entries, whatever characters their names hold."""

    def test_namespaces_are_isolated(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3], b"tenant-a", namespace="a")
        cache.store([1, 2], b"tenant-b", namespace="b")
        assert blob_of(cache.lookup([1, 2, 3, 4], namespace="a")) == b"tenant-a"
        assert blob_of(cache.lookup([1, 2, 3, 4], namespace="b")) == b"tenant-b"
        assert cache.lookup([1, 2, 3, 4]) is None
        assert cache.lookup([1, 2, 3], namespace="c", partial=True) is None
        assert cache.delete([1, 2, 3], namespace="b") is False
        assert cache.delete([1, 2, 3], namespace="a") is True
        assert blob_of(cache.lookup([1, 2, 3], namespace="b")) == b"tenant-b"
        assert cache.stats().namespaces == 1

    def test_namespaces_with_tricky_names(self, cache: CacheBackend) -> None:
        names = ["", "a", "a\x00", "\x00a", "ü/é:?&=#", "x" * 1000]
        for i, name in enumerate(names):
            cache.store([7, 7], bytes([i + 1]), namespace=name)
        for i, name in enumerate(names):
            assert blob_of(cache.lookup([7, 7], namespace=name)) == bytes([i + 1])
        assert len(cache) == len(names)
