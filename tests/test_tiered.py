"""`tiered://`: the unchanged conformance suite on pairs of built-in tiers, and what the
tiers do for each other (L2 hits copied into L1, stores not waiting for L2, L2 failures
never failing L1)."""

from __future__ import annotations

from pathlib import Path

import pytest

import sippcache
from sippcache.backends.tiered import PersistentTieredBackend, TieredBackend, tiered_url
from sippcache.testing import BackendTests, PersistentBackendTests


class TestTieredRAMOverLMDB(BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return tiered_url("ram://", f"lmdb://{tmp_path}/l2?max_bytes=256MiB")


class TestTieredLMDBOverDiskCache(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return tiered_url(f"lmdb://{tmp_path}/l1?max_bytes=256MiB", f"diskcache://{tmp_path}/l2")


def test_url_helper_round_trips_inner_urls(tmp_path: Path) -> None:
    l1 = f"lmdb://{tmp_path}/a b?max_bytes=1GiB&sync=false"
    url = tiered_url(l1, "ram://", max_entries=7, queue=3)
    assert "?" not in url.split("?", 1)[1] and url.count("&") == 3
    with sippcache.open(url) as cache:
        assert isinstance(cache, TieredBackend) and not isinstance(cache, PersistentTieredBackend)
        assert cache.l1.stats().max_entries == 7 and cache.l2.stats().max_entries == 7  # budgets go to both
        assert cache.l1.stats().max_bytes == 1024**3 and cache.queue == 3
        assert (tmp_path / "a b" / "data.mdb").exists()


@pytest.mark.parametrize(
    "url, message",
    [
        ("tiered://?l1=ram://", "l2"),
        ("tiered:///x?l1=ram://&l2=ram://", "location"),
        ("tiered://?l1=ram://&l2=ram://&queue=0", "queue"),
        ("tiered://?l1=ram://&l2=ram://&speed=1", "speed"),
        ("tiered://?l1=ram://&l2=nope://", None),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(sippcache.SippcacheError, match=message):
        sippcache.open(url)


def test_an_l2_hit_is_copied_into_l1(tmp_path: Path) -> None:
    l2 = f"lmdb://{tmp_path}/shared"
    with sippcache.open(l2) as shared:  # another replica stored these
        shared.store([1, 2, 3], b"from elsewhere", generation=5)
        shared.store([1, 2, 3, 4, 5], b"longer, from elsewhere")
    with sippcache.open(tiered_url("ram://", l2)) as cache:
        cache.store([1, 2], b"local")
        match = cache.lookup([1, 2, 3, 9])
        assert match is not None and bytes(match.blob) == b"from elsewhere" and match.length == 3
        local = cache.l1.lookup([1, 2, 3], touch=False)
        assert local is not None and bytes(local.blob) == b"from elsewhere"
        assert next(e for e in cache.l1.entries() if e.key == (1, 2, 3)).generation == 0
        match = cache.lookup([1, 2, 3, 4, 9], partial=True)
        assert bytes(match.blob) == b"longer, from elsewhere" and match.length == 4
        # A copy never replaces a newer local entry.
        cache.l1.store([7], b"newer here", generation=10)
        cache.l2.store([7, 8], b"l2 only")
        assert cache.lookup([7, 8, 9]).length == 2
        assert bytes(cache.l1.lookup([7]).blob) == b"newer here"


def test_a_store_does_not_wait_for_l2(tmp_path: Path) -> None:
    """L2 is a diskcache store whose write lock this test holds: L2 stores wait, the tiered store does not.

    No clock: the stores return while the lock is held, and only this thread can release it,
    so none of them waited for its L2 write; a store that had waited would have timed out
    (diskcache's 60 s), been counted as an L2 error and be missing from L2 afterwards.
    """
    import sqlite3

    with sippcache.open(tiered_url("ram://", f"diskcache://{tmp_path}/l2")) as cache:
        assert cache.store([0], b"first") and len(cache) == 1
        locker = sqlite3.connect(tmp_path / "l2" / "cache.db", isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # the write lock: L2's stores block until it is released
        rows = locker.execute("SELECT key FROM Cache ORDER BY key").fetchall()
        try:
            for i in range(1, 4):
                assert cache.store([1, 2, i], b"x" * 100_000) is True
            assert bytes(cache.lookup([1, 2, 3]).blob) == b"x" * 100_000  # from L1, while L2 waits
            assert locker.execute("SELECT key FROM Cache ORDER BY key").fetchall() == rows  # L2 has none yet
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert len(cache) == 4  # L2, after the queue drained: every store reached it
        assert len(cache.l2) == 4 and cache.stats().errors == 0
