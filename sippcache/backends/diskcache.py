"""`diskcache:///path`: a SQLite-indexed directory store (the `diskcache` package).

sippcache does its own LRU accounting, so diskcache's eviction is switched off
(its default 1 GB `size_limit` silently dropped large states in
llama-cpp-python). Only bytes go in and only bytes come out: the `Disk`
subclass below refuses to unpickle anything, so a tampered cache file cannot
run code.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Optional, Union

import diskcache

from ..engine import KVBackend, KVTxn, directory_path
from ..errors import CacheFull
from ..options import Size

DEFAULT_MAX_BYTES = 8 * 1024**3


class BytesOnlyDisk(diskcache.Disk):
    """A diskcache `Disk` that stores bytes keys and values and never unpickles."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not bytes:
            raise TypeError("sippcache stores only bytes keys in diskcache")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise ValueError("refusing to unpickle a diskcache key")
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if type(value) is not bytes:
            raise TypeError("sippcache stores only bytes values in diskcache")
        return super().store(value, read, key)

    def fetch(self, mode: int, filename: Any, value: Any, read: bool) -> Any:
        if mode not in (diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY):
            raise ValueError(f"refusing to decode a diskcache value stored in mode {mode}")
        return super().fetch(mode, filename, value, read)


class _DiskCacheTxn:
    def __init__(self, cache: diskcache.Cache) -> None:
        self._cache = cache

    def get(self, key: bytes) -> Optional[bytes]:
        return self._cache.get(key, retry=True)

    def put(self, key: bytes, value: Union[bytes, memoryview]) -> None:
        self._cache.set(key, value if type(value) is bytes else bytes(value), retry=True)

    def delete(self, key: bytes) -> None:
        self._cache.delete(key, retry=True)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key in list(self._cache.iterkeys()):
            if isinstance(key, bytes) and key.startswith(prefix):
                value = self._cache.get(key, retry=True)
                if value is not None:
                    yield key, value


class DiskCacheBackend(KVBackend):
    """A persistent, multi-process cache in a diskcache directory at `location`."""

    persistent: ClassVar[bool] = True
    options: ClassVar[dict[str, type]] = {"max_bytes": Size, "max_entries": int, "timeout": float}

    def __init__(
        self,
        location: str,
        *,
        max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
        max_entries: Optional[int] = None,
        timeout: float = 60.0,
    ) -> None:
        path = directory_path("diskcache", location)
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, location=f"diskcache://{path}")
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)
        self._cache = diskcache.Cache(
            path, timeout=timeout, disk=BytesOnlyDisk,
            eviction_policy="none", size_limit=2**62, cull_limit=0, statistics=False, tag_index=False,
        )  # fmt: skip

    @contextmanager
    def _transaction(self) -> Iterator[KVTxn]:
        try:
            with self._cache.transact(retry=True):
                yield _DiskCacheTxn(self._cache)
        except sqlite3.OperationalError as exc:
            if "full" in str(exc):
                raise CacheFull(f"{self.location}: {exc}") from None
            raise

    def _reader(self) -> tuple[KVTxn, Callable[[], None]]:
        return _DiskCacheTxn(self._cache), lambda: None

    def _close_store(self) -> None:
        self._cache.close()
