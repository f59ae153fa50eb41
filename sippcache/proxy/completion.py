"""A completion run in a slot with the best stored prefix.

A completion request (``/v1/chat/completions``, ``/v1/completions``,
``/completion``, or an Anthropic or Responses request converted to a chat)
flows like this::

    client ──> tokens (llama-server's /apply-template + /tokenize: its template, its tokenizer;
               a chat's text past the last prompt text it begins with: sippcache.proxy.prompts)
           ──> wait while a request in flight computes a long prefix of it that nothing holds yet
               (sippcache.proxy.flights)
           ──> a slot (SlotTable: the idle slot holding the longest prefix, else the least loaded server)
           ──> restore the store's best state into it when that beats what the slot holds, and
               loading it is expected to be faster than computing its tokens (sippcache.proxy.restoring)
           ──> the request, pinned with id_slot, relayed as llama-server answers it (streamed or not)
           ──> the slot is free again, its state left there unsaved, or saved now (sippcache.proxy.saving)

Reuse is counted only from what llama-server reports (`timings.cache_n` and
`prompt_n`), and the ``X-Sippcache-Prompt-Reused`` header carries its `cache_n`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from .apis import Translator
from .flights import Flight, Flights
from .health import Health
from .metrics import ProxyMetrics
from .passthrough import Passthrough, unavailable
from .prompts import KnownPrompts
from .relay import Relay, RelayResponse, forwarded
from .restoring import Restore, Restorer
from .saving import Saver
from .slots import NoServer, QueueFull, Slot, SlotTable, common_prefix
from .store import SlotStore
from .upstream import Upstream, UpstreamDown, UpstreamRefused

__all__ = ["SCOPE_HEADER", "Completions"]

#: The request header naming the tenant (scope) a request belongs to; default: the proxy's --scope.
SCOPE_HEADER = "X-Sippcache-Scope"


class Completions:
    """Runs completion requests in slots: tokens, a wait in flight, a slot, a restore, the relay, a save."""

    def __init__(
        self,
        upstreams: list[Upstream],
        slots: SlotTable,
        store: SlotStore,
        metrics: ProxyMetrics,
        client: httpx.AsyncClient,
        scope: str,
        *,
        flights: Flights,
        restorer: Restorer,
        saver: Saver,
        health: Health,
        passthrough: Passthrough,
    ) -> None:
        self.upstreams, self.slots, self.store, self.metrics, self.client = upstreams, slots, store, metrics, client
        self.scope = scope
        self.flights, self.restorer, self.saver, self.health = flights, restorer, saver, health
        self.passthrough = passthrough
        self.prompts = KnownPrompts()

    async def run(
        self,
        request: Request,
        body: bytes,
        payload: dict[str, Any],
        path: str,
        how: str,
        translator: Translator | None = None,
    ) -> Response:
        """Run `payload` (read as `how`: ``chat`` or ``completion``) at llama-server's `path` in a slot
        (module docstring); `translator` turns the answer into the API `request` came in."""

        async def as_is() -> Response:  # a request llama-server rejects: its own answer, as it is
            if translator is None:
                return await self.passthrough.forward(request, body)
            return await self.passthrough.unread(request, body)

        try:
            tokens = await self._prompt_tokens(how, payload)
        except UpstreamRefused:
            return await as_is()
        except (UpstreamDown, NoServer):
            return unavailable("no llama-server is reachable")
        scope = request.headers.get(SCOPE_HEADER, self.scope)
        cached = payload.get("cache_prompt", True) is not False
        flight = await self._take_off(tokens, scope) if cached and tokens and self.store.can_cut else None
        try:
            slot, held = await self.slots.acquire(tokens or (), scope)
        except (QueueFull, NoServer) as exc:
            self.flights.land(flight)
            full = isinstance(exc, QueueFull)
            return unavailable("every slot is busy and the queue is full" if full else "no llama-server is reachable")
        except BaseException:
            self.flights.land(flight)
            raise
        upstream = self.upstreams[slot.server]
        restore: Restore | None = None
        try:
            keeps = common_prefix(slot.tokens, tokens or ()) if slot.scope == scope else 0
            if slot.unsaved is not None and keeps < len(slot.tokens):  # it changes hands: its state is saved first
                await self.saver.save(slot, slot.unsaved, "leave")
            if slot.scope != scope and (slot.tokens or slot.unknown):  # another tenant's: never reused, erased
                await upstream.slot_action(slot.id, "erase")
                slot.unknown = False
            slot.tokens, slot.scope = (slot.tokens if slot.scope == scope else ()), scope
            slot.stored = min(slot.stored, keeps)
            if tokens and cached:
                restore = await self.restorer.restore(upstream, slot, tokens, held)
            fanned = isinstance(payload.get("n"), int) and payload["n"] > 1  # child tasks run in other slots
            if fanned:
                await self.saver.save_idle_slots(slot.server)
            payload["id_slot"] = slot.id
            if tokens and _ids_for_text(path, how, upstream):
                payload["prompt"] = tokens  # the ids it made of the text: not tokenized a second time
            stream = bool(payload.get("stream"))
            strip = stream and not payload.get("timings_per_token")
            if strip:
                payload["timings_per_token"] = True  # cache_n in the first event, for the header
            upstream_request = self.client.build_request(
                "POST", upstream.url + path, headers=forwarded(request.headers), json=payload, timeout=None
            )
            answer = await self.client.send(upstream_request, stream=True)
        except (UpstreamDown, httpx.TransportError) as exc:  # a slot call, or the request itself
            self.flights.land(flight)
            await self.health.lost(slot, exc)
            return unavailable(f"llama-server at {upstream.url} is not reachable")
        except BaseException:
            self.flights.land(flight)
            await self.slots.release(slot)
            raise

        async def done(relay: Relay) -> None:
            if fanned:  # while this request's own slot is still busy: its belief is kept
                await self.slots.forget_idle(slot.server)
            await self._finish(slot, how, relay, tokens, flight, restore)

        return RelayResponse(answer, stream, strip, done, translator=translator)

    async def _prompt_tokens(self, how: str, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's tokens as llama-server will see them; None for a request that has no single prompt."""
        upstream = self.health.any_upstream()
        if how == "chat":
            if not isinstance(payload.get("messages"), list):
                return None
            tokens, known = await self.prompts.tokens(upstream, await upstream.apply_template(payload))
            self.metrics.prompt_tokenizing.labels("tokenized").inc(len(tokens) - known)
            self.metrics.prompt_tokenizing.labels("known").inc(known)
            return tokens
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await upstream.tokenize(prompt)
        return _token_ids(prompt)

    async def _take_off(self, tokens: list[int], scope: str) -> Flight:
        """Wait for a request in flight computing a long prefix of `tokens` (`Flights.take_off`)
        where its state would be restored on a reachable upstream; then this one is in flight."""

        async def held(tokens: list[int], scope: str) -> int:  # by the store or an idle slot
            return max(await asyncio.to_thread(self.store.best_length, tokens, scope), self.slots.held(tokens, scope))

        def worth_waiting(leader: Flight, gain: int) -> bool:
            urls = (u.url for server, u in enumerate(self.upstreams) if server not in self.slots.down)
            return self.restorer.would_restore(len(leader.tokens), gain, urls)

        return await self.flights.take_off(tokens, scope, held, worth_waiting, self.metrics.flight_waits.inc)

    async def _finish(
        self,
        slot: Slot,
        how: str,
        relay: Relay,
        tokens: list[int] | None,
        flight: Flight | None,
        restore: Restore | None = None,
    ) -> None:
        """After the response: count what llama-server reported, save the slot now or leave its state
        there unsaved, free it; then the requests waiting for this one's state look again."""
        try:
            stored = await self._after(slot, how, relay, tokens, flight, restore)
        except BaseException:
            self.flights.land(flight)
            raise
        if stored is None:
            self.flights.land(flight)
        else:
            if flight is not None:
                flight.writing = True
            stored.add_done_callback(lambda _: self.flights.land(flight))

    async def _after(
        self,
        slot: Slot,
        how: str,
        relay: Relay,
        tokens: list[int] | None,
        flight: Flight | None,
        restore: Restore | None,
    ) -> asyncio.Task[Any] | None:
        """Count, learn the rates, save the slot if it is to be saved now (`SavePolicy`), and free
        it; the task storing its state, if any."""
        upstream = self.upstreams[slot.server]
        timings = relay.timings
        self.metrics.requests.labels(upstream.url, how, "ok" if relay.complete else "incomplete").inc()
        self.restorer.learn(upstream.url, timings, restore)
        self.restorer.rates.flush()  # kept for the next proxy at this place (at most every KEEP_EVERY seconds)
        prompt = len(tokens or ())
        if "cache_n" in timings:
            self.metrics.prompt_tokens.labels(upstream.url, "reused").inc(int(timings["cache_n"]))
            self.metrics.prompt_tokens.labels(upstream.url, "computed").inc(int(timings.get("prompt_n", 0)))
        if "prompt_n" in timings:  # llama-server's own count of the prompt
            prompt = int(timings["prompt_n"]) + int(timings.get("cache_n", 0))
        if relay.lost:
            await self.health.lost(slot, ConnectionError("the connection broke during a response"))
            return None
        if not relay.complete:  # cut short, the slot holds what nobody asked for: not stored
            slot.forget()
            await self.slots.release(slot)
            return None
        slot.tokens = tuple(tokens or ())  # what it holds begins so; the answer's tokens are not known here
        slot.unknown = False
        reason = self.saver.policy.now(
            waited_for=flight is not None and flight.waiting > 0,
            stored=slot.stored,
            held=prompt + int(timings.get("predicted_n", 0)),
        )
        task = None
        try:
            if reason is None:
                slot.unsaved = prompt
            else:
                task = await self.saver.save(slot, prompt, reason)
        except UpstreamDown as exc:
            await self.health.lost(slot, exc)
            return None
        await self.slots.release(slot)
        if slot.unsaved is not None:
            self.saver.save_when_idle(slot)
        return task


def _token_ids(prompt: Any) -> list[int] | None:
    """A completion's prompt given as token ids (a non-empty JSON list of ints, no bools), else
    None. Checked in C (`map(type, ...)`): 1.4 ms for a 32K-token prompt, 5.2 ms as a Python step
    per id."""
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        return list(prompt)
    return None


def _ids_for_text(path: str, how: str, upstream: Upstream) -> bool:
    """Whether a completion's prompt goes to llama-server as the token ids the proxy had it make
    (`_prompt_tokens`; the same ids, it tokenizes a text prompt with the same flags): it would
    tokenize the text again, in its time to first token (at 29.5K tokens of gemma-3 that added
    132 ms: python -m benchmarks.probes.prompt_ids). Not for a chat (no token-id form), nor for
    /v1/completions on a server with a projector (it reads that prompt as text)."""
    return how == "completion" and (path == "/completion" or not upstream.multimodal)
