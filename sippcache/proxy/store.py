"""Slot states in a sippcache store: restore the best stored prefix into a slot, save a slot.

llama-server reads and writes slot files only in its ``--slot-save-path``; the
proxy keeps that directory for staging (RAM-backed where there is one): a
restore writes the entry there as a slot file and asks llama-server to load it;
a save asks llama-server to write one, frames it as an entry, and keeps the file
ready for a later restore with no copy (`ready`: `sippcache.proxy.ready`) or
removes it.
The entry is keyed by the tokens the slot file itself lists, so whatever a slot
held is stored under exactly its own tokens.

A state's bytes are the whole cost of a restore on a fast GPU, so they are
copied as few times as the formats allow: a save maps the slot file (no read
into a new buffer), the entry's sequence header is written into that private
mapping and the frame is joined once; a restore writes the stored state into a
staging file kept for that slot, rewritten in place each time (a new file on a
RAM disk costs a page allocation per 4 KB, about as much as the copy).

Correctness does not rest on the proxy: llama-server reuses a restored state
only as far as its own comparison of the restored tokens with the prompt goes,
and refuses states of another model layout (then the slot is empty: a miss).
Which state is worth loading is the proxy's choice:

- ``full`` and ``swa`` (with ``--swa-full``) models: the entry with the longest
  common prefix (llama-server cuts it where the prompt parts from it); when a
  slot's state keeps all of the entry it came from but the end of that entry's
  answer, that entry is dropped, so a conversation keeps one entry, not one
  per turn (a new conversation that parts from it within its prompt, over a
  shared system prompt say, keeps it);
- ``recurrent`` (and hybrid) models: a state can only be extended at exactly its
  length, so only the longest stored *prefix* of the prompt, and every entry is
  kept.

With `chunk_tokens` (`sippcache.chunks.DEFAULT_CHUNK_TOKENS` by default; 0: whole)
states are stored as chunks of that many tokens and a tail (`sippcache.chunks`):
a conversation's later save writes only the chunks the store lacks and its tail,
and conversations over one system prompt share its chunks. A restore reads the
tail with the longest common prefix and the chunks it needs, and writes the
joined state into the staging file. What stateformat cannot cut, and every state
of a model whose memory is not chunked (`CHUNKED_KINDS`), is stored as one whole
entry, as before; such entries, and those of proxies before chunks, restore as
they always did.
"""

from __future__ import annotations

import asyncio
import logging
import math
import mmap
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import xxhash

from .. import chunks
from ..buffers import allocate, populate
from ..engine.directory import free_bytes
from ..errors import SippcacheError
from ..modelfile import MemoryKind
from ..processes import written_by_a_live_process
from ..protocol import CacheBackend, EntryInfo, Peek
from . import slotfile
from .ready import READY_PREFIX, ReadyFile, ReadyFiles
from .slots import Origin, keeps, reusable
from .upstream import Upstream, UpstreamRefused

__all__ = [
    "KIND",
    "RESTORE_PREFIX",
    "SAVE_PREFIX",
    "RestoreRefused",
    "Restored",
    "Saved",
    "SlotStore",
    "Snapshot",
    "StagingFile",
    "remove_stale_files",
]

log = logging.getLogger("sippcache.proxy")

#: The names of the slot files a proxy process makes in a staging directory, its pid after them:
#: a save's (removed once stored) and each slot's restore file (removed when the proxy exits).
SAVE_PREFIX, RESTORE_PREFIX = "sippcache-save-", "sippcache-restore-"
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
#: What a proxy entry's payload is: one llama.cpp sequence state (`llama_state_seq_get_data`'s form).
#: Its chunks and tails are of kinds ``llama-server.seq.chunk`` and ``llama-server.seq.tail``.
KIND = "llama-server.seq"
#: The memory kinds whose states are stored as chunks (`sippcache.chunks`). A sliding-window
#: model's (iSWA, run with --swa-full) are too: its full-attention layers are chunked and its
#: window goes whole into each tail (docs/proxy.md, "Chunked states", has the measurement).
#: Recurrent and hybrid memory cannot be cut: stored whole.
CHUNKED_KINDS: tuple[MemoryKind, ...] = ("full", "swa")


@dataclass(frozen=True)
class Restored:
    """A state llama-server loaded into a slot: the entry, its size and how long it took (`staged`:
    the store read and the staging file written; `loaded`: llama-server's own load, as it reported
    it, None where it did not); `held`, the tokens it holds when they are a prefix of the entry's
    (a run of its chunks); `ready`, loaded from a ready file (nothing staged)."""

    origin: Origin
    nbytes: int
    seconds: float
    held: tuple[int, ...] | None = None
    staged: float | None = None
    loaded: float | None = None
    ready: bool = False  # from a ready file (`SlotStore.restore_ready`): nothing staged

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens the slot holds now."""
        return self.origin.tokens if self.held is None else self.held


@dataclass(frozen=True)
class Snapshot:
    """A slot state llama-server wrote to the staging directory, not yet stored; `prompt`: how many
    of its tokens were the last request's prompt."""

    path: str
    tokens: tuple[int, ...]
    prompt: int
    started: float
    saved: float | None = None  # llama-server's own save, as it reported it (timings.save_ms)


@dataclass(frozen=True)
class Saved:
    """A slot state written to the store: `nbytes` written (the new chunks and the tail, or the
    whole entry), `state_bytes` the state's own size; `seconds` from the save's start, of which
    llama-server's own save took `saved` (None: it did not say)."""

    tokens: tuple[int, ...]
    nbytes: int
    seconds: float
    state_bytes: int = 0
    saved: float | None = None


class SlotStore:
    """One model's namespace in a store, seen from llama-server slots.

    `staging` must be the directory llama-server was started with as
    ``--slot-save-path``. Store calls run in worker threads: a large state never
    holds up the event loop. A store that fails is a miss, never an error for
    the client (`errors` counts them). `chunk_tokens`: the tokens of a chunk
    (0: whole states), for the memory kinds in `CHUNKED_KINDS`. `ready_bytes`:
    how many bytes of stored saves' slot files to keep ready (`ready`; 0: none);
    `keep_ready_in`: the folder they outlive the process in (None: removed by
    `close`; `ReadyFiles`).
    """

    def __init__(
        self,
        cache: CacheBackend,
        *,
        fingerprint: str,
        facts: dict[str, str],
        kind: MemoryKind,
        staging: str,
        min_tokens: int = 16,
        secret: bytes | None = None,
        chunk_tokens: int = chunks.DEFAULT_CHUNK_TOKENS,
        ready_bytes: int = 0,
        keep_ready_in: str | None = None,
    ) -> None:
        self.cache = cache
        self.fingerprint = fingerprint
        self.facts = facts
        self.kind = kind
        self.staging = staging
        self.min_tokens = min_tokens
        self.secret = secret
        self.states = chunks.ChunkedStates(
            cache,
            fingerprint=fingerprint,
            kind=KIND,
            chunk_tokens=chunk_tokens if kind in CHUNKED_KINDS else 0,
            secret=secret,
            versions={"llama_server": facts.get("build_info", "")},
        )
        self._staging_files: dict[str, StagingFile] = {}
        remove_stale_files(staging, (SAVE_PREFIX, RESTORE_PREFIX) + ((READY_PREFIX,) if keep_ready_in is None else ()))
        #: The slot files saved here and kept for restores that copy nothing (`sippcache.proxy.ready`).
        self.ready = ReadyFiles(staging, ready_bytes, can_cut=self.can_cut, keep_in=keep_ready_in)
        self._errors = 0
        self.refused = 0  # entries llama-server would not load (kept: another configuration may)

    @property
    def errors(self) -> int:
        """Store operations answered as misses, damaged entries dropped included."""
        return self._errors + self.states.damaged

    @property
    def chunk_tokens(self) -> int:
        """The tokens of a chunk; 0 when states are stored whole."""
        return self.states.chunk_tokens

    @property
    def stored_whole(self) -> int:
        """States stored whole although chunking is on: what stateformat could not cut."""
        return self.states.stored_whole

    def namespace(self, scope: str) -> str:
        """Where one scope's entries live: the fingerprint keeps models and configurations apart,
        the scope keeps tenants apart."""
        return f"llama-server:{self.fingerprint}/{scope}"

    # -- lookups ---------------------------------------------------------------

    @property
    def can_cut(self) -> bool:
        """Whether llama-server can cut a restored state of this model where a prompt parts from it."""
        return self.kind != "recurrent"

    def best(self, tokens: Sequence[int], scope: str) -> Peek | None:
        """The best stored state for `tokens` (not fetched); a store that fails is a miss. Its
        `key_length` is how many tokens a restore would load: with chunks, where the match ends
        before the entry's tail, only the chunks that cover it (an estimate: an entry stored whole
        is loaded whole)."""
        try:
            peek = self.cache.peek(tokens, namespace=self.namespace(scope), partial=self.can_cut)
        except SippcacheError as exc:
            self._failed("peek", exc)
            return None
        size = self.chunk_tokens
        if peek is None or not size or self.kind != "full":  # a window in the tail: all of it is loaded
            return peek
        if peek.length > (peek.key_length - 1) // size * size:
            return peek
        return Peek(peek.length, -(-peek.length // size) * size)

    def best_length(self, tokens: Sequence[int], scope: str) -> int:
        """How many of `tokens` the best stored state would give llama-server to reuse."""
        peek = self.best(tokens, scope)
        return 0 if peek is None else reusable(peek.key_length, peek.length, len(tokens), self.can_cut)

    # -- restore -----------------------------------------------------------------

    async def restore(self, upstream: Upstream, slot: int, tokens: Sequence[int], scope: str) -> Restored | None:
        """Load the best stored state for `tokens` into `slot`; None if there is none or it was refused
        (then the slot is empty)."""
        started = time.perf_counter()
        path = self.restore_file(upstream.url, slot)
        staged = await asyncio.to_thread(self._stage, tokens, self.namespace(scope), path)
        if staged is None:
            return None
        origin, nbytes, held = staged
        staged_seconds = time.perf_counter() - started
        try:
            answer = await upstream.slot_action(slot, "restore", os.path.basename(path))
        except UpstreamRefused as exc:
            self.refused += 1
            log.warning(
                "%s refused a stored state of %d tokens (kept): %s%s",
                upstream.url,
                len(origin.tokens),
                exc,
                _unreadable_by_others(path),
            )
            raise RestoreRefused(exc, nbytes, time.perf_counter() - started, len(held)) from exc
        seconds = time.perf_counter() - started
        return Restored(origin, nbytes, seconds, held, staged_seconds, _reported_seconds(answer, "restore_ms"))

    async def restore_ready(self, upstream: Upstream, slot: int, file: ReadyFile) -> Restored:
        """Load a ready file (`ready`, held by the caller) into `slot`: llama-server's own restore,
        nothing staged. A file it refuses is removed (`RestoreRefused`)."""
        started = time.perf_counter()
        try:
            answer = await upstream.slot_action(slot, "restore", os.path.basename(file.path))
        except UpstreamRefused as exc:
            self.refused += 1
            tokens = len(file.origin.tokens)
            log.warning(
                "%s refused a ready slot file of %d tokens (removed): %s%s",
                upstream.url,
                tokens,
                exc,
                _unreadable_by_others(file.path),
            )
            await asyncio.to_thread(self.ready.drop, file)
            raise RestoreRefused(exc, file.nbytes, time.perf_counter() - started, tokens) from exc
        self.ready.used(file)
        seconds = time.perf_counter() - started
        return Restored(file.origin, file.nbytes, seconds, loaded=_reported_seconds(answer, "restore_ms"), ready=True)

    def restore_file(self, url: str, slot: int) -> str:
        """The staging file restores into `slot` of the llama-server at `url` go through: one per
        slot and process, kept mapped and written in place by each restore, removed by `close`."""
        name = f"{RESTORE_PREFIX}{os.getpid()}-{xxhash.xxh64_hexdigest(url.encode())}-{slot}.slot"
        path = os.path.join(self.staging, name)
        self._staging_files.setdefault(path, StagingFile(path))
        return path

    def prepare(self, url: str, slot: int, nbytes: int) -> None:
        """Make the staging file of `slot` of the llama-server at `url` ready for a state of about
        `nbytes` bytes, its pages allocated (blocking: the proxy runs it in a worker thread at
        start). A new file's pages cost about as much again as writing a state into them (0.5 s a
        GB on /dev/shm): made ahead, the first restore after a restart writes in place. A failure
        (no room) is logged: that restore makes the file itself."""
        path = self.restore_file(url, slot)
        try:
            self._staging_files[path].reserve(nbytes + nbytes // 64 + 4096)  # room for its tokens too
        except OSError as exc:
            log.warning("cannot make the staging file %s ready for %d bytes: %s", path, nbytes, exc)

    def load_index(self) -> None:
        """Read the store's index into memory now (blocking: the proxy runs it in a worker thread at
        start), not in a restarted proxy's first request: a store read entry by entry takes about
        50 ms for each 32K-token state in chunks here, one from its index snapshot 0.4 s for
        100,000 entries (docs/benchmarks.md). A store that fails is logged: the first lookup tries
        again."""
        try:
            len(self.cache)
        except SippcacheError as exc:
            self._failed("reading the index", exc)

    def close(self) -> None:
        """Remove the staging files this store's restores used, and its ready files (or keep them:
        `ReadyFiles.close`)."""
        for staging in self._staging_files.values():
            staging.close()
        self._staging_files.clear()
        self.ready.close()

    def _stage(self, tokens: Sequence[int], namespace: str, path: str) -> tuple[Origin, int, tuple[int, ...]] | None:
        """Write the best stored state for `tokens` as a slot file at `path`: (the entry it comes
        from, the state's bytes, the tokens it holds: the entry's, or a prefix of them), or None."""
        try:
            assembled = self.states.restore(tokens, namespace=namespace, partial=self.can_cut, deferred=True)
        except SippcacheError as exc:
            self._failed("lookup", exc)
            return None
        if assembled is None:
            return None
        return self._write(assembled, self._staging_files.setdefault(path, StagingFile(path)), namespace)

    def _write(
        self, assembled: chunks.Assembled, staging: StagingFile, namespace: str, *, exact: bool = False
    ) -> tuple[Origin, int, tuple[int, ...]] | None:
        """Write an assembled state into `staging` as a slot file (`exact`: as long as the state):
        (the entry it comes from, the state's bytes, the tokens it holds), or None (the file then
        removed; a damaged entry deleted, and counted in `errors`)."""
        with assembled:
            # The payloads' checksums run as the staging file is written (`write_checked`):
            # llama-server hears of the file only once they passed.
            error: Exception | None = None
            passed = True
            try:
                version = int(assembled.entry.meta.get("slot_version", 0))
                prompt = int(assembled.entry.meta.get("prompt", 0))
                held = assembled.tokens
                head = b"".join(slotfile.build(version, held))
                nbytes = assembled.nbytes - slotfile.SEQ_HEADER_BYTES
                fill = partial(self.states.write_checked, assembled)
                exact = exact or version < slotfile.LONGER_FILE_VERSION
                passed = staging.write(head, assembled.nbytes, fill, exact=exact)
            except (TypeError, ValueError, OSError) as exc:  # SlotFileError is a ValueError
                error = exc
            if not passed:  # a miss: the damaged entry is deleted, and counted (`errors`)
                staging.close()
                return None
            if error is not None:
                self._failed("staging write" if isinstance(error, OSError) else "decode", error)
                if not isinstance(error, OSError):  # damaged: dropped
                    self._drop(assembled.key, namespace)
                staging.close()
                return None
            return Origin(assembled.key, prompt), nbytes, held

    # -- warming the ready files ---------------------------------------------------

    def to_warm(self) -> list[EntryInfo]:
        """The stored states of this model, every scope's, that `warm` would make ready, most
        recently used first; none when no ready file is kept. Only the namespaces of its states
        are listed (`CacheBackend.namespaces`), not their chunks, whose keys run up to a state's
        length each. A store that fails: none."""
        if not self.ready.budget:
            return []
        mine = self.namespace("")  # every scope's namespace begins with it
        try:
            listed = [
                entry
                for namespace in self.cache.namespaces()
                if namespace.startswith(mine) and not chunks.is_chunk_namespace(namespace)
                for entry in self.cache.entries(namespace)
            ]
        except SippcacheError as exc:
            self._failed("listing the entries to make ready", exc)
            return []
        return sorted(listed, key=lambda entry: entry.last_used, reverse=True)

    def warm(self, entry: EntryInfo) -> bool:
        """Make a stored state a ready file ahead of any request for it (blocking: the proxy runs
        it in a worker thread after its start, between requests): so a restarted proxy's follow-up
        is llama-server's own restore, as if the proxy had saved it. Not where a ready file serves
        its tokens already, nor where the file would not fit the budget unless files used since
        the start went for it (it is the least recently used of them). The store counts it as no
        use. Whether a file was made."""
        namespace = entry.namespace
        if self.ready.holds(namespace, entry.key):
            return False
        if self.ready.nbytes + entry.size > self.ready.budget:  # a tail's size says little: checked again below
            return False
        try:
            assembled = self.states.restore(entry.key, namespace=namespace, deferred=True, touch=False)
        except SippcacheError as exc:
            self._failed("lookup", exc)
            return False
        if assembled is None:
            return False
        if assembled.tokens != entry.key or self.ready.nbytes + assembled.nbytes > self.ready.budget:
            assembled.release()
            return False
        path = os.path.join(self.staging, f"{SAVE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.slot")
        staging = StagingFile(path)
        written = self._write(assembled, staging, namespace, exact=True)
        if written is None:
            return False
        staging.close(remove=False)
        return self.ready.add(path, namespace, written[0], oldest=True)

    # -- save --------------------------------------------------------------------

    async def snapshot(self, upstream: Upstream, slot: int, prompt: int) -> Snapshot:
        """Have llama-server write `slot`'s state to the staging directory; `keep` stores it (and
        removes the file). The tokens are read from the file's header at once: the caller knows what
        the slot holds before the store write is done. `prompt`: the last request's prompt length."""
        started = time.perf_counter()
        path = os.path.join(self.staging, f"{SAVE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.slot")
        try:
            answer = await upstream.slot_action(slot, "save", os.path.basename(path))
            tokens = await asyncio.to_thread(slotfile.read_tokens, path)
        except BaseException:
            slotfile.remove(path)
            raise
        return Snapshot(path, tokens, min(prompt, len(tokens)), started, _reported_seconds(answer, "save_ms"))

    def keep(self, snapshot: Snapshot, supersedes: Origin | None, scope: str) -> Saved | None:
        """Store a snapshot unless it is too short (blocking: run it in a worker thread): as chunks
        and a tail, or whole. `supersedes`, the entry the slot's state grew from, is dropped when the
        new state keeps all of its prompt and all of it but the end of its answer (`SUPERSEDE_SLACK`),
        and states can be cut: its tail (or whole entry) goes, and its chunks past what the two
        share; shared chunks stay. The slot file is then kept ready (`ready`), or removed; removed
        in every other case."""
        stored = None
        try:
            if len(snapshot.tokens) < self.min_tokens:
                return None
            stored = self._store(snapshot, supersedes, scope)
        except (OSError, ValueError, slotfile.SlotFileError, SippcacheError) as exc:
            self._failed("save", exc)
            return None
        finally:
            if stored is None:
                slotfile.remove(snapshot.path)
        seconds = time.perf_counter() - snapshot.started
        self.ready.add(snapshot.path, self.namespace(scope), Origin(stored.tokens, snapshot.prompt))
        return Saved(stored.tokens, stored.nbytes, seconds, stored.state_bytes, snapshot.saved)

    def _store(self, snapshot: Snapshot, supersedes: Origin | None, scope: str) -> chunks.Stored:
        """A saved slot file into the store. The file is mapped, not read: a whole entry copies the
        state once (into its frame); in chunks, only the new chunks are copied, once each (into their
        frames, from views of the mapping: stateformat.cut), and the tail."""
        with open(snapshot.path, "rb") as f:  # mapped copy-on-write: writing the header spoils no file
            mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mapped)
        parsed = slotfile.parse(view)
        replaces = supersedes.tokens if supersedes and self.can_cut and keeps(parsed.tokens, supersedes) else None
        return self.states.store(  # the views into `mapped` go with the call's frames: it is unmapped then
            parsed.tokens,
            slotfile.seq_state_in_place(view, parsed),
            namespace=self.namespace(scope),
            header=True,
            version=parsed.version,
            meta={"slot_version": parsed.version, "memory": self.kind, "prompt": snapshot.prompt},
            replaces=replaces,
        )

    def _drop(self, key: tuple[int, ...], namespace: str) -> None:
        try:
            self.cache.delete(key, namespace=namespace)
        except SippcacheError as exc:
            self._failed("delete of a damaged entry", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self._errors += 1
        log.warning("sippcache proxy: %s failed (a miss): %s", what, exc)


class RestoreRefused(UpstreamRefused):
    """llama-server refused a state staged for it (`SlotStore.restore`): a miss, with what the
    attempt cost, which the rates count as a restore that gave nothing."""

    def __init__(self, cause: UpstreamRefused, nbytes: int, seconds: float, tokens: int) -> None:
        super().__init__(cause.status, cause.message)
        self.nbytes, self.seconds, self.tokens = nbytes, seconds, tokens


def _unreadable_by_others(path: str) -> str:
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


def _reported_seconds(answer: dict[str, Any], name: str) -> float | None:
    """llama-server's own timing `name` (milliseconds) in a slot action's answer, in seconds."""
    timings = answer.get("timings")
    value = timings.get(name) if isinstance(timings, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return value / 1000.0
    return None
