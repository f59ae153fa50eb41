"""URLs, options, registration, and TLS (a real handshake through a TLS terminator)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from redis_testtools import TLSProxy, make_certificates
from sippcache_redis import AccessDenied, RedisBackend, RedisTLSBackend
from sippcache_redis.servers import ValkeyServer
from sippcache_redis.url import RedisAddress, parse_location

import sippcache


@pytest.mark.parametrize(
    "location, expected",
    [
        ("", RedisAddress("localhost", 6379, 0)),
        ("cache.internal", RedisAddress("cache.internal", 6379, 0)),
        ("10.0.0.7:6380/3", RedisAddress("10.0.0.7", 6380, 3)),
        ("[::1]:7000/0", RedisAddress("::1", 7000, 0)),
        ("[fe80::1%eth0]/1", RedisAddress("fe80::1%eth0", 6379, 1)),
        (":secret@host:1", RedisAddress("host", 1, 0, None, "secret")),
        ("alice@host", RedisAddress("host", 6379, 0, "alice", None)),
        ("alice:p@ss:w/rd@host:6379/2", RedisAddress("host", 6379, 2, "alice", "p@ss:w/rd")),  # already decoded
        ("bob:@[::1]:6379", RedisAddress("::1", 6379, 0, "bob", "")),
    ],
)
def test_locations(location: str, expected: RedisAddress) -> None:
    parsed = parse_location(location, tls=False)
    assert parsed == expected and parsed.password == expected.password


@pytest.mark.parametrize(
    "location", ["host:0", "host:65536", "host:port", "host/db", "::1:6379", "[::1", "[::1]x", "bad host", "host/-1"]
)
def test_bad_locations(location: str) -> None:
    with pytest.raises(ValueError):
        parse_location(location, tls=False)


def test_display_never_shows_the_password() -> None:
    address = parse_location("alice:hunter2@[::1]:6380/4", tls=True)
    assert address.display() == "rediss://alice:***@[::1]:6380/4"
    assert "hunter2" not in repr(address)


@pytest.mark.parametrize(
    "query, message",
    [
        ("prefix=a b", "prefix"),
        ("prefix={x}", "prefix"),
        ("prefix=" + "x" * 65, "prefix"),
        ("timeout=0", "timeout"),
        ("timeout=nan", "timeout"),
        ("chunk_size=10", "chunk_size"),
        ("max_bytes=0", "max_bytes"),
        ("max_entries=0", "max_entries"),
        ("ssl_ca_certs=/x", "rediss"),
        ("cluster=1", "database 0"),
        ("cluster=maybe", "cluster"),
    ],
)
def test_bad_options_are_bad_options(query: str, message: str) -> None:
    with pytest.raises(sippcache.BadOption, match=message):
        sippcache.open(f"redis://127.0.0.1:1/2?{query}")
    with pytest.raises(sippcache.BadOption, match="ssl_cert_reqs"):
        sippcache.open("rediss://127.0.0.1:1/0?ssl_cert_reqs=sometimes")


def test_registered_only_through_the_entry_point_group() -> None:
    info = sippcache.backends()
    for scheme, cls in (("redis", RedisBackend), ("rediss", RedisTLSBackend)):
        assert info[scheme].usable and info[scheme].origin.startswith("sippcache-redis ")
        assert info[scheme].target == f"sippcache_redis:{cls.__name__}"


def test_prefixes_and_databases_keep_deployments_apart(valkey_server: ValkeyServer, prefix: str) -> None:
    base = f"redis://127.0.0.1:{valkey_server.port}"
    urls = [f"{base}/0?prefix={prefix}a", f"{base}/0?prefix={prefix}b", f"{base}/5?prefix={prefix}a"]
    caches = [sippcache.open(url) for url in urls]
    try:
        for i, cache in enumerate(caches):
            cache.store([1, 2], f"deployment {i}".encode())
        for i, cache in enumerate(caches):
            assert bytes(cache.lookup([1, 2]).blob) == f"deployment {i}".encode() and len(cache) == 1
        caches[0].clear()
        assert caches[0].lookup([1, 2]) is None and len(caches[1]) == 1 and len(caches[2]) == 1
    finally:
        for cache in caches:
            cache.close()


def test_ipv6_host(make_server: Callable[..., ValkeyServer], prefix: str) -> None:
    server = make_server(args=["--bind", "127.0.0.1", "::1"])
    with sippcache.open(f"redis://[::1]:{server.port}/0?prefix={prefix}") as cache:
        assert cache.store([1], b"over IPv6") and bytes(cache.lookup([1]).blob) == b"over IPv6"
        assert cache.stats().location == f"redis://[::1]:{server.port}/0?prefix={prefix}"


def test_tls(valkey_server: ValkeyServer, tmp_path: Any, prefix: str, opened: list[Any]) -> None:
    certs = make_certificates(tmp_path / "certs")
    proxy = TLSProxy(valkey_server.port, certs["server.crt"], certs["server.key"])
    try:
        url = f"rediss://localhost:{proxy.port}/0?prefix={prefix}&ssl_ca_certs={certs['ca.crt']}"
        cache = sippcache.open(url)
        opened.append(cache)
        assert type(cache) is RedisTLSBackend and cache.stats().location.startswith("rediss://localhost:")
        assert cache.store([1, 2, 3], b"over TLS")
        assert bytes(cache.lookup([1, 2, 3]).blob) == b"over TLS" and proxy.handshakes >= 1
        with sippcache.open(f"redis://127.0.0.1:{valkey_server.port}/0?prefix={prefix}") as plain:  # same store
            assert bytes(plain.lookup([1, 2, 3]).blob) == b"over TLS"
        # A server whose certificate the client cannot verify is refused at open, clearly.
        with pytest.raises(AccessDenied, match=r"(?i)certificate") as info:
            sippcache.open(f"rediss://localhost:{proxy.port}/0?prefix={prefix}&ssl_ca_certs={certs['other.crt']}")
        assert "\n" not in str(info.value)
        # ...unless verification is switched off (redis-py's own option, passed through).
        with sippcache.open(
            f"rediss://localhost:{proxy.port}/0?prefix={prefix}&ssl_cert_reqs=none&ssl_check_hostname=false"
        ) as unverified:
            assert bytes(unverified.lookup([1, 2, 3]).blob) == b"over TLS"
    finally:
        proxy.close()
