"""`tiered://`: a local cache (L1) in front of a shared one (L2), itself a `CacheBackend`.

    tiered://?l1=<L1 URL, percent-encoded>&l2=<L2 URL, percent-encoded>[&max_bytes=...&max_entries=...]

Typically L1 is this machine's LMDB store and L2 a Redis server every replica
shares (`tiered_url` builds the URL)::

    tiered_url("lmdb:///var/cache/sipp", "redis://cache:6379/0?prefix=prod", max_bytes="20GiB")

- A store goes to L1 at once (its result is the result) and to L2 through a
  bounded background queue, so the shared tier never adds latency to a request.
- A lookup asks L1 first. If L1's match covers the whole query, that is the
  answer. Otherwise it waits (at most `timeout`) until this handle's queued L2
  operations are done, so it never sees L2 older than its own earlier stores,
  and asks L2; a longer match there is copied into L1 (with generation 0, so
  it never replaces a newer local entry) and returned.
- Uses of L1 hits reach L2 as `touch` calls through the same queue, so both
  tiers see uses in the same order as the stores.
- delete, clear, pin and unpin go to both tiers, to L2 through the queue (in
  order with the stores before them), waiting for its answer.
- `len`, `entries` and most of `stats` describe L2, the authoritative tier,
  after the queue drains; if L2 raises, L1's view instead.
- An L2 that fails never fails a call: its exceptions are counted in
  `Stats.errors` and warned about once per outage. L1 errors are raised as
  for any backend.

The queue is shared by every tiered handle in the process with the same L2
URL, one worker thread each, so operations reach L2 in the order they were
made even across handles. Operations still queued when the process exits
without `close()` are lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, urlencode

from ..base import BaseBackend
from ..errors import BadOption, CacheFull
from ..options import Size, coerce_options
from ..protocol import CacheBackend, EntryInfo, Match, Peek, Stats, StoreOptions

log = logging.getLogger("sippcache")

_Result = TypeVar("_Result")
_Default = TypeVar("_Default")

DEFAULT_QUEUE = 256
DEFAULT_QUEUE_BYTES = 512 * 1024**2
DEFAULT_TIMEOUT = 5.0


def tiered_url(l1: str, l2: str, **options: Any) -> str:
    """The `tiered://` URL of `l1` in front of `l2` (each percent-encoded whole), with
    tiered options such as ``max_bytes="20GiB"``, ``queue=256``, ``timeout=5``."""
    return "tiered://?" + urlencode({"l1": l1, "l2": l2, **{k: str(v) for k, v in options.items()}})


def _with_options(url: str, options: Mapping[str, Any]) -> str:
    """`url` with `options` added to (or replacing those in) its query string."""
    if not options:
        return url
    base, _, query = url.partition("?")
    merged = dict(parse_qsl(query, keep_blank_values=True))
    merged.update({name: str(value) for name, value in options.items()})
    return f"{base}?{urlencode(merged)}"


def _tokens(key: bytes) -> array[int]:
    ids = array("I")
    ids.frombytes(key)
    return ids


@dataclass
class _Job:
    """One L2 operation: run by the lane's worker, its outcome read by whoever waits."""

    run: Callable[[], Any]
    owner: TieredBackend
    nbytes: int = 0
    ticket: int = 0
    result: Any = None
    error: BaseException | None = None


class _Lane:
    """A FIFO of L2 operations and the thread that runs them (one per L2 URL per process)."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _lanes: ClassVar[dict[tuple[int, str], _Lane]] = {}

    def __init__(self, key: tuple[int, str]) -> None:
        self.key = key
        self.pid = key[0]
        self.cond = threading.Condition()
        self.jobs: deque[_Job] = deque()
        self.bytes = 0
        self.issued = 0  # tickets handed out
        self.done = 0  # every ticket up to this one has run
        self.users = 0
        self.thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, url: str) -> _Lane:
        key = (os.getpid(), url)
        with cls._lock:
            lane = cls._lanes.get(key)
            if lane is None:
                lane = cls._lanes[key] = _Lane(key)
            lane.users += 1
            return lane

    def release(self) -> None:
        with _Lane._lock:
            self.users -= 1
            if self.users <= 0:
                _Lane._lanes.pop(self.key, None)
        with self.cond:
            self.cond.notify_all()

    def submit(self, job: _Job, *, limit: int, limit_bytes: int, wait: float) -> bool:
        """Queue `job`; if the queue is full, wait up to `wait` seconds for room (0: drop at once)."""
        deadline = time.monotonic() + wait
        with self.cond:
            while self.jobs and (len(self.jobs) >= limit or self.bytes + job.nbytes > limit_bytes):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            self.issued += 1
            job.ticket = self.issued
            self.jobs.append(job)
            self.bytes += job.nbytes
            if self.thread is None:
                self.thread = threading.Thread(target=self._work, name="sippcache-tiered-l2", daemon=True)
                self.thread.start()
            self.cond.notify_all()
            return True

    def wait(self, ticket: int, timeout: float) -> bool:
        """Wait until the job with `ticket` (and every one before it) has run."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.done < ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    if self.users <= 0:
                        self.thread = None
                        return
                    self.cond.wait(1.0)
                job = self.jobs[0]
            try:
                job.result = job.run()
            except BaseException as exc:  # handed to the waiter or counted; never kills the worker
                job.error = exc
            job.owner._l2_outcome(job.error)
            with self.cond:
                self.jobs.popleft()
                self.bytes -= job.nbytes
                self.done = job.ticket
                self.cond.notify_all()


def _reset_lanes_in_child() -> None:
    _Lane._lock = threading.Lock()
    _Lane._lanes = {}


os.register_at_fork(after_in_child=_reset_lanes_in_child)


class TieredBackend(BaseBackend):
    """L1 in front of L2 (see the module docstring). Built by `from_url`; `persistent`
    only when both tiers are (`PersistentTieredBackend`)."""

    persistent: ClassVar[bool] = False
    keeps_bytes: ClassVar[bool] = True
    options: ClassVar[Mapping[str, type]] = {
        "l1": str, "l2": str, "max_bytes": Size, "max_entries": int, "queue": int, "queue_bytes": Size,
        "timeout": float,
    }  # fmt: skip

    def __init__(
        self,
        l1: CacheBackend,
        l2: CacheBackend,
        *,
        lane: str = "",
        queue: int = DEFAULT_QUEUE,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        location: str = "tiered://",
    ) -> None:
        super().__init__()
        if queue < 1:
            raise ValueError(f"queue must be at least 1, got {queue}")
        if queue_bytes < 1:
            raise ValueError(f"queue_bytes must be positive, got {queue_bytes}")
        if not 0 <= timeout <= 3600:
            raise ValueError(f"timeout must be in 0..3600 seconds, got {timeout}")
        self.l1 = l1
        self.l2 = l2
        self.location = location
        self.queue = queue
        self.queue_bytes = queue_bytes
        self.timeout = float(timeout)
        self._lane_name = lane or f"{id(l2)}"
        self._lane = _Lane.acquire(self._lane_name)
        self._last_ticket = 0
        self._lock = threading.Lock()
        self._counters = dict(hits=0, misses=0, stores=0, errors=0)
        self._l2_down: str | None = None
        self._l2_failures = 0

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> TieredBackend:
        """Open both tiers from the `l1` and `l2` options (budgets on the tiered URL go to both)."""
        from ..registry import open as open_url

        kwargs = coerce_options(cls.__name__, options, cls.options)
        if location:
            raise BadOption(f"tiered:// takes no location (got {location!r}); give the tiers as l1= and l2=")
        missing = [name for name in ("l1", "l2") if not kwargs.get(name)]
        if missing:
            raise BadOption(
                f"tiered:// needs {' and '.join(missing)}, e.g. {tiered_url('lmdb:///var/cache/sipp', 'redis://cache:6379/0')}"
            )
        budgets: dict[str, Any] = {name: kwargs.pop(name) for name in ("max_bytes", "max_entries") if name in kwargs}
        l1_url, l2_url = _with_options(kwargs.pop("l1"), budgets), _with_options(kwargs.pop("l2"), budgets)
        l1 = open_url(l1_url)
        try:
            l2 = open_url(l2_url)
        except BaseException:
            l1.close()
            raise
        both = type(l1).persistent and type(l2).persistent
        chosen = PersistentTieredBackend if both else TieredBackend
        shown = tiered_url(_shown(l1, l1_url), _shown(l2, l2_url))
        try:
            return chosen(l1, l2, lane=l2_url, location=shown, **kwargs)
        except ValueError as exc:
            l1.close()
            l2.close()
            raise BadOption(f"{cls.__name__}: {exc}") from exc

    # -- the L2 queue ---------------------------------------------------------------

    def _lane_here(self) -> _Lane:
        if self._lane.pid != os.getpid():  # forked: this process needs its own worker
            self._lane = _Lane.acquire(self._lane_name)
            self._last_ticket = 0
        return self._lane

    def _submit(self, run: Callable[[], Any], *, nbytes: int = 0, wait: float = 0.0) -> _Job | None:
        job = _Job(run, self, nbytes)
        if not self._lane_here().submit(job, limit=self.queue, limit_bytes=self.queue_bytes, wait=wait):
            self._l2_outcome(RuntimeError(f"the L2 queue is full ({self.queue} operations, {self.queue_bytes} bytes)"))
            return None
        with self._lock:
            self._last_ticket = max(self._last_ticket, job.ticket)
        return job

    def _drain(self) -> bool:
        """Wait (at most `timeout`) until this handle's queued L2 operations have run."""
        return self._lane_here().wait(self._last_ticket, self.timeout)

    def _ordered(self, run: Callable[[], Any], default: Any) -> Any:
        """Run `run` on L2 after everything queued before it, and return its result (or
        `default` if L2 failed or did not answer within `timeout`). CacheFull is raised."""
        job = self._submit(run, wait=self.timeout)
        if job is None or not self._lane_here().wait(job.ticket, self.timeout):
            return default
        if isinstance(job.error, CacheFull):
            raise job.error
        return default if job.error is not None else job.result

    def _l2_outcome(self, error: BaseException | None) -> None:
        """Count and report L2 failures: one warning per outage, a note when it works again."""
        with self._lock:
            if error is None or isinstance(error, CacheFull):
                if self._l2_down is not None:
                    log.info("sippcache: L2 of %s works again after %d failures", self.location, self._l2_failures)
                    self._l2_down, self._l2_failures = None, 0
                return
            self._counters["errors"] += 1
            self._l2_failures += 1
            if self._l2_down is None:
                self._l2_down = f"{type(error).__name__}: {error}"
                log.warning("sippcache: L2 of %s failed (%s); carrying on with L1", self.location, self._l2_down)

    def _l2(self, call: Callable[[], _Result], default: _Default) -> _Result | _Default:
        """Call L2 from this thread; a failure is counted and answered with `default`."""
        try:
            result = call()
        except CacheFull:
            raise
        except Exception as exc:
            self._l2_outcome(exc)
            return default
        self._l2_outcome(None)
        return result

    def _forward_touch(self, key: tuple[int, ...], namespace: str) -> None:
        self._submit(lambda: self.l2.touch(key, namespace=namespace))

    # -- BaseBackend hooks ------------------------------------------------------------

    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool:
        tokens = _tokens(key)
        stored = self.l1.store(
            tokens,
            blob,
            namespace=namespace,
            priority=options.priority,
            pinned=options.pinned,
            generation=options.generation,
        )
        owner = blob.obj
        # A copy unless the blob is a whole bytes object: the caller may reuse its buffer.
        data = owner if type(owner) is bytes and len(owner) == blob.nbytes else blob.tobytes()
        self._submit(
            lambda: self.l2.store(
                tokens,
                data,
                namespace=namespace,
                priority=options.priority,
                pinned=options.pinned,
                generation=options.generation,
            ),
            nbytes=len(data),
        )
        if stored:
            with self._lock:
                self._counters["stores"] += 1
        return stored

    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Match | None:
        tokens = _tokens(key)
        first = self.l1.lookup(tokens, namespace=namespace, partial=partial, touch=touch)
        best = first.length if first is not None else 0
        if best < len(tokens):
            self._drain()
            longer = self._l2_longer(tokens, namespace, partial, best)
            if longer is not None:
                if first is not None:
                    first.release()
                self._copy_to_l1(longer)
                if touch:
                    self._forward_touch(longer.key, namespace)
                with self._lock:
                    self._counters["hits"] += 1
                return longer
        with self._lock:
            self._counters["hits" if first is not None else "misses"] += 1
        if first is not None and touch:
            self._forward_touch(first.key, namespace)
        return first

    def _lookup_prefixes(self, key: bytes, lengths: list[int], namespace: str, touch: bool) -> list[Match]:
        """L1's run of the chain, then L2's for the lengths past it (copied into L1)."""
        tokens = _tokens(key)
        found = self.l1.lookup_prefixes(tokens, lengths, namespace=namespace, touch=touch)
        rest = lengths[len(found) :]
        if rest:
            self._drain()
            more = self._l2(lambda: self.l2.lookup_prefixes(tokens, rest, namespace=namespace, touch=False), [])
            for match in more:
                self._copy_to_l1(match)
            found += more
        with self._lock:
            self._counters["hits"] += len(found)
            self._counters["misses"] += len(found) < len(lengths)
        if touch:
            for match in found:
                self._forward_touch(match.key, namespace)
        return found

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        tokens = _tokens(key)
        first = self.l1.peek(tokens, namespace=namespace, partial=partial)
        if first is not None and first.length == len(tokens):
            return first
        self._drain()
        second = self._l2(lambda: self.l2.peek(tokens, namespace=namespace, partial=partial), None)
        return second if second is not None and (first is None or second.length > first.length) else first

    def _l2_longer(self, tokens: array[int], namespace: str, partial: bool, best: int) -> Match | None:
        """L2's match if it covers more than `best` tokens (its blob is read only then)."""
        peeked = self._l2(lambda: self.l2.peek(tokens, namespace=namespace, partial=partial), None)
        if peeked is None or peeked.length <= best:
            return None
        found = self._l2(lambda: self.l2.lookup(tokens, namespace=namespace, partial=partial, touch=False), None)
        if found is not None and found.length <= best:
            found.release()
            return None
        return found

    def _copy_to_l1(self, match: Match) -> None:
        """Copy an L2 hit into L1 (generation 0: it never replaces a newer local entry)."""
        try:
            self.l1.store(match.key, match.blob, namespace=match.namespace, generation=0)
        except Exception as exc:  # a full L1 (pinned entries) never fails the lookup
            log.warning("sippcache: could not copy an L2 hit into L1 of %s: %s", self.location, exc)

    def _touch_entry(self, key: bytes, namespace: str) -> bool:
        tokens = _tokens(key)
        if self.l1.touch(tokens, namespace=namespace):
            self._submit(lambda: self.l2.touch(tokens, namespace=namespace))
            return True
        return bool(self._ordered(lambda: self.l2.touch(tokens, namespace=namespace), False))

    def _touch_prefixes(self, key: bytes, lengths: list[int], namespace: str) -> int:
        """L1's run of the chain (its touches forwarded to L2), then L2's for the lengths past it."""
        tokens = _tokens(key)
        found = self.l1.touch_prefixes(tokens, lengths, namespace=namespace)
        if found:
            self._submit(lambda: self.l2.touch_prefixes(tokens, lengths[:found], namespace=namespace))
        if found == len(lengths):
            return found
        rest = lengths[found:]
        return found + int(self._ordered(lambda: self.l2.touch_prefixes(tokens, rest, namespace=namespace), 0))

    def _delete(self, key: bytes, namespace: str) -> bool:
        tokens = _tokens(key)
        first = self.l1.delete(tokens, namespace=namespace)
        second = self._ordered(lambda: self.l2.delete(tokens, namespace=namespace), False)
        return bool(first or second)

    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool:
        tokens = _tokens(key)

        def change(backend: CacheBackend) -> bool:
            return (backend.pin if pinned else backend.unpin)(tokens, namespace=namespace)

        first = change(self.l1)
        second = self._ordered(lambda: change(self.l2), False)
        return bool(first or second)

    def _clear(self) -> None:
        self.l1.clear()
        self._ordered(self.l2.clear, None)

    def _stats(self) -> Stats:
        self._drain()
        own = dict(self._counters)
        first = self.l1.stats()
        second = self._l2(self.l2.stats, None)
        source = second if second is not None else first
        return Stats(
            backend=type(self).__name__,
            location=self.location,
            entries=source.entries,
            bytes=source.bytes,
            max_bytes=source.max_bytes,
            max_entries=source.max_entries,
            namespaces=source.namespaces,
            hits=own["hits"],
            misses=own["misses"],
            stores=own["stores"],
            evictions=source.evictions,
            refused=source.refused,
            damaged=source.damaged,
            pinned=source.pinned,
            pinned_bytes=source.pinned_bytes,
            stale=source.stale,
            errors=own["errors"] + first.errors + (second.errors if second is not None else 0),
        )

    def _len(self) -> int:
        self._drain()
        count = self._l2(lambda: len(self.l2), None)
        return len(self.l1) if count is None else count

    def _entries(self, namespace: str | None) -> list[EntryInfo]:
        self._drain()
        listed = self._l2(lambda: list(self.l2.entries(namespace)), None)
        return list(self.l1.entries(namespace)) if listed is None else listed

    def _namespaces(self) -> list[str]:
        """L2's, listed after every L2 write queued in this process (by any handle): a namespace
        another handle has just stored into is listed here too; L1's if L2 does not answer."""
        listed = self._ordered(self.l2.namespaces, None)
        return self.l1.namespaces() if listed is None else listed

    def _close(self) -> None:
        """Let queued L2 operations finish (at most `timeout`), then close both tiers."""
        try:
            self._drain()
            done = self._submit(self.l2.close, wait=self.timeout)
            if done is None or not self._lane_here().wait(done.ticket, self.timeout):
                log.warning("sippcache: L2 of %s did not finish its queued operations in time", self.location)
        finally:
            self.l1.close()
            self._lane.release()


class PersistentTieredBackend(TieredBackend):
    """A tiered cache whose tiers both persist: entries survive reopen and are shared."""

    persistent: ClassVar[bool] = True


def _shown(backend: CacheBackend, url: str) -> str:
    """A tier's URL for display: its own location when it has one (no passwords), else the scheme."""
    location = getattr(backend, "location", None)
    return location if isinstance(location, str) and "://" in location else url.split("://", 1)[0] + "://"
