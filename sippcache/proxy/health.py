"""Which llama-servers are down, and watching them come back.

A server that fails a call is marked down (its slots get no requests, what
they held is forgotten) and polled until its health check answers; then it
serves again, empty.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .metrics import ProxyMetrics
from .slots import NoServer, Slot, SlotTable
from .upstream import Upstream

__all__ = ["Health"]

log = logging.getLogger("sippcache.proxy")

#: How often a down server's health is polled (seconds).
POLL_SECONDS = 0.5


class Health:
    """The up or down state of the proxy's upstreams."""

    def __init__(self, upstreams: list[Upstream], slots: SlotTable, metrics: ProxyMetrics) -> None:
        self.upstreams, self.slots, self.metrics = upstreams, slots, metrics
        self._watchers: dict[int, asyncio.Task[Any]] = {}  # health polls of down servers: cancelled on stop
        for upstream in upstreams:
            metrics.upstream_up.labels(upstream.url).set(1)

    def any_upstream(self) -> Upstream:
        """A reachable upstream (the first). Raises `NoServer`."""
        for server, upstream in enumerate(self.upstreams):
            if server not in self.slots.down:
                return upstream
        raise NoServer

    async def lost(self, slot: Slot, exc: BaseException) -> None:
        """A call through `slot` (held by the caller) failed: its server is down, the slot freed."""
        log.warning("sippcache proxy: %s is down: %s", self.upstreams[slot.server].url, exc)
        await self.slots.set_down(slot.server, True)
        await self.slots.release(slot)
        self._watch(slot.server)

    def stop(self) -> None:
        """Stop watching down servers."""
        for task in self._watchers.values():
            task.cancel()

    def _watch(self, server: int) -> None:
        """Poll a down server's health until it answers again; then it serves (empty) again."""

        async def watch() -> None:
            while not await self.upstreams[server].healthy():
                await asyncio.sleep(POLL_SECONDS)
            await self.slots.set_down(server, False)
            self.metrics.upstream_up.labels(self.upstreams[server].url).set(1)
            del self._watchers[server]

        if server not in self._watchers:
            self.metrics.upstream_up.labels(self.upstreams[server].url).set(0)
            self._watchers[server] = asyncio.create_task(watch())
