"""Persistent backends: several handles on one store in one process, each seeing
the others' writes and budgets.
"""

from __future__ import annotations

import pytest

import sippcache

from .fixtures import BackendFixtures, Opener, blob_of


class SharedStoreTests(BackendFixtures):
    """For backends whose `persistent` is True: two handles opened on the same URL."""

    def test_two_handles_in_one_process(self, open_cache: Opener) -> None:
        a, b = open_cache(), open_cache()
        a.store([5, 5], b"from a")
        assert blob_of(b.lookup([5, 5, 5])) == b"from a"
        a.store([5], b"a tenant's", namespace="tenant")
        assert b.namespaces() == ["", "tenant"]
        b.delete([5, 5])
        assert a.lookup([5, 5]) is None
        assert a.namespaces() == ["tenant"]
        a.close()
        b.store([6], b"b still works")
        assert blob_of(b.lookup([6])) == b"b still works"

    def test_pin_beyond_this_handles_budget_is_refused(self, open_cache: Opener) -> None:
        roomy = open_cache(max_bytes=10_000)
        roomy.store([1], bytes(3000), pinned=True)
        roomy.store([2], bytes(3000))
        tight = open_cache(max_bytes=5000)
        with pytest.raises(sippcache.CacheFull, match="pin"):
            tight.pin([2])
        assert roomy.pin([2]) is True
        assert tight.stats().pinned == 2
