"""Persistent backends: entries, recency, pins, priorities and generations
survive `close()` and reopening.
"""

from __future__ import annotations

from sippcache import CacheBackend

from .fixtures import BackendFixtures, Opener, blob_of


class ReopenTests(BackendFixtures):
    """For backends whose `persistent` is True: what a reopened store still holds."""

    def test_declares_persistent(self, cache: CacheBackend) -> None:
        assert type(cache).persistent is True

    def test_survives_close_and_reopen(self, open_cache: Opener) -> None:
        first = open_cache()
        first.store([1, 2, 3], b"kept", namespace="ns")
        first.store([1, 2], b"also kept")
        first.close()
        again = open_cache()
        assert len(again) == 2
        assert blob_of(again.lookup([1, 2, 3, 4], namespace="ns")) == b"kept"
        assert blob_of(again.lookup([1, 2, 3, 4])) == b"also kept"
        assert again.stats().bytes == len(b"kept") + len(b"also kept") + 5 * 4
        assert again.namespaces() == ["", "ns"]

    def test_recency_survives_reopen(self, open_cache: Opener) -> None:
        first = open_cache(max_bytes=3500)
        for i in range(3):
            first.store([i], bytes(1000))
        assert first.lookup([0]) is not None
        first.close()
        again = open_cache(max_bytes=3500)
        again.store([3], bytes(1000))
        assert again.lookup([1]) is None and again.lookup([0]) is not None

    def test_pins_priorities_and_generations_survive_reopen(self, open_cache: Opener) -> None:
        first = open_cache()
        first.store([1, 2], b"pinned", pinned=True, generation=7)
        first.store([3], b"valued", priority=99.5)
        first.close()
        again = open_cache()
        info = {tuple(e.key): e for e in again.entries()}
        assert (info[(1, 2)].pinned, info[(1, 2)].generation) == (True, 7)
        assert (info[(3,)].priority, info[(3,)].pinned) == (99.5, False)
        assert again.store([1, 2], b"stale", generation=6) is False
