"""The threaded copier: a joined state's pieces written into one buffer, each byte copied once.

A state joined from chunks (`sippcache.state.joining.Joined`) is the chunks' views and a
few small new buffers. Its K and V rows of one size form one table per run of layers, which
each chunk fills a column band of (`Rows`); a transposed V is a gather of every chunk's
runs per dimension (`Columns`). With numpy each is one table copy per chunk, not one per
layer and chunk, and numpy lets go of the GIL while it copies, so a large state's copies
are shared with helper threads where there are cores for them (`gather_workers`). A chunk
can be hashed as it is copied (`Hashes`), so that its checksum costs no second read from
memory.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import xxhash

from .. import helpers
from .seqstate import Buffer

try:  # optional: copies a table in one call, and lets go of the GIL (llama-cpp-python installs it; the proxy may not)
    import numpy as _np
except ImportError:  # pragma: no cover - the pure-Python path below writes the same bytes, buffer by buffer
    _np = None  # type: ignore[assignment]

__all__ = [
    "GATHER_GROUP_BYTES",
    "HASH_STEP_BYTES",
    "PARALLEL_GATHER_BYTES",
    "SHORT_RUN_BYTES",
    "gather_workers",
]

#: A chunk hashed as it is copied (`Joined.write_into`) is copied this many bytes at a time, each
#: step hashed right behind, in the cache still (measured on a 2 MiB L2 a core: hashing each
#: 256 KiB step right after its copy added a third of what hashing the bytes from memory costs).
HASH_STEP_BYTES = 256 << 10
#: A state's tables of at least this many bytes are copied on helper threads too.
PARALLEL_GATHER_BYTES = 4 << 20
#: A transposed V whose chunks hold runs shorter than this many bytes is gathered a group of
#: chunks at a time, through a table of about `GATHER_GROUP_BYTES` (`Columns._gather`; measured:
#: runs of 128 bytes gathered 1.5x faster so, runs of 512 bytes slower).
SHORT_RUN_BYTES = 256
GATHER_GROUP_BYTES = 4 << 20


def gather_workers() -> int:
    """Helper threads that copy a state's tables: one per core past the first, up to 3 (none on
    one core, or without numpy, whose copies are what let go of the GIL)."""
    return min(3, (os.cpu_count() or 1) - 1) if _np is not None else 0


def write_pieces(
    pieces: Sequence[Buffer | Rows | Columns],
    out: memoryview,
    views: Sequence[memoryview],
    hashed: Callable[[int, int], object] | None = None,
) -> None:
    """`Joined.write_into`: `pieces` (of the chunks `views`) written back to back into `out`, the
    tables (and large pieces, in bands) on helper threads too where the state is large, each
    chunk's digest told to `hashed` once its bytes are copied."""
    at = 0
    plain: list[tuple[memoryview, Buffer]] = []
    tables: list[tuple[Rows | Columns | Span, memoryview]] = []
    for piece in pieces:
        size = piece_size(piece)
        if isinstance(piece, Rows | Columns):
            tables.append((piece, out[at : at + size]))
        elif size >= PARALLEL_GATHER_BYTES and _np is not None:  # a whole state, a large tail
            tables.append((Span(memoryview(piece).cast("B")), out[at : at + size]))
        else:
            plain.append((out[at : at + size], piece))
        at += size
    workers = gather_workers() if sum(piece.nbytes for piece, _ in tables) >= PARALLEL_GATHER_BYTES else 0
    done = Hashes(views, sum(piece.passes for piece, _ in tables), hashed)
    jobs = deque(job for piece, place in tables for job in piece.jobs(place, workers + 1, done))
    for place, piece in plain:
        place[:] = piece
    started = [helpers.pool("gather", workers).submit(drain, jobs) for _ in range(workers)]
    try:
        drain(jobs)
    finally:  # no helper still writing into `out` (or reading the chunks) once this returns
        jobs.clear()
        for future in started:
            future.result()


def piece_size(piece: Buffer | Rows | Columns) -> int:
    """A piece's bytes, of a table or a buffer."""
    return piece.nbytes if isinstance(piece, Rows | Columns) else memoryview(piece).nbytes


class Hashes:
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


def drain(jobs: deque[Callable[[], None]]) -> None:
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
NO_HASHES = Hashes((), 0, None)


class Rows:
    """Layers of rows of one size from the chunks' parts (chunk i's at `at[i]`: each layer's
    counts[i] rows of `row` bytes, layer after layer): each layer's head, then its rows of every
    chunk. In a buffer, that is one table (a line per layer) that each chunk fills a column
    band of."""

    __slots__ = ("at", "counts", "heads", "nbytes", "row", "views")

    def __init__(self, views: list[memoryview], at: list[int], counts: list[int], heads: list[bytes], row: int) -> None:
        self.views, self.at, self.counts, self.heads, self.row = views, list(at), counts, heads, row
        self.nbytes = sum(map(len, heads)) + len(heads) * sum(counts) * row

    #: How many of its copies each chunk's bytes go through (`Hashes`): one, its band of the table.
    passes = 1

    def buffers(self) -> list[Buffer]:
        """As buffers to write back to back: each layer's head and its rows in every chunk."""
        out: list[Buffer] = []
        for j, head in enumerate(self.heads):
            out.append(head)
            for view, start, n in zip(self.views, self.at, self.counts, strict=True):
                out.append(view[start + j * n * self.row : start + (j + 1) * n * self.row])
        return out

    def jobs(self, out: memoryview, ways: int, done: Hashes) -> list[Callable[[], None]]:
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

    def _fill(self, table: Any, bands: list[tuple[int, memoryview, int, int, int]], done: Hashes) -> None:
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


class Span:
    """One large piece (a whole state, a window's tail), copied in bands."""

    __slots__ = ("nbytes", "view")

    #: How many of its copies each chunk's bytes go through (`Hashes`): none, it holds no chunk's.
    passes = 0

    def __init__(self, view: memoryview) -> None:
        self.view, self.nbytes = view, view.nbytes

    def jobs(self, out: memoryview, ways: int, done: Hashes) -> list[Callable[[], None]]:
        """About `ways` copies of a band each, in 64 KiB steps (no chunk's bytes: `done` unused)."""
        band = max(1, -(-self.nbytes // max(1, ways) // 65536)) * 65536
        return [partial(_copy, out[i : i + band], self.view[i : i + band]) for i in range(0, self.nbytes, band)]


def _copy(out: memoryview, data: memoryview) -> None:
    _np.copyto(_np.frombuffer(out, dtype=_np.uint8), _np.frombuffer(data, dtype=_np.uint8))


class Columns:
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
        """How many of its copies each chunk's bytes go through (`Hashes`): one a layer."""
        return len(self.heads)

    def _runs(self) -> Iterator[Buffer]:
        size = self.size
        for j, head in enumerate(self.heads):
            yield head
            for d in range(self.dims):
                for view, start, n in zip(self.views, self.at, self.counts, strict=True):
                    run = start + (j * self.dims + d) * n * size
                    yield view[run : run + n * size]

    def jobs(self, out: memoryview, ways: int, done: Hashes) -> list[Callable[[], None]]:
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

    def _write_runs(self, out: memoryview, done: Hashes) -> None:
        """Without numpy: every layer's head and runs back to back, then each chunk's copies told."""
        _write_back_to_back(out, self._runs())
        for _ in self.heads:
            done.copied(*range(len(self.views)))

    def _gather(self, table: Any, parts: list[Any], widths: list[tuple[int, list[int]]], done: Hashes) -> None:
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
        drain(deque(self.jobs(memoryview(out), 1, NO_HASHES)))
        return [out]


def _across(band: Any, stacked: Any, chunks: int, width: int) -> None:
    """A group's stacked tables (`chunks` of them, each a run of `width` bytes a row) into `band`,
    its rows' runs side by side: each run copied as one element of `width` bytes, not as a loop
    over its bytes (a whole join of 1 GiB 4-8% faster; measured: `state_path.py`'s row "each run
    copied as bytes", and an A/B of the two in new processes)."""
    run = _np.dtype((_np.void, width))
    _np.copyto(band.view(run), stacked.view(run).reshape(chunks, -1).T)


def _write_then(out: memoryview, parts: Iterable[Buffer], done: Hashes, chunks: range) -> None:
    """`_write_back_to_back`, then `done.copied` for `chunks`, whose bytes `parts` held."""
    _write_back_to_back(out, parts)
    done.copied(*chunks)


def _write_back_to_back(out: memoryview, parts: Iterable[Buffer]) -> None:
    at = 0
    for part in parts:
        size = memoryview(part).nbytes
        out[at : at + size] = part
        at += size
