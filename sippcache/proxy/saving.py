"""When a slot's state is saved, and saving it.

A slot's state is saved when its conversation leaves it, not after every
answer: a state holds every token from the first, so a save per turn writes the
whole conversation again each time (on a GPU, a 1 GB state's save and store
cost several times the answer). `SavePolicy` says which answers are saved at
once; the others' states stay in their slot, unsaved, and `Saver` saves them
before the slot serves another conversation, after `SavePolicy.idle` seconds
idle, and when the proxy stops (SIGTERM or SIGINT).

A save: llama-server writes the slot to the staging directory; in a worker
thread it is framed and stored, the file then kept ready (`SlotStore.ready`)
or removed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ..state.rates import RestoreRates
from .health import Health
from .metrics import ProxyMetrics
from .slots import Origin, Slot, SlotTable
from .store import SlotStore, Snapshot
from .upstream import Upstream, UpstreamDown

__all__ = ["SAVE_EVERY", "SAVE_IDLE", "SavePolicy", "Saver"]

log = logging.getLogger("sippcache.proxy")

#: A slot's unsaved state is saved once it holds this many tokens beyond what the store holds (what a
#: crash can lose), and once it has sat idle this many seconds.
SAVE_EVERY = 2048
SAVE_IDLE = 30.0


@dataclass(frozen=True)
class SavePolicy:
    """Which answers' states are saved at once (`now`); the rest wait in their slot.

    `min_tokens` and `can_cut` are the store's: a state shorter than `min_tokens` is not worth
    storing, and a state that cannot be cut (recurrent or hybrid memory) is extended only at
    exactly its length, so every answer's end is kept.
    """

    every: int = SAVE_EVERY
    idle: float = SAVE_IDLE
    min_tokens: int = 0
    can_cut: bool = True

    def now(self, *, waited_for: bool, stored: int, held: int) -> str | None:
        """Why a slot holding `held` tokens after an answer, of which the store holds `stored`, is
        saved at once, or None (it waits in the slot): other requests wait for its state
        (`waited_for`: a prefix in flight), the store held too little of its prompt (a new
        conversation or system prompt: other processes want it), its memory cannot be cut, or it
        has grown `every` tokens beyond the store (what a crash can lose)."""
        if waited_for:
            return "waited"
        if stored < self.min_tokens:
            return "new"
        if not self.can_cut:
            return "recurrent"
        if held - stored >= self.every:
            return "grown"
        return None


class Saver:
    """Saves slots' states into the store: now, when idle, before they change hands, on stop."""

    def __init__(
        self,
        upstreams: list[Upstream],
        slots: SlotTable,
        store: SlotStore,
        metrics: ProxyMetrics,
        rates: RestoreRates,
        health: Health,
        policy: SavePolicy,
    ) -> None:
        self.upstreams, self.slots, self.store = upstreams, slots, store
        self.metrics, self.rates, self.health, self.policy = metrics, rates, health, policy
        self._writes: set[asyncio.Task[Any]] = set()  # store writes: waited for on shutdown
        self._idle_saves: set[asyncio.Task[Any]] = set()  # saves of idle slots, waiting their time: cancelled

    async def save(self, slot: Slot, prompt: int, reason: str) -> asyncio.Task[Any] | None:
        """Have llama-server save `slot` (held by the caller; `prompt`: the last request's prompt
        length) and store the state in a background task, returned (None: the save failed, and what
        the slot holds is not known). Raises `UpstreamDown`."""
        upstream = self.upstreams[slot.server]
        try:
            snapshot = await self.store.snapshot(upstream, slot.id, prompt)
        except UpstreamDown:
            raise
        except Exception as exc:  # the slot serves again, its state is not stored
            log.warning("sippcache proxy: saving slot %d of %s failed: %s", slot.id, upstream.url, exc)
            slot.forget()
            return None
        self.metrics.slot_saves.labels(upstream.url, reason).inc()
        supersedes, slot.tokens = slot.origin, snapshot.tokens
        if len(snapshot.tokens) >= self.store.min_tokens:
            slot.origin = Origin(snapshot.tokens, snapshot.prompt)
        slot.unsaved, slot.stored = None, len(snapshot.tokens)  # queued for the store counts as stored
        task = asyncio.create_task(self._keep(upstream.url, snapshot, supersedes, slot.scope))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    def save_when_idle(self, slot: Slot) -> None:
        """Save `slot` after `SavePolicy.idle` seconds, unless a request used it meanwhile."""
        used = slot.used

        async def later() -> None:
            await asyncio.sleep(self.policy.idle)
            if slot.used == used:
                await self.save_idle_slot(slot, "idle")

        task = asyncio.create_task(later())
        self._idle_saves.add(task)
        task.add_done_callback(self._idle_saves.discard)

    async def save_idle_slots(self, server: int) -> None:
        """Save the idle slots of upstream `server` left unsaved: a request is about to run where
        llama-server may overwrite any of them (an unread request, a request for several choices)."""
        unsaved = [s for s in self.slots.slots if s.server == server and s.unsaved is not None]
        await asyncio.gather(*(self.save_idle_slot(s, "leave") for s in unsaved))

    async def save_idle_slot(self, slot: Slot, reason: str = "shutdown") -> None:
        """Save an idle slot left unsaved (busy, or saved meanwhile: nothing to do)."""
        if slot.unsaved is None or not await self.slots.take(slot):
            return
        try:
            if slot.unsaved is not None:
                await self.save(slot, slot.unsaved, reason)
        except UpstreamDown as exc:
            await self.health.lost(slot, exc)
            return
        await self.slots.release(slot)

    async def drain(self) -> None:
        """On shutdown: save every slot left unsaved, and wait for the store writes still running."""
        for task in self._idle_saves:
            task.cancel()
        await asyncio.gather(*(self.save_idle_slot(s) for s in self.slots.slots if s.unsaved is not None))
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def _keep(self, url: str, snapshot: Snapshot, supersedes: Origin | None, scope: str) -> None:
        saved = await asyncio.to_thread(self.store.keep, snapshot, supersedes, scope)
        if saved is None:
            return
        self.rates.record_save(
            url,
            nbytes=saved.state_bytes or saved.nbytes,
            seconds=saved.seconds,
            tokens=len(saved.tokens),
            written=saved.nbytes,
            server_seconds=saved.saved,  # an unmeasured restore is priced from llama-server's part
        )
        self.metrics.saves.labels(url).inc()
        self.metrics.save_seconds.labels(url).observe(saved.seconds)
        if saved.saved is not None:
            self.metrics.save_part_seconds.labels(url, "llama_server").observe(saved.saved)
            self.metrics.save_part_seconds.labels(url, "sippcache").observe(max(0.0, saved.seconds - saved.saved))
        self.metrics.bytes_stored.labels(url).inc(saved.nbytes)
