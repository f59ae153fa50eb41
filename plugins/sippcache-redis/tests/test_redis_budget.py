"""The budget is saved with the store on the server, as with the built-in backends
(tests/test_budgets.py): handles opened without limits go by it, a URL's limits change it,
handles given limits keep their own. And a handle forked into a child keeps working."""

from __future__ import annotations

import os

from sippcache_redis.backend import DEFAULT_MAX_BYTES
from sippcache_redis.servers import ValkeyServer

import sippcache
from sippcache.testing.bounded import wait_forked


def fill(cache: sippcache.CacheBackend, first: int, count: int) -> None:
    for i in range(first, first + count):
        assert cache.store([i], bytes(1000))  # 1,004 bytes each with the key


def test_handles_share_the_saved_budget(valkey_server: ValkeyServer, prefix: str) -> None:
    url = f"{valkey_server.url}?prefix={prefix}"
    with sippcache.open(url) as plain:
        assert plain.stats().max_bytes == DEFAULT_MAX_BYTES  # nothing saved yet
    with sippcache.open(f"{url}&max_bytes=3500&max_entries=50") as sized:
        fill(sized, 0, 3)
    plain = sippcache.open(url)
    roomy = sippcache.open(f"{url}&max_bytes=10000")
    try:
        assert (plain.stats().max_bytes, plain.stats().max_entries) == (3500, 50)
        fill(plain, 3, 1)  # over the saved budget: one goes
        assert len(plain) == 3 and plain.stats().evictions == 1
        fill(roomy, 4, 4)  # its first use saves 10,000: nothing goes
        assert len(roomy) == 7 and roomy.stats().evictions == 0
        assert plain.stats().max_bytes == 10000  # followed without reopening
    finally:
        plain.close()
        roomy.close()


def test_a_forked_child_uses_the_inherited_handle(valkey_server: ValkeyServer, prefix: str) -> None:
    with sippcache.open(f"{valkey_server.url}?prefix={prefix}") as cache:
        assert cache.store([1, 2, 3], b"from the parent")
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            ok = False
            try:
                match = cache.lookup([1, 2, 3, 4])
                ok = match is not None and bytes(match.blob) == b"from the parent"
                ok = ok and cache.store([4, 5], b"from the child")
            finally:
                os._exit(0 if ok else 1)
        assert wait_forked(pid, "look up and store through the inherited handle, and exit") == 0
        match = cache.lookup([4, 5])
        assert match is not None and bytes(match.blob) == b"from the child"
