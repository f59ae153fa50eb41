"""`diskcache:///path`: a SQLite-indexed directory store (the `diskcache` package).

sippcache does its own LRU accounting, so diskcache's eviction is switched off
(its default 1 GB `size_limit` silently dropped large states in
llama-cpp-python). Only bytes go in and only bytes come out: the `Disk`
subclass below refuses to unpickle anything, so a tampered cache file cannot
run code.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import diskcache

from ..engine import KVBackend, KVTxn, directory_path, prepare_directory
from ..errors import CacheFull, CorruptStore
from ..options import Size
from ..protocol import Blob

DEFAULT_MAX_BYTES = 8 * 1024**3

log = logging.getLogger("sippcache")


_FOREIGN_KEY = object()


class BytesOnlyDisk(diskcache.Disk):
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
        if type(key) is not bytes:
            raise TypeError("sippcache stores only bytes keys in diskcache")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            return _FOREIGN_KEY  # a pickled key (not ours): never unpickled, skipped by scans
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if type(value) is not bytes:
            raise TypeError("sippcache stores only bytes values in diskcache")
        return super().store(value, read, key)

    def fetch(self, mode: int, filename: Any, value: Any, read: bool) -> Any:
        if mode not in (diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY):
            raise CorruptStore(f"refusing to decode a diskcache value stored in mode {mode}")
        if filename is not None:
            self._inside(filename)
        return super().fetch(mode, filename, value, read)

    #: Value files to delete once the open transaction commits (None: no transaction).
    deferred: list[str] | None = None

    def remove(self, file_path: str) -> None:
        try:
            self._inside(file_path)
        except CorruptStore as exc:  # drop the row, never touch the outside file
            log.warning("sippcache: %s", exc)
            return
        if self.deferred is not None:  # the row's deletion may still roll back: keep the file until commit
            self.deferred.append(file_path)
        else:
            super().remove(file_path)


class _DiskCacheTxn:
    def __init__(self, cache: diskcache.Cache) -> None:
        self._cache = cache

    def get(self, key: bytes) -> bytes | None:
        try:
            return self._cache.get(key, retry=True)
        except CorruptStore as exc:  # a tampered row: its value is not read
            log.warning("sippcache: %s", exc)
            return None

    def put(self, key: bytes, value: Blob) -> None:
        self._cache.set(key, value if type(value) is bytes else bytes(value), retry=True)

    def delete(self, key: bytes) -> None:
        self._cache.delete(key, retry=True)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key in list(self._cache.iterkeys()):
            if isinstance(key, bytes) and key.startswith(prefix):
                value = self.get(key)
                if value is not None:
                    yield key, value


class DiskCacheBackend(KVBackend):
    """A persistent, multi-process cache in a diskcache directory at `location`."""

    persistent: ClassVar[bool] = True
    damage_errors = (sqlite3.DatabaseError,)
    options: ClassVar[dict[str, type]] = {"max_bytes": Size, "max_entries": int, "timeout": float}

    def __init__(
        self,
        location: str,
        *,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        max_entries: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        if not 0 <= timeout < float("inf"):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        path = directory_path("diskcache", location)
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, location=f"diskcache://{path}")
        self.path = path
        prepare_directory(path, ("cache.db", "cache.db-wal", "cache.db-shm"))
        try:
            self._cache = diskcache.Cache(
                path, timeout=timeout, disk=BytesOnlyDisk,
                eviction_policy="none", size_limit=2**62, cull_limit=0, statistics=False, tag_index=False,
            )  # fmt: skip
        except sqlite3.DatabaseError as exc:
            raise CorruptStore(f"{path} is not a readable diskcache store: {exc}") from exc
        for name in ("cache.db", "cache.db-wal", "cache.db-shm"):  # SQLite creates them 0644
            if os.path.exists(os.path.join(path, name)):
                os.chmod(os.path.join(path, name), 0o600)

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
            if "full" in str(exc) or "disk I/O error" in str(exc):
                raise CacheFull(f"{self.location}: could not write (disk full or failing): {exc}") from None
            raise
        except OSError as exc:  # a value file could not be written
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CacheFull(f"{self.location}: {exc}") from exc
            raise
        finally:
            disk.deferred = None  # rolled back: the files still belong to their rows

    def _reader(self) -> tuple[KVTxn, Callable[[], None]]:
        # A read transaction on this thread's connection, so one lookup or listing
        # sees a single commit (diskcache 5.x keeps one connection per thread).
        execute = self._cache._sql
        execute("BEGIN")
        return _DiskCacheTxn(self._cache), lambda: execute("COMMIT")

    def _close_store(self) -> None:
        self._cache.close()
