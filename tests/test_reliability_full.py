"""A full disk: the cache refuses with `CacheFull` (never another error), lookups
keep working, and stores work again once there is room.

The disk fills for real, from the process's point of view: a child process
lowers its file-size limit (RLIMIT_FSIZE), so writes past it fail (EFBIG) the
way they fail on a full disk, without needing a small filesystem. A store made
on a disk already full is tried on one, a small tmpfs (`tests.filesystems`):
there a write through a mapping fails as it does, with SIGBUS.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sippcache

CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys
    import sippcache
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    report = {}
    with sippcache.open(sys.argv[1]) as cache:
        cache.store([0], b"stored before the disk filled")
        resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, resource.RLIM_INFINITY))
        last = [0]
        for i in range(1, 400):
            try:
                cache.store([i, 1], bytes([i % 256]) * 100_000)
                last = [i, 1]
            except Exception as exc:
                report["error"] = type(exc).__name__
                report["message"] = str(exc)
                break
        # The cache may have evicted older entries to make room; the newest is there.
        match = cache.lookup(last)
        report["lookup_after_full"] = len(match.blob) if last != [0] else -1
        match.release()
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        cache.store([999], b"room again")
        report["store_after_room"] = bytes(cache.lookup([999]).blob).decode()
    print(json.dumps(report))
    """
)


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_full_disk_is_a_clear_refusal_and_the_cache_keeps_working(backend: str, tmp_path: Path) -> None:
    url = f"{backend}://{tmp_path}/store"
    result = subprocess.run([sys.executable, "-c", CHILD, url], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["error"] == "CacheFull", report
    assert "disk full" in report["message"]
    assert report["lookup_after_full"] == 100_000
    assert report["store_after_room"] == "room again"
    with sippcache.open(url) as cache:  # what is there is intact
        for entry in cache.entries():
            match = cache.lookup(list(entry.key), touch=False)
            assert match is not None and len(match.blob) == entry.size - 4 * len(entry.key)
            match.release()


OPEN_ON_A_FULL_DISK = textwrap.dedent(
    """
    import json, os, sys
    import sippcache
    folder = sys.argv[1]
    with open(os.path.join(folder, "filler"), "wb") as f:  # the disk fills, to its last block
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
    report = {}
    for backend in ("lmdb", "diskcache"):
        try:
            sippcache.open(f"{backend}://{folder}/{backend}").close()
            report[backend] = ["opened", ""]
        except sippcache.SippcacheError as exc:
            report[backend] = [type(exc).__name__, str(exc)]
    print(json.dumps(report))
    """
)


def test_a_store_made_on_a_full_disk_is_a_clear_refusal_not_a_crash(tmp_path: Path) -> None:
    """LMDB makes its lock file with ftruncate and writes it through a shared mapping: on a full
    disk, a SIGBUS killed the process; SQLite's "database or disk is full" read as a damaged
    store (`CorruptStore`), which a user might delete. Both are `CacheFull` now, saying so."""
    from tests.filesystems import in_small_tmpfs

    folder = tmp_path / "full"
    folder.mkdir()
    done = subprocess.run(
        [*in_small_tmpfs(str(folder), "1m"), sys.executable, "-c", OPEN_ON_A_FULL_DISK, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["lmdb"][0] == "CacheFull" and "the disk is full" in report["lmdb"][1], report
    assert report["diskcache"][0] == "CacheFull" and "the disk is full" in report["diskcache"][1], report
