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

    def test_namespaces_lists_those_holding_entries(self, cache: CacheBackend) -> None:
        assert cache.namespaces() == []
        cache.store([1, 2], b"b1", namespace="b")
        cache.store([1, 2, 3], b"b2", namespace="b")
        cache.store([5], b"a", namespace="a")
        cache.store([9], b"default")
        assert cache.namespaces() == ["", "a", "b"]
        assert cache.delete([5], namespace="a")
        assert cache.namespaces() == ["", "b"]  # its last entry gone, a namespace is gone
        assert cache.delete([1, 2], namespace="b")
        assert cache.namespaces() == ["", "b"]
        cache.clear()
        assert cache.namespaces() == []

    def test_namespaces_with_tricky_names_are_listed_as_they_are(self, cache: CacheBackend) -> None:
        names = ["", "a", "a\x00", "\x00a", "ü/é:?&=#", "x" * 1000]
        for name in names:
            cache.store([7, 7], b"x", namespace=name)
        assert cache.namespaces() == sorted(names)
        assert cache.stats().namespaces == len(names)
