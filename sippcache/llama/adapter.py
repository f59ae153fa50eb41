"""The llama-cpp-python adapter: restore the best cached prefix, evaluate only the rest.

Two ways in:

- `PrefixCache(llm, url).prefill(tokens)`: explicit. Afterwards the context
  holds exactly `tokens` and the next token can be sampled as if the whole
  prompt had been evaluated (`llm.sample()` / `llm.generate()`).
- `llm.set_cache(LlamaCache(url))`: a drop-in for llama-cpp-python's own cache
  hook (`create_completion`, `create_chat_completion`, its server). Fast
  with `sippcache.llama.Llama`, whose `set_cache` binds the cache to the model
  (with a plain `llama_cpp.Llama`: ``llm.set_cache(LlamaCache(url).bind(llm))``).
  Unbound, it keeps the whole-context states llama-cpp-python hands its cache,
  as `LlamaRAMCache` does (`sippcache.llama.wholestate`).

With `sippcache.llama.Llama` (rather than a plain `llama_cpp.Llama`), an entry
for a whole prompt also keeps the last position's logits, and an exact repeat
evaluates nothing: the first token is sampled from the stored logits with the
caller's own sampler chain. A plain `llama_cpp.Llama` samples only from its
context, so for it the last prompt token is always evaluated.

What is stored is llama.cpp's per-sequence state (`llama_state_seq_get_data`),
framed by `sippcache.llama.states` / `sippcache.frame`, under a namespace made of the
model fingerprint and a scope (unbound `LlamaCache`: the whole context, without
its empty scores). Never a pickle.

Correctness rules (see docs/llama.md):

- A restored state must hold exactly the positions its key says; logits come
  either from an evaluation or from the entry stored with that very state.
- A restored state is truncated (to use a longer entry that shares a common
  prefix) only when the model's memory can do it exactly (`states.MemoryKind`):
  ``llama_memory_seq_pos_min(mem, 0) <= max(0, n - n_swa + 1)`` with a sliding
  window (after a restore that holds only for a cut of one token), never for
  recurrent and hybrid models (their state is used at exactly its length). So
  prefills store checkpoints: every `checkpoint_interval` tokens, and where the
  prompt leaves a stored one.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Unpack

import llama_cpp
import numpy as np
from llama_cpp.llama_cache import BaseLlamaCache

from .. import tokens as _tokens
from ..protocol import CacheBackend
from . import states
from .fingerprint import Fingerprint, llama_fingerprint, speed_facts
from .options import CacheOptions, CacheSettings
from .seqcache import Reuse, SequenceCache, check_prompt, common_length, open_cache_argument
from .wholestate import WholeStateCache

log = logging.getLogger("sippcache")

#: The `kind` of entries holding one llama.cpp sequence's state.
KIND = states.KIND

__all__ = ["KIND", "Llama", "LlamaCache", "PrefillResult", "PrefixCache"]


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


def _check_observer(on_prefill: Any) -> None:
    if on_prefill is not None and not callable(on_prefill):
        raise TypeError("on_prefill must be callable")


class PrefixCache:
    """Prefix-state caching for one `llama_cpp.Llama` instance.

    `cache` is a URL, an open `CacheBackend`, or None for `sippcache.open()`'s
    default. A URL opened here is closed by `close()`; a backend passed in is
    left open. `options` (`CacheOptions`: `scope`, `min_tokens`,
    `checkpoint_interval`, `max_pending_writes`, `secret`) say how the store is
    used; its fields may be given as keywords instead (``scope="tenant-a"``),
    not both. `on_prefill(result)` is called after every prefill (for metrics).
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        cache: str | CacheBackend | None = None,
        *,
        options: CacheOptions | None = None,
        on_prefill: Callable[[PrefillResult], None] | None = None,
        **settings: Unpack[CacheSettings],
    ) -> None:
        if not isinstance(llm, llama_cpp.Llama):
            raise TypeError(f"llm must be a llama_cpp.Llama, not {type(llm).__name__}")
        options = CacheOptions.build(options, settings)
        _check_observer(on_prefill)
        self.llm = llm
        self.fingerprint: Fingerprint = llama_fingerprint(llm)
        self._states = SequenceCache(
            cache,
            fingerprint=self.fingerprint,
            kind=states.MemoryKind.of(llm.model),
            n_vocab=llm.n_vocab(),
            options=options,
            # One sequence evaluated from position 0: with a full-size SWA cache a live
            # context holds position p in slot p, and a restore can put its cells there.
            live_layout=bool(getattr(llm.context_params, "swa_full", False)),
            rates_place=speed_facts(llm),
        )
        self.options = options
        self.cache, self.namespace, self.scope = self._states.cache, self._states.namespace, options.scope
        self.min_tokens, self.checkpoint_interval = options.min_tokens, options.checkpoint_interval
        self.secret, self.memory_kind = self._states.secret, self._states.kind
        #: The measured prefill and restore rates that decide whether a stored state is restored
        #: (`CacheOptions.restore`; `sippcache.state.rates`), this cache's one place being "".
        self.rates = self._states.rates
        #: The file the rates are kept in for the next process at the same place
        #: (`CacheOptions.rates_dir`), or None where they are not kept.
        self.rates_path = self._states.rates_path
        self.n_swa = self.memory_kind.n_swa
        self.on_prefill = on_prefill
        #: Whole-prompt entries keep their logits, and exact repeats sample from them.
        self.stored_logits = isinstance(llm, Llama) and not llm._logits_all
        self._lock = threading.Lock()  # one prefill at a time: the llama context is not thread-safe
        self._closed = False

    # -- public API ------------------------------------------------------------

    def prefill(
        self,
        tokens: _tokens.Tokens,
        *,
        restore: bool = True,
        progress: Callable[[int, int], None] | None = None,
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
        return self._states.set_pinned(self._final_key(self._checked(tokens)), True)

    def unpin(self, tokens: _tokens.Tokens) -> bool:
        """Undo `pin`; True if the entry is in the cache."""
        return self._states.set_pinned(self._final_key(self._checked(tokens)), False)

    def cached_length(self, tokens: _tokens.Tokens) -> int:
        """How many leading tokens of `tokens` the longest stored entry that is a prefix
        of them holds, 0 if none is worth restoring (shorter than `min_tokens`): what
        a prefill would find, asked without reading an entry (`LlamaCache.__contains__`)."""
        ids = list(_tokens.decode(_tokens.encode(tokens)))
        found = self._states.peek(ids, partial=False) if ids else None
        return found.length if found is not None and found.length >= self.min_tokens else 0

    def snapshot_context(self) -> None:
        """Store what the context holds now, with its logits when they are current: after a
        completion, the prompt and the tokens generated (what `LlamaCache` keeps of one)."""
        with self._lock:
            llm = self.llm
            evaluated = [int(t) for t in llm.input_ids[: llm.n_tokens]]
            if len(evaluated) < self.min_tokens:
                return
            logits = llm.current_logits() if isinstance(llm, Llama) and self.stored_logits else None
            self._states.snapshot(llm.ctx, 0, evaluated, logits=logits)

    def flush(self) -> None:
        """Wait until every queued snapshot is written to the cache."""
        self._states.flush()

    def stats(self) -> dict[str, int | float]:
        """This cache's counters (see `PrefixStats`)."""
        return self._states.counters()

    def close(self) -> None:
        """Write pending snapshots, stop the writer, and close a cache opened from a URL."""
        if self._closed:
            return
        self._closed = True
        self._states.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one prefill ---------------------------------------------------------------

    def _checked(self, tokens: _tokens.Tokens) -> list[int]:
        """`tokens` as a list of ids this model and context can evaluate; ValueError otherwise."""
        ids = check_prompt(tokens, self._states.n_vocab)
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
        progress: Callable[[int, int], None] | None = None,
        pin: bool = False,
    ) -> PrefillResult:
        llm, stats = self.llm, self._states.stats
        with self._lock:
            restore_before = stats.restore_seconds
            if self._logits_current(ids):
                start, restored, logits, branch = len(ids), 0, None, 0  # ready to sample: nothing to do
                stats.context_tokens_reused += len(ids)
            else:
                live = llm.input_ids[: llm.n_tokens]
                if restore:
                    reuse = self._states.reuse(llm.ctx, 0, ids, live, with_logits=self.stored_logits)
                else:
                    self._states.clear(llm.ctx, 0)
                    reuse = Reuse(0)
                start, restored, logits, branch = reuse.start, reuse.restored, reuse.logits, reuse.branch
                self._context_set(ids, start, logits)
            if start < len(ids):
                # After a lookup, no usable entry holds the whole prompt with its logits: store
                # the final snapshot even over one without logits. Without a lookup, check first.
                self._evaluate(ids, start, branch, progress=progress, pin=pin, replace_final=restore)
            elif pin:
                self._states.set_pinned(self._final_key(ids), True)
            result = PrefillResult(
                restored, start - restored, len(ids) - start, logits is not None, stats.restore_seconds - restore_before
            )
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

    def _logits_current(self, ids: list[int]) -> bool:
        """The context holds exactly `ids` and can sample the next token right away."""
        llm = self.llm
        if llm.n_tokens != len(ids) or common_length(llm.input_ids[: llm.n_tokens], ids) != len(ids):
            return False
        if isinstance(llm, Llama):
            return llm.current_logits() is not None
        return not llm._requires_eval

    def _context_set(self, ids: list[int], start: int, logits: np.ndarray | None) -> None:
        """Record that sequence 0 now holds `ids[:start]`, set without an evaluation: the
        context's logits are not current; the stored ones are, if given."""
        llm = self.llm
        llm.input_ids[:start] = ids[:start]
        llm.n_tokens = start
        llm._requires_eval = logits is None  # llama-cpp-python's generate() may sample at once
        if isinstance(llm, Llama):
            llm.context_restored(logits)

    # -- evaluating and storing -------------------------------------------------

    def _evaluate(
        self,
        ids: list[int],
        start: int,
        branch: int,
        *,
        progress: Callable[[int, int], None] | None = None,
        pin: bool = False,
        replace_final: bool = False,
    ) -> None:
        """Evaluate `ids[start:]`, snapshotting at checkpoint boundaries, where the
        prompt leaves the entry it shares most with (`branch`), and at the end: the
        whole prompt with its logits (over an entry without them if `replace_final`),
        or (for a plain `llama_cpp.Llama`) the prompt minus its last token."""
        n, ctx, cache = len(ids), self.llm.ctx, self._states
        final = len(self._final_key(ids))
        plan = cache.plan(start, branch, final)
        position = start
        for boundary in plan.positions:
            self._eval(ids, position, boundary, start, n, progress)
            position = boundary
            cache.checkpoint(plan, ctx, 0, ids[:boundary])
        self._eval(ids, position, final, start, n, progress)
        if final > start and final >= self.min_tokens:
            logits = states.copy_logits(ctx, cache.n_vocab) if self.stored_logits else None
            cache.snapshot(
                ctx,
                0,
                ids[:final],
                logits=logits,
                pinned=pin,
                replace=replace_final and logits is not None,
                supersede=True,
            )
        elif pin:
            cache.set_pinned(ids[:final], True)
        self._eval(ids, final, n, start, n, progress)
        cache.stats.tokens_evaluated += n - start

    def _eval(
        self,
        ids: list[int],
        begin: int,
        stop: int,
        start: int,
        end: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        """`llm.eval(ids[begin:stop])` in pieces that end at multiples of n_batch: after a
        restore or a kept live prefix, the pieces a cold prefill would evaluate (measured
        on gemma-3-270m: 2,000 tokens after 2 kept ones took 2.2% longer in pieces
        counted from the kept prefix)."""
        n_batch = self.llm.n_batch
        piece = begin
        while piece < stop:
            edge = min(stop, (piece // n_batch + 1) * n_batch)
            self.llm.eval(ids[piece:edge])
            piece = edge
            if progress is not None:
                progress(edge - start, end - start)


class LlamaCache(BaseLlamaCache):
    """A drop-in for llama-cpp-python's cache hook: ``llm.set_cache(LlamaCache(url))``.

    llama-cpp-python looks the prompt up in its cache before each completion
    and hands it ``save_state()`` after. This class answers the lookup by doing
    the work itself: it prefills the prompt into its model's context (restoring
    the best cached prefix, or the whole prompt with its logits), so
    llama-cpp-python finds the prompt already evaluated and samples at once.
    After the completion it stores the context's sequence state. With
    `sippcache.llama.Llama` no whole-context state is made for that (see
    `begin_completion`); a plain `llama_cpp.Llama` still makes one (and copies
    its scores), which is not kept.

    The hook passes only tokens, so that fast path needs the model: a
    `LlamaCache` bound to one (`sippcache.llama.Llama.set_cache` binds it,
    otherwise pass `llm` or call `bind`) serves it. Unbound (a plain
    `llama_cpp.Llama`'s `set_cache`), it works as llama-cpp-python's own
    `LlamaRAMCache` does, with the store behind it: it keeps the whole-context
    states llama-cpp-python hands it (without the empty `scores` array) and
    answers the longest common prefix's (see `sippcache.llama.wholestate`).
    The other arguments (`options` or its fields as keywords, `on_prefill`)
    are `PrefixCache`'s.
    """

    def __init__(
        self,
        cache: str | CacheBackend | None = None,
        *,
        llm: llama_cpp.Llama | None = None,
        options: CacheOptions | None = None,
        on_prefill: Callable[[PrefillResult], None] | None = None,
        **settings: Unpack[CacheSettings],
    ) -> None:
        self.options = CacheOptions.build(options, settings)
        _check_observer(on_prefill)
        _check_llm(llm, optional=True)
        self.cache, self._owns_cache = open_cache_argument(cache)
        super().__init__(capacity_bytes=self.cache.stats().max_bytes or 0)
        #: `PrefixCache`'s arguments besides the model and the store.
        self._options: dict[str, Any] = dict(options=self.options, on_prefill=on_prefill)
        self._llm: llama_cpp.Llama | None = llm
        self._prefix_cache: PrefixCache | None = None
        self._whole_states: WholeStateCache | None = None  # unbound: llama-cpp-python's own states
        #: Where a `sippcache.llama.Llama` completion is: before its lookup, or past it (its next
        #: truth test is llama-cpp-python's store step). None: no such completion under way.
        self._completion: Literal["lookup", "store"] | None = None
        if llm is not None:
            self.prefix_cache()  # made now, not in the first request (see `bind`)

    def bind(self, llm: llama_cpp.Llama) -> LlamaCache:
        """Serve `llm`, and return this cache: ``llm.set_cache(LlamaCache(url).bind(llm))``.

        The fast path with a plain `llama_cpp.Llama` (`sippcache.llama.Llama.set_cache`
        does it): llama-cpp-python's hook passes only tokens, and unbound the cache
        can only keep the whole-context states it hands over. A cache serves one
        model; binding it to another raises ValueError.

        The `PrefixCache` doing the work is made here, not in the first request: making it
        reads the model file's head for its fingerprint (30-40 ms for gemma-3-270m, 36 MB
        read), and it starts making the buffers a restore copies into (`SequenceCache`). Made
        at the first lookup, a new process's first cached completion took 40-65 ms against
        8-11 ms for the next ones.
        """
        _check_llm(llm)
        if self._llm is not None and self._llm is not llm:
            raise ValueError("this LlamaCache already serves another model: make one LlamaCache per model")
        self._llm = llm
        self.prefix_cache()
        return self

    def prefix_cache(self, llm: llama_cpp.Llama | None = None) -> PrefixCache:
        """The `PrefixCache` doing the work for the bound model (`llm`, if given, must be it)."""
        if self._llm is None:
            raise RuntimeError(
                "this LlamaCache is not bound to a model (llama-cpp-python's cache hook passes only tokens), so "
                "it has no PrefixCache: use sippcache.llama.Llama, whose set_cache binds it, or LlamaCache.bind(llm)"
            )
        if llm is not None and llm is not self._llm:
            raise ValueError("this LlamaCache serves another model")
        if self._prefix_cache is None:
            self._prefix_cache = PrefixCache(self._llm, self.cache, **self._options)
        return self._prefix_cache

    def whole_states(self) -> WholeStateCache:
        """What an unbound cache uses: llama-cpp-python's own `LlamaState`s in the store."""
        if self._whole_states is None:
            self._whole_states = WholeStateCache(self.cache, self.options)
            log.info(
                "sippcache: LlamaCache not bound to a model: keeping llama-cpp-python's whole-context states "
                "(bind it, or use sippcache.llama.Llama, for the fast path)"
            )
        return self._whole_states

    def stats(self) -> dict[str, int | float]:
        """The counters (see `PrefixStats`): the bound model's `PrefixCache`'s, or unbound, the
        whole-state fallback's (lookups, hits, misses, tokens_reused, entries_written, ...)."""
        if self._llm is not None:
            return self.prefix_cache().stats()
        return self.whole_states().stats.as_dict()

    def begin_completion(self) -> None:
        """A `sippcache.llama.Llama` completion starts (its `create_completion` says so).

        llama-cpp-python tests ``if self.cache:`` before its lookup and again
        before ``self.cache[tokens] = self.save_state()``, after generating.
        Past this completion's lookup, that second test stores the context's
        sequence here and answers False, so no whole-context state (25 MB and
        10-60 ms for 1,400 gemma-3-270m tokens) is copied only to be dropped.
        """
        self._completion = "lookup"

    @property
    def cache_size(self) -> int:
        try:
            return self.cache.stats().bytes
        except Exception as exc:  # never fail a completion over bookkeeping
            log.warning("sippcache: could not read the cache size: %s", exc)
            return 0

    def __bool__(self) -> bool:
        """True, except at the store step of a `sippcache.llama.Llama` completion (see `begin_completion`)."""
        if self._completion != "store" or self._llm is None:
            return True
        self._completion = None
        self.prefix_cache().snapshot_context()
        return False

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.llama.LlamaState:
        """Bound: prefill `key` into the model's context; never answer a state to copy in.
        Unbound: the stored `LlamaState` sharing the longest common prefix with `key`
        (see `sippcache.llama.wholestate`), which llama-cpp-python loads itself.

        llama-cpp-python loads the answer only if it holds more of the prompt
        than the context does, and then prints "cache hit"; on a KeyError it
        prints "cache miss". So its verbose line tells the truth: a
        `sippcache.llama.Llama` gets a pending prefill, which its `load_state`
        runs (raising KeyError if nothing was restored from the cache). A plain
        `llama_cpp.Llama` (whose `load_state` would copy a state in), or a
        context holding the whole prompt already, is prefilled now; the answer is
        then the prompt (nothing to load, no line printed) if the cache was
        used, else KeyError.
        """
        if self._llm is None:
            self._completion = None
            return self.whole_states().lookup(key)
        prefix_cache = self.prefix_cache()
        if self._completion == "lookup":
            self._completion = "store"
        ids = [int(t) for t in key]
        if len(ids) <= 1:
            raise KeyError("a prompt of one token: nothing to restore")
        llm = prefix_cache.llm
        if isinstance(llm, Llama) and common_length(llm.input_ids[: llm.n_tokens], ids) < len(ids):
            return _PromptState(ids, prefix_cache)
        if prefix_cache.prefill(ids).restored:
            return _PromptState(ids)
        raise KeyError("nothing restored from the cache")

    def __contains__(self, key: Sequence[int]) -> bool:
        if self._llm is None:
            return self.whole_states().contains(key)
        return self.prefix_cache().cached_length(list(key)[:-1]) > 0

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        """Bound: store the context's sequence state (prompt and completion); `value` is not
        kept. Unbound: store `value` (a `LlamaState`) under the tokens it holds."""
        if self._llm is None:
            self.whole_states().store(value)
            return
        self.prefix_cache().snapshot_context()

    def flush(self) -> None:
        """Wait for the pending writes."""
        if self._prefix_cache is not None:
            self._prefix_cache.flush()

    def close(self) -> None:
        """Flush, stop the writer, and close a cache opened from a URL."""
        if self._prefix_cache is not None:
            self._prefix_cache.close()
        if self._owns_cache:
            self.cache.close()


def _check_llm(llm: Any, *, optional: bool = False) -> None:
    if not (isinstance(llm, llama_cpp.Llama) or (optional and llm is None)):
        raise TypeError(f"llm must be a llama_cpp.Llama, not {type(llm).__name__}")


class _PromptState(llama_cpp.llama.LlamaState):
    """What `LlamaCache` answers a lookup with: a `LlamaState` holding only the prompt.

    With `prefix_cache`, a pending prefill: `sippcache.llama.Llama.load_state`
    runs it when llama-cpp-python loads the answer. Without, the context holds
    the prompt already, so llama-cpp-python never loads it.
    """

    def __init__(self, ids: list[int], prefix_cache: PrefixCache | None = None) -> None:
        super().__init__(
            input_ids=np.asarray(ids, dtype=np.intc),
            scores=np.empty((0, 0), dtype=np.single),
            n_tokens=len(ids),
            llama_state=b"",
            llama_state_size=0,
            seed=0,
        )
        self.ids, self.prefix_cache = ids, prefix_cache


_SAMPLE_SIGNATURE = inspect.signature(llama_cpp.Llama.sample)
_SAMPLER_ARGUMENTS = set(inspect.signature(llama_cpp.Llama._init_sampler).parameters) - {"self"}


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` that samples from stored logits, and saves no scores.

    - After a `PrefixCache` (or `LlamaCache`) restored a whole prompt with its
      logits, `sample()` and `generate()` sample the first token from those
      logits with the same sampler chain (temperature, top-k/p, min-p,
      penalties, logit bias, grammar, seed) as after an evaluation: nothing
      is evaluated and the tokens are the same.
    - `save_state()` leaves out the n_batch x n_vocab scores array (512 MB for
      a 262k vocabulary) when `logits_all=False`, and a completion with a
      sippcache `LlamaCache` does not call it (see `LlamaCache.begin_completion`).
    - `set_cache` binds a `LlamaCache` to this model.
    """

    #: (n_tokens, logits of position n_tokens - 1) restored from the cache, until the next evaluation.
    _stored_logits: tuple[int, np.ndarray] | None = None
    #: n_tokens when the context's own logits were last computed (-1: not current).
    _logits_at: int = -1

    def set_cache(self, cache: BaseLlamaCache | None) -> None:
        if isinstance(cache, LlamaCache):
            cache.bind(self)
        super().set_cache(cache)

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.cache, LlamaCache):
            self.cache.begin_completion()
        return super().create_completion(*args, **kwargs)

    def eval(self, tokens: Sequence[int]) -> None:
        super().eval(tokens)
        if len(tokens):
            self._stored_logits = None
            self._logits_at = self.n_tokens

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]
        self._stored_logits, self._logits_at = None, -1

    def sample(self, *args: Any, **kwargs: Any) -> int:
        bound = _SAMPLE_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        idx = bound.arguments["idx"]
        stored = self._stored_logits
        if stored is None or stored[0] != self.n_tokens or (idx is not None and idx != self.n_tokens - 1):
            return int(super().sample(*args, **kwargs))
        sampler = self._sampler
        if sampler is None:  # as upstream: a sampler for this call only
            sampler = self._init_sampler(**{k: v for k, v in bound.arguments.items() if k in _SAMPLER_ARGUMENTS})
        return states.sample_from_logits(sampler.sampler, stored[1])

    def context_restored(self, logits: np.ndarray | None) -> None:
        """The context's `n_tokens` were just set without an evaluation (by a `PrefixCache`):
        its own logits are not current; `logits`, stored with the restored state, are."""
        self._stored_logits = None if logits is None else (self.n_tokens, logits)
        self._logits_at = -1

    def current_logits(self) -> np.ndarray | None:
        """The logits for the token after the context's, if current: stored, or the context's own."""
        if self._stored_logits is not None and self._stored_logits[0] == self.n_tokens:
            return self._stored_logits[1]
        if self.n_tokens > 0 and self._logits_at == self.n_tokens:
            return states.copy_logits(self.ctx, self._n_vocab)
        return None

    def save_state(self) -> llama_cpp.llama.LlamaState:
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
        if isinstance(state, _PromptState):  # a LlamaCache's answer: prefill the prompt
            if state.prefix_cache is not None and state.prefix_cache.llm is not self:
                raise ValueError("this state is another model's LlamaCache answer")
            if state.prefix_cache is not None and not state.prefix_cache.prefill(state.ids).restored:
                raise KeyError("nothing restored from the cache")  # llama-cpp-python reports a miss
            return
        self._stored_logits, self._logits_at = None, -1
        if len(state.scores) or self._logits_all:
            return super().load_state(state)
        self.input_ids = state.input_ids.copy()
        self.n_tokens = state.n_tokens
        self._requires_eval = True
        self._seed = state.seed
        states.restore_whole_state(self.ctx, state.llama_state, state.llama_state_size)
