"""Decided: the proxy makes a staging file ahead in 2 MiB slices with the GIL let go between
(`buffers.populate`, 9daf89c; `StagingFile.reserve`'s 64 MiB steps, d32bec6), not in one
``mmap(MAP_POPULATE)`` call (measured here, fef10ee: 1 GiB stopped the loop 551 ms that way, 7.3 ms now).

How long the proxy's event loop stops while its worker threads move state bytes.

The proxy serves every client from one asyncio event loop and moves state bytes
(slot files, staging files, the store) in worker threads. A worker that holds
the GIL through one long call stops the loop for that long: every stream it
relays stands still. On an H200 host a restarted proxy's first request took
350-580 ms more than llama-server's prompt time; making a 1 GiB staging file
ahead with one ``mmap(MAP_POPULATE)`` call held the GIL throughout.

A ticker thread sleeps 0.5 ms at a time and notes the longest gap between its
wake-ups (what the event loop would see) while, in the same process, one of
these runs in another thread:

- making a staging file ahead, one ``mmap(MAP_POPULATE)`` call (before 2026-11-28);
- making it ahead as the proxy does now (`StagingFile.reserve`: 64 MiB allocation
  steps, then `sippcache.state.buffers.populate`'s 2 MiB slices);
- `SlotStore.keep` of a llama-server slot file into LMDB, in chunks of 64 tokens;
- `SlotStore._stage` of that state back into a staging file.

The two ways of making a file alternate, `--rounds` times; medians are printed.
Goal: the proxy's way stops the loop for at most 50 ms (exit status 1 if not).

    python -m benchmarks.probes.event_loop_stall                  # 1 GiB, 3 rounds, files in /dev/shm
    python -m benchmarks.probes.event_loop_stall --size 256M --rounds 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import sippcache
from benchmarks.state_path import SLOT_VERSION, parse_size, show_size, synthetic_state
from sippcache.proxy import slotfile
from sippcache.proxy.store import SlotStore, Snapshot, StagingFile

GOAL_MS = 50.0
TOKEN_BYTES = 32 * 1024  # an 8B-class model's KV a token (32 KiB: 32,768 tokens in 1 GiB)


def longest_stop(work: Callable[[], object]) -> tuple[float, float]:
    """(ms `work` took, the longest gap in ms a 0.5 ms sleeper thread saw meanwhile)."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    started = time.perf_counter()
    try:
        work()
    finally:
        took = time.perf_counter() - started
        time.sleep(0.02)
        done.set()
        ticker.join()
    return took * 1000, max(gaps) * 1000


def in_worker(work: Callable[[], object]) -> Callable[[], None]:
    """`work` run in a worker thread, waited for (as the proxy runs it: asyncio.to_thread)."""

    def run() -> None:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()

    return run


def one_call(path: str, size: int) -> None:
    """The staging file made ahead before 2026-11-28: allocated, then mapped with MAP_POPULATE."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        mapping.close()
    finally:
        os.close(fd)


def sliced(path: str, size: int) -> None:
    staging = StagingFile(path)
    assert staging.reserve(size)
    staging._unmap()  # the file stays; the mapping goes (as for the other way)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="the state's size (default 1G)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where the files go")
    args = parser.parse_args()
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="sippcache-stall-", dir=args.dir)
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        for _ in range(args.rounds):
            for name, make in (("one mmap(MAP_POPULATE) call (before)", one_call), ("StagingFile.reserve", sliced)):
                path = os.path.join(root, "ahead.slot")
                rows.setdefault(f"staging file made ahead: {name}", []).append(
                    longest_stop(in_worker(lambda make=make, path=path: make(path, size)))
                )
                os.unlink(path)
        n = max(64, size // TOKEN_BYTES)
        state = synthetic_state(n, 1)
        tokens = tuple(range(1, n + 1))
        staging = os.path.join(root, "staging")
        os.makedirs(staging)
        with sippcache.open(f"lmdb://{root}/store?sync=false") as cache:
            slots = SlotStore(cache, fingerprint="bench", facts={}, kind="full", staging=staging, min_tokens=16)
            namespace = slots.namespace("bench")
            for i in range(args.rounds):
                path = os.path.join(staging, "save.slot")
                with open(path, "wb") as f:
                    for part in slotfile.build(SLOT_VERSION, tokens, state):
                        f.write(part)
                snapshot = Snapshot(path, tokens, n, time.perf_counter())
                rows.setdefault("SlotStore.keep (LMDB, chunks of 64)", []).append(
                    longest_stop(in_worker(lambda snapshot=snapshot: slots.keep(snapshot, None, "bench")))
                )
                out = os.path.join(staging, "restore.slot")
                rows.setdefault("SlotStore._stage (a restore)", []).append(
                    longest_stop(in_worker(lambda out=out: slots._stage(tokens, namespace, out)))
                )
                if i < args.rounds - 1:
                    cache.delete(tokens, namespace=namespace)
            slots.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"a state of {show_size(size)}, files in {args.dir or tempfile.gettempdir()}; medians of {args.rounds}")
    print(f"{'work in a worker thread':<62} {'took ms':>9} {'longest stop ms':>16}")
    for name, samples in rows.items():
        took = statistics.median(t for t, _ in samples)
        stop = statistics.median(s for _, s in samples)
        print(f"{name:<62} {took:>9,.1f} {stop:>16,.1f}")
    ours = statistics.median(s for _, s in rows["staging file made ahead: StagingFile.reserve"])
    verdict = "PASS" if ours <= GOAL_MS else "MISS"
    print(f"{verdict}: a staging file made ahead stops the event loop {ours:.1f} ms at most (goal <= {GOAL_MS:.0f} ms)")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
