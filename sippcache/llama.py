"""The llama-cpp-python adapter: restore the best cached prefix, evaluate only the rest.

Two ways in:

- `PrefixCache(llm, url).prefill(tokens)`: explicit. Afterwards the context
  holds exactly `tokens` and the next token can be sampled as if the whole
  prompt had been evaluated (`llm.sample()` / `llm.generate()`).
- `llm.set_cache(LlamaCache(url))`: a drop-in for llama-cpp-python's own cache
  hook (`create_completion`, `create_chat_completion`, its server). Use it
  with `sippcache.llama.Llama`.

With `sippcache.llama.Llama` (rather than a plain `llama_cpp.Llama`), an entry
for a whole prompt also keeps the last position's logits, and an exact repeat
evaluates nothing: the first token is sampled from the stored logits with the
caller's own sampler chain. A plain `llama_cpp.Llama` samples only from its
context, so for it the last prompt token is always evaluated.

What is stored is llama.cpp's per-sequence state (`llama_state_seq_get_data`),
framed by `sippcache.states` / `sippcache.frame`, under a namespace made of the
model fingerprint and a scope. Never the whole context, never the scores,
never a pickle.

Correctness rules (see docs/llama.md):

- A restored state must hold exactly the positions its key says; logits come
  either from an evaluation or from the entry stored with that very state.
- A restored state is truncated (to use a longer entry that shares a common
  prefix) only when llama.cpp can do it exactly:
  ``llama_memory_seq_pos_min(mem, 0) <= max(0, n - n_swa)``. On sliding-window
  models that rarely holds after a restore, so prefills store checkpoints:
  every `checkpoint_interval` tokens, and where the prompt leaves a stored one.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import llama_cpp
import numpy as np
from llama_cpp.llama_cache import BaseLlamaCache

from . import states
from . import tokens as _tokens
from .errors import CorruptEntry, UnsupportedEntry
from .fingerprint import Fingerprint, llama_fingerprint
from .frame import Secret, secret_from_environment
from .protocol import CacheBackend, Match, Peek
from .registry import open as open_cache
from .writer import BackgroundWriter

log = logging.getLogger("sippcache")

#: The `kind` of entries holding one llama.cpp sequence's state.
KIND = states.KIND
DEFAULT_MIN_TOKENS = 16
DEFAULT_CHECKPOINT_INTERVAL = 2048
#: Checkpoints where a prompt leaves a stored one are rounded down to a multiple of
#: this. llama.cpp's quantized kernels give results that depend on where a batch
#: is split: measured on gemma-3-270m (q4_k_m, AVX-512), splitting an evaluation
#: at a multiple of 8 tokens is bit-identical to not splitting it, while splitting
#: at 999 or 1,001 moves logits by up to 1.1. Aligned, a checkpoint costs nothing
#: in exactness (and at most 31 tokens of reuse).
CHECKPOINT_ALIGNMENT = 32


@dataclass
class PrefixStats:
    """Counters of one `PrefixCache` (this process only)."""

    lookups: int = 0  # prefills that looked in the cache
    hits: int = 0  # prefills that restored an entry
    partial_hits: int = 0  # hits on a longer or diverging entry, truncated to the shared prefix
    logits_hits: int = 0  # exact repeats served with stored logits: nothing evaluated
    misses: int = 0
    tokens_reused: int = 0  # restored from the cache
    context_tokens_reused: int = 0  # already in the llama context
    tokens_evaluated: int = 0
    entries_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    restore_seconds: float = 0.0
    corrupt_entries: int = 0
    rejected_entries: int = 0  # refused by llama.cpp or not truncatable
    backend_errors: int = 0  # lookups and deletes that failed (the request went on uncached)
    write_failures: int = 0  # background stores that failed

    def as_dict(self) -> dict[str, Union[int, float]]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PrefillResult(int):
    """What one `prefill` did. As an int: the tokens that were not evaluated.

    `restored` came from the cache, `live` were already in the context,
    `evaluated` were computed now; `logits_from_store` says that the next
    token's logits came from the stored entry (an exact repeat: nothing was
    evaluated), so they are sampled by `sippcache.llama.Llama.sample`.
    """

    restored: int
    live: int
    evaluated: int
    logits_from_store: bool
    restore_seconds: float

    def __new__(
        cls, restored: int, live: int, evaluated: int, logits_from_store: bool, restore_seconds: float
    ) -> PrefillResult:
        result = super().__new__(cls, restored + live)
        result.restored, result.live, result.evaluated = restored, live, evaluated
        result.logits_from_store, result.restore_seconds = logits_from_store, restore_seconds
        return result

    def __str__(self) -> str:
        return int.__repr__(self)

    def __repr__(self) -> str:
        return (
            f"PrefillResult(restored={self.restored}, live={self.live}, evaluated={self.evaluated}, "
            f"logits_from_store={self.logits_from_store}, restore_seconds={self.restore_seconds:.6f})"
        )


@dataclass
class _Reuse:
    """What `_reuse` put in the context: `start` tokens (`restored` of them from the
    cache), the stored logits if they came with it, and where the prompt leaves the
    entry it shares the most with (a place worth a checkpoint)."""

    start: int
    restored: int = 0
    logits: Optional[np.ndarray] = None
    branch: int = 0


def _check_options(
    scope: Any, min_tokens: Any, checkpoint_interval: Any, max_pending_writes: Any = 1,
    secret: Any = None, on_prefill: Any = None,
) -> None:  # fmt: skip
    """Refuse bad options before anything is opened or created."""
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a str, not {type(scope).__name__}")
    for name, value in (("min_tokens", min_tokens), ("checkpoint_interval", checkpoint_interval),
                        ("max_pending_writes", max_pending_writes)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if secret is not None and (not isinstance(secret, (str, bytes)) or not secret):
        raise TypeError("secret must be a non-empty str or bytes")
    if on_prefill is not None and not callable(on_prefill):
        raise TypeError("on_prefill must be callable")


def _secret(secret: Optional[Secret]) -> Optional[bytes]:
    """The MAC secret: the one given, else `SIPPCACHE_SECRET`, else none."""
    if secret is None:
        return secret_from_environment()
    return secret.encode("utf-8") if isinstance(secret, str) else secret


def _open(cache: Union[str, CacheBackend, None]) -> tuple[CacheBackend, bool]:
    """The backend for `cache` (a URL, an open backend, or None) and whether we opened it."""
    if cache is None or isinstance(cache, str):
        return open_cache(cache), True
    if not isinstance(cache, CacheBackend):
        raise TypeError(f"cache must be a URL or a CacheBackend, not {type(cache).__name__}")
    return cache, False


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Prefix-state caching for one `llama_cpp.Llama` instance.

    `cache` is a URL, an open `CacheBackend`, or None for `sippcache.open()`'s
    default. A URL opened here is closed by `close()`; a backend passed in is
    left open. `scope` keeps tenants apart: the same prompt in two scopes
    never shares an entry. Prefixes shorter than `min_tokens` are neither
    stored nor restored; long prefills store a checkpoint every
    `checkpoint_interval` tokens. With a `secret` (default: `SIPPCACHE_SECRET`)
    every entry carries a MAC and entries without a valid one are misses.
    `on_prefill(result)` is called after every prefill (for metrics).
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        cache: Union[str, CacheBackend, None] = None,
        *,
        scope: str = "default",
        min_tokens: int = DEFAULT_MIN_TOKENS,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
        max_pending_writes: int = 4,
        secret: Optional[Secret] = None,
        on_prefill: Optional[Callable[[PrefillResult], None]] = None,
    ) -> None:
        if not isinstance(llm, llama_cpp.Llama):
            raise TypeError(f"llm must be a llama_cpp.Llama, not {type(llm).__name__}")
        _check_options(scope, min_tokens, checkpoint_interval, max_pending_writes, secret, on_prefill)
        self.llm = llm
        self.fingerprint: Fingerprint = llama_fingerprint(llm)
        self.cache, self._owns_cache = _open(cache)
        self.scope = scope
        self.namespace = f"llama:{self.fingerprint.digest}/{scope}"
        self.min_tokens = min_tokens
        self.checkpoint_interval = checkpoint_interval
        self.secret = _secret(secret)
        self.on_prefill = on_prefill
        self.n_swa = int(llama_cpp.llama_model_n_swa(llm.model))
        #: Whole-prompt entries keep their logits, and exact repeats sample from them.
        self.stored_logits = isinstance(llm, Llama) and not llm._logits_all
        self._n_vocab = llm.n_vocab()
        self._stats = PrefixStats()
        self._lock = threading.Lock()  # one prefill at a time: the llama context is not thread-safe
        self._writer = BackgroundWriter(self._write_entry, max_pending=max_pending_writes)
        self._closed = False

    # -- public API ------------------------------------------------------------

    def prefill(
        self,
        tokens: _tokens.Tokens,
        *,
        restore: bool = True,
        progress: Optional[Callable[[int, int], None]] = None,
        pin: bool = False,
    ) -> PrefillResult:
        """Bring the context to exactly `tokens`, ready to sample the next token.

        Returns what was done (an int: the tokens not evaluated). With
        `restore=False` the whole prompt is evaluated from scratch (snapshots
        are still stored); `progress(done, total)` is called as tokens are
        evaluated; `pin=True` pins the prompt's entry (see `pin`).
        """
        return self._prefill(self._checked(tokens), restore=restore, progress=progress, pin=pin)

    def pin(self, tokens: _tokens.Tokens) -> bool:
        """Pin the entry a prefill of `tokens` stores (budgets never evict it), e.g. a
        system prompt every request starts with; True if it is in the cache."""
        return self._set_pinned(self._final_key(self._checked(tokens)), True)

    def unpin(self, tokens: _tokens.Tokens) -> bool:
        """Undo `pin`; True if the entry is in the cache."""
        return self._set_pinned(self._final_key(self._checked(tokens)), False)

    def flush(self) -> None:
        """Wait until every queued snapshot is written to the cache."""
        self._writer.flush()

    def stats(self) -> dict[str, Union[int, float]]:
        """This cache's counters (see `PrefixStats`)."""
        out = self._stats.as_dict()
        out["write_failures"] = self._writer.failures
        return out

    def close(self) -> None:
        """Write pending snapshots, stop the writer, and close a cache opened from a URL."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        if self._owns_cache:
            self.cache.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one prefill ---------------------------------------------------------------

    def _checked(self, tokens: _tokens.Tokens) -> list[int]:
        """`tokens` as a list of ids this model and context can evaluate; ValueError otherwise."""
        ids = list(_tokens.decode(_tokens.encode(tokens)))
        if not ids:
            raise ValueError("cannot prefill an empty prompt")
        n_vocab = self._n_vocab
        if max(ids) >= n_vocab:
            position = next(i for i, t in enumerate(ids) if t >= n_vocab)
            raise ValueError(f"token id {ids[position]} at position {position} is outside the vocabulary (n_vocab={n_vocab})")
        if len(ids) > self.llm.n_ctx():
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context size n_ctx={self.llm.n_ctx()}")
        if self._closed:
            raise RuntimeError("PrefixCache is closed")
        return ids

    def _prefill(
        self, ids: list[int], *, restore: bool = True, progress: Optional[Callable[[int, int], None]] = None,
        pin: bool = False,
    ) -> PrefillResult:  # fmt: skip
        with self._lock:
            restore_before = self._stats.restore_seconds
            if self._logits_current(ids):
                reuse = _Reuse(len(ids))  # the context already holds the prompt, ready to sample
                self._stats.context_tokens_reused += len(ids)
            elif restore:
                self._stats.lookups += 1
                reuse = self._reuse(ids)
            else:
                self._clear_context()
                reuse = _Reuse(0)
            if reuse.logits is not None:
                self._set_stored_logits(len(ids), reuse.logits)
            if reuse.start < len(ids):
                # After a lookup, no usable entry holds the whole prompt with its logits: store
                # the final snapshot even over one without logits. Without a lookup, check first.
                self._evaluate(ids, reuse.start, reuse.branch, progress=progress, pin=pin, replace_final=restore)
            elif pin:
                self._set_pinned(self._final_key(ids), True)
            result = PrefillResult(
                reuse.restored, reuse.start - reuse.restored, len(ids) - reuse.start, reuse.logits is not None,
                self._stats.restore_seconds - restore_before,
            )  # fmt: skip
        if self.on_prefill is not None:
            try:
                self.on_prefill(result)
            except Exception as exc:  # an observer must never fail the request
                log.warning("sippcache: on_prefill failed: %s: %s", type(exc).__name__, exc)
        return result

    def _final_key(self, ids: list[int]) -> list[int]:
        """The key of the entry a prefill of `ids` stores: the whole prompt (with its
        logits) when they can be used, else the prompt minus its last token."""
        return ids if self.stored_logits else ids[:-1]

    # -- restoring ----------------------------------------------------------------

    def _reuse(self, ids: list[int]) -> _Reuse:
        """Put the longest usable prefix of `ids` in the context.

        Candidates, best first: a stored entry for the whole prompt with its
        logits (nothing to evaluate); then, for `ids[:-1]`, the live context, the
        entry whose key is the longest prefix, the entry sharing the longest common
        prefix (usable only if truncating it is exact). The cache is asked with
        `peek` first, so the only entry fetched is the one restored: that matters
        when states cross a network.
        """
        n, target = len(ids), ids[:-1]
        prefix: Optional[Peek] = None
        if self.stored_logits:
            whole = self._peek(ids, partial=False)
            if whole is not None and whole.length == n:
                logits = self._fetch_and_restore(ids, partial=False, with_logits=True)
                if logits is not None:
                    self._stats.logits_hits += 1
                    return _Reuse(n, n, logits)
            elif whole is not None:
                prefix = whole  # shorter than the prompt: the longest prefix of target too
        shared: Optional[Peek] = None
        if target:
            prefix = prefix or self._peek(target, partial=False)
            shared = self._peek(target, partial=True)
        candidates = [(prefix.length, False)] if prefix is not None else []
        if shared is not None and shared.length > (prefix.length if prefix else 0):
            if states.may_truncate_restored(shared.key_length, shared.length, self.n_swa):
                candidates.append((shared.length, True))
        branch = shared.length if shared is not None else 0
        for length, partial in sorted(candidates, reverse=True):
            live = self._live_common(target)
            if live >= length and self._truncate_live(live):
                break  # the context already holds at least as much
            if length >= self.min_tokens:
                restored = self._fetch_and_restore(target, partial=partial)
                if restored is not None:
                    self._stats.partial_hits += partial and restored < len(target)
                    return _Reuse(restored, restored, branch=branch)
        self._stats.misses += 1
        live = self._live_common(target)
        if self._truncate_live(live):
            self._stats.context_tokens_reused += live
            return _Reuse(live, branch=branch)
        self._clear_context()
        return _Reuse(0, branch=branch)

    def _fetch_and_restore(self, query: list[int], *, partial: bool, with_logits: bool = False) -> Optional[Any]:
        """Look `query` up and restore the match: with `with_logits`, only an entry for
        all of `query` with its logits (returned); else the tokens restored, or None."""
        match = self._lookup(query, partial=partial)
        if match is None:
            return None
        with match:
            length = match.length
            if length < self.min_tokens or (with_logits and length != len(query)):
                return None
            restored = self._restore(match, length, query, with_logits=with_logits)
        return restored if with_logits or restored is None else length

    def _live_common(self, target: list[int]) -> int:
        return _common_length(self.llm.input_ids[: self.llm.n_tokens], target)

    def _logits_current(self, ids: list[int]) -> bool:
        """The context holds exactly `ids` and can sample the next token right away."""
        llm = self.llm
        if llm.n_tokens != len(ids) or _common_length(llm.input_ids[: llm.n_tokens], ids) != len(ids):
            return False
        if isinstance(llm, Llama):
            return llm._current_logits() is not None
        return not llm._requires_eval

    def _truncate_live(self, length: int) -> bool:
        """Cut the live context to `length` tokens if llama.cpp can do so exactly."""
        llm = self.llm
        if length == 0:
            return False
        if length == llm.n_tokens:
            return True
        if not states.truncate(self._memory(), 0, length, self.n_swa):
            return False
        llm.n_tokens = length
        self._context_changed()
        return True

    def _restore(self, match: Match, length: int, ids: list[int], *, with_logits: bool = False) -> Optional[Any]:
        """Load `match` into sequence 0 and keep its first `length` tokens; None if
        unusable. With `with_logits` the entry must carry the logits of its last
        position (the whole of `ids`): they are returned (a copy); otherwise True."""
        started = time.perf_counter()
        key = match.key
        try:
            entry = states.decode_entry(
                match.blob, key, fingerprint=self.fingerprint.digest, n_vocab=self._n_vocab, secret=self.secret
            )
        except UnsupportedEntry as exc:  # a newer sippcache's entry: not ours to delete
            log.info("sippcache: skipping a cache entry (%d tokens): %s", len(key), exc)
            return None
        except CorruptEntry as exc:
            log.warning("sippcache: dropping a corrupt cache entry (%d tokens): %s", len(key), exc)
            self._stats.corrupt_entries += 1
            self._drop(key)
            return None
        if with_logits and entry.logits is None:
            return None  # usable only with an evaluation of the last token: find a shorter entry
        logits = np.frombuffer(entry.logits, dtype=np.float32).copy() if with_logits else True  # type: ignore[arg-type]
        loaded = states.restore_state(self.llm.ctx, 0, entry.state, len(key), self.n_swa)
        del entry  # views of the match: gone before it is released
        if not loaded:  # refused, or a well-formed state for other positions than its key says
            log.warning(
                "sippcache: dropping a cached state (%d tokens) that llama.cpp refused or that holds other positions",
                len(key),
            )
            self._stats.rejected_entries += 1
            self._drop(key)
            self._clear_context()
            return None
        if length < len(key) and not states.truncate(self._memory(), 0, length, self.n_swa):
            self._stats.rejected_entries += 1
            self._clear_context()
            return None
        llm = self.llm
        llm.input_ids[:length] = ids[:length]
        llm.n_tokens = length
        self._context_changed()
        self._stats.hits += 1
        self._stats.tokens_reused += length
        self._stats.bytes_read += len(match.blob)
        self._stats.restore_seconds += time.perf_counter() - started
        return logits

    def _context_changed(self) -> None:
        """The context was set without an evaluation: its logits are not current."""
        llm = self.llm
        if isinstance(llm, Llama):
            llm._stored_logits, llm._logits_at = None, -1
        llm._requires_eval = True

    def _set_stored_logits(self, n_tokens: int, logits: np.ndarray) -> None:
        assert isinstance(self.llm, Llama)
        self.llm._stored_logits = (n_tokens, logits)
        self.llm._requires_eval = False  # llama-cpp-python's generate() may sample at once

    def _lookup(self, key: list[int], *, partial: bool) -> Optional[Match]:
        """A cache lookup that never fails the request: a backend error is logged and is a miss."""
        try:
            return self.cache.lookup(key, namespace=self.namespace, partial=partial)
        except Exception as exc:
            self._backend_error("lookup", exc)
            return None

    def _peek(self, key: list[int], *, partial: bool) -> Optional[Peek]:
        """What a lookup would find (no blob read, not a use); a backend error is a miss."""
        try:
            return self.cache.peek(key, namespace=self.namespace, partial=partial)
        except Exception as exc:
            self._backend_error("peek", exc)
            return None

    def _drop(self, key: Sequence[int]) -> None:
        try:
            self.cache.delete(key, namespace=self.namespace)
        except Exception as exc:
            self._backend_error("delete of a bad entry", exc)

    def _set_pinned(self, key: list[int], pinned: bool) -> bool:
        if len(key) < self.min_tokens:
            return False
        try:
            return (self.cache.pin if pinned else self.cache.unpin)(key, namespace=self.namespace)
        except Exception as exc:
            self._backend_error("pin", exc)
            return False

    def _exists(self, key: list[int]) -> bool:
        """Whether `key` is stored (counting as a use of it, which it is)."""
        try:
            return self.cache.touch(key, namespace=self.namespace)
        except Exception as exc:
            self._backend_error("touch", exc)
            return False

    def _backend_error(self, what: str, exc: Exception) -> None:
        self._stats.backend_errors += 1
        log.warning("sippcache: cache %s failed, continuing uncached: %s: %s", what, type(exc).__name__, exc)

    def _clear_context(self) -> None:
        states.clear(self._memory(), 0)
        self.llm.n_tokens = 0
        self._context_changed()

    def _memory(self) -> Any:
        return states.memory(self.llm.ctx)

    # -- evaluating and storing -------------------------------------------------

    def _evaluate(
        self, ids: list[int], start: int, branch: int, *,
        progress: Optional[Callable[[int, int], None]] = None, pin: bool = False, replace_final: bool = False,
    ) -> None:  # fmt: skip
        """Evaluate `ids[start:]`, snapshotting at checkpoint boundaries, where the
        prompt leaves the entry it shares most with (`branch`), and at the end: the
        whole prompt with its logits (over an entry without them if `replace_final`),
        or (for a plain `llama_cpp.Llama`) the prompt minus its last token."""
        n = len(ids)
        final = len(self._final_key(ids))
        interval = self.checkpoint_interval
        boundaries = {b for b in range((start // interval + 1) * interval, final, interval) if b >= self.min_tokens}
        branch -= branch % CHECKPOINT_ALIGNMENT
        if start < branch < final and branch >= self.min_tokens:
            boundaries.add(branch)
        # Intermediate checkpoints of one prefill may take half the cache's budget,
        # so they never evict everything else (the final one is always offered).
        max_bytes = self._max_bytes()
        budget = None if max_bytes is None else max_bytes // 2
        position = start
        for boundary in sorted(boundaries):
            self._eval(ids, position, boundary, start, n, progress)
            position = boundary
            spent = self._checkpoint(ids[:boundary], budget=budget)
            if budget is not None:
                budget -= spent
        self._eval(ids, position, final, start, n, progress)
        if final > start and final >= self.min_tokens:
            logits = states.copy_logits(self.llm.ctx, self._n_vocab) if self.stored_logits else None
            self._checkpoint(ids[:final], logits=logits, pinned=pin, replace=replace_final and logits is not None)
        elif pin:
            self._set_pinned(ids[:final], True)
        self._eval(ids, final, n, start, n, progress)
        self._stats.tokens_evaluated += n - start

    def _eval(
        self, ids: list[int], begin: int, stop: int, start: int, end: int,
        progress: Optional[Callable[[int, int], None]],
    ) -> None:  # fmt: skip
        """`llm.eval(ids[begin:stop])`, in n_batch pieces when reporting progress
        (the same split llm.eval makes itself, so the results are identical)."""
        if stop <= begin:
            return
        step = self.llm.n_batch if progress is not None else stop - begin
        for piece in range(begin, stop, step):
            self.llm.eval(ids[piece : min(stop, piece + step)])
            if progress is not None:
                progress(min(stop, piece + step) - start, end - start)

    def _checkpoint(
        self, key: list[int], *, budget: Optional[int] = None, logits: Optional[np.ndarray] = None,
        pinned: bool = False, replace: bool = False,
    ) -> int:  # fmt: skip
        """Copy sequence 0's state (and `logits`, the last position's) now, on the
        thread that owns the context, and store it in the background, unless `key`
        is stored already (and not to be replaced) or the state is larger than
        `budget`. Returns the bytes queued."""
        if not replace and self._exists(key):
            if pinned:
                self._set_pinned(key, True)
            return 0
        ctx = self.llm.ctx
        if budget is not None and llama_cpp.llama_state_seq_get_size(ctx, 0) > budget:
            return 0
        state = states.copy_state(ctx, 0)
        if state is None:
            log.warning("sippcache: llama.cpp could not copy the sequence state; not caching it")
            return 0
        self._writer.submit(states.Snapshot(key, state, logits, time.time_ns(), pinned))
        return len(state)

    def _snapshot_context(self) -> None:
        """Store what the context holds now, with its logits when they are current
        (after a completion: the prompt and the tokens generated)."""
        llm = self.llm
        evaluated = [int(t) for t in llm.input_ids[: llm.n_tokens]]
        if len(evaluated) < self.min_tokens:
            return
        logits = llm._current_logits() if isinstance(llm, Llama) and self.stored_logits else None
        self._checkpoint(evaluated, logits=logits)

    def _max_bytes(self) -> Optional[int]:
        try:
            return self.cache.stats().max_bytes
        except Exception:  # stats are advisory here
            return None

    def _write_entry(self, snapshot: states.Snapshot) -> None:
        blob = states.encode_entry(
            snapshot, fingerprint=self.fingerprint.digest, n_swa=self.n_swa, scope=self.scope, secret=self.secret
        )
        self.cache.store(
            snapshot.key, blob, namespace=self.namespace, pinned=snapshot.pinned, generation=snapshot.generation
        )
        self._stats.entries_written += 1
        self._stats.bytes_written += len(blob)


class LlamaCache(BaseLlamaCache):
    """A drop-in for llama-cpp-python's cache hook: ``llm.set_cache(LlamaCache(url))``.

    llama-cpp-python asks its cache for a state before each completion and
    hands it one after. This class answers the first call by doing the work
    itself: it prefills the prompt into the calling model's context (restoring
    the best cached prefix, or the whole prompt with its logits) and reports a
    miss, so llama-cpp-python finds the prompt already evaluated and samples at
    once. After the completion it stores the context's sequence state; the
    `LlamaState` it is handed is not kept (`sippcache.llama.Llama` does not
    even make one).

    The model is the `Llama` instance whose completion calls the cache (the
    hook passes only tokens), or the one given as `llm`. The other arguments
    are `PrefixCache`'s.
    """

    def __init__(
        self,
        cache: Union[str, CacheBackend, None] = None,
        *,
        llm: Optional[llama_cpp.Llama] = None,
        scope: str = "default",
        min_tokens: int = DEFAULT_MIN_TOKENS,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
        secret: Optional[Secret] = None,
        on_prefill: Optional[Callable[[PrefillResult], None]] = None,
    ) -> None:
        _check_options(scope, min_tokens, checkpoint_interval, secret=secret, on_prefill=on_prefill)
        if llm is not None and not isinstance(llm, llama_cpp.Llama):
            raise TypeError(f"llm must be a llama_cpp.Llama, not {type(llm).__name__}")
        self.cache, self._owns_cache = _open(cache)
        super().__init__(capacity_bytes=self.cache.stats().max_bytes or 0)
        self._options: dict[str, Any] = dict(
            scope=scope, min_tokens=min_tokens, checkpoint_interval=checkpoint_interval, secret=secret,
            on_prefill=on_prefill,
        )  # fmt: skip
        self._prefix_caches: weakref.WeakKeyDictionary[llama_cpp.Llama, PrefixCache] = weakref.WeakKeyDictionary()
        self._bound = llm

    def bind(self, llm: llama_cpp.Llama) -> None:
        """Serve `llm` when the caller cannot be found from the calling frame."""
        self._bound = llm

    def prefix_cache(self, llm: llama_cpp.Llama) -> PrefixCache:
        """The `PrefixCache` this cache uses for `llm`."""
        if llm not in self._prefix_caches:
            self._prefix_caches[llm] = PrefixCache(llm, self.cache, **self._options)
        return self._prefix_caches[llm]

    @property
    def cache_size(self) -> int:
        try:
            return self.cache.stats().bytes
        except Exception as exc:  # never fail a completion over bookkeeping
            log.warning("sippcache: could not read the cache size: %s", exc)
            return 0

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.llama.LlamaState:
        llm = self._caller()
        if len(key) > 1:
            prefix_cache = self.prefix_cache(llm)
            prefix_cache._prefill(prefix_cache._checked(key))
        raise KeyError("sippcache put the prompt in the context; nothing to load")

    def __contains__(self, key: Sequence[int]) -> bool:
        prefix_cache = self.prefix_cache(self._caller())
        found = prefix_cache._peek([int(t) for t in key][:-1], partial=False)
        return found is not None and found.length >= prefix_cache.min_tokens

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        prefix_cache = self.prefix_cache(self._caller())
        with prefix_cache._lock:
            prefix_cache._snapshot_context()

    def flush(self) -> None:
        """Wait for pending writes of every model served."""
        for prefix_cache in list(self._prefix_caches.values()):
            prefix_cache.flush()

    def close(self) -> None:
        """Flush, stop the writers, and close a cache opened from a URL."""
        for prefix_cache in list(self._prefix_caches.values()):
            prefix_cache.close()
        if self._owns_cache:
            self.cache.close()

    def _caller(self) -> llama_cpp.Llama:
        frame_ = sys._getframe(2)
        caller = frame_.f_locals.get("self")
        del frame_
        if isinstance(caller, llama_cpp.Llama):
            return caller
        if self._bound is not None:
            return self._bound
        raise TypeError(
            "LlamaCache serves llama_cpp.Llama completions (llm.set_cache(cache)); "
            "to call it directly, bind a model first: LlamaCache(url, llm=llm) or cache.bind(llm)"
        )


_SAMPLE_SIGNATURE = inspect.signature(llama_cpp.Llama.sample)
_SAMPLER_ARGUMENTS = set(inspect.signature(llama_cpp.Llama._init_sampler).parameters) - {"self"}
#: Where llama-cpp-python calls save_state() only to hand the result to its cache.
_COMPLETION_CODE = getattr(getattr(llama_cpp.Llama, "_create_completion", None), "__code__", None)
_DISCARDED_STATE = llama_cpp.llama.LlamaState(
    input_ids=np.empty(0, dtype=np.intc), scores=np.empty((0, 0), dtype=np.single), n_tokens=0,
    llama_state=b"", llama_state_size=0, seed=0,
)  # fmt: skip


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` that samples from stored logits, and saves no scores.

    - After a `PrefixCache` (or `LlamaCache`) restored a whole prompt with its
      logits, `sample()` and `generate()` sample the first token from those
      logits with the same sampler chain (temperature, top-k/p, min-p,
      penalties, logit bias, grammar, seed) as after an evaluation: nothing
      is evaluated and the tokens are the same.
    - `save_state()` leaves out the n_batch x n_vocab scores array (512 MB for
      a 262k vocabulary) when `logits_all=False`, and inside a completion that
      hands it to a sippcache `LlamaCache` (which does not keep it) it copies
      nothing at all.
    """

    #: (n_tokens, logits of position n_tokens - 1) restored from the cache, until the next evaluation.
    _stored_logits: Optional[tuple[int, np.ndarray]] = None
    #: n_tokens when the context's own logits were last computed (-1: not current).
    _logits_at: int = -1

    def set_cache(self, cache: Optional[BaseLlamaCache]) -> None:
        if isinstance(cache, LlamaCache):
            cache.bind(self)
        super().set_cache(cache)

    def eval(self, tokens: Sequence[int]) -> None:
        super().eval(tokens)
        if len(tokens):
            self._stored_logits = None
            self._logits_at = self.n_tokens

    def reset(self) -> None:
        super().reset()
        self._stored_logits, self._logits_at = None, -1

    def sample(self, *args: Any, **kwargs: Any) -> int:
        bound = _SAMPLE_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        idx = bound.arguments["idx"]
        stored = self._stored_logits
        if stored is None or stored[0] != self.n_tokens or (idx is not None and idx != self.n_tokens - 1):
            return super().sample(*args, **kwargs)
        sampler = self._sampler
        if sampler is None:  # as upstream: a sampler for this call only
            sampler = self._init_sampler(**{k: v for k, v in bound.arguments.items() if k in _SAMPLER_ARGUMENTS})
        return states.sample_from_logits(sampler.sampler, stored[1])

    def _current_logits(self) -> Optional[np.ndarray]:
        """The logits for the token after the context's, if current: stored, or the context's own."""
        if self._stored_logits is not None and self._stored_logits[0] == self.n_tokens:
            return self._stored_logits[1]
        if self.n_tokens > 0 and self._logits_at == self.n_tokens:
            return states.copy_logits(self.ctx, self._n_vocab)
        return None

    def save_state(self) -> llama_cpp.llama.LlamaState:
        if isinstance(self.cache, LlamaCache) and sys._getframe(1).f_code is _COMPLETION_CODE:
            return _DISCARDED_STATE  # LlamaCache.__setitem__ stores the sequence itself
        if self._logits_all:
            return super().save_state()
        state = states.copy_whole_state(self.ctx)
        return llama_cpp.llama.LlamaState(
            input_ids=self.input_ids.copy(),
            scores=np.empty((0, self._n_vocab), dtype=np.single),
            n_tokens=self.n_tokens,
            llama_state=state,
            llama_state_size=len(state),
            seed=self._seed,
        )

    def load_state(self, state: llama_cpp.llama.LlamaState) -> None:
        self._stored_logits, self._logits_at = None, -1
        if len(state.scores) or self._logits_all:
            return super().load_state(state)
        self.input_ids = state.input_ids.copy()
        self.n_tokens = state.n_tokens
        self._requires_eval = True
        self._seed = state.seed
        states.restore_whole_state(self.ctx, state.llama_state, state.llama_state_size)
