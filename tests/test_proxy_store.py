"""`SlotStore.keep` on a real RAM store: which entry a slot's new state replaces. A conversation keeps
one entry; a new conversation that parts from an entry within its prompt (over a shared system
prompt) never deletes it."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

import sippcache
from sippcache.proxy import slotfile
from sippcache.proxy.slots import Origin
from sippcache.proxy.store import SUPERSEDE_SLACK, SlotStore, Snapshot

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


def test_restores_rewrite_one_staging_file_per_slot_in_place(store: SlotStore) -> None:
    """Each restore into a slot goes through the same file, rewritten over its own pages and cut to
    the new state's length; `close` removes it."""
    long_state, short_state = b"L" * 40_000, b"s" * 1_000
    for state, tokens in ((long_state, (*SYSTEM, 1)), (short_state, (*SYSTEM, 2))):
        path = Path(store.staging) / "in.slot"
        path.write_bytes(b"".join(slotfile.build(4, tokens, state)))
        assert store.keep(Snapshot(str(path), tokens, len(tokens), time.perf_counter()), None, "") is not None
    target = store.restore_file("http://127.0.0.1:1", 0)
    assert store.restore_file("http://127.0.0.1:2", 0) != target != store.restore_file("http://127.0.0.1:1", 1)
    staged = store._stage((*SYSTEM, 1, 7), store.namespace(""), target)
    assert staged is not None and staged[1] == len(long_state)
    inode = os.stat(target).st_ino
    assert bytes(slotfile.parse(Path(target).read_bytes()).state) == long_state
    staged = store._stage((*SYSTEM, 2, 7), store.namespace(""), target)
    assert staged is not None and staged[0].tokens == (*SYSTEM, 2)
    assert os.stat(target).st_ino == inode
    assert slotfile.parse(Path(target).read_bytes()) == slotfile.SlotFile(4, (*SYSTEM, 2), memoryview(short_state))
    store.close()
    assert not Path(target).exists()
