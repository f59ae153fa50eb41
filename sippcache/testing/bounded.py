"""Bounded waits, for the conformance suite and any backend's own tests: a test waiting on
a child process, one of its pipes or a thread gives up after a bound, kills the child it
waited for and fails saying what it waited for.

A hang is never a test result. Started from a background job (SIGINT ignored, no
stdin), sippcache's suite once waited 13 minutes on a child that could not die of the
signal the test sent (issue 24); with these, such a child is a failure with a message.
The bounds only turn a hang into a failure: nothing here asserts a speed.

Every helper takes `what`, the thing the test waited for, named in the failure, and
`seconds`, the bound (`BOUND` unless given)::

    from sippcache.testing.bounded import finish, read_line

    child = subprocess.Popen([...], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert read_line(child, child.stdout, 'its first line ("ready")') == "ready\\n"
    stdout, stderr = finish(child, "exit once its input ends")

- `kill`: kill a child if it still runs, and reap it.
- `finish`: wait for a child to exit, reading the rest of its pipes.
- `finish_all`: wait for several children to exit; an overrun kills them all.
- `wait_forked`: wait for a child made with ``os.fork()``.
- `read_line`: read the next line of a child's pipe.
- `join_all`: join threads (daemon threads, so one left running cannot keep the test
  process from exiting).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from typing import IO, Any, AnyStr

__all__ = ["BOUND", "finish", "finish_all", "join_all", "kill", "read_line", "wait_forked"]

#: Seconds a test waits for a child or a thread that should be done in a few: generous,
#: for a loaded machine.
BOUND = 120.0


def _tail(output: str | bytes | None, chars: int = 2000) -> str:
    text = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
    return text[-chars:]


def kill(child: subprocess.Popen[Any], seconds: float = BOUND) -> None:
    """Kill `child` if it still runs, and reap it."""
    if child.poll() is None:
        child.kill()
    try:
        child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process {child.pid} still there {seconds:g} s after SIGKILL") from None


def finish(child: subprocess.Popen[Any], what: str, seconds: float = BOUND) -> tuple[Any, Any]:
    """Wait for `child` to exit, reading the rest of its pipes: (stdout, stderr), as
    ``communicate`` returns them. If it still runs after `seconds`, kill it and fail
    saying `what` it was expected to do, with the end of its stderr.

    Like ``communicate``, it closes the child's stdin if the test made a pipe of it
    with ``stdin=PIPE``: a child that must not see its stdin end gets a pipe the test
    owns (``os.pipe()``) instead."""
    try:
        return child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        child.kill()
        try:
            _, stderr = child.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:  # a grandchild holds its pipes open
            stderr = None
        raise AssertionError(
            f"process {child.pid} still running after {seconds:g} s (expected: {what}); killed it. "
            f"Its stderr ends:\n{_tail(stderr)}"
        ) from None


def finish_all(children: Iterable[subprocess.Popen[Any]], what: str, seconds: float = BOUND) -> list[int]:
    """Every child's exit code, in order, once all have exited (`seconds` in all). If one
    still runs then, kill every child and fail saying `what` they were expected to do.

    It waits without reading the children's pipes: a child with ``stdout=PIPE`` that
    writes more than a pipe holds needs `finish`."""
    children = list(children)
    deadline = time.monotonic() + seconds
    codes = []
    for child in children:
        try:
            codes.append(child.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in children:
                kill(other)
            raise AssertionError(
                f"process {child.pid} still running after {seconds:g} s (expected: {what}); "
                f"killed {'it' if len(children) == 1 else f'all {len(children)}'}"
            ) from None
    return codes


def wait_forked(pid: int, what: str, seconds: float = BOUND) -> int:
    """The exit code of the forked child `pid`. If it still runs after `seconds`, SIGKILL
    it and fail saying `what` it was expected to do (a fork test's deadlock is a failure)."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # SIGKILL cannot be caught or ignored: it is gone at once
            raise AssertionError(f"forked child {pid} still running after {seconds:g} s (expected: {what}); killed it")
        time.sleep(0.01)


def read_line(child: subprocess.Popen[Any], stream: IO[AnyStr], what: str, seconds: float = BOUND) -> AnyStr:
    """The next line of `stream`, a pipe from `child` ("" or b"" at its end). If none comes
    within `seconds`, kill `child` and fail saying `what` line was awaited.

    The read runs in a daemon thread: after a failure it ends when the killed child's
    pipe closes, and it never keeps the test process from exiting."""
    lines: queue.Queue[AnyStr] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=seconds)
    except queue.Empty:
        kill(child)
        raise AssertionError(
            f"process {child.pid} wrote no line in {seconds:g} s (expected: {what}); killed it"
        ) from None


def join_all(threads: Iterable[threading.Thread], what: str, seconds: float = BOUND) -> None:
    """Wait for every thread, `seconds` in all; fail naming the ones still running.

    Threads a test waits on this way must be daemon threads, so that one still running
    after the failure does not keep the test process from exiting."""
    threads = list(threads)
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = [thread.name for thread in threads if thread.is_alive()]
    assert not running, (
        f"{len(running)} of {len(threads)} threads still running after {seconds:g} s ({what}): {running}"
    )
