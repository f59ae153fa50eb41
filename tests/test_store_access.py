"""Opening stores that are not there, cannot be written, or must not be: `sippcache.open`'s
`must_exist` and `read_only`, and the errors the backends raise at their boundary.

Real LMDB and diskcache stores throughout. The "cannot be written" cases run in a
subprocess that really cannot write the store: as root, with the capabilities that
let root ignore file permissions dropped from its bounding set before it starts.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import sippcache
from sippcache.base import BaseBackend
from sippcache.errors import NoStore, ReadOnlyStore
from sippcache.testing.bounded import wait_forked

SCHEMES = ["lmdb", "diskcache"]
STORE_FILE = {"lmdb": "data.mdb", "diskcache": "cache.db"}
BLOB = b"state bytes " * 10


def _opened(url: str, *, read_only: bool = False, must_exist: bool = False) -> BaseBackend:
    """`sippcache.open`, as the `BaseBackend` every built-in backend is (for `read_only`, `purge_damaged`)."""
    cache = sippcache.open(url, read_only=read_only, must_exist=must_exist)
    assert isinstance(cache, BaseBackend)
    return cache


def _fill(url: str) -> None:
    with sippcache.open(url) as cache:
        cache.store([1, 2, 3], BLOB, namespace="a")
        cache.store([1, 2, 3, 4, 5], BLOB + b"!", namespace="a", pinned=True)
        cache.store([7], BLOB, namespace="b")


#: Files every reader writes, whatever sippcache does: LMDB's reader table and SQLite's WAL index.
_READERS_FILES = {"lock.mdb", "cache.db-shm"}


def _fingerprint(path: Path) -> dict[str, str]:
    """A hash of each file holding the store's contents: equal before and after means
    nothing was written. Readers' coordination files are left out, and so are empty
    files (a WAL reader creates an empty ``-wal``)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name not in _READERS_FILES and p.stat().st_size
    }


@pytest.fixture(params=SCHEMES)
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- must_exist ---------------------------------------------------------------------------------


def test_must_exist_names_a_missing_directory_and_creates_nothing(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}/missing"
    with pytest.raises(NoStore) as caught:
        sippcache.open(url, must_exist=True)
    assert str(caught.value) == f"no cache at {url} (directory {tmp_path}/missing does not exist)"
    assert not (tmp_path / "missing").exists()


def test_must_exist_names_a_directory_without_a_store(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}"
    with pytest.raises(NoStore) as caught:
        sippcache.open(url, must_exist=True)
    assert str(caught.value) == f"no cache at {url} ({tmp_path} holds no {scheme} store)"
    assert list(tmp_path.iterdir()) == []


def test_must_exist_opens_an_existing_store(scheme: str, tmp_path: Path) -> None:
    _fill(f"{scheme}://{tmp_path}/db")
    with _opened(f"{scheme}://{tmp_path}/db", must_exist=True) as cache:
        assert len(cache) == 3 and not cache.read_only


def test_ram_and_tiered_cannot_tell_so_must_exist_opens_them(tmp_path: Path) -> None:
    with sippcache.open("ram://", must_exist=True) as cache:
        assert len(cache) == 0


@pytest.mark.parametrize("must_exist", [False, True])
def test_a_regular_file_as_the_location_is_one_clear_error(scheme: str, tmp_path: Path, must_exist: bool) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a cache")
    with pytest.raises(NoStore) as caught:
        sippcache.open(f"{scheme}://{path}", must_exist=must_exist)
    assert f"{path} is a file, not a cache directory" in str(caught.value)
    assert path.read_text() == "not a cache"


# -- read_only ----------------------------------------------------------------------------------


def test_read_only_reads_everything_and_writes_nothing(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}/db"
    _fill(url)
    before = _fingerprint(tmp_path / "db")
    with _opened(url, read_only=True) as cache:
        assert cache.read_only
        assert len(cache) == 3
        stats = cache.stats()
        assert (stats.entries, stats.namespaces, stats.pinned) == (3, 2, 1)
        assert sorted((e.namespace, e.key) for e in cache.entries()) == [
            ("a", (1, 2, 3)),
            ("a", (1, 2, 3, 4, 5)),
            ("b", (7,)),
        ]
        for _ in range(600):  # more uses than one recency batch: none may be saved
            match = cache.lookup([1, 2, 3, 4, 5, 6], namespace="a")
            assert match is not None and match.length == 5 and bytes(match.blob) == BLOB + b"!"
            match.release()
            assert cache.touch([7], namespace="b")
        peeked = cache.peek([1, 2, 3, 9], namespace="a")
        assert peeked is not None and peeked.length == 3
    assert _fingerprint(tmp_path / "db") == before


def test_writes_through_a_read_only_handle_raise_read_only_store(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}/db"
    _fill(url)
    before = _fingerprint(tmp_path / "db")
    with _opened(url, read_only=True) as cache:
        writes = {
            "store": lambda: cache.store([9], b"x"),
            "delete": lambda: cache.delete([7], namespace="b"),
            "pin": lambda: cache.pin([7], namespace="b"),
            "unpin": lambda: cache.unpin([1, 2, 3, 4, 5], namespace="a"),
            "clear": cache.clear,
            "purge_damaged": cache.purge_damaged,
        }
        for name, write in writes.items():
            with pytest.raises(ReadOnlyStore, match="open read-only"):
                write()
            assert len(cache) == 3, name
    assert _fingerprint(tmp_path / "db") == before


def test_read_only_never_creates_a_store(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}/missing"
    with pytest.raises(NoStore, match="does not exist"):
        sippcache.open(url, read_only=True)
    assert not (tmp_path / "missing").exists()


def test_a_read_only_handle_sees_a_writers_changes(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}/db"
    _fill(url)
    with sippcache.open(url) as writer, sippcache.open(url, read_only=True) as reader:  # LMDB: writer first
        assert reader.lookup([5, 6], namespace="c") is None
        writer.store([5, 6], b"new", namespace="c")
        match = reader.lookup([5, 6], namespace="c")
        assert match is not None and bytes(match.blob) == b"new"
        match.release()
        writer.delete([7], namespace="b")
        assert len(reader) == 3


def test_a_read_only_handle_works_in_a_forked_child(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://{tmp_path}/db"
    _fill(url)
    with sippcache.open(url, read_only=True) as cache:
        assert len(cache) == 3
        pid = os.fork()
        if pid == 0:  # the child opens its own environment / connection on first use
            code = 1
            try:
                match = cache.lookup([1, 2, 3], namespace="a")
                code = 0 if match is not None and bytes(match.blob) == BLOB and len(cache) == 3 else 1
            finally:
                os._exit(code)
        assert wait_forked(pid, "look the entry up and exit") == 0
        match = cache.lookup([1, 2, 3], namespace="a")
        assert match is not None and bytes(match.blob) == BLOB
        match.release()


def test_lmdb_cannot_be_opened_for_writing_while_read_only_in_this_process(tmp_path: Path) -> None:
    """LMDB allows one environment per path per process: a read-only one cannot serve writers."""
    url = f"lmdb://{tmp_path}/db"
    _fill(url)
    with sippcache.open(url, read_only=True), pytest.raises(ReadOnlyStore, match="open read-only in this process"):
        sippcache.open(url)
    with sippcache.open(url) as writer, sippcache.open(url, read_only=True) as reader:
        writer.store([8], b"x")  # the other way round shares the writable environment
        assert len(reader) == 4


def test_backends_that_cannot_open_read_only_open_normally() -> None:
    with _opened("ram://", read_only=True) as cache:
        assert not cache.read_only
        assert cache.store([1], b"x")


# -- purge_damaged is backend API ---------------------------------------------------------------


def test_purge_damaged_is_on_every_base_backend(tmp_path: Path) -> None:
    l1, l2 = f"lmdb://{tmp_path}/l1", f"lmdb://{tmp_path}/l2"
    tiered = f"tiered://?l1={l1}&l2={l2}"
    with _opened(tiered) as cache:
        assert cache.purge_damaged() == 0  # the default: nothing to remove
    with _opened("ram://") as cache:
        assert cache.purge_damaged() == 0


def test_purge_damaged_removes_entries_with_unreadable_index_records(tmp_path: Path) -> None:
    import lmdb

    url = f"lmdb://{tmp_path}/db"
    _fill(url)
    env = lmdb.open(str(tmp_path / "db"), subdir=True, max_dbs=0)
    with env.begin(write=True) as txn:
        key = next(k for k, _ in txn.cursor() if k.startswith(b"M"))
        txn.put(key, b"\xc1 not msgpack")
    env.close()
    with _opened(url) as cache:
        assert cache.stats().damaged == 1
        assert cache.purge_damaged() == 1
        assert cache.stats().damaged == 0 and len(cache) == 2


# -- stores this user cannot write --------------------------------------------------------------

_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _CAP_FOWNER = 1, 2, 3
_PR_CAPBSET_DROP = 24


def _without_permission_overrides() -> None:
    """In the child before exec: drop the capabilities that let root ignore file
    permissions, so the child is refused what any other user would be."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _CAP_FOWNER):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _run_unprivileged(code: str) -> dict[str, object]:
    """Run `code` (which prints one JSON line) as a process that file permissions bind."""
    preexec = _without_permission_overrides if os.geteuid() == 0 else None
    try:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            preexec_fn=preexec,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired:  # a SubprocessError too: a hung child fails the test, never skips it
        raise
    except subprocess.SubprocessError as exc:  # only preexec_fn raises this: prctl needs CAP_SETPCAP
        pytest.skip(f"running as root without the right to drop capabilities (prctl failed: {exc})")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _chmod_tree(path: Path, folders: int, files: int) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(folders if p.is_dir() else files)


@pytest.fixture
def unwritable_store(scheme: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A filled store whose directory and files are read-only (to their owner too)."""
    path = tmp_path / "db"
    _fill(f"{scheme}://{path}")
    _chmod_tree(path, 0o555, 0o444)
    yield f"{scheme}://{path}", path
    _chmod_tree(path, 0o700, 0o600)


_PROBE = """
    import json, os, sippcache
    from sippcache.errors import ReadOnlyStore
    url, path = {url!r}, {path!r}
    try:
        open(os.path.join(path, "probe"), "w")
        denied = False
    except PermissionError:
        denied = True
    out = {{"denied": denied}}
"""


def test_opening_an_unwritable_store_for_writing_says_so(unwritable_store: tuple[str, Path]) -> None:
    url, path = unwritable_store
    before = _fingerprint(path)
    out = _run_unprivileged(
        _PROBE.format(url=url, path=str(path))
        + """
    try:
        sippcache.open(url).close()
        out["error"] = None
    except Exception as exc:
        out["error"], out["message"] = type(exc).__name__, str(exc)
    print(json.dumps(out))
    """
    )
    assert out["denied"], "the child could write the store: the test would prove nothing"
    assert out["error"] == "ReadOnlyStore", out
    message = str(out["message"])
    assert str(path) in message and "not writable" in message and "read_only=True" in message
    assert _fingerprint(path) == before


def test_an_unwritable_store_can_be_read(unwritable_store: tuple[str, Path], scheme: str) -> None:
    url, path = unwritable_store
    before = _fingerprint(path)
    out = _run_unprivileged(
        _PROBE.format(url=url, path=str(path))
        + """
    with sippcache.open(url, read_only=True) as cache:
        out["entries"] = sorted([e.namespace, list(e.key)] for e in cache.entries())
        out["stats"] = [cache.stats().entries, cache.stats().pinned]
        with cache.lookup([1, 2, 3, 4, 5, 6], namespace="a") as match:
            out["blob"] = bytes(match.blob).decode()
        try:
            cache.store([9], b"x")
        except ReadOnlyStore as exc:
            out["store"] = str(exc)
    print(json.dumps(out))
    """
    )
    assert out["denied"], "the child could write the store: the test would prove nothing"
    assert out["entries"] == [["a", [1, 2, 3]], ["a", [1, 2, 3, 4, 5]], ["b", [7]]]
    assert out["stats"] == [3, 1]
    assert out["blob"] == (BLOB + b"!").decode()
    assert "open read-only" in str(out["store"])
    assert _fingerprint(path) == before


# -- the same through the command line ------------------------------------------------------------


def _cli(*args: str, unprivileged: bool = False) -> subprocess.CompletedProcess[str]:
    """`sippcache ARGS` in a new process (one that file permissions bind, if `unprivileged`)."""
    preexec = _without_permission_overrides if unprivileged and os.geteuid() == 0 else None
    try:
        return subprocess.run(
            [sys.executable, "-m", "sippcache.cli", *args],
            preexec_fn=preexec,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"},
        )
    except subprocess.TimeoutExpired:  # a SubprocessError too: a hung child fails the test, never skips it
        raise
    except subprocess.SubprocessError as exc:
        pytest.skip(f"running as root without the right to drop capabilities (prctl failed: {exc})")


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_the_cli_inspects_an_unwritable_store(unwritable_store: tuple[str, Path], scheme: str) -> None:
    url, path = unwritable_store
    before = _fingerprint(path)
    probe = _run_unprivileged(_PROBE.format(url=url, path=str(path)) + "    print(json.dumps(out))\n")
    assert probe["denied"], "the child could write the store: the test would prove nothing"
    stats = _cli("stats", url, "--json", unprivileged=True)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["entries"] == 3
    listed = _cli("ls", url, "--json", unprivileged=True)
    assert listed.returncode == 0, listed.stderr
    assert sorted(len(e["key"]) if "key" in e else e["tokens"] for e in json.loads(listed.stdout)) == [1, 3, 5]
    verified = _cli("verify", url, "--json", unprivileged=True)  # raw test blobs, not frames: all three bad
    assert verified.returncode == 1 and not verified.stderr, verified.stderr
    report = json.loads(verified.stdout)
    assert report["checked"] == 3 and len(report["bad"]) == 3 and report["deleted"] == 0
    refused = _one_line_error(_cli("clear", url, "--yes", unprivileged=True))
    assert "not writable" in refused and str(path) in refused
    assert _fingerprint(path) == before


def test_the_cli_names_a_file_given_as_a_store(scheme: str, tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("not a cache")
    for args in (["stats", f"{scheme}://{file}"], ["ls", f"{scheme}://{file}"]):
        message = _one_line_error(_cli(*args))
        assert f"{file} is a file, not a cache directory" in message, message
    source = f"{scheme}://{tmp_path / 'db'}"
    _fill(source)
    message = _one_line_error(_cli("copy", source, f"{scheme}://{file}"))
    assert f"{file} is a file, not a cache directory" in message, message
    assert "Errno" not in message
    assert file.read_text() == "not a cache"
