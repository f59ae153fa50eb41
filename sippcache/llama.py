"""The llama-cpp-python adapter: restore the best cached prefix, evaluate only the rest.

Two ways in:

- `PrefixCache(llm, url).prefill(tokens)`: explicit. Afterwards the context
  holds exactly `tokens` and the last token's logits are current, so
  `llm.sample()` / `llm.generate()` continue as if the whole prompt had been
  evaluated.
- `llm.set_cache(LlamaCache(url))`: a drop-in for llama-cpp-python's own cache
  hook (`create_completion`, `create_chat_completion`, its server). Use it
  with `sippcache.llama.Llama` to also skip llama-cpp-python's 512 MB
  `scores` copy after every completion.

What is stored is llama.cpp's per-sequence state (`llama_state_seq_get_data`),
framed by `sippcache.frame`, under a namespace made of the model fingerprint
and a scope. Never the whole context, never the scores, never a pickle.

Correctness rules (see docs/llama.md):

- The entry restored for a prompt of n tokens covers at most n - 1 of them;
  the last token is always evaluated, so its logits are fresh.
- A restored state is truncated (to use a longer entry that shares a common
  prefix) only when llama.cpp can do it exactly:
  ``llama_memory_seq_pos_min(mem, 0) <= max(0, n - n_swa)``. On sliding-window
  models that rarely holds after a restore, so every prefill also stores a
  checkpoint at n - 1 tokens: an exact repeat then needs no truncation.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import llama_cpp
import numpy as np
from llama_cpp.llama_cache import BaseLlamaCache

from . import frame
from . import tokens as _tokens
from .errors import CorruptEntry
from .fingerprint import Fingerprint, llama_fingerprint
from .protocol import CacheBackend, Match
from .registry import open as open_cache
from .writer import BackgroundWriter

log = logging.getLogger("sippcache")

#: The `kind` of entries holding one llama.cpp sequence's state.
KIND = "llama.seq"
DEFAULT_MIN_TOKENS = 16
DEFAULT_CHECKPOINT_INTERVAL = 2048


@dataclass
class PrefixStats:
    """Counters of one `PrefixCache` (this process only)."""

    hits: int = 0
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


def _check_options(scope: Any, min_tokens: Any, checkpoint_interval: Any, max_pending_writes: Any = 1) -> None:
    """Refuse bad options before anything is opened or created."""
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a str, not {type(scope).__name__}")
    for name, value in (("min_tokens", min_tokens), ("checkpoint_interval", checkpoint_interval),
                        ("max_pending_writes", max_pending_writes)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


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
    `checkpoint_interval` tokens.
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
    ) -> None:
        if not isinstance(llm, llama_cpp.Llama):
            raise TypeError(f"llm must be a llama_cpp.Llama, not {type(llm).__name__}")
        _check_options(scope, min_tokens, checkpoint_interval, max_pending_writes)
        self.llm = llm
        self.fingerprint: Fingerprint = llama_fingerprint(llm)
        self.cache, self._owns_cache = _open(cache)
        self.scope = scope
        self.namespace = f"llama:{self.fingerprint.digest}/{scope}"
        self.min_tokens = min_tokens
        self.checkpoint_interval = checkpoint_interval
        self.n_swa = int(llama_cpp.llama_model_n_swa(llm.model))
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
    ) -> int:
        """Bring the context to exactly `tokens` with fresh logits for the last one.

        Returns how many tokens were not evaluated: taken from the cache, or
        already in the context from an earlier call. With `restore=False` the
        whole prompt is evaluated from scratch (snapshots are still stored);
        `progress(done, total)` is called as tokens are evaluated.
        """
        return self._prefill(self._checked(tokens), restore=restore, progress=progress)

    def _checked(self, tokens: _tokens.Tokens) -> list[int]:
        """`tokens` as a list of ids this model and context can evaluate; ValueError otherwise."""
        ids = list(_tokens.decode(_tokens.encode(tokens)))
        if not ids:
            raise ValueError("cannot prefill an empty prompt")
        n_vocab = self.llm.n_vocab()
        if max(ids) >= n_vocab:
            position = next(i for i, t in enumerate(ids) if t >= n_vocab)
            raise ValueError(f"token id {ids[position]} at position {position} is outside the vocabulary (n_vocab={n_vocab})")
        if len(ids) > self.llm.n_ctx():
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context size n_ctx={self.llm.n_ctx()}")
        if self._closed:
            raise RuntimeError("PrefixCache is closed")
        return ids

    def _prefill(
        self,
        ids: list[int],
        *,
        restore: bool = True,
        progress: Optional[Callable[[int, int], None]] = None,
        evaluate_last: bool = True,
    ) -> int:
        """`prefill` for checked ids; with `evaluate_last=False` the context ends
        at ids[:-1] (llama-cpp-python's hook evaluates the last token itself)."""
        with self._lock:
            if restore:
                start = self._reuse(ids)
            else:
                self._clear_context()
                start = 0
            self._evaluate(ids, start, progress=progress, evaluate_last=evaluate_last)
        return start

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

    # -- restoring ----------------------------------------------------------------

    def _reuse(self, ids: list[int]) -> int:
        """Put the longest usable prefix of `ids[:-1]` in the context; return its length.

        Candidates, longest first: the live context, the cached entry whose key
        is the longest prefix, the cached entry sharing the longest common
        prefix (usable only if truncating it is exact). The last token is
        never taken from the cache, so its logits are always computed.
        """
        target = ids[:-1]
        matches: list[Match] = []
        for partial in (False, True) if target else ():
            match = self._lookup(target, partial=partial)
            if match is not None and any(m.key == match.key for m in matches):
                match.release()  # both lookups found the same entry
            elif match is not None:
                matches.append(match)
        try:
            # Longest first; on equal length, an exact-prefix entry (no truncation) first.
            matches.sort(key=lambda m: (m.length, len(m.key) == m.length), reverse=True)
            for match in matches:
                live = _common_length(self.llm.input_ids[: self.llm.n_tokens], target)
                if live >= match.length and self._truncate_live(live):
                    break  # the context already holds at least as much
                if match.length >= self.min_tokens and self._restore(match, match.length, target):
                    return match.length
        finally:
            for match in matches:
                match.release()
        self._stats.misses += 1
        live = _common_length(self.llm.input_ids[: self.llm.n_tokens], target)
        if self._truncate_live(live):
            self._stats.context_tokens_reused += live
            return live
        self._clear_context()
        return 0

    def _truncate_live(self, length: int) -> bool:
        """Cut the live context to `length` tokens if llama.cpp can do so exactly."""
        llm = self.llm
        if length == 0:
            return False
        if length == llm.n_tokens:
            return True
        if not self._can_truncate(length) or not llama_cpp.llama_memory_seq_rm(self._memory(), 0, length, -1):
            return False
        llm.n_tokens = length
        return True

    def _holds_positions(self, length: int) -> bool:
        """Sequence 0 ends at position length - 1 and (without a sliding window) starts at 0."""
        memory = self._memory()
        if llama_cpp.llama_memory_seq_pos_max(memory, 0) != length - 1:
            return False
        return self.n_swa > 0 or llama_cpp.llama_memory_seq_pos_min(memory, 0) == 0

    def _can_truncate(self, length: int) -> bool:
        """llama.cpp's own rule: sliding-window layers keep only the last n_swa
        positions, so cutting below what they hold silently corrupts the logits."""
        pos_min = llama_cpp.llama_memory_seq_pos_min(self._memory(), 0)
        return pos_min <= max(0, length - self.n_swa) if self.n_swa > 0 else True

    def _restore(self, match: Match, length: int, target: list[int]) -> bool:
        """Load `match` into sequence 0 and keep its first `length` tokens; False if unusable."""
        started = time.perf_counter()
        try:
            entry = frame.decode(match.blob)
        except CorruptEntry as exc:
            log.warning("sippcache: dropping a corrupt cache entry (%d tokens): %s", len(match.key), exc)
            self._stats.corrupt_entries += 1
            self._drop(match.key)
            return False
        if (entry.kind, entry.fingerprint, entry.tokens, len(entry.sections)) != (
            KIND, self.fingerprint.digest, tuple(match.key), 1
        ):
            log.warning("sippcache: dropping a cache entry whose header does not match its key and model")
            self._stats.corrupt_entries += 1
            self._drop(match.key)
            return False
        payload = np.frombuffer(entry.sections[0], dtype=np.uint8)  # a view of the stored bytes: no copy
        size = payload.nbytes
        loaded = llama_cpp.llama_state_seq_set_data(
            self.llm.ctx, payload.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0
        )
        del payload, entry  # views of the match: gone before it is released
        if loaded == size and not self._holds_positions(len(match.key)):
            loaded = 0  # a well-formed state for other positions than its key says: never use it
        if loaded != size:  # 0 = refused; fewer bytes = the state did not fill the entry
            log.warning(
                "sippcache: dropping a cached state (%d tokens) that llama.cpp refused or that holds other positions",
                len(match.key),
            )
            self._stats.rejected_entries += 1
            self._drop(match.key)
            self._clear_context()
            return False
        if length < len(match.key):
            if not self._can_truncate(length) or not llama_cpp.llama_memory_seq_rm(self._memory(), 0, length, -1):
                self._stats.rejected_entries += 1
                self._clear_context()
                return False
        llm = self.llm
        llm.input_ids[:length] = target[:length]
        llm.n_tokens = length
        if hasattr(llm, "_requires_eval"):
            llm._requires_eval = True
        self._stats.hits += 1
        self._stats.tokens_reused += length
        self._stats.bytes_read += len(match.blob)
        self._stats.restore_seconds += time.perf_counter() - started
        return True

    def _lookup(self, key: list[int], *, partial: bool) -> Optional[Match]:
        """A cache lookup that never fails the request: a backend error is logged and is a miss."""
        try:
            return self.cache.lookup(key, namespace=self.namespace, partial=partial)
        except Exception as exc:
            self._stats.backend_errors += 1
            log.warning("sippcache: cache lookup failed, continuing uncached: %s: %s", type(exc).__name__, exc)
            return None

    def _drop(self, key: Sequence[int]) -> None:
        try:
            self.cache.delete(key, namespace=self.namespace)
        except Exception as exc:
            self._stats.backend_errors += 1
            log.warning("sippcache: could not delete a bad cache entry: %s: %s", type(exc).__name__, exc)

    def _clear_context(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory(), 0, -1, -1)
        self.llm.n_tokens = 0

    def _memory(self) -> Any:
        return llama_cpp.llama_get_memory(self.llm.ctx)

    # -- evaluating and storing -------------------------------------------------

    def _evaluate(
        self,
        ids: list[int],
        start: int,
        *,
        evaluate_last: bool = True,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> None:
        """Evaluate `ids[start:]`, snapshotting at checkpoint boundaries and at
        len(ids) - 1; with `evaluate_last=False`, stop before the last token."""
        last = len(ids) - 1
        first_boundary = (start // self.checkpoint_interval + 1) * self.checkpoint_interval
        boundaries = [b for b in range(first_boundary, last, self.checkpoint_interval) if b >= self.min_tokens]
        if last > start and last >= self.min_tokens:
            boundaries.append(last)
        end = len(ids) if evaluate_last else last
        # Intermediate checkpoints of one prefill may take half the cache's budget,
        # so they never evict everything else (the one at len - 1 is always offered).
        max_bytes = self._max_bytes()
        budget = None if max_bytes is None else max_bytes // 2
        position = start
        for boundary in boundaries:
            self._eval(ids, position, boundary, start, end, progress)
            position = boundary
            spent = self._checkpoint(ids[:boundary], budget=None if boundary == last else budget)
            if budget is not None:
                budget -= spent
        self._eval(ids, position, end, start, end, progress)
        self._stats.tokens_evaluated += end - start

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

    def _checkpoint(self, key: list[int], *, budget: Optional[int] = None) -> int:
        """Copy sequence 0's state now (the context is not thread-safe) and store it
        in the background, unless `key` is stored already or the state is larger
        than `budget`. Returns the bytes queued."""
        existing = self._lookup(key, partial=False)
        if existing is not None:
            with existing:
                if existing.length == len(key):
                    return 0
        ctx = self.llm.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        if budget is not None and size > budget:
            return 0
        buffer = bytearray(size)
        written = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buffer), size, 0)
        if written == 0 or written > size:
            log.warning("sippcache: llama.cpp could not copy the sequence state; not caching it")
            return 0
        self._writer.submit((key, memoryview(buffer)[:written]))
        return written

    def _max_bytes(self) -> Optional[int]:
        try:
            return self.cache.stats().max_bytes
        except Exception:  # stats are advisory here
            return None

    def _write_entry(self, item: tuple[list[int], memoryview]) -> None:
        key, state = item
        blob = frame.encode(
            key,
            [state],
            fingerprint=self.fingerprint.digest,
            kind=KIND,
            versions={"llama_cpp_python": llama_cpp.__version__},
            meta={"n_swa": self.n_swa, "scope": self.scope, "pid": os.getpid()},
        )
        self.cache.store(key, blob, namespace=self.namespace)
        self._stats.entries_written += 1
        self._stats.bytes_written += len(blob)


class LlamaCache(BaseLlamaCache):
    """A drop-in for llama-cpp-python's cache hook: ``llm.set_cache(LlamaCache(url))``.

    llama-cpp-python asks its cache for a state before each completion and
    hands it one after. This class answers the first call by doing the work
    itself: it restores the best prefix of the prompt (minus its last token)
    into the calling model's context and stores a checkpoint, then reports a
    miss, so llama-cpp-python continues from the context as it is and
    evaluates only the last token. After the completion it stores the
    context's sequence state; the `LlamaState` it is handed is not kept.

    The model is the `Llama` instance whose completion calls the cache (the
    hook passes only tokens), or the one given as `llm`.
    """

    def __init__(
        self,
        cache: Union[str, CacheBackend, None] = None,
        *,
        llm: Optional[llama_cpp.Llama] = None,
        scope: str = "default",
        min_tokens: int = DEFAULT_MIN_TOKENS,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
    ) -> None:
        _check_options(scope, min_tokens, checkpoint_interval)
        if llm is not None and not isinstance(llm, llama_cpp.Llama):
            raise TypeError(f"llm must be a llama_cpp.Llama, not {type(llm).__name__}")
        self.cache, self._owns_cache = _open(cache)
        super().__init__(capacity_bytes=self.cache.stats().max_bytes or 0)
        self._options = dict(scope=scope, min_tokens=min_tokens, checkpoint_interval=checkpoint_interval)
        self._prefix_caches: weakref.WeakKeyDictionary[llama_cpp.Llama, PrefixCache] = weakref.WeakKeyDictionary()
        self._bound = llm

    def bind(self, llm: llama_cpp.Llama) -> None:
        """Serve `llm` when the caller cannot be found from the calling frame."""
        self._bound = llm

    def prefix_cache(self, llm: llama_cpp.Llama) -> PrefixCache:
        """The `PrefixCache` this cache uses for `llm`."""
        if llm not in self._prefix_caches:
            self._prefix_caches[llm] = PrefixCache(llm, self.cache, **self._options)  # type: ignore[arg-type]
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
            prefix_cache._prefill(prefix_cache._checked(key), evaluate_last=False)
        raise KeyError("sippcache restored the prefix into the context; nothing to load")

    def __contains__(self, key: Sequence[int]) -> bool:
        llm = self._caller()
        prefix_cache = self.prefix_cache(llm)
        match = prefix_cache._lookup([int(t) for t in key][:-1], partial=False)
        if match is None:
            return False
        match.release()
        return match.length >= prefix_cache.min_tokens

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        llm = self._caller()
        prefix_cache = self.prefix_cache(llm)
        evaluated = [int(t) for t in llm.input_ids[: llm.n_tokens]]
        if len(evaluated) >= prefix_cache.min_tokens:
            with prefix_cache._lock:
                prefix_cache._checkpoint(evaluated)

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
        import sys

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


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` whose `save_state()` leaves out the scores array when
    `logits_all=False`.

    llama-cpp-python's `save_state()` copies an n_batch x n_vocab float32
    array (512 MB for a 262k vocabulary) that nothing reads unless
    `logits_all=True`, and `create_completion` calls it after every completion
    when a cache is set. Use this class with `LlamaCache` (or any cache) to
    skip that copy; states it saves load in the same class.
    """

    def set_cache(self, cache: Optional[BaseLlamaCache]) -> None:
        if isinstance(cache, LlamaCache):
            cache.bind(self)
        super().set_cache(cache)

    def save_state(self) -> llama_cpp.llama.LlamaState:
        if self._logits_all:
            return super().save_state()
        size = llama_cpp.llama_state_get_size(self.ctx)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_get_data(self.ctx, buffer, size)
        if written == 0 or written > size:
            raise RuntimeError("failed to copy the llama state")
        return llama_cpp.llama.LlamaState(
            input_ids=self.input_ids.copy(),
            scores=np.empty((0, self._n_vocab), dtype=np.single),
            n_tokens=self.n_tokens,
            llama_state=bytes(memoryview(buffer)[:written]),
            llama_state_size=written,
            seed=self._seed,
        )

    def load_state(self, state: llama_cpp.llama.LlamaState) -> None:
        if len(state.scores) or self._logits_all:
            return super().load_state(state)
        self.input_ids = state.input_ids.copy()
        self.n_tokens = state.n_tokens
        self._requires_eval = True
        self._seed = state.seed
        data = np.frombuffer(state.llama_state, dtype=np.uint8)
        pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_set_data(self.ctx, pointer, state.llama_state_size) != state.llama_state_size:
            raise RuntimeError("failed to set the llama state")
