"""The FastAPI app: upstream's (`llama_cpp.server.app.create_app`), with sippcache's caches,
the door every request comes in by (`sippcache.server.door`), the gate in place of
upstream's lock when a model runs ``--parallel``, and two read-only endpoints,
``GET /metrics`` (Prometheus text) and ``GET /v1/cache/stats`` (the same as JSON)."""

from __future__ import annotations

from typing import Any

from llama_cpp.server.settings import ModelSettings, ServerSettings

from .door import Door
from .metrics import CONTENT_TYPE_LATEST
from .stores import CachePool
from .upstream import Gate, install, install_gate, upstream_app

__all__ = ["create_server_app"]


def create_server_app(server_settings: ServerSettings, model_settings: list[ModelSettings], pool: CachePool) -> Any:
    """Upstream's FastAPI app (`create_app`), with sippcache's caches and metrics endpoints."""
    from fastapi import Depends
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool

    install(pool)
    install_gate(Gate(pool.admission, pool.runs_parallel, pool.interrupted) if pool.parallel else None)
    app = upstream_app.create_app(server_settings=server_settings, model_settings=model_settings)
    app.add_middleware(Door, admission=pool.admission)
    auth = [Depends(upstream_app.authenticate)]  # the API key, when one is set, as on upstream's endpoints

    # No return annotations: with postponed annotations FastAPI would try to resolve them for the schema.
    async def metrics():  # type: ignore[no-untyped-def]
        return Response(await run_in_threadpool(pool.metrics.render), media_type=CONTENT_TYPE_LATEST)

    async def cache_stats():  # type: ignore[no-untyped-def]
        return JSONResponse(await run_in_threadpool(pool.metrics.as_json))

    app.add_api_route(
        "/metrics", metrics, methods=["GET"], dependencies=auth, include_in_schema=False, response_model=None
    )
    app.add_api_route(
        "/v1/cache/stats",
        cache_stats,
        methods=["GET"],
        dependencies=auth,
        response_model=None,
        summary="Cache stats",
        tags=["sippcache"],
    )
    return app
