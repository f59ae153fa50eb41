"""Where slot files go through between llama-server and the store.

llama-server saves and restores slots only as files in its ``--slot-save-path``.
The proxy's staging folder is that place: in RAM where the machine has a tmpfs
with room (`staging_base`), private to one proxy process (`staging_dir`), each
slot's restore file kept mapped between restores (`StagingFile`), and what
proxies killed outright left there removed (`remove_stale_files`).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence

from ..engine.directory import free_bytes, huge_pages
from ..processes import written_by_a_live_process
from ..state.buffers import allocate, populate
from . import slotfile

__all__ = [
    "KEPT_PREFIX",
    "RAM_DISK",
    "READY_BYTES",
    "STAGING_FILE_MODE",
    "STAGING_PREFIX",
    "StagingFile",
    "kept_dir",
    "made_ahead",
    "ready_budget",
    "remove_stale_files",
    "staging_base",
    "staging_dir",
]

log = logging.getLogger("sippcache.proxy")

#: The private staging directories of managed proxies: this, the proxy's pid, "-", a random part.
STAGING_PREFIX = "sippcache-proxy-"
#: Where managed proxies with --keep-ready leave their ready slot files, beside their staging
#: directories: this and the user's id.
KEPT_PREFIX = "sippcache-kept-"
#: The most --ready-bytes takes by default: as llama-server's own --cache-ram (8192 MiB), which a
#: managed llama-server is started without.
READY_BYTES = 8 << 30


#: Managed proxies stage slot files in RAM here, where it has `RAM_DISK_ROOM` bytes free.
RAM_DISK = "/dev/shm"
#: A gigabyte: a state of 8K tokens of an 8B model in f16. A container's /dev/shm is 64 MB unless it
#: is given more: staged there, the states a proxy saves and restores would not fit.
RAM_DISK_ROOM = 1 << 30
#: A restore file's mode (less the umask): readable by a llama-server run as another user (a
#: container of its own sharing the folder), as its own slot files are. Made 0600, every restore
#: such a server was asked for was refused. Who else may read it is the folder's to say: a
#: managed proxy's staging folder is its own (0700).
STAGING_FILE_MODE = 0o644
#: A staging file made ahead (`StagingFile.reserve`) is allocated this many bytes at a time: a
#: restore that comes meanwhile waits for one such step at most, not for the whole file.
ALLOCATE_SLICE = 64 << 20
#: A staging file a restore must grow (where llama.cpp reads a longer file: `StagingFile.write`)
#: grows by this share of the state more, so that a conversation's next, slightly longer state
#: fits without growing it (and mapping it) again.
GROWTH_SLACK = 1 / 8


def staging_base() -> str:
    """Where managed proxies make their staging directories: in RAM where the machine has a tmpfs
    with room for states, else the temporary directory (a disk's page cache)."""
    base = tempfile.gettempdir()
    if not (os.path.isdir(RAM_DISK) and os.access(RAM_DISK, os.W_OK)):
        return base
    room = free_bytes(RAM_DISK) or 0
    if room >= RAM_DISK_ROOM:
        return RAM_DISK
    log.info(
        "sippcache proxy: %s has %d MiB free (under %d MiB): slot files go through %s",
        RAM_DISK,
        room >> 20,
        RAM_DISK_ROOM >> 20,
        base,
    )
    return base


def note_pages(folder: str) -> None:
    """Say whether the tmpfs slot files go through keeps them in huge pages (nothing for a disk)."""
    huge = huge_pages(folder)
    if huge is None:
        return
    log.info(
        "sippcache proxy: slot files go through %s, a tmpfs with %s",
        folder,
        "huge pages" if huge else "4 KiB pages (one with huge pages: --staging-dir; docs/proxy.md)",
    )


def warn_if_cramped(folder: str) -> None:
    """A warning where the folder slot files go through has room for less than a large state."""
    room = free_bytes(folder) or 0
    if room < RAM_DISK_ROOM:
        log.warning(
            "sippcache proxy: %s has %d MiB free: a state larger than that is neither saved nor restored",
            folder,
            room >> 20,
        )


def made_ahead(wanted: Sequence[tuple[str, int, int]], room: int) -> list[tuple[str, int, int]]:
    """The slots (upstream URL, slot, bytes) whose staging files are made at start, in order, while
    they take at most half the staging folder's `room`: made for every slot of a proxy with many
    (each as large as the largest state seen), they would fill a RAM disk, and llama-server's
    saves into it would fail. A slot left out makes its file at its first restore."""
    budget, ahead = room // 2, []
    for url, slot, nbytes in wanted:
        if nbytes > budget:
            break
        budget -= nbytes
        ahead.append((url, slot, nbytes))
    return ahead


def staging_dir(base: str) -> str:
    """A private directory for slot files in `base`; those that proxies killed outright left there
    are removed first."""
    remove_stale_files(base, (STAGING_PREFIX,))
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=base)


def kept_dir(base: str) -> str:
    """The folder in `base` where managed proxies of this user keep ready slot files between runs
    (--keep-ready): made private (0700). Raises OSError (PermissionError where it is not this user's)."""
    path = os.path.join(base, f"{KEPT_PREFIX}{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise OSError(f"cannot make {path} for --keep-ready: {exc}") from exc
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} (for --keep-ready) is not a folder only this user may use")
    return path


def ready_budget(room: int) -> int:
    """The default --ready-bytes for a slot folder with `room` bytes free: a quarter of it (staging
    files made ahead take at most half: `made_ahead`), at most `READY_BYTES`."""
    return min(READY_BYTES, room // 4)


def unreadable_by_others(path: str) -> str:
    """A hint for a refused restore whose file only this user may read (a umask of 077): a
    llama-server run as another user (a container of its own) cannot open it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        return ""
    return (
        f" (the restore file is mode {stat.S_IMODE(mode):04o}, this process's umask taking the rest of"
        f" {STAGING_FILE_MODE:04o}: a llama-server run as another user cannot read it; give the proxy"
        " a umask of 022, or run both as one user)"
    )


class StagingFile:
    """A slot's staging file, kept mapped between restores: each restore writes its state into
    pages that are already there and mapped (mapping a gigabyte afresh, faulting its pages in and
    unmapping it cost about half as much as the copy; docs/proxy.md has the figures). The
    mapping is made again when the file must grow past it or is another file now (removed and
    made again by someone else)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mapped: mmap.mmap | None = None
        self._file: tuple[int, int] = (0, 0)  # the mapped file's (device, inode)
        self._lock = threading.Lock()  # a restore's write, and `reserve` from the proxy's start
        self._wanted = threading.Event()  # a restore waits for the lock: `reserve` gives way

    def reserve(self, size: int) -> bool:
        """Make the file at least `size` bytes, its pages allocated and mapped, ahead of a restore
        (`SlotStore.prepare`), a slice at a time. Nothing is written into it, and a file a restore
        wrote (or one made ahead already) is left as it is: llama-server may be reading it. A
        restore that comes meanwhile does not wait for all of it (a gigabyte takes a second or
        more): the file is left as far as it got, for that restore to make the rest, and False is
        returned."""
        with self._lock:
            if self._mapped is not None:
                return True
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, STAGING_FILE_MODE)
            try:
                have = os.fstat(fd).st_size
                for start in range(have, size, ALLOCATE_SLICE):  # pages, not a sparse file
                    if self._wanted.is_set():
                        return False
                    allocate(fd, start, min(ALLOCATE_SLICE, size - start))
                self._map(fd, max(size, have), self._wanted.is_set)
            finally:
                os.close(fd)
            return not self._wanted.is_set()

    def write(self, head: bytes, nbytes: int, fill: Callable[[memoryview], bool], *, exact: bool) -> bool:
        """Make the file `head` (`slotfile.build`'s header and tokens) and then a state of `nbytes`
        without its 8-byte sequence header: `fill` writes the state into the mapping once (joined
        there, from chunks: `ChunkedStates.write_checked`), its 8-byte header then overwritten by
        the end of `head`. False if `fill` says the state is not to be used (the file is then
        left incomplete).

        Unless `exact` (a llama.cpp that loads only a file as long as its state:
        `slotfile.LONGER_FILE_VERSION`), a file longer than the state is left that long while
        its folder has as much room again free (llama-server's saves go there too), and one that
        must grow grows by `GROWTH_SLACK` more. Cut to a shorter state, a file frees the
        pages past it, and the next longer state must allocate and fault them in again: a
        restore of 268 MB after one of 67 MB took 244 ms that way, against 42 ms into pages kept
        (docs/proxy.md)."""
        self._wanted.set()  # a `reserve` under way stops at its next slice
        with self._lock:
            self._wanted.clear()
            return self._write(head, nbytes, fill, exact)

    def _map(self, fd: int, size: int, stop: Callable[[], bool] | None = None) -> mmap.mmap:
        """The mapping of `fd`, `size` bytes at least: the one kept if it is that file and as large
        (a new one's pages made, until `stop` says so)."""
        info = os.fstat(fd)
        if self._mapped is None or len(self._mapped) < size or self._file != (info.st_dev, info.st_ino):
            self._unmap()
            self._mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            populate(self._mapped, stop)  # a slice at a time: the event loop runs meanwhile
            self._file = (info.st_dev, info.st_ino)
        return self._mapped

    def _write(self, head: bytes, nbytes: int, fill: Callable[[memoryview], bool], exact: bool) -> bool:
        start = len(head) - slotfile.SEQ_HEADER_BYTES
        size = start + nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, STAGING_FILE_MODE)
        try:
            length = os.fstat(fd).st_size
            if size > length:  # the pages it grows by, made first: no room is then an OSError, not a SIGBUS
                grown = size if exact else size + int(size * GROWTH_SLACK)
                try:
                    allocate(fd, length, grown - length)
                except OSError:
                    if grown == size:
                        raise
                    grown = size  # room for the state, not for the slack
                    allocate(fd, length, size - length)
                length = grown
            elif size < length and (exact or (free_bytes(os.path.dirname(self.path)) or 0) < length):
                os.ftruncate(fd, size)  # its pages given back: llama-server's saves need that room
                length = size
            mapped = self._map(fd, length)
        finally:
            os.close(fd)
        view = memoryview(mapped)
        try:
            if not fill(view[start:size]):
                return False
            slotfile.state_of(bytes(view[start : start + slotfile.SEQ_HEADER_BYTES]))  # it was a sequence state
            view[: len(head)] = head
        finally:
            view.release()
        return True

    def close(self, *, remove: bool = True) -> None:
        """Unmap the file and remove it (a later `write` makes it again), unless not `remove`."""
        with self._lock:
            self._unmap()
            if remove:
                slotfile.remove(self.path)

    def _unmap(self) -> None:
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:  # views of it in a traceback: unmapped when they go
                pass


def remove_stale_files(directory: str, prefixes: Sequence[str]) -> int:
    """Remove the entries of `directory` named a prefix, a pid and "-" whose process is gone, and
    that this user owns: what a proxy killed outright (SIGKILL, a crash) left, slot files of up
    to gigabytes in RAM otherwise kept until a reboot. A live process's are kept, another
    proxy's sharing the directory included; an entry last changed before the process now
    holding its pid started is not that process's (`written_by_a_live_process`). Returns how
    many were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        pid, dash, _ = name[len(prefix) :].partition("-") if prefix else ("", "", "")
        if not (pid.isdigit() and dash):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if info.st_uid != os.getuid() or written_by_a_live_process(int(pid), info.st_mtime):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as exc:
            log.warning("sippcache proxy: could not remove %s, left by a process that is gone: %s", path, exc)
            continue
        removed += 1
    if removed:
        log.info("sippcache proxy: removed %d file(s) in %s left by proxies that are gone", removed, directory)
    return removed
