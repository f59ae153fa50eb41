"""The server's stores and models: one open store per URL, shared by every model and reload.

`CachePool` opens each store the models name before the server starts (a bad
URL stops it there), gives every model upstream loads its cache and, with
``--parallel``, its `Scheduler` (`CachePool.attach`), hands each request the
model it runs on (`CachePool.for_request`), and keeps each model alias's
counters across loads and unloads of its model, for the metrics.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
from llama_cpp.server.settings import ModelSettings

from ..llama import CacheOptions, LlamaCache, PrefixStats
from ..llama.batch import Job
from ..llama.fingerprint import llama_fingerprint, speed_facts
from ..llama.seqcache import SequenceCache
from ..llama.states import MemoryKind
from ..protocol import CacheBackend
from ..registry import default_url, redact_url
from ..registry import open as open_cache
from .door import Admission, RequestContext
from .metrics import ServeMetrics, StoreReader
from .model import ServedLlama, batching_obstacle, use_chat_format
from .scheduler import Scheduler
from .settings import ModelOptions, ServeError, Settings, resolve_cache_value, scope_for

log = logging.getLogger("sippcache")

__all__ = ["NO_CACHE_STORE", "CachePool"]

#: Where a ``--parallel`` model served without a cache keeps states between its slots.
NO_CACHE_STORE = "ram://?max_bytes=256MiB"


@dataclass
class _Model:
    """A model alias: its store (None: no cache), scope, options, and counters."""

    alias: str
    store: str | None  # the store's label (a redacted URL)
    scope: str
    options: ModelOptions
    retired: dict[str, float] = field(default_factory=dict)  # counted by instances since closed
    live: ServedLlama | None = None
    namespace: str | None = None
    obstacle: str | None = None  # why a --parallel model is served one request at a time

    @property
    def cache_options(self) -> CacheOptions:
        """How the model's `LlamaCache` and its scheduler's `SequenceCache` use the store."""
        return CacheOptions(scope=self.scope, chunk_tokens=self.options.chunk_tokens)


class CachePool:
    """The stores the server uses (opened once per URL, before the server starts), each
    model alias's options and counters, across loads and unloads of its model."""

    def __init__(self) -> None:
        self._stores: dict[str, CacheBackend] = {}  # label -> open backend
        self._readers: dict[str, StoreReader] = {}
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        #: Each live model's scheduler, with ``--parallel`` (a model without one runs one request at
        #: a time): kept here, by the pool that makes and closes them, not on the model.
        self._schedulers: dict[ServedLlama, Scheduler] = {}
        self.metrics = ServeMetrics(self, [])
        self.admission = Admission({}, "")
        self.interrupting = False  # the server's interrupt_requests

    @classmethod
    def open(cls, settings: Settings, cache: str | None) -> CachePool:
        """Open every store the models name. Raises `ServeError` (one line) for a bad URL."""
        pool = cls()
        try:
            default = resolve_cache_value(cache, default_url)
            for model in settings.models:
                alias = model.model_alias or model.model
                options = settings.options.get(alias, ModelOptions())
                own = options.cache_url
                url = default if own is None else resolve_cache_value(own, default_url)
                label = pool._open_store(url) if url is not None else None
                pool._models[alias] = _Model(alias, label, scope_for(model), options)
        except BaseException:
            pool.close()
            raise
        pool.metrics = ServeMetrics(pool, list(pool._models))
        limits = {alias: (m.options.parallel, m.options.max_queue) for alias, m in pool._models.items()}
        pool.admission = Admission(limits, next(iter(pool._models), ""))
        pool.interrupting = settings.server.interrupt_requests
        return pool

    def _open_store(self, url: str) -> str:
        label = redact_url(url)
        if label not in self._stores:
            try:
                backend = open_cache(url)
            except Exception as exc:
                message = " ".join(str(exc).split()) or type(exc).__name__
                ours = isinstance(exc, (ValueError, OSError, ImportError)) or type(exc).__module__ == "sippcache.errors"
                if not ours:
                    message = f"{type(exc).__name__}: {message}"
                raise ServeError(f"cannot open the cache {label}: {message}") from None
            self._stores[label] = backend
            self._readers[label] = StoreReader(label, backend)
        return label

    @property
    def parallel(self) -> bool:
        """Whether any model runs more than one request at once."""
        return any(m.options.parallel > 1 for m in self._models.values())

    def runs_parallel(self, alias: str) -> bool:
        entry = self._models.get(alias)
        return entry is not None and entry.options.parallel > 1 and entry.obstacle is None

    def interrupted(self, alias: str, request: RequestContext) -> bool:
        """Whether `request`'s stream is to end for a request waiting for a slot of `alias`."""
        entry = self._models.get(alias)
        live = entry.live if entry is not None else None
        scheduler = self._schedulers.get(live) if live is not None else None
        return scheduler is not None and scheduler.interrupted(request)

    # -- models coming and going ----------------------------------------------------------

    def attach(self, model: llama_cpp.Llama, settings: ModelSettings) -> ServedLlama:
        """Turn a model upstream's loader made into a `ServedLlama` with its alias's cache
        (and, with ``parallel`` > 1, its scheduler)."""
        if type(model) is not llama_cpp.Llama:
            raise RuntimeError(
                "sippcache serve: llama_cpp.server.model.LlamaProxy.load_llama_from_model_settings returned a "
                f"{type(model).__module__}.{type(model).__qualname__}, not a llama_cpp.Llama; this llama-cpp-python "
                "is not supported by sippcache serve"
            )
        alias = settings.model_alias or settings.model
        with self._lock:
            entry = self._models.get(alias)
            if entry is None:  # a model added after the start (LlamaProxy.__setitem__): the default store
                stores = list(self._stores)
                entry = _Model(alias, stores[0] if stores else None, scope_for(settings), ModelOptions())
                self._models[alias] = entry
        model.__class__ = ServedLlama  # it only overrides methods: see ServedLlama
        served: ServedLlama = model  # type: ignore[assignment]
        served.on_close = lambda closing: self.detach(closing, alias)
        served.on_generated = lambda ttft, tpot: self.metrics.observe_request(alias, "serialized", ttft, tpot)
        chosen = use_chat_format(served, settings)
        if chosen is not None:
            print(
                f"sippcache serve: {alias} has no chat template; using chat_format '{chosen}' for its "
                f"architecture '{served.metadata.get('general.architecture')}' (--chat_format to choose)",
                file=sys.stderr,
            )
        if entry.store is None or settings.vocab_only:
            served.set_cache(None)
        else:
            self._give_cache(served, entry)
        if entry.options.parallel > 1 and not settings.vocab_only:
            entry.obstacle = batching_obstacle(served)
            if entry.obstacle is not None:
                print(f"sippcache serve: {alias} runs one request at a time: {entry.obstacle}", file=sys.stderr)
            else:
                scheduler = self._scheduler(served, entry)
                with self._lock:
                    self._schedulers[served] = scheduler
        with self._lock:
            entry.live = served
        return served

    def _give_cache(self, served: ServedLlama, entry: _Model) -> None:
        logits_all = served._logits_all
        try:
            # The adapter keeps whole prompts with their logits (and answers exact repeats
            # from them) unless the model keeps logits for every position; a served model
            # needs only the last prompt position's (see ServedLlama), so the cache is made
            # as for logits_all=False.
            served._logits_all = False
            cache = LlamaCache(
                self._stores[entry.store or ""],
                llm=served,
                options=entry.cache_options,
                on_prefill=self.metrics.prefill_observer(entry.alias),
            )
            prefix_cache = cache.prefix_cache(served)
        except Exception as exc:  # a store that fails now costs speed only: serve uncached
            log.warning("sippcache: serving %s without a cache: %s: %s", entry.alias, type(exc).__name__, exc)
            with self._lock:
                entry.retired["backend_errors"] = entry.retired.get("backend_errors", 0) + 1
            served.set_cache(None)
            return
        finally:
            served._logits_all = logits_all
        served.sippcache_cache = cache
        served.set_cache(cache)
        entry.namespace = prefix_cache.namespace

    def _scheduler(self, served: ServedLlama, entry: _Model) -> Scheduler:
        """The model's scheduler: a `BatchEngine` on the store the model's cache uses (a
        small `ram://` store of its own when it has none: `NO_CACHE_STORE`)."""
        cache = served.sippcache_cache
        store: str | CacheBackend = cache.cache if cache is not None else NO_CACHE_STORE
        sequences = SequenceCache(
            store,
            fingerprint=llama_fingerprint(served),
            kind=MemoryKind.of(served.model),
            n_vocab=served.n_vocab(),
            options=entry.cache_options,
            rates_place=speed_facts(served),
        )
        alias = entry.alias
        try:
            return Scheduler(
                served,
                sequences,
                slots=entry.options.parallel,
                chunk=entry.options.prefill_chunk,
                save_idle=entry.options.save_idle,
                name=alias,
                on_step=lambda report: self.metrics.observe_step(alias, report),
                on_done=lambda job, request: self._finished(alias, job, request),
                interrupting=self.interrupting,
            )
        except BaseException:
            sequences.close()
            raise

    def _finished(self, alias: str, job: Job, request: RequestContext | None) -> None:
        if job.first_token_at is None:
            return
        arrived = request.arrived if request is not None else job.submitted_at
        n = len(job.generated)
        tpot = (job.last_token_at - job.first_token_at) / (n - 1) if n > 1 and job.last_token_at else None
        self.metrics.observe_request(alias, "batched", job.first_token_at - arrived, tpot)

    def for_request(self, model: llama_cpp.Llama) -> llama_cpp.Llama:
        """The `llama_cpp.Llama` a request runs on: its own from the model's scheduler with
        ``--parallel``, else the shared model."""
        if not isinstance(model, ServedLlama):
            return model
        scheduler = self._schedulers.get(model)
        if scheduler is not None:
            return scheduler.new_request()
        alias = self._alias_of(model)
        entry = self._models.get(alias) if alias is not None else None
        if entry is not None and entry.obstacle is not None:
            self.metrics.count_serialized(entry.alias, "model")
        return model

    def _alias_of(self, model: ServedLlama) -> str | None:
        with self._lock:
            return next((e.alias for e in self._models.values() if e.live is model), None)

    def detach(self, model: ServedLlama, alias: str) -> None:
        """A model is being freed: stop its scheduler (parking its slots), write its pending
        entries, stop its writers, keep its counts."""
        with self._lock:
            scheduler = self._schedulers.pop(model, None)
        cache, model.sippcache_cache = model.sippcache_cache, None
        model.cache = None  # also breaks the model <-> cache reference cycle
        final: dict[str, int | float] = {}
        try:
            if scheduler is not None:
                try:
                    scheduler.close()
                finally:
                    scheduler.sequences.close()
                    final = _added(final, {**scheduler.sequences.counters(), **scheduler.engine.counters})
                    final = _added(final, {f"serialized_{k}": v for k, v in scheduler.stats.serialized.items()})
            if cache is not None:
                prefix_cache = cache.prefix_cache(model)
                try:
                    cache.close()  # flushes and stops the model's writer; the shared store stays open
                finally:
                    final = _added(final, prefix_cache.stats())
        finally:
            with self._lock:
                entry = self._models[alias]
                entry.retired = _added(entry.retired, final)
                if entry.live is model:
                    entry.live = None

    def close(self) -> None:
        """Flush and close every loaded model's cache and scheduler, then the stores."""
        for entry in list(self._models.values()):
            if entry.live is not None:
                self.detach(entry.live, entry.alias)
        for backend in self._stores.values():
            try:
                backend.close()
            except Exception as exc:
                log.warning("sippcache: closing a store failed: %s: %s", type(exc).__name__, exc)
        self._stores.clear()

    # -- what the metrics read --------------------------------------------------------------

    def model_rows(self) -> list[dict[str, Any]]:
        rows = []
        with self._lock:
            entries = [(e, e.live, dict(e.retired)) for e in self._models.values()]
        zeros = {**PrefixStats().as_dict(), "write_failures": 0}
        for entry, live, retired in entries:
            totals: dict[str, Any] = {**zeros, **retired}
            cache = live.sippcache_cache if live is not None else None
            if cache is not None:
                totals = _added(totals, cache.prefix_cache().stats())
            scheduler = self._schedulers.get(live) if live is not None else None
            inside = self.admission.inside(entry.alias)
            running = scheduler.stats.running if scheduler is not None else min(inside, 1)
            prompt_rate = generated_rate = 0.0
            if scheduler is not None:
                totals = _added(totals, {**scheduler.sequences.counters(), **scheduler.engine.counters})
                totals = _added(totals, {f"serialized_{k}": v for k, v in scheduler.stats.serialized.items()})
                prompt_rate, generated_rate = scheduler.stats.rates()
            rows.append(
                {
                    "model": entry.alias,
                    "store": entry.store,
                    "scope": entry.scope,
                    "namespace": entry.namespace,
                    "loaded": live is not None,
                    "parallel": entry.options.parallel if entry.obstacle is None else 1,
                    "running": running,
                    "queued": max(0, inside - running),
                    "busy_slots": scheduler.stats.busy_slots if scheduler is not None else running,
                    "prompt_tokens_per_second": prompt_rate,
                    "generated_tokens_per_second": generated_rate,
                    "rejected": self.admission.rejected.get(entry.alias, 0),
                    **totals,
                }
            )
        return rows

    def store_readers(self) -> list[StoreReader]:
        return list(self._readers.values())


def _added(totals: dict[str, Any], more: dict[str, int | float]) -> dict[str, Any]:
    out = dict(totals)
    for key, value in more.items():
        out[key] = out.get(key, 0) + value
    return out
