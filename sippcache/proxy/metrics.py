"""The proxy's Prometheus metrics at ``/metrics``, one series per upstream llama-server.

Reuse is counted only from what llama-server reports for each request
(``timings.cache_n``: prompt tokens it did not evaluate; ``timings.prompt_n``:
the ones it did), never from the size of a restored state. A private registry:
embedding the proxy never mixes its metrics with the host's.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    """Counters, histograms and gauges of one proxy."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "sippcache_proxy_requests",
            "Completion requests relayed, by how they ended (ok: to the last byte).",
            ["upstream", "endpoint", "outcome"],
            registry=registry,
        )
        self.uncached = Counter(
            "sippcache_proxy_uncached_requests",
            "Requests llama-server ran in a slot of its own choosing, passed through uncached: the proxy does"
            " not read their prompts (infill, embeddings, ..., and the messages and responses requests it"
            " could not convert).",
            ["upstream", "path"],
            registry=registry,
        )
        self.unconverted = Counter(
            "sippcache_proxy_unconverted_requests",
            "Anthropic messages and OpenAI responses requests the proxy could not convert to the chat"
            " llama-server makes of them (a shape it does not know, media, input llama-server rejects):"
            " passed through uncached, by reason.",
            ["path", "reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "sippcache_proxy_prompt_tokens",
            "Prompt tokens as llama-server reports them: reused (timings.cache_n) or computed (timings.prompt_n).",
            ["upstream", "how"],
            registry=registry,
        )
        self.prompt_tokenizing = Counter(
            "sippcache_proxy_chat_prompt_tokens",
            "A chat prompt's tokens as the proxy got them: tokenized by llama-server for it, or known"
            " (the tokens of an earlier prompt text this one begins with: sippcache.proxy.prompts).",
            ["how"],
            registry=registry,
        )
        self.restores = Counter(
            "sippcache_proxy_restores",
            "Stored states loaded into a slot (ok) or refused by llama-server (refused: the entry is kept).",
            ["upstream", "outcome"],
            registry=registry,
        )
        self.ready_restores = Counter(
            "sippcache_proxy_ready_restores",
            "Restores (of restores{outcome=ok}) from a slot file the proxy kept ready: llama-server's own load, "
            "nothing read from the store or staged.",
            ["upstream"],
            registry=registry,
        )
        self.ready_files = Gauge(
            "sippcache_proxy_ready_files", "Slot files kept ready for restores (--ready-bytes).", registry=registry
        )
        self.ready_bytes = Gauge(
            "sippcache_proxy_ready_bytes", "The bytes of the slot files kept ready.", registry=registry
        )
        self.ready_warmed = Counter(
            "sippcache_proxy_ready_warmed",
            "Stored states made ready files after the start, ahead of any request (--warm-ready).",
            registry=registry,
        )
        self.ready_warming = Gauge(
            "sippcache_proxy_ready_warming",
            "1 while stored states are being made ready files after the start (--warm-ready), else 0.",
            registry=registry,
        )
        self.restores_skipped = Counter(
            "sippcache_proxy_restores_skipped",
            "Stored states not restored although one gave more tokens than the slot held, by why: "
            "slower_than_prefill, ineffective (this server's recent restores bought nothing), never (--restore never).",
            ["upstream", "reason"],
            registry=registry,
        )
        self.restores_ineffective = Counter(
            "sippcache_proxy_restores_ineffective",
            "Restores after which llama-server reused (timings.cache_n) less than half of what they gave the prompt.",
            ["upstream"],
            registry=registry,
        )
        self.restore_seconds = Histogram(
            "sippcache_proxy_restore_seconds", "Store read + slot restore.", ["upstream"], registry=registry
        )
        self.restore_part_seconds = Histogram(
            "sippcache_proxy_restore_part_seconds",
            "A restore's time by who spent it: sippcache (store read, checksums, the staging file written) and "
            "llama_server (its own load of the file, its timings.restore_ms); the rest of restore_seconds is the "
            "HTTP call and the scheduling around both.",
            ["upstream", "part"],
            registry=registry,
        )
        self.saves = Counter("sippcache_proxy_saves", "Slot states stored.", ["upstream"], registry=registry)
        self.slot_saves = Counter(
            "sippcache_proxy_slot_saves",
            "Slot saves asked of llama-server, by why: new (the store held nothing of the prompt), waited (other "
            "requests waited for it), recurrent (a recurrent or hybrid model: every answer), grown (--save-every "
            "tokens beyond the store), leave (the slot changed hands), idle (--save-idle seconds unused), shutdown.",
            ["upstream", "reason"],
            registry=registry,
        )
        self.save_seconds = Histogram(
            "sippcache_proxy_save_seconds", "Slot save + store write.", ["upstream"], registry=registry
        )
        self.save_part_seconds = Histogram(
            "sippcache_proxy_save_part_seconds",
            "A save's time by who spent it: llama_server (its own write of the slot file, its "
            "timings.save_ms) and sippcache (the rest of save_seconds: the HTTP call, the file read, "
            "framing, the store write).",
            ["upstream", "part"],
            registry=registry,
        )
        self.bytes_stored = Counter(
            "sippcache_proxy_stored_bytes", "Bytes of entries written to the store.", ["upstream"], registry=registry
        )
        self.store_errors = Gauge(
            "sippcache_proxy_store_errors",
            "Store operations that failed and were answered as misses.",
            registry=registry,
        )
        self.flight_waits = Counter(
            "sippcache_proxy_flight_waits",
            "Times a request waited for one in flight that computes a long prefix of its prompt.",
            registry=registry,
        )
        self.upstream_up = Gauge(
            "sippcache_proxy_upstream_up", "1 while the upstream answers.", ["upstream"], registry=registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
