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
  it comes back warm: the one sharing the most with the newcomer (which keeps
  that shared part), else the least recently used;
- a session whose prompt shares a prefix with what another slot holds (an idle
  session, or one earlier in the same call once it has evaluated that part)
  borrows it: `llama_memory_seq_cp` shares those KV cells instead of
  computing them again, as llama.cpp's server does with a common system prompt.

Everything `PrefixCache` promises holds per slot, because both go through one
`sippcache.llama.seqcache.SequenceCache`: the model fingerprint's namespace, the
sliding-window rule, checkpoints, stored logits, generations, and backend
errors that cost speed, never a wrong answer or an exception. The context
copies the `Llama`'s own parameters with one unified KV buffer, so a slot's
states are exactly those of a single-sequence context: they move between
slots, `PrefixCache` users and other processes.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np

from .. import tokens as _tokens
from ..frame import Secret
from ..protocol import CacheBackend
from . import states
from .fingerprint import llama_fingerprint
from .seqcache import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_MIN_TOKENS, Reuse, SequenceCache, common_length

log = logging.getLogger("sippcache")

#: Tokens of history the repetition penalties look at (llama-cpp-python's `last_n_tokens_size`).
PENALTY_LAST_N = 64


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

        add(llama_cpp.llama_sampler_init_penalties(
            n_vocab, PENALTY_LAST_N, self.repeat_penalty, self.frequency_penalty, self.presence_penalty))  # fmt: skip
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


@dataclass
class _Slot:
    """One sequence of the context, and the session living in it."""

    seq: int
    session: Hashable | None = None
    tokens: list[int] = field(default_factory=list)  # what the sequence holds
    used: int = 0  # when the session last ran (a counter), for least-recently-used parking
    generation: int = 0  # turns this session has taken in this pool


@dataclass
class _Run:
    """A session within one call."""

    session: Hashable
    slot: _Slot
    prompt: list[int]
    reuse: Reuse
    admitted: str
    chain: Any
    position: int = 0  # next position to evaluate
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    ttft: float = 0.0
    boundaries: list[int] = field(default_factory=list)
    logits: list[np.ndarray] | None = None  # kept when asked for


class SessionPool:
    """Up to `slots` conversations resident in one llama.cpp context, decoded together.

    `model` is a GGUF path (loaded here, with `llama_options` passed to
    `llama_cpp.Llama`) or a `llama_cpp.Llama` whose model (weights) the pool
    shares. `cache` is a URL, an open `CacheBackend`, or None for
    `sippcache.open()`'s default. `n_ctx` is the KV buffer all live sessions
    share (default: 2,048 tokens per slot); one session's prompt plus its
    `max_tokens` must fit in it. `scope`, `min_tokens`, `checkpoint_interval`,
    `max_pending_writes` and `secret` are `PrefixCache`'s. `close()` parks every
    live session in the cache (so a new process finds them warm) unless
    `park_on_close=False`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | llama_cpp.Llama,
        cache: str | CacheBackend | None = None,
        *,
        slots: int = 4,
        n_ctx: int | None = None,
        n_batch: int = 512,
        scope: str = "default",
        min_tokens: int = DEFAULT_MIN_TOKENS,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
        max_pending_writes: int = 4,
        secret: Secret | None = None,
        park_on_close: bool = True,
        **llama_options: Any,
    ) -> None:
        for name, value, lowest in (("slots", slots, 1), ("n_batch", n_batch, 1), ("n_ctx", n_ctx, 16)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lowest):
                raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        if slots > llama_cpp.llama_max_parallel_sequences():
            raise ValueError(f"slots must be at most {llama_cpp.llama_max_parallel_sequences()} (llama.cpp's limit)")
        n_ctx = n_ctx or 2048 * slots
        if isinstance(model, llama_cpp.Llama):
            if llama_options:
                raise TypeError("llama options apply when the pool loads the model; this Llama is loaded already")
            self._owns_llm, self.llm = False, model
        else:  # a small context of its own: the pool's context is made below
            self._owns_llm = True
            self.llm = llama_cpp.Llama(model_path=os.fspath(model), n_ctx=n_batch, n_batch=n_batch, verbose=False,
                                       **llama_options)  # fmt: skip
        self._ctx = self._batch = None
        try:
            params = llama_cpp.llama_context_params.from_buffer_copy(self.llm.context_params)
            params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, slots, True
            params.n_batch = params.n_ubatch = min(n_batch, n_ctx)
            self._ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
            if self._ctx is None:
                raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens for {slots} sequences")
            self.n_ctx, self.n_batch, self.slots = int(llama_cpp.llama_n_ctx(self._ctx)), int(params.n_batch), slots
            self._batch = llama_cpp.llama_batch_init(max(self.n_batch, slots), 0, 1)
            self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
            self.fingerprint = llama_fingerprint(self.llm)  # the pool's context has the same K/V types and kernels
            self._states = SequenceCache(
                cache, fingerprint=self.fingerprint, scope=scope,
                n_swa=int(llama_cpp.llama_model_n_swa(self.llm.model)), n_vocab=self.llm.n_vocab(),
                min_tokens=min_tokens, checkpoint_interval=checkpoint_interval, max_pending_writes=max_pending_writes,
                secret=secret,
            )  # fmt: skip
        except BaseException:
            self._free()
            raise
        self.cache, self.namespace = self._states.cache, self._states.namespace
        self.park_on_close = park_on_close
        self._slots = [_Slot(seq) for seq in range(slots)]
        self._clock = 0
        self._counters = dict(admitted_live=0, admitted_warm=0, admitted_shared=0, admitted_cold=0, parked=0,
                              borrowed_tokens=0,
                              decode_calls=0, tokens_generated=0)  # fmt: skip
        self._lock = threading.Lock()  # one call at a time: the context is not thread-safe
        self._closed = False

    # -- public API ------------------------------------------------------------

    def generate(
        self, prompts: Mapping[Hashable, Sequence[int]], *, max_tokens: int = 32, stop: Sequence[int] = (),
        logits: bool = False, **sampling: Any,
    ) -> dict[Hashable, Completion]:  # fmt: skip
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
        self, prompts: Mapping[Hashable, Sequence[int]], *, max_tokens: int = 32, stop: Sequence[int] = (),
        **sampling: Any,
    ) -> Iterator[tuple[Hashable, int]]:  # fmt: skip
        """`generate`, yielding (session, token) as each token is sampled (a stop token
        is not yielded)."""
        return self._run(prompts, max_tokens, stop, Sampling(**sampling), {}, False)

    @property
    def sessions(self) -> list[Hashable]:
        """The sessions live in a slot, least recently used first."""
        return [s.session for s in sorted(self._slots, key=lambda s: s.used) if s.session is not None]

    def park(self, session: Hashable) -> bool:
        """Snapshot a live session into the cache and free its slot; False if it was not live."""
        with self._lock:
            slot = self._slot_of(session)
            if slot is not None:
                self._park(slot)
            return slot is not None

    def stats(self) -> dict[str, int | float]:
        """The cache counters (see `PrefixStats`) and the pool's own: admissions by kind,
        sessions parked, prompt tokens borrowed from other slots, `llama_decode` calls,
        tokens generated."""
        return {**self._states.counters(), **self._counters}

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
                if self.park_on_close:
                    for slot in self._slots:
                        if slot.session is not None:
                            self._park(slot)
                self._states.close()
            finally:
                self._free()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call ------------------------------------------------------------------

    def _run(
        self, prompts: Mapping[Hashable, Sequence[int]], max_tokens: int, stop: Sequence[int], sampling: Sampling,
        completions: dict[Hashable, Completion], keep_logits: bool,
    ) -> Iterator[tuple[Hashable, int]]:  # fmt: skip
        checked = self._checked(prompts, max_tokens)
        stop_tokens = frozenset(int(t) for t in _tokens.decode(_tokens.encode(list(stop))))
        with self._lock:
            if self._closed:
                raise RuntimeError("SessionPool is closed")
            started = time.perf_counter()
            self._make_room(checked, max_tokens)
            runs = [self._admit(session, ids, set(checked), sampling) for session, ids in checked.items()]
            try:
                for run in runs:
                    run.logits = [] if keep_logits else None
                    if run.reuse.logits is not None:  # an exact repeat: the first token from the stored logits
                        token = states.sample_from_logits(run.chain, run.reuse.logits)
                        yield from self._accept(run, token, started, max_tokens, stop_tokens, run.reuse.logits)
                prompting = [r for r in runs if r.position < len(r.prompt)]
                yield from self._prefill(prompting, started, max_tokens, stop_tokens)
                yield from self._decode([r for r in runs if not r.finish_reason], started, max_tokens, stop_tokens)
            except BaseException:
                for run in runs:  # an interrupted call leaves nothing half-known: those sessions start over
                    self._forget(run.slot)
                raise
            finally:
                for run in runs:
                    llama_cpp.llama_sampler_free(run.chain)
            for run in runs:
                self._counters[f"admitted_{run.admitted}"] += 1
                # The sequence holds the prompt and every generated token but the last (sampled, not evaluated).
                run.slot.tokens = run.prompt + run.generated[:-1] if run.generated else list(run.prompt)
                completions[run.session] = Completion(
                    run.generated[:-1] if run.finish_reason == "stop" else list(run.generated), run.admitted,
                    run.reuse.start, len(run.prompt) - run.reuse.start, run.reuse.logits is not None,
                    run.finish_reason, run.ttft, run.logits,
                )  # fmt: skip

    def _checked(self, prompts: Mapping[Hashable, Sequence[int]], max_tokens: int) -> dict[Hashable, list[int]]:
        """Prompts as lists of ids this model and pool can run; ValueError/TypeError otherwise."""
        if not isinstance(prompts, Mapping) or not prompts:
            raise TypeError("prompts must be a non-empty mapping {session: prompt tokens}")
        if len(prompts) > self.slots:
            raise ValueError(f"{len(prompts)} sessions in one call, but the pool has {self.slots} slots")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        checked = {}
        n_vocab = self._states.n_vocab
        for session, tokens in prompts.items():
            ids = list(_tokens.decode(_tokens.encode(tokens)))
            if not ids:
                raise ValueError(f"session {session!r}: cannot run an empty prompt")
            if max(ids) >= n_vocab:
                raise ValueError(
                    f"session {session!r}: token id {max(ids)} is outside the vocabulary (n_vocab={n_vocab})"
                )
            checked[session] = ids
        need = sum(len(ids) + max_tokens for ids in checked.values())
        if need > self.n_ctx:
            raise ValueError(
                f"the prompts and max_tokens of this call need {need} tokens; the pool's n_ctx is {self.n_ctx}"
            )
        return checked

    def _make_room(self, prompts: Mapping[Hashable, list[int]], max_tokens: int) -> None:
        """Park idle sessions (least recently used first) until this call fits in the KV buffer."""
        need = sum(len(ids) + max_tokens for ids in prompts.values())
        idle = sorted(
            (s for s in self._slots if s.session is not None and s.session not in prompts), key=lambda s: s.used
        )
        held = sum(len(s.tokens) for s in idle)
        while idle and held + need > self.n_ctx:
            slot = idle.pop(0)
            held -= len(slot.tokens)
            self._park(slot)

    def _admit(self, session: Hashable, ids: list[int], in_call: set[Hashable], sampling: Sampling) -> _Run:
        """Give `session` a slot holding the longest usable prefix of `ids`: its live
        sequence, a cached entry, or nothing."""
        slot = self._slot_of(session)
        own = slot is not None
        live: Sequence[int] = slot.tokens if slot is not None else ()
        if slot is None:
            slot, live = self._free_slot(ids, in_call)
            slot.session, slot.generation = session, 0
        self._clock += 1
        slot.used, slot.generation = self._clock, slot.generation + 1
        reuse = self._states.reuse(self._ctx, slot.seq, ids, live, with_logits=True)
        slot.tokens = ids[: reuse.start]
        admitted = "warm" if reuse.restored else ("live" if own else "shared") if reuse.start else "cold"
        run = _Run(session, slot, ids, reuse, admitted, sampling.chain(self._states.n_vocab), position=reuse.start)
        run.boundaries = self._states.boundaries(reuse.start, reuse.branch, len(ids))
        return run

    def _slot_of(self, session: Hashable) -> _Slot | None:
        return next((s for s in self._slots if s.session == session and s.session is not None), None)

    def _free_slot(self, ids: list[int], in_call: set[Hashable]) -> tuple[_Slot, list[int]]:
        """A slot for a session that is not live, and what its sequence still holds: an
        empty slot; else the idle one sharing the longest prefix with `ids` (least recently
        used among equals), parked but its KV kept for the newcomer to reuse."""
        empty = next((s for s in self._slots if s.session is None), None)
        if empty is not None:
            return empty, []
        slot = max((s for s in self._slots if s.session not in in_call),
                   key=lambda s: (common_length(s.tokens, ids), -s.used))  # fmt: skip
        held = slot.tokens
        self._park(slot, keep=True)
        return slot, held

    def _park(self, slot: _Slot, *, keep: bool = False) -> None:
        """Snapshot the slot's session into the cache (through the writer) and free the
        slot (with `keep`, its KV stays for the next session to reuse)."""
        if len(slot.tokens) >= self._states.min_tokens:
            self._states.snapshot(self._ctx, slot.seq, list(slot.tokens))
        self._counters["parked"] += 1
        if keep:
            slot.session, slot.tokens = None, []
        else:
            self._forget(slot)

    def _forget(self, slot: _Slot) -> None:
        states.clear(states.memory(self._ctx), slot.seq)
        slot.session, slot.tokens = None, []

    # -- evaluating ----------------------------------------------------------------

    def _prefill(
        self, runs: list[_Run], started: float, max_tokens: int, stop: frozenset[int]
    ) -> Iterator[tuple[Hashable, int]]:
        """Evaluate the prompts' remaining tokens, several sessions per `llama_decode`.
        Each session's tokens go in segments that end at its checkpoint boundaries (so a
        snapshot holds exactly its key); the last prompt token of each asks for logits.
        Before evaluating, a session borrows the longest prefix another slot holds; it
        waits for an earlier session of the call that will soon hold a longer one."""
        budget = self._states.checkpoint_budget()
        pending = list(runs)
        while pending:
            items: list[tuple[int, int, int, bool]] = []
            ends: list[tuple[_Run, int, int]] = []  # (run, where its segment stops here, batch index of its last token)
            for order, run in enumerate(pending):
                self._borrow(run)
                if self._waits_for(run, pending[:order]):
                    continue
                room = self.n_batch - len(items)
                if room == 0:
                    break
                stop_at = next((b for b in run.boundaries if b > run.position), len(run.prompt))
                upto = min(stop_at, run.position + room)
                for pos in range(run.position, upto):
                    items.append((run.slot.seq, pos, run.prompt[pos], pos == len(run.prompt) - 1))
                ends.append((run, upto, len(items) - 1))
            self._decode_batch(items)
            for run, upto, index in ends:
                self._states.stats.tokens_evaluated += upto - run.position
                run.position = upto
                run.slot.tokens = run.prompt[:upto]
                if upto in run.boundaries:
                    spent = self._states.snapshot(self._ctx, run.slot.seq, run.prompt[:upto], budget=budget)
                    budget = None if budget is None else budget - spent
                elif upto == len(run.prompt):
                    self._finish_prompt(run, index)
                    yield from self._sample(run, index, started, max_tokens, stop)
            pending = [run for run in pending if run.position < len(run.prompt)]

    def _borrow(self, run: _Run) -> None:
        """Share (`llama_memory_seq_cp`) the longest prefix of the prompt, minus its last
        token, that another slot holds beyond what this session has, where cutting that
        slot's sequence there would be exact (the sliding-window rule)."""
        target = run.prompt[:-1]
        mem, n_swa = states.memory(self._ctx), self._states.n_swa
        best, donor = run.position, None
        for slot in self._slots:
            if slot is run.slot or not slot.tokens:
                continue
            length = common_length(slot.tokens, target)
            if length > best and states.can_truncate(mem, slot.seq, length, n_swa):
                best, donor = length, slot
        if donor is None:
            return
        states.clear(mem, run.slot.seq)
        llama_cpp.llama_memory_seq_cp(mem, donor.seq, run.slot.seq, 0, best)
        self._counters["borrowed_tokens"] += best - run.position
        run.reuse = Reuse(best, branch=run.reuse.branch)
        run.admitted = "shared" if run.admitted == "cold" else run.admitted
        run.position, run.slot.tokens = best, run.prompt[:best]
        run.boundaries = [b for b in run.boundaries if b > best]

    @staticmethod
    def _waits_for(run: _Run, earlier: list[_Run]) -> bool:
        """Whether an earlier session of the call is still evaluating a prefix this one
        shares beyond its own position (it will borrow it once evaluated)."""
        target = run.prompt[:-1]
        return any(
            other.position < common_length(other.prompt, target) and common_length(other.prompt, target) > run.position
            for other in earlier
        )

    def _finish_prompt(self, run: _Run, index: int) -> None:
        """The whole prompt is evaluated: store it with its logits (no usable entry with
        them was found at admission, so one without them is replaced)."""
        if len(run.prompt) >= self._states.min_tokens:
            logits = states.copy_logits(self._ctx, self._states.n_vocab, index)
            self._states.snapshot(self._ctx, run.slot.seq, run.prompt, logits=logits, replace=True)

    def _decode(
        self, runs: list[_Run], started: float, max_tokens: int, stop: frozenset[int]
    ) -> Iterator[tuple[Hashable, int]]:
        """Decode every running session's next token in one batch per step until each stops."""
        active = [run for run in runs if not run.finish_reason]
        while active:
            items = [
                (run.slot.seq, len(run.prompt) + len(run.generated) - 1, run.generated[-1], True) for run in active
            ]
            self._decode_batch(items)
            for index, run in enumerate(active):
                yield from self._sample(run, index, started, max_tokens, stop)
            active = [run for run in active if not run.finish_reason]

    def _sample(
        self, run: _Run, index: int, started: float, max_tokens: int, stop: frozenset[int]
    ) -> Iterator[tuple[Hashable, int]]:
        """Sample the session's next token from output `index` of the last decode."""
        logits = states.copy_logits(self._ctx, self._states.n_vocab, index) if run.logits is not None else None
        token = llama_cpp.llama_sampler_sample(run.chain, self._ctx, index)
        yield from self._accept(run, token, started, max_tokens, stop, logits)

    def _accept(
        self, run: _Run, token: int, started: float, max_tokens: int, stop: frozenset[int],
        logits: np.ndarray | None = None,
    ) -> Iterator[tuple[Hashable, int]]:  # fmt: skip
        if not run.generated:
            run.ttft = time.perf_counter() - started
        if run.logits is not None and logits is not None:
            run.logits.append(logits)
        run.generated.append(token)
        self._counters["tokens_generated"] += 1
        if token in stop or self._is_eog(token):
            run.finish_reason = "stop"
            return
        if len(run.generated) >= max_tokens:
            run.finish_reason = "length"
        yield run.session, token

    def _is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def _decode_batch(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of (sequence, position, token, wants logits) items."""
        batch = self._batch
        assert batch is not None and items
        batch.n_tokens = len(items)
        for i, (seq, pos, token, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        status = llama_cpp.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} ({len(items)} tokens)")
        self._counters["decode_calls"] += 1

    def _free(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._owns_llm:
            self.llm.close()


__all__ = ["Completion", "Sampling", "SessionPool"]
