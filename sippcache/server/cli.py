"""`sippcache serve` / ``python -m sippcache.server``: parse, open the stores, run uvicorn."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .app import create_server_app
from .settings import UPSTREAM_CACHE_SETTINGS, ServeError, build_parser, load_settings
from .stores import CachePool

__all__ = ["main"]


def _fail(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


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
    ignored = sorted({name for s in model_settings for name in UPSTREAM_CACHE_SETTINGS if name in s.model_fields_set})
    if ignored:
        print(f"sippcache serve: ignoring llama-cpp-python's own cache settings ({', '.join(ignored)}): "
              "the cache is sippcache's (--cache URL)", file=sys.stderr)  # fmt: skip
    try:
        try:
            app = create_server_app(server_settings, model_settings, pool)
        except Exception as exc:  # the model cannot be loaded: upstream's own errors, in one line
            _fail(f"cannot start the server: {type(exc).__name__}: {exc}")
        import uvicorn

        uvicorn.run(
            app,
            host=os.getenv("HOST", server_settings.host),
            port=int(os.getenv("PORT", server_settings.port)),
            ssl_keyfile=server_settings.ssl_keyfile,
            ssl_certfile=server_settings.ssl_certfile,
        )
    finally:
        pool.close()
    return 0
