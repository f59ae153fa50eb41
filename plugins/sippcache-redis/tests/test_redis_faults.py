"""Faults are misses, not crashes: a server down at open, killed in the middle of a
lookup or a store, restarted, stalled; persistence across restarts; credentials and
ACLs that are wrong are a clear error at open."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis_testtools import Proxy
from sippcache_redis import AccessDenied
from sippcache_redis.servers import ValkeyServer, free_port

import sippcache

MiB = 1024**2
BIG = bytes(range(256)) * (64 * MiB // 256)  # 64 chunks of 1 MiB: four 16 MiB windows


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "unavailable" in r.getMessage()]


def _wait_until(condition: Callable[[], bool], seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_server_down_at_open_then_started(
    make_server: Callable[..., ValkeyServer], caplog: pytest.LogCaptureFixture, opened: list[Any], prefix: str
) -> None:
    port = free_port()
    caplog.set_level(logging.INFO, logger="sippcache")
    started = time.monotonic()
    cache = sippcache.open(f"redis://127.0.0.1:{port}/0?prefix={prefix}&timeout=1")  # nothing listens: not an error
    opened.append(cache)
    for i in range(20):
        assert cache.lookup([1, 2, 3]) is None
        assert cache.store([1, 2, i], b"dropped") is False
        assert cache.delete([1, 2, 3]) is False
        assert cache.touch([1, 2, 3]) is False
    assert len(cache) == 0 and list(cache.entries()) == []
    stats = cache.stats()
    assert stats.errors >= 60 and stats.misses == 20 and stats.stores == 0
    assert len(_warnings(caplog)) == 1  # once per outage, however many failures
    assert time.monotonic() - started < 5  # refused connections fail fast, then the backoff skips the server
    make_server(port=port)  # the server comes up: the client notices by itself
    _wait_until(lambda: cache.store([1, 2, 3], b"now stored"))
    assert bytes(cache.lookup([1, 2, 3, 4]).blob) == b"now stored"
    assert any("is back" in r.getMessage() for r in caplog.records)


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # reported by the test
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_server_killed_mid_lookup(make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str) -> None:
    server = make_server()
    with sippcache.open(f"{server.url}?prefix={prefix}") as writer:
        assert writer.store([5, 6, 7], BIG)
    proxy = Proxy(server.port)
    cache = sippcache.open(f"redis://127.0.0.1:{proxy.port}/0?prefix={prefix}&timeout=2")
    opened.append(cache)
    try:
        assert len(cache) == 1
        proxy.hold("down", 20 * MiB)  # the reply stops 20 MiB into the blob
        thread, result = _in_thread(lambda: cache.lookup([5, 6, 7, 8]))
        assert proxy.held.wait(30)
        server.kill()
        proxy.cut()
        thread.join(30)  # bounds the wait only: the cut connection ends the lookup at once
        assert not thread.is_alive() and result == [None]  # a miss, no exception, no hang
        assert cache.stats().errors >= 1
        server.start()  # no persistence: an empty server on the same port
        _wait_until(lambda: cache.store([1], b"after restart"))
        assert cache.lookup([5, 6, 7, 8]) is None and len(cache) == 1
    finally:
        proxy.close()


def test_server_killed_mid_store_leaves_nothing_behind(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str
) -> None:
    server = make_server(args=["--appendonly", "yes", "--appendfsync", "always"])
    proxy = Proxy(server.port)
    cache = sippcache.open(f"redis://127.0.0.1:{proxy.port}/0?prefix={prefix}&timeout=2")
    opened.append(cache)
    try:
        assert cache.store([1], b"before")
        proxy.hold("up", 20 * MiB)  # the upload stops 20 MiB into the blob
        thread, result = _in_thread(lambda: cache.store([5, 6, 7], BIG))
        assert proxy.held.wait(30)
        server.kill()
        proxy.cut()
        thread.join(30)  # bounds the wait only
        assert not thread.is_alive() and result == [False]  # dropped, no exception, no hang
        server.start()  # with its AOF: what was written before the kill is back
        _wait_until(lambda: cache.lookup([1]) is not None)
        assert cache.lookup([5, 6, 7]) is None and len(cache) == 1
        with server.client() as client:  # the chunks that made it expire by themselves
            ttls = [client.pttl(key) for key in client.keys(f"{prefix}:b:*")]
            assert sum(ttl > 3600_000 for ttl in ttls) == 1  # the chunk of [1], committed
            assert len(ttls) > 2 and all(0 < ttl <= 15 * 60_000 for ttl in ttls if ttl <= 3600_000)  # expiring
    finally:
        proxy.close()


def test_stalled_server_answers_within_the_timeout(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server()
    cache = sippcache.open(f"{server.url}?prefix={prefix}&timeout=1")
    opened.append(cache)
    assert cache.store([1, 2], b"x")
    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        started = time.monotonic()
        assert cache.lookup([1, 2]) is None
        first = time.monotonic() - started
        started = time.monotonic()
        assert cache.store([3], b"y") is False and cache.lookup([1, 2]) is None and cache.delete([1, 2]) is False
        len(cache)
        cache.stats()
        rest = time.monotonic() - started
    finally:
        server.resume()
    assert 0.9 < first < 2.5, first  # the 1 s timeout, not more
    assert rest < 0.5, rest  # backing off: no more waiting on a dead server
    assert len(_warnings(caplog)) == 1
    _wait_until(lambda: cache.lookup([1, 2]) is not None)  # back by itself


@pytest.mark.parametrize("persistence", ["aof", "rdb"])
def test_persistent_server_keeps_entries_across_restarts(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str, persistence: str
) -> None:
    args = ["--appendonly", "yes", "--appendfsync", "always"] if persistence == "aof" else []
    server = make_server(args=args)
    url = f"{server.url}?prefix={prefix}&chunk_size=64KiB"
    cache = sippcache.open(url)
    opened.append(cache)
    blobs = {i: bytes([i]) * (100_000 + i) for i in range(5)}
    for i, blob in blobs.items():
        assert cache.store([i, i], blob, pinned=i == 0)
    if persistence == "rdb":
        with server.client() as client:
            client.save()
    server.kill()  # SIGKILL: only what was saved survives
    server.start()
    for i, blob in blobs.items():  # the same handle, reconnected
        _wait_until(lambda i=i: cache.lookup([i, i]) is not None)
        assert bytes(cache.lookup([i, i, 7]).blob) == blob
    with sippcache.open(url) as fresh:  # and a new one
        assert len(fresh) == 5 and next(e for e in fresh.entries() if e.key == (0, 0)).pinned
        assert bytes(fresh.lookup([3, 3]).blob) == blobs[3]


def test_wrong_password_is_a_clear_error_at_open(make_server: Callable[..., ValkeyServer], prefix: str) -> None:
    password = "p@ss:w/rd%?&#é"  # percent-encoded in the URL
    server = make_server(password=password)
    with sippcache.open(f"{server.url}&prefix={prefix}".replace("/0&", "/0?")) as cache:
        assert cache.store([1], b"authenticated") and len(cache) == 1
        assert password not in cache.stats().location and "***" in cache.stats().location
    for url in (f"redis://:wrong@127.0.0.1:{server.port}/0?prefix={prefix}",
                f"redis://127.0.0.1:{server.port}/0?prefix={prefix}"):  # fmt: skip
        with pytest.raises(AccessDenied) as info:
            sippcache.open(url)
        message = str(info.value)
        assert "\n" not in message and "credentials" in message and ":wrong" not in message
        assert isinstance(info.value, sippcache.BadOption)


def test_acl_denials_are_clear_errors_at_open(make_server: Callable[..., ValkeyServer], prefix: str) -> None:
    server = make_server()
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "noxadd", "on", ">secret1", "~*", "+@all", "-xadd")
        admin.execute_command("ACL", "SETUSER", "otherkeys", "on", ">secret2", "~elsewhere:*", "+@all")
        admin.execute_command("ACL", "SETUSER", "exact", "on", ">secret3", f"~{{{prefix}}}:*", f"~{prefix}:*",
                              "+evalsha", "+eval", "+info", "+get", "+set", "+pexpire", "+unlink", "+hscan",
                              "+type", "+hget", "+hmget", "+hlen", "+hset", "+hdel", "+hexists", "+del", "+xadd",
                              "+xrange")
    with pytest.raises(AccessDenied, match=r"(?i)'noxadd'.*xadd") as info:
        sippcache.open(f"redis://noxadd:secret1@127.0.0.1:{server.port}/0?prefix={prefix}")
    assert "\n" not in str(info.value) and "secret1" not in str(info.value)
    with pytest.raises(AccessDenied, match="'otherkeys'"):
        sippcache.open(f"redis://otherkeys:secret2@127.0.0.1:{server.port}/0?prefix={prefix}")
    # The commands docs/redis.md lists, on the prefix's keys only, are enough.
    with sippcache.open(f"redis://exact:secret3@127.0.0.1:{server.port}/0?prefix={prefix}&max_bytes=3000") as cache:
        for i in range(5):
            assert cache.store([i], bytes(1000))
        assert cache.lookup([4]) is not None and cache.pin([4]) and cache.delete([3])
        assert len(cache) == 1 and cache.stats().errors == 0 and cache.stats().evictions == 3
        cache.clear()
        assert len(cache) == 0
