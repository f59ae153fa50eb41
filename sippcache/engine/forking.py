"""Keeping open stores usable across `os.fork`.

An SQLite or LMDB lock copied into a child in the middle of a transaction
wedges the child, so a fork waits until no backend is inside an operation:
before it, every open backend's lock is taken (then every registered inner
lock, in the order operations take them), and the child gets fresh locks and
rebuilds each index from the store on its next use.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class ForkAware(Protocol):
    """An open backend as the fork handlers see it."""

    def _hold_for_fork(self) -> None:
        """Wait until no operation runs, and keep new ones out (its lock)."""

    def _resume_after_fork(self) -> None:
        """In the parent: let operations run again."""

    def _renew_after_fork(self) -> None:
        """In the child: replace the lock, and rebuild the index on the next use."""


_open_backends: weakref.WeakSet[ForkAware] = weakref.WeakSet()

# Module-level locks taken inside backend operations: (get the lock, replace it in a child).
_inner_locks: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []


def hold_across_forks(backend: ForkAware) -> None:
    """Hold `backend` still across every fork while it is alive (any backend with a
    lock around its operations: the KV engine's, the Redis plugin's)."""
    _open_backends.add(backend)


def fork_safe_lock(get: Callable[[], Any], replace: Callable[[Any], None]) -> None:
    """Register a module-level lock that backend operations take (after their own
    lock): it is held across fork, like the backend locks, and renewed in the child."""
    _inner_locks.append((get, replace))


def _before_fork() -> None:
    """Fork only between operations. Locks are taken in the order operations
    take them: backends first, then inner locks."""
    for backend in sorted(_open_backends, key=id):
        backend._hold_for_fork()
    for get, _ in _inner_locks:
        get().acquire()


def _after_fork_in_parent() -> None:
    for get, _ in reversed(_inner_locks):
        get().release()
    for backend in sorted(_open_backends, key=id):
        backend._resume_after_fork()


def _after_fork_in_child() -> None:
    for _, replace in _inner_locks:
        replace(threading.Lock())
    for backend in list(_open_backends):
        backend._renew_after_fork()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
