"""Fork: a cache opened before os.fork() works (or fails clearly) in the child, and the
parent is unharmed.

For ram, lmdb and diskcache: open, store, fork; the child looks up the
parent's entry, stores its own and exits with a code that reports success;
then the parent still works and (persistent backends) sees the child's store.
"Fails clearly" means the child's first use raises a SippcacheError saying the
cache cannot be used across fork (exit code FAILED_CLEARLY); a hang, a crash
or any other exception fails the test.
Also: fork while the parent holds a zero-copy LMDB match (the parent's bytes
must stay exactly what was stored, whatever the child does with its copy of
the match), and fork while another thread of the parent is inside the cache
(the child must not hang on a lock that thread held).

Every child leaves with os._exit and is killed if it does not finish in time.
"""

from __future__ import annotations

import gc
import os
import random
import threading
from pathlib import Path

import pytest

import sippcache
from sippcache import CacheBackend
from tests.reliability_tools import FAILED_CLEARLY, ITERATIONS, blob_version, make_blob, run_in_fork, run_verify

BACKENDS = ["ram", "lmdb", "diskcache"]
PERSISTENT = {"lmdb", "diskcache"}


def store_url(backend: str, path: Path) -> str:
    if backend == "ram":
        return "ram://?max_bytes=256MiB"
    return f"{backend}://{path}?max_bytes=256MiB"


def put(cache: CacheBackend, tokens: list[int], version: int = 0, size: int = 5000, namespace: str = "") -> bytes:
    blob = make_blob(namespace, tokens, version, size)
    cache.store(tokens, blob, namespace=namespace)
    return blob


def version_of(cache: CacheBackend, tokens: list[int], namespace: str = "") -> int | None:
    """The version stored under exactly `tokens` (every byte checked), None if absent."""
    match = cache.lookup(tokens, namespace=namespace)
    if match is None:
        return None
    with match:
        if tuple(match.key) != tuple(tokens):
            return None
        return blob_version(match.blob, namespace, tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_child_uses_a_cache_opened_before_fork(backend: str, tmp_path: Path, opened: list[CacheBackend]) -> None:
    cache = sippcache.open(store_url(backend, tmp_path / "store"))
    opened.append(cache)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5], size=200_000)
    assert version_of(cache, [1, 2, 3]) == 0

    def child() -> None:
        assert version_of(cache, [1, 2, 3]) == 0, "the child does not see the parent's entry"
        assert version_of(cache, [1, 2, 3, 4, 5]) == 0
        put(cache, [7, 7, 7], size=100_000)
        assert version_of(cache, [7, 7, 7]) == 0, "the child does not find its own store"
        put(cache, [1, 2, 3], version=1)  # an overwrite
        assert cache.delete([1, 2, 3, 4, 5])

    for round_ in range(ITERATIONS):
        code, report = run_in_fork(child)
        assert code is not None, f"the child hung; where it was stuck:\n{report}"
        assert code in (0, FAILED_CLEARLY), f"the child failed (exit {code}):\n{report}"
        # The parent still works ...
        put(cache, [9, round_])
        assert version_of(cache, [9, round_]) == 0
        assert version_of(cache, [1, 2, 3, 4, 5]) in (0, None)
        if code == FAILED_CLEARLY:  # the child could not use the cache: nothing more to see
            continue
        if backend in PERSISTENT:  # ... and sees the child's writes
            assert version_of(cache, [7, 7, 7]) == 0, "the parent does not see the child's store"
            assert version_of(cache, [1, 2, 3]) == 1, "the parent does not see the child's overwrite"
            assert version_of(cache, [1, 2, 3, 4, 5]) is None, "the parent does not see the child's delete"
            put(cache, [1, 2, 3])
            put(cache, [1, 2, 3, 4, 5], size=200_000)
        else:  # a forked ram cache is a separate copy
            assert version_of(cache, [7, 7, 7]) is None
            assert version_of(cache, [1, 2, 3]) == 0
            assert version_of(cache, [1, 2, 3, 4, 5]) == 0
    if backend in PERSISTENT:
        cache.close()
        with sippcache.open(store_url(backend, tmp_path / "store")) as again:
            assert version_of(again, [7, 7, 7]) == (0 if code == 0 else None) and version_of(again, [9, 0]) == 0
        rc, report, err = run_verify(store_url(backend, tmp_path / "store"))
        assert rc == 0 and report and not report["bad"], (rc, report, err)


@pytest.mark.parametrize("what_the_child_does", ["ignores-the-match", "drops-the-match"])
def test_fork_while_the_parent_holds_an_lmdb_match(
    what_the_child_does: str, tmp_path: Path, opened: list[CacheBackend]
) -> None:
    """The parent's zero-copy blob is a view of LMDB's map, protected by the parent's read
    transaction. Whatever the child does with its inherited copy of the match (ignore it,
    or drop it, as any child that exits normally or clears its references does), the
    parent's blob must keep its bytes while the store changes around it."""
    cache = sippcache.open(store_url("lmdb", tmp_path / "store"))
    opened.append(cache)
    held = put(cache, [1, 2, 3], size=300_000)
    match = cache.lookup([1, 2, 3, 4])
    assert match is not None and isinstance(match.blob, memoryview)

    def child() -> None:
        nonlocal match
        if what_the_child_does == "drops-the-match":
            del match  # the child's copy goes away (Match.__del__ releases it)
            gc.collect()
        assert version_of(cache, [1, 2, 3]) == 0, "the child does not see the entry"
        put(cache, [8, 8], size=50_000)

    code, report = run_in_fork(child)
    # The parent's held blob first: a wrong state is the worst failure.
    assert bytes(match.blob) == held, "the parent's held match changed while the child ran"
    # Churn: replace the held entry and write entries of the same size, so LMDB would
    # reuse its pages if the parent's snapshot were no longer protected.
    cache.delete([1, 2, 3])
    for i in range(8):
        put(cache, [50, i], size=300_000)
    intact = bytes(match.blob) == held
    match.release()
    assert intact, (
        "WRONG STATE: the parent's held LMDB match no longer holds the stored bytes after the "
        f"child ({what_the_child_does}) exited and the store changed"
    )
    assert code is not None, f"the child hung; where it was stuck:\n{report}"
    assert code in (0, FAILED_CLEARLY), f"the child failed (exit {code}):\n{report}"
    assert version_of(cache, [8, 8]) == (0 if code == 0 else None), "the parent does not see the child's store"
    rc, report, err = run_verify(store_url("lmdb", tmp_path / "store"))
    assert rc == 0 and report and not report["bad"], (rc, report, err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_while_another_thread_uses_the_cache(backend: str, tmp_path: Path, opened: list[CacheBackend]) -> None:
    """Fork while a second thread of the parent is busy in the cache (so it may hold the
    handle's lock, or be inside a transaction, at the moment of the fork): the child
    must not hang, and must be able to use the cache (or fail clearly)."""
    cache = sippcache.open(store_url(backend, tmp_path / "store"))
    opened.append(cache)
    put(cache, [1, 2, 3])
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        rng = random.Random(6)
        try:
            i = 0
            while not stop.is_set():
                put(cache, [60, i % 50], version=i, size=rng.randrange(100, 40_000))
                version_of(cache, [60, rng.randrange(50)])
                i += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    def child() -> None:
        assert version_of(cache, [1, 2, 3]) == 0, "the child does not see the entry"
        put(cache, [70, os.getpid()])
        assert version_of(cache, [70, os.getpid()]) == 0

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    results: list[tuple[int | None, str]] = []
    try:
        for _ in range(10 * ITERATIONS):  # stop at the first failure: a hung child costs 20 s
            results.append(run_in_fork(child, timeout=20))
            if results[-1][0] not in (0, FAILED_CLEARLY):
                break
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "the parent's busy thread hung"
    assert not errors, f"the parent's busy thread failed: {errors[0]!r}"
    code, report = results[-1]
    assert code is not None, f"child {len(results)} hung; where it was stuck:\n{report}"
    assert code in (0, FAILED_CLEARLY), f"child {len(results)} failed (exit {code}):\n{report}"
    assert version_of(cache, [1, 2, 3]) == 0


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_child_opens_its_own_handle_on_a_store_the_parent_has_open(
    backend: str, tmp_path: Path, opened: list[CacheBackend]
) -> None:
    """The worker pattern: the parent keeps the store open, each forked child opens it anew."""
    url = f"{backend}://{tmp_path}/store"
    parent = sippcache.open(url)
    opened.append(parent)
    parent.store([1, 2, 3], b"from the parent")

    def child() -> None:
        with sippcache.open(url) as own:
            match = own.lookup([1, 2, 3])
            assert match is not None and bytes(match.blob) == b"from the parent"
            match.release()
            own.store([7, 7, 7], b"from the child")

    code, report = run_in_fork(child)
    assert code == 0, report
    match = parent.lookup([7, 7, 7])
    assert match is not None and bytes(match.blob) == b"from the child"
    match.release()
