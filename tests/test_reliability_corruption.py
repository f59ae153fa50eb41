"""Damaged stores: the cache never hands out a wrong entry and never kills its process.

Every damaged store is used from a separate Python process (`_probe`), so a
crash inside LMDB or SQLite shows up as a negative return code (a signal)
instead of taking pytest down. The probe looks up every known key and
classifies each answer:

- ``ok``: the exact entry stored under that key;
- ``prefix:<n>``: a hit on a shorter stored key whose blob is exactly what
  was stored under it (a correct, shorter entry);
- ``miss``;
- ``corrupt``: a blob `sippcache.frame.decode` refuses (the adapter drops it);
- ``WRONG``: a blob that decodes but is not what was stored under the key
  the match names. This must never happen.

The llama tests then check the whole path on the real (tiny) model: after
damage, `PrefixCache.prefill` restores nothing from the damaged entry, its
logits equal the never-cached reference bit for bit, and its stats count the
entry as corrupt. `sippcache verify` (the console script, as a subprocess)
must report the damage.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import sippcache
from harness.llama_tools import last_logits, reference_logits
from sippcache import frame

SCRIPT = Path(sys.executable).with_name("sippcache")
NS = "ns"

#: (key, fingerprint, payload byte, payload length). The fingerprints are
#: distinct markers to find each entry's frame header in the files; the payload
#: lengths put SMALL and MEDIUM inline in diskcache's SQLite file (< 32 KiB) and
#: LARGE in a value file of its own (and in LMDB overflow pages).
SMALL = ([1, 2, 3], "fp-small-entry-0123456789", 0x41, 300)
MEDIUM = (list(range(1, 41)), "fp-medium-entry-123456789", 0x42, 20_000)
LARGE = (list(range(1, 101)), "fp-large-entry-0123456789", 0x43, 60_000)
ENTRIES = [SMALL, MEDIUM, LARGE]


def blob_of(entry: tuple[list[int], str, int, int]) -> bytes:
    key, fingerprint, byte, length = entry
    return frame.encode(key, [bytes([byte]) * length], fingerprint=fingerprint, kind="test", created=1.0)


def build_store(url: str) -> None:
    with sippcache.open(url) as cache:
        for entry in ENTRIES:
            cache.store(entry[0], blob_of(entry), namespace=NS)


# -- running things in another process ------------------------------------------------------


_PROBE = textwrap.dedent(
    """
    import json, sys
    import sippcache
    from sippcache import frame

    url, entries = sys.argv[1], json.loads(sys.argv[2])
    stored = {tuple(key): frame.encode(key, [bytes([byte]) * n], fingerprint=fp, kind="test", created=1.0)
              for key, fp, byte, n in entries}
    out = {}

    def record(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = f"raised {type(exc).__module__}.{type(exc).__name__}: {exc}"

    def classify(key):
        match = cache.lookup(key, namespace="ns")
        if match is None:
            return "miss"
        with match:
            found = tuple(match.key)
            blob = bytes(match.blob)
        try:
            decoded = frame.decode(blob)
        except sippcache.CorruptEntry:
            return "corrupt"
        if decoded.tokens != found or stored.get(found) != blob:
            return "WRONG"
        return "ok" if found == tuple(key) else f"prefix:{len(found)}"

    def open_():
        global cache
        cache = sippcache.open(url)
        return "ok"

    record("open", open_)
    if out["open"] == "ok":
        record("len", lambda: len(cache))
        record("entries", lambda: sorted(len(e.key) for e in cache.entries()))
        for key, *_ in entries:
            record(f"lookup {len(key)}", lambda key=key: classify(key))
        new = [9, 9, 9, 9]
        stored[tuple(new)] = frame.encode(new, [b"N" * 50_000], fingerprint="fp-new", kind="test", created=1.0)
        record("store", lambda: "ok" if cache.store(new, stored[tuple(new)], namespace="ns") else "not stored")
        record("lookup new", lambda: classify(new))
        record("delete new", lambda: cache.delete(new, namespace="ns"))
        record("close", lambda: cache.close() or "ok")
    print(json.dumps(out))
    """
)


def _run_python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script, *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode >= 0, (
        f"the process was killed by {signal.Signals(-result.returncode).name}:\n{result.stderr[-3000:]}"
    )
    return result


def probe(url: str) -> dict[str, object]:
    """Use the store at `url` in a new process; what each operation gave."""
    result = _run_python(_PROBE, url, json.dumps(ENTRIES))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def verify(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"the sippcache console script is not installed at {SCRIPT}"
    result = subprocess.run(
        [str(SCRIPT), "verify", url, "--json", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode >= 0, (
        f"sippcache verify was killed by {signal.Signals(-result.returncode).name}:\n{result.stderr[-3000:]}"
    )
    return result


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def no_wrong_answers(out: dict[str, object]) -> None:
    assert "WRONG" not in out.values(), out


# -- damaging files ---------------------------------------------------------------------------


def flip_after(path: Path, pattern: bytes, offset: int, mask: int = 0xFF) -> int:
    """XOR `mask` into the byte `offset` bytes after every occurrence of `pattern`
    (LMDB keeps stale copies of pages, so every copy is damaged); how many."""
    data = bytearray(path.read_bytes())
    found = [m.start() for m in re.finditer(re.escape(pattern), data)]
    assert found, f"{pattern[:40]!r} not found in {path}"
    for start in found:
        data[start + offset] ^= mask
    path.write_bytes(bytes(data))
    return len(found)


def value_files(store: Path) -> list[Path]:
    return sorted(store.glob("*/*/*.val"))


def meta_record_prefix(key: list[int]) -> bytes:
    """The start of the engine's M record (msgpack [namespace, key bytes, size, created, priority,
    generation]) for `key`."""
    return b"\x96" + msgpack.packb(NS) + msgpack.packb(struct.pack(f"<{len(key)}I", *key), use_bin_type=True)


def garbage(path: Path, size: int) -> None:
    path.write_bytes(random.Random(1234).randbytes(size))


@pytest.fixture(params=["lmdb", "diskcache"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


# -- flipped bytes in entries: detected, reported, never handed out --------------------------

#: name -> (backend, which entry, damage(store directory))
PAYLOAD_DAMAGE: dict[str, tuple[str, tuple, Callable[[Path], object]]] = {
    "lmdb-large-payload": ("lmdb", LARGE, lambda d: flip_after(d / "data.mdb", b"C" * 60_000, 30_000)),
    "lmdb-medium-payload": ("lmdb", MEDIUM, lambda d: flip_after(d / "data.mdb", b"B" * 20_000, 7_777, 0x01)),
    "lmdb-small-payload": ("lmdb", SMALL, lambda d: flip_after(d / "data.mdb", b"A" * 300, 150, 0x80)),
    "lmdb-large-header": ("lmdb", LARGE, lambda d: flip_after(d / "data.mdb", LARGE[1].encode(), 3)),
    "lmdb-small-header": ("lmdb", SMALL, lambda d: flip_after(d / "data.mdb", SMALL[1].encode(), 20, 0x01)),
    "diskcache-value-file-payload": ("diskcache", LARGE, lambda d: flip_after(value_files(d)[0], b"C" * 60_000, 1)),
    "diskcache-value-file-header": ("diskcache", LARGE, lambda d: flip_after(value_files(d)[0], LARGE[1].encode(), 0)),
    "diskcache-inline-payload": ("diskcache", MEDIUM, lambda d: flip_after(d / "cache.db", b"B" * 1000, 500)),
    "diskcache-inline-header": ("diskcache", SMALL, lambda d: flip_after(d / "cache.db", SMALL[1].encode(), 5)),
    "lmdb-large-entry-cut-short": ("lmdb", LARGE, lambda d: _cut_lmdb_entry(d, LARGE)),
    "lmdb-small-entry-cut-short": ("lmdb", SMALL, lambda d: _cut_lmdb_entry(d, SMALL)),
    "diskcache-inline-entry-cut-short": ("diskcache", MEDIUM, lambda d: _cut_diskcache_inline_entry(d, MEDIUM)),
}


def _cut_lmdb_entry(store: Path, entry: tuple) -> None:
    """Replace the entry's value by its first half (as a buggy or interrupted writer would)."""
    import lmdb

    env = lmdb.open(str(store), subdir=True, max_dbs=0, map_size=2**30)
    try:
        with env.begin(write=True) as txn:
            ((key, value),) = [(bytes(k), bytes(v)) for k, v in txn.cursor() if bytes(v) == blob_of(entry)]
            txn.put(key, value[: len(value) // 2])
    finally:
        env.close()


def _cut_diskcache_inline_entry(store: Path, entry: tuple) -> None:
    db = sqlite3.connect(store / "cache.db")
    try:
        blob = blob_of(entry)
        changed = db.execute("UPDATE Cache SET value = ? WHERE value = ?", (blob[: len(blob) // 2], blob)).rowcount
        assert changed == 1
        db.commit()
    finally:
        db.close()


def probe_damaged(url: str, damage: Callable[[], object]) -> dict[str, Any]:
    """Build the store, damage it, probe it in a child process: it opened, holds its
    three entries, and gave no wrong answer."""
    build_store(url)
    damage()
    out = probe(url)
    no_wrong_answers(out)
    assert out["open"] == "ok" and out["len"] == 3, out
    return out


@pytest.mark.parametrize("case", sorted(PAYLOAD_DAMAGE))
def test_flipped_entry_bytes_are_detected_and_reported(case: str, store_dir: Path) -> None:
    scheme, damaged, damage = PAYLOAD_DAMAGE[case]
    url = f"{scheme}://{store_dir}"
    out = probe_damaged(url, lambda: damage(store_dir))
    for key, *_ in ENTRIES:
        expected = {"corrupt"} if key == damaged[0] else {"ok"}
        assert out[f"lookup {len(key)}"] in expected, (key, out)
    assert (out["store"], out["lookup new"], out["delete new"], out["close"]) == ("ok", "ok", True, "ok"), out

    report = verify(url)
    assert report.returncode == 1, report.stderr
    bad = json.loads(report.stdout)["bad"]
    assert [(row["namespace"], row["tokens"]) for row in bad] == [(NS, len(damaged[0]))], bad
    assert re.search("checksum|payload|header", bad[0]["reason"]), bad
    deleted = verify(url, "--delete")
    assert deleted.returncode == 0 and json.loads(deleted.stdout)["deleted"] == 1, deleted.stderr
    clean = verify(url)
    assert clean.returncode == 0 and json.loads(clean.stdout) == {"checked": 2, "bad": [], "deleted": 0}


@pytest.mark.parametrize(
    "how",
    ["cut short", "garbage", "empty", "removed"],
)
def test_damaged_diskcache_value_file(how: str, store_dir: Path) -> None:
    url = f"diskcache://{store_dir}"
    build_store(url)
    (path,) = value_files(store_dir)
    if how == "cut short":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "garbage":
        garbage(path, path.stat().st_size)
    elif how == "empty":
        os.truncate(path, 0)
    else:
        path.unlink()

    out = probe(url)
    no_wrong_answers(out)
    assert out["open"] == "ok", out
    assert out[f"lookup {len(LARGE[0])}"] in ({"miss", f"prefix:{len(MEDIUM[0])}"} if how == "removed" else {"corrupt"})
    assert out[f"lookup {len(SMALL[0])}"] == out[f"lookup {len(MEDIUM[0])}"] == "ok", out
    assert out["store"] == "ok" and out["lookup new"] == "ok", out

    report = verify(url)
    assert report.returncode == 1, report.stderr
    assert [row["tokens"] for row in json.loads(report.stdout)["bad"]] == [len(LARGE[0])]
    assert verify(url, "--delete").returncode == 0
    assert json.loads(verify(url).stdout) == {"checked": 2, "bad": [], "deleted": 0}


# -- damaged index records (the engine's own metadata) -----------------------------------------

#: The M record of MEDIUM: msgpack [namespace, key bytes, size, created, priority, generation].
META_DAMAGE: dict[str, Callable[[Path], object]] = {
    # 0xc1 is never valid msgpack
    "unparsable": lambda f: flip_after(f, meta_record_prefix(MEDIUM[0]), 0, 0x96 ^ 0xC1),
    # one key token changed: the record no longer belongs to its id
    "other key": lambda f: flip_after(f, meta_record_prefix(MEDIUM[0]), len(meta_record_prefix(MEDIUM[0])) - 3, 0x01),
    # the list header becomes an array32 header declaring 2**31 elements
    "huge declared array": lambda f: _overwrite_all(f, meta_record_prefix(MEDIUM[0]), b"\xdd\x80\x00\x00\x00"),
}


def _overwrite_all(path: Path, pattern: bytes, replacement: bytes) -> None:
    data = bytearray(path.read_bytes())
    found = [m.start() for m in re.finditer(re.escape(pattern), data)]
    assert found
    for start in found:
        data[start : start + len(replacement)] = replacement
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", sorted(META_DAMAGE))
def test_damaged_index_record_is_a_miss_and_reported(backend: str, how: str, store_dir: Path) -> None:
    url = f"{backend}://{store_dir}"
    build_store(url)
    META_DAMAGE[how](store_dir / ("data.mdb" if backend == "lmdb" else "cache.db"))

    out = probe(url)
    no_wrong_answers(out)
    assert out["open"] == "ok", out
    # MEDIUM's record is unusable: its lookup falls back to the stored 3-token prefix (a correct entry).
    assert out[f"lookup {len(MEDIUM[0])}"] in ("miss", f"prefix:{len(SMALL[0])}"), out
    assert out[f"lookup {len(SMALL[0])}"] == out[f"lookup {len(LARGE[0])}"] == "ok", out
    assert out["store"] == "ok" and out["lookup new"] == "ok", out

    # verify must say the store holds a damaged entry (not "0 bad"), and --delete must remove it.
    fresh = store_dir.parent / "fresh"
    build_store(f"{backend}://{fresh}")
    META_DAMAGE[how](fresh / ("data.mdb" if backend == "lmdb" else "cache.db"))
    report = verify(f"{backend}://{fresh}")
    assert report.returncode == 1, (
        "sippcache verify does not report an entry whose index record is damaged: "
        f"exit {report.returncode}, {report.stdout.strip()} {report.stderr.strip()}"
    )
    assert verify(f"{backend}://{fresh}", "--delete").returncode == 0
    assert json.loads(verify(f"{backend}://{fresh}").stdout) == {"checked": 2, "bad": [], "deleted": 0}


# -- whole files cut short, replaced or removed ---------------------------------------------------


def _cut(path: Path, size: Callable[[int], int]) -> None:
    os.truncate(path, size(path.stat().st_size))


#: name -> (backend, damage(store directory)); the store must refuse to open with a clean error.
REFUSED: dict[str, tuple[str, Callable[[Path], object]]] = {
    "lmdb data.mdb cut in half": ("lmdb", lambda d: _cut(d / "data.mdb", lambda n: n // 2)),
    "lmdb data.mdb lost its last page": ("lmdb", lambda d: _cut(d / "data.mdb", lambda n: n - 4096)),
    "lmdb data.mdb lost its last byte": ("lmdb", lambda d: _cut(d / "data.mdb", lambda n: n - 1)),
    "lmdb data.mdb cut to one page": ("lmdb", lambda d: _cut(d / "data.mdb", lambda n: 4096)),
    "lmdb data.mdb cut to 100 bytes": ("lmdb", lambda d: _cut(d / "data.mdb", lambda n: 100)),
    "lmdb data.mdb is garbage": ("lmdb", lambda d: garbage(d / "data.mdb", (d / "data.mdb").stat().st_size)),
    "lmdb data.mdb is a text file": ("lmdb", lambda d: (d / "data.mdb").write_text("not a database\n" * 1000)),
    "diskcache cache.db cut in half": ("diskcache", lambda d: _cut(d / "cache.db", lambda n: n // 2)),
    "diskcache cache.db cut to 100 bytes": ("diskcache", lambda d: _cut(d / "cache.db", lambda n: 100)),
    "diskcache cache.db is garbage": ("diskcache", lambda d: garbage(d / "cache.db", (d / "cache.db").stat().st_size)),
    "lmdb data.mdb replaced by a directory": ("lmdb", lambda d: _replace_with_directory(d / "data.mdb")),
    "lmdb lock.mdb replaced by a directory": ("lmdb", lambda d: _replace_with_directory(d / "lock.mdb")),
    "diskcache cache.db replaced by a directory": ("diskcache", lambda d: _replace_with_directory(d / "cache.db")),
}


def _replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_damaged_store_file_is_refused_cleanly(case: str, store_dir: Path) -> None:
    scheme, damage = REFUSED[case]
    url = f"{scheme}://{store_dir}"
    build_store(url)
    damage(store_dir)

    out = probe(url)  # asserts no signal (SIGBUS from a mapped page past the end of the file) and exit 0
    assert str(out["open"]).startswith("raised sippcache.errors."), (
        f"expected opening to raise a SippcacheError (CorruptStore) naming the store, got: {out['open']}"
    )
    assert str(store_dir) in str(out["open"]), out
    assert_one_line_error(verify(url), str(store_dir))


@pytest.mark.parametrize("backend_and_file", ["lmdb:data.mdb", "diskcache:cache.db"])
def test_store_file_cut_to_nothing_is_an_empty_store_or_refused(backend_and_file: str, store_dir: Path) -> None:
    """A zero-length database file is what a brand-new store looks like: it may be
    taken as empty (every lookup a miss) or refused, but never crash."""
    scheme, name = backend_and_file.split(":")
    url = f"{scheme}://{store_dir}"
    build_store(url)
    os.truncate(store_dir / name, 0)
    out = probe(url)
    no_wrong_answers(out)
    if out["open"] != "ok":
        assert str(out["open"]).startswith("raised sippcache.errors."), out
        return
    assert out["len"] == 0 and {out[f"lookup {len(k)}"] for k, *_ in ENTRIES} == {"miss"}, out
    assert out["store"] == "ok" and out["lookup new"] == "ok", out


#: Files whose damage loses nothing: LMDB rebuilds its lock file when no process holds it,
#: and SQLite ignores a WAL whose header and frame checksums do not match.
HARMLESS: dict[str, tuple[str, Callable[[Path], object]]] = {
    "lmdb lock.mdb is garbage": ("lmdb", lambda d: garbage(d / "lock.mdb", (d / "lock.mdb").stat().st_size)),
    "lmdb lock.mdb cut to 100 bytes": ("lmdb", lambda d: _cut(d / "lock.mdb", lambda n: 100)),
    "lmdb lock.mdb removed": ("lmdb", lambda d: (d / "lock.mdb").unlink()),
    "diskcache garbage -wal and -shm": (
        "diskcache",
        lambda d: (garbage(d / "cache.db-wal", 50_000), garbage(d / "cache.db-shm", 32_768)),
    ),
}


@pytest.mark.parametrize("case", sorted(HARMLESS))
def test_damaged_auxiliary_files_lose_nothing(case: str, store_dir: Path) -> None:
    scheme, damage = HARMLESS[case]
    url = f"{scheme}://{store_dir}"
    out = probe_damaged(url, lambda: damage(store_dir))
    assert {out[f"lookup {len(k)}"] for k, *_ in ENTRIES} == {"ok"}, out
    assert out["store"] == "ok" and out["lookup new"] == "ok", out
    assert json.loads(verify(url).stdout) == {"checked": 3, "bad": [], "deleted": 0}


# -- the llama adapter on a damaged store: never restored, same logits as never cached --------


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


def _frame_offsets(data: bytes) -> list[tuple[int, int]]:
    """(start, header length) of every whole, undamaged sippcache frame in `data`.

    Only frames that decode: the unused part of a page can hold stale bytes
    (of a page it was copied from, or, with LMDB's meminit off, of the heap),
    among them the start of a frame; damaging "its" header would hit whatever
    record lies there instead."""
    found = []
    for m in re.finditer(re.escape(frame.MAGIC), data):
        _, _, header_len, _ = struct.unpack_from("<8sHIQ", data, m.start())
        body = m.start() + 22
        try:
            sizes = msgpack.unpackb(data[body : body + header_len])["sizes"]
            frame.decode(data[m.start() : body + header_len + sum(sizes)])
        except Exception:  # not a whole frame: stale bytes
            continue
        found.append((m.start(), header_len))
    return found


def _damage_llama_entry(store: Path, backend: str, where: str) -> None:
    """Flip one byte of the stored llama state (payload) or of its frame header, in place."""
    path = store / "data.mdb" if backend == "lmdb" else value_files(store)[0]
    data = bytearray(path.read_bytes())
    frames = _frame_offsets(bytes(data))
    assert frames, f"no frame found in {path}"
    for start, header_len in frames:
        payload = start + 22 + header_len
        data[payload + 4321 if where == "payload" else start + 22 + header_len // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_prefix_cache_never_restores_a_damaged_entry(
    make_llama, tiny_model, backend, where, store_dir, monkeypatch
) -> None:
    import llama_cpp

    from sippcache.llama import PrefixCache

    url = f"{backend}://{store_dir}"
    tokens = _prompt(120)
    # Whole states: one entry, so the damage and the entry stored in its place are the same one
    # (a damaged chunk: tests/test_chunks.py::test_damaged_chunks_are_deleted_and_give_the_shorter_run).
    with PrefixCache(make_llama(tiny_model, n_ctx=256), url, chunk_tokens=0) as pc:
        pc.prefill(tokens)
    _damage_llama_entry(store_dir, backend, where)
    _, never_cached = reference_logits(make_llama, tiny_model, tokens, n_ctx=256)  # the split a miss makes

    restored = []
    real_set_data = llama_cpp.llama_state_seq_set_data

    def set_data(*args):
        restored.append(args[2])
        return real_set_data(*args)

    monkeypatch.setattr(llama_cpp, "llama_state_seq_set_data", set_data)
    llm = make_llama(tiny_model, n_ctx=256)
    with PrefixCache(llm, url, chunk_tokens=0) as pc:
        assert pc.prefill(tokens) == 0
        stats = pc.stats()
    assert restored == [], "a damaged entry was handed to llama.cpp"
    assert (stats["hits"], stats["corrupt_entries"], stats["rejected_entries"], stats["backend_errors"]) == (0, 1, 0, 0)
    np.testing.assert_array_equal(last_logits(llm), never_cached)
    # The damaged entry was dropped and the prefill stored a fresh one in its place.
    report = verify(url)
    assert report.returncode == 0 and json.loads(report.stdout)["bad"] == [], report.stdout
    with sippcache.open(url) as cache, cache.lookup(tokens[:-1], namespace=pc.namespace) as match:
        assert match.length == 119 and frame.decode(match.blob).tokens == tuple(tokens[:-1])


def test_prefix_cache_never_restores_an_entry_framed_for_another_key(make_llama, tiny_model, store_dir) -> None:
    """A well-formed entry stored under the wrong key (a mix-up, or a file copied over
    another) is dropped: its header names other tokens."""
    from sippcache.llama import PrefixCache

    url = f"lmdb://{store_dir}"
    a, b = _prompt(120, seed=1), _prompt(120, seed=2)
    with PrefixCache(make_llama(tiny_model, n_ctx=256), url) as pc:
        pc.prefill(a)
        namespace = pc.namespace
    with sippcache.open(url) as cache:
        with cache.lookup(a[:-1], namespace=namespace) as match:
            blob_for_a = bytes(match.blob)
        cache.store(b[:-1], blob_for_a, namespace=namespace)
    _, never_cached = reference_logits(make_llama, tiny_model, b, n_ctx=256)
    llm = make_llama(tiny_model, n_ctx=256)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(b) == 0
        assert pc.stats()["corrupt_entries"] == 1 and pc.stats()["hits"] == 0
    np.testing.assert_array_equal(last_logits(llm), never_cached)
