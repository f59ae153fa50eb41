"""Restore a sliding-window (iSWA) sequence state where a live context keeps its cells.

llama.cpp's attention kernels sum over the KV cache's cells in the order of
their slots, and the rounding of those sums depends on where each cell sits.
Measured on gemma-3-270m (q4_k_m, AMD EPYC with AVX2, llama-cpp-python 0.3.36,
flash attention off): after a plain restore of 1,199 tokens, whose window cells
land 687 slots before where a live context holds them, the next logits differ
from the live context's in 262,142 of 262,144 values (max 0.158, same argmax);
moved by an even number of slots from the live layout they were bit-identical,
by an odd number they were not. At 2,201 tokens the plain restore differs by up
to 0.275; at 1,300, 1,333 and 2,200 it happened to match. On an AVX-512 build
the 1,199-token restore was bit-identical. So a restore is exact on every CPU
only when the cells are where a live context has them.

A live context with a full-size SWA cache (`swa_full`, llama.cpp's default)
holds position p of a sequence evaluated from 0 in slot p of both its caches:
the cells the sliding window no longer sees stay there, masked. A sequence
state (`llama_state_seq_get_data`) leaves those masked cells out, so a plain
restore packs the window's cells from slot 0 instead. `live_layout` moves them
back: it prepends zero cells (the positions just below the window) to the
state's sliding-window section, so the window's first cell lands in the slot a
live context has it in, modulo `KV_ALIGNMENT`. Those cells are masked for every
position the sequence can reach (p - pos >= n_swa), so their zeros are never
read: a masked cell adds exactly 0 to every sum, whatever it holds. The
attention kernels then sum the same values in the same order as in a live
context.

The zeros are not the positions' real keys and values, so a sequence restored
this way must never be cut back so far that the window reaches them: its real
window starts at `Padded.start`, which the caller keeps
(`SequenceCache.can_truncate`), since llama.cpp now reports an earlier first
position. That is the rule a restored state followed anyway (it can be cut by
at most one token).

The state format is read as llama.cpp writes it (llama-kv-cache.cpp,
`state_write`): the 8-byte header of `llama_state_seq_get_data` (magic, seq
id), then per cache (for iSWA: the full-attention cache, then the
sliding-window one) u32 streams, u32 cell count, per cell (i32 pos, u32
n_seq_id, n_seq_id x i32 seq id), u32 v_trans, u32 n_layer, per layer the K
rows (i32 type, u64 row size, rows), then per layer V (rows, or transposed:
i32 type, u32 element size, u32 n_embd, n_embd rows of one element per cell).
Anything that does not read exactly so (another llama.cpp version, per-cell
extensions, several streams) gets no padding: the restore is then the plain
one, exact where the kernels allow it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KV_ALIGNMENT", "Padded", "live_layout", "padded_size_bound"]

#: llama.cpp attends over the KV cache's cells in blocks of 256 (llama-kv-cache.cpp:
#: the number of cells a step attends over is padded to a multiple of max(n_pad, 256)),
#: and every SIMD width and block the CPU kernels use divides it. A layout shifted by
#: whole blocks of masked cells sums the same values in the same order, so padding
#: the window's start to a live context's slot modulo 256 is enough: at most 255
#: zero cells, not one per position below the window (measured on gemma-3-270m:
#: bit-identical either way at 1,199, 1,300, 1,333, 2,200 and 2,201 tokens).
KV_ALIGNMENT = 256

_HEADER = 8  # u32 magic, i32 seq id
_U32X2 = struct.Struct("<II")
_K_HEAD = struct.Struct("<iQ")  # type, row size
_V_T_HEAD = struct.Struct("<iII")  # type, element size, n_embd_v_gqa


@dataclass(frozen=True)
class Padded:
    """A state with its sliding-window section padded to a live context's layout: `state`
    (a new array, or a view of the buffer `live_layout`'s `into` gave) and `start`, the first
    position whose keys and values it really holds in the sliding-window layers."""

    state: np.ndarray
    start: int


@dataclass(frozen=True)
class _Section:
    begin: int  # offset of the stream count
    end: int
    cells: int
    positions: np.ndarray
    v_trans: bool
    k_layers: list[tuple[int, int]]  # (offset of the layer's header, row bytes)
    v_layers: list[tuple[int, int, int]]  # (offset of the header, bytes per cell, rows: 1 or n_embd if transposed)


def _read_section(data: np.ndarray, offset: int) -> _Section | None:
    """One cache's part of a sequence state, starting at `offset`; None if it does not read as expected."""
    size = len(data)
    if offset + 8 > size:
        return None
    n_stream, cells = _U32X2.unpack_from(data.data, offset)
    if n_stream != 1 or cells == 0:
        return None
    meta = offset + 8
    if meta + 12 * cells + 8 > size:
        return None
    table = np.frombuffer(data, dtype="<i4", count=3 * cells, offset=meta).reshape(cells, 3)
    if not (table[:, 1] == 1).all():  # one sequence id per cell: the form a single sequence's state has
        return None
    at = meta + 12 * cells
    v_trans, n_layer = _U32X2.unpack_from(data.data, at)
    at += 8
    if v_trans > 1 or not 0 < n_layer <= 4096:
        return None
    k_layers = []
    for _ in range(n_layer):
        if at + _K_HEAD.size > size:
            return None
        _, row = _K_HEAD.unpack_from(data.data, at)
        k_layers.append((at, row))
        at += _K_HEAD.size + row * cells
    v_layers = []
    for _ in range(n_layer):
        if v_trans:
            if at + _V_T_HEAD.size > size:
                return None
            _, element, n_embd = _V_T_HEAD.unpack_from(data.data, at)
            v_layers.append((at, element, n_embd))
            at += _V_T_HEAD.size + element * n_embd * cells
        else:
            if at + _K_HEAD.size > size:
                return None
            _, row = _K_HEAD.unpack_from(data.data, at)
            v_layers.append((at, row, 1))
            at += _K_HEAD.size + row * cells
    if at > size:
        return None
    return _Section(offset, at, cells, table[:, 0].copy(), bool(v_trans), k_layers, v_layers)


def live_layout(state: Any, n_swa: int, align: int = 0, *, into: Callable[[int], Any] | None = None) -> Padded | None:
    """`state` (a sequence state of an iSWA model holding positions 0 .. n - 1) with
    zero cells prepended to its sliding-window section, whose first position p0 then
    lands in slot p0 modulo `align` (in slot p0 itself with `align` 0) when restored
    into an empty sequence; None when there is nothing to move (no sliding window,
    the window starts at a slot a live context has, modulo `align`) or the state
    does not read as the two-cache form described in this module's docstring.
    `into(nbytes)`, if given, is a writable buffer of at least `nbytes` bytes that the
    padded state is written into (one used before: a new array's page faults cost
    more than the copy), else it is a new array."""
    if n_swa <= 0:
        return None
    data = np.frombuffer(state, dtype=np.uint8)
    if len(data) < _HEADER:
        return None
    full = _read_section(data, _HEADER)
    if full is None:
        return None
    window = _read_section(data, full.end)
    if window is None or window.end != len(data):
        return None
    n = full.cells
    start = int(window.positions[0])
    if (
        start <= 0
        or not np.array_equal(full.positions, np.arange(n))
        or not np.array_equal(window.positions, np.arange(start, n))
    ):
        return None
    fill = start % align if align else start
    if fill == 0:
        return None
    return Padded(_padded(data, window, fill, start - fill, into), start)


def padded_size_bound(nbytes: int, n_swa: int, align: int) -> int:
    """The most bytes `live_layout` makes of a state of `nbytes` bytes: at most `align` - 1 cells
    are put in front of a window of about `n_swa` cells, each no larger than a window cell."""
    return nbytes + nbytes * max(align - 1, 0) // max(n_swa, 1)


def _padded(
    data: np.ndarray, window: _Section, fill: int, first: int, into: Callable[[int], Any] | None = None
) -> np.ndarray:
    """`data` with `fill` zero cells (positions first .. first + fill - 1) in front of `window`'s
    cells, in a new array or at the start of `into(size)`, which may be the very memory `data` is
    in (at its start): then it is padded in place. The pieces are written last first, each moved
    right (numpy copies overlapping ranges as if through a temporary), so that none overwrites a
    piece not yet moved."""
    cells = window.cells
    per_cell = 12 + sum(row for _, row in window.k_layers) + sum(size * rows for _, size, rows in window.v_layers)
    nbytes = len(data) + fill * per_cell
    out = (
        np.empty(nbytes, dtype=np.uint8) if into is None else np.frombuffer(into(nbytes), dtype=np.uint8, count=nbytes)
    )
    table = np.empty((fill, 3), dtype="<i4")
    table[:, 0] = np.arange(first, first + fill)
    table[:, 1] = 1
    table[:, 2] = np.frombuffer(data, dtype="<i4", count=1, offset=4)[0]  # its seq id (read past by llama.cpp)
    counts = np.frombuffer(_U32X2.pack(1, cells + fill), dtype=np.uint8)
    # (to, from, bytes): from `data` if `from` is not None, else zeros; rows of a transposed V as
    # (to, from, rows, zero bytes, data bytes) in `blocks`. In the order of the layout.
    pieces: list[tuple[int, int | None, int] | tuple[int, int, int, int, int]] = []
    at = window.begin + 8 + 12 * fill  # past the cell counts and the cells put in front
    length = 12 * cells + 8  # the window's own cell table, then v_trans and n_layer
    pieces.append((at, window.begin + 8, length))
    at += length
    for header, row in window.k_layers:
        pieces.append((at, header, _K_HEAD.size))
        at += _K_HEAD.size
        pieces.append((at, None, fill * row))
        at += fill * row
        pieces.append((at, header + _K_HEAD.size, cells * row))
        at += cells * row
    for header, size, rows in window.v_layers:
        head = _V_T_HEAD.size if window.v_trans else _K_HEAD.size
        pieces.append((at, header, head))
        at += head
        # Transposed V is one row of `cells` elements per embedding dimension: pad each row.
        pieces.append((at, header + head, rows, fill * size, cells * size))
        at += rows * (fill + cells) * size
    tail = len(data) - window.end
    pieces.append((at, window.end, tail))
    assert at + tail == nbytes
    for piece in reversed(pieces):
        if len(piece) == 5:
            to, source, rows, zeros, held = piece
            block = out[to : to + rows * (zeros + held)].reshape(rows, zeros + held)
            block[:, zeros:] = data[source : source + rows * held].reshape(rows, held)
            block[:, :zeros] = 0  # after the move: in place, these bytes were its source
        else:
            to, start, count = piece[0], piece[1], piece[2]
            out[to : to + count] = 0 if start is None else data[start : start + count]
    out[window.begin + 8 : window.begin + 8 + 12 * fill] = table.view(np.uint8).reshape(-1)
    out[window.begin : window.begin + 8] = counts
    if not np.may_share_memory(out, data):
        out[: window.begin] = data[: window.begin]
    return out
