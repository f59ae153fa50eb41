"""`lmdb:///path`: a memory-mapped store shared by every process on the machine.

Lookups return the blob as a view of the mapped page (no copy), valid until
the `Match` is released. One LMDB environment is opened per path per process
(LMDB forbids two) and reopened in a forked child. Readers never block the
writer; writers take turns through LMDB's own lock.

A read-only open (`sippcache.open(url, read_only=True)`) opens the environment
read-only. If this user may not write ``lock.mdb`` either, it reads without
LMDB's lock table: safe for a store nobody writes meanwhile (another user's,
one on read-only media), not for one a writer is changing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import ClassVar, TypeVar, cast

import lmdb

from ..catalog import UNSET
from ..engine import KVBackend, KVTxn, directory_path, fork_safe_lock, prepare_directory
from ..engine.directory import check_store_files, free_bytes, missing_store
from ..engine.snapshots import End, detach_snapshots
from ..errors import CacheFull, CorruptStore, NoStore, ReadOnlyStore, SippcacheError, StoreError
from ..mirror import Limit
from ..options import Size
from ..protocol import Blob

_T = TypeVar("_T")

DEFAULT_MAX_BYTES = 8 * 1024**3
#: The default map: 4 x max_bytes, at least 64 GiB. The map is address space,
#: not disk or memory (LMDB maps the file read-only and never extends it to the
#: map's size on Linux), and growing it costs every process on the store a remap,
#: which copies the bytes of its unreleased matches out of the map (see
#: `_SharedEnv.resize`). So it is sized for growth to be rare: the data file
#: outgrows it only if readers pin three budgets' worth of freed pages.
DEFAULT_MAP_FACTOR = 4
DEFAULT_MAP_FLOOR = 64 * 1024**3
#: Room in the map beyond max_bytes, in the map used where the address space is
#: limited (``ulimit -v``) and the default does not fit: LMDB needs free pages for
#: copy-on-write and for pages still pinned by readers.
MAP_HEADROOM = 256 * 1024**2
#: The files of a store; data.mdb holds the entries.
STORE_FILES = ("data.mdb", "lock.mdb")
#: Largest map this backend asks for (the address space bounds it on 64-bit machines).
MAX_MAP_SIZE = 16 * 1024**4


class _SharedEnv:
    """One LMDB environment per (path, process), counted by its users.

    The first handle's settings (map size, sync, readers) hold for every
    handle of that path in the process. Open read transactions are tracked
    (`snapshots`: the function that ends each, with the handle that began it)
    because remapping moves the map: views into it must be gone first (see
    `resize`).
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _open: ClassVar[dict[tuple[str, int], _SharedEnv]] = {}

    def __init__(self, env: lmdb.Environment, key: tuple[str, int], read_only: bool) -> None:
        self.env = env
        self.key = key
        self.read_only = read_only
        self.users = 0
        self.snapshots: dict[End, object] = {}

    @classmethod
    def acquire(
        cls, path: str, map_sizes: tuple[int, ...], sync: bool, max_readers: int, read_only: bool
    ) -> _SharedEnv:
        """This process's environment for `path`, opened if it is not yet (with the
        first of `map_sizes` the address space allows); a writable one also serves
        read-only handles, never the other way round."""
        key = (path, os.getpid())
        with cls._lock:
            for inherited in [s for (p, pid), s in cls._open.items() if p == path and pid != key[1]]:
                inherited.abandon_after_fork()  # a forked child: the parent's environment must go first
            shared = cls._open.get(key)
            if shared is not None and shared.read_only and not read_only:
                raise ReadOnlyStore(
                    f"{path} is open read-only in this process; close those handles before opening it for writing"
                )
            if shared is None:
                env = _open_environment(path, map_sizes, sync, max_readers, read_only)
                _check_file_length(env, path)
                env.reader_check()  # free reader slots of processes that died holding a match
                shared = cls._open[key] = _SharedEnv(env, key, read_only)
            shared.users += 1
            return shared

    def abandon_after_fork(self) -> None:
        """In a forked child (with `_lock` held): close the inherited environment so
        this process can open its own. Impossible while the parent had a match open
        at the fork: closing would end the parent's read snapshot in the shared
        reader table."""
        if self.snapshots:
            raise SippcacheError(
                f"{self.key[0]}: this process was forked while an LMDB match was open, so it cannot "
                "use this store; release matches before forking"
            )
        if self.users:
            self.users = 0
            self.env.close()
        self._open.pop(self.key, None)

    def begin_read(self, owner: object) -> tuple[lmdb.Transaction[bytes | memoryview], End]:
        """A read transaction whose values are views of the map, and the function
        that ends it; counted at once (under `_lock`, so `resize` never remaps
        under a transaction it has not seen)."""
        with self._lock:
            txn = self.env.begin(buffers=True)
            end = _EndRead(self, txn)
            self.snapshots[end] = owner
            self.users += 1  # an open reader keeps the environment open
        return txn, end

    def resize(self, map_size: int) -> bool:
        """Set the map size (0: adopt another process's larger map).

        Remapping moves the map, and a view into the old one would read freed
        memory (or crash the process). So the read transactions of matches the
        user still holds, released or forgotten, are detached first
        (`detach_snapshots`: an open match keeps a copy of its bytes and stays
        valid; a blob that outlived its match is released and raises ValueError
        when read). One forgotten match must not stop every later call of the
        process on this path. False, the map unchanged, while a read
        transaction is still open: a blob exported to another object, or a read
        in progress in another thread.
        """
        with self._lock:
            held = list(self.snapshots)
        if held:
            detach_snapshots(held)
        with self._lock:
            if self.snapshots:
                return False
            self.env.set_mapsize(map_size)
            return True

    def detach(self, owner: object) -> None:
        """End the read transactions of `owner`'s open matches (a handle being
        closed), keeping copies of their bytes: a closed handle's forgotten
        matches keep neither the environment, nor a reader slot, nor a snapshot."""
        with self._lock:
            held = [end for end, by in self.snapshots.items() if by is owner]
        if held and self.key[1] == os.getpid():
            detach_snapshots(held, outliving=False)

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                del self._open[self.key]
                if self.key[1] == os.getpid():  # never close a parent's env in a forked child
                    self.env.close()


class _EndRead:
    """Ends a read transaction of a `_SharedEnv` (an object, not a closure: a closure
    naming itself would be a reference cycle, and the transaction, which holds its
    reader slot until freed, would wait for the garbage collector)."""

    __slots__ = ("shared", "txn")

    def __init__(self, shared: _SharedEnv, txn: lmdb.Transaction[bytes | memoryview]) -> None:
        self.shared = shared
        self.txn: lmdb.Transaction[bytes | memoryview] | None = txn

    def __call__(self) -> None:
        shared, txn = self.shared, self.txn
        if shared.key[1] != os.getpid() or txn is None:
            return  # a match inherited by a forked child: the snapshot is the parent's
        self.txn = None
        txn.abort()
        with shared._lock:
            shared.snapshots.pop(self, None)
        shared.release()


def _open_environment(
    path: str, map_sizes: tuple[int, ...], sync: bool, max_readers: int, read_only: bool
) -> lmdb.Environment:
    """Open the environment at `path` (creating it unless `read_only`) with the
    first of `map_sizes` that can be mapped, its errors as sippcache's."""
    if read_only:
        missing = missing_store(path, "data.mdb", "lmdb")
        if missing is not None:
            raise NoStore(f"no cache at lmdb://{path} ({missing})")
        check_store_files(path, STORE_FILES)
    else:
        prepare_directory(path, STORE_FILES)
        _check_room_for_lock_file(path, max_readers)

    def environment(lock: bool) -> lmdb.Environment:
        for map_size in map_sizes:
            try:
                return lmdb.open(
                    path,
                    map_size=map_size,
                    subdir=True,
                    sync=sync,
                    metasync=False,  # a commit's one flush, not two (MDB_NOMETASYNC: `sync` in docs/backends.md)
                    max_readers=max_readers,
                    readahead=False,
                    meminit=True,  # else a page's unused bytes are written from the heap: other data, secrets
                    mode=0o600,
                    max_dbs=0,
                    max_spare_txns=0,
                    readonly=read_only,
                    lock=lock,
                )
            except lmdb.MemoryError:  # no address space for this map (``ulimit -v``)
                if map_size == map_sizes[-1]:
                    raise
        raise AssertionError("no map size to try")

    try:
        try:
            return environment(lock=True)
        except lmdb.Error as exc:
            if not (read_only and _denied(exc)):
                raise
        # This user may not write lock.mdb: read without LMDB's lock table (see the module docstring).
        return environment(lock=False)
    except LMDBBackend.damage_errors as exc:
        raise CorruptStore(f"{path} is not a readable LMDB store: {exc}") from exc
    except lmdb.Error as exc:
        if _denied(exc):
            raise ReadOnlyStore(_not_writable(path, exc)) from exc
        raise StoreError(f"{path}: cannot open the LMDB store: {exc}") from exc


#: Bytes a reader's slot takes in LMDB's lock file (a cache line).
READER_SLOT = 64
#: Room a store needs beyond its readers' slots before LMDB makes its files: the lock file's
#: header and the data file's first pages, with a margin.
NEW_STORE_ROOM = 64 * 1024


def _check_room_for_lock_file(path: str, max_readers: int) -> None:
    """Raise `CacheFull` where LMDB would make its lock file with no room for it. LMDB sizes the
    file with ftruncate and writes it through a shared mapping: on a full disk its first write
    is a SIGBUS that kills the process, where a write to the data file is an error."""
    if os.path.exists(os.path.join(path, "lock.mdb")):
        return
    room, needed = free_bytes(path), READER_SLOT * max_readers + NEW_STORE_ROOM
    if room is not None and room < needed:
        raise CacheFull(f"{path}: no room to make an LMDB store ({room} bytes free, {needed} needed): the disk is full")


def _denied(exc: lmdb.Error) -> bool:
    """Whether an LMDB error means this user may not write the store's files."""
    return isinstance(exc, lmdb.ReadonlyError) or "Permission denied" in str(exc) or "Read-only" in str(exc)


def _not_writable(path: str, exc: BaseException) -> str:
    reason = str(exc).removeprefix(f"{path}: ")
    return f"{path} is not writable by this user ({reason}); open it with read_only=True to read it"


def _check_file_length(env: lmdb.Environment, path: str) -> None:
    """Refuse a data file shorter than its pages: touching mapped pages past the
    end of a file kills the process with SIGBUS."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    actual = os.path.getsize(os.path.join(path, "data.mdb"))
    if actual < needed:
        env.close()
        raise CorruptStore(f"{path}/data.mdb is {actual} bytes but its pages need {needed}: the file was cut short")


# After the backends' own locks (the order every thread takes them in).
fork_safe_lock(lambda: _SharedEnv._lock, lambda lock: setattr(_SharedEnv, "_lock", lock))


class _LMDBTxn:
    def __init__(self, txn: lmdb.Transaction[bytes | memoryview]) -> None:
        self._txn = txn

    def get(self, key: bytes) -> Blob | None:
        return self._txn.get(key)

    def put(self, key: bytes, value: Blob) -> None:
        self._txn.put(key, value)

    def delete(self, key: bytes) -> None:
        self._txn.delete(key)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, Blob]]:
        cursor = self._txn.cursor()
        if not cursor.set_range(prefix):
            return
        for key, value in cursor:
            key = bytes(key)
            if not key.startswith(prefix):
                return
            yield key, value


class LMDBBackend(KVBackend):
    """A persistent, multi-process cache in an LMDB environment at `location` (a directory)."""

    persistent: ClassVar[bool] = True
    reads_during_writes: ClassVar[bool] = True  # MVCC: a reader sees the last commit
    damage_errors = (
        lmdb.CorruptedError,
        lmdb.PageNotFoundError,
        lmdb.InvalidError,
        lmdb.VersionMismatchError,
        lmdb.PanicError,
        lmdb.BadTxnError,
    )
    library_errors = (lmdb.Error,)
    options: ClassVar[dict[str, type]] = {
        "max_bytes": Size, "max_entries": int, "map_size": Size, "sync": bool, "max_readers": int,
    }  # fmt: skip
    default_max_bytes: ClassVar[int | None] = DEFAULT_MAX_BYTES

    def __init__(
        self,
        location: str,
        *,
        max_bytes: Limit = UNSET,
        max_entries: Limit = UNSET,
        map_size: int | None = None,
        sync: bool = True,
        max_readers: int = 126,
        read_only: bool = False,
    ) -> None:
        if not 1 <= max_readers <= 65536:
            raise ValueError(f"max_readers must be in 1..65536, got {max_readers}")
        for name, value in (("max_bytes", max_bytes), ("map_size", map_size)):
            if isinstance(value, int) and not 0 < value <= MAX_MAP_SIZE:
                raise ValueError(f"{name} must be in 1..{MAX_MAP_SIZE} bytes (16 TiB), got {value}")
        path = directory_path("lmdb", location)
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, location=f"lmdb://{path}", read_only=read_only)
        budget = max_bytes if isinstance(max_bytes, int) else DEFAULT_MAX_BYTES
        map_sizes = (
            (map_size,)
            if map_size is not None
            else (
                min(MAX_MAP_SIZE, max(DEFAULT_MAP_FACTOR * budget, DEFAULT_MAP_FLOOR)),
                min(MAX_MAP_SIZE, 2 * budget + MAP_HEADROOM),
            )
        )
        self.path = path
        self._env_args = (path, map_sizes, sync, max_readers, read_only)
        self._owner = object()  # tags this handle's read transactions (`_SharedEnv.snapshots`)
        self._shared = _SharedEnv.acquire(*self._env_args)

    @classmethod
    def open_read_only(cls, location: str, options: Mapping[str, str]) -> LMDBBackend:
        """Open the environment read-only (see the module docstring)."""
        return cast(LMDBBackend, cls._from_url(location, options, read_only=True))

    @classmethod
    def missing_store(cls, location: str) -> str | None:
        """No directory, a file instead, or a directory without ``data.mdb``."""
        return missing_store(directory_path("lmdb", location), "data.mdb", "lmdb")

    def _library_error(self, exc: BaseException) -> SippcacheError:
        if isinstance(exc, lmdb.Error) and _denied(exc):
            return ReadOnlyStore(_not_writable(self.path, exc))
        return super()._library_error(exc)

    def _env(self) -> _SharedEnv:
        if self._shared.key[1] != os.getpid():  # forked: this process needs its own environment
            self._shared = _SharedEnv.acquire(*self._env_args)
        return self._shared

    @contextmanager
    def _transaction(self) -> Iterator[KVTxn]:
        shared = self._env()
        try:
            with self._begin(shared, lambda: shared.env.begin(write=True)) as txn:
                yield _LMDBTxn(txn)
        except lmdb.MapFullError:
            # Freed pages are reused only a few commits later: grow the map so the
            # caller's evict-and-retry can succeed (see `_SharedEnv.resize`).
            size = shared.env.info()["map_size"]
            grown = shared.resize(size * 2)
            raise CacheFull(
                f"{self.location}: the LMDB map ({size} bytes) is full"
                + ("; doubled it" if grown else "; it cannot grow while a blob of a match is exported or read")
            ) from None
        except (lmdb.DiskError, lmdb.Error) as exc:
            if isinstance(exc, lmdb.DiskError) or "Input/output error" in str(exc) or "No space" in str(exc):
                raise CacheFull(f"{self.location}: could not write (disk full or failing): {exc}") from exc
            raise

    def _reader(self) -> tuple[KVTxn, Callable[[], None]]:
        shared = self._env()
        txn, end = self._begin(shared, lambda: shared.begin_read(self._owner))
        return _LMDBTxn(txn), end

    def _begin(self, shared: _SharedEnv, begin: Callable[[], _T]) -> _T:
        """`begin()` a transaction; once more after adopting a map another process
        grew, or after freeing the reader slots of dead processes."""
        try:
            return begin()
        except lmdb.MapResizedError:  # another process grew the map: adopt its size
            if not shared.resize(0):
                raise StoreError(
                    f"{self.location}: another process grew the LMDB map, and this process cannot adopt it "
                    "while a blob of one of its matches is exported to another object (numpy.frombuffer(match.blob), "
                    "say) or another thread is reading it; drop those objects and retry"
                ) from None
        except lmdb.ReadersFullError:  # slots held by dead processes: free them
            shared.env.reader_check()
        return begin()

    def _close_store(self) -> None:
        self._shared.detach(self._owner)
        self._shared.release()
