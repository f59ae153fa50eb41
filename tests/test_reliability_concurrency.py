"""Concurrency: 4 processes x 8 threads doing mixed stores, lookups and deletes on one store.

Every thread of every process shares its process's ONE cache instance. Each
thread owns its keys and remembers what it last stored or deleted under each,
so every lookup of an own key has exactly one right answer; lookups of other
threads' keys (prefix and partial) must return self-consistent blobs for the
key they name. Checked, for one LMDB and one diskcache store:

- no exception in any worker;
- no acknowledged entry lost, and no deleted or older version coming back
  (max_bytes far above the data, so nothing may be evicted);
- with a small max_bytes (lots of evictions): stats().bytes and the sum of
  entries() sizes stay within max_bytes at checkpoints and at the end, a key
  may be missing only if the store evicted, and what is there is the last
  version stored;
- no deadlock: every process finishes within 120 s, or it is killed (after
  dumping every thread's stack) and the test fails.

SIPPCACHE_SLOW_TESTS=1 runs ten rounds of processes on the same store.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diskcache
import pytest

import sippcache
from sippcache.backends.diskcache import BytesOnlyDisk, DiskCacheBackend
from sippcache.backends.lmdb import LMDBBackend
from sippcache.backends.ram import RAMBackend
from sippcache.engine import KVBackend, KVTxn
from sippcache.engine.layout import PREFIX_BLOB
from sippcache.testing.bounded import join_all
from tests.reliability_tools import (
    DEADLOCK_SECONDS,
    ITERATIONS,
    KEYS_PER_THREAD,
    blob_version,
    read_text,
    run_verify,
    spawn,
    wait_all,
    worker_key,
)

PROCESSES = 4
THREADS = 8
#: Operations per thread and round; SIPPCACHE_SLOW_TESTS=1 runs ITERATIONS rounds, each
#: with its own processes and keys, on the same store (each round bounded by the deadlock limit).
OPS = 300
LARGE = 1024**3
SMALL = 1024**2


def store_url(backend: str, path: Path, max_bytes: int) -> str:
    return f"{backend}://{path}?max_bytes={max_bytes}"


def run_workers(url: str, tmp_path: Path, bounded: bool, seed: int, round_: int) -> list[dict]:
    """Start the worker processes of one round (each round has its own keys), wait for
    them (bounded), return their reports."""
    procs, outs, errs = [], [], []
    for proc in range(round_ * PROCESSES, (round_ + 1) * PROCESSES):
        out = tmp_path / f"worker-{proc}.json"
        err = tmp_path / f"worker-{proc}.stderr"
        with open(err, "wb") as stderr, open(tmp_path / f"worker-{proc}.stdout", "wb") as stdout:
            procs.append(
                spawn(
                    "concurrency-worker", url, proc, seed, OPS, THREADS, int(bounded), out, stdout=stdout, stderr=stderr
                )
            )
        outs.append(out)
        errs.append(err)
    codes = wait_all(procs, DEADLOCK_SECONDS)
    hung = [i for i, code in enumerate(codes) if code is None]
    assert not hung, (
        f"round {round_}: processes {hung} did not finish within {DEADLOCK_SECONDS:.0f} s (deadlock?):\n"
        + "\n".join(f"--- process {i} stderr:\n{read_text(errs[i])}" for i in hung)
    )
    failed = [i for i, code in enumerate(codes) if code != 0 or not outs[i].exists()]
    assert not failed, "\n".join(f"--- process {i} exited with {codes[i]}:\n{read_text(errs[i])}" for i in failed)
    reports = [json.loads(out.read_text()) for out in outs]
    errors = [e for report in reports for e in report["errors"]]
    assert not errors, f"{len(errors)} exceptions in workers; the first ones:\n" + "\n".join(errors[:5])
    return reports


def final_state(url: str) -> tuple[dict[str, int | None], list[tuple[str, tuple[int, ...]]], sippcache.Stats, int]:
    """(keyid -> version found, listed keys, stats, sum of entry sizes) through a fresh handle."""
    seen: dict[str, int | None] = {}
    with sippcache.open(url) as cache:
        for proc in range(ITERATIONS * PROCESSES):
            for thread in range(THREADS):
                for k in range(KEYS_PER_THREAD):
                    namespace, tokens = worker_key(proc, thread, k)
                    match = cache.lookup(tokens, namespace=namespace)
                    if match is None:
                        seen[f"{proc}.{thread}.{k}"] = None
                        continue
                    with match:
                        assert tuple(match.key) == tuple(tokens), "a lookup returned a longer or other key"
                        seen[f"{proc}.{thread}.{k}"] = blob_version(match.blob, namespace, tokens)
        listed = list(cache.entries())
        stats = cache.stats()
    return seen, [(e.namespace, tuple(e.key)) for e in listed], stats, sum(e.size for e in listed)


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_processes_and_threads_lose_nothing(backend: str, tmp_path: Path) -> None:
    url = store_url(backend, tmp_path / "store", LARGE)
    reports = [r for round_ in range(ITERATIONS) for r in run_workers(url, tmp_path, False, 1, round_)]
    model = {k: v for report in reports for k, v in report["models"].items()}
    assert sum(report["evictions"] for report in reports) == 0
    seen, listed, stats, listed_bytes = final_state(url)
    wrong = {k: (v, seen[k]) for k, v in model.items() if seen[k] != v}
    assert not wrong, (
        f"{len(wrong)} keys differ from what their owner last did (expected, found): {dict(list(wrong.items())[:10])}"
    )
    unknown = {k for k, v in seen.items() if v is not None and k not in model}
    assert not unknown, f"entries nobody stored: {unknown}"
    present = sum(1 for v in seen.values() if v is not None)
    assert len(listed) == stats.entries == present
    assert stats.bytes == listed_bytes
    rc, report, err = run_verify(url)
    assert rc == 0 and report and not report["bad"] and report["checked"] == present, (rc, report, err)


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_processes_and_threads_stay_within_a_small_budget(backend: str, tmp_path: Path) -> None:
    url = store_url(backend, tmp_path / "store", SMALL)
    reports = [r for round_ in range(ITERATIONS) for r in run_workers(url, tmp_path, True, 2, round_)]
    model = {k: v for report in reports for k, v in report["models"].items()}
    evictions = sum(report["evictions"] for report in reports)
    checkpoints = sum(report["counts"]["checkpoints"] for report in reports)
    assert checkpoints >= PROCESSES * THREADS, "the workers checked the budget too rarely"
    assert evictions > 0, "the small budget never evicted: the test does not test eviction"
    seen, _listed, stats, listed_bytes = final_state(url)
    assert stats.bytes <= SMALL and listed_bytes <= SMALL, (stats.bytes, listed_bytes)
    assert stats.bytes == listed_bytes
    resurrected = {k: (v, seen[k]) for k, v in model.items() if seen[k] is not None and seen[k] != v}
    assert not resurrected, f"keys holding a version other than the last stored (last, found): {resurrected}"
    missing = [k for k, v in model.items() if v is not None and seen[k] is None]
    assert len(missing) <= evictions, f"{len(missing)} entries missing but only {evictions} evictions"
    rc, report, err = run_verify(url)
    assert rc == 0 and report and not report["bad"], (rc, report, err)


class _FolderThief(BytesOnlyDisk):
    """A diskcache disk whose value folder is removed right after it is made, as another
    process's `remove` (os.removedirs of the folders it emptied) does at the worst moment."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.thefts = 3

    def _make_folders(self, target: str) -> None:
        super()._make_folders(target)
        if self.thefts:
            self.thefts -= 1
            os.removedirs(target)


def test_a_diskcache_value_folder_removed_by_another_process_is_made_again(tmp_path: Path) -> None:
    """Seen in CI: a store failed with FileNotFoundError when a concurrent delete emptied
    and removed the folder its value file was about to be created in."""
    cache = diskcache.Cache(str(tmp_path / "store"), disk=_FolderThief, eviction_policy="none")
    try:
        value = b"x" * 100_000  # above diskcache's inline limit: a value file
        cache.set(b"key", value)
        assert cache.disk.thefts == 0, "the folder was never taken: the test tests nothing"
        assert cache.get(b"key") == value
    finally:
        cache.close()


class _HeldWrites(KVBackend):
    """A store whose writes of an entry's bytes wait for `go` once `hold` is set: a large
    state's copy into LMDB, stretched for as long as the test needs. With `hold_start` set, a
    write transaction first waits for `start` (the handle's lock held, memory about to change);
    with `hold_commit`, it waits for `resume` once committed (memory not yet in step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold, self.writing, self.go = threading.Event(), threading.Event(), threading.Event()
        self.hold_start, self.starting, self.start = threading.Event(), threading.Event(), threading.Event()
        self.hold_commit, self.committed, self.resume = threading.Event(), threading.Event(), threading.Event()

    @contextmanager
    def _transaction(self) -> Iterator[KVTxn]:
        if self.hold_start.is_set():
            self.starting.set()
            assert self.start.wait(120), "the test never let the write start"
        with super()._transaction() as txn:
            put = txn.put

            def put_slowly(key: bytes, value: Any) -> None:
                if key.startswith(PREFIX_BLOB) and self.hold.is_set():
                    self.writing.set()
                    assert self.go.wait(120), "the test never let the write go on"
                put(key, value)

            txn.put = put_slowly  # type: ignore[method-assign]
            yield txn
        if self.hold_commit.is_set():
            self.committed.set()
            assert self.resume.wait(120), "the test never let the write finish"


class _SlowWrites(_HeldWrites, RAMBackend):
    pass


class _SlowLMDB(_HeldWrites, LMDBBackend):
    pass


class _SlowDiskCache(_HeldWrites, DiskCacheBackend):
    pass


def _held_store(backend: str, tmp_path: Path) -> _HeldWrites:
    if backend == "ram":
        return _SlowWrites()
    return (_SlowLMDB if backend == "lmdb" else _SlowDiskCache)(str(tmp_path / "store"))


def _write_in_background(cache: _HeldWrites) -> threading.Thread:
    """Store b"a large state" under (1, 2, 3, 4, 5) in namespace "n" on another thread (held
    where the test set `cache`'s holds), started."""
    writer = threading.Thread(
        target=cache.store, args=((1, 2, 3, 4, 5), b"a large state"), kwargs={"namespace": "n"}, daemon=True
    )
    writer.start()
    return writer


def test_a_peek_is_answered_while_another_thread_writes_an_entry() -> None:
    """`peek` (the proxy's routing and restore decisions) reads memory while another thread's
    store copies an entry's bytes (seconds for a whole state of a gigabyte in LMDB), rather
    than waiting for it; it answers as of before that write, which it sees once committed."""
    cache = _SlowWrites()
    cache.store((1, 2, 3), b"stored before", namespace="n")
    cache.hold.set()
    writer = _write_in_background(cache)
    assert cache.writing.wait(120)
    answers: list[Any] = []
    reader = threading.Thread(target=lambda: answers.append(cache.peek((1, 2, 3, 4, 5, 6), namespace="n")), daemon=True)
    reader.start()
    try:
        join_all([reader], "a peek while another thread writes an entry", 60)  # fails if peeks wait for it
    finally:
        cache.go.set()
    join_all([writer], "the store", 60)
    assert answers[0] is not None and answers[0].length == 3  # the write was not committed yet
    peek = cache.peek((1, 2, 3, 4, 5, 6), namespace="n")
    assert peek is not None and peek.length == 5


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_a_lookup_is_answered_while_another_thread_writes_an_entry(backend: str, tmp_path: Path) -> None:
    """On a store whose readers see only committed data (LMDB, SQLite's WAL), a lookup (the
    proxy's restore, another request's prefix) is answered while another thread's store copies
    an entry's bytes, as of before that write, with its hit and use counted; it sees the new
    entry once committed."""
    cache = _held_store(backend, tmp_path)
    try:
        cache.store((1, 2, 3), b"stored before", namespace="n")
        cache.store((1, 2, 3, 9), b"another", namespace="n")
        cache.hold.set()
        writer = _write_in_background(cache)
        assert cache.writing.wait(120)
        answers: list[Any] = []

        def read() -> None:
            match = cache.lookup((1, 2, 3, 4, 5, 6), namespace="n")
            answers.append(None if match is None else (match.length, bytes(match.blob)))
            chain = cache.lookup_prefixes((1, 2, 3, 9), [3, 4], namespace="n")
            answers.append([(m.length, bytes(m.blob)) for m in chain])
            answers.append(cache.lookup((7, 7), namespace="n"))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            join_all([reader], "lookups while another thread writes an entry", 60)  # fails if lookups wait for it
        finally:
            cache.go.set()
        join_all([writer], "the store", 60)
        assert answers == [(3, b"stored before"), [(3, b"stored before"), (4, b"another")], None]
        match = cache.lookup((1, 2, 3, 4, 5, 6), namespace="n")
        assert match is not None and (match.length, bytes(match.blob)) == (5, b"a large state")
        stats = cache.stats()
        assert (stats.hits, stats.misses) == (4, 1)
    finally:
        cache.close()


def test_a_lookup_waits_for_a_write_on_a_store_that_reads_uncommitted_bytes() -> None:
    """The RAM store's reads see a write's bytes before its commit: a lookup during a write
    waits for it (and then sees what it wrote), so it never returns bytes the catalog does
    not yet hold."""
    cache = _SlowWrites()
    cache.store((1, 2, 3), b"stored before", namespace="n")
    cache.hold.set()
    writer = _write_in_background(cache)
    assert cache.writing.wait(120)
    answers: list[Any] = []
    reader = threading.Thread(
        target=lambda: answers.append(cache.lookup((1, 2, 3, 4, 5, 6), namespace="n")), daemon=True
    )
    reader.start()
    reader.join(0.5)
    waited = reader.is_alive()
    cache.go.set()
    join_all([writer, reader], "the store and the lookup", 60)
    assert waited, "the lookup did not wait for the write"
    assert answers[0] is not None and (answers[0].length, answers[0].blob) == (5, b"a large state")


def test_a_lookup_that_began_before_a_writes_long_stretch_is_answered_during_it(tmp_path: Path) -> None:
    """A peek or lookup that finds the lock held while a write may still change memory waits;
    once the write reaches its entry's bytes it is answered (the waiting call polls), not after
    the write."""
    cache = _held_store("lmdb", tmp_path)
    try:
        cache.store((1, 2, 3), b"stored before", namespace="n")
        cache.hold.set()
        cache.hold_start.set()
        writer = _write_in_background(cache)
        assert cache.starting.wait(120)
        answers: list[Any] = []

        def read() -> None:
            peek = cache.peek((1, 2, 3, 4, 5, 6), namespace="n")
            match = cache.lookup((1, 2, 3, 4, 5, 6), namespace="n")
            answers.append((peek and peek.length, match and (match.length, bytes(match.blob))))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(0.5)
        waited = reader.is_alive()  # memory may be changing: no answer yet
        cache.start.set()
        assert cache.writing.wait(120)
        try:
            join_all([reader], "a peek and a lookup once the write copies its bytes", 60)
        finally:
            cache.go.set()
        join_all([writer], "the store", 60)
        assert waited, "the calls were answered while the write could still change memory"
        assert answers == [(3, (3, b"stored before"))]
    finally:
        cache.close()


def _large_blob(key: tuple[int, ...], version: int) -> bytes:
    """A blob that names its key and version, then 2 MiB that follow from them."""
    head = json.dumps({"key": list(key), "version": version}).encode().ljust(256)
    return head + bytes([(sum(key) + version) % 251]) * (2 * 1024**2)


def _check_large(match: Any) -> None:
    """A match's blob is the blob of the key it says it is (some version of it), whole."""
    blob = bytes(match.blob)
    head = json.loads(blob[:256])
    assert tuple(head["key"]) == tuple(match.key), f"a match for {tuple(match.key)} holds {head['key']}'s bytes"
    assert blob[256:] == bytes([(sum(head["key"]) + head["version"]) % 251]) * (2 * 1024**2), "a torn blob"


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_lookups_read_through_writes_evictions_and_deletes_without_a_wrong_byte(backend: str, tmp_path: Path) -> None:
    """Stress for lookups answered during another thread's write: two threads store 2 MiB
    entries under a small budget (every few stores evict) and delete some, three look up and
    look up chains; every match must hold its own key's bytes, whole. Runs until the readers
    have been answered during writes 50 times (checked by counting those answers), or 60 s."""
    url = f"{backend}://{tmp_path}/store?max_bytes=24MiB"
    cache = sippcache.open(url)
    through = [0]
    read_during_write = cache._read_during_write  # type: ignore[attr-defined]

    def counted(find: Any) -> Any:
        answer = read_during_write(find)
        if isinstance(answer, tuple):
            through[0] += 1
        return answer

    cache._read_during_write = counted  # type: ignore[attr-defined]
    stop, errors = threading.Event(), []

    def write(seed: int) -> None:
        rng = random.Random(seed)
        version = 0
        try:
            while not stop.is_set():
                key = tuple(range(1, rng.randrange(2, 12)))
                version += 1
                if rng.random() < 0.2:
                    cache.delete(key)
                else:
                    cache.store(key, _large_blob(key, version * 10 + seed))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def read(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                query = tuple(range(1, rng.randrange(2, 14)))
                if rng.random() < 0.5:
                    match = cache.lookup(query)
                    if match is not None:
                        with match:
                            _check_large(match)
                else:
                    for match in cache.lookup_prefixes(query, list(range(1, len(query) + 1))):
                        with match:
                            _check_large(match)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,), daemon=True) for i in (1, 2)]
    threads += [threading.Thread(target=read, args=(i,), daemon=True) for i in (3, 4, 5)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while through[0] < 50 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        join_all(threads, "the writers and readers", 120)
        cache.close()
    assert not errors, f"{errors[0]!r}"
    assert through[0] >= 1, "no lookup was answered during a write: the stress did not reach its path"


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_a_lookup_never_answers_from_memory_older_than_the_store_it_reads(backend: str, tmp_path: Path) -> None:
    """Between a write's commit and memory catching up, a lookup's own reader would see the new
    entry while memory does not: it waits, and answers with the new entry (a lookup that read
    memory alone there would give the shorter, older match)."""
    cache = _held_store(backend, tmp_path)
    try:
        cache.store((1, 2, 3), b"stored before", namespace="n")
        cache.hold_commit.set()
        writer = _write_in_background(cache)
        assert cache.committed.wait(120)
        answers: list[Any] = []

        def read() -> None:
            match = cache.lookup((1, 2, 3, 4, 5, 6), namespace="n")
            answers.append(match and (match.length, bytes(match.blob)))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(0.5)
        waited = reader.is_alive()
        cache.resume.set()
        join_all([writer, reader], "the store and the lookup", 60)
        assert answers == [(5, b"a large state")]
        assert waited, "the lookup answered while memory was behind the store"
    finally:
        cache.close()
