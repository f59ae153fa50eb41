"""Reading a llama.cpp sequence state: its bytes as `SeqState`'s zero-copy views.

llama.cpp does not say which layout a state has (a slot file says its version, but
`llama_state_seq_get_data`'s output does not, and neither says whether cell records carry
extensions), so `parse` tries each it knows and keeps the one that reads the whole buffer
consistently. Whatever it does not understand (another layout version, recurrent memory,
sizes that do not add up) raises `UnsupportedState`: the caller then stores the whole state
as it is.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

from .seqstate import (
    CELL,
    CELL_EXT_SIZE,
    DSV4_STATE_MAGIC,
    K_HEAD,
    KV_TYPES,
    MAX_CACHES,
    MAX_LAYERS,
    MAX_STREAMS,
    PAIR,
    SEQ_HEAD,
    SEQ_STATE_MAGIC,
    U32,
    VERSIONS,
    VT_HEAD,
    Buffer,
    Cache,
    Layer,
    SeqState,
    Stream,
    UnsupportedState,
    read_ints,
)

__all__ = ["parse"]


class _Recognized(UnsupportedState):
    """A memory this package recognizes and does not read (recurrent, DeepSeek V4): no other
    layout guess is tried."""


class Reader:
    """A cursor over a state's bytes whose failures say where it stopped (`UnsupportedState.at`);
    the meta part of a cut state is read with one too (`sippcache.state.meta.read_meta`)."""

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
        return int(self.unpack(U32, what)[0])

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
    has_header = header if header is not None else (len(view) >= 4 and U32.unpack_from(view)[0] == SEQ_STATE_MAGIC)
    header_seq_id: int | None = None
    base = 0
    if has_header:
        if len(view) < SEQ_HEAD.size or SEQ_HEAD.unpack_from(view)[0] != SEQ_STATE_MAGIC:
            raise UnsupportedState("not a llama.cpp sequence state: bad header magic", 0)
        header_seq_id = SEQ_HEAD.unpack_from(view)[1]
        view, base = view[SEQ_HEAD.size :], SEQ_HEAD.size
    errors: list[tuple[bool, int, UnsupportedState]] = []
    for v in (version,) if version is not None else VERSIONS:
        for ext in (cell_ext,) if cell_ext is not None else (False, True):
            reader = Reader(view, base)
            try:
                caches = _parse_caches(reader, v, ext)
            except _Recognized:
                raise
            except UnsupportedState as exc:
                errors.append((not reader.odd, exc.at, exc))
            else:
                return SeqState(caches, v, ext, header_seq_id)
    raise max(errors, key=lambda error: error[:2])[2]


def _parse_caches(reader: Reader, version: int, ext: bool) -> tuple[Cache, ...]:
    if not reader.left():
        raise reader.fail("an empty state: the context has no memory to save")
    caches: list[Cache] = []
    while reader.left():
        if len(caches) == MAX_CACHES:
            raise reader.fail(f"more than {MAX_CACHES} caches: not a KV cache state")
        start = reader.at
        if reader.left() >= 4 and U32.unpack_from(reader.view, start)[0] == DSV4_STATE_MAGIC:
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


def _parse_cache(reader: Reader, index: int, version: int, ext: bool) -> Cache:
    where = f"cache {index}"
    n_stream = reader.u32(f"{where}'s stream count")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise reader.fail(f"{where}: {n_stream} streams is not a KV cache's count (1..{MAX_STREAMS})")
    return Cache(tuple(_parse_stream(reader, f"{where}, stream {s}", version, ext) for s in range(n_stream)))


def _parse_stream(reader: Reader, where: str, version: int, ext: bool) -> Stream:
    n_cells = reader.u32(f"{where}'s cell count")
    if not n_cells:
        return Stream(0, reader.view[reader.at : reader.at], False, None, (), None)
    if n_cells > reader.left() // 12:
        raise reader.fail(f"{where}: {n_cells} cells cannot fit in the {reader.left()} bytes left")
    odd, reader.odd = reader.odd, True  # until the cells are read as a run
    cells, run = _parse_cells(reader, n_cells, ext, where)
    reader.odd = odd or run is None
    v_trans, n_layer = reader.unpack(PAIR, f"{where}'s V layout and layer count")
    if v_trans > 1:
        raise reader.fail(f"{where}: V layout {v_trans} is neither rows (0) nor transposed (1)")
    if n_layer > MAX_LAYERS:
        raise reader.fail(f"{where}: {n_layer} layers")
    rotation: tuple[int, int] | None = None
    if version >= 4:
        rot_k, rot_v = reader.unpack(PAIR, f"{where}'s rotation sizes")
        for rot in (rot_k, rot_v):
            if rot & (rot - 1) or rot > MAX_LAYERS:
                raise reader.fail(f"{where}: rotation size {rot} is not 0 or a power of two")
        rotation = (rot_k, rot_v)
    heads: list[tuple[int, int, memoryview]] = []
    for il in range(n_layer):
        k_type, k_row = reader.unpack(K_HEAD, f"{where}, layer {il}'s K header")
        _check_row(reader, k_type, k_row, f"{where}, layer {il}'s K")
        heads.append((k_type, k_row, reader.take(n_cells * k_row, f"{where}, layer {il}'s K rows")))
    layers: list[Layer] = []
    for il, (k_type, k_row, k) in enumerate(heads):
        what = f"{where}, layer {il}'s V"
        if v_trans:
            v_type, v_el, v_dims = reader.unpack(VT_HEAD, f"{what} header")
            name, block, size = _type(reader, v_type, what)
            if block != 1 or v_el != size:
                raise reader.fail(f"{what}: transposed {name} with element size {v_el}")
            if not v_dims:
                raise reader.fail(f"{what}: 0 dimensions")
            v = reader.take(v_dims * n_cells * v_el, f"{what} columns")
            layers.append(Layer(k_type, k_row, k, v_type, v_el, v_dims, v))
        else:
            v_type, v_row = reader.unpack(K_HEAD, f"{what} header")
            _check_row(reader, v_type, v_row, what)
            layers.append(Layer(k_type, k_row, k, v_type, v_row, 0, reader.take(n_cells * v_row, f"{what} rows")))
    return Stream(n_cells, cells, bool(v_trans), rotation, tuple(layers), run, CELL_EXT_SIZE if ext else 0)


def _type(reader: Reader, type_id: int, what: str) -> tuple[str, int, int]:
    known = KV_TYPES.get(type_id)
    if known is None:
        raise reader.fail(f"{what}: ggml type {type_id} is not a KV cache type")
    return known


def _check_row(reader: Reader, type_id: int, row: int, what: str) -> None:
    name, _block, size = _type(reader, type_id, what)
    if not row or row % size or row > reader.left():
        raise reader.fail(f"{what}: a row of {row} bytes is not a whole number of {name} blocks that fits")


def _parse_cells(reader: Reader, n_cells: int, ext: bool, where: str) -> tuple[memoryview, tuple[int, int] | None]:
    """The cell records and, when they are one sequence's consecutive positions in
    order (every sequence state of a KV cache in practice), that run."""
    width = 3 + (CELL_EXT_SIZE // 4 if ext else 0)  # i32s per record of one sequence id
    if n_cells * width * 4 <= reader.left():
        ints = read_ints(reader.view[reader.at : reader.at + n_cells * width * 4])
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
        pos, n_seq = reader.unpack(CELL, f"{where}'s cells")
        if n_seq == 0 or n_seq > MAX_STREAMS or pos < 0:
            raise reader.fail(f"{where}: a cell of position {pos} with {n_seq} sequence ids")
        reader.take((CELL_EXT_SIZE if ext else 0) + 4 * n_seq, f"{where}'s cells")
    return reader.view[start : reader.at], None


def _looks_recurrent(view: memoryview, at: int) -> bool:
    """Whether the bytes at `at` start like llama_memory_recurrent's state of one sequence:
    a cell count, records of (pos, n_seq_id = 0), the S layout (0 or 1), a layer count,
    then the first layer's R type and row size."""
    try:
        (count,) = U32.unpack_from(view, at)
        if count > 64:
            return False
        at += 4
        for _ in range(count):
            pos, n_seq = CELL.unpack_from(view, at)
            if pos < 0 or n_seq != 0:
                return False
            at += 8
        s_trans, n_layer, r_type, r_row = struct.unpack_from("<IIiQ", view, at)
    except struct.error:
        return False
    return bool(
        s_trans <= 1 and 1 <= n_layer <= MAX_LAYERS and 0 <= r_type < 64 and 0 < r_row * max(count, 1) <= len(view)
    )


def as_state(state: SeqState | Buffer) -> SeqState:
    """`state`, parsed where it is still bytes: what cuts a state takes either."""
    return state if isinstance(state, SeqState) else parse(state)
