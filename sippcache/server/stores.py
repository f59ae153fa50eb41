"""The server's stores: one open store per URL, shared by every model and every reload.

`CachePool` opens each store the models name before the server starts (a bad
URL stops it there), gives every model upstream loads its cache
(`CachePool.attach`) and keeps each model alias's counters across loads and
unloads of its model, for the metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
from llama_cpp.server.settings import ModelSettings

from ..llama import LlamaCache, PrefixStats
from ..protocol import CacheBackend
from ..registry import default_url, redact_url
from ..registry import open as open_cache
from .metrics import ServeMetrics, StoreReader
from .model import ServedLlama
from .settings import ServeError, resolve_cache_value, scope_for

log = logging.getLogger("sippcache")

__all__ = ["CachePool"]


@dataclass
class _Model:
    """A model alias: its store (None: no cache), scope, and counters."""

    alias: str
    store: str | None  # the store's label (a redacted URL)
    scope: str
    retired: dict[str, float] = field(default_factory=dict)  # counted by instances since closed
    live: ServedLlama | None = None
    namespace: str | None = None


class CachePool:
    """The stores the server uses (opened once per URL, before the server starts) and
    each model alias's counters, across loads and unloads of its model."""

    def __init__(self) -> None:
        self._stores: dict[str, CacheBackend] = {}  # label -> open backend
        self._readers: dict[str, StoreReader] = {}
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self.metrics = ServeMetrics(self, [])

    @classmethod
    def open(
        cls, model_settings: Sequence[ModelSettings], cache_urls: dict[str, str | None], cache: str | None
    ) -> CachePool:
        """Open every store the models name. Raises `ServeError` (one line) for a bad URL."""
        pool = cls()
        try:
            default = resolve_cache_value(cache, default_url)
            for settings in model_settings:
                alias = settings.model_alias or settings.model
                own = cache_urls.get(alias)
                url = default if own is None else resolve_cache_value(own, default_url)
                label = pool._open_store(url) if url is not None else None
                pool._models[alias] = _Model(alias, label, scope_for(settings))
        except BaseException:
            pool.close()
            raise
        pool.metrics = ServeMetrics(pool, list(pool._models))
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

    # -- models coming and going ----------------------------------------------------------

    def attach(self, model: llama_cpp.Llama, settings: ModelSettings) -> ServedLlama:
        """Turn a model upstream's loader made into a `ServedLlama` with its alias's cache."""
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
                entry = self._models[alias] = _Model(alias, stores[0] if stores else None, scope_for(settings))
        model.__class__ = ServedLlama  # it only overrides methods: see ServedLlama
        served: ServedLlama = model  # type: ignore[assignment]
        served.on_close = lambda closing: self.detach(closing, alias)
        if entry.store is None or settings.vocab_only:
            served.set_cache(None)
            return served
        logits_all = served._logits_all
        try:
            # The adapter keeps whole prompts with their logits (and answers exact repeats
            # from them) unless the model keeps logits for every position; a served model
            # needs only the last prompt position's (see ServedLlama), so the cache is made
            # as for logits_all=False.
            served._logits_all = False
            cache = LlamaCache(
                self._stores[entry.store], llm=served, scope=entry.scope,
                on_prefill=self.metrics.prefill_observer(alias),
            )  # fmt: skip
            prefix_cache = cache.prefix_cache(served)
        except Exception as exc:  # a store that fails now costs speed only: serve uncached
            log.warning("sippcache: serving %s without a cache: %s: %s", alias, type(exc).__name__, exc)
            with self._lock:
                entry.retired["backend_errors"] = entry.retired.get("backend_errors", 0) + 1
            served.set_cache(None)
            return served
        finally:
            served._logits_all = logits_all
        served.sippcache_cache = cache
        served.set_cache(cache)
        with self._lock:
            entry.live, entry.namespace = served, prefix_cache.namespace
        return served

    def detach(self, model: ServedLlama, alias: str) -> None:
        """A model is being freed: write its pending entries, stop its writer, keep its counts."""
        cache, model.sippcache_cache = model.sippcache_cache, None
        model.cache = None  # also breaks the model <-> cache reference cycle
        final: dict[str, int | float] = {}
        try:
            if cache is not None:
                prefix_cache = cache.prefix_cache(model)
                try:
                    cache.close()  # flushes and stops the model's writer; the shared store stays open
                finally:
                    final = prefix_cache.stats()
        finally:
            with self._lock:
                entry = self._models[alias]
                for key, value in final.items():
                    entry.retired[key] = entry.retired.get(key, 0) + value
                if entry.live is model:
                    entry.live = None

    def close(self) -> None:
        """Flush and close every loaded model's cache, then the stores."""
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
            totals = {**zeros, **retired}
            cache = live.sippcache_cache if live is not None else None
            if cache is not None:
                for key, value in cache.prefix_cache().stats().items():
                    totals[key] = totals.get(key, 0) + value
            rows.append({
                "model": entry.alias, "store": entry.store, "scope": entry.scope, "namespace": entry.namespace,
                "loaded": live is not None, **totals,
            })  # fmt: skip
        return rows

    def store_readers(self) -> list[StoreReader]:
        return list(self._readers.values())
