"""LMDB: a match the user never released must not stop the process when the map grows.

An unreleased match holds an LMDB read transaction, and its blob is a view of
the memory map. Growing the map (this process's own growth, or adopting one
another process made) remaps it, which the match used to forbid: after another
process had grown the map past this one's, every call of this process on that
path raised ``StoreError(MDB_MAP_RESIZED)`` for as long as the match lived.

Real LMDB files and real processes. The growing writer is a separate process
that tells on a pipe once its committed data runs past this process's map
(read from its own environment, ``env.info()``), and is SIGKILLed then, in the
middle of its stores: nothing timed decides the outcome.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sippcache
from sippcache import CacheBackend
from sippcache.errors import SippcacheError
from sippcache.testing.bounded import BOUND, finish, read_line

ROOT = Path(__file__).resolve().parent.parent

#: The writer child: store until the committed data is past the parent's map, say so, keep storing.
GROWER = """
import sys
import sippcache

url, parent_map = sys.argv[1], int(sys.argv[2])
cache = sippcache.open(url)
env = cache._shared.env  # this process's own environment: how far the store has grown
told = False
for i in range(20_000):
    cache.store([7, i % 400], bytes([i % 251]) * 100_000)
    info, page = env.info(), env.stat()["psize"]
    if not told and info["map_size"] > parent_map and (info["last_pgno"] + 1) * page > parent_map:
        print("grown", flush=True)
        told = True
print("done", flush=True)
"""


def _map_size(cache: CacheBackend) -> int:
    return int(cache._shared.env.info()["map_size"])  # type: ignore[attr-defined]


def _grow_in_another_process(url: str, beyond: int) -> None:
    """Run a writer that grows the store past `beyond` bytes of map; SIGKILL it mid-stores once it has."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", GROWER, url, str(beyond)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert child.stdout is not None
    line = read_line(child, child.stdout, f'the writer growing the map past {beyond} bytes ("grown")', seconds=300)
    os.kill(child.pid, signal.SIGKILL)
    _, stderr = finish(child, "die of SIGKILL")
    errors = stderr.decode(errors="replace")
    assert line == b"grown\n", f"the writer did not grow the map past {beyond} bytes: {line!r}\n{errors}"


def _state(trial: int) -> bytes:
    return bytes(range(256)) * 64 + trial.to_bytes(4, "little")


def _still_works(cache: CacheBackend, stored: dict[tuple[int, ...], bytes], tag: int) -> None:
    """Lookups of what this process stored find their bytes, and a new store is found."""
    for tokens, blob in stored.items():
        match = cache.lookup(list(tokens))
        assert match is not None, tokens
        with match:
            assert bytes(match.blob) == blob
    assert cache.store([9, tag], b"after the growth %d" % tag)
    match = cache.lookup([9, tag])
    assert match is not None
    with match:
        assert bytes(match.blob) == b"after the growth %d" % tag


def _leaked_match_reads_or_fails_alone(match: sippcache.Match, blob: bytes) -> None:
    """A leaked match either still shows its bytes or raises a sippcache error (never wrong bytes, never a crash)."""
    try:
        assert bytes(match.blob) == blob
    except SippcacheError:
        pass


def test_another_process_growing_the_map_while_a_match_is_unreleased(tmp_path: Path) -> None:
    """The issue's scenario, three kills in a row: each time, this process holds a match it
    never releases, a writer process grows the map past this process's and is SIGKILLed
    mid-stores; then lookups and stores work on the handle kept open and on a new one."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64MiB&map_size=1MiB"
    kept = sippcache.open(url)
    stored: dict[tuple[int, ...], bytes] = {}
    leaked: list[tuple[sippcache.Match, bytes]] = []
    try:
        for trial in range(3):
            tokens = (1, 2, trial)
            stored[tokens] = _state(trial)
            assert kept.store(list(tokens), stored[tokens])
            match = kept.lookup(list(tokens))
            assert match is not None
            leaked.append((match, stored[tokens]))  # never released: the user forgot

            _grow_in_another_process(url, _map_size(kept))

            _still_works(kept, stored, tag=2 * trial)
            with sippcache.open(url) as fresh:
                _still_works(fresh, stored, tag=2 * trial + 1)
            for match, blob in leaked:
                _leaked_match_reads_or_fails_alone(match, blob)
        assert all(bytes(match.blob) == blob for match, blob in leaked)  # this design keeps them valid
    finally:
        for match, _ in leaked:
            match.release()
        kept.close()


def test_a_chain_of_matches_held_when_another_process_grows_the_map(tmp_path: Path) -> None:
    """The matches of one `lookup_prefixes` (a restore's chunks) share one read snapshot: held
    unreleased while a writer process grows the map past this one's, they are detached together,
    each keeping its bytes, and this process goes on (it raised MDB_MAP_RESIZED on every call)."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64MiB&map_size=1MiB"
    kept = sippcache.open(url)
    try:
        stored = {tuple(range(1, n + 1)): _state(n) for n in (2, 3, 4)}
        for tokens, blob in stored.items():
            assert kept.store(list(tokens), blob)
        chain = kept.lookup_prefixes([1, 2, 3, 4], [2, 3, 4])
        assert [match.length for match in chain] == [2, 3, 4]

        _grow_in_another_process(url, _map_size(kept))

        _still_works(kept, stored, tag=0)
        assert [bytes(match.blob) for match in chain] == list(stored.values())
    finally:
        kept.close()


def test_a_blob_outliving_its_match_when_another_process_grows_the_map(tmp_path: Path) -> None:
    """`blob = cache.lookup(k).blob`: a blob still referenced after its match was collected
    cannot be copied. After the remap it fails alone, with ValueError (a released view)."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64MiB&map_size=1MiB"
    with sippcache.open(url) as cache:
        assert cache.store([1], b"outliving")
        match = cache.lookup([1])
        assert match is not None
        blob = match.blob
        del match
        assert bytes(blob) == b"outliving"

        _grow_in_another_process(url, _map_size(cache))

        _still_works(cache, {(1,): b"outliving"}, tag=1)
        with pytest.raises(ValueError):
            bytes(blob)


def test_a_leaked_match_does_not_stop_this_process_growing_its_map(tmp_path: Path) -> None:
    """The process holding the match is the one whose writes fill the map."""
    with sippcache.open(f"lmdb://{tmp_path}/small?map_size=1MiB&max_bytes=64MiB") as cache:
        assert cache.store([0], b"kept")
        leaked = cache.lookup([0])
        assert leaked is not None
        for i in range(1, 41):
            assert cache.store([i], bytes([i]) * 200_000)
        assert len(cache) == 41
        assert _map_size(cache) > 8 * 200_000
        for i in range(1, 41):
            match = cache.lookup([i])
            assert match is not None
            with match:
                assert bytes(match.blob) == bytes([i]) * 200_000
        assert bytes(leaked.blob) == b"kept"
        leaked.release()
        with pytest.raises(ValueError):
            bytes(leaked.blob)


def test_closing_a_handle_ends_the_snapshots_of_its_unreleased_matches(tmp_path: Path) -> None:
    """A closed handle's matches keep neither the environment nor reader slots: with two
    reader slots both held by unreleased matches, a new handle can read once the old one
    is closed, and the old matches still show their bytes."""
    url = f"lmdb://{tmp_path}/store?max_readers=2"
    old = sippcache.open(url)
    assert old.store([1], b"one") and old.store([2], b"two")
    first, second = old.lookup([1]), old.lookup([2])
    assert first is not None and second is not None
    old.close()
    with sippcache.open(url) as new:
        for tokens, blob in (([1], b"one"), ([2], b"two")):
            match = new.lookup(tokens)
            assert match is not None
            with match:
                assert bytes(match.blob) == blob
    assert bytes(first.blob) == b"one" and bytes(second.blob) == b"two"
    first.release()
    with pytest.raises(ValueError):
        bytes(first.blob)
    del second  # collected unreleased: nothing left to end


def test_an_exported_blob_blocks_adopting_the_map_with_a_clear_error_until_dropped(tmp_path: Path) -> None:
    """A blob exported to another object (a numpy array, say) cannot be detached from the
    map: the process cannot remap while it lives, says why, and recovers once it is dropped."""
    import struct

    url = f"lmdb://{tmp_path}/store?max_bytes=64MiB&map_size=1MiB"
    with sippcache.open(url) as cache:
        assert cache.store([1], b"exported")
        match = cache.lookup([1])
        assert match is not None
        exporter = struct.iter_unpack("B", match.blob)  # holds a buffer export of the blob

        _grow_in_another_process(url, _map_size(cache))

        with pytest.raises(sippcache.StoreError, match="exported"):
            cache.lookup([1])
        assert bytes(match.blob) == b"exported"  # left as it was
        del exporter
        _still_works(cache, {(1,): b"exported"}, tag=1)
        assert bytes(match.blob) == b"exported"  # detached: a copy
        match.release()


#: In a process with limited address space: the default map does not fit, the smaller one does.
LIMITED = """
import resource
import sys
import sippcache

resource.setrlimit(resource.RLIMIT_AS, (8 * 1024**3, resource.getrlimit(resource.RLIMIT_AS)[1]))
with sippcache.open(sys.argv[1]) as cache:
    assert cache.store([1], b"fits")
    print(cache._shared.env.info()["map_size"])
"""


def test_the_default_map_is_large_and_smaller_where_the_address_space_is_limited(tmp_path: Path) -> None:
    """The default map is address space sized so that growth is rare (4 x max_bytes, at least
    64 GiB); under ``ulimit -v`` it falls back to 2 x max_bytes + 256 MiB instead of failing."""
    url = f"lmdb://{tmp_path}/store?max_bytes=256MiB"
    with sippcache.open(url) as cache:
        assert cache.store([1], b"fits")
        assert _map_size(cache) == 64 * 1024**3
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", LIMITED, f"lmdb://{tmp_path}/other?max_bytes=256MiB"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=BOUND,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 2 * 256 * 1024**2 + 256 * 1024**2
