"""`SlotStore.keep` on a real RAM store: which entry a slot's new state replaces. A conversation keeps
one entry; a new conversation that parts from an entry within its prompt (over a shared system
prompt) never deletes it."""

from __future__ import annotations

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
