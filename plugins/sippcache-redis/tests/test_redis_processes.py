"""Several processes, each with its own connection, share one store: what one stores,
deletes or clears is seen by the others at their next call; concurrent writers never
break generations, budgets or blobs."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time

from sippcache_redis.servers import ValkeyCluster, ValkeyServer

import sippcache
from sippcache.testing.bounded import BOUND, finish_all, read_line

_WORKER = textwrap.dedent(
    """
    import sys, sippcache
    cache = sippcache.open(sys.argv[1])
    for line in sys.stdin:
        op, *args = line.split()
        if op == "store":
            ok = cache.store([int(t) for t in args[1:]], args[0].encode())
        elif op == "delete":
            ok = cache.delete([int(t) for t in args])
        elif op == "clear":
            ok = cache.clear()
        print(op, ok, flush=True)
    cache.close()
    """
)


class Worker:
    """Another Python process holding the store open and running one command per request."""

    def __init__(self, url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, line: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = read_line(self.process, self.process.stdout, f"the answer to {line!r}")
        return answer.strip()  # once the call has returned there

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert finish_all([self.process], "exit once its stdin ends") == [0]


def _check_visibility(url: str) -> None:
    worker = Worker(url)
    try:
        with sippcache.open(url) as cache:
            assert cache.lookup([1, 2, 3]) is None  # the mirror is built before the other process writes
            assert worker.run("store from-worker 1 2 3") == "store True"
            match = cache.lookup([1, 2, 3, 4])
            assert match is not None and bytes(match.blob) == b"from-worker" and match.length == 3
            assert worker.run("store second 1 2 3 4 5") == "store True"
            assert len(cache) == 2
            assert worker.run("delete 1 2 3") == "delete True"
            assert cache.lookup([1, 2, 3, 4]) is None
            assert bytes(cache.lookup([1, 2, 3, 4, 5]).blob) == b"second"
            cache.store([9], b"mine")
            assert worker.run("clear") == "clear None"
            assert cache.lookup([1, 2, 3, 4, 5]) is None and cache.lookup([9]) is None and len(cache) == 0
    finally:
        worker.close()


def test_other_processes_see_stores_deletes_and_clears_at_once(valkey_server: ValkeyServer, prefix: str) -> None:
    _check_visibility(f"{valkey_server.url}?prefix={prefix}")


def test_the_same_on_a_cluster(valkey_cluster: ValkeyCluster, prefix: str) -> None:
    _check_visibility(f"{valkey_cluster.url}?prefix={prefix}")


_WRITER = textwrap.dedent(
    """
    import random, sys, sippcache
    url, seed = sys.argv[1], int(sys.argv[2])
    generations = list(range(seed, 400, 2))
    random.Random(seed).shuffle(generations)
    with sippcache.open(url) as cache:
        for g in generations:
            cache.store([1, 2, 3], (b"%05d" % g) * (300 + g), generation=g)   # several 1 KiB chunks
    """
)


def test_two_writers_of_one_key_keep_the_newest_generation(valkey_server: ValkeyServer, prefix: str) -> None:
    """Both processes store the same key with shuffled generations at the same time: the
    store ends with the newest one, whole (its own chunks, not a mix)."""
    url = f"{valkey_server.url}?prefix={prefix}&chunk_size=1KiB"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, url, str(seed)]) for seed in (0, 1)]
    deadline = time.monotonic() + BOUND
    with sippcache.open(url) as cache:
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline:  # read while they write
            match = cache.lookup([1, 2, 3])
            if match is not None:  # always a whole blob
                g = int(bytes(match.blob[:5]))
                assert bytes(match.blob) == (b"%05d" % g) * (300 + g)
        assert finish_all(writers, "store their 200 generations of one key and exit") == [0, 0]
        entry = next(iter(cache.entries()))
        assert entry.generation == 399
        assert bytes(cache.lookup([1, 2, 3]).blob) == b"00399" * 699
        assert cache.store([1, 2, 3], b"older", generation=398) is False


_FILLER = textwrap.dedent(
    """
    import sys, sippcache
    url, first = sys.argv[1], int(sys.argv[2])
    with sippcache.open(url) as cache:
        for i in range(first, first + 60):
            cache.store([i, i], bytes(10_000))
    """
)


def test_a_budget_holds_across_concurrent_writers(valkey_server: ValkeyServer, prefix: str) -> None:
    url = f"{valkey_server.url}?prefix={prefix}&max_bytes=200000"
    fillers = [subprocess.Popen([sys.executable, "-c", _FILLER, url, str(n * 1000)]) for n in range(3)]
    deadline = time.monotonic() + BOUND
    with sippcache.open(url) as cache:
        rng = random.Random(1)
        while any(f.poll() is None for f in fillers) and time.monotonic() < deadline:
            assert cache.stats().bytes <= 200_000
            cache.lookup([rng.randrange(3) * 1000 + rng.randrange(60)] * 2)
        assert finish_all(fillers, "store their 60 entries and exit") == [0, 0, 0]
        stats = cache.stats()
        assert stats.bytes <= 200_000 and 15 <= stats.entries <= 20
        # Evicted entries' chunks are gone from the server too.
        chunks = valkey_server.client().keys(f"{prefix}:b:*")
        assert len(chunks) == stats.entries
