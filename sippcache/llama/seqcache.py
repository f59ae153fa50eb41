"""The cache as llama.cpp sequences see it: where prefills find states and leave them.

`PrefixCache` (sequence 0 of a `Llama`'s context) and `SessionPool` (one
sequence per slot of a shared context) both use a `SequenceCache`, so both
follow the same rules and keep the same counters:

- every call to the store is one that never fails a request: a backend error
  is logged, counted and answered as a miss;
- candidates are peeked at first and only the entry restored is fetched;
- a restored entry must check out (`sippcache.state.chunks.ChunkedStates.restore`), hold
  exactly its key's positions, and is cut back only where the model's memory
  (`states.MemoryKind`) can be cut exactly: anywhere with full attention, by one
  token with a sliding window, never for recurrent and hybrid models;
- an entry that cannot be used is refused with a reason (`PrefixStats.refused_*`),
  and kept unless it is wrong (it holds other positions than its key): another
  context, or this one later, may use it;
- snapshots are copied on the thread that owns the context and written by one
  background writer, each with its generation; a prefill waits for the writer
  only when a queued snapshot holds more of its prompt than the context does
  (a session just parked and back, an exact repeat).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import llama_cpp
import numpy as np
import numpy.typing as npt

from .. import helpers
from .. import tokens as _tokens
from ..errors import CorruptEntry, UnsupportedEntry
from ..frame import secret_from_environment
from ..protocol import CacheBackend, Peek
from ..registry import open as open_cache
from ..state import buffers
from ..state.buffers import StateBuffers
from ..state.chunks import Assembled, ChunkedStates
from ..state.rates import RestoreRates, mode_from_environment, rates_dir, rates_file
from . import layout, states
from .checkpoints import CheckpointPlan, checkpoint_positions
from .fingerprint import Fingerprint
from .options import CacheOptions
from .writer import BackgroundWriter

log = logging.getLogger("sippcache")

#: The largest state in chunks joined into a buffer kept for the next restore (`SequenceCache`):
#: one of, say, 32K tokens of an 8B model (4 GB) is joined into a buffer of its own each time.
JOIN_BUFFER_LIMIT = 512 * 1024**2

#: Token ids as a list or as llama-cpp-python's `input_ids` array.
TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]

_T = TypeVar("_T")
_D = TypeVar("_D")


@dataclass
class PrefixStats:
    """Counters of one `PrefixCache` or `SessionPool` (this process only)."""

    lookups: int = 0  # prefills that looked in the cache
    hits: int = 0  # prefills that restored an entry
    partial_hits: int = 0  # hits on a longer or diverging entry, truncated to the shared prefix
    logits_hits: int = 0  # exact repeats served with stored logits: nothing evaluated
    misses: int = 0
    tokens_reused: int = 0  # restored from the cache (and kept: never counted for a state then thrown away)
    #: Unbound LlamaCache only: tokens of states handed to llama-cpp-python that it must cut
    #: back first. It can on full-attention and sliding-window models (a whole-context state
    #: holds every cell), not on recurrent and hybrid ones, where it evaluates the whole
    #: prompt instead; the cache cannot see which, so they are not counted as reused.
    tokens_offered: int = 0
    context_tokens_reused: int = 0  # already in the llama context
    tokens_evaluated: int = 0
    entries_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    restore_seconds: float = 0.0
    corrupt_entries: int = 0
    chunks_written: int = 0  # chunk entries stored (`CacheOptions.chunk_tokens`): a state's tokens the store lacked
    chunks_shared: int = 0  # chunks a stored state found in the store already (not written again)
    chunks_read: int = 0  # chunk entries read by restores
    rejected_entries: int = 0  # entries not used: the sum of the refused_* reasons below
    refused_load: int = 0  # llama.cpp did not take the state (another layout, no room now): kept
    refused_positions: int = 0  # it held other positions than its key says: a wrong entry, dropped
    refused_cut: int = 0  # usable only cut back where this model's memory cannot cut exactly: kept
    backend_errors: int = 0  # lookups and deletes that failed (the request went on uncached)
    write_failures: int = 0  # background stores that failed
    #: Stored states that would have given more tokens but were not restored, the sum of the
    #: skipped_* reasons below (`CacheOptions.restore`, `sippcache.state.rates`).
    restores_skipped: int = 0
    skipped_slower_than_prefill: int = 0  # expected to load slower than computing its tokens ("auto")
    skipped_never: int = 0  # restore="never"

    def as_dict(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def skip(self, reason: str) -> None:
        """Count a restore not done, for `reason` (a declining `sippcache.state.rates.Decision`'s)."""
        self.restores_skipped += 1
        name = f"skipped_{reason}"
        setattr(self, name, getattr(self, name) + 1)

    def refuse(self, reason: str) -> None:
        """Count an entry not used, for `reason` (one of `states.REFUSAL_REASONS`)."""
        self.rejected_entries += 1
        name = f"refused_{reason}"
        setattr(self, name, getattr(self, name) + 1)


@dataclass
class Reuse:
    """What `SequenceCache.reuse` put in the sequence: its first `start` tokens
    (`restored` of them from the cache), the stored logits if they came with it,
    and where the prompt leaves the entry it shares the most with (`branch`: a
    place worth a checkpoint)."""

    start: int
    restored: int = 0
    logits: np.ndarray | None = None
    branch: int = 0


@dataclass(frozen=True)
class Restored:
    """What `SequenceCache.restore` loaded: the sequence holds `length` tokens, and
    `logits` (when asked for) are those of the last one, stored with the entry."""

    length: int
    logits: np.ndarray | None = None


def check_prompt(tokens: _tokens.Tokens, n_vocab: int, *, what: str = "") -> list[int]:
    """`tokens` as a list of ids a model of `n_vocab` tokens can evaluate: TypeError or
    ValueError (prefixed with `what`, e.g. "session 'a': ") for anything else, an empty
    prompt included. The one check of `PrefixCache`, `SessionPool` and `BatchEngine`."""
    try:
        ids = list(_tokens.decode(_tokens.encode(tokens)))
    except (TypeError, ValueError) as exc:
        if not what:
            raise
        raise type(exc)(f"{what}{exc}") from None
    if not ids:
        raise ValueError(f"{what}cannot run an empty prompt")
    if max(ids) >= n_vocab:
        position = next(i for i, t in enumerate(ids) if t >= n_vocab)
        raise ValueError(
            f"{what}token id {ids[position]} at position {position} is outside the vocabulary (n_vocab={n_vocab})"
        )
    return ids


def _anonymous(nbytes: int, *, populate: bool = False, room: int = 0) -> mmap.mmap:
    """`nbytes` of anonymous memory (not zeroed by Python, as a bytearray is), in huge pages where
    the kernel has them (a 2 MB page faulted in at a time); with `populate`, its pages made now
    (`buffers.populate`). `room`: as many bytes more after them, whose pages are made only where
    they are written."""
    buffer = mmap.mmap(-1, max(nbytes + room, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    if populate:
        buffers.populate(buffer, length=nbytes, own=True)  # no other thread sees it yet
    return buffer


class _KeptBuffer:
    """Memory a restore copies a state into, kept from restore to restore: a new buffer's page
    faults cost as much as the copy. Grown to the largest state, up to `JOIN_BUFFER_LIMIT`; a
    larger one gets a buffer of its own each time. `make_ahead` makes one with its pages in a
    helper thread, which the next restore takes (waiting for it if it is still being made).
    Used on the thread that owns the context only."""

    def __init__(self, what: str) -> None:
        self.what = what  # for the log
        self.buffer = mmap.mmap(-1, 1)
        #: A buffer being made (`make_ahead`), not yet taken.
        self.ahead: Future[mmap.mmap] | None = None

    def get(self, nbytes: int) -> mmap.mmap:
        """A buffer of at least `nbytes` bytes: the kept one, else a new one (then kept)."""
        if self.ahead is not None:
            made, self.ahead = self.ahead, None
            try:
                ahead = made.result()
            except Exception as exc:  # no memory for it, say: the restore makes its own
                log.warning("sippcache: the %s buffer made ahead failed: %s", self.what, exc)
            else:
                if len(ahead) > len(self.buffer):
                    self.buffer = ahead
        if nbytes <= len(self.buffer):
            return self.buffer
        buffer = _anonymous(nbytes)
        if nbytes <= JOIN_BUFFER_LIMIT:
            self.buffer = buffer
        return buffer

    def make_ahead(self, nbytes: int, room: int = 0) -> None:
        """Have a buffer of `nbytes` (and `room` more, not populated) made in a helper thread."""
        if self.ahead is not None:
            self.ahead.cancel()  # one for a smaller state: not needed now (if made, freed unused)
        self.ahead = helpers.pool("prepare", 1).submit(_anonymous, nbytes, populate=True, room=room)

    def close(self) -> None:
        """Free the kept buffer (once no view of it is held) and drop one still being made."""
        if self.ahead is not None:
            self.ahead.cancel()
            self.ahead = None
        kept, self.buffer = self.buffer, mmap.mmap(-1, 1)
        with contextlib.suppress(BufferError):  # a view of it still held: freed with the view
            kept.close()


def open_cache_argument(cache: str | CacheBackend | None) -> tuple[CacheBackend, bool]:
    """The backend for `cache` (a URL, an open backend, or None) and whether we opened it."""
    if cache is None or isinstance(cache, str):
        return open_cache(cache), True
    if not isinstance(cache, CacheBackend):
        raise TypeError(f"cache must be a URL or a CacheBackend, not {type(cache).__name__}")
    return cache, False


def decode_or_drop(
    decode: Callable[[], _T], key: TokenIds, stats: PrefixStats, drop: Callable[[], object]
) -> _T | None:
    """`decode()` of a stored entry, or None: an entry of a newer format is skipped (not
    ours to delete), a corrupt one is counted and dropped. One policy for every reader."""
    try:
        return decode()
    except UnsupportedEntry as exc:
        log.info("sippcache: skipping a cache entry (%d tokens): %s", len(key), exc)
        return None
    except CorruptEntry as exc:
        log.warning("sippcache: dropping a corrupt cache entry (%d tokens): %s", len(key), exc)
        stats.corrupt_entries += 1
        drop()
        return None


def common_length(a: TokenIds, b: TokenIds) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def _sequence_key(ctx: Any, seq: int) -> tuple[int, int]:
    """A llama context (by address) and a sequence id, as a dictionary key."""
    return ctypes.cast(ctx, ctypes.c_void_p).value or 0, seq


class SequenceCache:
    """One model's namespace in a store, seen from llama.cpp sequences.

    `cache` is a URL, an open `CacheBackend`, or None for `sippcache.open()`'s
    default (closed by `close()` only if opened here). The namespace is
    ``llama:<fingerprint>/<scope>``. With a `secret` (default:
    `SIPPCACHE_SECRET`) entries carry a MAC and entries without a valid one are
    misses. `options` (`CacheOptions`, default: its defaults) holds the scope,
    `min_tokens`, `checkpoint_interval`, `max_pending_writes` and the secret.
    `kind` is the model's `states.MemoryKind`. `rates_place` says what else sets
    the speed (`fingerprint.speed_facts`): the measured rates are kept across
    processes under it (`CacheOptions.rates_dir`); None keeps them in memory only.

    With `live_layout` (for a single-sequence context with a full-size SWA
    cache: `PrefixCache`), a sliding-window state is restored where a live
    context holds its cells (`sippcache.llama.layout`), so what the model
    computes afterwards is bit for bit what it computes without a cache; the
    real start of each such sequence's window is kept here, since llama.cpp no
    longer reports it, and every cut of a sequence goes through `truncate`.
    """

    def __init__(
        self,
        cache: str | CacheBackend | None,
        *,
        fingerprint: Fingerprint,
        kind: states.MemoryKind,
        n_vocab: int,
        options: CacheOptions | None = None,
        live_layout: bool = False,
        rates_place: str | None = None,
    ) -> None:
        options = CacheOptions.build(options, {}) if options is not None else CacheOptions()
        self.cache, self._owns_cache = open_cache_argument(cache)
        self.options = options
        self.fingerprint = fingerprint
        self.scope = options.scope
        self.namespace = f"llama:{fingerprint.digest}/{options.scope}"
        #: What the model's memory allows (cuts, sharing): `states.MemoryKind.of(model)`.
        self.kind = kind
        self.n_vocab = n_vocab
        self.live_layout = live_layout and kind.n_swa > 0 and not kind.exact_length_only
        # (context address, seq) -> first position a padded restore really holds in the
        # sliding-window layers (below it: zero cells, never to come into the window).
        self._window_starts: dict[tuple[int, int], int] = {}
        self.min_tokens = options.min_tokens
        secret = options.secret if options.secret is not None else secret_from_environment()
        #: The secret in use (bytes), from `options` or `SIPPCACHE_SECRET`.
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.stats = PrefixStats()
        #: The states in the store: as chunks and tails (`CacheOptions.chunk_tokens`), or whole.
        self.states = ChunkedStates(
            self.cache,
            fingerprint=fingerprint.digest,
            kind=states.KIND,
            chunk_tokens=options.chunk_tokens,
            secret=self.secret,
            versions={"llama_cpp_python": llama_cpp.__version__},
        )
        #: Whether a restore beats computing, from what this cache measured: llama.cpp's own
        #: prefill timings and the restores done (`CacheOptions.restore`).
        self.rates = RestoreRates(options.restore or mode_from_environment())
        #: The file the rates are kept in for the next process at the same place, or None.
        self.rates_path = self._keep_rates(rates_place)
        self._flush_rates = weakref.finalize(self, self.rates.flush, force=True)  # at close, else at exit
        self._perf_seen: tuple[int, int, float] | None = None  # (context, n_p_eval, t_p_eval_ms) last read
        self._writer = BackgroundWriter(self._write_entry, max_pending=options.max_pending_writes)
        self._queued: dict[int, list[int]] = {}  # keys of snapshots not yet written, by snapshot id
        #: Where a state in chunks is joined for llama.cpp, and padded in place to a live context's
        #: layout (`_restore_state`); where a whole state is padded. Made ahead where sizes are known.
        self._joins = _KeptBuffer("join")
        self._ahead_for = 0  # the state size the kept buffers are made (or being made) for
        self._prepare_buffers()
        self._buffers = StateBuffers()  # what snapshots are copied into, used again once written
        self._queued_lock = threading.Lock()

    def _keep_rates(self, place: str | None) -> str | None:
        """Keep the rates in `CacheOptions.rates_dir`, in the file of this fingerprint, `place` and
        store, starting from what a former process measured there; the file, or None."""
        directory = rates_dir() if self.options.rates_dir is None else os.fspath(self.options.rates_dir)
        if place is None or not directory:
            return None
        store = type(self.cache)
        where = getattr(self.cache, "location", None) or getattr(self.cache, "path", "")
        path = rates_file(
            directory, self.fingerprint.digest, f"{place}\nstore={store.__module__}.{store.__name__}:{where}"
        )
        loaded = self.rates.keep("", path)
        log.debug("sippcache: restore rates kept in %s (%d samples from before)", path, loaded)
        return path

    # -- the store, never failing a request -------------------------------------------

    def peek(self, key: list[int], *, partial: bool) -> Peek | None:
        """What a lookup would find (no blob read, not a use)."""
        return self._safely("peek", lambda: self.cache.peek(key, namespace=self.namespace, partial=partial), None)

    def lookup(self, key: list[int], *, partial: bool, deferred: bool = False) -> Assembled | None:
        """The best stored state for `key` (as `ChunkedStates.restore`; `deferred`: its payload
        checks left to `restore`, which runs them while it joins the state), or None."""
        damaged = self.states.damaged
        found = self._safely(
            "lookup",
            lambda: self.states.restore(key, namespace=self.namespace, partial=partial, deferred=deferred),
            None,
        )
        self.stats.corrupt_entries += self.states.damaged - damaged
        return found

    def exists(self, key: list[int]) -> bool:
        """Whether `key` is stored (counting as a use of it, which it is)."""
        return self._safely("touch", lambda: self.cache.touch(key, namespace=self.namespace), False)

    def set_pinned(self, key: list[int], pinned: bool) -> bool:
        if len(key) < self.min_tokens:
            return False
        return self._safely("pin", lambda: self.states.pin(key, namespace=self.namespace, pinned=pinned), False)

    def drop(self, key: Sequence[int]) -> None:
        self._safely("delete of a bad entry", lambda: self.cache.delete(key, namespace=self.namespace), None)

    def _safely(self, what: str, call: Callable[[], _T], default: _D) -> _T | _D:
        """`call()`, or `default` if the backend fails: logged and counted, never raised."""
        try:
            return call()
        except Exception as exc:
            self.backend_error(what, exc)
            return default

    def backend_error(self, what: str, exc: Exception) -> None:
        self.stats.backend_errors += 1
        log.warning("sippcache: cache %s failed, continuing uncached: %s: %s", what, type(exc).__name__, exc)

    # -- restoring ----------------------------------------------------------------

    def reuse(self, ctx: Any, seq: int, ids: list[int], live: TokenIds, *, with_logits: bool) -> Reuse:
        """Put the longest usable prefix of `ids` into sequence `seq`, which holds `live` now.

        Candidates, best first: with `with_logits`, a stored entry for the whole
        prompt with its logits (nothing to evaluate); then, for `ids[:-1]`, the
        live sequence, the entry whose key is the longest prefix, the entry
        sharing the longest common prefix (usable only if truncating it is
        exact). Entries are peeked at first, so the only one fetched is the one
        restored. Afterwards the sequence holds exactly `ids[:start]`. A recurrent or
        hybrid model's state is never cut: the live sequence is kept only if the prompt
        extends it, and a stored entry only if its key is a prefix of the prompt.
        """
        self.stats.lookups += 1
        self._learn_prefill(ctx)
        if self._queued_common(ids) > common_length(live, ids):
            self.flush()  # a snapshot still queued (a session just parked, a repeat) holds more than the context
        n, target = len(ids), ids[:-1]
        prefix: Peek | None = None
        worth = True  # a shorter entry is not worth restoring where the whole prompt's is not
        if with_logits:
            whole = self.peek(ids, partial=False)
            if whole is not None and whole.length == n:
                worth = self._worth(n, max(1, n - common_length(live, ids)))
                if worth:
                    whole_prompt = self._fetch_and_restore(ctx, seq, ids, partial=False, with_logits=True)
                    if whole_prompt is not None:
                        self.stats.logits_hits += 1
                        return Reuse(n, n, whole_prompt.logits)
                    live = ()  # a failed restore leaves the sequence empty
            elif whole is not None:
                prefix = whole  # shorter than the prompt: the longest prefix of target too
        shared: Peek | None = None
        if target:
            prefix = prefix or self.peek(target, partial=False)
            shared = self.peek(target, partial=True)
        candidates = [(prefix.length, False)] if prefix is not None else []
        if shared is not None and shared.length > (prefix.length if prefix else 0):
            if self.kind.may_truncate_restored(shared.key_length, shared.length):
                candidates.append((shared.length, True))
            elif shared.length >= self.min_tokens:
                self._refuse(shared.key_length, states.REFUSED_CUT)  # not fetched: it could not be cut back
        # What the store holds or will hold once its writer catches up: a snapshot still queued
        # counts as stored, so what a caller decides from `branch` never depends on the writer's pace.
        branch = max(shared.length if shared is not None else 0, self._queued_common(target))
        for length, partial in sorted(candidates, reverse=True):
            common = common_length(live, target)
            if common >= length and self._truncate_live(ctx, seq, live, common):
                break  # the sequence already holds at least as much
            if worth and length >= self.min_tokens and self._worth(length, length - common):
                restored = self._fetch_and_restore(ctx, seq, target, partial=partial)
                if restored is not None:
                    self.stats.partial_hits += partial and restored.length < len(target)
                    return Reuse(restored.length, restored.length, branch=branch)
                live = ()  # a failed restore leaves the sequence empty
        self.stats.misses += 1
        common = common_length(live, target)
        if self._truncate_live(ctx, seq, live, common):
            self.stats.context_tokens_reused += common
            return Reuse(common, branch=branch)
        self.clear(ctx, seq)
        return Reuse(0, branch=branch)

    def _worth(self, tokens: int, gain: int) -> bool:
        """Whether to restore a state of `tokens` tokens that saves computing `gain` of them
        (`CacheOptions.restore`: by the measured rates in "auto"); a restore not done is counted."""
        decision = self.rates.decide("", tokens=gain, nbytes=self.rates.size_of("", tokens))
        if not decision:
            self.stats.skip(decision.reason)
            log.debug("sippcache: not restoring %d tokens (%d to compute otherwise): %s", tokens, gain, decision.reason)
        return bool(decision)

    def _learn_prefill(self, ctx: Any) -> None:
        """Teach the rates the prompt tokens llama.cpp computed in `ctx` since the last look, and
        how long they took (its own counters, `llama_perf_context`)."""
        perf = llama_cpp.llama_perf_context(ctx)
        seen, now = self._perf_seen, (id(ctx), int(perf.n_p_eval), float(perf.t_p_eval_ms))
        self._perf_seen = now
        if seen is not None and seen[0] == now[0] and now[1] > seen[1] and now[2] > seen[2]:
            self.rates.record_prefill("", now[1] - seen[1], (now[2] - seen[2]) / 1000)
            self.rates.flush()  # kept for the next process (at most every KEEP_EVERY seconds)

    def _truncate_live(self, ctx: Any, seq: int, live: TokenIds, length: int) -> bool:
        """Cut the live sequence to `length` tokens if llama.cpp can do so exactly."""
        if length == 0:
            return False
        return length == len(live) or self.truncate(ctx, seq, length)

    def can_truncate(self, ctx: Any, seq: int, length: int) -> bool:
        """Whether cutting sequence `seq` to `length` positions is exact: the memory kind's
        rule (`MemoryKind.can_truncate`), and after a padded restore, the sliding window
        of position `length` must not reach the zero cells below the real window."""
        start = self._window_starts.get(_sequence_key(ctx, seq))
        if start is not None and start > max(0, length - self.kind.n_swa + 1):
            return False
        return self.kind.can_truncate(states.memory(ctx), seq, length)

    def truncate(self, ctx: Any, seq: int, length: int) -> bool:
        """Cut sequence `seq` to its first `length` positions if that is exact."""
        return self.can_truncate(ctx, seq, length) and bool(
            llama_cpp.llama_memory_seq_rm(states.memory(ctx), seq, length, -1)
        )

    def clear(self, ctx: Any, seq: int) -> None:
        """Empty sequence `seq` (and forget where a padded restore's window started)."""
        states.clear(states.memory(ctx), seq)
        self._window_starts.pop(_sequence_key(ctx, seq), None)

    def _restore_state(self, ctx: Any, seq: int, state: memoryview, length: int) -> str | None:
        """`states.restore_state` into the emptied sequence `seq`, with a live context's
        cell layout when `live_layout` is on and the state needs it (the state with zero
        cells below the window; a plain restore if llama.cpp refuses that, which a
        full-size SWA cache never should, unless it was padded in place).

        The padded state is made in the kept join buffer (made ahead where the sizes are
        known: `_prepare_buffers`): a state joined there is padded in place (it was given
        the room: `_join_room`), a whole one copied there. It was a new array each time: a
        new process's first padded copy of a 11.8 MB gemma-3-270m state (1,284 tokens)
        took 13-20 ms (its page faults), later ones 1-3 ms (malloc had the pages by then);
        and a second buffer as large as the join's would double the pages a new process
        makes before its first restore (8-10 ms per 12 MB here)."""
        padded = (
            layout.live_layout(state, self.kind.n_swa, layout.KV_ALIGNMENT, into=self._joins.get)
            if self.live_layout
            else None
        )
        if padded is not None:
            if states.restore_state(ctx, seq, padded.state, length, self.kind) is None:
                self._window_starts[_sequence_key(ctx, seq)] = padded.start
                return None
            self.clear(ctx, seq)
            if np.may_share_memory(padded.state, np.frombuffer(state, dtype=np.uint8)):
                log.warning("sippcache: llama.cpp refused a state padded to a live layout")
                return states.REFUSED_LOAD  # padded in place: the state as stored is gone
            log.debug("sippcache: llama.cpp refused a state padded to a live layout; restoring it as stored")
        return states.restore_state(ctx, seq, state, length, self.kind)

    def _fetch_and_restore(
        self, ctx: Any, seq: int, query: list[int], *, partial: bool, with_logits: bool = False
    ) -> Restored | None:
        """Look `query` up and restore the match into `seq`: with `with_logits`, only an
        entry for all of `query` with its logits; None if nothing usable was restored."""
        started = time.perf_counter()
        found = self.lookup(query, partial=partial, deferred=True)
        if found is None:
            return None
        with found:
            length = found.length
            if length < self.min_tokens or (with_logits and length != len(query)):
                return None
            return self.restore(ctx, seq, found, length, with_logits=with_logits, started=started)

    def restore(
        self,
        ctx: Any,
        seq: int,
        found: Assembled,
        length: int,
        *,
        with_logits: bool = False,
        started: float | None = None,
    ) -> Restored | None:
        """Load the state `found` (`lookup`'s) into `seq` and keep its first `length` tokens;
        None if unusable (the sequence is then empty). With `with_logits` the entry must carry
        the logits of its last position: `Restored.logits` holds them (a copy). `started`:
        when the lookup began (`time.perf_counter`; default now), for the restore rate."""
        started = time.perf_counter() if started is None else started
        key, held = found.key, found.tokens
        logits_bytes = found.extra(states.LOGITS) if len(held) == len(key) else None
        if logits_bytes is not None and len(logits_bytes) != 4 * self.n_vocab:
            log.warning("sippcache: dropping a cache entry (%d tokens) whose logits are not n_vocab floats", len(key))
            self.stats.corrupt_entries += 1
            self.drop(key)
            return None
        if with_logits and logits_bytes is None:
            return None  # usable only with an evaluation of the last token: find a shorter entry
        logits = np.frombuffer(logits_bytes, dtype=np.float32).copy() if with_logits and logits_bytes else None
        del logits_bytes
        nbytes = found.nbytes
        self.clear(ctx, seq)
        # A deferred lookup's payload checks run as the state is joined (a whole entry has
        # nothing to join: checked first); llama.cpp gets the bytes only once they passed.
        damaged = self.states.damaged
        state: memoryview | None = None
        if found.whole:
            state = memoryview(found.state) if self.states.check(found) else None
        else:
            state = memoryview(self._joins.get(nbytes + self._join_room(nbytes)))[:nbytes]
            if not self.states.write_checked(found, state):
                state = None
        if state is None:
            self.stats.corrupt_entries += self.states.damaged - damaged
            return None
        refused = self._restore_state(ctx, seq, state, len(held))
        if refused is None and length < len(held) and not self.truncate(ctx, seq, length):
            refused = states.REFUSED_CUT
        if refused is not None:
            self._refuse(len(key), refused)
            if refused == states.REFUSED_POSITIONS:  # a well-formed state for other positions: wrong for everyone
                self.drop(key)
            self.clear(ctx, seq)
            return None
        seconds = time.perf_counter() - started
        self.stats.hits += 1
        self.stats.tokens_reused += length
        self.stats.bytes_read += nbytes
        self.stats.chunks_read += found.chunks
        self.stats.restore_seconds += seconds
        self.rates.record_restore("", nbytes=nbytes, seconds=seconds, tokens=len(held))
        self.rates.flush()
        return Restored(length, logits)

    def _prepare_buffers(self) -> None:
        """Where the rates know the size of the largest state here (kept from the processes before,
        `CacheOptions.rates_dir`, or a snapshot taken now), up to `JOIN_BUFFER_LIMIT`, and the kept
        buffer is not made for it yet: make it with its pages in a helper thread (with the room to
        pad it in place, `_join_room`). A restore then copies into pages that are there: SmolLM2,
        a 46 MB state joined: 18-20 ms instead of 35-37 ms (docs/llama.md); gemma-3-270m, a
        11.8 MB state padded: 1-3 ms instead of 13-20 ms. Made when a snapshot is taken before
        the first restore too, so that a process that computed its prompts first restores them
        as fast the first time as later (gemma-3-270m: 26-36 ms, was 114). Its cost is that
        memory, from then on."""
        largest = self.rates.largest_state("")
        if not largest or largest > JOIN_BUFFER_LIMIT or largest <= self._ahead_for:
            return
        self._ahead_for = largest
        self._joins.make_ahead(largest, room=self._join_room(largest))

    def _join_room(self, nbytes: int) -> int:
        """The bytes a joined state of `nbytes` bytes may need after it to be padded in place to a
        live context's layout (`_restore_state`): address space, whose pages are made only where
        the padding writes (`layout.padded_size_bound`); 0 without `live_layout`."""
        if not self.live_layout:
            return 0
        return layout.padded_size_bound(nbytes, self.kind.n_swa, layout.KV_ALIGNMENT) - nbytes

    def _refuse(self, key_length: int, reason: str) -> None:
        """Count and log an entry of `key_length` tokens not used, for `reason`: a warning
        when the entry is at fault or llama.cpp refused it, information when this
        model's memory simply cannot cut it back (expected on recurrent models)."""
        self.stats.refuse(reason)
        level = logging.INFO if reason == states.REFUSED_CUT else logging.WARNING
        log.log(
            level, "sippcache: not using a cached state of %d tokens (%s model): %s", key_length, self.kind.name, reason
        )

    # -- storing ------------------------------------------------------------------

    def plan(self, start: int, branch: int, final: int) -> CheckpointPlan:
        """The checkpoints of an evaluation from `start` to `final` (`checkpoint_positions`
        with this cache's options), sharing one `checkpoint_budget`."""
        positions = checkpoint_positions(
            start, branch, final, interval=self.options.checkpoint_interval, min_tokens=self.min_tokens
        )
        return CheckpointPlan(positions, self.checkpoint_budget() if positions else None)

    def checkpoint(self, plan: CheckpointPlan, ctx: Any, seq: int, key: list[int]) -> None:
        """Store the checkpoint `key` (sequence `seq` holds exactly it) within `plan`'s budget."""
        spent = self.snapshot(ctx, seq, key, budget=plan.budget)
        if plan.budget is not None:
            plan.budget -= spent

    def checkpoint_budget(self) -> int | None:
        """Bytes the intermediate snapshots of one prefill may take: half the store's
        budget, so they never evict everything else (the final one is always offered)."""
        try:
            max_bytes = self.cache.stats().max_bytes
        except Exception:  # stats are advisory here
            return None
        return None if max_bytes is None else max_bytes // 2

    def snapshot(
        self,
        ctx: Any,
        seq: int,
        key: list[int],
        *,
        budget: int | None = None,
        logits: np.ndarray | None = None,
        pinned: bool = False,
        replace: bool = False,
        supersede: bool = False,
    ) -> int:
        """Copy sequence `seq`'s state (and `logits`, the last position's) now, on the
        thread that owns the context, and store it in the background, unless `key`
        is stored already (and not to be replaced) or the state is larger than
        `budget`. `supersede` (a prompt's end): the entries under shorter prefixes of
        `key` go once it is stored, where this model's states can be cut anywhere (see
        `_write_entry`). Returns the bytes queued."""
        if not replace and self.exists(key):
            if pinned:
                self.set_pinned(key, True)
            return 0
        if budget is not None and states.state_size(ctx, seq) > budget:
            return 0
        started = time.perf_counter()
        state = states.copy_state(ctx, seq, self._buffers)
        if state is None:
            log.warning("sippcache: llama.cpp could not copy the sequence state; not caching it")
            return 0
        snapshot = states.Snapshot(key, state, logits, time.time_ns(), pinned, supersede, time.perf_counter() - started)
        self.rates.record_size("", len(key), len(state))  # known now, for the next request's decision
        if not self.stats.hits:  # for the first restore; after it the kept buffer grows as states do
            self._prepare_buffers()
        with self._queued_lock:
            self._queued[id(snapshot)] = key
        self._writer.submit(snapshot)
        return len(state)

    def _queued_common(self, ids: Sequence[int]) -> int:
        """The most tokens a snapshot not yet written shares with `ids`."""
        with self._queued_lock:
            return max((common_length(key, ids) for key in self._queued.values()), default=0)

    def _write_entry(self, snapshot: states.Snapshot) -> None:
        """Store a snapshot (on the writer thread): as chunks the store lacks and a tail, or
        whole. A prompt's end (`supersede`) supersedes the entries under shorter prefixes of
        it where a restored state can be cut anywhere (full attention: this one serves them,
        cut back, with one token evaluated where theirs had logits): a conversation keeps its
        latest prompt's entry (an exact repeat of it needs no evaluation) and what followed
        it, and what it grew from goes."""
        started = time.perf_counter()
        try:
            logits = [] if snapshot.logits is None else [snapshot.logits.data.cast("B")]
            stored = self.states.store(
                snapshot.key,
                snapshot.state,
                namespace=self.namespace,
                header=True,
                meta={"n_swa": self.kind.n_swa, "memory": self.kind.name, "scope": self.scope, "pid": os.getpid()},
                sections=logits,
                roles=[states.LOGITS] * len(logits),
                supersede=snapshot.supersede and self.kind.n_swa == 0 and not self.kind.exact_length_only,
                pinned=snapshot.pinned,
                generation=snapshot.generation,
            )
        finally:
            with self._queued_lock:
                self._queued.pop(id(snapshot), None)
            self._buffers.give_back(snapshot.state)  # framed and stored (or failed): nothing reads it now
        seconds = snapshot.seconds + time.perf_counter() - started  # copied out, then stored
        self.rates.record_save("", nbytes=snapshot.state.nbytes, seconds=seconds, written=stored.nbytes)
        self.stats.entries_written += 1
        self.stats.bytes_written += stored.nbytes
        self.stats.chunks_written += stored.chunks_new
        self.stats.chunks_shared += stored.chunks_kept

    # -- lifetime ---------------------------------------------------------------------

    def counters(self) -> dict[str, int | float]:
        """The counters (see `PrefixStats`)."""
        out = self.stats.as_dict()
        out["write_failures"] = self._writer.failures
        return out

    def flush(self) -> None:
        """Wait until every queued snapshot is written to the cache."""
        self._writer.flush()

    def close(self) -> None:
        """Write pending snapshots, stop the writer, free the kept buffers, and close a cache
        opened from a URL; the rates are written to their file (`rates_path`)."""
        self._writer.close()
        self._flush_rates()
        self._joins.close()
        if self._owns_cache:
            self.cache.close()
