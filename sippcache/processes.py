"""Whether a process still exists: files named with a process id (a download's partial file, a
proxy's slot files) are removed once their process is gone, never while it runs."""

from __future__ import annotations

import os

__all__ = ["process_exists"]


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
