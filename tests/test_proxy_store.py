"""`SlotStore.keep` on a real RAM store: which entry a slot's new state replaces. A conversation keeps
one entry; a new conversation that parts from an entry within its prompt (over a shared system
prompt) never deletes it. With real llama.cpp states: stored as chunks and a tail (a later save
writes only its new chunks, conversations share a system prompt's), staged back as the very slot
file llama-server wrote; what sippcache.state cannot cut, and entries stored whole, as before."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sippcache
from sippcache import state as sf
from sippcache.proxy import slotfile
from sippcache.proxy.slots import SUPERSEDE_SLACK, Origin
from sippcache.proxy.staging import StagingFile, remove_stale_files
from sippcache.proxy.store import Saved, SlotStore, Snapshot
from sippcache.state import chunkentries, copier

SYSTEM = tuple(range(1000, 1400))  # a 400-token system prompt


@pytest.fixture
def store(tmp_path: Path) -> SlotStore:
    return SlotStore(
        sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path), min_tokens=16
    )


def keep(store: SlotStore, tokens: tuple[int, ...], prompt: int, supersedes: Origin | None) -> Origin:
    """Store a slot state of `tokens` (the first `prompt` of them the request's prompt), as the proxy
    does after a response; the Origin the slot then holds."""
    path = Path(store.staging) / f"s-{len(tokens)}-{tokens[-1]}.slot"
    path.write_bytes(b"".join(slotfile.build(4, tokens, b"state" * 10)))
    saved = store.keep(Snapshot(str(path), tokens, prompt, time.perf_counter()), supersedes, "")
    assert saved is not None and not path.exists()
    return Origin(tokens, prompt)


def keys(store: SlotStore) -> set[tuple[int, ...]]:
    return {tuple(e.key) for e in store.cache.entries(namespace=store.namespace(""))}


def test_the_next_turn_of_a_conversation_replaces_its_entry(store: SlotStore) -> None:
    turn1 = (*SYSTEM, 1, 2, 3)
    first = keep(store, (*turn1, 50, 51, 52), len(turn1), None)  # prompt, then a 3-token answer
    turn2 = (*turn1, 50, 51, 99, 7, 8)  # the answer written back otherwise at its end, a new question
    keep(store, (*turn2, 60, 61), len(turn2), first)
    assert keys(store) == {(*turn2, 60, 61)}


def test_a_new_conversation_over_a_shared_system_prompt_keeps_the_first(store: SlotStore) -> None:
    alice = (*SYSTEM, 1, 2)
    first = keep(store, (*alice, 50, 51), len(alice), None)  # short: question and answer inside the slack
    bob = (*SYSTEM, 3, 4, 5)
    keep(store, (*bob, 70, 71), len(bob), first)  # restored from alice's entry, parts within its prompt
    assert keys(store) == {(*alice, 50, 51), (*bob, 70, 71)}


def test_a_regenerated_long_answer_keeps_the_first_answer(store: SlotStore) -> None:
    prompt = (*SYSTEM, 1, 2)
    answer = tuple(range(5000, 5000 + 2 * SUPERSEDE_SLACK))
    first = keep(store, (*prompt, *answer), len(prompt), None)
    other = (*prompt, *range(6000, 6000 + 3 * SUPERSEDE_SLACK))
    keep(store, other, len(prompt), first)
    assert keys(store) == {(*prompt, *answer), other}


def test_an_entry_whose_prompt_is_not_known_is_replaced_by_the_slack_rule(store: SlotStore) -> None:
    tokens = (*SYSTEM, 1, 2, 50, 51)
    keep(store, tokens, len(tokens), None)
    keep(store, (*tokens[:-2], 9, 9, 9, 9), 0, Origin(tokens, 0))  # an entry from before prompts were kept
    assert keys(store) == {(*tokens[:-2], 9, 9, 9, 9)}


def test_the_index_is_read_at_start_not_by_the_first_request(tmp_path: Path, caplog: Any) -> None:
    """A restarted proxy reads its store's index in a worker thread at start (`load_index`): the
    states a proxy before it kept are then indexed before any lookup, and found; a store that
    fails to read is logged and counted, not raised (the first lookup tries again)."""
    url = f"lmdb://{tmp_path}/store"
    with sippcache.open(url) as cache:
        first = SlotStore(cache, fingerprint="f", facts={}, kind="full", staging=str(tmp_path), min_tokens=16)
        keep(first, (*SYSTEM, 1, 2, 3), len(SYSTEM) + 3, None)
    with sippcache.open(url) as cache:
        again = SlotStore(cache, fingerprint="f", facts={}, kind="full", staging=str(tmp_path), min_tokens=16)
        assert cache._replica.seq < 0  # opened: nothing read yet
        again.load_index()
        assert cache._replica.seq >= 0 and cache._replica.read_every_entry  # read, no lookup made
        peek = again.best((*SYSTEM, 1, 2, 3, 4), "")
        assert peek is not None and peek.length == len(SYSTEM) + 3
    again.load_index()  # its store closed: a failure, logged
    assert again.errors == 1 and "reading the index failed" in caplog.text


# -- the byte path: what a save stores and what a restore stages ------------------------------------------


def test_a_saved_state_is_stored_byte_for_byte_in_the_sequence_form(store: SlotStore) -> None:
    """The slot file is mapped, its header overwritten in that private mapping only: the entry holds
    exactly llama_state_seq_get_data's form of the state (seq header + the file's state bytes)."""
    from sippcache import frame

    tokens = (*SYSTEM, 1, 2, 3)
    state = bytes(range(256)) * 64
    keep_state = Path(store.staging) / "s.slot"
    keep_state.write_bytes(b"".join(slotfile.build(4, tokens, state)))
    saved = store.keep(Snapshot(str(keep_state), tokens, len(tokens), time.perf_counter()), None, "")
    assert saved is not None and saved.tokens == tokens
    with store.cache.lookup(tokens, namespace=store.namespace("")) as match:
        entry = frame.decode(match.blob)
        assert entry.tokens == tokens and entry.meta["slot_version"] == 4
        assert bytes(entry.sections[0]) == struct.pack("<Ii", slotfile.SEQ_STATE_MAGIC, 0) + state


@pytest.fixture(params=["one thread", "helper threads"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a staged state's bytes are copied: on the calling thread (a small state), or in bands
    and tables on helper threads too (`copier.PARALLEL_GATHER_BYTES`, 4 MiB, made 0)."""
    if request.param == "helper threads":
        monkeypatch.setattr(copier, "PARALLEL_GATHER_BYTES", 0)
        monkeypatch.setattr(copier.os, "cpu_count", lambda: 4)
    return str(request.param)


def staged_state(path: str | Path, nbytes: int) -> bytes:
    """The first `nbytes` of the state in the slot file at `path`: what llama.cpp reads of it (a
    state says its own length; a staging file may be longer than the state it holds)."""
    state = slotfile.parse(Path(path).read_bytes()).state
    assert len(state) >= nbytes
    return bytes(state[:nbytes])


@pytest.mark.parametrize("version", [1, 4])
def test_restores_rewrite_one_staging_file_per_slot_in_place(store: SlotStore, copies: str, version: int) -> None:
    """Each restore into a slot goes through the same file, rewritten over its own pages; `close`
    removes it. For a llama.cpp that reads a longer file (slot-file version 2 on) a shorter state
    leaves the file as long as it was, its pages kept for the next longer state; for version 1
    (written by builds that abort on a longer file too) the file is cut to the state's length."""
    long_state, short_state = b"L" * 40_000, b"s" * 1_000
    for state, tokens in ((long_state, (*SYSTEM, 1)), (short_state, (*SYSTEM, 2))):
        path = Path(store.staging) / "in.slot"
        path.write_bytes(b"".join(slotfile.build(version, tokens, state)))
        assert store.keep(Snapshot(str(path), tokens, len(tokens), time.perf_counter()), None, "") is not None
    target = store.restore_file("http://127.0.0.1:1", 0)
    assert store.restore_file("http://127.0.0.1:2", 0) != target != store.restore_file("http://127.0.0.1:1", 1)
    staged = store._stage((*SYSTEM, 1, 7), store.namespace(""), target)
    assert staged is not None and staged[1] == len(long_state)
    made = os.stat(target)
    assert staged_state(target, len(long_state)) == long_state
    staged = store._stage((*SYSTEM, 2, 7), store.namespace(""), target)
    assert staged is not None and staged[0].tokens == (*SYSTEM, 2)
    assert os.stat(target).st_ino == made.st_ino
    parsed = slotfile.parse(Path(target).read_bytes())
    assert parsed.version == version and parsed.tokens == (*SYSTEM, 2)
    if version == 1:
        assert bytes(parsed.state) == short_state
    else:
        assert os.stat(target).st_size == made.st_size and bytes(parsed.state[: len(short_state)]) == short_state
    store.close()
    assert not Path(target).exists()


def test_a_staging_file_kept_mapped_is_always_the_file_llama_server_reads(store: SlotStore) -> None:
    """A slot's staging file stays mapped between restores (`StagingFile`): a state shorter than
    the last, then longer again within the mapping, then longer than it (mapped again), and after
    the file was removed by someone else (the new file mapped, not the removed one), each time the
    file holds exactly the staged state."""
    states = {n: bytes([n % 251]) * n for n in (40_000, 1_000, 30_000, 90_000)}
    for n, state in states.items():
        path = Path(store.staging) / "in.slot"
        path.write_bytes(b"".join(slotfile.build(4, (*SYSTEM, n), state)))
        assert store.keep(Snapshot(str(path), (*SYSTEM, n), len(SYSTEM) + 1, time.perf_counter()), None, "")
    target = store.restore_file("http://127.0.0.1:1", 0)

    def staged(n: int) -> bytes:
        assert store._stage((*SYSTEM, n, 7), store.namespace(""), target) is not None
        return staged_state(target, n)

    for n in (40_000, 1_000, 30_000, 90_000):
        assert staged(n) == states[n]
    os.unlink(target)
    assert staged(1_000) == states[1_000] and staged(40_000) == states[40_000]
    store.close()
    assert not Path(target).exists()


def test_a_staging_file_made_ahead_is_written_in_place(store: SlotStore, caplog: Any) -> None:
    """`prepare` (the proxy's start, from the largest state its kept rates saw) makes a slot's staging
    file with its pages allocated; a restore then writes into that same file and mapping, a smaller
    state or (grown, remapped) a larger one. A prepare that fails is logged, not raised."""
    states = {n: bytes([n % 251]) * n for n in (40_000, 90_000)}
    for n, state in states.items():
        path = Path(store.staging) / "in.slot"
        path.write_bytes(b"".join(slotfile.build(4, (*SYSTEM, n), state)))
        assert store.keep(Snapshot(str(path), (*SYSTEM, n), len(SYSTEM) + 1, time.perf_counter()), None, "")
    url = "http://127.0.0.1:1"
    store.prepare(url, 0, 50_000)
    target = Path(store.restore_file(url, 0))
    made = os.stat(target)
    assert made.st_size >= 50_000 and made.st_blocks * 512 >= 50_000  # allocated, not a sparse file
    assert store._stage((*SYSTEM, 40_000, 7), store.namespace(""), str(target)) is not None
    assert os.stat(target).st_ino == made.st_ino and os.stat(target).st_size == made.st_size
    assert staged_state(target, 40_000) == states[40_000]
    assert store._stage((*SYSTEM, 90_000, 7), store.namespace(""), str(target)) is not None
    assert staged_state(target, 90_000) == states[90_000]
    grown = os.stat(target)
    assert grown.st_size > 90_000 * 1.1 and grown.st_blocks * 512 >= grown.st_size  # with room for a longer one
    store.prepare(url, 0, 10**6)  # after a restore: the file llama-server reads is left as it is
    assert staged_state(target, 90_000) == states[90_000]
    assert os.stat(target).st_size == grown.st_size  # not grown
    store.close()
    assert not target.exists()
    blocker = Path(store.staging) / "blocker"
    blocker.write_text("a file where the staging folder should be")
    store.staging = str(blocker)
    store.prepare(url, 1, 50_000)
    assert "cannot make the staging file" in caplog.text


def test_a_restore_does_not_wait_for_its_staging_file_to_be_made_ahead(ram_dir: Path) -> None:
    """A restarted proxy makes each slot's staging file ahead, in a worker thread (`prepare`): a
    gigabyte takes it a second or more. A restore that comes meanwhile takes the file as far as it
    got (the making ahead gives way at its next slice) instead of waiting for all of it, and
    writes its state whole; with no restore meanwhile, the file is made whole."""
    import threading

    folder = str(ram_dir)
    store = SlotStore(sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=folder, min_tokens=16)
    try:
        state = bytes(range(250)) * 160
        path = Path(folder) / "in.slot"
        path.write_bytes(b"".join(slotfile.build(4, (*SYSTEM, 1), state)))
        assert store.keep(Snapshot(str(path), (*SYSTEM, 1), len(SYSTEM) + 1, time.perf_counter()), None, "")
        url = "http://127.0.0.1:1"
        target = store.restore_file(url, 0)
        staging = store._staging_files[target]
        result: list[bool] = []
        worker = threading.Thread(target=lambda: result.append(staging.reserve(1 << 30)))
        worker.start()
        while not os.path.exists(target) or os.stat(target).st_size == 0:
            assert worker.is_alive(), "the file was not made"
            time.sleep(0.001)
        assert store._stage((*SYSTEM, 1, 7), store.namespace(""), target) is not None
        worker.join()
        assert result == [False]  # it gave way to the restore
        assert staged_state(target, len(state)) == state
        whole = StagingFile(os.path.join(folder, "whole.slot"))
        assert whole.reserve(8 << 20)  # nothing came meanwhile: made whole
        assert os.stat(whole.path).st_blocks * 512 >= 8 << 20
        whole.close()
    finally:
        store.close()


def test_a_restore_into_a_folder_without_room_for_its_state_is_a_miss_not_a_crash(tmp_path: Path) -> None:
    """A staging folder too small for a state (a container's /dev/shm is 64 MB unless it is given
    more): the staging file's pages are allocated before the state is copied into its mapping, so
    no room is an OSError (a miss, counted, the file removed), where a copy into a page the tmpfs
    could not allocate was a SIGBUS that killed the proxy. A state that fits then restores there,
    and one that fits but not with the eighth more a file grows by (`GROWTH_SLACK`) restores
    without it; a shorter state then cuts the file to its length (kept long, it would hold room
    llama-server's saves need). Run in a private mount namespace whose folder is a 1 MiB tmpfs."""
    from tests.filesystems import in_small_tmpfs

    small = tmp_path / "small"
    small.mkdir()
    code = """if True:
        import json, os, sys, time
        import sippcache
        from sippcache.proxy import slotfile
        from sippcache.proxy.store import SlotStore, Snapshot
        disk, small = sys.argv[1:]
        store = SlotStore(sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=disk, min_tokens=16)
        system = tuple(range(1000, 1400))
        sizes = {1: 2 << 20, 2: 256 << 10, 3: 940 << 10}
        for n, size in sizes.items():
            path = os.path.join(disk, f"in-{n}.slot")
            with open(path, "wb") as f:
                f.writelines(slotfile.build(4, (*system, n), bytes([n]) * size))
            assert store.keep(Snapshot(path, (*system, n), 401, time.perf_counter()), None, "") is not None
        target = os.path.join(small, "restore.slot")
        big = store._stage((*system, 1, 7), store.namespace(""), target)
        out = {"big": big is not None, "errors": store.errors, "left": os.path.exists(target)}
        for n in (2, 3):
            fits = store._stage((*system, n, 7), store.namespace(""), target)
            with open(target, "rb") as f:
                state = slotfile.parse(f.read()).state[: sizes[n]]  # the file may be longer than its state
                out[f"fits {n}"] = fits is not None and bytes(state) == bytes([n]) * sizes[n]
        store._stage((*system, 2, 7), store.namespace(""), target)  # the folder has not its room again:
        out["cut"] = os.path.getsize(target) == len(b"".join(slotfile.build(4, (*system, 2), bytes(sizes[2]))))
        store.close()
        print(json.dumps(out))
    """
    done = subprocess.run(
        [*in_small_tmpfs(str(small), "1m"), sys.executable, "-c", code, str(tmp_path), str(small)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    out = json.loads(done.stdout.splitlines()[-1])
    assert out == {"big": False, "errors": 1, "left": False, "fits 2": True, "fits 3": True, "cut": True}


def test_slot_files_a_proxy_killed_outright_left_are_removed(tmp_path: Path) -> None:
    """A proxy killed outright (SIGKILL) leaves its save and restore files (gigabytes in RAM, kept
    until a reboot); the next store on the directory removes those whose process is gone, and
    keeps a live process's (another proxy's sharing the directory), older names without a pid,
    and everything else. A file last changed before the live process with its pid started was
    another's, given the same pid (a container's proxy gets the same pid at each start): removed.
    The managed proxies' staging directories are cleaned the same way."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    gone, live = int(done.stdout), os.getpid()
    removed = [
        f"sippcache-save-{gone}-0a1b.slot",
        f"sippcache-restore-{gone}-5f3e-0.slot",
        "sippcache-save-0-0a1b.slot",  # no process is 0
        f"sippcache-save-{10**30}-0a1b.slot",  # nor a number no pid can be
    ]
    kept = [
        f"sippcache-save-{live}-0a1b.slot",
        f"sippcache-restore-{live}-5f3e-0.slot",
        "sippcache-save-0a1b2c3d.slot",  # named before the pid was in the name
        f"model-{gone}-x.slot",
    ]
    reused = f"sippcache-restore-{live}-77aa-0.slot"  # left before this process, given its pid, started
    removed.append(reused)
    for name in removed + kept:
        (tmp_path / name).write_bytes(b"slot")
    os.utime(tmp_path / reused, (time.time() - 3600, time.time() - 3600))
    SlotStore(sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    for name in (f"sippcache-proxy-{gone}-x1", f"sippcache-proxy-{live}-x2", "sippcache-proxy-ab_12"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "llama-server.log").write_bytes(b"log")
    assert remove_stale_files(str(tmp_path), ("sippcache-proxy-",)) == 1
    assert not (tmp_path / f"sippcache-proxy-{gone}-x1").exists()
    assert (tmp_path / f"sippcache-proxy-{live}-x2" / "llama-server.log").exists()
    assert (tmp_path / "sippcache-proxy-ab_12").exists()


# -- chunked states (sippcache.state.chunks), on real llama.cpp states --------------------------------------------

CHUNK = 64


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import llama_cpp

    from harness.tinymodel import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("proxy-store-model") / "tiny.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=512, verbose=False)
    yield llm
    llm.close()


def real_state(llm: Any, tokens: tuple[int, ...]) -> bytes:
    """llama.cpp's state bytes of `tokens` as a slot file holds them (no 8-byte header; version 3:
    llama-cpp-python's llama.cpp), evaluated in batches ending at multiples of CHUNK."""
    import ctypes

    import llama_cpp

    llm.reset()
    begin = 0
    for end in [*range(CHUNK, len(tokens), CHUNK), len(tokens)]:
        llm.eval(list(tokens[begin:end]))
        begin = end
    size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(llm.ctx, buffer, size, 0)
    return bytes(buffer)[8:written]


@pytest.fixture
def chunked(tmp_path: Path) -> SlotStore:
    return SlotStore(
        sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path), chunk_tokens=CHUNK
    )


def keep_real(
    store: SlotStore, llm: Any, tokens: tuple[int, ...], prompt: int, supersedes: Origin | None, scope: str = ""
) -> Saved:
    path = Path(store.staging) / f"real-{len(tokens)}-{tokens[-1]}.slot"
    path.write_bytes(b"".join(slotfile.build(3, tokens, real_state(llm, tokens))))
    saved = store.keep(Snapshot(str(path), tokens, prompt, time.perf_counter()), supersedes, scope)
    assert saved is not None and not path.exists()
    return saved


def state_keys(store: SlotStore) -> list[tuple[int, ...]]:
    """The keys of the tails and whole entries (the chunks aside)."""
    return sorted(tuple(e.key) for e in store.cache.entries() if not chunkentries.is_chunk_namespace(e.namespace))


def chunk_keys(store: SlotStore) -> list[int]:
    return sorted(len(e.key) for e in store.cache.entries() if chunkentries.is_chunk_namespace(e.namespace))


def tiny_tokens(n: int, seed: int) -> tuple[int, ...]:
    import random

    rng = random.Random(seed)
    return tuple(rng.randrange(3, 259) for _ in range(n))


def test_a_chunked_state_is_staged_as_the_slot_file_llama_server_wrote(
    chunked: SlotStore, tiny_llm: Any, copies: str
) -> None:
    tokens = (1, *tiny_tokens(499, 0))
    state = real_state(tiny_llm, tokens)
    saved = keep_real(chunked, tiny_llm, tokens, len(tokens), None)
    assert saved.state_bytes == len(state) + 8 and saved.nbytes < saved.state_bytes * 1.1
    assert state_keys(chunked) == [tokens] and chunk_keys(chunked) == list(range(CHUNK, 500, CHUNK))
    target = chunked.restore_file("http://127.0.0.1:1", 0)
    staged = chunked._stage((*tokens, 5), chunked.namespace(""), target)
    assert staged is not None and staged[0] == Origin(tokens, len(tokens)) and staged[2] == tokens
    written = b"".join(slotfile.build(3, tokens, state))
    assert Path(target).read_bytes()[: len(written)] == written  # the file may be longer: llama.cpp reads the state
    # A new conversation parting at 300 tokens: the chunks that cover them, cut by llama-server.
    staged = chunked._stage((*tokens[:300], 1, 2), chunked.namespace(""), target)
    assert staged is not None and staged[0].tokens == tokens and staged[2] == tokens[:320]
    parsed = slotfile.parse(Path(target).read_bytes())
    assert (parsed.version, parsed.tokens) == (3, tokens[:320])
    assert staged_state(target, len(sf.prefix(state, 320))) == sf.prefix(state, 320)
    peek = chunked.best((*tokens[:300], 1, 2), "")
    assert peek is not None and (peek.length, peek.key_length) == (300, 320)  # what a restore would load
    chunked.close()


def test_a_damaged_chunk_found_while_staging_leaves_no_slot_file(chunked: SlotStore, tiny_llm: Any) -> None:
    """The payloads' checksums run while the staging file is written: a damaged chunk makes the
    restore a miss (no file for llama-server to load), the chunk is deleted, and the next restore
    takes the run before it."""
    tokens = (1, *tiny_tokens(499, 2))
    state = real_state(tiny_llm, tokens)
    keep_real(chunked, tiny_llm, tokens, len(tokens), None)
    at = next(e.namespace for e in chunked.cache.entries() if chunkentries.is_chunk_namespace(e.namespace))
    with chunked.cache.lookup(tokens[: 3 * CHUNK], namespace=at) as match:  # type: ignore[union-attr]
        damaged = bytearray(match.blob)
    damaged[-5] ^= 0xFF
    chunked.cache.store(tokens[: 3 * CHUNK], damaged, namespace=at)
    target = chunked.restore_file("http://127.0.0.1:1", 0)
    errors = chunked.errors
    assert chunked._stage((*tokens, 5), chunked.namespace(""), target) is None and not Path(target).exists()
    assert chunked.errors == errors + 1 and chunked.states.damaged == 1
    assert chunked.cache.peek(tokens[: 3 * CHUNK], namespace=at).key_length == 2 * CHUNK  # type: ignore[union-attr]
    staged = chunked._stage((*tokens[:300], 1), chunked.namespace(""), target)  # a cut state: chunks alone
    assert staged is not None and staged[2] == tokens[: 2 * CHUNK]
    assert staged_state(target, len(sf.prefix(state, 2 * CHUNK))) == sf.prefix(state, 2 * CHUNK)
    chunked.close()


def test_conversations_over_one_system_prompt_write_it_once(chunked: SlotStore, tiny_llm: Any) -> None:
    system = (1, *tiny_tokens(599, 1))
    saved = [keep_real(chunked, tiny_llm, (*system, *tiny_tokens(100, 10 + i)), 620, None) for i in range(4)]
    per_token = saved[0].state_bytes // 700
    assert all(s.nbytes < (700 - 576) * per_token * 1.1 for s in saved[1:])  # only what follows 9 shared chunks
    assert len(state_keys(chunked)) == 4 and len(chunk_keys(chunked)) == 9 + 4 * 1


def test_the_next_turn_replaces_the_tail_and_keeps_the_shared_chunks(chunked: SlotStore, tiny_llm: Any) -> None:
    turn1 = (1, *tiny_tokens(459, 2))  # chunks to 448
    first = keep_real(chunked, tiny_llm, turn1, 440, None)
    assert first.nbytes > first.state_bytes
    turn2 = (*turn1[:445], *tiny_tokens(150, 3))  # its answer's end written back otherwise, a new question
    keep_real(chunked, tiny_llm, turn2, 560, Origin(turn1, 440))
    assert state_keys(chunked) == [turn2]  # one entry for the conversation
    assert chunk_keys(chunked) == list(range(CHUNK, len(turn2), CHUNK))
    # A new conversation that parts within the first one's prompt keeps it.
    other = (*turn2[:300], *tiny_tokens(100, 4))
    keep_real(chunked, tiny_llm, other, 390, Origin(turn2, 560))
    assert state_keys(chunked) == sorted([turn2, other])


def test_states_stateformat_cannot_cut_are_stored_whole_and_counted(chunked: SlotStore) -> None:
    keep(chunked, (*SYSTEM, 1, 2, 3), 400, None)  # b"state" * 10: no llama.cpp state
    assert chunked.stored_whole == 1 and chunk_keys(chunked) == []
    with chunked.cache.lookup((*SYSTEM, 1, 2, 3), namespace=chunked.namespace("")) as match:  # type: ignore[union-attr]
        from sippcache import frame

        entry = frame.decode(match.blob)
        assert (entry.kind, entry.roles) == ("llama-server.seq", ("state",))
        del entry
    recurrent = SlotStore(
        sippcache.open("ram://"), fingerprint="f", facts={}, kind="recurrent", staging=chunked.staging
    )
    assert recurrent.chunk_tokens == 0  # recurrent and hybrid memory: whole states, not counted
    keep(recurrent, (*SYSTEM, 1), 400, None)
    assert recurrent.stored_whole == 0


def test_whole_entries_of_earlier_proxies_restore_and_are_replaced(chunked: SlotStore, tiny_llm: Any) -> None:
    """An entry stored whole (by a proxy before chunks, or --chunk-tokens 0) restores as it did; the
    conversation's next save replaces it with a tail and chunks."""
    whole = SlotStore(chunked.cache, fingerprint="f", facts={}, kind="full", staging=chunked.staging, chunk_tokens=0)
    turn1 = (1, *tiny_tokens(299, 5))
    keep_real(whole, tiny_llm, turn1, 290, None)
    assert chunk_keys(chunked) == [] and whole.stored_whole == 0
    target = chunked.restore_file("http://127.0.0.1:1", 0)
    staged = chunked._stage((*turn1, 7), chunked.namespace(""), target)
    assert staged is not None and staged[2] == turn1
    written = b"".join(slotfile.build(3, turn1, real_state(tiny_llm, turn1)))
    assert Path(target).read_bytes()[: len(written)] == written
    turn2 = (*turn1, *tiny_tokens(100, 6))
    keep_real(chunked, tiny_llm, turn2, 390, Origin(turn1, 290))
    assert state_keys(chunked) == [turn2] and len(chunk_keys(chunked)) == 6
    chunked.close()


def test_a_restarted_store_makes_its_most_recently_used_states_ready_files(tmp_path: Path, tiny_llm: Any) -> None:
    """`SlotStore.warm`, a restarted proxy's: the states used last become the very slot files
    llama-server wrote (a restore then copies nothing), within the ready budget, most recently
    used first, every scope's, counted as no use by the store; each the first to go for room
    after them, and none made twice. A conversation's earlier turn (replaced), the chunks and
    another model's states are not made."""
    cache = f"lmdb://{tmp_path}/store"
    (tmp_path / "staging").mkdir()
    first = SlotStore(sippcache.open(cache), fingerprint="f", facts={}, kind="full", staging=str(tmp_path / "staging"))
    other = SlotStore(first.cache, fingerprint="g", facts={}, kind="full", staging=first.staging)
    system = (1, *tiny_tokens(199, 20))
    talks = [(*system, *tiny_tokens(60, 21 + i)) for i in range(3)]
    keep_real(other, tiny_llm, talks[0], 200, None)
    early = (*talks[1][:230],)
    keep_real(first, tiny_llm, early, 200, None)
    for tokens in talks:  # the last one a tenant's
        scope = "tenant" if tokens == talks[2] else ""
        keep_real(first, tiny_llm, tokens, 200, Origin(early, 200) if tokens == talks[1] else None, scope)
        time.sleep(0.01)
    files = {t: b"".join(slotfile.build(3, t, real_state(tiny_llm, t))) for t in talks}
    first.close()
    first.cache.close()

    cache_again = sippcache.open(cache)
    used = {e.key: e.last_used for e in cache_again.entries()}
    budget = len(files[talks[2]]) + len(files[talks[1]]) + 100  # two of the three
    store = SlotStore(cache_again, fingerprint="f", facts={}, kind="full", staging=first.staging, ready_bytes=budget)
    listed = store.to_warm()
    assert [e.key for e in listed] == talks[::-1]  # the early turn was replaced; model g's are not listed
    assert [e.namespace for e in listed] == [store.namespace("tenant"), store.namespace(""), store.namespace("")]
    assert any(chunkentries.is_chunk_namespace(n) for n in cache_again.namespaces())  # stored in chunks, not listed
    assert [store.warm(e) for e in listed] == [True, True, False]
    ready = sorted(store.ready._files, key=lambda f: f.used)
    assert [f.origin for f in ready] == [Origin(talks[1], 200), Origin(talks[2], 200)]
    assert [f.space for f in ready] == [store.ready.space(store.namespace(n)) for n in ("", "tenant")]
    assert all(Path(f.path).read_bytes() == files[f.origin.tokens] for f in ready)
    assert {e.key: e.last_used for e in cache_again.entries()} == used
    assert not store.warm(listed[0])  # a file holds it already
    saved = Path(store.staging) / "saved.slot"
    saved.write_bytes(files[talks[0]])
    assert store.ready.add(str(saved), store.namespace(""), Origin(talks[0], 200))
    assert [f.origin.tokens for f in store.ready._files] == [talks[2], talks[0]]  # the older warmed one went
    store.close()
    assert os.listdir(store.staging) == []


def test_a_slot_file_this_user_may_not_remove_is_logged_not_raised(tmp_path: Path, caplog: Any) -> None:
    """A save file llama-server wrote where this proxy may not remove it (another user's folder, a
    sticky bit; here an immutable file, which not even root may remove): the state was stored,
    and the keep says so and logs the file that stays, rather than failing the save."""
    import shutil

    store = SlotStore(sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path))
    path = tmp_path / "sippcache-save-1-x.slot"
    path.write_bytes(b"".join(slotfile.build(4, (*SYSTEM, 1), b"state" * 10)))
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
        pytest.skip("no chattr +i here (not root, or a file system without the flag)")
    try:
        saved = store.keep(Snapshot(str(path), (*SYSTEM, 1), len(SYSTEM) + 1, time.perf_counter()), None, "")
        assert saved is not None and keys(store) == {(*SYSTEM, 1)}
        assert f"cannot remove the slot file {path} (it stays)" in caplog.text
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
