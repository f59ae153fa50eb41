"""SessionPool: many conversations live in one llama.cpp context, decoded together.

llama-cpp-python's `Llama` drives one sequence, so a program talking to
several users either serialises them (each switch a restore, or a prefill) or
loads the model several times. A pool keeps up to `slots` sessions resident in
one context, one llama.cpp sequence each, like llama.cpp's server with
``--parallel N``:

- a call names its sessions (conversation ids) and their prompts; each is
  admitted live (its sequence still holds the conversation), warm (its longest
  cached prefix is restored into a free slot) or cold;
- their prompt suffixes are evaluated together, several sessions' tokens in one
  `llama_decode`, and then every session's next token is decoded in one batch
  per step until each one stops;
- sessions stay live between calls; when a slot (or room in the KV buffer) is
  needed, an idle session is snapshotted into the cache and its slot freed, so
  it comes back warm: the one whose sequence the newcomer loses least of
  (which keeps the shared part), least recently used among equals;
- a session whose prompt shares a prefix with what another slot holds (an idle
  session, or one earlier in the same call once it has evaluated that part)
  borrows it: `llama_memory_seq_cp` shares those KV cells instead of
  computing them again (a common system prompt is evaluated once).

The work is done by `sippcache.llama.batch.BatchEngine`, the engine
``sippcache serve --parallel`` runs as well.

Everything `PrefixCache` promises holds per slot, because both go through one
`sippcache.llama.seqcache.SequenceCache`: the model fingerprint's namespace, the
sliding-window rule, checkpoints, stored logits, generations, and backend
errors that cost speed, never a wrong answer or an exception. The context
copies the `Llama`'s own parameters with one unified KV buffer, so a slot's
states are exactly those of a single-sequence context: they move between
slots, `PrefixCache` users of a `Llama` with the same parameters, and other
processes. A pool that loads the model turns flash attention on unless told
otherwise (`LOADED_DEFAULTS`, and why).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from .. import tokens as _tokens
from ..protocol import CacheBackend
from . import states
from .batch import BatchEngine, Job
from .fingerprint import llama_fingerprint, speed_facts
from .options import FIELDS, CacheOptions
from .seqcache import SequenceCache, check_prompt

#: Tokens of history the repetition penalties look at (llama-cpp-python's `last_n_tokens_size`).
PENALTY_LAST_N = 64

#: llama options a pool that loads the model itself uses unless given others (as
#: ``sippcache serve --parallel`` does). Flash attention: every resident session's cells
#: share one KV buffer, and without it llama.cpp's CPU kernels compute each token's
#: attention over all of them (and, in the sliding-window layers, over the whole
#: full-size SWA cache) and mask the result; with it they skip the masked cells, so a
#: step costs what its own session's cells cost, and a restored state sums its cells in
#: the order a live sequence does wherever it lands in the buffer (docs/pool.md, "Slots,
#: context size and memory": measured on gemma-3-270m). `swa_full` is left at llama.cpp's
#: default (on): a slot's sequence keeps every position in the sliding-window layers, so
#: it can be cut back or shared at any length, as a full-attention one can.
LOADED_DEFAULTS: dict[str, Any] = {"flash_attn": True, "verbose": False}

#: Sessions a pool keeps live per slot by default (`SessionPool`'s `sequences`): 8
#: conversations taking turns in calls of 4 on 4 slots come back live instead of being
#: parked and restored every call (benchmarks/pool.py on gemma-3-270m: 1.92x one Llama's tokens per
#: second instead of 1.85x).
RESIDENT_PER_SLOT = 4


@dataclass
class Completion:
    """What `SessionPool.generate` did for one session.

    `admitted` is "live" (its sequence still held the conversation), "warm"
    (a cached prefix was restored), "shared" (a prefix another slot held was
    shared with it) or "cold"; `reused` prompt tokens were not evaluated,
    `evaluated` were; `logits_from_store` means an exact repeat whose first
    token was sampled from stored logits. `finish_reason` is "length"
    (max_tokens reached) or "stop" (an end-of-generation or stop token, not
    included in `tokens`). `ttft_seconds` runs from the start of the call to
    this session's first token. With `generate(..., logits=True)`, `logits`
    holds the logits each token was sampled from (float32, one row per token).
    """

    tokens: list[int]
    admitted: str
    reused: int
    evaluated: int
    logits_from_store: bool
    finish_reason: str
    ttft_seconds: float
    logits: list[np.ndarray] | None = None


@dataclass(frozen=True)
class Sampling:
    """Sampler settings for every session of a call (as `Llama.generate` takes them).
    Each session gets its own chain: with a `seed`, the one it would get running
    alone, so results do not depend on which sessions share the call."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None

    def chain(self, n_vocab: int) -> Any:
        """A llama.cpp sampler chain built as llama-cpp-python's `Llama._init_sampler`
        builds it (penalties, then greedy; or top-k, typical, top-p, min-p, temperature
        and a seeded draw), with the same arguments."""
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

        def add(sampler: Any) -> None:
            llama_cpp.llama_sampler_chain_add(chain, sampler)

        add(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab, PENALTY_LAST_N, self.repeat_penalty, self.frequency_penalty, self.presence_penalty
            )
        )
        seed = self.seed if self.seed is not None else random.randrange(2**32)
        if self.temperature == 0.0:
            add(llama_cpp.llama_sampler_init_greedy())
        elif self.temperature < 0.0:
            add(llama_cpp.llama_sampler_init_dist(seed))
        else:
            add(llama_cpp.llama_sampler_init_top_k(self.top_k))
            add(llama_cpp.llama_sampler_init_typical(self.typical_p, 1))
            add(llama_cpp.llama_sampler_init_top_p(self.top_p, 1))
            add(llama_cpp.llama_sampler_init_min_p(self.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(self.temperature))
            add(llama_cpp.llama_sampler_init_dist(seed))
        return chain


class SessionPool:
    """Up to `slots` conversations resident in one llama.cpp context, decoded together.

    `model` is a GGUF path (loaded here, with `llama_options` passed to
    `llama_cpp.Llama` over `LOADED_DEFAULTS`: flash attention on, as
    ``sippcache serve --parallel`` has it, unless ``flash_attn=False`` is given)
    or a `llama_cpp.Llama` whose model (weights) and context parameters the pool
    shares as they are (build it with ``flash_attn=True``). The pool's context
    copies those parameters, and its entries share a namespace with a
    `PrefixCache` on a `Llama` built with the same ones: a default pool's are not
    a default `Llama`'s (flash attention off), whose states llama.cpp cannot load
    (another V layout). `cache` is a URL, an open `CacheBackend`, or None for
    `sippcache.open()`'s default. `n_ctx` is the KV buffer all live sessions
    share (default: 2,048 tokens per slot); one session's prompt plus its
    `max_tokens` must fit in it. `sequences` is how many sessions stay live in
    it between calls (default: `RESIDENT_PER_SLOT` per slot; as many as `slots`
    on a recurrent or hybrid model, whose state buffers grow with every
    sequence): a session that comes back live evaluates only its new tokens,
    where a parked one is restored from the cache. Idle sessions are parked,
    least recently used first, when the buffer has no room for a call.
    `options` (`CacheOptions`) are `PrefixCache`'s; its fields may be given as
    keywords instead (``scope="tenant-a"``), not both: every other keyword is a
    llama option. `close()` parks every
    live session in the cache (so a new process finds them warm) unless
    `park_on_close=False`. A call runs its sessions on the pool's
    `sippcache.llama.batch.BatchEngine` from start to end, prompts evaluated up
    to `n_batch` tokens a step.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | llama_cpp.Llama,
        cache: str | CacheBackend | None = None,
        *,
        slots: int = 4,
        n_ctx: int | None = None,
        n_batch: int = 512,
        sequences: int | None = None,
        options: CacheOptions | None = None,
        park_on_close: bool = True,
        **llama_options: Any,
    ) -> None:
        # The keywords naming CacheOptions' fields build the options; the others are llama options.
        options = CacheOptions.build(options, {k: llama_options.pop(k) for k in FIELDS if k in llama_options})
        for name, value, lowest in (("slots", slots, 1), ("n_batch", n_batch, 1), ("n_ctx", n_ctx, 16)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lowest):
                raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        if sequences is not None and (
            not isinstance(sequences, int) or isinstance(sequences, bool) or sequences < slots
        ):
            raise ValueError(f"sequences must be an int >= slots ({slots}), got {sequences!r}")
        limit = llama_cpp.llama_max_parallel_sequences()
        for name, value in (("slots", slots), ("sequences", sequences or slots)):
            if value > limit:
                raise ValueError(f"{name} must be at most {limit} (llama.cpp's limit)")
        if isinstance(model, llama_cpp.Llama):
            if llama_options:
                raise TypeError("llama options apply when the pool loads the model; this Llama is loaded already")
            self._owns_llm, self.llm = False, model
        else:  # a small context of its own: the pool's context is the engine's
            self._owns_llm = True
            options_here = {**LOADED_DEFAULTS, **llama_options}
            self.llm = llama_cpp.Llama(model_path=os.fspath(model), n_ctx=n_batch, n_batch=n_batch, **options_here)
        self._engine: BatchEngine | None = None
        try:
            self.fingerprint = llama_fingerprint(self.llm)  # the engine's context has the same K/V types and kernels
            kind = states.MemoryKind.of(self.llm.model)
            if sequences is None:
                sequences = slots if kind.exact_length_only else min(RESIDENT_PER_SLOT * slots, limit)
            self._states = SequenceCache(
                cache,
                fingerprint=self.fingerprint,
                kind=kind,
                n_vocab=self.llm.n_vocab(),
                options=options,
                rates_place=speed_facts(self.llm),
            )
            self._engine = BatchEngine(
                self.llm,
                self._states,
                slots=slots,
                n_ctx=n_ctx or 2048 * slots,
                n_batch=n_batch,
                chunk=max(n_batch, 32) // 32 * 32,
                sequences=sequences,
            )
        except BaseException:
            self._free()
            raise
        self.n_ctx, self.n_batch, self.slots = self._engine.n_ctx, self._engine.n_batch, slots
        self.sequences = self._engine.sequences
        self.cache, self.namespace, self.options = self._states.cache, self._states.namespace, options
        self.park_on_close = park_on_close
        self._lock = threading.Lock()  # one call at a time: the context is not thread-safe
        self._closed = False

    # -- public API ------------------------------------------------------------

    def generate(
        self,
        prompts: Mapping[Hashable, Sequence[int]],
        *,
        max_tokens: int = 32,
        stop: Sequence[int] = (),
        logits: bool = False,
        **sampling: Any,
    ) -> dict[Hashable, Completion]:
        """Run every session in `prompts` ({session: prompt tokens}) together; return
        {session: Completion}. At most `slots` sessions per call. A prompt continues
        a session's conversation when it starts with what the session holds (its
        earlier prompt and answer). `stop`: token ids that end a session (besides
        the model's end-of-generation tokens); `logits`: keep the logits each token
        was sampled from; `sampling`: `Sampling`'s fields."""
        completions: dict[Hashable, Completion] = {}
        for _ in self._run(prompts, max_tokens, stop, Sampling(**sampling), completions, logits):
            pass
        return completions

    def stream(
        self,
        prompts: Mapping[Hashable, Sequence[int]],
        *,
        max_tokens: int = 32,
        stop: Sequence[int] = (),
        **sampling: Any,
    ) -> Iterator[tuple[Hashable, int]]:
        """`generate`, yielding (session, token) as each token is sampled (a stop token
        is not yielded)."""
        return self._run(prompts, max_tokens, stop, Sampling(**sampling), {}, False)

    @property
    def sessions(self) -> list[Hashable]:
        """The live sessions (each holding one of the pool's `sequences`), least recently used first."""
        return self._engine.sessions() if self._engine is not None else []

    def park(self, session: Hashable) -> bool:
        """Snapshot a live session into the cache and free its sequence; False if it was not live."""
        with self._lock:
            return self._engine is not None and self._engine.park(session)

    def stats(self) -> dict[str, int | float]:
        """The cache counters (see `PrefixStats`) and the pool's own: admissions by kind,
        sessions parked, prompt tokens borrowed from other slots, `llama_decode` calls,
        tokens generated, prompt tokens evaluated."""
        engine = self._engine.counters if self._engine is not None else {}
        return {**self._states.counters(), **engine}

    def flush(self) -> None:
        """Wait until every queued snapshot is written to the cache."""
        self._states.flush()

    def close(self) -> None:
        """Park the live sessions (unless `park_on_close=False`), write pending snapshots,
        and free the context (and the model, if the pool loaded it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.park_on_close and self._engine is not None:
                    self._engine.park_all()
                self._states.close()
            finally:
                self._free()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call ------------------------------------------------------------------

    def _run(
        self,
        prompts: Mapping[Hashable, Sequence[int]],
        max_tokens: int,
        stop: Sequence[int],
        sampling: Sampling,
        completions: dict[Hashable, Completion],
        keep_logits: bool,
    ) -> Iterator[tuple[Hashable, int]]:
        checked = self._checked(prompts, max_tokens)
        stop_tokens = frozenset(int(t) for t in _tokens.decode(_tokens.encode(list(stop))))
        with self._lock:
            engine = self._engine
            if self._closed or engine is None:
                raise RuntimeError("SessionPool is closed")
            started = time.perf_counter()
            self._make_room(engine, checked, max_tokens)
            sampled: deque[tuple[Job, int, np.ndarray | None]] = deque()
            rows: dict[Hashable, list[np.ndarray]] = {session: [] for session in checked}
            jobs = [
                Job(
                    ids,
                    sampling.chain(self._states.n_vocab),
                    max_tokens,
                    session=session,
                    stop=stop_tokens,
                    keep_logits=keep_logits,
                    on_token=lambda job, token, logits: sampled.append((job, token, logits)),
                )
                for session, ids in checked.items()
            ]
            try:
                for job in jobs:
                    engine.submit(job)
                while any(job.state != "done" for job in jobs):
                    engine.step()
                    while sampled:
                        job, token, logits = sampled.popleft()
                        if logits is not None:
                            rows[job.session].append(logits)
                        if job.finish_reason != "stop":  # a stop token is not part of the answer
                            yield job.session, token
            except BaseException:
                for job in jobs:  # a call given up (an exception, a stream closed) ends its sessions' jobs
                    engine.cancel(job)
                engine.step()
                raise
            finally:
                for job in jobs:
                    llama_cpp.llama_sampler_free(job.chain)
            for job in jobs:
                if job.error is not None:
                    raise job.error
                completions[job.session] = Completion(
                    job.generated[:-1] if job.finish_reason == "stop" else list(job.generated),
                    job.admitted,
                    job.reused,
                    len(job.prompt) - job.reused,
                    job.logits_from_store,
                    job.finish_reason or "",
                    (job.first_token_at or started) - started,
                    rows[job.session] if keep_logits else None,
                )

    def _checked(self, prompts: Mapping[Hashable, Sequence[int]], max_tokens: int) -> dict[Hashable, list[int]]:
        """Prompts as lists of ids this model and pool can run; ValueError/TypeError otherwise."""
        if not isinstance(prompts, Mapping) or not prompts:
            raise TypeError("prompts must be a non-empty mapping {session: prompt tokens}")
        if len(prompts) > self.slots:
            raise ValueError(f"{len(prompts)} sessions in one call, but the pool has {self.slots} slots")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        n_vocab = self._states.n_vocab
        checked = {
            session: check_prompt(tokens, n_vocab, what=f"session {session!r}: ") for session, tokens in prompts.items()
        }
        need = sum(len(ids) + max_tokens for ids in checked.values())
        if need > self.n_ctx:
            raise ValueError(
                f"the prompts and max_tokens of this call need {need} tokens; the pool's n_ctx is {self.n_ctx}"
            )
        return checked

    def _make_room(self, engine: BatchEngine, prompts: Mapping[Hashable, list[int]], max_tokens: int) -> None:
        """Park idle sessions (least recently used first) until this call's prompts and
        answers fit in the KV buffer beside what the sequences hold: a live session's
        prompt adds its new tokens, another's all of them (a restored state has cells of
        its own). A step that still finds no room parks more (`BatchEngine`)."""
        live = set(engine.sessions())
        extending = [ids for session, ids in prompts.items() if session in live]
        need = sum(len(ids) for session, ids in prompts.items() if session not in live) + max_tokens * len(prompts)
        while engine.held_cells(extending) + need > self.n_ctx and engine.park_least_recent(set(prompts)):
            pass

    def _free(self) -> None:
        if self._engine is not None:
            self._engine.free()
            self._engine = None
        if self._owns_llm:
            self.llm.close()


__all__ = ["Completion", "Sampling", "SessionPool"]
