"""Zero-copy matches: a blob that is a view of the store's memory, valid while
the read snapshot behind it is open.

The snapshot ends when the match is released. A match collected while its
blob is still referenced, as in ``bytes(cache.lookup(k).blob)`` (the match is
gone before bytes() reads the blob), keeps the blob valid instead: the blob is
remembered here and its snapshot ended at a later sweep, once nothing
references it any more. Sweeps run whenever a snapshot match is made and when
a backend closes.

A backend that must end snapshots the user still holds (LMDB, to remap its
memory: see `detach_snapshots`) detaches them: an open match gets a copy of
its bytes and stays valid; a blob that outlived its match cannot be copied
(the user holds the view itself) and is released.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from typing import cast

from ..protocol import Match

#: The function that ends a snapshot.
End = Callable[[], None]

# Zero-copy blobs still referenced when their match was collected, with the
# function that ends their snapshot.
_outliving_blobs: list[tuple[memoryview, End]] = []
# The open (unreleased, not collected) matches, by the function that ends their snapshot.
_open_matches: dict[End, weakref.ref[SnapshotMatch]] = {}
# Guards both, and every match's switch from open to released or detached.
_lock = threading.RLock()


def _reset_lock_in_child() -> None:
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def release_unreferenced_blobs() -> None:
    """End the snapshots of outliving blobs that nothing references any more."""
    with _lock:
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


def detach_snapshots(ends: Collection[End], *, outliving: bool = True) -> None:
    """End the snapshots `ends` that are behind matches the user still holds, so
    that the store may drop the memory they view (LMDB remapping its map, or
    closing a handle).

    - An open match keeps its bytes: its blob becomes a copy (a `memoryview` of
      `bytes`), and the view of the store is released.
    - With `outliving`, a blob that outlived its match is released: reading it
      raises ValueError (its holder has the view itself; nothing can swap it).
    - A blob exported to another object (``numpy.frombuffer(match.blob)``, a
      live ``struct.iter_unpack``) cannot be released (BufferError) and stays
      as it is, its snapshot open.

    Snapshots in `ends` behind neither (a read in progress) are left alone.
    """
    wanted = set(ends)
    with _lock:
        for end, ref in list(_open_matches.items()):
            match = ref() if _snapshot_of(end) in wanted else None
            if match is not None:
                match._detach()
        if not outliving:
            return
        keep = []
        for blob, end in _outliving_blobs:
            if _snapshot_of(end) in wanted:
                try:
                    blob.release()
                except BufferError:
                    keep.append((blob, end))
                    continue
                end()
            else:
                keep.append((blob, end))
        _outliving_blobs[:] = keep


def shared_end(end: End, count: int) -> list[End]:
    """`count` functions ending one snapshot that `count` matches share (a chain read in one
    transaction, `lookup_prefixes`): each match gets its own (the registry above keys matches
    by theirs), and the snapshot ends when the last of them is called. One match gets `end`."""
    if count == 1:
        return [end]
    left = [count]
    guard = threading.Lock()
    return [_SharedEnd(end, left, guard) for _ in range(count)]


class _SharedEnd:
    """One match's end of a snapshot it shares with others (`shared_end`); `detach_snapshots`
    finds the matches of a snapshot by it."""

    __slots__ = ("_guard", "_left", "snapshot")

    def __init__(self, snapshot: End, left: list[int], guard: threading.Lock) -> None:
        self.snapshot, self._left, self._guard = snapshot, left, guard

    def __call__(self) -> None:
        with self._guard:
            self._left[0] -= 1
            last = self._left[0] == 0
        if last:
            self.snapshot()


def _snapshot_of(end: End) -> End:
    """The function that ends the snapshot behind a match's `end`."""
    return end.snapshot if isinstance(end, _SharedEnd) else end


class SnapshotMatch(Match):
    """A match whose blob is a view valid until `end` ends its read snapshot."""

    __slots__ = ("_end",)

    def __init__(
        self, length: int, key: tuple[int, ...] | bytes | memoryview, blob: memoryview, namespace: str, end: End
    ) -> None:
        super().__init__(length, key, blob, namespace)
        self._end: End | None = end
        with _lock:
            _open_matches[end] = weakref.ref(self)
        if _outliving_blobs:
            release_unreferenced_blobs()

    def release(self) -> None:
        """End the blob's validity and the snapshot behind it (idempotent).

        Raises BufferError while an object made from the blob with the buffer
        protocol (a numpy array, say) is alive; delete it and call again.
        """
        with _lock:
            cast(memoryview, self.blob).release()  # a detached match's copy too
            end, self._end = self._end, None
            if end is not None:
                _open_matches.pop(end, None)
                end()

    def _detach(self) -> None:
        """(With `_lock` held.) Keep a copy of the blob and end the snapshot; left
        as it is while the blob is exported (BufferError)."""
        end = self._end
        if end is None:
            return
        view = cast(memoryview, self.blob)
        copy = memoryview(view.tobytes())
        try:
            view.release()
        except BufferError:
            return
        self.blob, self._end = copy, None
        _open_matches.pop(end, None)
        end()

    def __del__(self) -> None:
        if self._end is None:
            return
        if sys.getrefcount(self.blob) > 2:
            # The blob outlives its match: keep it valid and end the snapshot
            # once nothing holds the blob any more.
            with _lock:
                end, self._end = self._end, None
                if end is not None:
                    _open_matches.pop(end, None)
                    _outliving_blobs.append((cast(memoryview, self.blob), end))
            return
        try:
            self.release()
        except Exception:  # exported elsewhere; the snapshot goes with the GC
            pass
