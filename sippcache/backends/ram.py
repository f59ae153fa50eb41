"""`ram://`: entries in this process's memory; gone when it exits.

Lookups return the stored bytes object itself: no copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar

from ..catalog import UNSET
from ..engine import KVBackend, KVTxn, owned_bytes
from ..eviction import DEFAULT_POLICY, EvictionPolicy
from ..mirror import Limit
from ..options import Size
from ..protocol import Blob

DEFAULT_MAX_BYTES = 1024**3


class _DictTxn:
    """Transactions on a dict. The engine's lock already serialises every
    operation, so a write only has to be undoable: it logs what it overwrote."""

    def __init__(self, data: dict[bytes, bytes], undo: list[tuple[bytes, bytes | None]] | None) -> None:
        self._data = data
        self._undo = undo

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def put(self, key: bytes, value: Blob) -> None:
        assert self._undo is not None, "write in a read transaction"
        self._undo.append((key, self._data.get(key)))
        self._data[key] = owned_bytes(value)

    def delete(self, key: bytes) -> None:
        assert self._undo is not None, "write in a read transaction"
        if key in self._data:
            self._undo.append((key, self._data.pop(key)))

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return ((k, v) for k, v in list(self._data.items()) if k.startswith(prefix))


class RAMBackend(KVBackend):
    """An in-process cache, bounded by `max_bytes` (default 1 GiB) and optionally
    `max_entries`, evicting by `eviction` (the benchmarks compare policies on it)."""

    persistent: ClassVar[bool] = False
    keeps_bytes: ClassVar[bool] = True
    options: ClassVar[dict[str, type]] = {"max_bytes": Size, "max_entries": int}
    default_max_bytes: ClassVar[int | None] = DEFAULT_MAX_BYTES

    def __init__(
        self,
        location: str = "",
        *,
        max_bytes: Limit = UNSET,
        max_entries: Limit = UNSET,
        eviction: EvictionPolicy = DEFAULT_POLICY,
    ) -> None:
        if location:
            raise ValueError(f"ram:// takes no path, got {location!r}")
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, location="ram://", eviction=eviction)
        self._data: dict[bytes, bytes] = {}

    @contextmanager
    def _transaction(self) -> Iterator[KVTxn]:
        undo: list[tuple[bytes, bytes | None]] = []
        try:
            yield _DictTxn(self._data, undo)
        except BaseException:
            for key, old in reversed(undo):
                if old is None:
                    self._data.pop(key, None)
                else:
                    self._data[key] = old
            raise

    def _reader(self) -> tuple[KVTxn, Callable[[], None]]:
        return _DictTxn(self._data, None), lambda: None

    def _close_store(self) -> None:
        self._data.clear()
