"""What a storage library supplies to the engine: transactions on a byte map."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ..protocol import Blob


class KVTxn(Protocol):
    """A transaction on the backing byte map; reads see one consistent state."""

    def get(self, key: bytes) -> Blob | None:
        """The value under `key`, or None."""

    def put(self, key: bytes, value: Blob) -> None:
        """Set `key` to `value`."""

    def delete(self, key: bytes) -> None:
        """Remove `key` if present."""

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, Blob]]:
        """Every (key, value) whose key starts with `prefix`."""
