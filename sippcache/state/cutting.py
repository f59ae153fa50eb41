"""Cutting a llama.cpp sequence state: the state of a prefix, and a state's chunks of positions.

llama.cpp can save and load one whole sequence, but has no call for a range of one. To
store a long state as chunks of tokens, and to give the state of a prefix from them,
sippcache cuts the bytes itself:

- `prefix` gives the state of the first n positions: what llama.cpp itself writes for a
  sequence holding just those tokens.
- `split` cuts a state into chunks of positions plus a small meta part (and a tail: the
  caches not chunked), `cut` the same before any chunk is copied. A chunk holds only its
  own cells' rows, so the chunks of a prefix are the same bytes in every longer state with
  that prefix. `sippcache.state.joining.join` puts them back together.

A state cut must hold one sequence's positions 0..n-1 in order in each cache it cuts;
any other raises `UnsupportedState`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from .meta import TAIL_HEAD, write_meta
from .parsing import as_state
from .seqstate import (
    CELL_EXT_SIZE,
    SEQ_HEAD,
    SEQ_STATE_MAGIC,
    U32,
    Buffer,
    Cache,
    SeqState,
    Stream,
    UnsupportedState,
    stream_pieces,
    v_columns,
)

try:  # optional: copies a group of chunks' transposed V at once (llama-cpp-python installs it; the proxy may not)
    import numpy as _np
except ImportError:  # pragma: no cover - each chunk's transposed V is then cut alone, slice by slice
    _np = None  # type: ignore[assignment]

__all__ = ["CUT_GROUP_BYTES", "Cut", "Split", "chunkable_caches", "cut", "prefix", "split"]


def prefix(state: SeqState | Buffer, n: int) -> bytes:
    """The state of the sequence's first `n` positions, byte for byte what llama.cpp
    writes for a sequence holding just those tokens (in the form `state` has).

    Every cache must hold the sequence's positions 0..N-1 in cell order (N =
    `n_positions`), in one stream. A sliding-window cache past its window holds only
    the last positions, and the window of a shorter prefix needs cells it does not
    have: such a state gives only itself (n = N); any other n raises `UnsupportedState`.
    """
    st = as_state(state)
    total = st.n_positions
    if not 0 <= n <= total:
        raise ValueError(f"a prefix of {n} positions of a state of {total}")
    if n == total:
        return st.to_bytes()
    pieces: list[Buffer] = []
    if st.header_seq_id is not None:
        pieces.append(SEQ_HEAD.pack(SEQ_STATE_MAGIC, st.header_seq_id))
    for index, cache in enumerate(st.caches):
        found = full_run(cache, f"cache {index}", total)
        pieces.append(U32.pack(len(cache.streams)))
        for s, stream in enumerate(cache.streams):
            if found is not None and s == found[0]:
                record = len(stream.cells) // stream.n_cells
                pieces.extend(stream_pieces(stream, n, stream.cells[: n * record]))
            else:
                pieces.append(U32.pack(0))
    return b"".join(pieces)


def chunkable_caches(state: SeqState | Buffer) -> int:
    """How many of the state's caches, from the first, hold all its positions 0..N-1 in order:
    what `split(chunked=)` can cut. An iSWA model's sliding-window cache does while the state
    is within its window; past it llama.cpp writes only the window's cells (``swa_full`` or
    not)."""
    st = as_state(state)
    count = 0
    for i, cache in enumerate(st.caches):
        try:
            found = full_run(cache, f"cache {i}", st.n_positions)
        except UnsupportedState:
            break
        if found is not None and not found[1].layers:
            break
        count += 1
    return count


def full_run(cache: Cache, where: str, total: int) -> tuple[int, Stream] | None:
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
    st = as_state(state)
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
    runs = [full_run(cache, f"cache {i}", total) for i, cache in enumerate(st.caches[:chunked])]
    for index, found in enumerate(runs):
        if found is not None and not found[1].layers:
            raise UnsupportedState(f"cache {index} holds cells but no layers: its chunks would be empty")
    seq_ids = {stream.run[0] for _, stream in filter(None, runs) if stream.run is not None}
    if len(seq_ids) > 1:
        raise UnsupportedState(f"the chunked caches hold different sequences {sorted(seq_ids)}")
    seq_id = seq_ids.pop() if seq_ids else -1
    tail = b""
    if chunked < len(st.caches):
        rest = SeqState(st.caches[chunked:], st.version, st.cell_ext, None)
        tail = b"".join([TAIL_HEAD.pack(total), *rest.pieces()])
    streams = [found[1] for found in runs if found is not None]
    return Cut(write_meta(st, runs, seq_id), tail, streams, bounds, st.cell_ext)


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
            yield from v_columns(layer, stream.n_cells, begin, end)
