"""sippcache-redis: a sippcache backend on Redis or Valkey (one server or a cluster).

Installed, it registers the URL schemes ``redis://`` and ``rediss://`` (TLS)
through the ``sippcache.backends`` entry point group; nothing else refers to
it. Open it like any other store::

    import sippcache
    cache = sippcache.open("redis://cache.internal:6379/0?prefix=prod&max_bytes=20GiB")

See docs/redis.md in the sippcache repository (or this package's README).
"""

from __future__ import annotations

from .backend import AccessDenied, RedisBackend, RedisTLSBackend
from .url import RedisAddress, parse_location

__version__ = "0.1.0"

__all__ = ["AccessDenied", "RedisAddress", "RedisBackend", "RedisTLSBackend", "parse_location"]
