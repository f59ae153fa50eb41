"""Continuous batching over one llama.cpp context: slots, jobs, and one step at a time.

A `BatchEngine` keeps `sequences` llama.cpp sequences in one context (one
unified KV buffer) and runs up to `slots` jobs on them at once: a prompt to
prefill, then tokens to sample until the job stops. Each `step()` is one
`llama_decode` holding the next token of every decoding job together with
chunks of prompts being prefilled (at most `chunk` prompt tokens a step), so a
long new prompt never holds the others' decoding back by more than one chunk.
Jobs join between steps and leave when they finish or are cancelled; their
slot keeps its sequence for whoever comes next. With more sequences than slots
(`SessionPool`), idle conversations stay in the KV buffer between calls and
come back live; when llama.cpp finds no room for a step, the least recently
used idle sequence is parked (stored, then cleared) and the step tried again.

Where a job's prompt starts, cheapest first:

- its slot: the slot of its session (`SessionPool`), else an empty slot (which
  first shares the longest prefix another slot holds), else the idle slot
  whose sequence the prompt loses least of (a conversation continued loses
  nothing), least recently used among equals, parked first (a snapshot goes
  to the cache unless it is there already);
- the cache (`SequenceCache.reuse`), where it holds more than the slot: a
  stored entry for the whole prompt with its logits (nothing to evaluate), the
  longest stored prefix, or the entry sharing the most with it where cutting
  it back is exact;
- other slots: before each chunk, the longest prefix another slot holds is
  shared (`llama_memory_seq_cp`) instead of evaluated again, and a job waits
  a step for an earlier job still evaluating a prefix they share (a system
  prompt many conversations start with is evaluated once).

On a recurrent or hybrid model (`states.MemoryKind.exact_length_only`) a
sequence's state is one cell at its last position: llama.cpp cannot cut it,
and `llama_memory_seq_cp` shares that whole cell whatever range it is given.
So a slot's sequence is kept only when the prompt extends it, and a prefix is
shared only from a slot holding exactly that prefix: an earlier job evaluating
a prefix a later one shares stops there (at a multiple of
`CHECKPOINT_ALIGNMENT`, a checkpoint it also stores) for the later one to
share it before going on.

The engine is not thread-safe: one thread owns it (the server's scheduler
thread, or the thread in a `SessionPool` call).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import llama_cpp
import numpy as np

from . import states
from .checkpoints import CHECKPOINT_ALIGNMENT, CheckpointPlan
from .seqcache import SequenceCache, check_prompt, common_length

log = logging.getLogger("sippcache")

__all__ = ["BatchEngine", "Job", "StepReport"]

#: Prompt tokens evaluated per step by default: on gemma-3-270m, 2 cores, a prompt is
#: prefilled about as fast in chunks of 64 as of 512, while the requests decoding
#: beside it wait for each step (benchmarks/probes/prefill_chunk.py, docs/serve.md "Tuning").
DEFAULT_CHUNK = 128


@dataclass(eq=False)
class Job:
    """One request in a `BatchEngine`: `prompt` to prefill, then tokens sampled with
    `chain` (a llama.cpp sampler chain the caller owns) until one is an
    end-of-generation token or in `stop` ("stop"), `max_new` tokens were sampled
    ("length"), or the job is cancelled ("cancelled").

    `on_token(job, token, logits)` is called on the engine's thread for every
    token sampled, the last one included (`job.finish_reason` is then set);
    `logits` is a copy of the row it was sampled from when `keep_logits`.
    `on_finish(job)` is called once when the job leaves, whatever the reason
    (`error` holds the exception when it is "error"). `session` ties the job
    to a conversation (`SessionPool`); the server leaves it None and slots are
    matched by content.
    """

    prompt: list[int]
    chain: Any
    max_new: int
    session: Hashable | None = None
    stop: frozenset[int] = frozenset()
    keep_logits: bool = False
    on_token: Callable[[Job, int, np.ndarray | None], None] | None = None
    on_finish: Callable[[Job], None] | None = None
    #: Kept alive while the engine holds the job: the owner of `chain`, if it frees it.
    keepalive: Any = None
    #: Tokens its reader has asked for so far (None: `max_new` alone bounds the job). Past them the
    #: job waits, its last token sampled and not evaluated, until the reader asks for more or leaves:
    #: a reader on another thread (the server's requests) ends the job where it stops reading, not
    #: where the engine had got to by the time it said so.
    allowed: int | None = None

    # -- set by the engine ----------------------------------------------------------
    state: str = "queued"  # queued, prefill, decode, done
    admitted: str = ""  # live, warm, shared or cold
    reused: int = 0  # prompt tokens not evaluated
    logits_from_store: bool = False
    generated: list[int] = field(default_factory=list)
    #: Tokens of prompt + generated the sequence holds (the last sampled token is
    #: evaluated one step later, if the job goes on).
    evaluated: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False  # set by anyone; the engine drops the job at its next step
    submitted_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    _position: int = 0  # next prompt position to evaluate
    _plan: CheckpointPlan = field(default_factory=lambda: CheckpointPlan([]))
    _slot: _Slot | None = None

    @property
    def waiting(self) -> bool:
        """Whether it has sampled all its reader asked for (`allowed`)."""
        return self.allowed is not None and len(self.generated) >= self.allowed

    @property
    def context(self) -> list[int]:
        """The tokens the job's sequence holds now: what upstream's ``_input_ids`` means."""
        return (self.prompt + self.generated)[: self.evaluated]


@dataclass(eq=False)
class _Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what the sequence holds
    job: Job | None = None
    session: Hashable | None = None
    used: int = 0  # a clock, for least-recently-used choices
    saved: int = 0  # the longest prefix of `tokens` the cache held when its job was admitted, or stored since
    #: A prompt end not stored yet (`_store_now`): its tokens and logits, stored when the slot is parked or
    #: stored (`store_unsaved`), or a later prompt leaves it.
    unsaved: tuple[list[int], np.ndarray] | None = None


@dataclass
class StepReport:
    """What one `step()` did: tokens in the batch (decoded, prompt), tokens sampled,
    jobs that started or finished, seconds in `llama_decode` and in sampling."""

    decoded: int = 0
    prompt_tokens: int = 0
    sampled: int = 0
    started: int = 0
    finished: int = 0
    decode_seconds: float = 0.0
    sample_seconds: float = 0.0

    @property
    def batch(self) -> int:
        return self.decoded + self.prompt_tokens


class BatchEngine:
    """Up to `slots` jobs at once in one llama.cpp context of `n_ctx` cells, one
    sequence each, decoded together; `sequences` (default `slots`) sequences in all,
    each holding the last conversation it ran until it is parked.

    `llm` lends its model (weights, vocabulary) and context parameters (K/V types,
    flash attention, threads): the engine's context copies them with
    ``n_seq_max = slots`` and one unified KV buffer, so a slot's states are those
    of a single-sequence context and move between slots, `PrefixCache` users and
    other processes. `cache` is where states are found and left. `chunk` bounds
    the prompt tokens of a step (a multiple of 32, at most `n_batch`).

    A prompt's end is stored at once only where `_store_now` says so (a prompt the
    store held nothing of, a recurrent or hybrid model, `checkpoint_interval` tokens
    beyond the store); otherwise what a slot holds beyond the store waits there and
    is stored when the slot is parked (for room, `park`, `park_all`, or handed to
    another conversation), when a later prompt leaves it, or by `store_unsaved` (the
    server's scheduler, once idle). `SessionPool` and the server both run so.
    `store_finished` stores every prompt end and every finished job's sequence at
    once instead: nothing in sippcache sets it any more (the server did, and wrote a
    conversation's whole state again every turn); it stays for a caller whose other
    processes must find each answer the moment it is given, at a write per request.
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        cache: SequenceCache,
        *,
        slots: int,
        n_ctx: int,
        n_batch: int = 512,
        chunk: int = DEFAULT_CHUNK,
        store_finished: bool = False,
        sequences: int | None = None,
    ) -> None:
        sequences = slots if sequences is None else sequences
        for name, value, lowest in (
            ("slots", slots, 1),
            ("n_batch", n_batch, 1),
            ("n_ctx", n_ctx, 16),
            ("sequences", sequences, slots if isinstance(slots, int) else 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        if sequences > llama_cpp.llama_max_parallel_sequences():
            name = "slots" if sequences == slots else "sequences"
            raise ValueError(f"{name} must be at most {llama_cpp.llama_max_parallel_sequences()} (llama.cpp's limit)")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < CHECKPOINT_ALIGNMENT:
            raise ValueError(f"chunk must be an int >= {CHECKPOINT_ALIGNMENT}, got {chunk!r}")
        if chunk % CHECKPOINT_ALIGNMENT:
            raise ValueError(f"chunk must be a multiple of {CHECKPOINT_ALIGNMENT}, got {chunk}")
        self.llm, self.cache = llm, cache
        self._ctx = self._batch = None
        try:
            params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
            params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, sequences, True
            params.n_batch = params.n_ubatch = min(n_batch, n_ctx)
            #: The parameters the context was made with (flash attention, swa_full, ...).
            self.params = params
            self._ctx = llama_cpp.llama_init_from_model(llm.model, params)
            if self._ctx is None:
                raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens for {sequences} sequences")
            self.n_ctx, self.n_batch = int(llama_cpp.llama_n_ctx(self._ctx)), int(params.n_batch)
            self._batch = llama_cpp.llama_batch_init(max(self.n_batch, slots), 0, 1)
        except BaseException:
            self.free()
            raise
        self.slots, self.sequences = slots, sequences
        self.chunk = min(chunk, max(CHECKPOINT_ALIGNMENT, self.n_batch - self.n_batch % CHECKPOINT_ALIGNMENT))
        self.store_finished = store_finished
        self._vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self._slots = [_Slot(seq) for seq in range(sequences)]
        self._queue: deque[Job] = deque()
        self._running: list[Job] = []  # in admission order
        self._clock = 0
        self.counters = dict(
            admitted_live=0,
            admitted_warm=0,
            admitted_shared=0,
            admitted_cold=0,
            parked=0,
            parked_for_room=0,
            stored_idle=0,
            borrowed_tokens=0,
            decode_calls=0,
            tokens_generated=0,
            prompt_tokens_evaluated=0,
        )

    @property
    def ctx(self) -> Any:
        return self._ctx

    # -- jobs ---------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue `job` (ValueError if it cannot run: see `check`); it starts at a step
        when a slot is free for it."""
        self.check(job)
        job.submitted_at = time.perf_counter()
        self._queue.append(job)

    def check(self, job: Job) -> None:
        """Raise ValueError if `job` cannot run here (any thread may call this)."""
        if job.state != "queued" or job.submitted_at:
            raise ValueError("a job runs once")
        check_prompt(job.prompt, self.cache.n_vocab)
        if job.max_new < 1:
            raise ValueError(f"max_new must be at least 1, got {job.max_new}")
        if len(job.prompt) + job.max_new > self.n_ctx:
            raise ValueError(f"{len(job.prompt)} prompt tokens and {job.max_new} more do not fit in {self.n_ctx}")

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def busy(self) -> bool:
        """Whether a step would do anything: a job to admit while a slot is free, to prefill, to
        decode (not `Job.waiting` for its reader) or to drop."""
        if self._queue and len(self._running) < self.slots:
            return True
        return any(job.cancelled or not job.waiting for job in self._running)

    def step(self) -> StepReport:
        """Admit what fits, then one `llama_decode` of every decoding job's next token and
        up to `chunk` prompt tokens, then sample. A decode that fails ends the jobs in it
        with finish_reason "error"."""
        report = StepReport()
        self._drop_cancelled(report)
        self._admit_queued(report)
        items: list[tuple[int, int, int, bool]] = []
        decoding = [job for job in self._running if job.state == "decode" and not job.waiting]
        for job in decoding:
            assert job._slot is not None
            items.append((job._slot.seq, job.evaluated, job.generated[-1], True))
        segments = self._plan_prefill(len(items))
        for job, end in segments:
            assert job._slot is not None
            last = len(job.prompt) - 1
            items.extend((job._slot.seq, pos, job.prompt[pos], pos == last) for pos in range(job._position, end))
        if not items:
            return report
        report.decoded, report.prompt_tokens = len(decoding), len(items) - len(decoding)
        started = time.perf_counter()
        try:
            self._decode(items)
        except Exception as exc:
            for job in decoding + [job for job, _ in segments]:
                self._fail(job, exc, report)
            return report
        report.decode_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for index, job in enumerate(decoding):
            job.evaluated += 1
            assert job._slot is not None
            job._slot.tokens = job.context
            self._sample(job, index, report)
        index = len(decoding) - 1
        for job, end in segments:
            index += end - job._position
            self._prefilled(job, end, index, report)
        report.sample_seconds = time.perf_counter() - started
        return report

    def cancel(self, job: Job) -> None:
        """End `job` at the next step (any thread may call this)."""
        job.cancelled = True

    def abort(self, exc: BaseException) -> None:
        """End every job with finish_reason "error" (`exc`) and empty every slot: after a
        failure that leaves what the sequences hold unknown."""
        report = StepReport()
        for job in list(self._running):
            self._fail(job, exc, report)
        while self._queue:
            job = self._queue.popleft()
            job.error = exc
            self._finish(job, "error", report)
        for slot in self._slots:
            self._forget(slot)

    # -- admission ------------------------------------------------------------------------

    def _admit_queued(self, report: StepReport) -> None:
        waiting: deque[Job] = deque()
        while self._queue:
            job = self._queue.popleft()
            if job.cancelled:
                self._finish(job, "cancelled", report)
                continue
            slot = self._choose_slot(job) if len(self._running) < self.slots else None
            if slot is None:
                waiting.append(job)
                continue
            self._admit(job, slot, report)
            report.started += 1
        self._queue = waiting

    def _choose_slot(self, job: Job) -> _Slot | None:
        """The slot `job` runs in (None: wait): its session's; else an empty one; else the
        idle one whose sequence the prompt loses least of, least recently used among
        equals, parked (its KV kept for the newcomer) unless it is a session-less slot
        whose conversation the prompt goes on with (`_keeps`: the server's next turn,
        which stores nothing)."""
        if job.session is not None:
            own = next((s for s in self._slots if s.session == job.session), None)
            if own is not None:
                return own if own.job is None else None  # a session runs one job at a time
        reserved = {j.session for j in self._queue if j.session is not None} | {job.session}
        idle = [s for s in self._slots if s.job is None and (s.session is None or s.session not in reserved)]
        if not idle:
            return None
        empty = next((s for s in idle if not s.tokens and s.session is None), None)
        if empty is not None:
            return empty
        slot = min(idle, key=lambda s: (len(s.tokens) - common_length(s.tokens, job.prompt), s.used))
        if slot.session is not None or not self._keeps(slot, job.prompt):
            self._park(slot, keep=True)
        return slot

    def _keeps(self, slot: _Slot, prompt: list[int]) -> bool:
        """Whether `prompt` keeps what matters of `slot`'s sequence: all of it, or the prompt
        end its last job left (unsaved, or stored: `saved`), the conversation going on. What
        it may drop then is the tail of an answer its next turn holds in other tokens; an
        unsaved prompt end it keeps stays unsaved (`_admit`)."""
        common = common_length(slot.tokens, prompt)
        end = len(slot.unsaved[0]) if slot.unsaved is not None else slot.saved
        return common >= len(slot.tokens) or (end >= self.cache.min_tokens and common >= end)

    def _admit(self, job: Job, slot: _Slot, report: StepReport) -> None:
        own = job.session is not None and slot.session == job.session
        if slot.unsaved is not None and common_length(slot.tokens, job.prompt) < len(slot.unsaved[0]):
            self._save_prompt_end(slot)  # the new prompt leaves it: store it before the sequence is cut
        if not slot.tokens:  # an empty sequence: what another slot holds first, then the cache's if longer
            self._share(slot, job.prompt[:-1], 0)
        live = slot.tokens
        slot.job, slot.session = job, job.session
        self._clock += 1
        slot.used = self._clock
        reuse = self.cache.reuse(self._ctx, slot.seq, job.prompt, live, with_logits=True)
        slot.tokens = job.prompt[: reuse.start]
        slot.saved = max(reuse.restored, reuse.branch)
        job.admitted = "warm" if reuse.restored else ("live" if own else "shared") if reuse.start else "cold"
        job.reused, job._position = reuse.start, reuse.start
        job._plan = self.cache.plan(reuse.start, reuse.branch, len(job.prompt))
        job.evaluated = reuse.start
        job._slot = slot
        if self.cache.kind.exact_length_only:
            self._stop_where_shared(job)
        self._running.append(job)
        if reuse.logits is not None:  # an exact repeat: the first token from the stored logits
            job.state = "decode"
            job.logits_from_store = True
            token = states.sample_from_logits(job.chain, reuse.logits)
            self._accept(job, token, reuse.logits if job.keep_logits else None, report)
        else:
            job.state = "prefill"

    # -- prefill ----------------------------------------------------------------------------

    def _plan_prefill(self, decoding: int) -> list[tuple[Job, int]]:
        """(job, where its prompt segment ends) for this step: jobs in admission order,
        each segment ending at a checkpoint boundary, the prompt's end or a multiple of
        `chunk` (the splits a prefill alone makes); a segment the step's room cuts short
        ends at a multiple of 32 tokens from its start (a split that changes no result).
        Every prefilling job first borrows what other slots hold at the step's start (a
        recurrent donor holds a shared prefix exactly for one step only)."""
        room = min(self.chunk, self.n_batch - decoding)
        segments: list[tuple[Job, int]] = []
        prefilling = [job for job in self._running if job.state == "prefill"]
        for job in prefilling:
            self._borrow(job)
        for order, job in enumerate(prefilling):
            if room <= 0:
                break
            if self._waits_for(job, prefilling[:order]):
                continue
            position, n = job._position, len(job.prompt)
            end = min(job._plan.next_stop(position, n), (position // self.chunk + 1) * self.chunk)
            if end - position > room:
                end = position + room - room % CHECKPOINT_ALIGNMENT
                if end <= position:
                    break
            segments.append((job, end))
            room -= end - position
        return segments

    def _borrow(self, job: Job) -> None:
        """Share the longest prefix of the prompt, minus its last token, that another
        slot holds beyond what this job has (`_share`)."""
        slot = job._slot
        assert slot is not None
        best = self._share(slot, job.prompt[:-1], job._position)
        if best <= job._position:
            return
        if job.admitted == "cold":
            job.admitted = "shared"
        job.reused = job._position = job.evaluated = best
        job._plan.skip_to(best)

    def _share(self, slot: _Slot, target: list[int], beyond: int) -> int:
        """Make `slot`'s sequence the longest prefix of `target` longer than `beyond`
        that another slot holds (`llama_memory_seq_cp`: the same cells, not a copy),
        where cutting that slot's sequence there is exact (`MemoryKind.can_truncate`:
        the sliding-window rule; recurrent and hybrid, only a slot holding exactly that
        prefix). Returns the tokens the sequence now shares (`beyond`: none found)."""
        mem, kind = states.memory(self._ctx), self.cache.kind
        best, donor = beyond, None
        for other in self._slots:
            if other is slot or not other.tokens:
                continue
            length = common_length(other.tokens, target)
            if length > best and kind.can_truncate(mem, other.seq, length):
                best, donor = length, other
        if donor is None:
            return beyond
        states.clear(mem, slot.seq)
        llama_cpp.llama_memory_seq_cp(mem, donor.seq, slot.seq, 0, best)
        self.counters["borrowed_tokens"] += best - beyond
        slot.tokens = target[:best]
        return best

    def _waits_for(self, job: Job, earlier: list[Job]) -> bool:
        """Whether an earlier job is still evaluating a prefix this one shares beyond its
        own position (it will borrow it once evaluated)."""
        for other in earlier:
            shared = self._share_point(other, job)
            if other._position < shared and shared > job._position:
                return True
        return False

    def _share_point(self, donor: Job, job: Job) -> int:
        """How much of `job`'s prompt (minus its last token) it can borrow from `donor`'s
        evaluation: what they share, rounded down to `CHECKPOINT_ALIGNMENT` on a
        recurrent or hybrid model, where `donor` stops for it (`_stop_where_shared`)."""
        shared = common_length(donor.prompt, job.prompt[:-1])
        return shared - shared % CHECKPOINT_ALIGNMENT if self.cache.kind.exact_length_only else shared

    def _stop_where_shared(self, job: Job) -> None:
        """Recurrent and hybrid models: make every earlier job still evaluating a prefix
        `job` shares stop there (a checkpoint), so that for one step its sequence holds
        exactly that prefix, whole, and `_borrow` can share it."""
        for other in self._running:
            if other.state == "prefill":
                point = self._share_point(other, job)
                if point > max(other._position, job._position) and point >= self.cache.min_tokens:
                    other._plan.add(point)

    def _prefilled(self, job: Job, end: int, index: int, report: StepReport) -> None:
        """`job`'s prompt is evaluated up to `end` (its last token at batch `index`)."""
        slot = job._slot
        assert slot is not None
        evaluated = end - job._position
        self.cache.stats.tokens_evaluated += evaluated
        self.counters["prompt_tokens_evaluated"] += evaluated
        job._position = job.evaluated = end
        slot.tokens = job.prompt[:end]
        if end in job._plan.positions:
            self.cache.checkpoint(job._plan, self._ctx, slot.seq, job.prompt[:end])
        elif end == len(job.prompt):
            job.state = "decode"
            if len(job.prompt) >= self.cache.min_tokens:  # stored with its logits: an exact repeat evaluates nothing
                logits = states.copy_logits(self._ctx, self.cache.n_vocab, index)
                if self._store_now(slot, end):
                    self.cache.snapshot(self._ctx, slot.seq, job.prompt, logits=logits, replace=True, supersede=True)
                    slot.saved, slot.unsaved = end, None
                else:
                    slot.unsaved = (list(job.prompt), logits)
            self._sample(job, index, report)

    def _store_now(self, slot: _Slot, end: int) -> bool:
        """Whether a prompt's end is stored as soon as it is evaluated. With
        `store_finished` and on a model whose states cannot be cut back (recurrent,
        hybrid), always. Else (`SessionPool`, the server) when nothing stored held a
        prefix of it at admission (a new conversation or system prompt: other processes
        want it now) or it is `checkpoint_interval` tokens beyond that (what a crash
        could cost, as a long prefill's checkpoints bound it); otherwise its tokens and
        logits wait in the slot and are stored when the slot is parked (for room, `park`,
        `park_all`, a hand-over), a later prompt leaves them or `store_unsaved` runs, a
        later turn of a conversation kept live superseding them: a 12 MB state written
        per turn for the few tokens it adds was most of what the cache cost a pool
        (benchmarks/pool.py), and on a GPU a 1 GB state costs more than the answer."""
        if self.store_finished or self.cache.kind.exact_length_only or slot.saved < self.cache.min_tokens:
            return True
        return end - slot.saved >= self.cache.options.checkpoint_interval

    def _save_prompt_end(self, slot: _Slot) -> None:
        """Store the slot's unsaved prompt end with its logits, cutting the sequence back
        to it (when the slot still holds it and cutting there is exact)."""
        assert slot.unsaved is not None
        key, logits = slot.unsaved
        slot.unsaved = None
        if slot.tokens[: len(key)] != key:
            return
        if len(slot.tokens) > len(key) and not self.cache.truncate(self._ctx, slot.seq, len(key)):
            return
        slot.tokens = list(key)
        self.cache.snapshot(self._ctx, slot.seq, key, logits=logits, replace=True, supersede=True)

    # -- decoding and sampling ----------------------------------------------------------------

    def _sample(self, job: Job, index: int, report: StepReport) -> None:
        logits = states.copy_logits(self._ctx, self.cache.n_vocab, index) if job.keep_logits else None
        token = int(llama_cpp.llama_sampler_sample(job.chain, self._ctx, index))
        self._accept(job, token, logits, report)

    def _accept(self, job: Job, token: int, logits: np.ndarray | None, report: StepReport) -> None:
        job.last_token_at = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = job.last_token_at
        job.generated.append(token)
        self.counters["tokens_generated"] += 1
        report.sampled += 1
        if token in job.stop or llama_cpp.llama_vocab_is_eog(self._vocab, token):
            job.finish_reason = "stop"
        elif len(job.generated) >= job.max_new:
            job.finish_reason = "length"
        if job.on_token is not None:
            job.on_token(job, token, logits)
        if job.finish_reason is not None:
            self._leave(job, report)

    def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of (sequence, position, token, wants logits) items; while
        llama.cpp finds no room for them (status 1: nothing was evaluated), park the
        least recently used idle sequence and try again."""
        batch = self._batch
        assert batch is not None and items
        batch.n_tokens = len(items)
        for i, (seq, pos, token, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        status = llama_cpp.llama_decode(self._ctx, batch)
        while status == 1 and self.park_least_recent({job.session for job in self._queue}):
            self.counters["parked_for_room"] += 1
            status = llama_cpp.llama_decode(self._ctx, batch)
        self.counters["decode_calls"] += 1
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} ({len(items)} tokens)")

    # -- leaving --------------------------------------------------------------------------------

    def _drop_cancelled(self, report: StepReport) -> None:
        for job in [job for job in self._running if job.cancelled]:
            self._finish(job, "cancelled", report)

    def _leave(self, job: Job, report: StepReport) -> None:
        """A job that finished by itself: its slot keeps the sequence (stored now with
        `store_finished`)."""
        slot = job._slot
        assert slot is not None
        self._release(job)
        if self.store_finished and len(slot.tokens) >= self.cache.min_tokens:
            self.cache.snapshot(self._ctx, slot.seq, list(slot.tokens))
            slot.saved = len(slot.tokens)
        self._done(job, report)

    def _finish(self, job: Job, reason: str, report: StepReport) -> None:
        job.finish_reason = reason
        if job._slot is not None:
            self._release(job)
        self._done(job, report)

    def _fail(self, job: Job, exc: BaseException, report: StepReport) -> None:
        """A job whose decode failed: its sequence is not to be trusted, so it is cleared."""
        slot = job._slot
        job.error = exc
        self._finish(job, "error", report)
        if slot is not None:
            self._forget(slot)

    def _release(self, job: Job) -> None:
        slot = job._slot
        assert slot is not None
        slot.tokens = job.context
        slot.job = None
        self._running.remove(job)
        self.counters[f"admitted_{job.admitted}"] += 1

    def _done(self, job: Job, report: StepReport) -> None:
        job.state = "done"
        job.finished_at = time.perf_counter()
        report.finished += 1
        if job.on_finish is not None:
            job.on_finish(job)

    # -- slots --------------------------------------------------------------------------------

    def sessions(self) -> list[Hashable]:
        """The sessions holding a slot, least recently used first."""
        return [s.session for s in sorted(self._slots, key=lambda s: s.used) if s.session is not None]

    def held_cells(self, adding: Sequence[Sequence[int]] = ()) -> int:
        """The KV cells the sequences hold (with `adding`: and these prompts beside them),
        a prefix several of them hold counted once: what `_borrow` shares is one set of
        cells. A restored sequence has cells of its own, so this can be lower than what
        llama.cpp holds (a step then parks for room), never higher than the sum of the
        sequences' lengths."""
        held = sorted([list(s.tokens) for s in self._slots if s.tokens] + [list(p) for p in adding if p])
        return sum(map(len, held)) - sum(common_length(a, b) for a, b in pairwise(held))

    def park_least_recent(self, keep: set[Hashable] | frozenset[Hashable] = frozenset()) -> bool:
        """Park (store, then clear) the least recently used idle sequence, but those of
        the sessions in `keep`; False if there is none."""
        idle = [s for s in self._slots if s.job is None and s.tokens and (s.session is None or s.session not in keep)]
        if not idle:
            return False
        self._park(min(idle, key=lambda s: s.used))
        return True

    def park(self, session: Hashable) -> bool:
        """Snapshot the idle slot of `session` into the cache and free it; False if no
        idle slot holds that session."""
        slot = next((s for s in self._slots if s.session == session and s.job is None), None)
        if slot is not None:
            self._park(slot)
        return slot is not None

    def park_all(self) -> None:
        """Snapshot every idle slot's sequence into the cache (unless stored already), then
        its unsaved prompt end with its logits, and free the slots: what a process leaves
        for the next one."""
        for slot in self._slots:
            if slot.job is None and (slot.tokens or slot.session is not None):
                self._park(slot)

    @property
    def unstored(self) -> int:
        """Idle slots holding what the store does not: an unsaved prompt end, or tokens
        beyond what the store held of their sequence (`store_unsaved` stores them)."""
        return sum(1 for slot in self._slots if slot.job is None and self._holds_unstored(slot))

    def _holds_unstored(self, slot: _Slot) -> bool:
        return slot.unsaved is not None or len(slot.tokens) > max(slot.saved, self.cache.min_tokens - 1)

    def store_unsaved(self) -> int:
        """Store what each idle slot holds beyond the store, as parking does (its sequence
        unless stored already, then its unsaved prompt end with its logits), leaving the
        slot its conversation and KV, cut back to that prompt end if there was one (what
        followed it is in the store now). Returns the slots stored. The server's scheduler
        calls it once idle: what other processes, and the next process after a crash,
        find of conversations that kept their slots."""
        stored = 0
        for slot in self._slots:
            if slot.job is None and self._holds_unstored(slot):
                self._store_slot(slot)
                stored += 1
        self.counters["stored_idle"] += stored
        return stored

    def _park(self, slot: _Slot, *, keep: bool = False) -> None:
        """Store the slot (`_store_slot`) and free it (with `keep`, its KV, cut back to its
        unsaved prompt end if there was one, stays for the next job to reuse)."""
        self._store_slot(slot)
        self.counters["parked"] += 1
        if keep:
            slot.session = None
        else:
            self._forget(slot)

    def _store_slot(self, slot: _Slot) -> None:
        """Snapshot the slot's sequence into the cache (unless stored already), then its
        unsaved prompt end with its logits (`_save_prompt_end`: the sequence cut back to
        it where that is exact); the store then holds all the slot holds."""
        at_prompt_end = slot.unsaved is not None and slot.unsaved[0] == slot.tokens  # stored below, with logits
        if len(slot.tokens) >= self.cache.min_tokens and not at_prompt_end:
            self.cache.snapshot(self._ctx, slot.seq, list(slot.tokens))
        if slot.unsaved is not None:
            self._save_prompt_end(slot)
        slot.saved = len(slot.tokens)

    def _forget(self, slot: _Slot) -> None:
        states.clear(states.memory(self._ctx), slot.seq)
        slot.session, slot.tokens, slot.saved, slot.unsaved = None, [], 0, None

    def free(self) -> None:
        """Free the context (the jobs still in it end, unfinished)."""
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
