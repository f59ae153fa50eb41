"""A background writer: framing and storing off the caller's thread.

The llama context is not thread-safe, so the state is copied on the calling
thread; everything after that (hashing, framing, the store's write
transaction) happens here. The queue is bounded, so a slow store applies
back-pressure instead of growing memory. A failing store logs and drops the
entry: caching must never fail the request. On Linux the thread runs at a
lower scheduling priority (nice +10), so on a machine whose cores all run
llama.cpp it writes in the gaps instead of slowing the next tokens.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sippcache")

_STOP = object()


class BackgroundWriter:
    """Runs `write(item)` for each submitted item on one daemon thread, in order."""

    def __init__(self, write: Callable[[Any], None], *, max_pending: int = 4, name: str = "sippcache-writer") -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self._write = write
        self._max_pending, self._name = max_pending, name
        self.failures = 0
        self._closed = False
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self._max_pending)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> None:
        """Queue `item`; blocks while `max_pending` items are already waiting."""
        if self._closed:
            raise RuntimeError("the background writer is closed")
        if self._pid != os.getpid():  # a forked child has no writer thread: start its own
            self._start()
        self._queue.put(item)

    def flush(self) -> None:
        """Wait until every submitted item has been written (or has failed)."""
        if self._pid == os.getpid():
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread (idempotent)."""
        self._closed = True
        if self._pid == os.getpid() and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        _lower_priority_of_this_thread()
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(item)
            except Exception as exc:
                self.failures += 1
                log.warning("sippcache: could not store a cache entry: %s: %s", type(exc).__name__, exc)
            finally:
                self._queue.task_done()


#: How much lower the writer thread's scheduling priority is (added to its nice value).
NICE_INCREMENT = 10


def _lower_priority_of_this_thread() -> None:
    """Raise this thread's nice value (Linux: per thread; elsewhere it would be the
    whole process's, so nothing is done)."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE_INCREMENT))
    except OSError as exc:  # a sandbox may forbid it: write at normal priority
        log.debug("sippcache: could not lower the writer thread's priority: %s", exc)
