"""Slot files kept ready: states llama-server saved, restored later with no copy.

A restore through the store writes the state into a staging file for
llama-server to load: one copy of the whole state on top of llama-server's own
load. On a fast GPU that copy alone is 15-21% of llama-server's own restore
(docs/proxy.md, "What one copy costs on a fast GPU"). A slot file llama-server
saved is already a file it loads. So once a save is stored, the proxy keeps its
slot file, up to a byte budget (least recently used out first), and a later
prompt it serves at least as well as the store's best is restored from it:
llama-server's own restore, nothing read or copied by sippcache.

The store stays what is shared and lasting (chunked, across processes and
hosts); these files are a tier in llama-server's slot folder, in RAM where that
folder is. They are this process's (named with its pid) and removed when it
exits, as llama-server's own ``--cache-ram`` dies with it, unless a folder to
keep them in is given (`keep_in`): then they are moved there at exit and the
next proxy adopts them at its start, so a restarted proxy restores them as
llama-server restores its own slot files. A restarted proxy also makes files
of the store's states used last itself, after its start (`SlotStore.warm`,
within what the budget has left): each the first to go for room. A file in
the budget whose state
another file of its namespace holds all of (a conversation's later turn: the
store's supersede rule) is removed as soon as that file is added.

llama-server aborts on a slot file cut short, so a file is given to it only as
it was kept (`ReadyFiles.intact`), and a file another proxy kept only once its
state reads through to the file's end.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import xxhash

from .. import state
from ..processes import written_by_a_live_process
from . import slotfile
from .slots import Origin, common_prefix, keeps, reusable

__all__ = ["READY_PREFIX", "ReadyFile", "ReadyFiles"]

log = logging.getLogger("sippcache.proxy")

#: A ready file's name: this, the pid of the proxy holding it, its namespace's hash, the prompt
#: length of the request that left the state, a random part: ``sippcache-ready-PID-NS-PROMPT-ID.slot``.
READY_PREFIX = "sippcache-ready-"


@dataclass(eq=False)
class ReadyFile:
    """One kept slot file: where it is, the namespace (hashed) and tokens of its state, and its size."""

    path: str
    space: str  # `ReadyFiles.space` of its namespace
    origin: Origin
    nbytes: int
    stamp: tuple[int, int, int]  # (inode, size, mtime in ns) when kept: `ReadyFiles.intact`
    used: int = 0  # a tick of the set's clock: the least recently used goes first
    readers: int = 0  # restores reading it now: it is not removed meanwhile


class ReadyFiles:
    """The slot files a proxy keeps in `directory` (llama-server's ``--slot-save-path``), at most
    `budget` bytes of them. `can_cut`: whether llama-server can cut a state where a prompt parts
    from it (not for recurrent and hybrid memory). `keep_in`: a folder the files outlive the
    process in (moved there by `close`, adopted from there now); None: removed by `close`.
    Threads share an instance: saves add files in worker threads, lookups run on the event loop."""

    def __init__(self, directory: str, budget: int, *, can_cut: bool = True, keep_in: str | None = None) -> None:
        self.directory, self.budget, self.can_cut, self.keep_in = directory, max(0, budget), can_cut, keep_in
        self._files: list[ReadyFile] = []
        self._clock = 0
        self._lock = threading.Lock()
        if keep_in is not None:
            self._adopt(keep_in)

    @staticmethod
    def space(namespace: str) -> str:
        """A namespace as a file name carries it."""
        return xxhash.xxh64_hexdigest(namespace.encode())

    @property
    def nbytes(self) -> int:
        """The bytes of the files kept now."""
        with self._lock:
            return sum(f.nbytes for f in self._files)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def add(self, path: str, namespace: str, origin: Origin, *, oldest: bool = False) -> bool:
        """Take over the slot file at `path` (in `directory`), a state of `origin.tokens` stored in
        `namespace`: kept, renamed as a ready file, if it fits the budget (files less recently used
        removed for room, and files of the namespace it supersedes); else removed. `oldest`: it
        counts as used before every file kept (a file made ahead of any use: the first to go for
        room, and none go for it). Whether kept."""
        try:
            stamp = _stamp(path)  # a rename keeps the inode, size and time of change
        except OSError:
            return False
        if stamp[1] > self.budget:
            slotfile.remove(path)
            return False
        space = self.space(namespace)
        target = os.path.join(self.directory, _name(space, origin.prompt, f"{uuid.uuid4().hex}.slot"))
        try:
            os.rename(path, target)
        except OSError as exc:
            log.warning("sippcache proxy: cannot keep the slot file %s ready: %s", path, exc)
            slotfile.remove(path)
            return False
        ready = ReadyFile(target, space, origin, stamp[1], stamp)
        with self._lock:
            gone = [f for f in self._files if f.space == space and not f.readers and self._supersedes(origin, f)]
            self._files = [f for f in self._files if f not in gone]
            if oldest:
                ready.used = min((f.used for f in self._files), default=0) - 1
            else:
                self._clock += 1
                ready.used = self._clock
            self._files.append(ready)
            gone += self._over_budget()
        for file in gone:
            slotfile.remove(file.path)
        return ready not in gone

    def holds(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Whether a file of `namespace` holds all of a state of `tokens` (the same state, or, where
        states can be cut, one that begins with it)."""
        space, wanted = self.space(namespace), tuple(tokens)
        with self._lock:
            return any(
                f.space == space
                and (f.origin.tokens == wanted or (self.can_cut and f.origin.tokens[: len(wanted)] == wanted))
                for f in self._files
            )

    def _supersedes(self, new: Origin, old: ReadyFile) -> bool:
        """Whether a file of `new` makes `old` of no use: the same state, or (where states can be
        cut) one that keeps all `old` is worth (`keeps`)."""
        return new.tokens == old.origin.tokens or (self.can_cut and keeps(new.tokens, old.origin))

    def _over_budget(self) -> list[ReadyFile]:
        """Take the least recently used files out of the set (none being read) until the rest fits
        the budget; those taken (the caller removes them)."""
        total = sum(f.nbytes for f in self._files)
        gone = []
        for file in sorted(self._files, key=lambda f: f.used):
            if total <= self.budget:
                break
            if not file.readers:
                gone.append(file)
                total -= file.nbytes
        self._files = [f for f in self._files if f not in gone]
        return gone

    @contextmanager
    def best(self, namespace: str, tokens: Sequence[int]) -> Iterator[tuple[ReadyFile, int] | None]:
        """The file giving llama-server the most of `tokens` to reuse, and how many (None: no file
        gives any), held while the block runs: not removed for room meanwhile. A file changed
        since it was kept is removed instead (`intact`)."""
        space = self.space(namespace)
        changed = []
        with self._lock:
            ranked = sorted(
                ((f, reusable(len(f.origin.tokens), common_prefix(f.origin.tokens, tokens), len(tokens), self.can_cut))
                 for f in self._files if f.space == space),
                key=lambda pair: (-pair[1], pair[0].nbytes),
            )  # fmt: skip
            found = None
            for file, gives in ranked:
                if gives <= 0:
                    break
                if file.readers or self.intact(file):
                    found = file, gives
                    file.readers += 1
                    break
                changed.append(file)
            self._files = [f for f in self._files if f not in changed]
        for file in changed:
            log.warning("sippcache proxy: the ready slot file %s changed since it was kept: removed", file.path)
            slotfile.remove(file.path)
        try:
            yield found
        finally:
            if found is not None:
                with self._lock:
                    found[0].readers -= 1

    @staticmethod
    def intact(file: ReadyFile) -> bool:
        """Whether `file` is still the file kept (its inode, size and time of change): llama-server
        aborts on a slot file cut short (GGML_ASSERT in llama_state_seq_load_file), and one
        another process changed is not the state it lists."""
        try:
            return _stamp(file.path) == file.stamp
        except OSError:
            return False

    def used(self, file: ReadyFile) -> None:
        """`file` was restored: the last to go for room."""
        with self._lock:
            self._clock += 1
            file.used = self._clock

    def drop(self, file: ReadyFile) -> None:
        """Remove a file llama-server would not load."""
        with self._lock:
            if file not in self._files:
                return
            self._files.remove(file)
        slotfile.remove(file.path)

    def close(self) -> None:
        """Remove every file, or move it into `keep_in` for the next proxy."""
        with self._lock:
            files, self._files = self._files, []
        for file in files:
            if self.keep_in is None:
                slotfile.remove(file.path)
                continue
            try:
                os.rename(file.path, os.path.join(self.keep_in, os.path.basename(file.path)))
            except OSError as exc:
                log.warning("sippcache proxy: cannot keep %s in %s: %s", file.path, self.keep_in, exc)
                slotfile.remove(file.path)

    def _adopt(self, folder: str) -> None:
        """Take the ready files proxies that are gone left in `folder` (this user's), newest first,
        into `directory` while they fit the budget; remove the rest. The tokens come from each
        file's own header."""
        found = []
        try:
            names = os.listdir(folder)
        except OSError as exc:
            log.warning("sippcache proxy: no kept slot files taken from %s: %s", folder, exc)
            return
        for name in names:
            parts = name[len(READY_PREFIX) :].split("-") if name.startswith(READY_PREFIX) else []
            if len(parts) != 4 or not (parts[0].isdigit() and parts[2].isdigit()):
                continue
            path = os.path.join(folder, name)
            try:
                info = os.stat(path)
            except OSError:
                continue
            if info.st_uid != os.getuid() or written_by_a_live_process(int(parts[0]), info.st_mtime):
                continue
            found.append((info.st_mtime, path, parts, info.st_size))
        total, adopted = 0, []
        for _, path, (_, space, prompt, rest), nbytes in sorted(found, reverse=True):
            if total + nbytes > self.budget:
                slotfile.remove(path)
                continue
            target = os.path.join(self.directory, _name(space, int(prompt), rest))
            try:
                tokens = _whole_slot_file(path)
                os.rename(path, target)
                stamp = _stamp(target)
            except (OSError, ValueError) as exc:  # SlotFileError and UnsupportedState are ValueErrors
                log.warning("sippcache proxy: a kept slot file %s is not taken: %s", path, exc)
                slotfile.remove(path)
                continue
            total += nbytes
            adopted.append(ReadyFile(target, space, Origin(tokens, int(prompt)), nbytes, stamp))
        for file in reversed(adopted):  # the oldest goes first for room
            self._clock += 1
            file.used = self._clock
            self._files.append(file)
        if adopted:
            log.info(
                "sippcache proxy: %d slot files (%d MiB) kept by earlier proxies are ready", len(adopted), total >> 20
            )


def _name(space: str, prompt: int, rest: str) -> str:
    """A ready file's name, of this process (`READY_PREFIX`); `rest`: its random part and suffix."""
    return f"{READY_PREFIX}{os.getpid()}-{space}-{prompt}-{rest}"


def _stamp(path: str) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_ino, info.st_size, info.st_mtime_ns


def _whole_slot_file(path: str) -> tuple[int, ...]:
    """The tokens of a slot file another process kept, once its state reads through to the file's
    end (`state.parse`, over a mapping: only its headers are read): a file cut short (a
    disk's last writes lost in a crash) would abort llama-server. Raises ValueError (or OSError)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view, parsed = memoryview(mapped), None
    try:
        parsed = slotfile.parse(view)
        state.parse(parsed.state, header=False, version=parsed.version)
        return parsed.tokens
    finally:
        parsed = None
        with contextlib.suppress(BufferError):  # views in a traceback: unmapped when they go
            view.release()
            mapped.close()
