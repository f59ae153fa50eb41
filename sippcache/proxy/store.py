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

With `chunk_tokens` (`sippcache.state.chunks.DEFAULT_CHUNK_TOKENS` by default; 0: whole)
states are stored as chunks of that many tokens and a tail (`sippcache.state.chunks`):
a conversation's later save writes only the chunks the store lacks and its tail,
and conversations over one system prompt share its chunks. A restore reads the
tail with the longest common prefix and the chunks it needs, and writes the
joined state into the staging file. What sippcache.state cannot cut, and every state
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
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import xxhash

from ..errors import SippcacheError
from ..protocol import CacheBackend, EntryInfo, Peek
from ..state import chunks
from ..state.chunkentries import is_chunk_namespace
from ..state.modelfile import MemoryKind
from . import slotfile
from .ready import READY_PREFIX, ReadyFile, ReadyFiles
from .slots import Origin, keeps, reusable
from .staging import StagingFile, remove_stale_files, unreadable_by_others
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
]

log = logging.getLogger("sippcache.proxy")

#: The names of the slot files a proxy process makes in a staging directory, its pid after them:
#: a save's (removed once stored) and each slot's restore file (removed when the proxy exits).
SAVE_PREFIX, RESTORE_PREFIX = "sippcache-save-", "sippcache-restore-"
#: What a proxy entry's payload is: one llama.cpp sequence state (`llama_state_seq_get_data`'s form).
#: Its chunks and tails are of kinds ``llama-server.seq.chunk`` and ``llama-server.seq.tail``.
KIND = "llama-server.seq"
#: The memory kinds whose states are stored as chunks (`sippcache.state.chunks`). A sliding-window
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
        """States stored whole although chunking is on: what sippcache.state could not cut."""
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
                unreadable_by_others(path),
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
                unreadable_by_others(file.path),
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
                if namespace.startswith(mine) and not is_chunk_namespace(namespace)
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
        frames, from views of the mapping: sippcache.state.cut), and the tail."""
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


def _reported_seconds(answer: dict[str, Any], name: str) -> float | None:
    """llama-server's own timing `name` (milliseconds) in a slot action's answer, in seconds."""
    timings = answer.get("timings")
    value = timings.get(name) if isinstance(timings, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return value / 1000.0
    return None
