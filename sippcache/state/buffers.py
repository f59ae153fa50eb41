"""Memory that state bytes are copied into, used again: a new buffer's pages cost more than the copy.

On Linux a new buffer's first write takes a page fault per 4 KiB: on this project's
machines, copying a 256 MB state into new memory took 176 ms, into a buffer used before
24 ms (`benchmarks/state_path.py`, "memcpy (new buffer)"). States are copied out of
llama.cpp into these (`sippcache.llama.states.copy_state`), and entries are framed into
them before a backend copies them into its own storage (`sippcache.frame.encode_into`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["MADV_POPULATE_WRITE", "POPULATE_SLICE", "StateBuffers", "allocate", "populate"]

#: Linux's madvise(2) advice that makes a mapping's pages present and writable now (5.14 and later).
MADV_POPULATE_WRITE = 23
#: Pages are made a slice of this many bytes at a time: each call holds the GIL that long only.
POPULATE_SLICE = 2 << 20


def populate(
    buffer: mmap.mmap, stop: Callable[[], bool] | None = None, *, length: int | None = None, own: bool = False
) -> bool:
    """Make every page of the writable mapping `buffer` (of its first `length` bytes, if given)
    present now (`MADV_POPULATE_WRITE`, else a write to each page: the bytes are to be
    overwritten), a slice at a time; `stop`, asked before each slice, ends it there when it says
    True. True when every page was made. With `own` (no other thread can see `buffer` yet: a
    buffer made ahead in a helper thread), madvise is called through ctypes, which lets the GIL go
    while the kernel makes a slice's pages: with `mmap.madvise`, which holds it, a gemma-3-270m
    process whose first request came at once waited through most of its 20 ms of pages. A page
    fault per 4 KiB as a copy reaches them costs more than the copy; and one call for the whole
    mapping (``mmap(MAP_POPULATE)``) holds the GIL throughout, so every other thread, the proxy's
    event loop too, waits: 2.2 s for 1 GiB of /dev/shm on this project's machines, and on an H200
    host a restarted proxy's first request waited 350-580 ms, likely for its staging files."""
    end = len(buffer) if length is None else min(length, len(buffer))
    for start in range(0, end, POPULATE_SLICE):
        if stop is not None and stop():
            return False
        size = min(POPULATE_SLICE, end - start)
        if own and _madvise_unlocked(buffer, start, size):
            continue
        try:
            buffer.madvise(MADV_POPULATE_WRITE, start, size)
        except (OSError, ValueError, AttributeError):  # before Linux 5.14, or elsewhere
            buffer[start : start + size : mmap.PAGESIZE] = bytes(len(range(0, size, mmap.PAGESIZE)))
    return True


def _madvise_unlocked(buffer: mmap.mmap, start: int, size: int) -> bool:
    """`MADV_POPULATE_WRITE` on `size` bytes of `buffer` from `start`, the GIL let go meanwhile
    (a ctypes call); False where that cannot be done (no libc madvise, an error): do it otherwise."""
    madvise = _libc_madvise()
    if madvise is None:
        return False
    try:
        view = (ctypes.c_char * len(buffer)).from_buffer(buffer)  # held: the mapping cannot go meanwhile
    except (TypeError, ValueError):  # not writable, say
        return False
    try:
        return bool(madvise(ctypes.addressof(view) + start, size, MADV_POPULATE_WRITE) == 0)
    finally:
        del view


_madvise: list[Any] = []


def _libc_madvise() -> Any:
    """libc's madvise through ctypes, or None where there is none."""
    if not _madvise:
        try:
            function: Any = ctypes.CDLL(None, use_errno=True).madvise
            function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):
            function = None
        _madvise.append(function)
    return _madvise[0]


def allocate(fd: int, offset: int, length: int) -> None:
    """Give bytes `offset` to `offset + length` of the file `fd` their blocks now, the file growing
    to hold them, or raise OSError (ENOSPC: no room). Before a file is mapped and copied into: a
    page its file system cannot allocate when a copy first writes it is a SIGBUS, which kills the
    process (a container's /dev/shm is 64 MB unless it is given more, and a state can be a
    gigabyte). Where there is no posix_fallocate (macOS), zeros are written, which allocates too."""
    if length <= 0:
        return
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, offset, length)
        return
    zeros = bytes(min(length, POPULATE_SLICE))
    for start in range(offset, offset + length, len(zeros)):
        os.pwrite(fd, zeros[: min(len(zeros), offset + length - start)], start)


class StateBuffers:
    """Buffers that state bytes are written into, used again once they are stored
    (`give_back`). A buffer is anonymous memory reserved for twice the size it is first
    taken for, so that a conversation's next, longer state fits it (pages never touched
    cost nothing). At most `keep` free buffers are kept, holding at most `limit` bytes
    that were written to; a larger buffer is not kept. Threads may share one."""

    def __init__(self, *, keep: int = 2, limit: int = 2 * 1024**3) -> None:
        self.keep, self.limit = keep, limit
        self._free: list[mmap.mmap] = []
        # each buffer taken or free -> the most bytes written to it (gone with the buffer)
        self._touched: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # taken on one thread, given back on another (the writer's)

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least `size` bytes: the smallest free one that holds it, else a new one."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= size]
            if fits:
                buffer = min(fits, key=len)
                self._free.remove(buffer)
                self._touched[buffer] = max(self._touched[buffer], size)
                return buffer
        try:
            buffer = mmap.mmap(-1, max(2 * size, mmap.PAGESIZE))
        except OSError:  # no room to reserve twice as much (strict overcommit): exactly as much
            buffer = mmap.mmap(-1, max(size, 1))
        with self._lock:
            self._touched[buffer] = size
        return buffer

    def give_back(self, state: memoryview) -> None:
        """The buffer `state` is in (a view of a buffer `take` gave: what `copy_state` and
        `frame.encode_into` return) is free again; it is kept for the next state if it is one of
        these buffers and within `keep` and `limit` (the smallest free ones go first: the next
        state is likely larger)."""
        buffer = state.obj
        with self._lock:
            if not isinstance(buffer, mmap.mmap) or buffer not in self._touched or buffer in self._free:
                return
            self._free.append(buffer)
            self._free.sort(key=len)
            while self._free and (
                len(self._free) > self.keep or sum(self._touched[b] for b in self._free) > self.limit
            ):
                del self._touched[self._free.pop(0)]

    @property
    def free_bytes(self) -> int:
        """The bytes written to the free buffers kept (what they hold of memory)."""
        with self._lock:
            return sum(self._touched[b] for b in self._free)
