"""Persistent backends: a store shared with other processes, which see each
other's writes without reopening.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import sippcache
from sippcache import CacheBackend

from .bounded import finish_all
from .fixtures import BackendFixtures, blob_of

_CHILD = textwrap.dedent(
    """
    import sys, sippcache
    url, action, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with sippcache.open(url) as cache:
        for i in range(first, first + count):
            if action == "store":
                cache.store([42, i], b"from-child-%d" % i)
            else:
                assert cache.delete([42, i])
    """
)


def run_in_child(url: str, action: str, first: int, count: int) -> subprocess.Popen[bytes]:
    """Start another Python process that stores (or deletes) keys [42, i] in the store at `url`."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sippcache.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", _CHILD, url, action, str(first), str(count)], env=env)


def _wait(*children: subprocess.Popen[bytes]) -> None:
    """Every child ended, and ended well. One still running after `BOUND` seconds (a
    deadlock) fails the test, and every child is killed: a hang is never a result."""
    codes = finish_all(children, "store or delete its keys and exit")
    for child, code in zip(children, codes, strict=True):
        assert code == 0, f"child process {child.pid} exited with {code}"


class ProcessTests(BackendFixtures):
    """For backends whose `persistent` is True: child processes writing the same store.

    The children open the store by URL in a fresh interpreter, so the backend
    must be installed (an entry point): a `register_backend` made in the test
    process does not reach them.
    """

    def test_generations_hold_across_processes(self, cache_url: str, cache: CacheBackend) -> None:
        cache.store([42, 0], b"newer", generation=2**62)
        _wait(run_in_child(cache_url, "store", 0, 3))  # generation: the child's clock, older
        assert blob_of(cache.lookup([42, 0])) == b"newer"
        assert blob_of(cache.lookup([42, 1])) == b"from-child-1"

    def test_other_process_writes_are_visible_without_reopening(self, cache_url: str, cache: CacheBackend) -> None:
        cache.store([1], b"mine")
        assert cache.lookup([42, 0]) is None
        _wait(run_in_child(cache_url, "store", 0, 5))
        assert blob_of(cache.lookup([42, 3, 7])) == b"from-child-3"
        assert len(cache) == 6
        _wait(run_in_child(cache_url, "delete", 0, 2))
        assert cache.lookup([42, 0]) is None
        assert len(cache) == 4
        assert blob_of(cache.lookup([1])) == b"mine"

    def test_concurrent_writer_processes(self, cache_url: str, cache: CacheBackend) -> None:
        children = [run_in_child(cache_url, "store", n * 100, 40) for n in range(3)]
        for i in range(40):
            cache.store([43, i], b"parent")
        _wait(*children)
        assert len(cache) == 160
        for n in range(3):
            for i in range(n * 100, n * 100 + 40, 13):
                assert blob_of(cache.lookup([42, i])) == b"from-child-%d" % i
