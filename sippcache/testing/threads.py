"""One handle shared by many threads."""

from __future__ import annotations

import random
import threading

from sippcache import CacheBackend

from .bounded import join_all
from .fixtures import BackendFixtures


class ThreadTests(BackendFixtures):
    """Concurrent stores, lookups and deletes from threads on one handle."""

    def test_threads_share_one_instance(self, cache: CacheBackend) -> None:
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                rng = random.Random(n)
                for i in range(150):
                    key = [n, i % 20, rng.randrange(4)]
                    cache.store(key, f"{n}-{key}".encode())
                    match = cache.lookup(key + [9])
                    assert match is not None
                    with match:
                        assert bytes(match.blob) == f"{n}-{key}".encode()
                    cache.lookup([rng.randrange(8)], partial=True)
                    if i % 10 == 0:
                        cache.delete([n, rng.randrange(20), rng.randrange(4)])
            except BaseException as exc:  # reported below
                errors.append(exc)

        # Daemon threads: a deadlocked one fails the test below without keeping pytest from exiting.
        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(8)]
        for thread in threads:
            thread.start()
        join_all(threads, "8 workers storing, looking up and deleting on one handle: a deadlock")
        assert not errors, errors
        assert 0 < len(cache) <= 8 * 80
