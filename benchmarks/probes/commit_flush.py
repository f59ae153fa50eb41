"""Decided: sippcache opens LMDB with ``MDB_NOMETASYNC``, one flush a commit instead of LMDB's two
(986453c).

What LMDB's flushes cost a state stored in chunks, on a disk.

A state stored in chunks of 64 tokens is one LMDB commit a chunk (and one for its
tail): 129 for 8,192 tokens, 513 for 32,768. With ``sync=true`` (the default) each
commit flushes to disk, and a flush is the dearest step a commit has: an
``fdatasync`` on Linux, an ``F_FULLFSYNC`` (the drive's own cache too) on macOS.
LMDB flushes twice a commit by default (the pages, then the meta page that makes
them the store); sippcache opens it with ``MDB_NOMETASYNC``, one flush a commit
(the meta page goes with the next flush: an OS crash can undo the latest commit,
never corrupt the store).

Per --tokens, alternating, each a new store in --dir (default: a folder under
/var/tmp, on a disk): the same synthetic state (llama.cpp's format, 32 KiB a token,
as in `state_path.py`) stored through `ChunkedStates.store` with

- ``sync=true``, two flushes a commit (LMDB's default; sippcache before 2026-11-28),
- ``sync=true``, one flush a commit (now),
- ``sync=false``, no flush (the floor: what the flushes cost is the rest),

and the flushes' cost per commit. Goal: one flush a commit at most as slow as
two (a 5% margin for noise); exit status 1 if missed (unless --no-goals).

    python -m benchmarks.probes.commit_flush [--tokens 8192] [--repeat 5] [--dir PATH] [--no-goals]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lmdb

import sippcache
from benchmarks.state_path import SLOT_VERSION, synthetic_state
from sippcache.state.chunks import DEFAULT_CHUNK_TOKENS, ChunkedStates

#: (label, URL's sync option, LMDB's metasync): the settings, in the order they are timed.
SETTINGS = (
    ("sync, 2 flushes a commit", "true", True),
    ("sync, 1 flush a commit", "true", False),
    ("no sync", "false", False),
)

_open = lmdb.open


def opening_with(metasync: bool) -> Callable[..., Any]:
    """`lmdb.open` with `metasync` in place of sippcache's (the setting before it is timed)."""
    return lambda *args, **kwargs: _open(*args, **{**kwargs, "metasync": metasync})


def store_once(root: str, state: bytes, tokens: tuple[int, ...], sync: str, metasync: bool) -> tuple[float, int]:
    """Seconds to store `state` in a new store at `root`, and the commits that took."""
    where = tempfile.mkdtemp(dir=root)
    lmdb.open = opening_with(metasync)  # type: ignore[assignment]
    try:
        with sippcache.open(f"lmdb://{where}/store?sync={sync}") as cache:
            states = ChunkedStates(cache, fingerprint="bench", kind="state")
            started = time.perf_counter()
            stored = states.store(tokens, state, header=False, version=SLOT_VERSION)
            seconds = time.perf_counter() - started
    finally:
        lmdb.open = _open  # type: ignore[assignment]
        shutil.rmtree(where)
    if not stored.chunked:
        sys.exit("FAIL: the state was not stored in chunks")
    return seconds, stored.entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192", help="comma-separated state lengths in tokens (8192)")
    parser.add_argument("--repeat", type=int, default=5, help="stores of each setting; the median is shown (5)")
    parser.add_argument("--dir", default="/var/tmp", help="where the stores go: a disk, not a RAM disk (/var/tmp)")
    parser.add_argument("--no-goals", action="store_true", help="report only: exit 0 whatever the ratios")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="sippcache-commit-flush-", dir=args.dir)
    missed = []
    try:
        print(f"stores in {root}; chunks of {DEFAULT_CHUNK_TOKENS} tokens; medians of {args.repeat}")
        print(f"{'tokens':>7} {'MiB':>6} {'commits':>8}  " + "  ".join(f"{label:>25}" for label, _, _ in SETTINGS))
        for n_tokens in (int(n) for n in args.tokens.split(",")):
            state = synthetic_state(n_tokens, seed=1)
            times: dict[str, list[float]] = {label: [] for label, _, _ in SETTINGS}
            commits = 0
            for i in range(args.repeat):
                for label, sync, metasync in SETTINGS:
                    tokens = tuple(range(i * n_tokens, (i + 1) * n_tokens))
                    seconds, commits = store_once(root, state, tokens, sync, metasync)
                    times[label].append(seconds)
            median = {label: statistics.median(values) for label, values in times.items()}
            floor = median["no sync"]
            cells = [f"{median[label] * 1e3:>10,.0f} ms" for label, _, _ in SETTINGS]
            print(f"{n_tokens:>7,} {len(state) / 2**20:>6,.0f} {commits:>8,}  " + "  ".join(f"{c:>25}" for c in cells))
            for label, _, _ in SETTINGS[:2]:
                print(f"{'':>24}{label}: flushes {(median[label] - floor) / commits * 1e3:.2f} ms a commit")
            two, one = median[SETTINGS[0][0]], median[SETTINGS[1][0]]
            print(f"{'':>24}one flush a commit / two: {one / two:.2f}")
            if one > 1.05 * two:
                missed.append(f"{n_tokens} tokens: one flush a commit took {one / two:.2f}x two")
    finally:
        shutil.rmtree(root)
    for line in missed:
        print(f"MISS: {line}")
    return 1 if missed and not args.no_goals else 0


if __name__ == "__main__":
    sys.exit(main())
