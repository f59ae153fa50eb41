"""The conformance suite, run against each built-in backend."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import sippcache
from sippcache.testing import BackendTests, PersistentBackendTests
from sippcache.testing.fixtures import blob_of


class TestRAMBackend(BackendTests):
    @pytest.fixture
    def cache_url(self) -> str:
        return "ram://"


class TestLMDBBackend(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return f"lmdb://{tmp_path}/store?max_bytes=256MiB"


class TestDiskCacheBackend(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return f"diskcache://{tmp_path}/store"


def test_lmdb_grows_a_full_map(tmp_path: Path) -> None:
    with sippcache.open(f"lmdb://{tmp_path}/small?map_size=1MiB&max_bytes=64MiB") as cache:
        for i in range(40):
            cache.store([i], bytes(200_000))
        assert len(cache) == 40
        assert all(cache.lookup([i]) is not None for i in range(40))
    assert (tmp_path / "small" / "data.mdb").stat().st_size > 8 * 200_000  # beyond the 1 MiB map it began with


@pytest.mark.parametrize("sync", [True, False])
def test_lmdb_flushes_a_commit_once_or_not_at_all(tmp_path: Path, sync: bool) -> None:
    """`sync=true` flushes a commit's pages and leaves its meta page to the next flush (one flush a
    commit, not two: each is an F_FULLFSYNC on macOS, and a chunked state is hundreds of commits)."""
    with sippcache.open(f"lmdb://{tmp_path}/db?sync={str(sync).lower()}") as cache:
        cache.store([1], b"abc")
        flags = cache._shared.env.flags()  # type: ignore[attr-defined]
        assert (flags["sync"], flags["metasync"]) == (sync, False)
    with sippcache.open(f"lmdb://{tmp_path}/db") as cache:
        assert blob_of(cache.lookup([1])) == b"abc"


def test_lmdb_match_release_can_be_retried(tmp_path: Path) -> None:
    """A release refused because the blob is exported (BufferError) leaves the match releasable."""
    with sippcache.open(f"lmdb://{tmp_path}/db") as cache:
        cache.store([1], b"abcdef")
        match = cache.lookup([1])
        assert match is not None and isinstance(match.blob, memoryview)
        exporter = struct.iter_unpack("B", match.blob)  # holds a buffer export of the blob
        with pytest.raises(BufferError):
            match.release()
        assert bytes(match.blob) == b"abcdef"  # still valid: nothing was released
        del exporter
        match.release()
        with pytest.raises(ValueError):
            bytes(match.blob)


def test_lmdb_blob_outliving_its_match_stays_valid_and_frees_its_snapshot(tmp_path: Path) -> None:
    """`bytes(cache.lookup(k).blob)`: the match is collected before bytes() reads the blob."""
    with sippcache.open(f"lmdb://{tmp_path}/db?max_readers=8") as cache:
        cache.store([1, 2], b"payload")
        for _ in range(200):  # far more than 8 reader slots: snapshots must be ended
            assert bytes(cache.lookup([1, 2]).blob) == b"payload"
        blob = cache.lookup([1, 2]).blob
        assert bytes(blob[:3]) == b"pay"
