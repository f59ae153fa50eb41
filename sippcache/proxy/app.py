"""The proxy's ASGI app: completions go through a slot with the best stored prefix; the rest passes.

A completion request (``/v1/chat/completions``, ``/v1/completions``,
``/completion``) flows like this::

    client ──> tokens (llama-server's /apply-template + /tokenize: its template, its tokenizer;
               a chat's text past the last prompt text it begins with: sippcache.proxy.prompts)
           ──> wait while a request in flight computes a long prefix of it that nothing holds yet
           ──> a slot (SlotTable: the idle slot holding the longest prefix, else the least loaded server)
           ──> restore the store's best state into it when that beats what the slot holds, and
               loading it is expected to be faster than computing its tokens (`sippcache.rates`)
           ──> the request, pinned with id_slot, relayed as llama-server answers it (streamed or not)
           ──> the slot is free again, its state left there unsaved, or saved now (see below)
           ──> a save: llama-server writes it to the staging directory; in a worker thread it is
               framed and stored, the file then kept ready (`SlotStore.ready`: a later restore
               that serves a prompt as well as the store loads it as it is, nothing copied) or removed

Every other path, and a request the proxy cannot read, goes to llama-server
unchanged (headers, ``Authorization`` included), so llama-server's own errors
(a malformed request's 400) reach the client as they are. Reuse is counted
only from what llama-server reports (`timings.cache_n` and `prompt_n`), and the
``X-Sippcache-Prompt-Reused`` header carries its `cache_n`.

A slot's state is saved when its conversation leaves it, not after every
answer: a state holds every token from the first, so a save per turn writes the
whole conversation again each time (on a GPU, a 1 GB state's save and store
cost several times the answer). An answer's state is saved at once when other
requests wait for it (a prefix in flight), when the store held nothing of its
prompt (a new conversation or system prompt: other processes want it), or when
the slot has grown `save_every` tokens beyond what the store holds (what a
crash can lose), and always on a recurrent or hybrid model (a state extended
only at exactly its length: every answer's end is kept). Otherwise it stays in
the slot, unsaved, and is saved before the slot serves another conversation,
after `save_idle` seconds idle, and when the proxy stops (SIGTERM or SIGINT).

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
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..rates import INEFFECTIVE_SHARE, RestoreRates
from .apis import Translator, Unconvertible, anthropic, responses, responses_answer
from .metrics import ProxyMetrics
from .prompts import KnownPrompts
from .ready import ReadyFile
from .relay import HOP, REUSED_HEADER, Relay, RelayResponse, forwarded
from .slots import MIN_GAIN, NoServer, Origin, QueueFull, Slot, SlotTable, common_prefix, reusable
from .store import Restored, RestoreRefused, SlotStore, Snapshot
from .upstream import Upstream, UpstreamDown, UpstreamRefused

__all__ = ["COMPLETION_PATHS", "REUSED_HEADER", "Proxy"]

log = logging.getLogger("sippcache.proxy")

#: The paths whose requests run in a slot: path -> how the prompt is read.
COMPLETION_PATHS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completion",
    "/completions": "completion",
    "/completion": "completion",
}
#: The agentic clients' APIs, run as the chat llama-server converts them to (`sippcache.proxy.apis`):
#: path -> (the conversion of a request, the translator of the chat's answer back).
CONVERTED_PATHS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[str], Translator]]] = {
    "/v1/messages": (anthropic.to_chat, anthropic.AnthropicTranslator),
    "/v1/responses": (responses.to_chat, responses_answer.ResponsesTranslator),
    "/responses": (responses.to_chat, responses_answer.ResponsesTranslator),
}
#: The chat path a converted request goes to.
CHAT_PATH = "/v1/chat/completions"
#: The paths whose requests llama-server runs in a slot of its own choosing while the proxy does not
#: read their prompt (infill, embeddings, reranking, audio, and the converted APIs' requests the proxy
#: cannot convert): passed through, not cached (`Proxy.unread`).
UNREAD_PATHS = frozenset(
    {
        "/infill",
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/rerank",
        "/reranking",
        "/v1/rerank",
        "/v1/reranking",
        "/v1/audio/transcriptions",
        "/audio/transcriptions",
    }
)
#: llama-server's slot actions (``POST /slots/{id}?action=...``) that change what a slot holds.
SLOT_PATH = re.compile(r"/slots/(\d+)")
CHANGING_ACTIONS = frozenset({"erase", "restore"})
#: The request header naming the tenant (scope) a request belongs to; default: the proxy's --scope.
SCOPE_HEADER = "X-Sippcache-Scope"
#: A slot's unsaved state is saved once it holds this many tokens beyond what the store holds (what a
#: crash can lose), and once it has sat idle this many seconds.
SAVE_EVERY = 2048
SAVE_IDLE = 30.0
#: A request waits for one in flight (`Proxy.flight_wait`) when that one computes at least this many
#: tokens of its prompt beyond what the store and the idle slots hold.
MIN_FLIGHT_LEAD = 256
#: While a request has a slot, making ready files after the start (`Proxy.warm`) waits, looking
#: again this often (seconds): a restore or prefill gets the cores and memory to itself.
WARM_PAUSE = 0.05
RETRY_AFTER = "2"


@dataclass(eq=False)
class _Flight:
    """A request in flight, whose stored state later requests sharing its prefix can wait for."""

    scope: str
    tokens: list[int]
    landed: asyncio.Event
    waiting: int = 0  # requests waiting for its state now: it is stored at once
    writing: bool = False  # answered, its state being written to the store: what is left is that write

    def min_lead(self) -> int:
        """How many tokens beyond what the store and the slots hold make waiting for this one pay:
        a prefill's worth (`MIN_FLIGHT_LEAD`) while it computes, a restore's (`MIN_GAIN`) once only
        its store write is left (a conversation's next turn, sent before its last state landed)."""
        return MIN_GAIN if self.writing else MIN_FLIGHT_LEAD


@dataclass(frozen=True)
class _Restore:
    """A restore done for a request: what was loaded, and how many of the prompt's tokens it gave
    llama-server to reuse (what `timings.cache_n` should then report)."""

    restored: Restored
    promised: int


class Proxy:
    """The proxy for a set of llama-servers of one model sharing one `SlotStore`.

    A burst of requests over one long new prefix (a system prompt or document that nothing holds
    yet) would have llama-server compute it once per slot, all at once. Instead the first computes
    it and the others wait for its stored state, at most `flight_wait` seconds (0: never wait).

    `rates` decides per upstream whether a restore beats computing (default: ``auto``, measured);
    its mode is the command line's ``--restore``. A slot left unsaved is saved once it has grown
    `save_every` tokens beyond the store, or sat `save_idle` seconds idle (module docstring).
    """

    def __init__(
        self,
        upstreams: list[Upstream],
        slots: SlotTable,
        store: SlotStore,
        metrics: ProxyMetrics,
        client: httpx.AsyncClient,
        scope: str = "",
        flight_wait: float = 60.0,
        rates: RestoreRates | None = None,
        *,
        save_every: int = SAVE_EVERY,
        save_idle: float = SAVE_IDLE,
    ) -> None:
        self.scope = scope
        self.flight_wait = flight_wait
        self.save_every, self.save_idle = save_every, save_idle
        self.rates = rates if rates is not None else RestoreRates()
        self.upstreams = upstreams
        self.slots = slots
        self.store = store
        self.metrics = metrics
        self.prompts = KnownPrompts()
        self.client = client
        for upstream in upstreams:
            metrics.upstream_up.labels(upstream.url).set(1)
        self._writes: set[asyncio.Task[Any]] = set()  # store writes: waited for on shutdown
        self._idle_saves: set[asyncio.Task[Any]] = set()  # saves of idle slots, waiting their time: cancelled
        self._watchers: dict[int, asyncio.Task[Any]] = {}  # health polls of down servers: cancelled
        self._flights: set[_Flight] = set()
        self._warned: set[str] = set()  # upstreams already warned about an ineffective restore
        self._said_uncached: set[str] = set()  # paths already logged as passed through uncached
        self._stopping = False  # `warm` makes no more files

    # -- the ASGI entry --------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.drain)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        if request.url.path == "/metrics" and request.method == "GET":
            response: Response = Response(self.metrics.render(), media_type=self.metrics.content_type)
        elif request.method == "POST" and request.url.path in COMPLETION_PATHS:
            response = await self.complete(request, COMPLETION_PATHS[request.url.path])
        elif request.method == "POST" and request.url.path in CONVERTED_PATHS:
            response = await self.converted(request)
        elif request.method == "POST" and request.url.path in UNREAD_PATHS:
            response = await self.unread(request)
        elif (
            request.method == "POST"
            and (slot_path := SLOT_PATH.fullmatch(request.url.path))
            and request.query_params.get("action") in CHANGING_ACTIONS
        ):
            response = await self.slot_action(request, int(slot_path[1]))
        else:
            response = await self.passthrough(request)
        await response(scope, receive, send)

    async def drain(self) -> None:
        """On shutdown: save every slot left unsaved, wait for the store writes still running; stop
        watching down servers and making ready files."""
        self.stop_warming()
        for task in (*self._watchers.values(), *self._idle_saves):
            task.cancel()
        await asyncio.gather(*(self._save_idle_slot(s) for s in self.slots.slots if s.unsaved is not None))
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        self.rates.flush(force=True)

    # -- ready files made ahead ----------------------------------------------------

    async def warm(self) -> int:
        """After the start: make the store's most recently used states of this model (of every
        scope) ready files (`SlotStore.warm`), one at a time, each while no request has a slot,
        until the ready budget is full or the proxy stops. A restarted proxy's follow-up is then
        llama-server's own restore, not a store read and a staging copy on top of it. How many
        were made."""
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

    def stop_warming(self) -> None:
        """`warm` makes no more files (the one being made is finished)."""
        self._stopping = True

    # -- completions -------------------------------------------------------------

    async def complete(self, request: Request, how: str) -> Response:
        body = await request.body()
        payload = _json_object(body)
        if payload is None:
            return await self.passthrough(request, body)  # llama-server's own 400
        return await self._complete(request, body, payload, request.url.path, how)

    async def converted(self, request: Request) -> Response:
        """An Anthropic messages or OpenAI responses request (`CONVERTED_PATHS`): converted to the chat
        llama-server would make of it, run as a chat (a slot, the best stored prefix, ``id_slot``),
        and its answer turned back into the API's. One the proxy cannot convert exactly passes through
        uncached (`unread`), counted with the reason."""
        body = await request.body()
        path, payload = request.url.path, _json_object(body)
        convert, translator = CONVERTED_PATHS[path]
        try:
            if payload is None:
                raise Unconvertible("invalid", "not a JSON object")
            chat = convert(payload)
        except Unconvertible as exc:
            self.metrics.unconverted.labels(path, exc.reason).inc()
            log.debug("sippcache proxy: a %s request passes through uncached: %s", path, exc)
            return await self.unread(request, body)
        model = payload.get("model")
        return await self._complete(request, body, chat, CHAT_PATH, "chat", translator(str(model or "")))

    async def _complete(
        self,
        request: Request,
        body: bytes,
        payload: dict[str, Any],
        path: str,
        how: str,
        translator: Translator | None = None,
    ) -> Response:
        """Run `payload` at llama-server's `path` in a slot (module docstring); `translator` turns the
        answer into the API `request` came in (a converted request: `converted`)."""

        async def as_is() -> Response:  # a request llama-server rejects: its own answer, as it is
            return await (self.passthrough(request, body) if translator is None else self.unread(request, body))

        try:
            tokens = await self._prompt_tokens(how, payload)
        except UpstreamRefused:
            return await as_is()
        except (UpstreamDown, NoServer):
            return _unavailable("no llama-server is reachable")
        scope = request.headers.get(SCOPE_HEADER, self.scope)
        cached = payload.get("cache_prompt", True) is not False
        flight = await self._take_off(tokens, scope) if cached and tokens and self.store.can_cut else None
        try:
            slot, held = await self.slots.acquire(tokens or (), scope)
        except (QueueFull, NoServer) as exc:
            self._land(flight)
            full = isinstance(exc, QueueFull)
            return _unavailable("every slot is busy and the queue is full" if full else "no llama-server is reachable")
        except BaseException:
            self._land(flight)
            raise
        upstream = self.upstreams[slot.server]
        restore: _Restore | None = None
        try:
            keeps = common_prefix(slot.tokens, tokens or ()) if slot.scope == scope else 0
            if slot.unsaved is not None and keeps < len(slot.tokens):  # it changes hands: its state is saved first
                await self._save_slot(slot, slot.unsaved, "leave")
            if slot.scope != scope and (slot.tokens or slot.unknown):  # another tenant's: never reused, erased
                await upstream.slot_action(slot.id, "erase")
                slot.unknown = False
            slot.tokens, slot.scope = (slot.tokens if slot.scope == scope else ()), scope
            slot.stored = min(slot.stored, keeps)
            if tokens and cached:
                restore = await self._restore(upstream, slot, tokens, held)
            fanned = isinstance(payload.get("n"), int) and payload["n"] > 1  # child tasks run in other slots
            if fanned:
                await self._save_idle_slots(slot.server)
            payload["id_slot"] = slot.id
            if tokens and _ids_for_text(path, how, upstream):
                payload["prompt"] = tokens  # the ids it made of the text: not tokenized a second time
            stream = bool(payload.get("stream"))
            if stream and not payload.get("timings_per_token"):
                payload["timings_per_token"] = True  # cache_n in the first event, for the header
                strip = True
            else:
                strip = False
            upstream_request = self.client.build_request(
                "POST", upstream.url + path, headers=forwarded(request.headers), json=payload, timeout=None
            )
            answer = await self.client.send(upstream_request, stream=True)
        except (UpstreamDown, httpx.TransportError) as exc:  # a slot call, or the request itself
            self._land(flight)
            await self._lost(slot, exc)
            return _unavailable(f"llama-server at {upstream.url} is not reachable")
        except BaseException:
            self._land(flight)
            await self.slots.release(slot)
            raise

        async def done(relay: Relay) -> None:
            if fanned:  # while this request's own slot is still busy: its belief is kept
                await self.slots.forget_idle(slot.server)
            await self._finish(slot, how, relay, tokens, flight, restore)

        return RelayResponse(answer, stream, strip, done, translator=translator)

    async def _prompt_tokens(self, how: str, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's tokens as llama-server will see them; None for a request that has no single prompt."""
        upstream = self._any_upstream()
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

    async def _take_off(self, tokens: list[int], scope: str) -> _Flight:
        """Wait while a request in flight computes at least `MIN_FLIGHT_LEAD` tokens of this prompt
        beyond what the store and the idle slots hold (its state is stored when it ends), or stores
        a state giving at least `MIN_GAIN` more (`_Flight.min_lead`), at most `flight_wait` seconds
        in all; then this request is in flight itself."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.flight_wait
        while self.flight_wait > 0:
            lead, leader = max(
                ((common_prefix(f.tokens, tokens), f) for f in self._flights if f.scope == scope),
                key=lambda pair: (pair[0], pair[1].writing),  # of two as long, the one that lands sooner
                default=(0, None),
            )
            if leader is None or lead < leader.min_lead():
                break
            held = max(await asyncio.to_thread(self.store.best_length, tokens, scope), self.slots.held(tokens, scope))
            if leader.landed.is_set():
                continue  # it landed meanwhile: look again
            gain = lead - held
            if gain < leader.min_lead() or loop.time() >= deadline or not self._would_restore(leader, gain):
                break
            self.metrics.flight_waits.inc()
            leader.waiting += 1
            try:
                await asyncio.wait_for(leader.landed.wait(), deadline - loop.time())
            except TimeoutError:
                break
            finally:
                leader.waiting -= 1
        flight = _Flight(scope, tokens, asyncio.Event())
        self._flights.add(flight)
        return flight

    def _would_restore(self, leader: _Flight, gain: int) -> bool:
        """Whether a state of the leader's length, giving `gain` tokens, would be restored on some
        reachable upstream: waiting for a state that will not be restored only adds latency."""
        return any(
            self.rates.estimate(u.url, tokens=gain, nbytes=self.rates.size_of(u.url, len(leader.tokens))).restore
            for server, u in enumerate(self.upstreams)
            if server not in self.slots.down
        )

    def _land(self, flight: _Flight | None) -> None:
        """A request's state is stored (or will not be): requests waiting for it look again."""
        if flight is not None:
            self._flights.discard(flight)
            flight.landed.set()

    def _any_upstream(self) -> Upstream:
        for server, upstream in enumerate(self.upstreams):
            if server not in self.slots.down:
                return upstream
        raise NoServer

    async def _restore(self, upstream: Upstream, slot: Slot, tokens: list[int], held: int) -> _Restore | None:
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
    ) -> _Restore | None:
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
        return _Restore(restored, promised)

    def _learn(self, url: str, timings: dict[str, Any], restore: _Restore | None) -> None:
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

    async def _finish(
        self,
        slot: Slot,
        how: str,
        relay: Relay,
        tokens: list[int] | None,
        flight: _Flight | None,
        restore: _Restore | None = None,
    ) -> None:
        """After the response: count what llama-server reported, save the slot now or leave its state
        there unsaved, free it; then the requests waiting for this one's state look again."""
        try:
            stored = await self._after(slot, how, relay, tokens, flight, restore)
        except BaseException:
            self._land(flight)
            raise
        if stored is None:
            self._land(flight)
        else:
            if flight is not None:
                flight.writing = True
            stored.add_done_callback(lambda _: self._land(flight))

    async def _after(
        self,
        slot: Slot,
        how: str,
        relay: Relay,
        tokens: list[int] | None,
        flight: _Flight | None,
        restore: _Restore | None,
    ) -> asyncio.Task[Any] | None:
        """Count, learn the rates, save the slot if it is to be saved now, and free it; the task
        storing its state, if any."""
        upstream = self.upstreams[slot.server]
        timings = relay.timings
        self.metrics.requests.labels(upstream.url, how, "ok" if relay.complete else "incomplete").inc()
        self._learn(upstream.url, timings, restore)
        self.rates.flush()  # kept for the next proxy at this place (at most every KEEP_EVERY seconds)
        prompt = len(tokens or ())
        if "cache_n" in timings:
            self.metrics.prompt_tokens.labels(upstream.url, "reused").inc(int(timings["cache_n"]))
            self.metrics.prompt_tokens.labels(upstream.url, "computed").inc(int(timings.get("prompt_n", 0)))
        if "prompt_n" in timings:  # llama-server's own count of the prompt
            prompt = int(timings["prompt_n"]) + int(timings.get("cache_n", 0))
        if relay.lost:
            await self._lost(slot, ConnectionError("the connection broke during a response"))
            return None
        if not relay.complete:  # cut short, the slot holds what nobody asked for: not stored
            slot.forget()
            await self.slots.release(slot)
            return None
        slot.tokens = tuple(tokens or ())  # what it holds begins so; the answer's tokens are not known here
        slot.unknown = False
        reason = self._save_now(slot, flight, held=prompt + int(timings.get("predicted_n", 0)))
        task = None
        try:
            if reason is None:
                slot.unsaved = prompt
            else:
                task = await self._save_slot(slot, prompt, reason)
        except UpstreamDown as exc:
            await self._lost(slot, exc)
            return None
        await self.slots.release(slot)
        if slot.unsaved is not None:
            self._save_when_idle(slot)
        return task

    def _save_now(self, slot: Slot, flight: _Flight | None, held: int) -> str | None:
        """Why a slot that holds `held` tokens after an answer is saved at once, or None: it waits in
        the slot (module docstring)."""
        if flight is not None and flight.waiting:
            return "waited"
        if slot.stored < self.store.min_tokens:
            return "new"
        if not self.store.can_cut:  # extended only at exactly its length: every answer's end is kept
            return "recurrent"
        if held - slot.stored >= self.save_every:
            return "grown"
        return None

    async def _save_slot(self, slot: Slot, prompt: int, reason: str) -> asyncio.Task[Any] | None:
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

    def _save_when_idle(self, slot: Slot) -> None:
        """Save `slot` after `save_idle` seconds, unless a request used it meanwhile."""
        used = slot.used

        async def later() -> None:
            await asyncio.sleep(self.save_idle)
            if slot.used == used:
                await self._save_idle_slot(slot, "idle")

        task = asyncio.create_task(later())
        self._idle_saves.add(task)
        task.add_done_callback(self._idle_saves.discard)

    async def _save_idle_slots(self, server: int) -> None:
        """Save the idle slots of upstream `server` left unsaved: a request is about to run where
        llama-server may overwrite any of them (`unread`, a request for several choices)."""
        unsaved = [s for s in self.slots.slots if s.server == server and s.unsaved is not None]
        await asyncio.gather(*(self._save_idle_slot(s, "leave") for s in unsaved))

    async def _save_idle_slot(self, slot: Slot, reason: str = "shutdown") -> None:
        """Save an idle slot left unsaved (busy, or saved meanwhile: nothing to do)."""
        if slot.unsaved is None or not await self.slots.take(slot):
            return
        try:
            if slot.unsaved is not None:
                await self._save_slot(slot, slot.unsaved, reason)
        except UpstreamDown as exc:
            await self._lost(slot, exc)
            return
        await self.slots.release(slot)

    async def _keep(self, url: str, snapshot: Snapshot, supersedes: Origin | None, scope: str) -> None:
        saved = await asyncio.to_thread(self.store.keep, snapshot, supersedes, scope)
        if saved is not None:
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

    async def _lost(self, slot: Slot, exc: BaseException) -> None:
        log.warning("sippcache proxy: %s is down: %s", self.upstreams[slot.server].url, exc)
        await self.slots.set_down(slot.server, True)
        await self.slots.release(slot)
        self._watch(slot.server)

    def _watch(self, server: int) -> None:
        """Poll a down server's health until it answers again; then it serves (empty) again."""

        async def watch() -> None:
            while not await self.upstreams[server].healthy():
                await asyncio.sleep(0.5)
            await self.slots.set_down(server, False)
            self.metrics.upstream_up.labels(self.upstreams[server].url).set(1)
            del self._watchers[server]

        if server not in self._watchers:
            self.metrics.upstream_up.labels(self.upstreams[server].url).set(0)
            self._watchers[server] = asyncio.create_task(watch())

    # -- a client's slot actions ------------------------------------------------------

    async def slot_action(self, request: Request, slot_id: int) -> Response:
        """A client's erase or restore of a slot (`CHANGING_ACTIONS`), sent to the llama-server a
        passthrough would reach. The proxy takes the slot as a request would (waiting while one has
        it), saves what it holds unsaved (its conversation leaves it), lets llama-server act, and
        then believes the slot holds nothing: its next request is restored as after a restart, not
        sent to llama-server as if the state it believed were still there (a whole recompute)."""
        try:
            upstream = self._any_upstream()
        except NoServer:
            return _unavailable("no llama-server is reachable")
        slot = self.slots.find(self.upstreams.index(upstream), slot_id)
        if slot is None:
            return await self.passthrough(request)  # llama-server's own answer to a slot it has not
        body = await request.body()
        if not await self.slots.take(slot, wait=True):
            return _unavailable(f"llama-server at {upstream.url} is not reachable")
        url = f"{upstream.url}{request.url.path}?{request.url.query}"
        try:
            if slot.unsaved is not None:
                await self._save_slot(slot, slot.unsaved, "leave")
            answer = await self.client.post(url, headers=forwarded(request.headers), content=body, timeout=None)
        except (UpstreamDown, httpx.TransportError) as exc:
            await self._lost(slot, exc)
            return _unavailable(f"llama-server at {upstream.url} is not reachable")
        except BaseException:
            slot.forget()
            await self.slots.release(slot)
            raise
        slot.forget(empty=answer.is_success and request.query_params["action"] == "erase")
        await self.slots.release(slot)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP | {"content-encoding"}}
        return Response(answer.content, answer.status_code, headers=headers)

    # -- everything else ------------------------------------------------------------

    async def unread(self, request: Request, body: bytes | None = None) -> Response:
        """A request llama-server runs in a slot of its own choosing, whose prompt the proxy does not
        read (`UNREAD_PATHS`), passed through and not cached. It may take any idle slot of that
        llama-server, so the idle slots there holding a state not stored yet are saved first, and
        afterwards every idle slot there is believed to hold a state the proxy does not know: a
        conversation's next turn is restored, not sent as if its state were still in the slot (a
        whole recompute), and another tenant's request erases the slot first."""
        try:
            upstream = self._any_upstream()
        except NoServer:
            return _unavailable("no llama-server is reachable")
        server, path = self.upstreams.index(upstream), request.url.path
        self.metrics.uncached.labels(upstream.url, path).inc()
        if path not in self._said_uncached:  # once a path: a client of these APIs gains nothing from the proxy
            self._said_uncached.add(path)
            log.warning(
                "sippcache proxy: %s requests pass through to llama-server uncached (the proxy does not read "
                "their prompts; docs/proxy.md)",
                path,
            )
        await self._save_idle_slots(server)

        async def done(_: Relay) -> None:
            await self.slots.forget_idle(server)

        return await self.passthrough(request, body, upstream=upstream, done=done)

    async def passthrough(
        self,
        request: Request,
        body: bytes | None = None,
        *,
        upstream: Upstream | None = None,
        done: Callable[[Relay], Awaitable[None]] | None = None,
    ) -> Response:
        """Forward a request as it is to a reachable llama-server (`upstream`, if given) and relay its
        answer as it is; then `done`, if given, however the relay ends."""
        if upstream is None:
            try:
                upstream = self._any_upstream()
            except NoServer:
                return _unavailable("no llama-server is reachable")
        url = upstream.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        content = body if body is not None else await request.body()
        outgoing = self.client.build_request(
            request.method, url, headers=forwarded(request.headers), content=content, timeout=None
        )
        try:
            answer = await self.client.send(outgoing, stream=True)
        except httpx.TransportError:
            return _unavailable(f"llama-server at {upstream.url} is not reachable")
        return RelayResponse(answer, stream=True, strip=False, done=done, as_is=True)


def _json_object(body: bytes) -> dict[str, Any] | None:
    """A request body's JSON object, or None (not JSON, or not an object)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _token_ids(prompt: Any) -> list[int] | None:
    """A completion's prompt given as token ids (a non-empty JSON list of ints, no bools), else
    None. Checked in C (`map(type, ...)`): 1.4 ms for a 32K-token prompt, 5.2 ms as a Python step
    per id."""
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        return list(prompt)
    return None


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.4g}"


def _ids_for_text(path: str, how: str, upstream: Upstream) -> bool:
    """Whether a completion's prompt goes to llama-server as the token ids the proxy had it make
    (`_prompt_tokens`; the same ids, it tokenizes a text prompt with the same flags): it would
    tokenize the text again, in its time to first token (at 29.5K tokens of gemma-3 that added
    132 ms: benchmarks/prompt_ids.py). Not for a chat (no token-id form), nor for
    /v1/completions on a server with a projector (it reads that prompt as text)."""
    return how == "completion" and (path == "/completion" or not upstream.multimodal)


def _unavailable(message: str) -> Response:
    return JSONResponse(
        {"error": {"code": 503, "message": message, "type": "unavailable_error"}},
        status_code=503,
        headers={"Retry-After": RETRY_AFTER},
    )


async def _lifespan(receive: Receive, send: Send, drain: Callable[[], Awaitable[None]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await drain()
            await send({"type": "lifespan.shutdown.complete"})
            return
