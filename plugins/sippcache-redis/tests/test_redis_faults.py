"""Faults are misses, not crashes: a server down at open, killed in the middle of a
lookup or a store, restarted, stalled; persistence across restarts; credentials and
ACLs that are wrong are a clear error at open."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis_testtools import Clock, Proxy, open_with_clock
from sippcache_redis import AccessDenied
from sippcache_redis.backend import BACKOFF_FIRST, BACKOFF_MAX
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
    clock = Clock()  # the backoff's clock: it moves only when this test moves it
    cache = open_with_clock(f"redis://127.0.0.1:{port}/0?prefix={prefix}&timeout=1", clock)  # nothing listens: fine
    opened.append(cache)
    assert cache.attempts == 1  # the connection at open, refused
    for i in range(20):
        assert cache.lookup([1, 2, 3]) is None
        assert cache.store([1, 2, i], b"dropped") is False
        assert cache.delete([1, 2, 3]) is False
        assert cache.touch([1, 2, 3]) is False
    assert len(cache) == 0 and list(cache.entries()) == []
    stats = cache.stats()
    assert stats.errors >= 60 and stats.misses == 20 and stats.stores == 0
    # Fail fast: while the backoff lasts, all of the above were answered without trying the server.
    assert cache.attempts == 1 and cache.round_trips == 0
    clock.advance(BACKOFF_FIRST)  # the backoff is over: the next call tries the server (refused again)...
    assert cache.lookup([1, 2, 3]) is None and cache.attempts == 2
    clock.advance(0.75 * 2 * BACKOFF_FIRST)  # ... and the backoff doubles
    assert cache.lookup([1, 2, 3]) is None and cache.store([1], b"dropped") is False and cache.attempts == 2
    clock.advance(0.25 * 2 * BACKOFF_FIRST)
    assert cache.lookup([1, 2, 3]) is None and cache.attempts == 3
    assert len(_warnings(caplog)) == 1  # once per outage, however many failures
    make_server(port=port)  # the server comes up (answering PING): the client notices by itself...
    assert cache.store([1, 2, 3], b"now stored") is False and cache.attempts == 3  # ... once the backoff is over
    clock.advance(BACKOFF_MAX)
    assert cache.store([1, 2, 3], b"now stored")
    assert bytes(cache.lookup([1, 2, 3, 4]).blob) == b"now stored"
    assert any("is back" in r.getMessage() for r in caplog.records)


def _connections_received(server: ValkeyServer) -> int:
    """Connections the server has accepted since it started (this one included)."""
    with server.client() as client:
        return int(client.info("stats")["total_connections_received"])


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # reported by the test
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)  # one that hangs fails its test without keeping pytest alive
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
    clock = Clock()  # the backoff's clock: it moves only when this test moves it
    cache = open_with_clock(f"{server.url}?prefix={prefix}&timeout=1", clock)
    opened.append(cache)
    patient = sippcache.open(f"{server.url}?prefix={prefix}&timeout=600")
    opened.append(patient)
    assert cache.store([1, 2], b"x") and patient.lookup([1, 2]) is not None
    connections = _connections_received(server)
    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        attempts, trips = cache.attempts, cache.round_trips
        thread, result = _in_thread(lambda: cache.lookup([1, 2]))
        thread.join(60)  # bounds the wait only: the 1 s timeout ends the lookup
        assert not thread.is_alive() and result == [None]  # a miss, no exception, no hang
        assert (cache.attempts, cache.round_trips) == (attempts + 1, trips + 1)  # one exchange, given up
        assert cache.store([3], b"y") is False and cache.lookup([1, 2]) is None and cache.delete([1, 2]) is False
        len(cache)
        cache.stats()
        assert (cache.attempts, cache.round_trips) == (attempts + 1, trips + 1)  # backing off: no more waiting
        # A stall within the timeout is waited out: the answer, not a miss.
        before = patient.attempts
        waiting, answer = _in_thread(lambda: patient.lookup([1, 2]))
        _wait_until(lambda: patient.attempts > before)  # its request is on its way to the stalled server
    finally:
        server.resume()
    waiting.join(60)  # bounds the wait only
    assert not waiting.is_alive() and len(answer) == 1 and bytes(answer[0].blob) == b"x"
    # No client connected again while the server was stalled (redis-py's own retries are off: a
    # retry would have reconnected): the only new connection is the one counting them.
    assert _connections_received(server) == connections + 1
    assert len(_warnings(caplog)) == 1
    assert cache.lookup([1, 2]) is None and cache.attempts == attempts + 1  # still backing off
    clock.advance(BACKOFF_FIRST)
    assert bytes(cache.lookup([1, 2]).blob) == b"x"  # back by itself once the backoff is over


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
    for url in (
        f"redis://:wrong@127.0.0.1:{server.port}/0?prefix={prefix}",
        f"redis://127.0.0.1:{server.port}/0?prefix={prefix}",
    ):
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
        admin.execute_command(
            "ACL",
            "SETUSER",
            "exact",
            "on",
            ">secret3",
            f"~{{{prefix}}}:*",
            f"~{prefix}:*",
            "+evalsha",
            "+eval",
            "+info",
            "+get",
            "+set",
            "+pexpire",
            "+unlink",
            "+hscan",
            "+type",
            "+hget",
            "+hmget",
            "+hlen",
            "+hset",
            "+hdel",
            "+hexists",
            "+del",
            "+xadd",
            "+xrange",
        )
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


def test_the_cli_never_prints_a_password(make_server: Callable[..., ValkeyServer], prefix: str, tmp_path: Path) -> None:
    """`sippcache stats --json`, `copy` and their errors show a store's URL with its password as ***."""
    password = "hunter2-secret"
    server = make_server(password=password)
    url = f"{server.url}&prefix={prefix}".replace("/0&", "/0?")
    with sippcache.open(url) as cache:
        cache.store([1, 2], b"entry")
    script = Path(sys.executable).with_name("sippcache")
    runs = [
        [str(script), "stats", url, "--json"],
        [str(script), "copy", url, f"lmdb://{tmp_path}/copy", "--json"],
        [str(script), "copy", url, f"lmdb://{tmp_path}/copy"],
        [str(script), "copy", url, url],  # the same store: an error naming both
        [str(script), "stats", f"lmdb://{tmp_path}/none?password={password}"],  # no store there
    ]
    outputs = [subprocess.run(argv, capture_output=True, text=True, timeout=120) for argv in runs]
    assert [r.returncode for r in outputs] == [0, 0, 0, 2, 2], [r.stderr for r in outputs]
    assert json.loads(outputs[0].stdout)["url"].count("***") == 1
    assert "***" in json.loads(outputs[1].stdout)["source"]
    for result in outputs:
        assert password not in result.stdout + result.stderr, result
