"""The one place that relies on llama-cpp-python's server internals.

`CachingLlamaProxy` and `install` use: ``LlamaProxy.load_llama_from_model_settings``
(a static method, called through ``self``, the only place upstream creates
caches), ``LlamaProxy.__call__`` (how an endpoint gets the model for a
request), ``llama_cpp.server.app.LlamaProxy`` (the name `create_app`
instantiates), the settings fields ``cache``, ``model_alias`` and
``vocab_only``, and, when a model runs ``--parallel``, the module globals
``llama_outer_lock`` and ``llama_inner_lock``, which upstream's
``get_llama_proxy`` takes around every request and its stream publisher
reads to interrupt a stream. `tests/test_serve_upstream.py` fails, naming the
symbol, if a llama-cpp-python upgrade moves any of them.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import llama_cpp
import llama_cpp.server.app as upstream_app
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings

from .door import CURRENT, Admission, RequestContext
from .stores import CachePool

__all__ = ["CachingLlamaProxy", "Gate", "LlamaProxy", "install", "install_gate", "upstream_app"]


class CachingLlamaProxy(LlamaProxy):
    """Upstream's `LlamaProxy` (one model loaded at a time, swapped by alias) whose
    loader attaches sippcache: it calls upstream's with ``cache=False`` (so no
    LlamaRAMCache/LlamaDiskCache is made), then gives the model its sippcache
    cache and, with ``--parallel``, its scheduler. A request then gets a
    `llama_cpp.Llama` of its own from the scheduler (`__call__`)."""

    pool: ClassVar[CachePool | None] = None  # set by `install`

    @classmethod
    def load_llama_from_model_settings(cls, settings: ModelSettings) -> llama_cpp.Llama:
        model = LlamaProxy.load_llama_from_model_settings(settings.model_copy(update={"cache": False}))
        if cls.pool is None:
            return model
        return cls.pool.attach(model, settings)

    def __call__(self, model: str | None = None) -> llama_cpp.Llama:
        loaded = super().__call__(model)
        if self.pool is None:
            return loaded
        return self.pool.for_request(loaded)


def install(pool: CachePool) -> None:
    """Make `llama_cpp.server.app.create_app` build a `CachingLlamaProxy` using `pool`."""
    CachingLlamaProxy.pool = pool
    upstream_app.LlamaProxy = CachingLlamaProxy  # type: ignore[attr-defined]  # app.py imports it, not re-exported


# -- who may use the proxy at once ----------------------------------------------------------


@dataclass(eq=False)
class _Grant:
    alias: str
    exclusive: bool
    request: RequestContext | None


@dataclass(eq=False)
class _Waiter:
    alias: str
    exclusive: bool
    request: RequestContext | None
    future: asyncio.Future[None]
    grant: _Grant | None = field(default=None)  # taken for it by `Gate.leave`


_GRANT: contextvars.ContextVar[_Grant | None] = contextvars.ContextVar("sippcache_grant", default=None)


class Gate:
    """Takes the place of upstream's two locks when a model runs ``--parallel``.

    Upstream holds one lock around every request, so one request runs at a time,
    and swaps models (an alias other than the loaded one) under it. The gate lets
    any number of requests for the loaded model in at once when that model runs
    ``--parallel`` (its scheduler then bounds what runs), one at a time for a
    model that does not, and a request for another model in alone, once the
    others are out, so the swap happens with no request using the old model.
    Waiting requests go in the order they came. `inner` and `outer` are what
    upstream's ``get_llama_proxy`` acquires and releases; ``outer.locked()`` is
    what upstream's stream publisher asks, with ``interrupt_requests``, to end a
    stream another request is waiting behind: for every request waiting for a
    slot of a model, its scheduler picks the oldest running request of that
    model to end; a request waiting at the gate for another model ends them all.
    """

    def __init__(
        self,
        admission: Admission,
        parallel: Callable[[str], bool],
        interrupted: Callable[[str, RequestContext], bool],
    ) -> None:
        self._admission = admission
        self._parallel = parallel
        self._interrupted = interrupted
        self._inside: list[_Grant] = []  # in the order they came in
        self._waiters: deque[_Waiter] = deque()
        self.inner = _Inner(self)
        self.outer = _Outer(self)

    async def enter(self) -> None:
        request = CURRENT.get()
        alias = self._admission.resolve(request.model if request is not None else None)
        exclusive = not self._parallel(alias)
        if not self._waiters and self._may_enter(alias, exclusive):
            grant = _Grant(alias, exclusive, request)
            self._inside.append(grant)
            _GRANT.set(grant)
            return
        waiter = _Waiter(alias, exclusive, request, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if waiter.grant is not None:  # let in just as it was cancelled: give its place back
                self._inside.remove(waiter.grant)
                self._let_in()
            raise
        _GRANT.set(waiter.grant)

    def leave(self) -> None:
        grant = _GRANT.get()
        if grant is not None and grant in self._inside:
            self._inside.remove(grant)
            _GRANT.set(None)
        self._let_in()

    def _let_in(self) -> None:
        """Let the waiters in, in order, while the first one may enter."""
        while self._waiters and self._may_enter(self._waiters[0].alias, self._waiters[0].exclusive):
            waiter = self._waiters.popleft()
            waiter.grant = _Grant(waiter.alias, waiter.exclusive, waiter.request)
            self._inside.append(waiter.grant)
            waiter.future.set_result(None)

    def _may_enter(self, alias: str, exclusive: bool) -> bool:
        if not self._inside:
            return True
        return not exclusive and all(not g.exclusive and g.alias == alias for g in self._inside)

    def should_interrupt(self) -> bool:
        """Whether the current request's stream should end for one that waits (see the class)."""
        request = CURRENT.get()
        mine = next((g for g in self._inside if g.request is request and request is not None), None)
        if mine is None:
            return bool(self._waiters)
        if any(w.alias != mine.alias or w.exclusive for w in self._waiters):
            return True  # a request for another model (or one at a time) waits for everyone to leave
        return request is not None and self._interrupted(mine.alias, request)


class _Inner:
    """Upstream's ``llama_inner_lock``, as the gate."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    async def acquire(self) -> None:
        await self._gate.enter()

    def release(self) -> None:
        self._gate.leave()


class _Outer:
    """Upstream's ``llama_outer_lock``: nothing to wait for; `locked` asks whether to interrupt."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    async def acquire(self) -> None:
        return None

    def release(self) -> None:
        return None

    def locked(self) -> bool:
        return self._gate.should_interrupt()


_UPSTREAM_LOCKS = (upstream_app.llama_outer_lock, upstream_app.llama_inner_lock)


def install_gate(gate: Gate | None) -> None:
    """Put `gate` in place of upstream's two module-level locks (None: upstream's own)."""
    outer, inner = (gate.outer, gate.inner) if gate is not None else _UPSTREAM_LOCKS
    upstream_app.llama_outer_lock = outer  # type: ignore[assignment]
    upstream_app.llama_inner_lock = inner  # type: ignore[assignment]
