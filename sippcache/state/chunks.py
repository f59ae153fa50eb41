"""Sequence states kept as shared chunks of tokens: a store that grows with the tokens, not the turns.

A llama.cpp sequence state holds every token from position 0, so storing each
turn of a chat whole writes its earlier turns again, and every conversation over
one system prompt keeps its own copy of it. `ChunkedStates` stores a state of N
tokens as (docs/format.md, "Chunked states"):

- chunk entries of C tokens (`chunk_tokens`), each keyed by the exact token
  prefix that ends it (``tokens[:k*C]``, for every k*C < N) and holding those
  cells' rows of every layer (`sippcache.state.cutting.split`'s chunk bytes), with
  the cut's small ``meta`` in the frame's meta, so any run of chunks is
  self-sufficient. Their bytes depend only on the tokens up to their end, so
  every state sharing that prefix shares them: they are written once;
- a tail entry keyed by all N tokens: the cells past the last boundary, the
  caches a cut does not chunk (an iSWA model's sliding-window cache), and
  the caller's own sections (logits, ...) and meta fields.

Chunks live in a namespace of their own next to the caller's
(`sippcache.state.chunkentries.chunk_namespace`: the namespace, C and a digest of the layout their bytes
have), so a tail never shares a key with a chunk, and states of another layout
or chunk size never mix. Storing writes only the chunks the store lacks (the
run it holds found with one `touch_prefixes`, nothing read) and the tail. A restore finds the tail
(or whole entry) with the longest match, reads the chunks it needs in order,
and joins them into one buffer: the bytes llama.cpp itself would give for that
prefix. A chunk missing mid-chain (evicted, deleted by another process) gives
the shorter run before it: a shorter hit, never a wrong one.

Chunks are shared by tokens, and llama.cpp computes the same tokens' K/V to the
same bits only in the same batches (on a CPU, with quantized weights, a prompt
batch and one-token decoding differ in their last bits). Where a state's tokens
were computed again rather than restored, the chunk the store already holds
came from the other computation, and the joined state is bit-identical to
neither: the model then answers as after any other batch split, and may part
at a near-tie (docs/proxy.md, "Chunked states", measures it).

What `sippcache.state` cannot cut (recurrent memory, an unknown format version,
several streams, ...) is stored whole, exactly as a caller stores a state
without this module (one entry of `kind`, the state as its first section), and
counted (`ChunkedStates.stored_whole`). Entries of that form restore as they
always did. Every entry is a normal frame (`sippcache.frame`) with the caller's
fingerprint and secret, so checksums and MACs apply per chunk. Over the plain
`CacheBackend` protocol: every backend works unchanged.

No `llama_cpp` import: the proxy (slot files) and the llama-cpp-python layer
(`llama_state_seq_get_data`'s form) both use it.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import frame, helpers
from .. import tokens as _tokens
from ..errors import CorruptEntry, UnsupportedEntry
from ..protocol import Blob, CacheBackend, Match
from ..tokens import Tokens
from .buffers import StateBuffers
from .chunkentries import (
    CHUNK_SUFFIX,
    TAIL_SUFFIX,
    chain_digests,
    chunk_namespace,
    layout_of,
    pin_chain,
    token_ids,
)
from .copier import gather_workers
from .cutting import Cut, chunkable_caches, cut
from .joining import Joined, joined
from .parsing import parse
from .seqstate import UnsupportedState

__all__ = [
    "CHECK_THREADS",
    "DEFAULT_CHUNK_TOKENS",
    "MEANWHILE_THREADS",
    "Assembled",
    "ChunkedStates",
    "Stored",
    "check_threads",
]

log = logging.getLogger("sippcache.chunks")

#: The default chunk size, of the llama-cpp-python layer (`CacheOptions.chunk_tokens`) and the
#: proxy (`--chunk-tokens`). Smaller chunks share more: a conversation's own boundary chunk
#: repeats up to C - 1 tokens of the shared prefix, and each stored state writes its last partial
#: chunk again in its tail (C / 2 tokens on average). Larger ones mean fewer entries, each with a
#: frame, an index record and a key (4 bytes a token) and one more step of a restore.
#: benchmarks/store_growth.py (4 conversations x 5 turns over one system prompt, SmolLM2) through
#: the drop-in: 64 writes 1.73 U and keeps 1.10 U (128: 2.52 U and 1.34 U; whole states 28.4 U);
#: benchmarks/state_path.py: a 256 MiB state restores from 64-token chunks about as fast as whole.
DEFAULT_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class Stored:
    """What one `ChunkedStates.store` wrote."""

    tokens: tuple[int, ...] = field(repr=False)
    #: Stored as chunks and a tail (False: one whole entry).
    chunked: bool
    #: Framed bytes written: the new chunks and the tail, or the whole entry.
    nbytes: int
    #: Entries written (the store may refuse one: no room).
    entries: int
    #: Bytes of the state itself.
    state_bytes: int
    #: Chunk entries written, and those the store already held (not written again).
    chunks_new: int = 0
    chunks_kept: int = 0
    #: Why it was stored whole: chunking off, or what `sippcache.state` could not cut.
    why_whole: str = ""


class Unchecked(NamedTuple):
    """An entry whose payload a deferred `ChunkedStates.restore` left unchecked."""

    key: Tokens
    namespace: str
    blob: Blob
    #: The payload's checksum, where the payload is the cells the state is joined from (a chunk's).
    cells_checksum: int | None


class Assembled:
    """A state put together for a query by `ChunkedStates.restore`. The matches it was read from
    (the tail's or whole entry's, and its chunks') are held until `release` (a `with` block):
    the state's bytes and the caller's sections are views of them."""

    def __init__(
        self,
        entry: frame.Frame,
        key: tuple[int, ...],
        length: int,
        n_tokens: int,
        state: Joined | memoryview,
        chunks: int,
        matches: list[Match],
        unchecked: list[Unchecked] | None = None,
    ) -> None:
        #: The tail's (or whole entry's) frame: its meta, and the caller's sections.
        self.entry = entry
        #: The tokens of that entry: the stored state this one is (a prefix of).
        self.key = key
        #: How many of the query's tokens the entry matches.
        self.length = length
        #: Chunk entries read (0: a whole entry, or a state within its tail).
        self.chunks = chunks
        self._n_tokens = n_tokens
        self._matches = matches
        #: The entries whose payload checks a deferred restore left (`Unchecked`), one
        #: per chunk the state is joined from, in their order (the tail's cells last), or the
        #: whole entry's.
        self.unchecked = unchecked or []
        self._state: Joined | memoryview | None = state
        self._joined: Blob | None = None

    def _held(self) -> Joined | memoryview:
        if self._state is None:
            raise ValueError("the assembled state was released")
        return self._state

    @property
    def nbytes(self) -> int:
        """The state's size in bytes (in the form it was stored in: with `llama_state_seq_get_data`'s
        8-byte header if it had it)."""
        state = self._held()
        return state.nbytes

    @property
    def parts(self) -> list[Blob]:
        """The state's bytes in order, as the parts it is made of (one for a whole entry): write
        them back to back, and each byte is copied once."""
        state = self._held()
        return [state] if isinstance(state, memoryview) else state.parts()

    @property
    def state(self) -> Blob:
        """The state in one buffer: a whole entry's own bytes (no copy), or joined (one copy,
        the first time it is asked for)."""
        state = self._held()
        if isinstance(state, memoryview):
            return state
        if self._joined is None:
            self._joined = state.to_bytes()
        return self._joined

    def state_in(self, buffer: bytearray | mmap.mmap) -> Blob:
        """`state`, joined into the first `nbytes` of `buffer` (at least that long) rather than a
        new buffer: a caller that restores again and again keeps one, whose pages are not
        faulted in again (in a new buffer that costs about as much as the copy itself). A whole
        entry's own bytes are returned as they are. Valid until `buffer` is written again or
        this is released."""
        state = self._held()
        if isinstance(state, memoryview):
            return state
        if len(buffer) < state.nbytes:
            raise ValueError(f"a buffer of {len(buffer)} bytes for a state of {state.nbytes}")
        out = memoryview(buffer)[: state.nbytes]
        state.write_into(out)
        return out

    def write_into(self, out: memoryview, hashed: Callable[[int, int], object] | None = None) -> None:
        """Write the state into the first `nbytes` of `out` (a writable byte buffer: a mapped slot
        file, say), each byte copied once, a large state's on helper threads too; `hashed(i,
        digest)` as chunk i's bytes are copied (`sippcache.state.Joined.write_into`; a whole entry
        has no chunks)."""
        state = self._held()
        (state if isinstance(state, Joined) else Joined([state])).write_into(out, hashed)

    @property
    def joined_chunks(self) -> int:
        """How many chunks the state is joined from (with the tail's cells; 0: a whole entry)."""
        state = self._held()
        return state.chunks if isinstance(state, Joined) else 0

    @property
    def whole(self) -> bool:
        """A whole entry (not chunked, or stored before chunks)."""
        return not self.entry.kind.endswith(TAIL_SUFFIX)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens the state holds: the entry's, or (a chunk run short of its tail) a prefix of them."""
        return self.key[: self._n_tokens]

    def extra(self, role: str) -> memoryview | None:
        """The caller's section named `role` (stored with `ChunkedStates.store(sections=, roles=)`)."""
        return self.entry.section(role)

    def release(self) -> None:
        """Release the matches (idempotent); the state's bytes and the frame's sections are not
        to be used after."""
        matches, self._matches = self._matches, []
        self._state = self._joined = None
        self.unchecked = []
        for match in matches:
            match.release()

    def __enter__(self) -> Assembled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Assembled(<{self._n_tokens} of {len(self.key)} tokens>, {self.nbytes} bytes, chunks={self.chunks})"


class ChunkedStates:
    """Sequence states of one model in a `CacheBackend`, stored as chunks and tails (module docstring).

    `fingerprint`, `versions` and `secret` go into every frame as the caller gives them; `kind`
    is the caller's kind of a whole state (its chunks are ``kind + ".chunk"``, its tails
    ``kind + ".tail"``). `chunk_tokens` 0 stores every state whole. Backend errors
    (`SippcacheError`) pass through; damaged entries are deleted and counted (`damaged`).
    It keeps nothing between calls but those two counters and the buffers frames are written
    into for a store that copies them into storage of its own (`frame.framed_for`: there the
    frame itself need not be new memory), so threads may share one as far as the backend allows
    (the llama-cpp-python layer stores on its writer thread and restores on the model's).
    """

    def __init__(
        self,
        cache: CacheBackend,
        *,
        fingerprint: str,
        kind: str,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        secret: frame.Secret | None = None,
        versions: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be an int >= 0 (0: whole states), got {chunk_tokens!r}")
        self.cache = cache
        self.fingerprint = fingerprint
        self.kind = kind
        self.chunk_kind, self.tail_kind = kind + CHUNK_SUFFIX, kind + TAIL_SUFFIX
        self.chunk_tokens = chunk_tokens
        self.secret = secret
        self.versions = dict(versions or {})
        #: States stored whole although chunking is on: `sippcache.state` could not cut them.
        self.stored_whole = 0
        #: Damaged entries found (and deleted) by restores.
        self.damaged = 0
        self.buffers = StateBuffers()  # what frames are written into (`_put`), used again

    # -- storing -------------------------------------------------------------------------

    def store(
        self,
        tokens: Tokens,
        state: Blob,
        *,
        namespace: str = "",
        header: bool | None = None,
        version: int | None = None,
        meta: Mapping[str, Any] | None = None,
        sections: Sequence[Blob] = (),
        roles: Sequence[str] = (),
        replaces: Sequence[int] | None = None,
        supersede: bool = False,
        pinned: bool = False,
        generation: int | None = None,
    ) -> Stored:
        """Store `state`, the state of `tokens`: `llama_state_seq_get_data`'s form, or a slot
        file's state bytes (`header`, `version`: as `sippcache.state.parse` takes them). `meta`,
        `sections` and `roles` are the caller's (whole-entry data: they go with the tail, or
        with the whole entry after the state). `replaces`: the key of an entry this state takes
        the place of (the previous turn of its conversation): that entry is deleted, and so are
        its chunks past the tokens the two share; shared chunks stay. `supersede` (for a model
        whose restored states can be cut anywhere: full attention): once stored as chunks, the
        entries under shorter prefixes of `tokens` go (a restore of this one, cut back, gives
        theirs; their chunks are this one's), except pinned ones. `pinned` pins the entry and
        its chunks; `generation` is the entry's (`CacheBackend.store`)."""
        key = tuple(tokens)
        view = memoryview(state).cast("B")
        if len(sections) != len(roles):
            raise ValueError("sections and roles must be as many")
        why = "chunking is off"
        if self.chunk_tokens:
            try:
                parsed = parse(view, header=header, version=version)
                if parsed.n_positions != len(key):
                    raise UnsupportedState(f"the state holds {parsed.n_positions} positions, its key {len(key)}")
                # Every cache holding all the positions is chunked: an iSWA model's sliding-window
                # cache too while the state is within its window (past it, it goes whole with the tail).
                chunked = max(1, chunkable_caches(parsed))
                pieces = cut(parsed, range(self.chunk_tokens, len(key), self.chunk_tokens), chunked=chunked)
                layout = layout_of(parsed, chunked)
            except UnsupportedState as exc:
                self.stored_whole += 1
                why = str(exc)
                log.info("sippcache: a state of %d tokens stored whole: %s", len(key), why)
            else:
                stored = self._store_chunked(
                    key, view, pieces, layout, namespace, meta, sections, roles, replaces, pinned, generation
                )
                if supersede and stored.entries:
                    self._supersede(key, namespace)
                return stored
        roles = ["state", *roles]
        nbytes = self._put(
            key, [view, *sections], self.kind, meta, roles, namespace, pinned=pinned, generation=generation
        )
        if replaces is not None and tuple(replaces) != key:
            self.cache.delete(replaces, namespace=namespace)
        return Stored(key, False, nbytes, int(nbytes > 0), view.nbytes, why_whole=why)

    def _store_chunked(
        self,
        key: tuple[int, ...],
        view: memoryview,
        pieces: Cut,
        layout: str,
        namespace: str,
        meta: Mapping[str, Any] | None,
        sections: Sequence[Blob],
        roles: Sequence[str],
        replaces: Sequence[int] | None,
        pinned: bool,
        generation: int | None,
    ) -> Stored:
        size = self.chunk_tokens
        ids = token_ids(key)
        chunks_at = chunk_namespace(namespace, size, layout)
        ours = {"chunk_meta": pieces.meta, "chunk_tokens": size, "chunk_layout": layout}
        bounds = [k * size for k in range(1, len(pieces))]  # the chunk entries' key lengths
        # The chunks this state extends are kept (the run of them from the first, found and used
        # in one call, before the new ones' room is made); the rest are written, deepest first,
        # since a key that extends another's whole key marks it superseded (evicted first:
        # sippcache.eviction) and a shorter one never does.
        if pinned:
            have = 0
            while have < len(bounds) and self.cache.pin(ids[: bounds[have]], namespace=chunks_at):
                have += 1
        else:
            have = self.cache.touch_prefixes(ids, bounds, namespace=chunks_at)
        pieces.first_wanted = have
        nbytes = written = 0
        chain = chain_digests(ids, size, len(bounds))
        for end in reversed(bounds[have:]):
            cells = [pieces.pieces(end // size - 1)]  # copied once, into its frame, from views of the state
            # A chunk's priority: its tokens and one chunk more, so that per token (what eviction
            # weighs) the first chunks, which every longer state needs, outlast the last ones.
            stored = self._put(
                ids[:end],
                cells,
                self.chunk_kind,
                {**ours, "chain": chain[end // size - 1]},
                ["cells"],
                chunks_at,
                frame_tokens=ids[end - size : end],
                priority=end + size,
                pinned=pinned,
            )
            written, nbytes = written + (stored > 0), nbytes + stored
        stored = self._put(
            key,
            [pieces.pieces(-1), pieces.tail, *sections],
            self.tail_kind,
            {**(meta or {}), **ours},
            ["cells", "caches", *roles],
            namespace,
            priority=len(key) + size,
            pinned=pinned,
            generation=generation,
        )
        written, nbytes = written + (stored > 0), nbytes + stored
        # The chain used once more, after its tail: if making room moved eviction's clock up
        # meanwhile, the tail would otherwise outlive the chunks it is restored with. This also
        # clears the superseded marks the deepest new chunk left on the chunk before it.
        self.cache.touch_prefixes(ids, bounds, namespace=chunks_at)
        if replaces is not None and tuple(replaces) != key:
            self._replace(tuple(replaces), key, namespace, chunks_at)
        return Stored(key, True, nbytes, written, view.nbytes, len(bounds) - have, have)

    def _put(
        self,
        key: Sequence[int],
        sections: Sequence[Blob | Sequence[Blob]],
        kind: str,
        meta: Mapping[str, Any] | None,
        roles: Sequence[str],
        namespace: str,
        *,
        frame_tokens: Sequence[int] | None = None,
        **options: Any,
    ) -> int:
        """Frame `sections` (under `frame_tokens`, else `key`) as the store is best given it
        (`frame.framed_for`) and store the frame under `key` with the `CacheBackend.store`
        `options`: the bytes written, 0 if not stored."""
        fields = dict(
            fingerprint=self.fingerprint, kind=kind, versions=self.versions, meta=meta, roles=roles, secret=self.secret
        )
        tokens = key if frame_tokens is None else frame_tokens
        with frame.framed_for(self.cache, self.buffers, tokens, sections, **fields) as blob:
            return memoryview(blob).nbytes if self.cache.store(key, blob, namespace=namespace, **options) else 0

    def pin(self, tokens: Tokens, *, namespace: str = "", pinned: bool = True) -> bool:
        """`pin_chain` on this store, with this instance's secret."""
        return pin_chain(self.cache, tokens, namespace=namespace, pinned=pinned, secret=self.secret)

    def _supersede(self, key: tuple[int, ...], namespace: str) -> None:
        """Delete the unpinned entries stored under shorter prefixes of `key` (found with `peek`,
        longest first; one a backend cannot tell pinned or not is kept)."""
        end = len(key) - 1
        while end > 0:
            peek = self.cache.peek(key[:end], namespace=namespace)
            if peek is None:
                return
            if peek.pinned is False:
                self.cache.delete(key[: peek.length], namespace=namespace)
            end = peek.length - 1

    def _replace(self, old: tuple[int, ...], key: tuple[int, ...], namespace: str, chunks_at: str) -> None:
        """Delete the entry under `old`, and its chunks (in this layout) that `key` does not share."""
        self.cache.delete(old, namespace=namespace)
        size = self.chunk_tokens
        shared = _tokens.common_prefix(old, key)
        ids = token_ids(old)
        for end in range((shared // size + 1) * size, len(old), size):
            self.cache.delete(ids[:end], namespace=chunks_at)

    # -- restoring -------------------------------------------------------------------------

    def restore(
        self, tokens: Tokens, *, namespace: str = "", partial: bool = False, deferred: bool = False, touch: bool = True
    ) -> Assembled | None:
        """The best stored state for `tokens`: the one of the entry with the longest stored
        prefix (with `partial`, the longest common prefix) that the store can still assemble;
        None if there is none. Where a state can be cut (chunks alone make one), only the chunks
        covering the match are read: the result may then hold a prefix of the entry's tokens
        (`Assembled.tokens`), never tokens the store did not hold. Release it when done.

        `deferred` (without a secret: a MAC is checked before anything is read) leaves the
        entries' payload checksums to `check`, which the caller runs before llama.cpp gets the
        bytes, while it writes them out (xxhash lets go of the GIL). Unless `touch`, what is read
        counts as no use for eviction (a copy made ahead, not a use: `SlotStore.warm`)."""
        match = self.cache.lookup(tokens, namespace=namespace, partial=partial, touch=touch)
        if match is None:
            return None
        held = [match]
        unchecked: list[Unchecked] | None = [] if deferred and self.secret is None else None
        try:
            assembled = self._assemble(match, namespace, partial, held, unchecked, touch)
        except BaseException:
            for m in held:
                m.release()
            raise
        if assembled is None:
            for m in held:
                m.release()
        return assembled

    def check(self, assembled: Assembled) -> bool:
        """Check the payloads a deferred `restore` left unchecked: False, the damaged entry deleted
        and counted, if one fails (then use none of the state). May run on another thread while the
        state's bytes are written out."""
        return self._check(assembled.unchecked)

    def write_checked(self, assembled: Assembled, out: memoryview) -> bool:
        """`assembled.write_into(out)`, with `check`. Where fewer than `MEANWHILE_THREADS` threads
        can check (`check_threads`), each chunk's payload is hashed as it is copied, its bytes in
        the cache (one read of them from memory, not two); else, and for what else a deferred
        restore left unchecked, the frames are checked on helper threads meanwhile. False, the
        damaged entry deleted and counted, if one fails: then use none of `out`."""
        unchecked = assembled.unchecked
        as_copied = len(unchecked) == assembled.joined_chunks and check_threads() < MEANWHILE_THREADS
        by_chunk = unchecked if as_copied else []
        failed: list[int] = []

        def hashed(i: int, digest: int) -> None:  # else its whole frame is checked (and dropped if bad)
            if digest != by_chunk[i].cells_checksum and not self._check(by_chunk[i : i + 1]):
                failed.append(i)

        checked = self._check_meanwhile(unchecked) if unchecked and not by_chunk else None
        try:
            assembled.write_into(out, hashed if by_chunk else None)
        finally:  # (before the views it reads are released)
            passed = checked is None or checked.result()
        return passed and not failed

    def check_meanwhile(self, assembled: Assembled) -> Future[bool]:
        """`check` on helper threads (xxhash lets go of the GIL), the entries shared among as many
        as `check_threads()`: the caller writes the state out meanwhile, and waits for the
        result, before anything uses the bytes and before releasing `assembled`."""
        return self._check_meanwhile(assembled.unchecked)

    def _check_meanwhile(self, unchecked: list[Unchecked]) -> Future[bool]:
        threads = check_threads()
        ways = max(1, min(threads, len(unchecked)))
        workers = helpers.pool("check", threads)
        return helpers.all_true([workers.submit(self._check, unchecked[i::ways]) for i in range(ways)])

    def _check(self, unchecked: list[Unchecked]) -> bool:
        for key, namespace, blob, _ in unchecked:
            try:
                frame.decode(blob, secret=self.secret)
            except (CorruptEntry, UnsupportedEntry) as exc:
                self._drop(key, namespace, str(exc))
                return False
        return True

    def _assemble(
        self,
        match: Match,
        namespace: str,
        partial: bool,
        held: list[Match],
        unchecked: list[Unchecked] | None,
        touch: bool = True,
    ) -> Assembled | None:
        key = match.key
        try:
            entry = frame.decode(match.blob, secret=self.secret, check_payload=unchecked is None)
        except UnsupportedEntry as exc:  # a newer sippcache's: kept for it
            log.warning("sippcache: an entry of %d tokens is of a newer format (kept): %s", len(key), exc)
            return None
        except CorruptEntry as exc:
            self._drop(key, namespace, str(exc))
            return None
        if entry.fingerprint != self.fingerprint or entry.token_bytes != _tokens.encode(key):
            self._drop(key, namespace, "its header does not match its key and model")
            return None
        if unchecked is not None:
            unchecked.append(Unchecked(key, namespace, match.blob, None))
        if entry.kind == self.kind and entry.sections:
            return Assembled(entry, key, match.length, len(key), entry.sections[0], 0, held, unchecked)
        if entry.kind != self.tail_kind:
            self._drop(key, namespace, f"an entry of kind {entry.kind!r} among states of {self.kind!r}")
            return None
        size, layout, meta = (entry.meta.get(name) for name in ("chunk_tokens", "chunk_layout", "chunk_meta"))
        cells, caches = entry.section("cells"), entry.section("caches")
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or size <= 0
            or not isinstance(layout, str)
            or not isinstance(meta, bytes)
            or cells is None
            or caches is None
        ):
            self._drop(key, namespace, "a tail without its chunk fields")
            return None
        first = (len(key) - 1) // size * size  # where the tail's own cells begin
        if len(cells) % (len(key) - first):
            self._drop(key, namespace, "a tail whose cells are not a whole number")
            return None
        per_cell = len(cells) // (len(key) - first)
        alone = not len(caches)  # nothing but chunked caches: a run of chunks is a state by itself
        want = match.length if partial else len(key)
        full = want > first or not alone
        need = first // size if full else -(-want // size)
        at = chunk_namespace(namespace, size, layout)
        chunks = self._chunks(key, need, size, per_cell, layout, at, held, unchecked, touch)
        try:
            if full and len(chunks) == need:
                state = joined(meta, [*chunks, cells], caches)
                if unchecked is not None:  # in the order of the joined chunks: the tail's cells last
                    unchecked.append(unchecked.pop(0))
                return Assembled(entry, key, match.length, len(key), state, need, held, unchecked)
            if chunks and alone:  # a run short of the tail: the state of its tokens
                run = len(chunks) * size
                state = joined(meta, chunks)
                if unchecked is not None:  # the tail's own payload is not used
                    unchecked.pop(0)
                return Assembled(entry, key, min(match.length, run), run, state, len(chunks), held, unchecked)
        except UnsupportedState as exc:  # the parts do not fit: not used
            if unchecked is not None and not self._check(unchecked):
                return None  # a damaged payload, now deleted
            self.damaged += 1
            log.warning("sippcache: the chunks of an entry of %d tokens do not join (not used): %s", len(key), exc)
        return None

    def _chunks(
        self,
        key: tuple[int, ...],
        need: int,
        size: int,
        per_cell: int,
        layout: str,
        namespace: str,
        held: list[Match],
        unchecked: list[Unchecked] | None,
        touch: bool = True,
    ) -> list[memoryview]:
        """The cells of the first `need` chunks of `key`'s chain, in order, up to the first one
        missing or unusable: read with one `lookup_prefixes` (one snapshot, or one round trip),
        their matches added to `held` (views of them are returned), and to `unchecked` (when not
        None) the chunks whose payloads are left to `check`."""
        ids = token_ids(key)
        width = size * per_cell
        lengths = [k * size for k in range(1, need + 1)]
        found = self.cache.lookup_prefixes(ids, lengths, namespace=namespace, touch=touch)
        held += found
        chain = chain_digests(ids, size, len(found))
        out: list[memoryview] = []
        for match, digest in zip(found, chain, strict=True):
            end = match.length
            try:
                chunk = frame.decode(match.blob, secret=self.secret, check_payload=unchecked is None)
            except UnsupportedEntry:
                break
            except CorruptEntry as exc:
                self._drop(ids[:end], namespace, str(exc))
                break
            cells = chunk.section("cells")
            if (
                chunk.kind != self.chunk_kind
                or chunk.fingerprint != self.fingerprint
                or chunk.meta.get("chunk_layout") != layout
                or chunk.meta.get("chunk_tokens") != size
                or cells is None
                or len(cells) != width
                or chunk.meta.get("chain") != digest
            ):
                self._drop(ids[:end], namespace, "a chunk that does not match its key, model or layout")
                break
            out.append(cells)
            if unchecked is not None:
                sole = len(chunk.sections) == 1  # then the cells are its payload
                unchecked.append(Unchecked(ids[:end], namespace, match.blob, chunk.checksum if sole else None))
        return out

    def _drop(self, key: Tokens, namespace: str, why: str) -> None:
        """A damaged entry: deleted, as every reader does (a miss)."""
        self.damaged += 1
        log.warning("sippcache: a corrupt entry was deleted: %s", why)
        self.cache.delete(key, namespace=namespace)


#: At most this many threads check a restore's checksums.
CHECK_THREADS = 4
#: Where at least this many threads can check (`check_threads`), a restore's chunks are checked on
#: them while it is joined; with fewer, each chunk is hashed as the join copies it. A 1 GiB restore
#: from chunks, the proxy's staging (`benchmarks/state_path.py`): on this project's 2 cores (1
#: checking thread) 171 ms hashed as copied against 194 ms checked meanwhile; on a 16-core H200
#: host (4) 159/140 ms (RAM/LMDB store) as copied against 112/118 ms meanwhile.
MEANWHILE_THREADS = 2


def check_threads() -> int:
    """Threads that check a restore's checksums while it is joined: the cores the join's own
    threads (the caller's and `sippcache.state.copier.gather_workers`) leave, from 1 to `CHECK_THREADS`.
    On a host with cores to spare (a GPU server) a checksum is no longer the slowest part of a
    restore: xxh3 ran at 0.59x a memory copy on the H200 host's CPU."""
    return max(1, min(CHECK_THREADS, (os.cpu_count() or 1) - 1 - gather_workers()))
