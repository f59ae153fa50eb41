"""What an unbound `LlamaCache` stores: llama-cpp-python's own whole-context states.

llama-cpp-python's cache hook passes only tokens, so a `LlamaCache` that is
not bound to a model (``llama_cpp.Llama(...).set_cache(LlamaCache(url))``, the
way llama-cpp-python's own `LlamaRAMCache` is used) cannot prefill anything
itself. It does what `LlamaRAMCache` does, with the store behind it:

- ``cache[prompt + completion] = llm.save_state()`` stores the `LlamaState`
  under the tokens the state holds (``input_ids[:n_tokens]``): the whole
  context's state (`llama_state_get_data`) as section "state", framed by
  `sippcache.frame` with the kind `llama.whole`. llama-cpp-python's `scores`
  array (n_batch x n_vocab float32: 512 MB for gemma's vocabulary) is left out
  where it holds nothing. With ``logits_all=False`` llama-cpp-python never
  writes it (sampling reads the context's logits), so nothing is kept; with
  ``logits_all=True`` it holds the logits of every position, and its rows up
  to the last one that is not all zero bits are kept (section "scores"), as
  `LlamaRAMCache` keeps them (logprobs of an echoed prompt read them).
- ``cache[prompt]`` answers, as `LlamaRAMCache` does, the entry sharing the
  longest common prefix with the prompt (at least `min_tokens`), as a
  `LlamaState` that llama-cpp-python's own `load_state` loads: the same
  state, input ids, seed and (with ``logits_all=True``) scores rows
  `LlamaRAMCache` would hand back; the rows left out are zeros, given as one
  zero row that numpy broadcasts.
  llama-cpp-python then cuts the context to the part the prompt shares and
  evaluates the rest, as after a `LlamaRAMCache` hit. A whole-context state
  holds every cell the live context held, so that cut is the one
  llama-cpp-python makes in a live context. A recurrent or hybrid model's
  state cannot be cut at all: llama-cpp-python then evaluates the whole
  prompt ("partial kv removal not supported"). Without the model the cache
  cannot tell which happened, so only a state the prompt extends (nothing to
  cut) counts as `tokens_reused`; one that must be cut counts as
  `tokens_offered`. Bind the cache (or use `sippcache.llama.Llama`) for real
  reuse on recurrent and hybrid models.

Without a model there is no model fingerprint: entries live under the
namespace ``llama.whole:<llama-cpp-python version>/<scope>``. Give each model
its own store or `scope` (as with `LlamaDiskCache`), or bind the cache, whose
entries are namespaced by the model's fingerprint. Once this process has
stored a state, entries made with another vocabulary or context size are
misses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import llama_cpp
import numpy as np

from .. import frame
from ..errors import CorruptEntry
from ..frame import secret_from_environment
from ..protocol import CacheBackend
from ..state.buffers import StateBuffers
from .options import CacheOptions
from .seqcache import PrefixStats, common_length, decode_or_drop

log = logging.getLogger("sippcache")

#: The `kind` of entries holding a whole llama.cpp context's state (`Llama.save_state()`).
KIND = "llama.whole"
STATE = "state"
SCORES = "scores"

_T = TypeVar("_T")
_D = TypeVar("_D")


def namespace(scope: str) -> str:
    """Where an unbound `LlamaCache` keeps its entries."""
    return f"llama.whole:{llama_cpp.__version__}/{scope}"


def kept_score_rows(scores: np.ndarray, n_tokens: int) -> int:
    """How many leading rows of a `LlamaState`'s `scores` to keep. Fewer rows than tokens:
    the array has n_batch rows, so `logits_all=False`, and llama-cpp-python never writes
    it (what it holds is whatever the memory held): none. Otherwise the rows up to the
    last one that is not all zero bits (-0.0 counts as data): one pass over the array
    (25 ms for 512 MB)."""
    if scores.shape[0] < n_tokens or scores.size == 0 or not scores.view(np.uint8).any():
        return 0
    nonzero = np.flatnonzero(scores.view(np.uint32).any(axis=1))
    return int(nonzero[-1]) + 1


class WholeStateCache:
    """`LlamaState`s in a store, found by longest common prefix (see the module docstring)."""

    def __init__(self, cache: CacheBackend, options: CacheOptions) -> None:
        self.cache = cache
        self.scope = options.scope
        self.namespace = namespace(options.scope)
        self.min_tokens = options.min_tokens
        secret = options.secret if options.secret is not None else secret_from_environment()
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.stats = PrefixStats()
        #: (n_vocab, n_ctx) of the model this cache serves, once a state of it was stored here.
        self.layout: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._buffers = StateBuffers()  # what entries are framed into for a store that copies them

    # -- llama-cpp-python's hook -----------------------------------------------------

    def store(self, value: llama_cpp.llama.LlamaState) -> None:
        """Store a `LlamaState` under the tokens it holds, unless an entry has them already."""
        for name in ("input_ids", "scores", "n_tokens", "llama_state", "llama_state_size", "seed"):
            if not hasattr(value, name):
                raise TypeError(f"an unbound LlamaCache stores llama_cpp LlamaState values, not {type(value).__name__}")
        n_tokens = int(value.n_tokens)
        key = [int(t) for t in np.asarray(value.input_ids)[:n_tokens]]
        scores = np.ascontiguousarray(value.scores, dtype=np.single)
        if scores.ndim != 2:
            raise ValueError(f"LlamaState.scores must be 2-dimensional, not {scores.shape}")
        with self._lock:
            self.layout = (int(scores.shape[1]), len(value.input_ids))
            if n_tokens < self.min_tokens or len(key) != n_tokens:
                return
            if self._safely("touch", lambda: self.cache.touch(key, namespace=self.namespace), False):
                return  # the same tokens: the same state (recency counted)
            rows = kept_score_rows(scores, n_tokens)
            size = int(value.llama_state_size)
            sections: list[Any] = [memoryview(value.llama_state)[:size]]
            roles = [STATE]
            if rows:
                sections.append(scores[:rows].data.cast("B"))
                roles.append(SCORES)
            meta = {
                "n_vocab": int(scores.shape[1]), "n_ctx": len(value.input_ids), "score_rows": int(scores.shape[0]),
                "seed": int(value.seed), "scope": self.scope, "pid": os.getpid(),
            }  # fmt: skip
            with frame.framed_for(
                self.cache,
                self._buffers,
                key,
                sections,
                fingerprint=self.namespace,
                kind=KIND,
                meta=meta,
                roles=roles,
                secret=self.secret,
                versions={"llama_cpp_python": llama_cpp.__version__},
            ) as blob:
                if self._safely("store", lambda: self.cache.store(key, blob, namespace=self.namespace), False):
                    self.stats.entries_written += 1
                    self.stats.bytes_written += memoryview(blob).nbytes

    def lookup(self, tokens: Sequence[int]) -> llama_cpp.llama.LlamaState:
        """The stored state sharing the longest common prefix with `tokens`; KeyError if none
        shares at least `min_tokens`."""
        ids = [int(t) for t in tokens]
        with self._lock:
            self.stats.lookups += 1
            started = time.perf_counter()
            state = self._fetch(ids) if len(ids) >= self.min_tokens else None
            if state is None:
                self.stats.misses += 1
                raise KeyError("no stored state shares enough of the prompt")
            self.stats.hits += 1
            common = common_length(state.input_ids[: state.n_tokens], ids)
            if common == state.n_tokens < len(ids):  # the prompt extends it: llama-cpp-python cuts nothing
                self.stats.tokens_reused += common
            else:  # it cuts the state to what the prompt shares (minus its last token), if the model can be cut
                self.stats.tokens_offered += common - 1 if common == len(ids) else common
            self.stats.restore_seconds += time.perf_counter() - started
            return state

    def contains(self, tokens: Sequence[int]) -> bool:
        """Whether `lookup(tokens)` would find an entry (without reading it)."""
        ids = [int(t) for t in tokens]
        if len(ids) < self.min_tokens:
            return False
        found = self._safely("peek", lambda: self.cache.peek(ids, namespace=self.namespace, partial=True), None)
        return found is not None and found.length >= self.min_tokens

    # -- entries -----------------------------------------------------------------------

    def _fetch(self, ids: list[int]) -> llama_cpp.llama.LlamaState | None:
        match = self._safely("lookup", lambda: self.cache.lookup(ids, namespace=self.namespace, partial=True), None)
        if match is None:
            return None
        with match:
            if match.length < self.min_tokens:
                return None
            key = match.key

            def drop() -> None:
                self._safely("delete of a bad entry", lambda: self.cache.delete(key, namespace=self.namespace), None)

            state = decode_or_drop(lambda: self._decode(match.blob, key), key, self.stats, drop)
            if state is None:
                return None
            self.stats.bytes_read += len(match.blob)
        if self.layout is not None and self.layout != (state.scores.shape[1], len(state.input_ids)):
            self.stats.rejected_entries += 1  # another model's (or context size's): llama.cpp would refuse it
            return None
        return state

    def _decode(self, blob: Any, key: tuple[int, ...]) -> llama_cpp.llama.LlamaState:
        """The `LlamaState` in `blob`, copied out of it (the blob is valid only inside the match)."""
        entry = frame.decode(blob, secret=self.secret)
        if (entry.kind, entry.fingerprint, entry.tokens) != (KIND, self.namespace, key):
            raise CorruptEntry("its header does not match its key and namespace")
        meta = entry.meta
        fields: list[int] = []
        for name in ("n_vocab", "n_ctx", "score_rows", "seed"):
            value = meta.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CorruptEntry(f"its header lacks {name}")
            fields.append(value)
        n_vocab, n_ctx, score_rows, seed = fields
        state, scores = entry.section(STATE), entry.section(SCORES)
        if state is None or n_vocab < 1 or not len(key) <= n_ctx or not 0 <= score_rows <= n_ctx:
            raise CorruptEntry("its header sizes do not match its key")
        if scores is None:
            # Nothing but zeros was saved: one zero row, which load_state broadcasts over its rows.
            rows = np.zeros((1, n_vocab), dtype=np.single)
        else:
            if len(scores) % (4 * n_vocab) or not 0 < len(scores) // (4 * n_vocab) <= score_rows:
                raise CorruptEntry(f"its scores are {len(scores)} bytes, not a number of {n_vocab}-token rows")
            rows = np.zeros((score_rows, n_vocab), dtype=np.single)
            kept = np.frombuffer(scores, dtype=np.single).reshape(-1, n_vocab)
            rows[: len(kept)] = kept
            del kept
        input_ids = np.full(n_ctx, -1, dtype=np.intc)  # no token matches past the state's own
        input_ids[: len(key)] = key
        data = bytes(state)
        del state, scores, entry  # views of the match: gone before it is released
        return llama_cpp.llama.LlamaState(
            input_ids=input_ids, scores=rows, n_tokens=len(key), llama_state=data, llama_state_size=len(data), seed=seed
        )

    def _safely(self, what: str, call: Callable[[], _T], default: _D) -> _T | _D:
        """`call()`, or `default` if the backend fails: logged and counted, never raised."""
        try:
            return call()
        except Exception as exc:
            self.stats.backend_errors += 1
            log.warning("sippcache: cache %s failed, continuing uncached: %s: %s", what, type(exc).__name__, exc)
            return default
