"""Whether to restore a stored state into a slot, doing it, and learning from what it bought.

Whether a restore pays is measured per upstream (`RestoreRates`): each answer's
``timings`` give the server's prefill rate, each restore its rate in bytes a
second (store read, staging, load); a restore expected to be slower than
computing the tokens it saves is skipped, and counted with its reason. A
restore llama-server then hardly used (its `cache_n` under half of what the
restore gave the prompt) is counted as ineffective and taught to the rates as
a restore that bought (next to) nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..state.rates import INEFFECTIVE_SHARE, RestoreRates
from .metrics import ProxyMetrics
from .ready import ReadyFile
from .slots import MIN_GAIN, Slot, common_prefix, reusable
from .store import Restored, RestoreRefused, SlotStore
from .upstream import Upstream

__all__ = ["Restore", "Restorer"]

log = logging.getLogger("sippcache.proxy")


@dataclass(frozen=True)
class Restore:
    """A restore done for a request: what was loaded, and how many of the prompt's tokens it gave
    llama-server to reuse (what `timings.cache_n` should then report)."""

    restored: Restored
    promised: int


class Restorer:
    """Restores the best stored state into a slot where that beats computing it, per the rates."""

    def __init__(self, store: SlotStore, rates: RestoreRates, metrics: ProxyMetrics) -> None:
        self.store, self.rates, self.metrics = store, rates, metrics
        self._warned: set[str] = set()  # upstreams already warned about an ineffective restore

    def would_restore(self, length: int, gain: int, urls: Iterable[str]) -> bool:
        """Whether a state of `length` tokens, giving `gain` tokens, would be restored on one of the
        upstreams at `urls`: waiting for a state that will not be restored only adds latency."""
        return any(
            self.rates.estimate(url, tokens=gain, nbytes=self.rates.size_of(url, length)).restore for url in urls
        )

    async def restore(self, upstream: Upstream, slot: Slot, tokens: list[int], held: int) -> Restore | None:
        """Restore the best state for `tokens` into `slot` when it gives at least `MIN_GAIN` tokens
        more than the slot holds (`held`) and the rates expect loading it (the whole entry's bytes)
        to be faster than computing those tokens; the restore done, if any. A ready file
        (`SlotStore.ready`) that gives at least as many tokens as the store's best is the one
        loaded: nothing is read or copied for it."""
        peek = await asyncio.to_thread(self.store.best, tokens, slot.scope)
        best = 0 if peek is None else reusable(peek.key_length, peek.length, len(tokens), self.store.can_cut)
        slot.stored = max(slot.stored, best)
        with self.store.ready.best(self.store.namespace(slot.scope), tokens) as ready:
            if ready is not None and ready[1] >= best:
                file, gives = ready
                length = len(file.origin.tokens)
                return await self._load(upstream, slot, tokens, gives - held, file.nbytes, length, file)
        if peek is None:
            return None
        nbytes = self.rates.size_of(upstream.url, peek.key_length)
        return await self._load(upstream, slot, tokens, best - held, nbytes, peek.key_length)

    async def _load(
        self,
        upstream: Upstream,
        slot: Slot,
        tokens: list[int],
        gain: int,
        nbytes: int | None,
        length: int,
        file: ReadyFile | None = None,
    ) -> Restore | None:
        """Restore a state of `length` tokens and about `nbytes` bytes (None: not known) giving `gain`
        tokens more than the slot holds, from `file` or else the store, if it gains at least
        `MIN_GAIN` and the rates say so."""
        if gain < MIN_GAIN:
            return None
        url = upstream.url
        decision = self.rates.decide(url, tokens=gain, nbytes=nbytes, ready=file is not None)
        if not decision:
            self.metrics.restores_skipped.labels(url, decision.reason).inc()
            log.debug(
                "sippcache proxy: no restore of %d tokens (%d more than slot %d of %s holds): %s "
                "(restore %s s, prefill %s s expected)",
                length,
                gain,
                slot.id,
                url,
                decision.reason,
                _seconds(decision.restore_seconds),
                _seconds(decision.prefill_seconds),
            )
            return None
        try:
            if file is None:
                restored = await self.store.restore(upstream, slot.id, tokens, slot.scope)
            else:
                restored = await self.store.restore_ready(upstream, slot.id, file)
        except RestoreRefused as refused:
            slot.forget(empty=True)  # a refused restore leaves the slot empty
            self.metrics.restores.labels(url, "refused").inc()
            # its seconds bought nothing: a server that refuses every restore (a file it may not
            # read, a state it cannot load) stops getting them, as one that wastes them does
            self.rates.record_restore(
                url,
                nbytes=refused.nbytes,
                seconds=refused.seconds,
                tokens=refused.tokens,
                useful=0.0,
                ready=file is not None,
            )
            return None
        if restored is None:
            return None
        slot.tokens, slot.origin, slot.stored = restored.tokens, restored.origin, len(restored.tokens)
        self.metrics.restores.labels(url, "ok").inc()
        if restored.ready:
            self.metrics.ready_restores.labels(url).inc()
        self.metrics.restore_seconds.labels(url).observe(restored.seconds)
        for part, seconds in (("sippcache", restored.staged), ("llama_server", restored.loaded)):
            if seconds is not None:
                self.metrics.restore_part_seconds.labels(url, part).observe(seconds)
        loaded = restored.tokens  # the entry's tokens, or the prefix its chunks gave
        promised = reusable(len(loaded), common_prefix(loaded, tokens), len(tokens), self.store.can_cut)
        return Restore(restored, promised)

    def learn(self, url: str, timings: dict[str, Any], restore: Restore | None) -> None:
        """Teach the rates what one answer measured: the prefill rate (llama-server's own
        `prompt_n` in `prompt_ms`) and, after a restore, its rate in bytes weighted by the share of
        what it gave that llama-server reused (`cache_n`). A restore of which it reused less than
        `INEFFECTIVE_SHARE` is ineffective (it recomputed what was restored: a slot cleared behind
        the proxy's back, a sliding-window model without --swa-full): counted, with a warning once
        per upstream."""
        try:
            computed, ms = int(timings["prompt_n"]), float(timings["prompt_ms"])
        except (KeyError, TypeError, ValueError):
            pass
        else:
            self.rates.record_prefill(url, computed, ms / 1000.0)
        if restore is None:
            return
        restored, useful = restore.restored, 1.0  # no timings (a client that left): taken as used
        if isinstance(timings.get("cache_n"), int) and restore.promised > 0:
            reused = int(timings["cache_n"])
            useful = reused / restore.promised
            if useful < INEFFECTIVE_SHARE:
                self.metrics.restores_ineffective.labels(url).inc()
                log.log(
                    logging.DEBUG if url in self._warned else logging.WARNING,
                    "sippcache proxy: %s reused %d of the %d prompt tokens a restore gave it (timings.cache_n): "
                    "it recomputes restored states (a slot cleared behind the proxy's back, --cache-idle-slots; "
                    "a sliding-window model without --swa-full); restores there are skipped while they buy nothing",
                    url,
                    reused,
                    restore.promised,
                )
                self._warned.add(url)
        self.rates.record_restore(
            url,
            nbytes=restored.nbytes,
            seconds=restored.seconds,
            tokens=len(restored.tokens),
            useful=useful,
            loaded=restored.loaded,
            ready=restored.ready,
        )


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.4g}"
