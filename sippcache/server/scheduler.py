"""The ``--parallel`` scheduler: one model's `BatchEngine`, stepped on a thread of its own.

Requests (each on its own worker thread, in upstream's code) get a
`BatchedLlama` from `Scheduler.new_request` and hand their jobs to
`Scheduler.submit`; the scheduler thread moves them into the engine between
steps, ends the jobs of clients that hung up, runs `BatchEngine.step()` while
there is work, and sleeps when there is none. Tokens go back to each request
through the job's callbacks (see `sippcache.server.batched`). What cannot run
batched runs on the shared model behind `Scheduler.serialized`'s lock.

States are stored by `SessionPool`'s rule (`BatchEngine._store_now`), not after
every request: a prompt's end at once when the store held nothing of it (a new
conversation or system prompt), on a recurrent or hybrid model, or
`checkpoint_interval` tokens beyond the store; otherwise what a slot holds waits
there and is stored when the slot goes to another conversation, when the
scheduler has had no job for `save_idle` seconds (`BatchEngine.store_unsaved`,
on the scheduler thread), and when the scheduler closes (`close`: every slot
parked). A conversation that keeps its slot writes nothing per turn.

A step that fails in an unexpected way ends every job in the engine with that
error and starts over with empty slots: requests fail, the server keeps
serving.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..llama.batch import BatchEngine, Job, StepReport
from ..llama.seqcache import SequenceCache
from .batched import BatchedLlama
from .door import RequestContext
from .model import ServedLlama
from .settings import DEFAULT_SAVE_IDLE

log = logging.getLogger("sippcache")

__all__ = ["Scheduler", "SchedulerStats"]

#: Seconds over which `SchedulerStats` reports tokens per second.
RATE_WINDOW = 10.0

_T = TypeVar("_T")


@dataclass
class SchedulerStats:
    """What the metrics read of a scheduler: running and waiting jobs, busy slots,
    recent steps (time, prompt tokens, generated tokens) for the rates, and the
    requests that ran on the shared model instead, by reason."""

    slots: int
    running: int = 0
    queued: int = 0
    busy_slots: int = 0
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)
    serialized: dict[str, int] = field(default_factory=dict)

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(prompt tokens, generated tokens) per second over the last `RATE_WINDOW` seconds."""
        now = time.monotonic() if now is None else now
        steps = [step for step in list(self.recent) if step[0] >= now - RATE_WINDOW]
        return sum(s[1] for s in steps) / RATE_WINDOW, sum(s[2] for s in steps) / RATE_WINDOW


class Scheduler:
    """Runs `model`'s requests `slots` at a time in one context (`BatchEngine`), on the
    store `sequences` uses. `on_step(report)` is called after every step and
    `on_done(job, request)` when a job leaves (metrics). With `interrupting`
    (the server's ``interrupt_requests``), each job waiting for a slot picks the
    oldest running request to be ended (`interrupted`). Once it has had no job for
    `save_idle` seconds, it stores what its slots hold beyond the store (see the
    module docstring)."""

    def __init__(
        self,
        model: ServedLlama,
        sequences: SequenceCache,
        *,
        slots: int,
        chunk: int,
        name: str,
        on_step: Callable[[StepReport], None] | None = None,
        on_done: Callable[[Job, RequestContext | None], None] | None = None,
        interrupting: bool = False,
        save_idle: float = DEFAULT_SAVE_IDLE,
    ) -> None:
        if isinstance(save_idle, bool) or not isinstance(save_idle, (int, float)) or not 0 <= save_idle < math.inf:
            raise ValueError(f"save_idle must be a number of seconds >= 0, got {save_idle!r}")
        self.model, self.sequences = model, sequences
        self.save_idle = float(save_idle)
        self.engine = BatchEngine(
            model,
            sequences,
            slots=slots,
            n_ctx=slots * model.n_ctx(),
            n_batch=model.n_batch,
            chunk=chunk,
        )
        self.stats = SchedulerStats(slots)
        self.on_step, self.on_done = on_step, on_done
        self._incoming: list[tuple[Job, RequestContext | None]] = []
        self._requests: dict[Job, RequestContext | None] = {}
        self.interrupting = interrupting
        self._interrupted: set[RequestContext] = set()
        self._serial = threading.Lock()  # the shared model's own context: one user at a time
        self._seed_lock = threading.Lock()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"sippcache-scheduler-{name}", daemon=True)
        self._thread.start()

    def new_request(self) -> BatchedLlama:
        """A `llama_cpp.Llama` for one request."""
        return BatchedLlama(self.model, self)

    def take_seed(self) -> int:
        """The model's seed for a request that reads it, and the model's next: upstream's
        unseeded request sets the shared model's seed to ``Random(seed).randint(0, 2**32)``
        and seeds itself with that; here the request takes its turn in that chain at once,
        so two requests reading at the same moment do not get the same seed."""
        with self._seed_lock:
            seed = self.model._seed
            self.model.set_seed(random.Random(seed).randint(0, 2**32))
            return seed

    def give_seed(self, seed: int) -> None:
        """A request set its seed: as upstream's, it is the shared model's from now on."""
        with self._seed_lock:
            self.model.set_seed(seed)

    def submit(self, job: Job, request: RequestContext | None = None) -> None:
        """Run `job` (from any thread; ValueError if it cannot run); when `request`'s client
        disconnects, it ends at the next step."""
        self.engine.check(job)
        with self._wake:
            if self._closing:
                raise RuntimeError("the model is being unloaded")
            self._incoming.append((job, request))
            self.stats.queued += 1
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """End `job` at the next step (from any thread)."""
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    def allow(self, job: Job, tokens: int) -> None:
        """Let `job` sample up to `tokens` tokens (`Job.allowed`; from its reader's thread)."""
        job.allowed = tokens
        with self._wake:
            self._wake.notify()

    def interrupted(self, request: RequestContext) -> bool:
        """Whether `request`'s stream is to end for a request waiting for a slot."""
        return request in self._interrupted

    def serialized(self, reason: str, call: Callable[[], _T]) -> _T:
        """`call()` on the shared model, one at a time; a stream holds the model until it
        ends. Counted by `reason`."""
        with self._wake:
            self.stats.serialized[reason] = self.stats.serialized.get(reason, 0) + 1
        self._serial.acquire()
        try:
            result = call()
        except BaseException:
            self._serial.release()
            raise
        if isinstance(result, Iterator):
            return _holding(result, self._serial)  # type: ignore[return-value]
        self._serial.release()
        return result

    def close(self) -> None:
        """Let the running jobs finish, park every slot in the store (its sequence, and its
        unsaved prompt end with its logits), free the context."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        try:
            self.engine.park_all()
        finally:
            self.engine.free()

    # -- the scheduler thread ---------------------------------------------------------------

    def _run(self) -> None:
        worked = time.monotonic()  # when the engine last had a job
        while True:
            with self._wake:
                idle = False
                while not (self._incoming or self.engine.busy):
                    if self._closing and not (self.engine.running or self.engine.queued):
                        return
                    if self._closing or self.engine.running or not self.engine.unstored:
                        self._wake.wait()  # a job, a reader asking for more or leaving, the close
                        continue
                    left = worked + self.save_idle - time.monotonic()
                    if left <= 0:
                        idle = True
                        break
                    self._wake.wait(left)
                incoming, self._incoming = self._incoming, []
            if idle:
                self._store_idle()
                worked = time.monotonic()  # a store that failed is tried again after another idle time, not at once
                continue
            try:
                self._step(incoming)
            except Exception as exc:  # the engine's state cannot be trusted: every job fails, the server goes on
                log.exception("sippcache: a batched step failed; ending its requests")
                self.engine.abort(exc)
                self._observe(StepReport())
            worked = time.monotonic()

    def _store_idle(self) -> None:
        """Store what the slots hold beyond the store (`BatchEngine.store_unsaved`): the
        engine has had no job for `save_idle` seconds."""
        try:
            stored = self.engine.store_unsaved()
        except Exception:  # the slots keep what they hold; the next idle time tries again
            log.exception("sippcache: storing the idle slots failed")
            return
        log.debug("sippcache: stored %d idle slot(s) after %g s without a job", stored, self.save_idle)

    def _step(self, incoming: list[tuple[Job, RequestContext | None]]) -> None:
        for job, request in incoming:
            self._requests[job] = request
            self.engine.submit(job)
        for job, request in self._requests.items():
            if request is not None and request.disconnected.is_set():
                job.cancelled = True
        self._observe(self.engine.step())

    def _observe(self, report: StepReport) -> None:
        stats, engine = self.stats, self.engine
        stats.running, stats.busy_slots = engine.running, engine.running
        with self._wake:
            stats.queued = engine.queued + len(self._incoming)
        if report.batch:
            stats.recent.append((time.monotonic(), report.prompt_tokens, report.sampled))
            while stats.recent and stats.recent[0][0] < time.monotonic() - RATE_WINDOW:
                stats.recent.popleft()
        if self.on_step is not None:
            self.on_step(report)
        for job in [job for job in self._requests if job.state == "done"]:
            request = self._requests.pop(job)
            if request is not None:
                self._interrupted.discard(request)
            if self.on_done is not None:
                self.on_done(job, request)
        if self.interrupting:
            self._pick_interrupted()

    def _pick_interrupted(self) -> None:
        """One running request to end per job waiting for a slot, oldest first."""
        owed = self.engine.queued - len(self._interrupted)
        running = sorted(
            ((job, request) for job, request in self._requests.items() if job.state in ("prefill", "decode")),
            key=lambda item: item[0].submitted_at,
        )
        for _, request in running:
            if owed <= 0:
                return
            if request is not None and request not in self._interrupted:
                self._interrupted.add(request)
                owed -= 1


def _holding(stream: Iterator[Any], lock: threading.Lock) -> Iterator[Any]:
    """`stream`, releasing `lock` when it ends or is closed."""
    try:
        yield from stream
    finally:
        lock.release()
