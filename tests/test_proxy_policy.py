"""The proxy's decisions as plain code, without HTTP: when a slot is saved (`SavePolicy`), when a
request waits for another's state (`Flights`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sippcache.proxy.flights import MIN_FLIGHT_LEAD, Flights
from sippcache.proxy.saving import SAVE_EVERY, SavePolicy
from sippcache.proxy.slots import MIN_GAIN

# -- when a slot is saved ------------------------------------------------------------------------

POLICY = SavePolicy(every=2048, idle=30.0, min_tokens=16, can_cut=True)


@pytest.mark.parametrize(
    ("waited_for", "stored", "held", "reason"),
    [
        (True, 5000, 5001, "waited"),  # others wait for it: at once, whatever else holds
        (False, 0, 900, "new"),  # the store held nothing of its prompt: other processes want it
        (False, 15, 900, "new"),
        (False, 16, 900, None),  # a next turn: stays in the slot
        (False, 1000, 1000 + 2047, None),
        (False, 1000, 1000 + 2048, "grown"),  # what a crash could lose reached `every`
    ],
)
def test_which_answers_are_saved_at_once(waited_for: bool, stored: int, held: int, reason: str | None) -> None:
    assert POLICY.now(waited_for=waited_for, stored=stored, held=held) == reason


def test_a_state_that_cannot_be_cut_is_saved_after_every_answer() -> None:
    """Recurrent and hybrid memory is extended only at exactly its length: each answer's end is kept."""
    recurrent = SavePolicy(min_tokens=16, can_cut=False)
    assert recurrent.now(waited_for=False, stored=1000, held=1001) == "recurrent"
    assert recurrent.now(waited_for=False, stored=0, held=1001) == "new"


def test_the_defaults_are_the_documented_ones() -> None:
    assert SavePolicy() == SavePolicy(every=SAVE_EVERY, idle=30.0, min_tokens=0, can_cut=True)
    assert SAVE_EVERY == 2048


# -- when a request waits for another's state -----------------------------------------------------------


def held(amount: int) -> Callable[[list[int], str], Awaitable[int]]:
    """What the store and the idle slots hold of any prompt: `amount` tokens."""

    async def elsewhere(tokens: list[int], scope: str) -> int:
        return amount

    return elsewhere


def test_a_next_turn_waits_for_its_last_state_still_being_written() -> None:
    """A request whose prefix another one computes waits only for a long lead (a prefill's worth);
    once that one has answered and only its store write is left, a restore's worth is enough: a
    conversation's next turn, sent before its last state landed, waits for that write instead of
    computing again what it is about to store (it did so by chance before, under load)."""
    prompt = list(range(100, 100 + MIN_FLIGHT_LEAD // 2))  # more than MIN_GAIN, less than MIN_FLIGHT_LEAD
    assert MIN_GAIN < len(prompt) < MIN_FLIGHT_LEAD

    async def take_off(writing: bool) -> tuple[int, bool]:
        flights, waits = Flights(wait=30.0), []
        leader = await flights.take_off(prompt, "", held(0), lambda f, gain: True)
        leader.writing = writing
        asyncio.get_running_loop().call_later(0.2, flights.land, leader)  # the write lands
        flight = await flights.take_off([*prompt, 7, 8, 9], "", held(0), lambda f, g: True, lambda: waits.append(1))
        landed = leader.landed.is_set()
        flights.land(flight)
        return len(waits), landed

    assert asyncio.run(take_off(writing=False)) == (0, False)  # still computing: too short a lead to wait
    assert asyncio.run(take_off(writing=True)) == (1, True)  # only the write left: waited for it to land


@pytest.mark.parametrize(
    ("wait", "elsewhere", "worth", "scope", "waits"),
    [
        (0.1, 0, True, "", True),  # waited, then gave up at 0.1 s: the leader never landed
        (0.1, 2 * MIN_FLIGHT_LEAD, True, "", False),  # what it computes is held elsewhere: no gain
        (0.1, 0, False, "", False),  # its state would not be restored: waiting adds latency only
        (0.0, 0, True, "", False),  # waiting is off
        (0.1, 0, True, "another tenant", False),  # scopes never share
    ],
)
def test_a_request_waits_only_where_the_wait_buys_a_restore(
    wait: float, elsewhere: int, worth: bool, scope: str, waits: bool
) -> None:
    prompt = list(range(2 * MIN_FLIGHT_LEAD))

    async def waited() -> tuple[bool, bool]:
        flights, counted = Flights(wait), []
        leader = await flights.take_off(prompt, "", held(0), lambda f, gain: True)
        flight = await flights.take_off(
            [*prompt, 1], scope, held(elsewhere), lambda f, gain: worth, lambda: counted.append(1)
        )
        flights.land(flight)
        flights.land(leader)
        return bool(counted), leader.waiting == 0

    assert asyncio.run(waited()) == (waits, True)
