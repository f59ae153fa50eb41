"""Requests in flight whose state later requests sharing their prefix wait for.

A burst of requests over one long new prefix (a system prompt or document that
nothing holds yet) would have llama-server compute it once per slot, all at
once. Instead the first computes it and the others wait for its stored state
(at most `Flights.wait` seconds; 0: never wait), then restore it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .slots import MIN_GAIN, common_prefix

__all__ = ["MIN_FLIGHT_LEAD", "Flight", "Flights"]

#: A request waits for one in flight when that one computes at least this many tokens of its prompt
#: beyond what the store and the idle slots hold.
MIN_FLIGHT_LEAD = 256


@dataclass(eq=False)
class Flight:
    """A request in flight, whose stored state later requests sharing its prefix can wait for."""

    scope: str
    tokens: list[int]
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0  # requests waiting for its state now: it is stored at once
    writing: bool = False  # answered, its state being written to the store: what is left is that write

    def min_lead(self) -> int:
        """How many tokens beyond what the store and the slots hold make waiting for this one pay:
        a prefill's worth (`MIN_FLIGHT_LEAD`) while it computes, a restore's (`MIN_GAIN`) once only
        its store write is left (a conversation's next turn, sent before its last state landed)."""
        return MIN_GAIN if self.writing else MIN_FLIGHT_LEAD


class Flights:
    """The requests in flight of one proxy."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self._flying: set[Flight] = set()

    async def take_off(
        self,
        tokens: list[int],
        scope: str,
        held: Callable[[list[int], str], Awaitable[int]],
        worth_waiting: Callable[[Flight, int], bool],
        on_wait: Callable[[], None] = lambda: None,
    ) -> Flight:
        """Wait while a request in flight computes at least `MIN_FLIGHT_LEAD` tokens of this prompt
        beyond what is `held` elsewhere (the store, the idle slots), or stores a state giving at
        least `MIN_GAIN` more (`Flight.min_lead`), and waiting for it is `worth_waiting` (its state
        would be restored), at most `wait` seconds in all; then this request is in flight itself.
        `on_wait` is called each time it waits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while self.wait > 0:
            lead, leader = max(
                ((common_prefix(f.tokens, tokens), f) for f in self._flying if f.scope == scope),
                key=lambda pair: (pair[0], pair[1].writing),  # of two as long, the one that lands sooner
                default=(0, None),
            )
            if leader is None or lead < leader.min_lead():
                break
            elsewhere = await held(tokens, scope)
            if leader.landed.is_set():
                continue  # it landed meanwhile: look again
            gain = lead - elsewhere
            if gain < leader.min_lead() or loop.time() >= deadline or not worth_waiting(leader, gain):
                break
            on_wait()
            leader.waiting += 1
            try:
                await asyncio.wait_for(leader.landed.wait(), deadline - loop.time())
            except TimeoutError:
                break
            finally:
                leader.waiting -= 1
        flight = Flight(scope, tokens)
        self._flying.add(flight)
        return flight

    def land(self, flight: Flight | None) -> None:
        """A request's state is stored (or will not be): requests waiting for it look again."""
        if flight is not None:
            self._flying.discard(flight)
            flight.landed.set()
