"""Helper threads for byte work: gathering a transposed V, checking checksums while a state is
written. numpy's copies and xxhash let go of the GIL, so a few threads use the cores a single
Python thread leaves idle. One small pool per kind of work, made on first use and made again in
a forked child (whose copy of the parent's pool has no threads)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["all_true", "pool"]

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The pool of `workers` threads for the work called `name` (the first call's count holds)."""
    with _lock:
        found = _pools.get(name)
        if found is None:
            found = _pools[name] = ThreadPoolExecutor(max(1, workers), thread_name_prefix=f"sippcache-{name}")
        return found


def all_true(futures: Sequence[Future[bool]]) -> Future[bool]:
    """One future for work shared among threads: True once every one of `futures` gave True,
    False if one gave False, the first exception if one raised (each is waited for first)."""
    if len(futures) == 1:
        return futures[0]
    combined: Future[bool] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Future[bool]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            combined.set_result(all([f.result() for f in futures]))
        except BaseException as exc:
            combined.set_exception(exc)

    for future in futures:
        future.add_done_callback(done)
    return combined


def _forget() -> None:
    """In a forked child the parent's threads are gone: make new pools when needed."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
