"""`diskcache:///path`: a SQLite-indexed directory store (the `diskcache` package).

sippcache does its own LRU accounting, so diskcache's eviction is switched off
(its default 1 GB `size_limit` silently dropped large states in
llama-cpp-python). Only bytes go in and only bytes come out (a large value
as a view of its value file, mapped read-only): the `Disk` subclass below
refuses to unpickle anything, so a tampered cache file cannot run code.

A read-only open does not use `diskcache.Cache`, which writes its settings
whenever it opens: it reads the ``Cache`` table through its own SQLite
connection opened with ``mode=ro``. If SQLite cannot open the database that
way (a WAL database whose ``-shm`` file this user may not create), it opens it
``immutable``, without locking: safe for a store nobody writes meanwhile, not
for one a writer is changing.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, cast
from urllib.parse import quote

import diskcache  # type: ignore[import-untyped]  # diskcache ships no type information

from ..catalog import UNSET
from ..engine import KVBackend, KVTxn, directory_path, prepare_directory
from ..engine.directory import check_store_files, missing_store
from ..errors import CacheFull, CorruptStore, NoStore, ReadOnlyStore, SippcacheError, StoreError
from ..mirror import Limit
from ..options import Size
from ..protocol import Blob

DEFAULT_MAX_BYTES = 8 * 1024**3
#: Value files at least this large are read as read-only mappings, not into new memory: a
#: restore then copies a state from the page cache once (0.5x memcpy, against 0.14x for a read).
MAP_FROM_BYTES = 1 << 20
#: A value file is written from the caller's memory in slices of this many bytes.
WRITE_SLICE = 8 << 20
#: The database diskcache keeps its index (and small values) in, and SQLite's files beside it.
DATABASE = "cache.db"
STORE_FILES = (DATABASE, "cache.db-wal", "cache.db-shm")

log = logging.getLogger("sippcache")


_FOREIGN_KEY = object()


class BytesOnlyDisk(diskcache.Disk):  # type: ignore[misc]  # diskcache is untyped
    """A diskcache `Disk` that stores bytes keys and values, never unpickles,
    never touches a value file outside its directory (the file name comes from
    the database, which may have been tampered with), and keeps value files
    0600 in 0700 folders (entries hold users' prompts)."""

    def _inside(self, filename: str) -> str:
        root = os.path.realpath(self._directory)
        full = os.path.realpath(os.path.join(root, filename))
        if not full.startswith(root + os.sep):
            raise CorruptStore(f"refusing value file {filename!r}: it is outside {root}")
        return full

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: Any = None) -> int:
        # Replaces diskcache's (5.x) file writer: real 0700 folders inside the store
        # (never through a planted link) and a new file created 0600, never followed.
        if mode != "xb":
            raise TypeError("sippcache writes only binary value files")
        self._inside(os.path.relpath(full_path, self._directory))
        fd = self._create(full_path)
        size = 0
        with os.fdopen(fd, "wb") as writer:
            for chunk in iterator:
                size += len(chunk)
                writer.write(chunk)
        return size

    def _create(self, full_path: str, attempts: int = 10) -> int:
        # Another process's `remove` deletes folders it emptied (os.removedirs), so a
        # folder made here may vanish before the file is created in it: make it again,
        # as diskcache's own writer does.
        for _ in range(attempts - 1):
            try:
                return self._create_once(full_path)
            except FileNotFoundError:
                continue
        return self._create_once(full_path)

    def _create_once(self, full_path: str) -> int:
        self._make_folders(os.path.dirname(full_path))
        return os.open(full_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)

    def _make_folders(self, target: str) -> None:
        folder = self._directory
        for part in os.path.relpath(target, self._directory).split(os.sep):
            folder = os.path.join(folder, part)
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
            if not stat.S_ISDIR(os.lstat(folder).st_mode):  # a planted link or file: never write through it
                raise CorruptStore(f"refusing value folder {folder}: it is not a real folder")

    def put(self, key: Any) -> tuple[Any, bool]:
        """The database key of `key`, which must be bytes (stored raw, never pickled)."""
        if type(key) is not bytes:
            raise TypeError("sippcache stores only bytes keys in diskcache")
        return cast(tuple[Any, bool], super().put(key))

    def get(self, key: Any, raw: bool) -> Any:
        """A key read from the database; a pickled one (not ours) is never unpickled."""
        if not raw:
            return _FOREIGN_KEY  # a pickled key (not ours): never unpickled, skipped by scans
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        """The database fields of `value`: bytes, or a view of bytes. A value file is written
        straight from the caller's memory in slices (diskcache's own writer takes bytes, a copy
        of a whole state, and writes them a line at a time)."""
        if type(value) is not bytes and not isinstance(value, memoryview):
            raise TypeError("sippcache stores only bytes values in diskcache")
        view = memoryview(value).cast("B")
        if view.nbytes < self.min_file_size:
            return super().store(bytes(view), read, key)
        filename, full_path = self.filename(key, value)
        slices = (view[at : at + WRITE_SLICE] for at in range(0, view.nbytes, WRITE_SLICE))
        return self._write(full_path, slices, "xb"), diskcache.core.MODE_BINARY, filename, None

    def fetch(self, mode: int, filename: Any, value: Any, read: bool) -> Any:
        """A stored value, read only in the raw or binary modes and only inside the store; a
        large value file as a read-only mapping (see `MAP_FROM_BYTES`)."""
        if mode not in (diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY):
            raise CorruptStore(f"refusing to decode a diskcache value stored in mode {mode}")
        if filename is not None:
            full = self._inside(filename)
            if mode == diskcache.core.MODE_BINARY and not read:
                return _read_value_file(full)
        return super().fetch(mode, filename, value, read)

    #: Value files to delete once the open transaction commits (None: no transaction).
    deferred: list[str] | None = None

    def remove(self, file_path: str) -> None:
        """Delete a value file inside the store, once the transaction that dropped its row commits."""
        try:
            self._inside(file_path)
        except CorruptStore as exc:  # drop the row, never touch the outside file
            log.warning("sippcache: %s", exc)
            return
        if self.deferred is not None:  # the row's deletion may still roll back: keep the file until commit
            self.deferred.append(file_path)
        else:
            super().remove(file_path)


def _read_value_file(path: str) -> Blob:
    """A value file's bytes: a view of a read-only mapping of it if it is large, else read.
    The mapping holds its own memory (it outlives the read transaction, and the file's removal:
    value files are only ever created whole, then removed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size >= MAP_FROM_BYTES:
            return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
        with open(fd, "rb", closefd=False) as reader:
            return reader.read()
    finally:
        os.close(fd)


class _DiskCacheTxn:
    def __init__(self, cache: diskcache.Cache) -> None:
        self._cache = cache

    def get(self, key: bytes) -> Blob | None:
        try:
            return cast(Blob | None, self._cache.get(key, retry=True))
        except CorruptStore as exc:  # a tampered row: its value is not read
            log.warning("sippcache: %s", exc)
            return None

    def put(self, key: bytes, value: Blob) -> None:
        self._cache.set(key, value if isinstance(value, bytes | memoryview) else bytes(value), retry=True)

    def delete(self, key: bytes) -> None:
        self._cache.delete(key, retry=True)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, Blob]]:
        for key in list(self._cache.iterkeys()):
            if isinstance(key, bytes) and key.startswith(prefix):
                value = self.get(key)
                if value is not None:
                    yield key, value


class _ReadOnlyTxn:
    """Reads of diskcache's ``Cache`` table (rows with bytes keys), values decoded
    by `BytesOnlyDisk` as `diskcache.Cache.get` would; every write is refused."""

    _SELECT = "SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND (expire_time IS NULL OR expire_time > ?)"

    def __init__(self, con: sqlite3.Connection, disk: BytesOnlyDisk) -> None:
        self.con = con
        self._disk = disk
        self.pid = os.getpid()  # a SQLite connection must not be used across fork

    def get(self, key: bytes) -> Blob | None:
        rows = self.con.execute(self._SELECT + " AND key = ?", (time.time(), key)).fetchall()
        return self._value(rows[0]) if rows else None

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, Blob]]:
        for row in self.con.execute(self._SELECT, (time.time(),)).fetchall():
            if isinstance(row[0], bytes) and row[0].startswith(prefix):
                value = self._value(row)
                if value is not None:
                    yield row[0], value

    def _value(self, row: tuple[Any, ...]) -> Blob | None:
        _, mode, filename, value = row
        try:
            fetched = self._disk.fetch(mode, filename, value, False)
        except (CorruptStore, OSError) as exc:  # a tampered row, a value file gone: not read
            log.warning("sippcache: %s", exc)
            return None
        return fetched if isinstance(fetched, bytes | memoryview) else None

    def put(self, key: bytes, value: Blob) -> None:
        raise ReadOnlyStore("this diskcache store is open read-only")

    def delete(self, key: bytes) -> None:
        raise ReadOnlyStore("this diskcache store is open read-only")


def _disk_full(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite failed for want of room ("database or disk is full"), not for damaged files."""
    return "full" in str(exc)


def _open_read_only(path: str) -> sqlite3.Connection:
    """A connection that cannot write `path`'s database (see the module docstring)."""
    uri = "file:" + quote(os.path.join(path, DATABASE))
    try:
        con = sqlite3.connect(uri + "?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
        con.execute("SELECT 1 FROM Cache LIMIT 1").fetchall()
    except sqlite3.OperationalError as exc:  # SQLite could not set up WAL's shared memory here
        if "unable to open" not in str(exc) and "readonly" not in str(exc):
            raise
        con = sqlite3.connect(uri + "?immutable=1", uri=True, isolation_level=None, check_same_thread=False)
    return con


class DiskCacheBackend(KVBackend):
    """A persistent, multi-process cache in a diskcache directory at `location`."""

    persistent: ClassVar[bool] = True
    reads_during_writes: ClassVar[bool] = True  # WAL: a reader (its thread's connection) sees the last commit
    views_need_their_reader: ClassVar[bool] = False  # a mapped value file holds its own memory
    damage_errors = (sqlite3.DatabaseError,)
    library_errors = (sqlite3.Error,)
    options: ClassVar[dict[str, type]] = {"max_bytes": Size, "max_entries": int, "timeout": float}
    default_max_bytes: ClassVar[int | None] = DEFAULT_MAX_BYTES

    def __init__(
        self,
        location: str,
        *,
        max_bytes: Limit = UNSET,
        max_entries: Limit = UNSET,
        timeout: float = 60.0,
        read_only: bool = False,
    ) -> None:
        if not 0 <= timeout < float("inf"):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        path = directory_path("diskcache", location)
        super().__init__(
            max_bytes=max_bytes, max_entries=max_entries, location=f"diskcache://{path}", read_only=read_only
        )
        self.path = path
        self._cache: Any = None  # a diskcache.Cache, for writing
        self._reading: _ReadOnlyTxn | None = None  # reads through a read-only connection
        try:
            if read_only:
                self._open_for_reading()
            else:
                self._open_for_writing(timeout)
        except sqlite3.Error as exc:
            error = self._library_error(exc)
            if isinstance(error, CorruptStore):
                error = CorruptStore(f"{path} is not a readable diskcache store: {exc}")
            raise error from exc

    def _open_for_writing(self, timeout: float) -> None:
        prepare_directory(self.path, STORE_FILES)
        self._cache = diskcache.Cache(
            self.path,
            timeout=timeout,
            disk=BytesOnlyDisk,
            eviction_policy="none",
            size_limit=2**62,
            cull_limit=0,
            statistics=False,
            tag_index=False,
        )
        for name in STORE_FILES:  # SQLite creates them 0644
            if os.path.exists(os.path.join(self.path, name)):
                os.chmod(os.path.join(self.path, name), 0o600)

    def _open_for_reading(self) -> None:
        missing = missing_store(self.path, DATABASE, "diskcache")
        if missing is not None:
            raise NoStore(f"no cache at {self.location} ({missing})")
        check_store_files(self.path, STORE_FILES)
        self._connect_for_reading()

    def _connect_for_reading(self) -> None:
        self._reading = _ReadOnlyTxn(_open_read_only(self.path), BytesOnlyDisk(self.path))

    @classmethod
    def open_read_only(cls, location: str, options: Mapping[str, str]) -> DiskCacheBackend:
        """Read the store through a read-only SQLite connection (see the module docstring)."""
        return cast(DiskCacheBackend, cls._from_url(location, options, read_only=True))

    @classmethod
    def missing_store(cls, location: str) -> str | None:
        """No directory, a file instead, or a directory without ``cache.db``."""
        return missing_store(directory_path("diskcache", location), DATABASE, "diskcache")

    def _library_error(self, exc: BaseException) -> SippcacheError:
        text = str(exc)
        if isinstance(exc, sqlite3.OperationalError):
            if _disk_full(exc):  # an OperationalError is a DatabaseError, but the files are not damaged
                return CacheFull(f"{self.location}: could not write (the disk is full): {text}")
            if "readonly" in text or "unable to open" in text:
                return ReadOnlyStore(
                    f"{self.path} is not writable by this user ({text}); open it with read_only=True to read it"
                )
            if "locked" in text:
                return StoreError(f"{self.location}: {text}")
        return super()._library_error(exc)

    @contextmanager
    def _transaction(self) -> Iterator[KVTxn]:
        disk = self._cache.disk
        disk.deferred = []
        try:
            with self._cache.transact(retry=True):
                yield _DiskCacheTxn(self._cache)
            committed, disk.deferred = disk.deferred, None
            for file_path in committed:
                disk.remove(file_path)
        except sqlite3.OperationalError as exc:
            if _disk_full(exc) or "disk I/O error" in str(exc):
                raise CacheFull(f"{self.location}: could not write (disk full or failing): {exc}") from None
            raise
        except OSError as exc:  # a value file could not be written
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CacheFull(f"{self.location}: {exc}") from exc
            raise
        finally:
            disk.deferred = None  # rolled back: the files still belong to their rows

    def _reader(self) -> tuple[KVTxn, Callable[[], None]]:
        # A read transaction, so one lookup or listing sees a single commit (on this
        # thread's connection: diskcache 5.x keeps one connection per thread).
        if self._reading is not None:
            if self._reading.pid != os.getpid():  # forked: leave the parent's connection alone
                self._connect_for_reading()
                assert self._reading is not None
            execute: Callable[[str], Any] = self._reading.con.execute
            txn: KVTxn = self._reading
        else:
            execute = self._cache._sql
            txn = _DiskCacheTxn(self._cache)
        execute("BEGIN")
        return txn, lambda: execute("COMMIT")

    def _close_store(self) -> None:
        if self._reading is not None:
            if self._reading.pid == os.getpid():
                self._reading.con.close()
        else:
            self._cache.close()
