"""The index snapshot: a store opened from it answers exactly as one that reads every entry.

Stores of at least `INDEX_SNAPSHOT_MIN_ENTRIES` entries save their catalog (`I`, at log
record `J`) on close; the next process loads it and replays the log after it.
Every test here uses real LMDB stores (one diskcache store too), another
process where the brief says "another process", and compares what a store
answers with what a copy of it without the snapshot answers (every entry read
from its records): entries, sizes, pins, priorities, recency order, lookups.
"""

from __future__ import annotations

import logging
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lmdb
import pytest

import sippcache
from sippcache import tokens
from sippcache.catalog import SNAPSHOT_MAGIC, Budget, Catalog, EntryState, Put
from sippcache.engine.layout import (
    ENTRY_PREFIXES,
    KEY_INDEX_SNAPSHOT,
    KEY_INDEX_SNAPSHOT_SEQ,
    LOG_KEEP,
    PREFIX_BLOB,
    entry_id,
    log_key,
)
from sippcache.engine.replica import INDEX_SNAPSHOT_MIN_ENTRIES
from sippcache.index import IndexHit, PrefixIndex

ENTRIES = INDEX_SNAPSHOT_MIN_ENTRIES + 200
PREFIXES = [list(range(1000 * p, 1000 * p + 40 + 10 * p)) for p in range(3)]


def key(i: int) -> list[int]:
    """The i-th key: one of three shared prefixes plus a suffix of its own."""
    return PREFIXES[i % 3] + [5000 + i, *range(i % 7)]


def namespace(i: int) -> str:
    return "a" if i % 2 else "b"


def eid_of(i: int) -> bytes:
    """The engine's id of the i-th entry."""
    return entry_id(namespace(i), tokens.encode(key(i)))


def url(path: Path, scheme: str = "lmdb") -> str:
    return f"{scheme}://{path}?max_bytes=1GiB" + ("&sync=false" if scheme == "lmdb" else "")


def build(path: Path, entries: int = ENTRIES, scheme: str = "lmdb") -> None:
    """A store of `entries` entries (some pinned, some with a priority, a few used), closed: with its snapshot."""
    with sippcache.open(url(path, scheme)) as cache:
        for i in range(entries):
            cache.store(key(i), b"blob %d" % i, namespace=namespace(i), pinned=i % 50 == 0, priority=i % 3 or None)
        for i in range(0, entries, 9):
            cache.lookup(key(i) + [1, 2], namespace=namespace(i)).release()


def contents(cache: Any) -> list[tuple[Any, ...]]:
    """Everything a store says about its entries, in its recency order."""
    return [
        (e.namespace, e.key, e.size, e.created, e.last_used, e.priority, e.pinned, e.generation)
        for e in cache.entries()
    ]


def lmdb_records(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), subdir=True, max_dbs=0, map_size=2**30)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def edit_lmdb(path: Path, put: dict[bytes, bytes] | None = None, delete: tuple[bytes, ...] = ()) -> None:
    """Change records behind the engine's back (what damage or another program would do)."""
    env = lmdb.open(str(path), subdir=True, max_dbs=0, map_size=2**30)
    try:
        with env.begin(write=True) as txn:
            for k, v in (put or {}).items():
                txn.put(k, v)
            for k in delete:
                txn.delete(k)
    finally:
        env.close()


def without_snapshot(path: Path, tmp_path: Path) -> list[tuple[Any, ...]]:
    """What a copy of the store at `path` says when it has no snapshot (every entry read)."""
    copy = tmp_path / f"copy-of-{path.name}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(path, copy)
    edit_lmdb(copy, delete=(KEY_INDEX_SNAPSHOT, KEY_INDEX_SNAPSHOT_SEQ))
    cache = sippcache.open(url(copy))
    try:
        count = len(cache)  # the first operation loads the index
        assert cache._replica.read_every_entry or count == 0
        return contents(cache)
    finally:
        cache.close()


def opened_from_snapshot(path: Path) -> Any:
    """Open the store, load its index (the first operation) and check it came from the snapshot."""
    cache = sippcache.open(url(path))
    len(cache)
    assert not cache._replica.read_every_entry, "the store was read entry by entry, not from its snapshot"
    return cache


def in_another_process(path: Path, code: str) -> None:
    script = textwrap.dedent(
        f"""
        import sippcache
        from tests.test_index_snapshot import key, namespace
        cache = sippcache.open({url(path)!r})
        """
    ) + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_snapshot_written_on_close_and_loaded_with_the_same_answers(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    records = lmdb_records(store)
    assert KEY_INDEX_SNAPSHOT in records and KEY_INDEX_SNAPSHOT_SEQ in records
    cache = opened_from_snapshot(store)
    try:
        assert len(cache) == ENTRIES
        assert contents(cache) == without_snapshot(store, tmp_path)
        for i in random.Random(0).sample(range(ENTRIES), 50):
            with cache.lookup(key(i) + [9], namespace=namespace(i)) as match:
                assert (match.key, bytes(match.blob)) == (tuple(key(i)), b"blob %d" % i)
            shorter = cache.lookup(key(i)[:-1], namespace=namespace(i), partial=True)
            assert shorter is not None and shorter.length == len(key(i)) - 1
            shorter.release()
        assert cache.lookup(key(1), namespace="b") is None  # namespaces stay apart
        assert cache.stats().pinned == len(range(0, ENTRIES, 50))
    finally:
        cache.close()


def test_small_stores_get_no_snapshot(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store, entries=INDEX_SNAPSHOT_MIN_ENTRIES - 1)
    assert KEY_INDEX_SNAPSHOT not in lmdb_records(store)


def test_a_read_only_handle_loads_the_snapshot_and_never_writes_one(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    cache = sippcache.open(url(store), read_only=True)
    try:
        assert len(cache) == ENTRIES and not cache._replica.read_every_entry
        with cache.lookup(key(3), namespace=namespace(3)) as match:
            assert bytes(match.blob) == b"blob 3"
    finally:
        cache.close()
    edit_lmdb(store, delete=(KEY_INDEX_SNAPSHOT, KEY_INDEX_SNAPSHOT_SEQ))
    with sippcache.open(url(store), read_only=True) as cache:
        assert len(cache) == ENTRIES  # read entry by entry
    assert KEY_INDEX_SNAPSHOT not in lmdb_records(store)


def test_reopen_after_another_process_stored_and_deleted(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    in_another_process(
        store,
        f"""
        for i in range({ENTRIES}, {ENTRIES} + 30):
            cache.store(key(i), b"late %d" % i, namespace=namespace(i))
        for i in range(0, 60, 2):
            assert cache.delete(key(i), namespace=namespace(i))
        cache.store(key(1), b"replaced", namespace=namespace(1))
        cache.pin(key(3), namespace=namespace(3))
        cache.close()
    """,
    )
    records = lmdb_records(store)
    assert records[b"S"] > records[KEY_INDEX_SNAPSHOT_SEQ], "the other process must not have rewritten the snapshot"
    cache = opened_from_snapshot(store)
    try:
        assert contents(cache) == without_snapshot(store, tmp_path)
        for i in range(0, 60, 2):
            match = cache.lookup(key(i), namespace=namespace(i))
            assert match is None or len(match.key) < len(key(i)), f"deleted entry {i} came back"
            if match is not None:
                match.release()
        for i in range(ENTRIES, ENTRIES + 30):
            with cache.lookup(key(i), namespace=namespace(i)) as match:
                assert bytes(match.blob) == b"late %d" % i
        with cache.lookup(key(1), namespace=namespace(1)) as match:
            assert bytes(match.blob) == b"replaced"
        assert len(cache) == ENTRIES + 30 - 30
    finally:
        cache.close()


def test_another_process_writing_while_this_one_has_the_store_open(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    cache = opened_from_snapshot(store)
    try:
        in_another_process(
            store,
            """
            assert cache.delete(key(5), namespace=namespace(5))
            cache.store([1, 2, 3], b"new", namespace="c")
            cache.close()
        """,
        )
        match = cache.lookup(key(5), namespace=namespace(5))
        assert match is None or len(match.key) < len(key(5))
        with cache.lookup([1, 2, 3, 4], namespace="c") as match:
            assert bytes(match.blob) == b"new"
    finally:
        cache.close()


def test_snapshot_older_than_the_trimmed_log_is_not_used(tmp_path: Path) -> None:
    """More than 2 x LOG_KEEP records after the snapshot: the log it needs is trimmed, so
    the next open reads every entry (and its close writes a fresh snapshot)."""
    store = tmp_path / "store"
    build(store)
    snapshot_at = int.from_bytes(lmdb_records(store)[KEY_INDEX_SNAPSHOT_SEQ], "little")
    in_another_process(
        store,
        f"""
        import os
        for n in range({2 * LOG_KEEP + 10}):
            cache.pin(key(7), namespace=namespace(7)) if n % 2 else cache.unpin(key(7), namespace=namespace(7))
        cache.delete(key(8), namespace=namespace(8))
        os._exit(0)  # a writer that never closes (a server, a crash): it saves no snapshot
    """,
    )
    records = lmdb_records(store)
    assert int.from_bytes(records[b"T"], "little") > snapshot_at
    assert int.from_bytes(records[KEY_INDEX_SNAPSHOT_SEQ], "little") == snapshot_at
    cache = sippcache.open(url(store))
    try:
        assert contents(cache) == without_snapshot(store, tmp_path)  # contents() loads the index first
        assert cache._replica.read_every_entry
        assert cache.lookup(key(8), namespace=namespace(8)) is None
    finally:
        cache.close()
    assert int.from_bytes(lmdb_records(store)[KEY_INDEX_SNAPSHOT_SEQ], "little") > snapshot_at
    opened_from_snapshot(store).close()


@pytest.mark.parametrize("damage", ["flipped byte", "cut short", "empty", "garbage", "other version"])
def test_damaged_snapshot_falls_back_to_reading_every_entry(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    build(store)
    expected = without_snapshot(store, tmp_path)
    raw = bytearray(lmdb_records(store)[KEY_INDEX_SNAPSHOT])
    if damage == "flipped byte":
        raw[len(raw) // 2] ^= 0x04
    elif damage == "cut short":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = bytearray()
    elif damage == "garbage":
        raw = bytearray(random.Random(1).randbytes(len(raw)))
    else:
        raw[: len(SNAPSHOT_MAGIC)] = SNAPSHOT_MAGIC.replace(b"-1", b"-9")
    if raw:
        edit_lmdb(store, put={KEY_INDEX_SNAPSHOT: bytes(raw)})
    else:
        edit_lmdb(store, delete=(KEY_INDEX_SNAPSHOT,))
    with caplog.at_level(logging.WARNING, logger="sippcache"):
        cache = sippcache.open(url(store))
        try:
            assert contents(cache) == expected
            assert cache._replica.read_every_entry
            with cache.lookup(key(11), namespace=namespace(11)) as match:
                assert bytes(match.blob) == b"blob 11"
        finally:
            cache.close()
    if damage not in ("empty",):
        assert "snapshot is damaged" in caplog.text
    opened_from_snapshot(store).close()  # closing wrote a good one


def test_a_missing_log_record_after_the_snapshot_means_reading_every_entry(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    in_another_process(
        store,
        f"""
        for i in range({ENTRIES}, {ENTRIES} + 5):
            cache.store(key(i), b"late", namespace=namespace(i))
        cache.close()
    """,
    )
    records = lmdb_records(store)
    after_snapshot = int.from_bytes(records[KEY_INDEX_SNAPSHOT_SEQ], "little") + 2
    edit_lmdb(store, delete=(log_key(after_snapshot),))
    cache = sippcache.open(url(store))
    try:
        assert contents(cache) == without_snapshot(store, tmp_path)
        assert cache._replica.read_every_entry and len(cache) == ENTRIES + 5
    finally:
        cache.close()


def test_entries_deleted_after_the_snapshot_without_a_log_record_are_misses(tmp_path: Path) -> None:
    """An entry whose records vanished behind the engine's back (no log record) is not handed out."""
    store = tmp_path / "store"
    build(store)
    eid = eid_of(13)
    assert b"M" + eid in lmdb_records(store)
    edit_lmdb(store, delete=tuple(prefix + eid for prefix in ENTRY_PREFIXES if prefix != PREFIX_BLOB))
    cache = opened_from_snapshot(store)
    try:
        match = cache.lookup(key(13) + [1], namespace=namespace(13))
        assert match is None or len(match.key) < len(key(13))
        assert len(cache) == ENTRIES - 1
    finally:
        cache.close()


def test_damaged_entry_record_after_the_snapshot_is_found_on_use_and_purged(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    ids = [eid_of(20), eid_of(21)]
    edit_lmdb(store, put={b"M" + eid: b"\xc1 not msgpack" for eid in ids})
    cache = opened_from_snapshot(store)
    try:
        match = cache.lookup(key(20) + [1], namespace=namespace(20))
        assert match is None or len(match.key) < len(key(20))
        assert cache.stats().damaged == 1
        assert cache.purge_damaged() == 2  # every record read: the one not looked up is found too
        assert cache.stats().damaged == 0 and len(cache) == ENTRIES - 2
    finally:
        cache.close()
    assert all(b"M" + eid not in lmdb_records(store) for eid in ids)


def test_clear_after_the_snapshot(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    keeper = opened_from_snapshot(store)  # open before the clear: it must see it
    try:
        in_another_process(store, "cache.clear(); cache.close()")
        assert len(keeper) == 0 and keeper.lookup(key(1), namespace=namespace(1)) is None
    finally:
        keeper.close()
    records = lmdb_records(store)
    assert KEY_INDEX_SNAPSHOT not in records and KEY_INDEX_SNAPSHOT_SEQ not in records
    with sippcache.open(url(store)) as cache:
        assert len(cache) == 0 and list(cache.entries()) == []
        cache.store(key(1), b"after", namespace=namespace(1))
    with sippcache.open(url(store)) as cache:
        assert [e.key for e in cache.entries()] == [tuple(key(1))]


def test_clear_by_a_process_that_did_not_remove_the_snapshot(tmp_path: Path) -> None:
    """A snapshot older than a clear record is brought up to date by replaying it."""
    store = tmp_path / "store"
    build(store)
    snapshot = lmdb_records(store)[KEY_INDEX_SNAPSHOT]
    in_another_process(store, "cache.clear(); cache.store([4, 5], b'x'); cache.close()")
    edit_lmdb(store, put={KEY_INDEX_SNAPSHOT: snapshot})  # the old snapshot back: its position is before the clear
    cache = sippcache.open(url(store))
    try:
        assert [e.key for e in cache.entries()] == [(4, 5)]
    finally:
        cache.close()


def test_diskcache_store_uses_the_snapshot_too(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store, scheme="diskcache")
    cache = sippcache.open(url(store, "diskcache"))
    try:
        assert len(cache) == ENTRIES and not cache._replica.read_every_entry
        with cache.lookup(key(17) + [3], namespace=namespace(17)) as match:
            assert bytes(match.blob) == b"blob 17"
    finally:
        cache.close()


# -- the catalog and index dumps themselves ---------------------------------------------------


def _random_catalog(seed: int) -> Catalog:
    rng = random.Random(seed)
    catalog = Catalog()
    for n in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        raw = b"".join(t.to_bytes(4, "little") for t in tokens)
        ns = rng.choice(["", "x"])
        state = EntryState(
            ns,
            len(tokens),
            10 + len(raw),
            1.0,
            n,
            n,
            rng.randrange(10**6),
            rng.random(),
            rng.random() < 0.1,
            rng.random() < 0.2,
        )
        catalog.apply(Put(ns.encode() + raw, raw, state))
    catalog.clock = 1.5
    return catalog


@pytest.mark.parametrize("seed", range(5))
def test_catalog_snapshot_round_trip_answers_the_same(seed: int) -> None:
    catalog = _random_catalog(seed)
    loaded = Catalog.from_snapshot(catalog.snapshot(42))
    assert loaded is not None
    copy, position = loaded
    assert position == 42 and copy.clock == catalog.clock and len(copy) == len(catalog)
    assert (copy.total, copy.pinned_bytes, copy.pinned_count) == (
        catalog.total,
        catalog.pinned_bytes,
        catalog.pinned_count,
    )
    for eid in catalog.ids():
        assert copy.get(eid) == catalog.get(eid)
        assert copy.index.key_of(eid) == catalog.index.key_of(eid)
    rng = random.Random(seed)
    for _ in range(300):
        query = b"".join(rng.randrange(4).to_bytes(4, "little") for _ in range(rng.randrange(1, 14)))
        for ns in ("", "x"):
            assert copy.index.longest_prefix(ns, query) == catalog.index.longest_prefix(ns, query)
            assert copy.index.longest_common(ns, query) == catalog.index.longest_common(ns, query)
    assert copy.victims(Budget(catalog.total // 2)) == catalog.victims(Budget(catalog.total // 2))


def test_catalog_snapshot_refuses_every_single_flipped_byte() -> None:
    raw = _random_catalog(0).snapshot(1)
    for position in range(0, len(raw), max(1, len(raw) // 200)):
        damaged = bytearray(raw)
        damaged[position] ^= 0x20
        assert Catalog.from_snapshot(bytes(damaged)) is None, position


def test_index_load_refuses_malformed_dumps() -> None:
    index = PrefixIndex()
    index.insert("", b"\1\0\0\0\2\0\0\0", b"id-1", 1)
    index.insert("", b"\1\0\0\0\3\0\0\0", b"id-2", 2)
    good = index.dump()
    fresh = PrefixIndex()
    fresh.load(good)
    assert fresh.longest_prefix("", b"\1\0\0\0\3\0\0\0\4\0\0\0") == IndexHit(b"id-2", 2)
    assert fresh.longest_common("", b"\1\0\0\0") == IndexHit(b"id-2", 1)  # the most recent of both
    ns, edges, parents, entries, ranks = good[0]
    for bad in (
        [[ns, edges, [5] * len(parents), entries, ranks]],  # a parent after its child
        [[ns, [b"\1\0\0"] * len(edges), parents, entries, ranks]],  # an edge of part of a token
        [[ns, edges, parents, ["id"] * len(entries), ranks]],  # ids that are not bytes
        [[ns, edges, parents, entries, [0.5] * len(ranks)]],  # ranks that are not integers
        [[ns, edges[:-1], parents, entries, ranks]],  # columns of different lengths
        good + good,  # a namespace twice
    ):
        with pytest.raises(ValueError):
            PrefixIndex().load(bad)


def test_chains_of_chunk_keys_read_entry_by_entry_answer_as_where_they_were_stored(tmp_path: Path) -> None:
    """Chunk entries are keyed by their whole prefix, each a chunk longer than the last: a new
    handle reads them (no snapshot below `INDEX_SNAPSHOT_MIN_ENTRIES`) longest key first, and must
    answer every lookup as the handle that stored them, whatever order they were stored in."""
    rng = random.Random(7)
    trunk = [rng.randrange(1, 50_000) for _ in range(64 * 40)]
    branch = trunk[: 64 * 25] + [rng.randrange(1, 50_000) for _ in range(64 * 10)]
    keys = [trunk[: 64 * k] for k in range(1, 41)] + [branch[: 64 * k] for k in range(26, 36)]
    rng.shuffle(keys)
    queries = [trunk + [9], branch + [9], trunk[:1000], branch[: 64 * 30 + 5], [*trunk[:700], 3], [4]]

    def answers(cache: Any) -> list[Any]:
        found = []
        for query in queries:
            match = cache.lookup(query, namespace="chunks")
            found.append(None if match is None else match.length)
            if match is not None:
                match.release()
            chain = cache.lookup_prefixes(query, list(range(64, len(query) + 1, 64)), namespace="chunks")
            found.append([m.length for m in chain])
            for m in chain:
                m.release()
        return found + [(e.key, e.size) for e in sorted(cache.entries(), key=lambda e: e.key)]

    with sippcache.open(url(tmp_path / "store")) as cache:
        for k in keys:
            cache.store(k, b"chunk %d" % len(k), namespace="chunks")
        stored = answers(cache)
    with sippcache.open(url(tmp_path / "store")) as cache:
        assert answers(cache) == stored
        assert cache._replica.read_every_entry
    assert stored[0] == len(trunk) and stored[1] == [64 * k for k in range(1, 41)]
