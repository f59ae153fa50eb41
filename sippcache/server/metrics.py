"""The metrics of `sippcache serve`: Prometheus text at ``/metrics``, JSON at ``/v1/cache/stats``.

Everything lives in a private `prometheus_client.CollectorRegistry` (never the
global one), so embedding the server in a process that has its own metrics
does not mix them. Counters and gauges are read at scrape time from the
adapter's own counters (`PrefixCache.stats()` and, with ``--parallel``, the
scheduler's, one per loaded model, plus what models unloaded since the start
had counted), the admission counts and each store's `stats()`. Recorded as
they happen: histograms of restore times (the adapter's `on_prefill`
callback), of tokens per batched step, of time to first token and of time per
output token.

A scrape never waits for the model (it does not take the server's llama lock)
and never hangs on a store: a store's `stats()` runs on its own thread with a
time limit; past it (a Redis server that stopped answering) the last values
read are reported with ``sippcache_store_up 0``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..llama.states import REFUSAL_REASONS
from ..protocol import CacheBackend

__all__ = [
    "CONTENT_TYPE_LATEST",
    "MODEL_COUNTERS",
    "SERVING_COUNTERS",
    "SERVING_GAUGES",
    "STORE_COUNTERS",
    "STORE_GAUGES",
    "ServeMetrics",
    "StoreReader",
]

#: (PrefixCache.stats() key, metric name without _total, help): one series per model alias.
MODEL_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("lookups", "sippcache_lookups", "Prefills that looked in the cache."),
    ("hits", "sippcache_hits", "Prefills that restored an entry from the cache."),
    ("partial_hits", "sippcache_partial_hits", "Hits on a longer or diverging entry, cut back to the shared prefix."),
    ("logits_hits", "sippcache_logits_hits", "Exact repeats served with stored logits (nothing evaluated)."),
    ("misses", "sippcache_misses", "Prefills that restored nothing from the cache."),
    ("tokens_reused", "sippcache_tokens_reused", "Prompt tokens restored from the cache."),
    ("context_tokens_reused", "sippcache_context_tokens_reused", "Prompt tokens kept from the live llama context."),
    ("tokens_evaluated", "sippcache_tokens_evaluated", "Prompt tokens llama.cpp evaluated."),
    ("entries_written", "sippcache_entries_written", "Entries this server wrote to the store."),
    ("bytes_written", "sippcache_bytes_written", "Bytes of entries this server wrote to the store."),
    ("bytes_read", "sippcache_bytes_read", "Bytes of entries restored from the store."),
    ("corrupt_entries", "sippcache_corrupt_entries", "Entries dropped because they failed their checks."),
    (
        "rejected_entries",
        "sippcache_rejected_entries",
        "Entries not used: llama.cpp refused them, they were wrong, or the model cannot cut them back "
        "(sippcache_refused_entries_total by reason).",
    ),
)
#: (model row key, metric name, help): how each model is serving, read at scrape time.
SERVING_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("parallel", "sippcache_slots", "Requests the model runs at once (--parallel)."),
    ("running", "sippcache_requests_running", "Requests running now."),
    ("queued", "sippcache_requests_queued", "Requests admitted and waiting to run."),
    ("busy_slots", "sippcache_slots_busy", "Slots running a request now (slot occupancy: this / sippcache_slots)."),
    (
        "prompt_tokens_per_second",
        "sippcache_prompt_tokens_per_second",
        "Prompt tokens the batched path evaluated per second, over the last 10 s.",
    ),
    (
        "generated_tokens_per_second",
        "sippcache_generated_tokens_per_second",
        "Tokens the batched path generated per second, over the last 10 s.",
    ),
)
#: (model row key, metric name without _total, help), read at scrape time.
SERVING_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("prompt_tokens_evaluated", "sippcache_batched_prompt_tokens", "Prompt tokens the batched path evaluated."),
    ("tokens_generated", "sippcache_batched_generated_tokens", "Tokens the batched path generated."),
    ("decode_calls", "sippcache_batched_steps", "Batched steps (llama_decode calls)."),
    (
        "borrowed_tokens",
        "sippcache_borrowed_tokens",
        "Prompt tokens shared from another slot's sequence (llama_memory_seq_cp) instead of evaluated.",
    ),
    ("rejected", "sippcache_requests_rejected", "Requests turned away with 503: every slot busy and the queue full."),
)
#: Tokens per batched step (a decode token per running request plus prompt tokens).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Seconds of a batched step's phases: one `llama_decode`, then sampling every request's token.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
#: Time to first token, from the request's arrival (queueing included).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Time per output token after the first.
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
#: Entries not used, by reason: (PrefixCache.stats() key, label value), from `states.REFUSAL_REASONS`.
REFUSALS: tuple[tuple[str, str], ...] = tuple((f"refused_{reason}", reason) for reason in REFUSAL_REASONS)
#: Store failures seen by the adapter, by kind: (PrefixCache.stats() key, label value).
BACKEND_ERRORS: tuple[tuple[str, str], ...] = (("backend_errors", "lookup"), ("write_failures", "write"))
#: (Stats field, metric name, help): one series per store, read from `stats()` at scrape time.
STORE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("entries", "sippcache_store_entries", "Entries in the store (every process)."),
    ("bytes", "sippcache_store_bytes", "Bytes in the store (every process)."),
    ("max_bytes", "sippcache_store_max_bytes", "The store's byte budget (absent when unlimited)."),
    ("pinned", "sippcache_store_pinned_entries", "Pinned entries in the store."),
)
STORE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("evictions", "sippcache_store_evictions", "Entries this server's store handle evicted to stay within budget."),
    ("refused", "sippcache_store_refused", "Entries this server's store handle refused (too large, or no room)."),
    (
        "errors",
        "sippcache_store_errors",
        "Operations the store could not do (e.g. server down), answered as misses or dropped.",
    ),
)
#: Restore times: a memory copy (about 2 ms for 12 MB) up to a slow network store.
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class StatsSource(Protocol):
    """What the metrics read: `sippcache.server.stores.CachePool`."""

    def model_rows(self) -> list[dict[str, Any]]:
        """One dict per model alias: model, store, scope, namespace, loaded, and the adapter's counters."""

    def store_readers(self) -> list[StoreReader]: ...


class StoreReader:
    """Reads one store's `stats()` safely: on a thread of its own, with a time limit;
    a failure or a timeout reports the last values read and ``up = False``."""

    def __init__(self, label: str, backend: CacheBackend, *, timeout: float = 2.0) -> None:
        self.label = label
        self.backend = backend
        self.timeout = timeout
        self.last: dict[str, Any] = {}
        self.up = False
        self.failures = 0  # stats() calls that failed or timed out
        self._lock = threading.Lock()
        self._pending: threading.Thread | None = None

    def read(self) -> tuple[dict[str, Any], bool]:
        """(the latest stats as a dict, whether this read succeeded in time)."""
        with self._lock:
            thread = self._pending
            if thread is None or not thread.is_alive():  # never more than one call in flight
                thread = threading.Thread(target=self._read, name="sippcache-stats", daemon=True)
                self._pending = thread
                self._started = time.monotonic()
                thread.start()
        thread.join(max(0.0, self.timeout - (time.monotonic() - self._started)))
        with self._lock:
            if thread.is_alive():
                self.up = False
            return dict(self.last), self.up

    def _read(self) -> None:
        try:
            stats = self.backend.stats()
            values = {name: getattr(stats, name) for name in stats.__dataclass_fields__}
        except Exception:
            with self._lock:
                self.up = False
                self.failures += 1
            return
        with self._lock:
            self.last, self.up = values, True


class ServeMetrics:
    """The server's metrics registry: scrape-time counters plus the restore-time histogram."""

    def __init__(self, source: StatsSource, aliases: list[str]) -> None:
        self.source = source
        self.registry = CollectorRegistry(auto_describe=False)
        self.restore_seconds = Histogram(
            "sippcache_restore_seconds",
            "Time to restore a prefix from the cache into the llama context, per prefill that restored one.",
            ["model"],
            registry=self.registry,
            buckets=RESTORE_BUCKETS,
        )
        self.batch_tokens = Histogram(
            "sippcache_batch_tokens",
            "Tokens in each batched step (llama_decode): decode tokens plus prompt tokens.",
            ["model"],
            registry=self.registry,
            buckets=BATCH_BUCKETS,
        )
        self.step_seconds = Histogram(
            "sippcache_step_seconds",
            "Where each batched step's time goes (phase: decode, the one llama_decode; sample, "
            "sampling each request's next token with its chain and handing it over).",
            ["model", "phase"],
            registry=self.registry,
            buckets=STEP_BUCKETS,
        )
        self.ttft = Histogram(
            "sippcache_time_to_first_token_seconds",
            "From a completion request's arrival to its first token (path: batched or serialized).",
            ["model", "path"],
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "sippcache_time_per_output_token_seconds",
            "Time per generated token after the first, per completion (path: batched or serialized).",
            ["model", "path"],
            registry=self.registry,
            buckets=TPOT_BUCKETS,
        )
        self._serialized: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        for alias in aliases:
            self.restore_seconds.labels(alias)  # every model's series exists from the start
        self.registry.register(_Collector(source, self))

    def observe_step(self, alias: str, report: Any) -> None:
        """A batched step of `alias`'s scheduler (a `StepReport`)."""
        if report.batch:
            self.batch_tokens.labels(alias).observe(report.batch)
            self.step_seconds.labels(alias, "decode").observe(report.decode_seconds)
            self.step_seconds.labels(alias, "sample").observe(report.sample_seconds)

    def observe_request(self, alias: str, path: str, ttft: float, tpot: float | None) -> None:
        """A completion of `alias` that generated tokens, on the `path` it ran."""
        self.ttft.labels(alias, path).observe(ttft)
        if tpot is not None:
            self.tpot.labels(alias, path).observe(tpot)

    def count_serialized(self, alias: str, reason: str) -> None:
        """A request of a ``--parallel`` model that ran on the shared model (not counted by a scheduler)."""
        with self._lock:
            self._serialized[alias, reason] = self._serialized.get((alias, reason), 0) + 1

    def serialized_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._serialized)

    def prefill_observer(self, alias: str) -> Callable[[Any], None]:
        """An `on_prefill` callback for the model `alias`."""
        histogram = self.restore_seconds.labels(alias)

        def observe(result: Any) -> None:
            if result.restored:
                histogram.observe(result.restore_seconds)

        return observe

    def render(self) -> bytes:
        """The Prometheus text exposition (blocking: reads the stores; call it off the event loop)."""
        return generate_latest(self.registry)

    def as_json(self) -> dict[str, Any]:
        """The same numbers as a JSON-able dict (blocking, as `render`)."""
        models = {}
        for row in self.source.model_rows():
            row = dict(row)
            models[row.pop("model")] = row
        stores = {}
        for reader in self.source.store_readers():
            values, up = reader.read()
            stores[reader.label] = {"up": up, **values}
        errors = sum(row.get(key, 0) for row in models.values() for key, _ in BACKEND_ERRORS)
        errors += sum(_number(store, "errors") for store in stores.values())
        # backend_errors: every store failure seen (the adapter's lookups and writes, the stores' own count).
        return {"backend_errors": int(errors), "models": models, "stores": stores}


class _Collector(Collector):
    def __init__(self, source: StatsSource, metrics: ServeMetrics) -> None:
        self.source = source
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        rows = self.source.model_rows()
        for key, name, documentation in MODEL_COUNTERS + SERVING_COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["model"])
            for row in rows:
                family.add_metric([row["model"]], row.get(key, 0))
            yield family
        for key, name, documentation in SERVING_GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["model"])
            for row in rows:
                gauge.add_metric([row["model"]], row.get(key, 0))
            yield gauge
        serialized = CounterMetricFamily(
            "sippcache_requests_serialized",
            "Requests of a --parallel model run on the shared model, one at a time (reason: prompt_logprobs, "
            "embedding, model: the model cannot run batched).",
            labels=["model", "reason"],
        )
        counts = self.metrics.serialized_counts()
        for row in rows:
            for key, value in row.items():
                if key.startswith("serialized_"):
                    counts[row["model"], key.removeprefix("serialized_")] = (
                        counts.get((row["model"], key.removeprefix("serialized_")), 0) + value
                    )
        for (model, reason), value in sorted(counts.items()):
            serialized.add_metric([model, reason], value)
        yield serialized
        yield _per_model(
            "sippcache_backend_errors",
            "Store failures the adapter saw (kind=lookup: lookups, deletes, touches; kind=write: background "
            "writes); the request went on uncached.",
            "kind",
            BACKEND_ERRORS,
            rows,
        )
        yield _per_model(
            "sippcache_refused_entries",
            "Stored states not used, by reason: load (llama.cpp did not take it; kept), positions (it held other "
            "positions than its key; dropped), cut (usable only cut back where the model's memory cannot be cut "
            "exactly: a sliding window after a restore, any recurrent or hybrid state; kept).",
            "reason",
            REFUSALS,
            rows,
        )
        loaded = GaugeMetricFamily(
            "sippcache_model_loaded", "1 for the model alias the server has loaded.", labels=["model"]
        )
        info = GaugeMetricFamily(
            "sippcache_model_cache_info",
            "The store and scope each model alias uses (value 1).",
            labels=["model", "store", "scope"],
        )
        for row in rows:
            loaded.add_metric([row["model"]], 1 if row["loaded"] else 0)
            info.add_metric([row["model"], row["store"] or "", row["scope"] or ""], 1)
        yield loaded
        yield info
        yield from _store_metrics(self.source.store_readers())


def _per_model(
    name: str, help_text: str, label: str, table: tuple[tuple[str, str], ...], rows: list[dict[str, Any]]
) -> CounterMetricFamily:
    """One counter with a series per model and per `label` value: `table` maps a stats key to that value."""
    family = CounterMetricFamily(name, help_text, labels=["model", label])
    for row in rows:
        for key, value in table:
            family.add_metric([row["model"], value], row.get(key, 0))
    return family


def _store_metrics(readers: list[StoreReader]) -> Iterator[Metric]:
    read = [(reader, *reader.read()) for reader in readers]
    up = GaugeMetricFamily(
        "sippcache_store_up", "1 if the store's stats() answered in time at this scrape.", labels=["store"]
    )
    for reader, _, ok in read:
        up.add_metric([reader.label], 1 if ok else 0)
    yield up
    for field, name, documentation in STORE_GAUGES:
        gauge = GaugeMetricFamily(name, documentation, labels=["store"])
        for reader, values, _ in read:
            if values.get(field) is not None:
                gauge.add_metric([reader.label], values[field])
        yield gauge
    for field, name, documentation in STORE_COUNTERS:
        counter = CounterMetricFamily(name, documentation, labels=["store"])
        for reader, values, _ in read:
            counter.add_metric([reader.label], _number(values, field))
        yield counter


def _number(values: Mapping[str, Any], field: str) -> float:
    value = values.get(field)
    return float(value) if isinstance(value, (int, float)) else 0.0
