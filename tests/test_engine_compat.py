"""Stores written before pins, priorities and generations still open and work."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import lmdb
import msgpack

import sippcache
from sippcache.engine import entry_id


def _write_old_store(path: Path, entries: list[tuple[list[int], bytes, int]]) -> None:
    """An LMDB store in the first layout: M = [namespace, key, size, created], no V or G records."""
    path.mkdir()
    env = lmdb.open(str(path), map_size=64 * 1024**2, subdir=True)
    with env.begin(write=True) as txn:
        for seq, (tokens, blob, used) in enumerate(entries, start=1):
            key = struct.pack(f"<{len(tokens)}I", *tokens)
            eid = entry_id("old", key)
            txn.put(b"B" + eid, blob)
            txn.put(b"M" + eid, msgpack.packb(["old", key, len(blob) + len(key), used], use_bin_type=True))
            txn.put(b"U" + eid, struct.pack("<Q", used))
            txn.put(b"L" + struct.pack(">Q", seq), msgpack.packb(["p", eid], use_bin_type=True))
        txn.put(b"S", struct.pack("<Q", len(entries)))
    env.close()


def test_old_layout_loads_with_defaults_and_keeps_its_order(tmp_path: Path) -> None:
    now = time.time_ns()
    _write_old_store(
        tmp_path / "store",
        [([1, 2, 3], b"a" * 1000, now - 3), ([4, 5], b"b" * 1000, now - 2), ([6], b"c" * 1000, now - 1)],
    )
    with sippcache.open(f"lmdb://{tmp_path}/store?max_bytes=3100") as cache:
        assert len(cache) == 3
        with cache.lookup([1, 2, 3, 9], namespace="old") as match:
            assert bytes(match.blob) == b"a" * 1000
        info = {tuple(e.key): e for e in cache.entries()}
        assert info[(1, 2, 3)].priority == 3 and info[(4, 5)].priority == 2
        assert info[(6,)].generation == now - 1 and not info[(6,)].pinned
        cache.store([7], b"d" * 1000, namespace="old")  # over budget: the least recently used goes
        assert cache.lookup([4, 5], namespace="old", touch=False) is None
        assert cache.lookup([1, 2, 3], namespace="old", touch=False) is not None
        assert cache.pin([6], namespace="old")
    with sippcache.open(f"lmdb://{tmp_path}/store") as again:
        assert {tuple(e.key): e.pinned for e in again.entries()} == {(1, 2, 3): False, (6,): True, (7,): False}


def test_entry_ids_are_the_documented_hash() -> None:
    """docs/format.md: an entry's id is xxh3_128(u64le(len(namespace)) + namespace + token bytes),
    namespace in UTF-8: stores written by any version address their entries so."""
    import xxhash

    for namespace in ("", "old", "modèle/scope"):
        for key in (b"", struct.pack("<3I", 1, 2, 3), bytes(range(256)) * 512):
            ns = namespace.encode("utf-8")
            assert entry_id(namespace, key) == xxhash.xxh3_128_digest(struct.pack("<Q", len(ns)) + ns + key)
