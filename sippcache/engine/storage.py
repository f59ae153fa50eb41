"""What a storage library supplies to the engine: transactions on a byte map."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ..protocol import Blob


def owned_bytes(value: Blob) -> bytes:
    """`value` as an immutable bytes object for a store to keep: the caller's own bytes object when
    `value` is (a whole view of) one, with no copy (a state can be gigabytes); else a copy."""
    owner = value.obj if isinstance(value, memoryview) else value
    if type(owner) is bytes and len(owner) == memoryview(value).nbytes:
        return owner
    return bytes(value)


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
