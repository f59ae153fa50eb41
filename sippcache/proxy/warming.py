"""Ready files made after a start from the states used last (``--warm-ready``).

A restarted proxy's follow-up is then llama-server's own restore of a file
that is there already, not a store read and a staging copy on top of it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .metrics import ProxyMetrics
from .slots import SlotTable
from .store import SlotStore

__all__ = ["WARM_PAUSE", "Warmer"]

log = logging.getLogger("sippcache.proxy")

#: While a request has a slot, making ready files waits, looking again this often (seconds): a
#: restore or prefill gets the cores and memory to itself.
WARM_PAUSE = 0.05


class Warmer:
    """Makes the store's most recently used states ready files while no request has a slot."""

    def __init__(self, store: SlotStore, slots: SlotTable, metrics: ProxyMetrics) -> None:
        self.store, self.slots, self.metrics = store, slots, metrics
        self._stopping = False

    async def run(self) -> int:
        """Make the store's most recently used states of this model (of every scope) ready files
        (`SlotStore.warm`), one at a time, each while no request has a slot, until the ready budget
        is full or `stop` is called. How many were made."""
        started, made = time.perf_counter(), 0
        self.metrics.ready_warming.set(1)
        try:
            for entry in await asyncio.to_thread(self.store.to_warm):
                while not self._stopping and any(s.busy for s in self.slots.slots):
                    await asyncio.sleep(WARM_PAUSE)
                if self._stopping or self.store.ready.nbytes >= self.store.ready.budget:
                    break
                if await asyncio.to_thread(self.store.warm, entry):
                    made += 1
                    self.metrics.ready_warmed.inc()
        finally:
            self.metrics.ready_warming.set(0)
        if made:
            log.info(
                "sippcache proxy: %d stored states made ready files in %.1f s (%d MiB ready)",
                made,
                time.perf_counter() - started,
                self.store.ready.nbytes >> 20,
            )
        return made

    def stop(self) -> None:
        """Make no more files (the one being made is finished)."""
        self._stopping = True
