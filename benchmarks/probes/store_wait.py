"""Decided: on stores whose readers see only committed data (LMDB, diskcache), a lookup is answered
beside another thread's write, not after it (a4beaa8: during a 1 GiB LMDB write 1.7 ms, was 1,230 ms;
this script: b0a84a5).

How long a request's store calls wait while another thread writes a large state.

The proxy stores a slot's state in a worker thread while other requests go on:
each asks the store where its prompt's best state is (`peek`: routing, and
whether a restore pays) and, to restore, reads it (`lookup`). One thread here
stores a synthetic state of --size (llama.cpp's format, 32 KiB a token, as in
`state_path.py`) through `ChunkedStates.store`, whole and in chunks of 64
tokens, while another calls `peek`, or `lookup` + release, on a small stored
entry every 5 ms; each call's wait is recorded. A peek answers from memory
while the writer copies bytes or commits; so does a lookup on a store whose
readers see only committed data (LMDB, diskcache: `reads_during_writes`),
reading the store beside the write. On the RAM store, whose reads would see
the write's bytes before its commit, a lookup waits for the write it is in
(one chunk, or a whole state).

Goal: the longest peek, and on LMDB and diskcache the longest lookup, during a
whole state's write at most 1% of that write. Exit status 1 if it is missed
(unless --no-goals). On an idle machine:

    python -m benchmarks.probes.store_wait [--size 1G] [--backends lmdb,diskcache,ram] [--no-goals]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import sippcache
from benchmarks.state_path import KV_BYTES_PER_TOKEN, SLOT_VERSION, parse_size, synthetic_state
from sippcache.state import chunks

URLS = {
    "lmdb": "lmdb://{dir}/store?max_bytes=64GiB&sync=false",
    "diskcache": "diskcache://{dir}/store?max_bytes=64GiB",
    "ram": "ram://?max_bytes=64GiB",
}
GOAL = 0.01  # the longest wait, as a share of the whole state's write


def waits_during_store(
    url: str, state: bytes, key: tuple[int, ...], chunk_tokens: int, call: str
) -> tuple[float, list[float], bool]:
    """Store `state` under `key` in one thread while another makes `call` every 5 ms: the store's
    seconds, every call's, and whether the goal holds for the call on this store."""
    with sippcache.open(url) as cache:
        cache.store((1, 2, 3), b"a small entry", namespace="n")
        states = chunks.ChunkedStates(cache, fingerprint="bench", kind="bench", chunk_tokens=chunk_tokens)
        done, waits = threading.Event(), []

        def ask() -> None:
            while not done.is_set():
                started = time.perf_counter()
                if call == "peek":
                    cache.peek((1, 2, 3, 4), namespace="n")
                else:
                    match = cache.lookup((1, 2, 3, 4), namespace="n")
                    assert match is not None, "the small entry is gone"
                    match.release()
                waits.append(time.perf_counter() - started)
                time.sleep(0.005)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        started = time.perf_counter()
        states.store(key, state, namespace="n", header=False, version=SLOT_VERSION)
        took = time.perf_counter() - started
        done.set()
        asker.join(60)
        goal = call == "peek" or bool(getattr(cache, "reads_during_writes", False))
    return took, waits, goal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="the state's size (1G)")
    parser.add_argument("--backends", default="lmdb,diskcache,ram", help=f"of {', '.join(URLS)}")
    parser.add_argument("--no-goals", action="store_true", help="report only: exit 0 whatever the waits")
    args = parser.parse_args()
    size = parse_size(args.size)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in backends if b not in URLS]:
        parser.error(f"unknown backends {', '.join(unknown)}")
    n_tokens = max(128, size // KV_BYTES_PER_TOKEN)
    state = synthetic_state(n_tokens, seed=1)
    key = tuple(range(3, n_tokens + 3))
    root = tempfile.mkdtemp(prefix="sippcache-store-wait-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    print(f"a {len(state) / 2**20:,.0f} MiB state ({n_tokens:,} tokens); store in {root}")
    print(
        f"{'store':<9} {'stored as':<14} {'call':<7} {'write ms':>9} {'calls':>6} {'longest ms':>11} {'median ms':>10}"
    )
    missed = []
    try:
        for name in backends:
            for chunk_tokens in (0, 64):
                for call in ("peek", "lookup"):
                    where = tempfile.mkdtemp(dir=root)
                    took, waits, goal = waits_during_store(URLS[name].format(dir=where), state, key, chunk_tokens, call)
                    shutil.rmtree(where)
                    longest = max(waits) if waits else 0.0
                    shape = "whole" if not chunk_tokens else f"chunks of {chunk_tokens}"
                    print(
                        f"{name:<9} {shape:<14} {call:<7} {took * 1e3:>9,.0f} {len(waits):>6} "
                        f"{longest * 1e3:>11,.1f} {statistics.median(waits) * 1e3 if waits else 0:>10,.2f}"
                    )
                    if goal and not chunk_tokens and longest > GOAL * took:
                        missed.append(
                            f"{name}: the longest {call} waited {longest * 1e3:,.1f} ms of a {took * 1e3:,.0f} ms write"
                        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in missed:
        print(f"{'MISS (--no-goals)' if args.no_goals else 'FAIL'}: {line} (goal: at most {GOAL:.0%})")
    if not missed:
        print(
            f"PASS: every peek, and every lookup where the store reads during writes, waited at most {GOAL:.0%}"
            " of a whole state's write"
        )
    return 1 if missed and not args.no_goals else 0


if __name__ == "__main__":
    sys.exit(main())
