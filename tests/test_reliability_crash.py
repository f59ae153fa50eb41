"""Crash safety: writer processes SIGKILLed at random moments, on real LMDB and diskcache stores.

The promise: whatever happens, the cache never hands back a wrong state and
never loses an acknowledged entry to a crash. A writer process stores (and
overwrites, deletes, looks up) self-checking entries of 1 KB to 1 MB and
acknowledges each store or delete on a pipe after the call returned; the test
kills it at a seeded random moment. After each kill:

- the store opens (a fresh handle, and a handle kept open through all kills,
  as a server would);
- every acknowledged entry is there with exactly its bytes, every
  acknowledged delete stuck, and only the one operation in flight at the kill
  may have gone either way; `entries()` and `stats()` agree with the lookups;
- ``sippcache verify`` finds nothing bad;
- new stores work, in this process and in the next writer.

max_bytes is far above what the writer stores, so nothing may be evicted.
SIPPCACHE_SLOW_TESTS=1 runs ten times as many kills.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import sippcache
from sippcache import CacheBackend
from tests.reliability_tools import (
    ITERATIONS,
    LineReader,
    WrongBlob,
    blob_version,
    crash_key,
    make_blob,
    read_text,
    run_verify,
    spawn,
    wait_all,
)

#: Kills per backend (times ITERATIONS).
KILLS = 20
#: Blob payload sizes, log-uniform.
MIN_SIZE, MAX_SIZE = 1024, 1024 * 1024
#: Above this many live entries the writer mostly deletes, to keep the store small.
LIVE_CAP = 60


def store_url(backend: str, path: Path) -> str:
    if backend == "lmdb":
        # A small initial map, so that the writer also gets killed while it grows the map.
        return f"lmdb://{path}?max_bytes=1GiB&map_size=8MiB"
    return f"diskcache://{path}?max_bytes=1GiB"


@dataclass
class Model:
    """What the store must hold: keyid -> version (None: deleted), from acknowledgements."""

    state: dict[str, int | None] = field(default_factory=dict)

    def present(self) -> dict[str, int]:
        return {k: v for k, v in self.state.items() if v is not None}

    def apply(self, lines: list[str]) -> tuple[tuple[str, int | None] | None, list[str]]:
        """Apply a writer's acknowledged operations; return (the operation in flight at
        the kill as (keyid, resulting version or None), or None; protocol problems)."""
        problems: list[str] = []
        pending: tuple[str, str, int] | None = None
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind in ("R", "DONE") or not line:
                continue
            if kind == "E":
                problems.append(f"the writer saw a wrong result: {rest}")
                continue
            op, keyid, version = rest.split()
            if kind == "B":
                if pending is not None:
                    problems.append(f"two operations in flight: {pending} and {line}")
                pending = (op, keyid, int(version))
            elif kind == "A":
                if pending != (op, keyid, int(version)):
                    problems.append(f"acknowledgement {line!r} does not match {pending}")
                self.state[keyid] = int(version) if op == "S" else None
                pending = None
        if pending is None:
            return None, problems
        op, keyid, version = pending
        return (keyid, version if op == "S" else None), problems


def observe(cache: CacheBackend, keyids: list[str]) -> tuple[dict[str, int | None], list[str]]:
    """keyid -> version found (None: absent) for every key; problems with wrong blobs."""
    seen: dict[str, int | None] = {}
    problems: list[str] = []
    for keyid in keyids:
        namespace, tokens = crash_key(keyid)
        match = cache.lookup(tokens + [5], namespace=namespace)
        if match is None:
            seen[keyid] = None
            continue
        with match:
            try:
                if tuple(match.key) == tuple(tokens):
                    seen[keyid] = blob_version(match.blob, namespace, tokens)
                else:
                    seen[keyid] = None
                    blob_version(match.blob, namespace, match.key)
            except WrongBlob as exc:
                problems.append(f"{keyid}: WRONG STATE: {exc}")
                seen[keyid] = -1
    return seen, problems


def check_store(
    cache: CacheBackend, model: Model, inflight: tuple[str, int | None] | None, label: str
) -> tuple[dict[str, int | None], list[str]]:
    """Compare a handle's view of the store with the model; return (observed state, problems)."""
    keyids = sorted(set(model.state) | ({inflight[0]} if inflight else set()))
    seen, problems = observe(cache, keyids)
    for keyid in keyids:
        allowed = {model.state.get(keyid)}
        if inflight is not None and inflight[0] == keyid:
            allowed.add(inflight[1])
        if seen[keyid] not in allowed:
            expected = " or ".join("absent" if v is None else f"version {v}" for v in sorted(allowed, key=str))
            found = "absent" if seen[keyid] is None else f"version {seen[keyid]}"
            lost = " (an ACKNOWLEDGED entry was lost)" if seen[keyid] is None else ""
            problems.append(f"{label}: {keyid}: expected {expected}, found {found}{lost}")
    present = {(ns, tuple(tokens)) for ns, tokens in (crash_key(k) for k, v in seen.items() if v is not None)}
    listed = list(cache.entries())
    listed_keys = {(e.namespace, tuple(e.key)) for e in listed}
    for namespace, key in sorted(listed_keys):
        if (namespace, key) not in present:
            problems.append(
                f"{label}: entries() lists {namespace!r}/{len(key)} tokens ending {key[-2:]}, "
                "which no lookup returns (a ghost entry)"
            )
    stats = cache.stats()
    if stats.entries != len(present) or len(listed) != len(present):
        problems.append(
            f"{label}: stats().entries={stats.entries}, entries() lists {len(listed)}, lookups find {len(present)}"
        )
    if stats.bytes != sum(e.size for e in listed):
        problems.append(f"{label}: stats().bytes={stats.bytes} != sum of entry sizes {sum(e.size for e in listed)}")
    if stats.evictions:
        problems.append(f"{label}: {stats.evictions} evictions although max_bytes is far above the data")
    return seen, problems


# -- random kills ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_sigkill_at_random_moments_loses_nothing_acknowledged(
    backend: str, tmp_path: Path, opened: list[CacheBackend]
) -> None:
    url = store_url(backend, tmp_path / "store")
    rng = random.Random(f"crash-{backend}")
    model = Model()
    server = sippcache.open(url)  # kept open through every kill, like a long-running server
    opened.append(server)
    history: list[str] = []
    for run in range(KILLS * ITERATIONS):
        # -- start a writer and kill it at a random moment --------------------------------
        stderr_path = tmp_path / f"writer-{run}.stderr"
        with open(stderr_path, "wb") as stderr:
            writer = spawn(
                "crash-writer",
                url,
                run,
                rng.randrange(2**32),
                MIN_SIZE,
                MAX_SIZE,
                LIVE_CAP,
                stdin=subprocess.PIPE,
                stderr=stderr,
            )
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(json.dumps(sorted(model.present().items())).encode())
        writer.stdin.close()
        mode = rng.random()
        if mode < 0.1:
            when, delay = "after start", rng.uniform(0.0, 0.4)  # possibly while it opens the store
            lines = LineReader(writer.stdout)
            time.sleep(delay)
        elif mode < 0.5:
            when, delay = "after ready", rng.uniform(0.0, 0.5)
            lines = LineReader(writer.stdout)
            assert lines.ready.wait(60), f"run {run}: the writer never opened the store:\n{read_text(stderr_path)}"
            time.sleep(delay)
        else:  # inside a write: shortly after the start of a random operation
            nth, delay = rng.randrange(1, 80), rng.uniform(0.0, 0.004)
            when = f"after the start of operation {nth}"
            lines = LineReader(writer.stdout, writer.pid, (nth, delay))
            assert lines.done.wait(60), f"run {run}: the writer never reached operation {nth}"
        writer.send_signal(signal.SIGKILL)
        (code,) = wait_all([writer], 60)
        lines.join()
        context = f"{backend} run {run}, killed {delay:.3f} s {when}"
        assert code == -signal.SIGKILL, (
            f"{context}: the writer exited by itself with {code} before the kill:\n{read_text(stderr_path)}"
            f"\nstdout tail: {lines.lines[-5:]}"
        )
        inflight, problems = model.apply(lines.lines)
        acked = sum(1 for line in lines.lines if line.startswith("A "))
        history.append(f"{context}: {acked} acknowledged, in flight: {inflight}")

        # -- the store opens and holds exactly what was acknowledged ----------------------
        try:
            fresh = sippcache.open(url)
        except Exception as exc:
            pytest.fail(f"{context}: the store no longer opens: {type(exc).__name__}: {exc}")
        opened.append(fresh)
        seen, more = check_store(fresh, model, inflight, "fresh handle")
        problems += more
        seen_server, more = check_store(server, model, inflight, "long-lived handle")
        problems += more
        if seen_server != seen:
            diff = {k: (seen[k], seen_server.get(k)) for k in seen if seen[k] != seen_server.get(k)}
            problems.append(f"the long-lived handle and a fresh one disagree: {diff}")

        # -- sippcache verify finds nothing bad -------------------------------------------
        rc, report, err = run_verify(url)
        if rc != 0 or not report or report["bad"]:
            problems.append(f"sippcache verify: exit {rc}, report {report}, stderr {err.strip()[-1500:]}")
        elif report["checked"] != sum(1 for v in seen.values() if v is not None):
            problems.append(
                f"sippcache verify checked {report['checked']} entries, "
                f"lookups find {sum(1 for v in seen.values() if v is not None)}"
            )

        # -- new stores work ---------------------------------------------------------------
        probe = f"p.{run}"
        namespace, tokens = crash_key(probe)
        blob = make_blob(namespace, tokens, 0, 3000)
        try:
            server.store(tokens, blob, namespace=namespace)
            match = fresh.lookup(tokens, namespace=namespace)
            ok = match is not None and bytes(match.blob) == blob
            if match is not None:
                match.release()
            if not ok:
                problems.append("a new store in the long-lived handle is not found by the fresh one")
        except Exception as exc:
            problems.append(f"a new store failed: {type(exc).__name__}: {exc}")
        fresh.close()
        opened.remove(fresh)

        # The in-flight operation may show only after that write: LMDB publishes a commit
        # by updating the lock file's txnid after the meta page, and a writer killed in
        # between has its last commit published by the next writer (robust-mutex recovery).
        if inflight is not None:
            after, more = observe(server, [inflight[0]])
            problems += more
            if after[inflight[0]] != seen[inflight[0]]:
                allowed = {model.state.get(inflight[0]), inflight[1]}
                if after[inflight[0]] not in allowed:
                    problems.append(
                        f"in-flight {inflight[0]}: after the next write found {after[inflight[0]]}, allowed {allowed}"
                    )
                history.append(
                    f"  the in-flight operation became visible only after the next write "
                    f"({seen[inflight[0]]} -> {after[inflight[0]]})"
                )
                seen[inflight[0]] = after[inflight[0]]

        assert not problems, f"{context}:\n" + "\n".join(problems) + "\nhistory:\n" + "\n".join(history)
        # The observed state is the truth from now on (the in-flight operation went one way).
        model.state.update(seen)
        model.state[probe] = 0

    # A clean new process still works at the end, and everything acknowledged is still there.
    server.store([1, 2, 3], make_blob("", [1, 2, 3], 0, 100))
    with open(tmp_path / "final.stderr", "wb") as stderr:
        final = spawn("probe", url, 1, stderr=stderr)
    assert wait_all([final]) == [0], read_text(tmp_path / "final.stderr")
    with sippcache.open(url) as again:
        seen, problems = observe(again, sorted(model.state))
    lost = {k: (v, seen[k]) for k, v in model.state.items() if seen[k] != v}
    assert not problems and not lost, (problems, lost)


# -- kills at chosen moments -----------------------------------------------------------

#: diskcache.Cache methods the engine calls inside one write transaction, and how many times:
#: an overwrite sets the B, M, U, L and S records; a delete deletes B, M and U (then sets L, S).
KILL_POINTS = [("S", "set", n) for n in range(1, 6)] + [("D", "delete", n) for n in range(1, 4)]


@pytest.mark.parametrize("op, method, nth", KILL_POINTS, ids=[f"{op}-{m}{n}" for op, m, n in KILL_POINTS])
def test_diskcache_sigkill_inside_a_write_transaction(tmp_path: Path, op: str, method: str, nth: int) -> None:
    """SIGKILL right after each diskcache call inside the transaction of an overwrite or a
    delete of an acknowledged entry: afterwards the entry is either the old or the new
    version (or, for a delete, absent), never a ghost that is listed but cannot be read."""
    url = f"diskcache://{tmp_path}/store?max_bytes=1GiB"
    keyid = "0.0"
    namespace, tokens = crash_key(keyid)
    old = make_blob(namespace, tokens, 0, 100_000)  # > 32 KiB: diskcache keeps it in its own file
    with sippcache.open(url) as cache:
        cache.store(tokens, old, namespace=namespace)
        cache.store([1, 2, 3], make_blob("", [1, 2, 3], 0, 100))
    with open(tmp_path / "stderr", "wb") as stderr:
        proc = spawn("kill-at-call", url, keyid, 1, op, method, nth, stderr=stderr)
        out, _ = proc.communicate(timeout=60)
    lines = out.decode().split()
    if proc.returncode == 0:
        pytest.fail(f"the operation made fewer than {nth} {method} calls (output {lines}): adjust KILL_POINTS")
    assert proc.returncode == -signal.SIGKILL, read_text(tmp_path / "stderr")
    assert "K" in lines
    allowed = {0, 1} if op == "S" else {0, None}
    with sippcache.open(url) as cache:
        seen, problems = observe(cache, [keyid])
        listed = [tuple(e.key) for e in cache.entries()]
    assert not problems, problems
    assert seen[keyid] in allowed, (
        f"killed after diskcache.Cache.{method} call {nth} of an {'overwrite' if op == 'S' else 'delete'}: "
        f"the acknowledged entry is {'absent' if seen[keyid] is None else seen[keyid]}, "
        f"expected one of {allowed}; entries() lists {[len(k) for k in listed]}-token keys"
    )
    assert (tuple(tokens) in listed) == (seen[keyid] is not None), "entries() and lookup disagree (a ghost entry)"
    rc, report, err = run_verify(url)
    assert rc == 0 and report and not report["bad"], (rc, report, err)


# -- killed readers ---------------------------------------------------------------------


def test_lmdb_readers_killed_while_holding_matches_do_not_lock_out_new_processes(tmp_path: Path) -> None:
    """Processes killed while holding a match leave their LMDB reader slots behind. While
    another process keeps the environment open (a server), nothing resets the reader
    table: once dead readers fill it, every new process must still be able to read."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64MiB&max_readers=8"
    with sippcache.open(url) as server:
        server.store([1, 2, 3], make_blob("", [1, 2, 3], 0, 100_000))
        for i in range(3 * 8 * ITERATIONS):
            with open(tmp_path / f"reader-{i}.stderr", "wb") as stderr:
                reader = spawn("hold-reader", url, stderr=stderr)
            assert reader.stdout is not None
            lines = LineReader(reader.stdout)
            ready = lines.ready.wait(60) and "R" in lines.lines
            if not ready:
                wait_all([reader], 1)
                pytest.fail(
                    f"reader process {i} (after {i} readers were killed) could not read: "
                    f"{lines.lines} {read_text(tmp_path / f'reader-{i}.stderr')}"
                )
            reader.send_signal(signal.SIGKILL)
            wait_all([reader], 60)
            lines.join()
        with open(tmp_path / "probe.stderr", "wb") as stderr:
            proc = spawn("probe", url, 1, stderr=stderr)
        assert wait_all([proc]) == [0], f"a new process cannot use the store: {read_text(tmp_path / 'probe.stderr')}"
        match = server.lookup([1, 2, 3])
        assert match is not None
        match.release()
    rc, report, err = run_verify(url)
    assert rc == 0 and report and not report["bad"], (rc, report, err)
