"""Which slot of which llama-server a request runs in.

Each slot is used by one request at a time (the request is pinned to it with
``id_slot``), so the proxy knows what every idle slot holds: the tokens of the
last state it restored or saved there. A request goes to the idle slot that
holds the longest prefix of its prompt; with none, to an idle slot of the
least loaded server (least recently used first), where the store's best state
is restored. With every slot busy, requests wait in arrival order, at most
`max_queue` of them (then `QueueFull`: a 503 with ``Retry-After``).

What a slot holds is a belief, not a fact: a slot whose server restarted, or
that another client used, holds something else. A wrong belief costs only
speed (llama-server compares tokens itself before reusing any), and
`forget` drops the beliefs about a server that went away, or a slot a
client erased or restored through the proxy (`Passthrough.slot_action`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..tokens import common_prefix

__all__ = [
    "MIN_GAIN",
    "SUPERSEDE_SLACK",
    "NoServer",
    "Origin",
    "QueueFull",
    "Slot",
    "SlotTable",
    "common_prefix",
    "keeps",
    "reusable",
]


#: Fewer tokens than this are not worth moving a state for: a stored state is restored only when it
#: gives at least this many more than the slot holds, and a slot giving a prompt fewer than this
#: counts as giving none when a slot is picked (every conversation shares a chat template's first
#: tokens: for them, a conversation's slot would be taken, and saved, while another sits empty).
MIN_GAIN = 32


class QueueFull(Exception):
    """Every slot is busy and `max_queue` requests already wait."""


class NoServer(Exception):
    """Every upstream server is down."""


def reusable(stored: int, common: int, prompt: int, can_cut: bool) -> int:
    """How many of a prompt's `prompt` tokens llama-server reuses from a state of `stored` tokens that
    shares `common` with it: where states can be cut, the common part; where they cannot (recurrent
    and hybrid memory), the whole state if it is a strict prefix of the prompt, else nothing."""
    if can_cut:
        return common
    return stored if common == stored < prompt else 0


@dataclass(frozen=True)
class Origin:
    """A stored entry a slot's state grew from: its tokens, and how many of them were the prompt of
    the request that made it (the rest is that request's answer; 0 when not known)."""

    tokens: tuple[int, ...]
    prompt: int


#: A slot's new state replaces the entry it grew from when it keeps all of that entry's prompt and
#: all of the entry but at most its last this many tokens: the end of the last answer as the model
#: generated it, which the next turn's template writes back its own way (an end-of-turn token, a
#: word tokenized otherwise).
SUPERSEDE_SLACK = 32


def keeps(tokens: Sequence[int], old: Origin) -> bool:
    """Whether a state of `tokens` holds all a state of `old` is worth: longer, and parting from it
    past its prompt and at most `SUPERSEDE_SLACK` tokens before its end."""
    common = common_prefix(old.tokens, tokens)
    return len(old.tokens) < len(tokens) and common >= max(old.prompt, len(old.tokens) - SUPERSEDE_SLACK)


@dataclass(eq=False)
class Slot:
    """Slot `id` of upstream number `server`: what it holds and whether a request has it."""

    server: int
    id: int
    tokens: tuple[int, ...] = ()
    scope: str = ""  # the tenant whose state it holds: another tenant's request never reuses it
    origin: Origin | None = None  # the stored entry its state grew from, if any
    #: While llama-server's state in the slot is not stored (a live conversation's later turns): the
    #: prompt length of the request that left it. Saved when the slot changes hands, sits idle, has
    #: grown past a bound, or the proxy stops.
    unsaved: int | None = None
    stored: int = 0  # how many of the tokens the slot holds the store holds too (or has queued)
    #: llama-server may hold a state there the proxy does not know (from before the proxy started, a
    #: request cut short or not read by the proxy, a failed save, a client's restore): another
    #: tenant's request erases it first.
    unknown: bool = True
    busy: bool = False
    used: int = 0  # a tick of the table's clock: the least recently used slot goes first

    def forget(self, *, empty: bool = False) -> None:
        """Believe the slot holds nothing the proxy can reuse: nothing at all with `empty` (its server
        restarted, it was erased), else a state it does not know (`unknown`)."""
        self.tokens, self.origin, self.unsaved, self.stored = (), None, None, 0
        self.unknown = not empty


class SlotTable:
    """Every slot of every upstream, and the requests waiting for one."""

    def __init__(self, slots_per_server: Sequence[int], max_queue: int = 64, can_cut: bool = True) -> None:
        self.can_cut = can_cut
        self.slots = [Slot(server, i) for server, n in enumerate(slots_per_server) for i in range(n)]
        self.max_queue = max_queue
        self.down: set[int] = set()
        self._clock = itertools.count(1)
        self._freed = asyncio.Condition()
        self._waiting = 0

    def busy(self, server: int) -> int:
        return sum(1 for s in self.slots if s.server == server and s.busy)

    def _idle(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy and s.server not in self.down]

    def _pick(self, tokens: Sequence[int], scope: str) -> tuple[Slot, int] | None:
        idle = self._idle()
        if not idle:
            return None
        load = {server: self.busy(server) for server in {s.server for s in idle}}
        # Most held first; then the least loaded server; then an empty slot, a stored one (nothing to
        # save before it changes hands), the least recently used.
        return max(
            ((s, self._held(s, tokens, scope)) for s in idle),
            key=lambda p: (
                p[1] if p[1] >= MIN_GAIN else 0,
                -load[p[0].server],
                not p[0].tokens and not p[0].unknown,
                p[0].unsaved is None,
                -p[0].used,
            ),
        )

    def held(self, tokens: Sequence[int], scope: str) -> int:
        """How many of `tokens` the best idle slot would give llama-server to reuse for `scope`."""
        return max((self._held(s, tokens, scope) for s in self._idle()), default=0)

    def _held(self, slot: Slot, tokens: Sequence[int], scope: str) -> int:
        """What `slot` gives a prompt of `scope` to reuse: nothing if it holds another scope's state."""
        if slot.scope != scope:
            return 0
        return reusable(len(slot.tokens), common_prefix(slot.tokens, tokens), len(tokens), self.can_cut)

    async def acquire(self, tokens: Sequence[int], scope: str) -> tuple[Slot, int]:
        """The best idle slot for a prompt of `scope`, marked busy, and how many of its tokens it
        already holds (0 for a slot holding another scope's state: the caller erases it)."""
        async with self._freed:
            if self._waiting >= self.max_queue and not any(not s.busy for s in self.slots):
                raise QueueFull
            self._waiting += 1
            try:
                while (picked := self._pick(tokens, scope)) is None:
                    if len(self.down) == len({s.server for s in self.slots}):
                        raise NoServer
                    await self._freed.wait()
            finally:
                self._waiting -= 1
            slot, held = picked
            slot.busy = True
            slot.used = next(self._clock)
            return slot, held

    def find(self, server: int, slot_id: int) -> Slot | None:
        """Slot `slot_id` of upstream number `server`, if it has one."""
        return next((s for s in self.slots if s.server == server and s.id == slot_id), None)

    async def take(self, slot: Slot, *, wait: bool = False) -> bool:
        """Mark `slot` busy if it is idle and its server up (a save of the proxy's own; with `wait`,
        a client's slot action, which waits while a request has it); False if not. Not a use: it
        keeps its place in the least-recently-used order."""
        async with self._freed:
            while wait and slot.busy and slot.server not in self.down:
                await self._freed.wait()
            if slot.busy or slot.server in self.down:
                return False
            slot.busy = True
            return True

    async def release(self, slot: Slot) -> None:
        """Give the slot back (what it holds is set by the caller) and wake the waiting requests:
        every one looks again, since one waiting for this slot alone may be among them."""
        async with self._freed:
            slot.busy = False
            self._freed.notify_all()

    async def set_down(self, server: int, down: bool) -> None:
        """Mark a server down (its requests fail fast) or back up; either way its slots hold nothing
        now (a restarted server starts empty). Waiting requests look again."""
        async with self._freed:
            (self.down.add if down else self.down.discard)(server)
            for slot in self.slots:
                if slot.server == server:
                    slot.forget(empty=True)
            self._freed.notify_all()

    async def forget_idle(self, server: int) -> None:
        """Drop what the proxy believes a server's idle slots hold: llama-server ran the child tasks
        of a request with ``n`` > 1 in slots of its own choosing."""
        async with self._freed:
            for slot in self.slots:
                if slot.server == server and not slot.busy:
                    slot.forget()

    @property
    def waiting(self) -> int:
        return self._waiting
