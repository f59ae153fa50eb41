"""`sippcache serve` / ``python -m sippcache.server``: parse, open the stores, run uvicorn."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from .app import create_server_app
from .settings import UPSTREAM_CACHE_SETTINGS, ServeError, build_parser, load_settings
from .stores import CachePool

__all__ = ["SHUTDOWN_SECONDS", "main"]

#: How long a stopping server lets the requests in progress run before it ends them.
SHUTDOWN_SECONDS = 30


def _fail(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


class _Stopped(Exception):
    """SIGTERM, as uvicorn raises it again once it has shut down."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the server until it is stopped (SIGINT/SIGTERM); pending cache writes are flushed on the way out."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args)
        os.environ.pop("CONFIG_FILE", None)  # read above; create_app would read it again, without our keys
        pool = CachePool.open(settings, args.cache_url)
    except ServeError as exc:
        _fail(str(exc))
    server_settings, model_settings = settings.server, settings.models
    for note in settings.notes:
        print(f"sippcache serve: {note}", file=sys.stderr)
    ignored = sorted({name for s in model_settings for name in UPSTREAM_CACHE_SETTINGS if name in s.model_fields_set})
    if ignored:
        print(
            f"sippcache serve: ignoring llama-cpp-python's own cache settings ({', '.join(ignored)}): "
            "the cache is sippcache's (--cache URL)",
            file=sys.stderr,
        )
    try:
        try:
            app = create_server_app(server_settings, model_settings, pool)
        except Exception as exc:  # the model cannot be loaded: upstream's own errors, in one line
            _fail(f"cannot start the server: {type(exc).__name__}: {exc}")
        import uvicorn
        from sse_starlette.sse import AppStatus

        # SIGTERM/SIGINT: stop accepting, let the requests in progress finish (streams too:
        # sse-starlette would cut them at once), for at most SHUTDOWN_SECONDS; then what
        # still runs ends and every slot is parked in the store (pool.close()).
        AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]
        # uvicorn raises the signal that stopped it again after shutting down: for SIGTERM
        # that would end the process before the stores are flushed (pool.close() below).
        signal.signal(signal.SIGTERM, _stopped)
        uvicorn.run(
            app,
            host=os.getenv("HOST", server_settings.host),
            port=int(os.getenv("PORT", server_settings.port)),
            ssl_keyfile=server_settings.ssl_keyfile,
            ssl_certfile=server_settings.ssl_certfile,
            timeout_graceful_shutdown=SHUTDOWN_SECONDS,
        )
    except _Stopped:
        pass
    finally:
        pool.close()
    return 0
