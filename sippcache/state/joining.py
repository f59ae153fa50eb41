"""Joining a state's chunks: the state `split` cut, byte for byte, or the state of a prefix.

`join(meta, chunks, tail)` gives back the state `sippcache.state.cutting.split` cut, and
without a tail any leading chunks give the state of their positions: `join(meta,
chunks[:k])` is the state of the first k chunks' tokens. `joined` gives that state before
any byte of it is copied (`Joined`), for the copier to write into one buffer
(`sippcache.state.copier`).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Sequence

from .copier import Columns, Rows, piece_size, write_pieces
from .meta import FLAG_EXT, FLAG_HEADER, TAIL_HEAD, read_meta
from .seqstate import (
    BIG_ENDIAN,
    CELL_EXT_SIZE,
    K_HEAD,
    PAIR,
    SEQ_HEAD,
    SEQ_STATE_MAGIC,
    U32,
    VT_HEAD,
    Buffer,
    UnsupportedState,
    read_ints,
)

__all__ = ["Joined", "join", "joined"]


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

    def __init__(self, pieces: list[Buffer | Rows | Columns], views: Sequence[memoryview] = ()) -> None:
        self._pieces = pieces
        self._views = views
        #: The state's size in bytes.
        self.nbytes = sum(map(piece_size, pieces))

    @property
    def chunks(self) -> int:
        """How many chunks it is joined from (the `chunks` given to `joined`)."""
        return len(self._views)

    def parts(self) -> list[Buffer]:
        """The state as buffers to write back to back (a transposed V joined into one first)."""
        return [
            part
            for piece in self._pieces
            for part in (piece.buffers() if isinstance(piece, Rows | Columns) else [piece])
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
        write_pieces(self._pieces, out, self._views, hashed)

    def to_bytes(self) -> bytes:
        return b"".join(self.parts())


def joined(meta: Buffer, chunks: Sequence[Buffer], tail: Buffer = b"") -> Joined:
    """`join`'s state as a `Joined`, nothing copied yet (the same checks as `join`)."""
    flags, _, seq_id, header_seq_id, n_caches, chunked, caches = read_meta(meta)
    ext = bool(flags & FLAG_EXT)
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
        if len(rest) < TAIL_HEAD.size:
            raise UnsupportedState(f"this state has {n_caches - chunked} unchunked cache(s): its tail is needed")
        (tail_total,) = TAIL_HEAD.unpack_from(rest)
        if tail_total != total:
            raise UnsupportedState(f"the tail belongs to a state of {tail_total} positions, the chunks hold {total}")
        rest = rest[TAIL_HEAD.size :]
    elif len(rest):
        raise UnsupportedState("a tail given for a state whose caches are all chunked")
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    pieces: list[Buffer | Rows | Columns] = []
    if flags & FLAG_HEADER:
        pieces.append(SEQ_HEAD.pack(SEQ_STATE_MAGIC, header_seq_id))
    offsets = [0] * len(views)  # where each chunk's part of the next cache starts
    for cache in caches:
        pieces.append(U32.pack(cache.n_stream))
        for s in range(cache.n_stream):
            if s != cache.active or not total:
                pieces.append(U32.pack(0))
                continue
            pieces.append(U32.pack(total))
            pieces.append(_cell_records(total, seq_id, views, offsets, counts, ext))
            pieces.append(PAIR.pack(int(cache.v_trans), len(cache.k)))
            if cache.rotation is not None:
                pieces.append(PAIR.pack(*cache.rotation))
            at = [offset + (CELL_EXT_SIZE * n if ext else 0) for offset, n in zip(offsets, counts, strict=True)]
            rows = [(k_type, k_row, 0) for k_type, k_row in cache.k] + list(cache.v)
            for (row, transposed), group in itertools.groupby(rows, key=lambda layer: (layer[1], bool(layer[2]))):
                if not transposed:  # K rows, or V rows: layers of one row size, written as one table
                    heads = [K_HEAD.pack(type_id, row) for type_id, _, _ in group]
                    pieces.append(Rows(views, at, counts, heads, row))
                    for i, n in enumerate(counts):
                        at[i] += len(heads) * n * row
                    continue
                for v_dims, same in itertools.groupby(group, key=lambda layer: layer[2]):
                    heads = [VT_HEAD.pack(v_type, row, v_dims) for v_type, _, _ in same]
                    pieces.append(Columns(views, at, counts, heads, row, v_dims))
                    for i, n in enumerate(counts):
                        at[i] += len(heads) * v_dims * n * row
            offsets = at
    pieces.append(rest)
    return Joined(pieces, views)


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
        exts = read_ints(
            b"".join(view[at : at + CELL_EXT_SIZE * n] for view, at, n in zip(views, offsets, counts, strict=True))
        )
        for field in range(3):
            ints[2 + field :: width] = exts[field::3]
    if BIG_ENDIAN:
        ints.byteswap()
    return ints.tobytes()
