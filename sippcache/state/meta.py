"""The meta part of a state cut into chunks: what is not per cell, written by `cut`, read by `joined`.

It holds the layout version, the sequence id, whether the state had
`llama_state_seq_get_data`'s header and cell extensions, and each chunked cache's stream
count and per-layer K/V types and sizes. It does not depend on how many positions the
state holds, so a longer state with the same layout has the same meta (docs/stateformat.md,
"Chunks"). The tail (the caches not chunked) starts with the positions it belongs to.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .parsing import Reader
from .seqstate import (
    CELL_EXT_SIZE,
    K_HEAD,
    MAX_CACHES,
    MAX_LAYERS,
    MAX_STREAMS,
    PAIR,
    VERSIONS,
    VT_HEAD,
    Buffer,
    SeqState,
    Stream,
    data_head,
)

__all__ = ["META_MAGIC"]

#: The meta part's magic and layout version.
META_MAGIC = b"SIPPSTM\x01"
META_HEAD = struct.Struct("<8sIIiiII")  # magic, flags, version, seq id, header seq id, caches, chunked
FLAG_HEADER, FLAG_EXT = 1, 2
TAIL_HEAD = struct.Struct("<Q")
META_CACHE = struct.Struct("<Ii")  # stream count, the stream holding the cells (-1: none)


def write_meta(state: SeqState, runs: Sequence[tuple[int, Stream] | None], seq_id: int) -> bytes:
    """The meta part of `state` cut with its first len(`runs`) caches chunked (`runs`: each one's
    stream holding its cells, and its index; None where it holds none)."""
    flags = (FLAG_HEADER if state.header_seq_id is not None else 0) | (FLAG_EXT if state.cell_ext else 0)
    meta = [
        META_HEAD.pack(META_MAGIC, flags, state.version, seq_id, state.header_seq_id or 0, len(state.caches), len(runs))
    ]
    for cache, found in zip(state.caches[: len(runs)], runs, strict=True):
        meta.append(META_CACHE.pack(len(cache.streams), -1 if found is None else found[0]))
        if found is not None:
            stream = found[1]
            meta.extend(data_head(stream))
            for layer in stream.layers:
                meta.append(K_HEAD.pack(layer.k_type, layer.k_row))
            for layer in stream.layers:
                if layer.v_transposed:
                    meta.append(VT_HEAD.pack(layer.v_type, layer.v_size, layer.v_dims))
                else:
                    meta.append(K_HEAD.pack(layer.v_type, layer.v_size))
    return b"".join(meta)


@dataclass(frozen=True)
class CacheMeta:
    """One chunked cache as its meta part describes it: its streams and its layers' types and
    sizes, all a join needs besides the chunks' cells."""

    n_stream: int
    active: int
    v_trans: bool
    rotation: tuple[int, int] | None
    k: tuple[tuple[int, int], ...]  # (type, row) per layer
    v: tuple[tuple[int, int, int], ...]  # (type, size, dims) per layer

    def bytes_per_cell(self, ext: bool) -> int:
        k = sum(row for _, row in self.k)
        v = sum(size * max(1, dims) for _, size, dims in self.v)
        return (CELL_EXT_SIZE if ext else 0) + k + v


def read_meta(meta: Buffer) -> tuple[int, int, int, int, int, int, list[CacheMeta]]:
    """A meta part's flags, version, sequence id, header sequence id, cache count, chunked cache
    count and chunked caches; `UnsupportedState` where it is not one `write_meta` wrote."""
    reader = Reader(memoryview(meta).cast("B"), 0)
    magic, flags, version, seq_id, header_seq_id, n_caches, chunked = reader.unpack(META_HEAD, "the meta header")
    if magic != META_MAGIC:
        raise reader.fail("not a chunked state's meta part")
    if version not in VERSIONS or flags > 3 or not 1 <= chunked <= n_caches <= MAX_CACHES:
        raise reader.fail("a meta part of an unknown layout")
    caches: list[CacheMeta] = []
    for _ in range(chunked):
        n_stream, active = reader.unpack(META_CACHE, "a cache's stream count")
        if not 1 <= n_stream <= MAX_STREAMS or not -1 <= active < int(n_stream):
            raise reader.fail("a cache of an impossible stream layout")
        if active < 0:
            caches.append(CacheMeta(n_stream, active, False, None, (), ()))
            continue
        v_trans, n_layer = reader.unpack(PAIR, "a cache's layer count")
        if v_trans > 1 or n_layer > MAX_LAYERS:
            raise reader.fail("a cache of an impossible layer layout")
        rotation = tuple(reader.unpack(PAIR, "rotations")) if version >= 4 else None
        k = tuple(tuple(reader.unpack(K_HEAD, "a K header")) for _ in range(n_layer))
        v = tuple(
            tuple(reader.unpack(VT_HEAD, "a V header")) if v_trans else (*reader.unpack(K_HEAD, "a V header"), 0)
            for _ in range(n_layer)
        )
        if any(row <= 0 for _, row in k) or any(size <= 0 for _, size, _ in v):
            raise reader.fail("a layer of no bytes per cell")
        caches.append(CacheMeta(n_stream, active, bool(v_trans), rotation, k, v))
    if reader.left():
        raise reader.fail("bytes after the meta part's layers")
    return flags, version, seq_id, header_seq_id, n_caches, chunked, caches
