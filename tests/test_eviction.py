"""The eviction policies (`sippcache.eviction`) on the real RAM backend: which entry a new
one supersedes, and how LRU and the default differ. benchmarks/trace.py measures them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sippcache.backends.ram import RAMBackend
from sippcache.eviction import LRU, GreedyDual

SYSTEM = list(range(1000, 1020))  # a shared system prompt: 20 tokens
BLOB = bytes(1000)  # an entry of 25 tokens counts 1,100 bytes


def turn(conversation: int, *more: int) -> list[int]:
    """A conversation's prompt after the system prompt: 5 tokens of its own, then `more`."""
    return SYSTEM + [conversation] * 5 + list(more)


def superseded(cache: RAMBackend) -> set[tuple[int, ...]]:
    return {e.key for e in cache.entries() if e.superseded}


def test_a_sibling_after_a_shared_prefix_supersedes_nothing() -> None:
    """Conversations that branch off after one system prompt are siblings: a new one takes
    no other's place. (Only the second ever stored splits the first one's edge, as the next
    turn of a conversation would: that one is marked.)"""
    with RAMBackend(max_bytes=4 * 1100) as cache:
        cache.store(list(range(25)), BLOB)  # unrelated, and the oldest
        for conversation in (1, 2, 3):
            cache.store(turn(conversation), BLOB)
        assert superseded(cache) == {tuple(turn(1))}
        cache.store([7] * 25, bytes(2100))  # needs two entries' room
        kept = {e.key for e in cache.entries()}
        assert tuple(turn(2)) in kept and tuple(turn(3)) in kept  # live conversations stay
        assert tuple(turn(1)) not in kept and tuple(range(25)) not in kept


def test_the_next_turn_supersedes_the_one_before() -> None:
    with RAMBackend(max_bytes=10 * 1100) as cache:
        cache.store(turn(1), BLOB)
        cache.store(turn(2), BLOB)
        cache.store(turn(1, 50, 51, 52), BLOB)  # conversation 1's next turn extends its first
        assert tuple(turn(1)) in superseded(cache)
        assert tuple(turn(2)) not in superseded(cache)


def test_lru_ignores_supersession_the_default_does_not() -> None:
    def survivors(policy: LRU | GreedyDual) -> set[tuple[int, ...]]:
        with RAMBackend(max_bytes=3 * 1100, eviction=policy) as cache:
            cache.store(list(range(25)), BLOB)  # the oldest
            cache.store(turn(1), BLOB)
            cache.store(turn(1, 50), bytes(996))  # the next turn: same size
            cache.store([7] * 25, BLOB)
            return {e.key for e in cache.entries()}

    assert tuple(range(25)) not in survivors(LRU()) and tuple(turn(1)) in survivors(LRU())
    assert tuple(range(25)) in survivors(GreedyDual()) and tuple(turn(1)) not in survivors(GreedyDual())


def test_prune_order_is_the_eviction_order() -> None:
    """`EvictionPolicy.order` ranks `entries()` as the store ranks its own victims."""
    with RAMBackend(max_bytes=3 * 1100) as cache:
        cache.store(list(range(25)), BLOB)
        cache.store(turn(1), BLOB)
        cache.store(turn(1, 50), bytes(996))
        ordered = [e.key for e in GreedyDual().order(cache.entries())]
        assert ordered[0] == tuple(turn(1)) and ordered[1] == tuple(range(25))
        assert [e.key for e in LRU().order(cache.entries())] == [e.key for e in cache.entries()]
        cache.store([7] * 25, BLOB)
        assert tuple(turn(1)) not in {e.key for e in cache.entries()}


def _trace_benchmark() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "trace.py"
    spec = importlib.util.spec_from_file_location("trace_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("budget", [100_000, 300_000, 1_000_000])
def test_never_worse_than_lru_on_conversations(budget: int) -> None:
    """benchmarks/trace.py's conversation workload at a tenth of its length (300 chats, about
    1,100 requests; the same arrival rate, so as many live at once) and of its budgets. The
    rule that let any key sharing half an entry supersede it lost to LRU at 300,000 tokens."""
    trace = _trace_benchmark()
    prompts = trace.conversations(0, count=300)
    lru, _ = trace.replay(prompts, budget, LRU())
    default, _ = trace.replay(prompts, budget, GreedyDual())
    assert default >= lru
