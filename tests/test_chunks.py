"""sippcache.state.chunks on real llama.cpp states (llama-cpp-python, the tiny generated models).

A state stored as chunks and a tail comes back byte for byte; a second state sharing a prefix
writes only its new chunks and its tail; four conversations over one system prompt store it once;
a chunk gone under a reader gives the shorter run, never other bytes; whole entries (the proxy's
before chunks, and what `sippcache.state` cannot cut) restore as they did. Every state is computed in
batches that end at multiples of the chunk size, so two states sharing a prefix have the same K/V
bytes for it (llama.cpp's values depend on the batch split: test_stateformat.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
import xxhash

import sippcache
from harness import tinymodel
from harness.llama_tools import ROOT, last_logits, reference_logits
from sippcache import frame
from sippcache import state as sf
from sippcache.errors import CorruptEntry
from sippcache.state import chunkentries, chunks
from tests.test_llama_tiny import assert_close

C = 64  # tokens a chunk: small, so that a few hundred tokens make a chain
FP, KIND, NS = "tiny-model", "test.seq", "scope-a"


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [tinymodel.BOS_ID] + [rng.randrange(3, tinymodel.N_VOCAB) for _ in range(n - 1)]


def state_of(llm: Any, tokens: list[int]) -> bytes:
    """llama.cpp's state of `tokens` (`llama_state_seq_get_data`: with its 8-byte header),
    evaluated in batches ending at every multiple of C."""
    llm.reset()
    begin = 0
    for end in [*range(C, len(tokens), C), len(tokens)]:
        llm.eval(tokens[begin:end])
        begin = end
    size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(llm.ctx, buffer, size, 0)
    return bytes(buffer)[:written]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("chunks-models")
    return {
        kind: tinymodel.write_tiny_model(folder / f"{kind}.gguf", kind=kind)
        for kind in ("attention", "swa", "recurrent")
    }


@pytest.fixture(scope="module")
def llms(models: dict[str, Path]) -> Iterator[dict[tuple[str, bool], Any]]:
    """`llms[kind, flash]`: a loaded model and context (flash attention on, or off: transposed V)."""
    loaded: dict[tuple[str, bool], Any] = {}
    for kind, flash in (("attention", True), ("attention", False), ("swa", True), ("recurrent", True)):
        loaded[kind, flash] = llama_cpp.Llama(
            model_path=str(models[kind]), n_ctx=2048, n_batch=512, flash_attn=flash, verbose=False
        )
    yield loaded
    for llm in loaded.values():
        llm.close()


@pytest.fixture
def llm(llms: dict[tuple[str, bool], Any]) -> Any:
    return llms["attention", True]


@pytest.fixture
def cache() -> Iterator[sippcache.CacheBackend]:
    with sippcache.open("ram://") as opened:
        yield opened


def states(cache: sippcache.CacheBackend, **options: Any) -> chunks.ChunkedStates:
    return chunks.ChunkedStates(cache, fingerprint=FP, kind=KIND, chunk_tokens=C, **options)


def entries(cache: sippcache.CacheBackend) -> tuple[list[sippcache.EntryInfo], list[sippcache.EntryInfo]]:
    """(chunk entries, tail and whole entries)."""
    listed = list(cache.entries())
    return [e for e in listed if chunkentries.is_chunk_namespace(e.namespace)], [
        e for e in listed if not chunkentries.is_chunk_namespace(e.namespace)
    ]


def restored(store: chunks.ChunkedStates, tokens: list[int], partial: bool = False) -> tuple[tuple[int, ...], bytes]:
    """(the tokens of the state a restore assembles, its bytes)."""
    assembled = store.restore(tokens, namespace=NS, partial=partial)
    assert assembled is not None
    with assembled:
        return assembled.tokens, bytes(assembled.state)


# -- round trips --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flash", [True, False], ids=["v-rows", "v-transposed"])
@pytest.mark.parametrize("form", ["seq", "slot-file"])
def test_a_state_stored_as_chunks_is_assembled_byte_for_byte(
    llms: dict[tuple[str, bool], Any], cache: sippcache.CacheBackend, flash: bool, form: str
) -> None:
    tokens = prompt(700)
    data = state_of(llms["attention", flash], tokens)
    if form == "slot-file":  # a slot file's state bytes: no 8-byte header, the version given
        data = data[8:]
    store = states(cache)
    stored = store.store(tokens, data, namespace=NS, header=form == "seq", version=3)
    assert stored.chunked and (stored.chunks_new, stored.chunks_kept, stored.entries) == (10, 0, 11)
    chunk_entries, tails = entries(cache)
    assert sorted(len(e.key) for e in chunk_entries) == list(range(C, 700, C))  # keyed by the prefix each ends
    assert [len(e.key) for e in tails] == [700]
    assert restored(store, tokens) == (tuple(tokens), data)
    assert restored(store, [*tokens, 5, 6]) == (tuple(tokens), data)  # a longer query: the stored prefix
    # A query that parts from it: only the chunks covering the common prefix are read.
    assembled = store.restore([*tokens[:300], 9, 9], namespace=NS, partial=True)
    assert assembled is not None
    with assembled:
        assert (assembled.length, assembled.chunks, assembled.tokens) == (300, 5, tuple(tokens[:320]))
        assert bytes(assembled.state) == sf.prefix(data, 320)
    # Every chunk is a normal frame of its own kind, with what a run of them needs to be joined.
    chunk = cache.lookup(tokens[:C], namespace=chunk_entries[0].namespace)
    assert chunk is not None
    with chunk:
        entry = frame.decode(chunk.blob)
        assert (entry.kind, entry.fingerprint, entry.tokens) == (KIND + ".chunk", FP, tuple(tokens[:C]))
        assert bytes(entry.sections[0]) == sf.split(data, [C]).chunks[0]
        assert entry.meta["chunk_meta"] == sf.split(data, [C]).meta
        del entry


@pytest.mark.parametrize("backend", ["ram", "lmdb"])
def test_frames_are_new_bytes_for_a_store_that_keeps_them_else_written_into_one_buffer(
    llm: Any, tmp_path: Path, backend: str
) -> None:
    """RAM keeps the bytes it is given (`keeps_bytes`): its frames are new bytes. LMDB copies what
    it is given into its file: every frame is written into one buffer, used again. Either way each
    entry is `frame.encode`'s frame, and the state comes back byte for byte."""
    tokens = prompt(700)
    data = state_of(llm, tokens)
    with sippcache.open("ram://" if backend == "ram" else f"lmdb://{tmp_path}/store") as cache:
        store = states(cache)
        assert store.store(tokens, data, namespace=NS).entries == 11
        assert restored(store, tokens) == (tuple(tokens), data)
        largest = 0
        for info in cache.entries():
            match = cache.lookup(info.key, namespace=info.namespace)
            assert match is not None and tuple(match.key) == tuple(info.key)
            with match:
                entry = frame.decode(match.blob)
                fields = dict(versions=entry.versions, created=entry.created, meta=entry.meta, roles=list(entry.roles))
                again = frame.encode(entry.tokens, list(entry.sections), fingerprint=FP, kind=entry.kind, **fields)
                assert bytes(match.blob) == again
                largest = max(largest, len(again))
                del entry
        # The buffer kept holds the largest frame's bytes: one buffer took every frame in turn.
        assert store.buffers.free_bytes == (0 if getattr(cache, "keeps_bytes", False) else largest)


def test_the_assembled_state_loads_into_llama_cpp(llm: Any, cache: sippcache.CacheBackend) -> None:
    tokens = prompt(400)
    data = state_of(llm, tokens)
    store = states(cache)
    store.store(tokens, data, namespace=NS)
    _, state = restored(store, [*tokens[:200], 7], partial=True)  # a run of 4 chunks: 256 tokens
    llm.reset()
    buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    assert llama_cpp.llama_state_seq_set_data(llm.ctx, buffer, len(state), 0) == len(state)
    memory = llama_cpp.llama_get_memory(llm.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == 255


# -- what a store writes -------------------------------------------------------------------------------


def test_a_second_state_sharing_a_prefix_writes_only_its_new_chunks_and_tail(
    llm: Any, cache: sippcache.CacheBackend
) -> None:
    first, second = prompt(700), [*prompt(700)[:500], *prompt(300, seed=1)]
    store = states(cache)
    one = store.store(first, state_of(llm, first), namespace=NS)
    before = cache.stats().bytes
    data = state_of(llm, second)
    two = store.store(second, data, namespace=NS)
    # 7 chunks (448 tokens) are the first state's; chunks 8..12 (up to 768) and the tail are new.
    assert (two.chunks_kept, two.chunks_new, two.entries) == (7, 5, 6)
    assert two.nbytes == cache.stats().bytes - before - 4 * sum(range(8 * C, 13 * C, C)) - 4 * 800  # + key tokens
    per_token = len(sf.split(data, [C]).chunks[0]) // C
    assert two.nbytes < (800 - 448) * per_token * 1.1  # the new tokens' bytes, not the state's
    assert one.nbytes > 700 * per_token
    assert restored(store, second) == (tuple(second), data)
    assert restored(store, first)[1] == state_of(llm, first)


def test_a_system_prompt_shared_by_four_conversations_is_stored_once(llm: Any, cache: sippcache.CacheBackend) -> None:
    system = prompt(600)
    chats = [[*system, *prompt(150, seed=10 + i)[1:]] for i in range(4)]
    store = states(cache)
    data = [state_of(llm, chat) for chat in chats]
    written = [store.store(chat, d, namespace=NS) for chat, d in zip(chats, data, strict=True)]
    assert [w.chunks_kept for w in written] == [0, 9, 9, 9]  # the system prompt's 9 whole chunks: once
    chunk_entries, tails = entries(cache)
    assert len(tails) == 4 and len(chunk_entries) == 9 + 4 * 2  # each then has 2 chunks of its own (to 704)
    per_token = len(sf.split(data[0], [C]).chunks[0]) // C
    distinct = 600 + 4 * 149
    # Each conversation's last partial chunk and its frames' key tokens (4 bytes a token, against 512 of
    # K/V on this model) on top: whole states would have written 2.5 x the distinct tokens.
    assert sum(w.nbytes for w in written) < 1.2 * distinct * per_token
    for chat, d in zip(chats, data, strict=True):
        assert restored(store, chat) == (tuple(chat), d)
    # A fifth conversation restores the shared chunks: the system prompt and the rest of its last chunk.
    tokens, state = restored(store, [*system, 1, 2, 3], partial=True)
    (origin,) = [i for i, chat in enumerate(chats) if tuple(chat[:640]) == tokens]
    assert tokens[:600] == tuple(system) and state == sf.prefix(data[origin], 640)


def test_a_conversation_that_replaces_its_previous_turn(llm: Any, cache: sippcache.CacheBackend) -> None:
    """The new tail takes the old one's place; the old one's chunks past what they share go; shared ones stay."""
    turn1 = prompt(460)  # chunks to 448
    turn2 = [*turn1[:440], *prompt(200, seed=3)[1:]]  # parts 20 tokens before the first turn's end
    store = states(cache)
    store.store(turn1, state_of(llm, turn1), namespace=NS)
    data = state_of(llm, turn2)
    stored = store.store(turn2, data, namespace=NS, replaces=turn1)
    assert (stored.chunks_kept, stored.chunks_new) == (6, 3)  # shared up to 384; its own 448, 512, 576
    chunk_entries, tails = entries(cache)
    assert [len(e.key) for e in tails] == [len(turn2)]
    assert sorted(len(e.key) for e in chunk_entries) == list(range(C, len(turn2), C))  # turn1's 448 is gone
    assert all(tuple(e.key) == tuple(turn2[: len(e.key)]) for e in chunk_entries)
    assert restored(store, turn2) == (tuple(turn2), data)


def test_chunks_are_kept_fresh_and_not_marked_superseded(llm: Any, tmp_path: Path) -> None:
    """A new chunk that extends a stored one's whole key would mark it superseded (evicted first,
    sippcache.eviction): stored deepest first and touched, a chain keeps every link."""
    with sippcache.open(f"lmdb://{tmp_path}/store") as cache:
        store = states(cache)
        first = prompt(300)
        store.store(first, state_of(llm, first), namespace=NS)
        second = [*first, *prompt(300, seed=2)[1:]]
        store.store(second, state_of(llm, second), namespace=NS)
        chunk_entries, _ = entries(cache)
        assert len(chunk_entries) == (len(second) - 1) // C
        assert not [e for e in chunk_entries if e.superseded]
        by_depth = {len(e.key): e for e in chunk_entries}
        assert by_depth[C].priority / C > by_depth[5 * C].priority / (5 * C)  # the first outlast the last


def test_a_long_chain_restores_from_lmdb_without_a_reader_per_chunk(llm: Any, tmp_path: Path) -> None:
    """An LMDB match pins a read transaction, and an environment has a fixed number of reader slots
    (shared by every process): a restore reads its whole chain in one (`lookup_prefixes`)."""
    tokens = prompt(1300)  # 20 chunks
    data = state_of(llm, tokens)
    with sippcache.open(f"lmdb://{tmp_path}/store?max_readers=8") as cache:
        store = states(cache)
        assert store.store(tokens, data, namespace=NS).chunks_new == 20
        assert restored(store, tokens) == (tuple(tokens), data)
        assert restored(store, [*tokens[:1000], 1], partial=True) == (tuple(tokens[:1024]), sf.prefix(data, 1024))


# -- faults -------------------------------------------------------------------------------------------------


class _DeletingOnLookup:
    """A store that deletes one chunk as soon as a reader has looked the tail up (another process
    evicting it under the reader)."""

    def __init__(self, cache: sippcache.CacheBackend, victim: list[int], namespace: str) -> None:
        self.cache, self.victim, self.victim_namespace, self.done = cache, victim, namespace, False

    def lookup(self, tokens: Any, **kwargs: Any) -> Any:
        match = self.cache.lookup(tokens, **kwargs)
        if not self.done:
            self.done = True
            assert self.cache.delete(self.victim, namespace=self.victim_namespace)
        return match

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def test_a_chunk_deleted_under_a_reader_gives_the_shorter_run(llm: Any, cache: sippcache.CacheBackend) -> None:
    tokens = prompt(700)
    data = state_of(llm, tokens)
    states(cache).store(tokens, data, namespace=NS)
    chunk_namespace = entries(cache)[0][0].namespace
    reader = states(_DeletingOnLookup(cache, tokens[: 4 * C], chunk_namespace))  # type: ignore[arg-type]
    held, state = restored(reader, tokens)
    assert held == tuple(tokens[: 3 * C]) and state == sf.prefix(data, 3 * C)  # the run before the gap
    # And with the first chunk gone there is nothing to restore: a miss, not a wrong state.
    assert cache.delete(tokens[:C], namespace=chunk_namespace)
    assert states(cache).restore(tokens, namespace=NS) is None


def test_a_window_in_the_tail_needs_every_chunk(
    llms: dict[tuple[str, bool], Any], cache: sippcache.CacheBackend
) -> None:
    """iSWA: the sliding-window cache goes whole into the tail, so a run of chunks is no state by
    itself: a missing chunk is a miss."""
    tokens = prompt(400)
    data = state_of(llms["swa", True], tokens)
    store = states(cache)
    stored = store.store(tokens, data, namespace=NS)
    assert stored.chunked and stored.chunks_new == 6
    assert restored(store, tokens) == (tuple(tokens), data)
    assert restored(store, [*tokens[:100], 1], partial=True) == (tuple(tokens), data)  # all of it, to be cut
    chunk_namespace = entries(cache)[0][0].namespace
    assert cache.delete(tokens[: 3 * C], namespace=chunk_namespace)
    assert store.restore(tokens, namespace=NS) is None


def test_damaged_chunks_are_deleted_and_give_the_shorter_run(llm: Any, cache: sippcache.CacheBackend) -> None:
    tokens = prompt(500)
    data = state_of(llm, tokens)
    store = states(cache)
    store.store(tokens, data, namespace=NS)
    chunk_namespace = entries(cache)[0][0].namespace
    with cache.lookup(tokens[: 3 * C], namespace=chunk_namespace) as match:  # type: ignore[union-attr]
        damaged = bytearray(match.blob)
    damaged[-5] ^= 0xFF  # a flipped K/V byte: the frame's checksum fails
    cache.store(tokens[: 3 * C], damaged, namespace=chunk_namespace)
    assert restored(store, tokens) == (tuple(tokens[: 2 * C]), sf.prefix(data, 2 * C))
    assert store.damaged == 1
    assert cache.peek(tokens[: 3 * C], namespace=chunk_namespace).key_length == 2 * C  # type: ignore[union-attr]
    # An intact chunk of another model under the same key (a store shared by mistake) is not used either.
    cells = sf.split(data, [C, 2 * C]).chunks[1]
    other = frame.encode(tokens[: 2 * C], [cells], fingerprint="other", kind=KIND + ".chunk", roles=["cells"])
    cache.store(tokens[: 2 * C], other, namespace=chunk_namespace)
    assert restored(store, tokens) == (tuple(tokens[:C]), sf.prefix(data, C))
    assert store.damaged == 2


def test_a_deferred_restore_leaves_the_payload_checks_to_check(llm: Any, cache: sippcache.CacheBackend) -> None:
    """`restore(deferred=True)` checks headers, not payloads: `check` does, on any thread, before
    the bytes are used; a damaged payload fails it and its entry is deleted. With a secret nothing
    is deferred (a MAC is checked before anything is read)."""
    tokens = prompt(500)
    data = state_of(llm, tokens)
    store = states(cache)
    store.store(tokens, data, namespace=NS)
    with store.restore(tokens, namespace=NS, deferred=True) as intact:  # type: ignore[union-attr]
        assert len(intact.unchecked) == 1 + (500 - 1) // C and store.check(intact)
        assert intact.state == data
    chunk_namespace = entries(cache)[0][0].namespace
    with cache.lookup(tokens[: 3 * C], namespace=chunk_namespace) as match:  # type: ignore[union-attr]
        damaged = bytearray(match.blob)
    damaged[-5] ^= 0xFF  # a flipped K/V byte: the frame's checksum fails
    cache.store(tokens[: 3 * C], damaged, namespace=chunk_namespace)
    with store.restore(tokens, namespace=NS, deferred=True) as found:  # type: ignore[union-attr]
        assert not store.check(found) and store.damaged == 1
    assert cache.peek(tokens[: 3 * C], namespace=chunk_namespace).key_length == 2 * C  # type: ignore[union-attr]
    assert restored(store, tokens) == (tuple(tokens[: 2 * C]), sf.prefix(data, 2 * C))  # the run before it
    secret = states(cache, secret=b"s3cret")
    secret.store(tokens, data, namespace="mac")
    with secret.restore(tokens, namespace="mac", deferred=True) as checked:  # type: ignore[union-attr]
        assert checked.unchecked == [] and secret.check(checked) and checked.state == data


@pytest.mark.parametrize("threads", [1, chunks.CHECK_THREADS], ids=["as-copied", "meanwhile"])
def test_write_checked_checks_each_chunk_as_it_is_copied_or_meanwhile(
    llm: Any, cache: sippcache.CacheBackend, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """`write_checked` writes a deferred restore's state and checks its payloads: with one thread
    to check (`check_threads`), each chunk's hashed as it is copied and compared with its header's
    checksum (only the tail's frame is checked whole); with several, every frame on them while the
    state is joined; a whole entry's meanwhile. A damaged chunk, tail or whole entry fails it
    (deleted, counted)."""
    monkeypatch.setattr(chunks, "check_threads", lambda: threads)
    tokens = prompt(500)
    data = state_of(llm, tokens)
    store = states(cache)
    store.store(tokens, data, namespace=NS)
    checked: list[int] = []
    real_check = chunks.ChunkedStates._check
    monkeypatch.setattr(
        chunks.ChunkedStates, "_check", lambda self, some: checked.append(len(some)) or real_check(self, some)
    )
    with store.restore(tokens, namespace=NS, deferred=True) as intact:  # type: ignore[union-attr]
        out = bytearray(intact.nbytes)
        assert intact.joined_chunks == len(intact.unchecked) == 1 + (500 - 1) // C
        assert store.write_checked(intact, memoryview(out)) and out == data
    if threads == 1:
        assert checked == [1]  # the tail
    else:  # every frame, shared among the threads
        assert len(checked) == threads and sum(checked) == 1 + (500 - 1) // C
    chunk_namespace = entries(cache)[0][0].namespace
    for key, namespace in ((tokens[: 3 * C], chunk_namespace), (tokens, NS)):  # a chunk, then the tail
        with cache.lookup(key, namespace=namespace) as match:  # type: ignore[union-attr]
            damaged = bytearray(match.blob)
        damaged[-5] ^= 0xFF  # the frame's checksum fails
        cache.store(key, damaged, namespace=namespace)
        before = store.damaged
        with store.restore(tokens, namespace=NS, deferred=True) as found:  # type: ignore[union-attr]
            assert not store.write_checked(found, memoryview(bytearray(found.nbytes)))
        assert store.damaged == before + 1
        gone = cache.peek(key, namespace=namespace)
        assert gone is None or gone.key_length < len(key)
        store.store(tokens, data, namespace=NS)  # written again
    whole = chunks.ChunkedStates(cache, fingerprint=FP, kind=KIND, chunk_tokens=0)
    whole.store(tokens, data, namespace="whole")
    with whole.restore(tokens, namespace="whole", deferred=True) as found:  # type: ignore[union-attr]
        out = bytearray(found.nbytes)
        assert found.joined_chunks == 0 and whole.write_checked(found, memoryview(out)) and out == data
    with cache.lookup(tokens, namespace="whole") as match:  # type: ignore[union-attr]
        damaged = bytearray(match.blob)
    damaged[-5] ^= 0xFF
    cache.store(tokens, damaged, namespace="whole")
    with whole.restore(tokens, namespace="whole", deferred=True) as found:  # type: ignore[union-attr]
        assert not whole.write_checked(found, memoryview(bytearray(found.nbytes))) and whole.damaged == 1
    assert cache.peek(tokens, namespace="whole") is None


def test_checks_meanwhile_are_shared_among_the_spare_cores(
    llm: Any, cache: sippcache.CacheBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host with cores to spare the payload checks run on several threads at once
    (`check_threads`): their answer is every part's, a damaged chunk in any part fails it."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert chunks.check_threads() == chunks.CHECK_THREADS == 4
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert chunks.check_threads() == 1  # the caller and one gather helper take both cores
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    tokens = prompt(500)
    data = state_of(llm, tokens)
    store = states(cache)
    store.store(tokens, data, namespace=NS)
    with store.restore(tokens, namespace=NS, deferred=True) as intact:  # type: ignore[union-attr]
        assert len(intact.unchecked) >= 4 and store.check_meanwhile(intact).result() is True
    chunk_namespace = entries(cache)[0][0].namespace
    for end in (C, 5 * C):  # in the first thread's share, then another's
        with cache.lookup(tokens[:end], namespace=chunk_namespace) as match:  # type: ignore[union-attr]
            damaged = bytearray(match.blob)
        damaged[-5] ^= 0xFF
        cache.store(tokens[:end], damaged, namespace=chunk_namespace)
        before = store.damaged
        with store.restore(tokens, namespace=NS, deferred=True) as found:  # type: ignore[union-attr]
            assert store.check_meanwhile(found).result() is False
        assert store.damaged == before + 1
        store.store(tokens, data, namespace=NS)  # the chunk written again


def test_with_a_secret_every_chunk_carries_a_mac(llm: Any, cache: sippcache.CacheBackend) -> None:
    tokens = prompt(300)
    data = state_of(llm, tokens)
    states(cache, secret=b"s3cret").store(tokens, data, namespace=NS)
    for info in cache.entries():
        with cache.lookup(info.key, namespace=info.namespace) as match:  # type: ignore[union-attr]
            assert frame.decode(match.blob, secret=b"s3cret").authenticated
            with pytest.raises(CorruptEntry, match="MAC"):
                frame.decode(match.blob, secret=b"another")
    assert restored(states(cache, secret=b"s3cret"), tokens) == (tuple(tokens), data)
    assert states(cache, secret=b"another").restore(tokens, namespace=NS) is None  # refused, and deleted


# -- whole entries ------------------------------------------------------------------------------------------


def test_entries_of_the_whole_form_still_restore(llm: Any, cache: sippcache.CacheBackend) -> None:
    """What the proxy stored before chunks: the state as the first section of one entry of its kind."""
    tokens = prompt(300)
    data = state_of(llm, tokens)
    meta = {"slot_version": 4, "prompt": 290}
    cache.store(
        tokens, frame.encode(tokens, [data], fingerprint=FP, kind=KIND, meta=meta, roles=["state"]), namespace=NS
    )
    assembled = states(cache).restore([*tokens, 1], namespace=NS, partial=True)
    assert assembled is not None
    with assembled:
        assert assembled.whole and assembled.chunks == 0 and assembled.entry.meta == meta
        assert assembled.tokens == tuple(tokens) and bytes(assembled.state) == data


def test_an_unsplittable_state_is_stored_whole_and_counted(
    llms: dict[tuple[str, bool], Any], cache: sippcache.CacheBackend
) -> None:
    tokens = prompt(200)
    data = state_of(llms["recurrent", True], tokens)  # Mamba: one cell holds the whole sequence
    store = states(cache)
    stored = store.store(tokens, data, namespace=NS, meta={"prompt": 200}, sections=[b"logits"], roles=["logits"])
    assert not stored.chunked and "recurrent" in stored.why_whole and store.stored_whole == 1
    assert entries(cache)[0] == []
    with cache.lookup(tokens, namespace=NS) as match:  # type: ignore[union-attr]
        entry = frame.decode(match.blob)
        assert (entry.kind, entry.roles, entry.meta) == (KIND, ("state", "logits"), {"prompt": 200})
        del entry
    assembled = store.restore(tokens, namespace=NS)
    assert assembled is not None
    with assembled:
        assert assembled.whole and bytes(assembled.state) == data and assembled.extra("logits") == b"logits"
    # Chunking off: whole too, and not counted as a state that could not be cut.
    off = chunks.ChunkedStates(cache, fingerprint=FP, kind=KIND, chunk_tokens=0)
    assert not off.store(prompt(300), state_of(llms["attention", True], prompt(300)), namespace=NS).chunked
    assert off.stored_whole == 0


def test_a_tail_keeps_the_callers_sections_and_meta(llm: Any, cache: sippcache.CacheBackend) -> None:
    tokens = prompt(300)
    store = states(cache, versions={"llama.cpp": "test"})
    store.store(tokens, state_of(llm, tokens), namespace=NS, meta={"prompt": 7}, sections=[b"L" * 40], roles=["logits"])
    assembled = store.restore(tokens, namespace=NS)
    assert assembled is not None
    with assembled:
        assert not assembled.whole and assembled.entry.meta["prompt"] == 7
        assert assembled.extra("logits") == b"L" * 40 and assembled.entry.versions == {"llama.cpp": "test"}


# -- superseding, pins, checks ----------------------------------------------------------------------


def test_a_state_supersedes_the_entries_under_its_prefixes_except_pinned_ones(
    llm: Any, cache: sippcache.CacheBackend
) -> None:
    """`supersede` (the llama-cpp-python layer's prompt ends, on full attention): once stored as
    chunks, the unpinned entries under shorter prefixes of the state go; the state, cut back,
    serves them. Entries of other prompts, and pinned ones, stay."""
    store = states(cache)
    tokens, other = prompt(300), prompt(120, seed=3)
    for n in (100, 150, 200):
        store.store(tokens[:n], state_of(llm, tokens[:n]), namespace=NS, pinned=n == 150)
    store.store(other, state_of(llm, other), namespace=NS)
    data = state_of(llm, tokens)
    store.store(tokens, data, namespace=NS, supersede=True)
    _, kept = entries(cache)
    assert sorted(len(e.key) for e in kept) == [120, 150, 300]
    assert [len(e.key) for e in kept if e.pinned] == [150]
    # What was superseded comes from the longer state: its chunks, cut at a chunk boundary.
    assert restored(store, [*tokens[:200], 9], partial=True) == (tuple(tokens[:256]), sf.prefix(data, 256))
    # Whole states (chunking off) supersede nothing: they cannot be cut apart.
    whole = chunks.ChunkedStates(cache, fingerprint=FP, kind=KIND, chunk_tokens=0)
    whole.store(other[:60], state_of(llm, other[:60]), namespace="other")
    whole.store(other, state_of(llm, other), namespace="other", supersede=True)
    assert len([e for e in cache.entries("other")]) == 2


def test_pinning_a_state_pins_its_chain(llm: Any, cache: sippcache.CacheBackend) -> None:
    store = states(cache)
    tokens = prompt(300)
    store.store(tokens, state_of(llm, tokens), namespace=NS)
    assert store.pin(tokens, namespace=NS)
    chunk_entries, kept = entries(cache)
    assert all(e.pinned for e in chunk_entries + kept) and len(chunk_entries) == 4
    assert store.pin(tokens, namespace=NS, pinned=False)
    assert not any(e.pinned for e in cache.entries())
    assert not store.pin(prompt(50, seed=8), namespace=NS)


def test_a_chunk_frame_holds_its_own_tokens_and_the_chained_digest_of_its_key(
    llm: Any, cache: sippcache.CacheBackend, tmp_path: Path
) -> None:
    """A chunk's frame holds C tokens and a digest standing for all k*C of its key, so a chain
    reads O(N) key bytes; `chunk_matches_key` is the check, and `sippcache verify` passes chunks."""
    store = states(cache)
    tokens = prompt(300)
    store.store(tokens, state_of(llm, tokens), namespace=NS)
    chunk_entries, _ = entries(cache)
    for entry in chunk_entries:
        with cache.lookup(entry.key, namespace=entry.namespace) as match:
            decoded = frame.decode(match.blob)
            assert decoded.tokens == tuple(entry.key[-C:])
            assert chunkentries.chunk_matches_key(decoded, entry.key)
            assert not chunkentries.chunk_matches_key(decoded, [*entry.key[:-1], entry.key[-1] ^ 1])
            assert not chunkentries.chunk_matches_key(decoded, [entry.key[0] ^ 1, *entry.key[1:]])
            del decoded
    url = f"lmdb://{tmp_path}/verify"
    with sippcache.open(url) as disk:
        states(disk).store(tokens, state_of(llm, tokens), namespace=NS)
    result = subprocess.run(
        [sys.executable, "-m", "sippcache.cli", "verify", url, "--json"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"checked": 5, "bad": [], "deleted": 0}


def test_stats_shows_what_chunked_states_take_against_their_distinct_tokens(llm: Any, tmp_path: Path) -> None:
    """`sippcache stats`: per namespace with chunks, its states, chunks, bytes, the distinct tokens
    their keys hold and the bytes stored over those tokens' K/V bytes. Four conversations over one
    system prompt, two turns each, in chunks: about 1x; whole states of the same: far more."""
    system = prompt(256)
    chats = [system + prompt(41, seed=10 + c)[1:] for c in range(4)]  # (each prompt() starts with BOS)
    turns = [chat + prompt(31, seed=20 + c)[1:] for c, chat in enumerate(chats)]
    url = f"lmdb://{tmp_path}/stats"
    with sippcache.open(url) as cache:
        store = states(cache)
        for first, second in zip(chats, turns, strict=True):
            store.store(first, state_of(llm, first), namespace=NS)
            store.store(second, state_of(llm, second), namespace=NS, replaces=first)
        whole = chunks.ChunkedStates(cache, fingerprint=FP, kind=KIND, chunk_tokens=0)
        for first, second in zip(chats, turns, strict=True):
            whole.store(first, state_of(llm, first), namespace="whole")
            whole.store(second, state_of(llm, second), namespace="whole")
        (use,) = chunkentries.usage(cache.entries())
    distinct = 256 + 4 * 70
    assert (use.namespace, use.states, use.distinct_tokens) == (NS, 4, distinct)
    assert use.chunks == 4 + 4  # the system prompt's 4 chunks once, and each conversation's 5th
    assert 500 < use.kv_bytes_per_token < 600  # the tiny model's 512 bytes, with the frames
    assert 1.0 <= use.per_distinct < 1.6
    result = subprocess.run(
        [sys.executable, "-m", "sippcache.cli", "stats", url, "--json"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["chunked"]
    assert (row["namespace"], row["states"], row["chunks"], row["distinct_tokens"]) == (NS, 4, 8, distinct)
    table = subprocess.run(
        [sys.executable, "-m", "sippcache.cli", "stats", url], capture_output=True, text=True, check=False
    )
    assert table.returncode == 0 and "chunked states" in table.stdout


# -- a writer killed mid-store ----------------------------------------------------------------------


def token_state(tokens: list[int], layers: int = 8, row: int = 256) -> bytes:
    """A state in llama.cpp's format (version 3, with `llama_state_seq_get_data`'s header) whose
    every cell's K and V rows are made from the tokens up to it, as a real model's are: states
    sharing a prefix share its bytes, so chunks of one serve another, and the state of a prefix
    is `token_state` of it."""
    digest, cells_rows = b"", []
    for token in tokens:
        digest = xxhash.xxh3_128_digest(digest + token.to_bytes(4, "little"))
        cells_rows.append(digest * (row // len(digest)))
    rows = b"".join(cells_rows)
    parts = [
        struct.pack("<Ii", sf.SEQ_STATE_MAGIC, 0),
        struct.pack("<II", 1, len(tokens)),
        b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(len(tokens))),
        struct.pack("<II", 0, layers),
    ]
    for _ in range(2 * layers):  # every layer's K rows, then every layer's V rows (f16)
        parts += [struct.pack("<iQ", 1, row), rows]
    return b"".join(parts)


def conversation(i: int) -> list[int]:
    """Conversation `i`'s tokens: a shared 100-token system prompt, then its own 20 to 140."""
    rng = random.Random(i)
    return list(range(1000, 1100)) + [rng.randrange(3, 5000) for _ in range(rng.randrange(20, 140))]


_WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
import sippcache
from sippcache.state import chunks
from tests.test_chunks import conversation, token_state
with sippcache.open(sys.argv[1]) as cache:
    store = chunks.ChunkedStates(cache, fingerprint="fp", kind="test.seq", chunk_tokens=16)
    for i in range(int(sys.argv[3]), 10**6):
        tokens = conversation(i)
        store.store(tokens, token_state(tokens), namespace="ns")
        print(i, flush=True)
"""


def test_a_writer_killed_mid_store_leaves_no_chain_that_restores_wrong_bytes(tmp_path: Path) -> None:
    """A writer storing states of conversations over one system prompt is killed (SIGKILL) at
    random points, three times; whatever it left, every restore gives exactly the state of the
    tokens it says it holds (a shorter run where chunks are missing), or nothing."""
    url = f"lmdb://{tmp_path}/store"
    rng = random.Random(3)
    start, done = 0, 0
    root = str(Path(__file__).resolve().parent.parent)
    for _ in range(3):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, url, root, str(start)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None
        for _ in range(rng.randrange(5, 40)):  # some states stored whole, then a kill mid-way
            done = int(writer.stdout.readline()) + 1
        time.sleep(rng.random() * 0.05)
        writer.kill()
        writer.wait()
        start = done + 1
    checked = 0
    with sippcache.open(url) as cache:
        store = chunks.ChunkedStates(cache, fingerprint="fp", kind="test.seq", chunk_tokens=16)
        for i in range(start + 2):
            tokens = conversation(i)
            for query, partial in ((tokens, False), ([*tokens[:110], 1], True)):
                assembled = store.restore(query, namespace="ns", partial=partial)
                if assembled is None:
                    continue
                with assembled:
                    held = list(assembled.tokens)
                    assert held == query[: len(held)] or partial
                    assert bytes(assembled.state) == token_state(held), (i, partial, len(held))
                    checked += 1
    assert checked >= done  # each state stored before the last kill is found whole


def test_under_a_budget_no_chunk_outlives_the_chunk_before_it() -> None:
    """A chunk is worth something only with every chunk before it, and a tail only with its whole
    chain. Conversations over one system prompt through a store 10x too small (old ones coming
    back now and then): whatever eviction took, every chunk left has its parent chunk and every
    tail left its chain, so no run is cut short in its middle. (Before the chain was used again
    after its tail was stored, 1 tail of 20 here had lost its last chunk.)"""
    with sippcache.open("ram://?max_bytes=600KiB") as cache:
        store = chunks.ChunkedStates(cache, fingerprint="fp", kind="test.seq", chunk_tokens=16)
        for i in range(60):
            tokens = conversation(i)
            store.store(tokens, token_state(tokens, layers=2, row=64), namespace="ns")
            if i % 3 == 0:
                back = store.restore(conversation(i // 2), namespace="ns")
                if back is not None:
                    back.release()
        assert cache.stats().evictions > 100
        held = {tuple(e.key) for e in cache.entries() if chunkentries.is_chunk_namespace(e.namespace)}
        tails = [tuple(e.key) for e in cache.entries(namespace="ns")]
    assert held and all(key[:-16] in held for key in held if len(key) > 16)
    assert len(tails) >= 10
    assert all(key[:end] in held for key in tails for end in range(16, len(key), 16))


# -- two processes over one system prompt -----------------------------------------------------------

_PREFILLER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import numpy as np
from sippcache.llama import Llama, PrefixCache
from harness.llama_tools import last_logits
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_batch=512, flash_attn=False, verbose=False)
with PrefixCache(llm, sys.argv[2]) as cache:  # chunks of 64 tokens, the default
    cache.prefill(json.loads(sys.stdin.read()))
    np.save(sys.argv[4], last_logits(llm))
    cache.flush()
    print(json.dumps(cache.stats()))
"""


def prefill_in_a_process(model: Path, url: str, tokens: list[int], logits: Path) -> dict[str, Any]:
    """`PrefixCache.prefill(tokens)` over a `sippcache.llama.Llama` in a new Python process: its
    stats once its states are written; the last logits are saved to `logits`."""
    done = subprocess.run(
        [sys.executable, "-c", _PREFILLER, str(model), url, str(ROOT), str(logits)],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SIPPCACHE_RESTORE": "always"},  # the tiny model computes faster than it loads
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stats: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return stats


def test_a_second_process_restores_the_shared_prompt_from_the_first_ones_chunks(
    tiny_model: Path, make_llama: Any, tmp_path: Path
) -> None:
    """Process A prefills a 300-token system prompt and its own question; process B, started after
    A ended, the same prompt and another question. B restores the prompt from A's chunks (cut
    back to the 300 tokens they share), writes only the chunks past it, and its logits are those
    of a llama.cpp context that never saw a cache, evaluating B's tokens in the same two batches."""
    size = chunks.DEFAULT_CHUNK_TOKENS  # 64: the prompt's first 4 chunks are whole, its 5th is not
    system = prompt(300)
    a, b = system + prompt(61, seed=1)[1:], system + prompt(91, seed=2)[1:]  # 360 and 390 tokens
    assert a[300] != b[300]
    url = f"lmdb://{tmp_path / 'store'}"

    first = prefill_in_a_process(tiny_model, url, a, tmp_path / "a.npy")
    assert (first["hits"], first["chunks_written"], first["chunks_shared"]) == (0, 5, 0)  # 64, 128, ... 320
    second = prefill_in_a_process(tiny_model, url, b, tmp_path / "b.npy")
    # Restored: A's state cut back to the shared prompt, read as A's first 5 chunks (the 5th, of
    # tokens 256 to 320, holds 20 of A's own, cut off); then B's 90 tokens evaluated.
    assert (second["hits"], second["partial_hits"], second["tokens_reused"]) == (1, 1, 300)
    assert second["chunks_read"] == 5 and second["tokens_evaluated"] == len(b) - 300
    # Stored: the prompt's 4 whole chunks were A's already; B wrote its 320 and 384 and its tail.
    assert (second["chunks_shared"], second["chunks_written"], second["entries_written"]) == (4, 2, 1)

    with sippcache.open(url) as cache:
        held, tails = entries(cache)
    assert len({e.namespace for e in held}) == 1 and len(tails) == 2
    boundaries = {tuple(tokens[:end]) for tokens in (a, b) for end in range(size, len(tokens), size)}
    assert len(boundaries) == 5 + 6 - 4 and sorted(e.key for e in held) == sorted(boundaries)

    fresh = make_llama(tiny_model, flash_attn=False)  # no cache: B's prompt in B's two batches
    fresh.eval(b[:300])
    fresh.eval(b[300:])
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), last_logits(fresh))
    whole, _ = reference_logits(make_llama, tiny_model, b, flash_attn=False)  # and in one batch
    assert_close(np.load(tmp_path / "b.npy"), whole)
