"""Whether a process still exists: files named with a process id (a download's partial file, a
proxy's slot files) are removed once their process is gone, never while it runs."""

from __future__ import annotations

import os

__all__ = ["process_exists", "process_started", "written_by_a_live_process"]

#: A file changed up to this long before its pid's process started is still taken as that
#: process's (its start time is known to a clock tick, and a clock may step).
START_SLACK_SECONDS = 2.0


def process_exists(pid: int) -> bool:
    """Whether a process `pid` exists (this user's or another's)."""
    if pid <= 0:  # not a process: kill(0, ...) would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid can be
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_started(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch, where /proc says (Linux); else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            booted = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22, starttime: after "pid (comm) "
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def written_by_a_live_process(pid: int, changed: float) -> bool:
    """Whether a file named with `pid` and last changed at `changed` (its mtime) may belong to a
    running process: one with that pid exists, and did not start after the file last changed (a
    process that did is another that was given the pid again: in a container, each start of a
    proxy may get the same pid)."""
    if not process_exists(pid):
        return False
    started = process_started(pid)
    return started is None or changed >= started - START_SLACK_SECONDS
