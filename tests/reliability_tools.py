"""Shared helpers for the reliability tests: crash, concurrency and fork.

The tests check three promises with real files and real processes: the cache
never hands back a wrong state, never loses an acknowledged entry to a crash,
and never crashes (or hangs) the process that uses it.

Blobs are self-checking: `make_blob` frames seeded random bytes derived from
(namespace, key, version, size) with `sippcache.frame`, and records the
version and size in the frame's meta, so any reader can recompute the exact
bytes an entry must hold (`blob_version`) and `sippcache verify` sees real
frames.

This file is also the script the tests start as separate processes
(``python reliability_tools.py ROLE ARGS...``): see `main` for the roles.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import sippcache
from sippcache import frame

#: SIPPCACHE_SLOW_TESTS=1 multiplies every iteration count by this.
SLOW = bool(os.environ.get("SIPPCACHE_SLOW_TESTS", "").strip() not in ("", "0"))
ITERATIONS = 10 if SLOW else 1

#: The console script pip installed beside this interpreter.
SCRIPT = Path(sys.executable).with_name("sippcache")
HELPER = Path(__file__).resolve()

#: Every process must finish within this many seconds, or it counts as hung.
DEADLOCK_SECONDS = 120.0

FINGERPRINT = "sippcache-reliability-tests"
KIND = "reliability.blob"


class WrongBlob(AssertionError):
    """A blob that is not exactly what was stored under its key."""


# -- self-checking blobs ---------------------------------------------------------------


def payload(namespace: str, tokens: Sequence[int], version: int, size: int) -> bytes:
    """`size` seeded random bytes, a function of the key, the version and the size only."""
    seed = f"{namespace}|{','.join(map(str, tokens))}|{version}|{size}"
    return random.Random(seed).randbytes(size)


def make_blob(namespace: str, tokens: Sequence[int], version: int, size: int) -> bytes:
    """The exact bytes stored for version `version` of (namespace, tokens)."""
    return frame.encode(
        list(tokens),
        [payload(namespace, tokens, version, size)],
        fingerprint=FINGERPRINT,
        kind=KIND,
        created=0.0,
        meta={"v": version, "n": size, "ns": namespace},
    )


def blob_version(blob: Any, namespace: str, tokens: Sequence[int]) -> int:
    """The version `blob` holds for (namespace, tokens); WrongBlob unless every byte is right."""
    try:
        decoded = frame.decode(blob)
    except sippcache.CorruptEntry as exc:
        raise WrongBlob(f"damaged blob for {namespace!r}/{len(tokens)} tokens: {exc}") from None
    if decoded.tokens != tuple(tokens):
        raise WrongBlob(
            f"blob for a different key: stored under {len(tokens)} tokens ending {tuple(tokens)[-4:]}, "
            f"frame says {len(decoded.tokens)} tokens ending {decoded.tokens[-4:]}"
        )
    meta = dict(decoded.meta)
    del decoded  # its sections are views of the blob
    if meta.get("ns") != namespace or not isinstance(meta.get("v"), int) or not isinstance(meta.get("n"), int):
        raise WrongBlob(f"blob meta {meta!r} does not belong to namespace {namespace!r}")
    if bytes(blob) != make_blob(namespace, tokens, meta["v"], meta["n"]):
        raise WrongBlob(f"blob bytes differ from version {meta['v']} of the key")
    return int(meta["v"])


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


# -- keys ------------------------------------------------------------------------------

#: Shared prefixes (as real prompts share system prompts); token ids >= 10**6 never
#: collide with the small ids at the end of every key, so no key is a prefix of another.
PREFIXES = [[], [1_000_000 + i for i in range(40)], [2_000_000 + i for i in range(300)]]
NAMESPACES = ["", "tenant-b"]


def crash_key(keyid: str) -> tuple[str, list[int]]:
    """(namespace, tokens) of a crash-test key id "<run>.<i>" (or "p.<run>" for the parent's probes)."""
    a, b = keyid.split(".")
    if a == "p":
        return "probe", [3_000_000, int(b)]
    run, i = int(a), int(b)
    return NAMESPACES[i % 2], PREFIXES[i % 3] + [run, i]


def worker_key(proc: int, thread: int, k: int) -> tuple[str, list[int]]:
    """(namespace, tokens) of a key owned by one thread of one worker process."""
    return NAMESPACES[k % 2], PREFIXES[k % 3] + [proc, thread, k]


# -- processes -------------------------------------------------------------------------


def spawn(
    role: str, *args: Any, stdout: Any = subprocess.PIPE, stderr: Any = None, stdin: Any = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """Start this file as a new Python process in `role`."""
    return subprocess.Popen(
        [sys.executable, str(HELPER), role, *map(str, args)], stdout=stdout, stderr=stderr, stdin=stdin
    )


def wait_all(procs: Sequence[subprocess.Popen[bytes]], seconds: float = DEADLOCK_SECONDS) -> list[int | None]:
    """Wait for every process for at most `seconds` in all; kill the ones still running.
    Returns their exit codes, None for each one that had to be killed (hung)."""
    deadline = time.monotonic() + seconds
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for proc, code in zip(procs, codes, strict=True):
        if code is None:
            proc.kill()
            proc.wait(timeout=60)  # SIGKILL: at once
    return codes


def run_verify(url: str) -> tuple[int, Any, str]:
    """Run ``sippcache verify URL --json``: (exit code, its JSON or None, stderr)."""
    assert SCRIPT.exists(), f"the sippcache console script is not installed at {SCRIPT}"
    result = subprocess.run(
        [str(SCRIPT), "verify", url, "--json"],
        capture_output=True,
        text=True,
        timeout=DEADLOCK_SECONDS,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        report = json.loads(result.stdout) if result.stdout.strip() else None
    except ValueError:
        report = None
    return result.returncode, report, result.stderr


def read_text(path: Path, limit: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text if len(text) <= limit else "...\n" + text[-limit:]


class LineReader:
    """Collect a process's stdout lines in a thread (so its pipe never fills); `ready` is
    set when a line "R" arrives. With `kill_at=(n, delay)`, SIGKILL the process `delay`
    seconds after its n-th line starting with "B " (the start of its n-th operation);
    `done` is set then, or at EOF."""

    def __init__(self, stream: IO[bytes], pid: int = 0, kill_at: tuple[int, float] | None = None) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self._pid, self._kill_at = pid, kill_at
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: IO[bytes]) -> None:
        started = 0
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line == "R":
                self.ready.set()
            elif line.startswith("B ") and self._kill_at is not None:
                started += 1
                if started == self._kill_at[0]:
                    end = time.perf_counter() + self._kill_at[1]
                    while time.perf_counter() < end:  # spin: sleep() is too coarse for a few ms
                        pass
                    os.kill(self._pid, signal.SIGKILL)
                    self.done.set()
        self.ready.set()  # EOF: the process is gone
        self.done.set()

    def join(self, timeout: float = 30) -> None:
        self._thread.join(timeout)


# -- fork ------------------------------------------------------------------------------


#: Exit code of a forked child whose use of the cache failed clearly: a SippcacheError
#: that says the cache cannot be used across fork.
FAILED_CLEARLY = 2


def run_in_fork(child: Any, timeout: float = 60.0) -> tuple[int | None, str]:
    """Fork; in the child run `child()` and leave with os._exit: 0 if it returned,
    FAILED_CLEARLY if it raised a SippcacheError that mentions fork, 1 if it raised
    anything else. Returns (exit code, or None if it hung; what it reported: the
    traceback, or for a hung child every thread's stack)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into the caller (pytest)
        code = 1
        try:
            os.close(read_end)
            # If it hangs, report where: every thread's stack, then exit.
            faulthandler.dump_traceback_later(
                max(1.0, timeout - 5), exit=True, file=os.fdopen(write_end, "w", closefd=False)
            )
            child()
            faulthandler.cancel_dump_traceback_later()
            code = 0
        except BaseException as exc:
            if isinstance(exc, sippcache.SippcacheError) and "fork" in str(exc).lower():
                code = FAILED_CLEARLY
            try:
                os.write(write_end, traceback.format_exc().encode()[-60_000:])
            except BaseException:
                pass
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []

    def drain() -> None:
        with os.fdopen(read_end, "rb") as stream:
            chunks.append(stream.read())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    status: int | None = None
    while time.monotonic() < deadline:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = raw
            break
        time.sleep(0.01)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        reader.join(10)
        return None, b"".join(chunks).decode(errors="replace")
    reader.join(10)
    code = os.waitstatus_to_exitcode(status)
    report = b"".join(chunks).decode(errors="replace")
    if report.startswith("Timeout ("):  # faulthandler's dump of a hung child
        return None, report
    return code, report


# -- roles run as separate processes ---------------------------------------------------


def _say(line: str) -> None:
    """One line on stdout, unbuffered and atomic (a pipe write under PIPE_BUF)."""
    os.write(1, (line + "\n").encode())


def crash_writer(url: str, run: int, seed: int, lo: int, hi: int, live_cap: int) -> None:
    """Store (and overwrite, delete, look up) entries until killed.

    Protocol on stdout: "R" once the store is open; "B <op> <keyid> <version>"
    before each store (op S) or delete (op D), "A ..." with the same fields
    after it returned (the acknowledgement). stdin: JSON [[keyid, version], ...]
    of the entries present before this run. A wrong lookup result prints
    "E <reason>" and exits with code 3.
    """
    live: dict[str, int] = {k: v for k, v in json.loads(sys.stdin.read() or "[]")}
    rng = random.Random(seed)
    cache = sippcache.open(url)
    _say("R")
    fresh = 0
    for _ in range(100_000):
        keys = sorted(live)
        r = rng.random()
        if keys and (r < 0.15 or (len(keys) > live_cap and r < 0.6)):
            keyid = rng.choice(keys)
            namespace, tokens = crash_key(keyid)
            _say(f"B D {keyid} -1")
            if not cache.delete(tokens, namespace=namespace):
                _say(f"E delete of present {keyid} returned False")
                os._exit(3)
            _say(f"A D {keyid} -1")
            del live[keyid]
            continue
        if keys and r < 0.3:
            keyid = rng.choice(keys)
            namespace, tokens = crash_key(keyid)
            match = cache.lookup(tokens, namespace=namespace)
            try:
                if match is None or tuple(match.key) != tuple(tokens):
                    _say(f"E lookup of {keyid} (version {live[keyid]}) missed")
                    os._exit(3)
                version = blob_version(match.blob, namespace, tokens)
            except WrongBlob as exc:
                _say(f"E lookup of {keyid}: {exc}")
                os._exit(3)
            finally:
                if match is not None:
                    match.release()
            if version != live[keyid]:
                _say(f"E lookup of {keyid} returned version {version}, stored {live[keyid]}")
                os._exit(3)
            continue
        if keys and r < 0.45:
            keyid = rng.choice(keys)  # overwrite an acknowledged entry
            version = live[keyid] + 1
        else:
            keyid, version = f"{run}.{fresh}", 0
            fresh += 1
        namespace, tokens = crash_key(keyid)
        blob = make_blob(namespace, tokens, version, log_uniform(rng, lo, hi))
        _say(f"B S {keyid} {version}")
        cache.store(tokens, blob, namespace=namespace)
        _say(f"A S {keyid} {version}")
        live[keyid] = version
    _say("DONE")
    while True:  # wait to be killed, however long the test takes to do it
        time.sleep(3600)


def kill_at_call(url: str, keyid: str, version: int, op: str, method: str, nth: int) -> None:
    """Run one store (op S, of `version`) or delete (op D) of `keyid` in a diskcache
    store, SIGKILLing this process right after the `nth` call of `diskcache.Cache.<method>`
    returns during that operation. Prints "B" before, "A" after the operation and
    "K" just before the kill."""
    import diskcache

    cache = sippcache.open(url)
    namespace, tokens = crash_key(keyid)
    blob = make_blob(namespace, tokens, version, 100_000) if op == "S" else b""
    cache.lookup(tokens, namespace=namespace, touch=False)  # sync first: count only the operation's own calls
    original = getattr(diskcache.Cache, method)
    calls = [0]

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == nth:
            _say("K")
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(diskcache.Cache, method, wrapped)
    _say("B")
    if op == "S":
        cache.store(tokens, blob, namespace=namespace)
    else:
        cache.delete(tokens, namespace=namespace)
    _say(f"A {calls[0]}")


def hold_reader(url: str) -> None:
    """Open the store, look up [1, 2, 3] and hold the match; print "R"; wait to be killed."""
    cache = sippcache.open(url)
    match = cache.lookup([1, 2, 3])
    if match is None:
        _say("E miss")
        os._exit(3)
    _say("R")
    while True:  # wait to be killed, holding the match
        time.sleep(3600)


def probe(url: str, tag: int) -> None:
    """A new process that must be able to use the store: look up, store, look up."""
    cache = sippcache.open(url)
    match = cache.lookup([1, 2, 3])
    assert match is not None, "the entry [1, 2, 3] is missing"
    match.release()
    tokens = [4_000_000, tag]
    blob = make_blob("", tokens, 0, 5000)
    cache.store(tokens, blob)
    match = cache.lookup(tokens)
    assert match is not None and bytes(match.blob) == blob, "a new store is not found"
    match.release()
    cache.close()
    _say("OK")


KEYS_PER_THREAD = 16


def concurrency_worker(url: str, proc: int, seed: int, ops: int, threads: int, bounded: int, out: str) -> None:
    """Threads sharing ONE cache instance do mixed stores, lookups and deletes.

    Each thread owns keys `worker_key(proc, thread, k)` and knows what it last
    stored or deleted under each; its own lookups must agree (with `bounded`,
    an absent key is accepted: the store may have evicted it). Lookups of other
    threads' keys must return self-consistent blobs. With `bounded`, stats and
    entries are checked against max_bytes every 20 operations. Results go to
    `out` as JSON.
    """
    faulthandler.dump_traceback_later(DEADLOCK_SECONDS - 15, exit=True)  # hung: dump every thread's stack
    cache = sippcache.open(url)
    max_bytes = cache.stats().max_bytes
    assert max_bytes is not None
    barrier = threading.Barrier(threads)
    models: list[dict[str, int | None]] = [{} for _ in range(threads)]
    errors: list[str] = []
    counts = {"store": 0, "lookup": 0, "delete": 0, "cross": 0, "absent": 0, "checkpoints": 0}
    count_lock = threading.Lock()

    def bump(name: str) -> None:
        with count_lock:
            counts[name] += 1

    def run_thread(t: int) -> None:
        rng = random.Random(f"{seed}/{proc}/{t}")
        model = models[t]
        versions: dict[str, int] = {}
        failures = 0
        barrier.wait(timeout=60)
        for step in range(ops):
            k = rng.randrange(KEYS_PER_THREAD)
            keyid = f"{proc}.{t}.{k}"
            namespace, tokens = worker_key(proc, t, k)
            r = rng.random()
            try:
                if r < 0.45:
                    version = versions[keyid] = versions.get(keyid, -1) + 1
                    blob = make_blob(namespace, tokens, version, log_uniform(rng, 100, 64_000))
                    cache.store(tokens, blob, namespace=namespace)
                    model[keyid] = version
                    bump("store")
                elif r < 0.75:
                    expected = model.get(keyid)
                    match = cache.lookup(tokens + [7, 7], namespace=namespace, partial=rng.random() < 0.3)
                    observed = None
                    if match is not None:
                        with match:
                            if tuple(match.key) == tuple(tokens):
                                observed = blob_version(match.blob, namespace, tokens)
                            else:  # a partial lookup may return another key: it must be right too
                                blob_version(match.blob, namespace, match.key)
                    if observed != expected:
                        if observed is None and bounded:
                            model[keyid] = None  # evicted
                            bump("absent")
                        else:
                            raise AssertionError(
                                f"lookup of own key {keyid}: expected version {expected}, got {observed}"
                            )
                    bump("lookup")
                elif r < 0.85:
                    present = model.get(keyid) is not None
                    deleted = cache.delete(tokens, namespace=namespace)
                    if deleted != present and not (bounded and present and not deleted):
                        raise AssertionError(f"delete of own key {keyid} returned {deleted}; present={present}")
                    model[keyid] = None
                    bump("delete")
                else:
                    other = worker_key(
                        rng.randrange(max(4, proc + 1)), rng.randrange(threads), rng.randrange(KEYS_PER_THREAD)
                    )
                    o_namespace, o_tokens = other
                    query = o_tokens[: rng.randrange(1, len(o_tokens) + 1)] + [rng.randrange(5)]
                    partial = rng.random() < 0.5
                    match = cache.lookup(query, namespace=o_namespace, partial=partial)
                    if match is not None:
                        with match:
                            key = tuple(match.key)
                            blob_version(match.blob, o_namespace, key)
                            common = 0
                            for a, b in zip(key, query, strict=False):
                                if a != b:
                                    break
                                common += 1
                            if match.length != common or (not partial and common != len(key)):
                                raise AssertionError(
                                    f"lookup returned length {match.length} for a key sharing {common}"
                                )
                    bump("cross")
                if bounded and step % 20 == 0:
                    stats = cache.stats()
                    listed = sum(e.size for e in cache.entries())
                    if stats.bytes > max_bytes or listed > max_bytes:
                        raise AssertionError(f"over budget: stats.bytes={stats.bytes} entries={listed} > {max_bytes}")
                    bump("checkpoints")
            except Exception:
                failures += 1
                with count_lock:
                    errors.append(f"process {proc} thread {t} step {step}:\n{traceback.format_exc()}")
                if failures >= 3:
                    return

    workers = [threading.Thread(target=run_thread, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stats = cache.stats()
    result = {
        "models": {k: v for model in models for k, v in model.items()},
        "errors": errors,
        "evictions": stats.evictions,
        "counts": counts,
    }
    cache.close()
    faulthandler.cancel_dump_traceback_later()
    Path(out).write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    if role == "crash-writer":
        url, run, seed, lo, hi, live_cap = args
        crash_writer(url, int(run), int(seed), int(lo), int(hi), int(live_cap))
    elif role == "kill-at-call":
        url, keyid, version, op, method, nth = args
        kill_at_call(url, keyid, int(version), op, method, int(nth))
    elif role == "hold-reader":
        hold_reader(args[0])
    elif role == "probe":
        probe(args[0], int(args[1]))
    elif role == "concurrency-worker":
        url, proc, seed, ops, threads, bounded, out = args
        concurrency_worker(url, int(proc), int(seed), int(ops), int(threads), int(bounded), out)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
