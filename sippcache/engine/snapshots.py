"""Zero-copy matches: a blob that is a view of the store's memory, valid while
the read snapshot behind it is open.

The snapshot ends when the match is released. A match collected while its
blob is still referenced, as in ``bytes(cache.lookup(k).blob)`` (the match is
gone before bytes() reads the blob), keeps the blob valid instead: the blob is
remembered here and its snapshot ended at a later sweep, once nothing
references it any more. Sweeps run whenever a snapshot match is made and when
a backend closes.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import cast

from ..protocol import Match

# Zero-copy blobs still referenced when their match was collected, with the
# function that ends their snapshot.
_outliving_blobs: list[tuple[memoryview, Callable[[], None]]] = []
_outliving_lock = threading.Lock()


def _reset_outliving_lock_in_child() -> None:
    global _outliving_lock
    _outliving_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_outliving_lock_in_child)


def release_unreferenced_blobs() -> None:
    """End the snapshots of outliving blobs that nothing references any more."""
    with _outliving_lock:
        keep = []
        for blob, end in _outliving_blobs:
            # References: the list's tuple, the loop variable, getrefcount's argument.
            if sys.getrefcount(blob) > 3:
                keep.append((blob, end))
                continue
            try:
                blob.release()
                end()
            except Exception:  # exported (BufferError): try again at the next sweep
                keep.append((blob, end))
        _outliving_blobs[:] = keep


class SnapshotMatch(Match):
    """A match whose blob is a view valid until `end` ends its read snapshot."""

    __slots__ = ("_end",)

    def __init__(
        self, length: int, key: tuple[int, ...] | bytes, blob: memoryview, namespace: str, end: Callable[[], None]
    ) -> None:
        super().__init__(length, key, blob, namespace)
        self._end: Callable[[], None] | None = end
        if _outliving_blobs:
            release_unreferenced_blobs()

    def release(self) -> None:
        """End the blob's validity and the snapshot behind it (idempotent).

        Raises BufferError while an object made from the blob with the buffer
        protocol (a numpy array, say) is alive; delete it and call again.
        """
        if self._end is None:
            return
        cast(memoryview, self.blob).release()
        end, self._end = self._end, None
        end()

    def __del__(self) -> None:
        if self._end is None:
            return
        if sys.getrefcount(self.blob) > 2:
            # The blob outlives its match: keep it valid and end the snapshot
            # once nothing holds the blob any more.
            with _outliving_lock:
                _outliving_blobs.append((cast(memoryview, self.blob), self._end))
            self._end = None
            return
        try:
            self.release()
        except Exception:  # exported elsewhere; the snapshot goes with the GC
            pass
