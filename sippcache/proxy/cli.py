"""`sippcache proxy`: start (or attach to) llama-server, check it, and serve the proxy with uvicorn.

Two ways to start:

- managed: ``--llama-server PATH --model M.gguf [--parallel N] [-- ARGS]`` starts
  llama-server on loopback with every flag the proxy needs and stops it on exit;
- attach: ``--upstream URL`` (repeatable) ``--slot-dir DIR`` for servers already
  running with ``--slot-save-path DIR``; each is checked at start (for a
  sliding-window model, that it extends a restored state: ``--swa-full``), and
  the proxy refuses to start with one line that names what is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

import httpx
from prometheus_client import Gauge

from .. import frame, registry
from ..engine.directory import free_bytes
from ..flags import check_flags
from ..protocol import CacheBackend
from ..state.modelfile import read_model_facts
from ..state.rates import RestoreRates, mode_from_environment, rates_file
from .app import Proxy
from .launch import (
    Managed,
    ProxyError,
    check_extends_restores,
    connect,
    fingerprint,
    start_llama_server,
    stop_llama_server,
)
from .metrics import ProxyMetrics
from .settings import build_parser, proxy_flags
from .slots import SlotTable
from .staging import (
    kept_dir,
    made_ahead,
    note_pages,
    ready_budget,
    staging_base,
    staging_dir,
    warn_if_cramped,
)
from .store import SlotStore

log = logging.getLogger("sippcache.proxy")

__all__ = ["main"]


class _Stopped(Exception):
    """SIGTERM, as uvicorn raises it again once it has shut down."""


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped


def _fail(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the proxy until SIGINT/SIGTERM; a managed llama-server is stopped with it."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per call to llama-server
    if bool(args.llama_server) == bool(args.upstream):
        _fail("give either --llama-server PATH --model M (managed) or --upstream URL --slot-dir DIR (attach)")
    if args.upstream and not args.slot_dir:
        _fail("--upstream needs --slot-dir: the directory the servers were started with as --slot-save-path")
    if args.llama_server and not args.model:
        _fail("--llama-server needs --model")
    if args.staging_dir and not args.llama_server:
        _fail("--staging-dir is for a managed llama-server; attached ones save where --slot-dir says")
    if args.staging_dir and not (os.path.isdir(args.staging_dir) and os.access(args.staging_dir, os.W_OK | os.X_OK)):
        _fail(f"--staging-dir {args.staging_dir} is not a folder this user can write in")
    if problem := check_flags(args, proxy_flags()):
        _fail(problem)
    try:
        args.restore = args.restore or mode_from_environment()
    except ValueError as exc:
        _fail(str(exc))
    managed: Managed | None = None
    if args.llama_server:
        base = staging_base() if args.staging_dir is None else os.path.abspath(args.staging_dir)
        staging = staging_dir(base)
    else:
        staging = os.path.abspath(args.slot_dir)
    if args.ready_keep:
        try:
            args.keep_ready_in = kept_dir(base) if args.llama_server else staging
        except OSError as exc:
            _fail(str(exc))
    else:
        args.keep_ready_in = None
    if args.ready_bytes is None:
        args.ready_bytes = ready_budget(free_bytes(staging) or 0)
    warn_if_cramped(staging)
    note_pages(staging)
    try:
        cache = registry.open(args.cache)
    except Exception as exc:
        _fail(f"cannot open the store: {exc}")
    try:
        if args.llama_server:
            managed = start_llama_server(
                args.llama_server, args.model, args.parallel, staging, args.server_args, args.port
            )
            urls = [managed.url]
        else:
            urls = args.upstream
        # uvicorn raises the signal that stopped it again after shutting down: for SIGTERM that
        # would end the process before the managed llama-server is stopped and staging removed.
        signal.signal(signal.SIGTERM, _stopped)
        asyncio.run(_serve(args, urls, staging, cache, managed))
    except (_Stopped, KeyboardInterrupt):  # uvicorn has shut down; stop llama-server below
        pass
    except ProxyError as exc:
        _fail(str(exc))
    finally:
        if managed is not None:
            stop_llama_server(managed)
            shutil.rmtree(staging, ignore_errors=True)
        cache.close()
    return 0


async def _index_then_warm(store: SlotStore, proxy: Proxy | None) -> None:
    """Read the store's index (`SlotStore.load_index`), then make ready files (`Warmer.run`)."""
    await asyncio.to_thread(store.load_index)
    if proxy is not None:
        await proxy.warmer.run()


async def _serve(
    args: argparse.Namespace, urls: Sequence[str], staging: str, cache: CacheBackend, managed: Managed | None
) -> None:
    import uvicorn

    # No kept-alive connections: llama-server may close one after a streamed answer, and a request
    # sent on it would fail as if the server were down. A loopback connect costs a fraction of a ms.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None), limits=limits) as client:
        upstreams, infos = await connect(urls, staging, args.api_key, client)
        model_path = args.model or infos[0].model_path
        facts = read_model_facts(model_path) if model_path and os.path.isfile(model_path) else None
        if facts and facts.kind == "swa" and managed is None:
            for upstream, info in zip(upstreams, infos, strict=True):
                if not info.n_ctx or info.n_ctx > facts.n_swa + 64:  # a window shorter than a slot
                    await check_extends_restores(upstream, staging, facts.n_swa, info.n_ctx)
        digest, described = fingerprint(infos[0], facts)
        store = SlotStore(
            cache,
            fingerprint=digest,
            facts=described,
            kind=facts.kind if facts else "full",
            staging=staging,
            min_tokens=args.min_tokens,
            secret=frame.secret_from_environment(),
            chunk_tokens=args.chunk_tokens,
            ready_bytes=args.ready_bytes,
            keep_ready_in=args.keep_ready_in,
        )
        metrics = ProxyMetrics()
        metrics.store_errors.set_function(lambda: store.errors)
        metrics.ready_files.set_function(lambda: len(store.ready))
        metrics.ready_bytes.set_function(lambda: store.ready.nbytes)
        Gauge(
            "sippcache_proxy_states_stored_whole",
            "Slot states stored as one whole entry although chunking is on: states sippcache.state could not cut.",
            registry=metrics.registry,
        ).set_function(lambda: store.stored_whole)
        proxy = Proxy(
            upstreams,
            SlotTable([i.slots for i in infos], args.max_queue, store.can_cut),
            store,
            metrics,
            client,
            args.scope,
            args.flight_wait,
            RestoreRates(args.restore),
            save_every=args.save_every,
            save_idle=args.save_idle,
        )
        if args.rates_dir:
            for upstream in upstreams:
                place = upstream.url
                if managed is not None:  # its URL is a new port each start: named by what it runs instead
                    place = "managed\n" + "\n".join([args.llama_server, args.model, *args.server_args])
                path = rates_file(args.rates_dir, digest, place)
                loaded = proxy.rates.keep(upstream.url, path)
                log.info("restore rates of %s kept in %s (%d samples from before)", upstream.url, path, loaded)
        wanted = [
            (upstream.url, slot, largest)
            for upstream, info in zip(upstreams, infos, strict=True)
            if (largest := proxy.rates.largest_state(upstream.url))
            for slot in range(info.slots)
        ]
        ahead = made_ahead(wanted, free_bytes(staging) or 0)
        if len(ahead) < len(wanted):
            log.info(
                "sippcache proxy: staging files made ahead for %d of %d slots (at most half of %s's room)",
                len(ahead),
                len(wanted),
                staging,
            )
        # In the background: the store's index, and each slot's staging file for the largest state seen there.
        # Then, with --warm-ready, ready files of the states used last.
        preparing = [asyncio.create_task(_index_then_warm(store, proxy if args.ready_warm else None))]
        preparing += [asyncio.create_task(asyncio.to_thread(store.prepare, url, *made)) for url, *made in ahead]
        config = uvicorn.Config(proxy, host=args.host, port=args.port, log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        print(
            f"sippcache proxy: http://{args.host}:{args.port} -> {', '.join(urls)} "
            f"({sum(i.slots for i in infos)} slots, {store.kind} memory, "
            f"{f'chunks of {store.chunk_tokens} tokens' if store.chunk_tokens else 'whole states'}, "
            f"cache {getattr(cache, 'location', type(cache).__name__)})",
            file=sys.stderr,
            flush=True,
        )
        try:
            await server.serve()
        finally:
            # uvicorn raises SIGINT again once it has shut down, and asyncio.run cancels this task for
            # it: the files are still closed (restore files removed, ready files removed or kept).
            try:
                proxy.warmer.stop()
                await asyncio.gather(*preparing)
            finally:
                store.close()  # an attached server's --slot-save-path stays
