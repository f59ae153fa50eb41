"""Garbage written straight under the backend's keys (by a bug, a person or an attacker
with write access) is a miss or is repaired, never an exception and never a wrong blob."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from sippcache_redis.servers import ValkeyServer

import sippcache
from sippcache.plugin import encode_tokens, entry_id

KEYS = {tuple([i, i + 1, i + 2]): bytes([i]) * (3000 + i) for i in range(6)}


def _eid(key: tuple[int, ...]) -> bytes:
    return entry_id("", encode_tokens(key))


def _garbage(prefix: str) -> dict[str, Callable[[Any], None]]:
    tag = "{" + prefix + "}"
    state, cat, val, log = (f"{tag}:{name}" for name in ("state", "cat", "val", "log"))
    first = _eid((0, 1, 2))

    def chunks(client: Any, key: tuple[int, ...]) -> list[bytes]:
        return sorted(client.keys(f"{prefix}:b:{{{_eid(key).hex()}}}:*"))

    def next_seq(client: Any) -> int:
        return int(client.hget(state, "seq")) + 1

    def log_records(client: Any, *records: dict[str, bytes]) -> None:
        seq = next_seq(client)
        for i, fields in enumerate(records):
            client.xadd(log, fields, id=f"{seq + i}-0")
        client.hset(state, "seq", seq + len(records) - 1)

    return {
        "state is a string": lambda c: (c.delete(state), c.set(state, b"\x00garbage")),
        "state seq is not a number": lambda c: c.hset(state, "seq", "lots"),
        "state seq is negative": lambda c: c.hset(state, "seq", "-5"),
        "state epoch missing": lambda c: c.hdel(state, "epoch"),
        "state clock is garbage": lambda c: c.hset(state, "clock", "nan"),
        "state seq jumps ahead": lambda c: c.hset(state, "seq", next_seq(c) + 50),
        "state seq goes back": lambda c: c.hset(state, "seq", "1"),
        "cat is a list": lambda c: (c.delete(cat), c.rpush(cat, b"x")),
        "cat value not msgpack": lambda c: c.hset(cat, first, b"\xc1" * 40),
        "cat value for another id": lambda c: c.hset(cat, first, c.hget(cat, _eid((1, 2, 3)))),
        "cat value wrong fields": lambda c: c.hset(cat, first, b"12345678" + msgpack.packb(["", b"\x00" * 4, -1])),
        "cat value truncated": lambda c: c.hset(cat, first, c.hget(cat, first)[:20]),
        "cat field not an id": lambda c: c.hset(cat, b"short", b"whatever"),
        "cat huge chunk size": lambda c: c.hset(
            cat,
            first,
            c.hget(cat, first)[:8]
            + msgpack.packb(["", encode_tokens((0, 1, 2)), 3012, 1, 3.0, 1, 2**40, 5], use_bin_type=True),
        ),
        "val garbage": lambda c: c.hset(val, first, b"\xff" * 18),
        "val wrong length": lambda c: c.hset(val, first, b"\x00" * 5),
        "val nan value": lambda c: c.hset(val, first, b"\x00" * 8 + b"\x7f\xf8" + b"\x00" * 6 + b"\x00\x00"),
        "val is a string key": lambda c: (c.delete(val), c.set(val, b"x")),
        "log is a string": lambda c: (c.delete(log), c.set(log, b"x")),
        "log record unknown kind": lambda c: log_records(c, {"k": "z", "e": first}),
        "log record bad id": lambda c: log_records(c, {"k": "p", "e": b"short"}),
        "log touch bad length": lambda c: log_records(c, {"k": "t", "d": b"\x00" * 31}),
        "log touch nan": lambda c: log_records(c, {"k": "t", "d": first + b"\x00" * 8 + b"\x7f\xf8" + b"\x00" * 6}),
        "log record no fields": lambda c: log_records(c, {"x": "y"}),
        "log put of garbage meta": lambda c: (c.hset(cat, first, b"junk"), log_records(c, {"k": "p", "e": first})),
        "log id far ahead": lambda c: c.xadd(log, {"k": "c"}, id="999999999-0"),
        "log deleted": lambda c: c.delete(log),
        "chunk missing": lambda c: c.delete(chunks(c, (0, 1, 2))[0]),
        "chunk too short": lambda c: c.set(chunks(c, (0, 1, 2))[0], b"x"),
        "chunk same length, other bytes": lambda c: c.set(chunks(c, (0, 1, 2))[0], b"\x07" * 1024),
        "chunk of another entry": lambda c: c.set(chunks(c, (0, 1, 2))[0], c.get(chunks(c, (1, 2, 3))[0])),
        "chunk is a hash": lambda c: [(c.delete(k), c.hset(k, "a", "b")) for k in chunks(c, (0, 1, 2))[1:2]],
        "everything deleted": lambda c: c.delete(state, cat, val, log),
    }


SCENARIOS = list(_garbage("x"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_garbage_is_a_miss_never_an_exception(valkey_server: ValkeyServer, prefix: str, scenario: str) -> None:
    url = f"{valkey_server.url}?prefix={prefix}&chunk_size=1KiB"
    with sippcache.open(url) as writer, valkey_server.client() as raw:
        for key, blob in KEYS.items():
            assert writer.store(key, blob)
        reader = sippcache.open(url)
        try:
            assert len(reader) == len(KEYS)  # a mirror built before the damage
            _garbage(prefix)[scenario](raw)
            for cache in (reader, writer, sippcache.open(url)):  # caught up, in step, brand new
                for key, blob in KEYS.items():
                    match = cache.lookup([*key, 99])
                    assert match is None or (bytes(match.blob) == blob and match.key == key), scenario
                    match = cache.lookup(key, partial=True)
                    assert match is None or bytes(match.blob) == KEYS[match.key]
                listed = list(cache.entries())
                assert len(cache) == len(listed) <= len(KEYS)
                cache.stats()
                # The store keeps working afterwards.
                assert cache.store([7, 7, 7], b"after the damage") is True
                assert bytes(cache.lookup([7, 7, 7]).blob) == b"after the damage"
                cache.pin([7, 7, 7])
                assert cache.delete([7, 7, 7]) is True
                assert cache.stats().errors == 0, scenario
            cache.close()
            reader.clear()
            assert len(writer) == 0 and writer.lookup([1, 2, 3]) is None
        finally:
            reader.close()


def test_a_torn_entry_is_removed_with_its_chunks(valkey_server: ValkeyServer, prefix: str) -> None:
    url = f"{valkey_server.url}?prefix={prefix}&chunk_size=1KiB"
    with sippcache.open(url) as cache, valkey_server.client() as raw:
        cache.store([1, 2, 3], bytes(5000))
        cache.store([4], bytes(10))
        keys = raw.keys(f"{prefix}:b:{{{_eid((1, 2, 3)).hex()}}}:*")
        assert len(keys) == 5
        raw.delete(keys[2])
        assert cache.lookup([1, 2, 3]) is None
        assert len(cache) == 1 and raw.keys(f"{prefix}:b:{{{_eid((1, 2, 3)).hex()}}}:*") == []
        assert raw.hlen("{" + prefix + "}:cat") == 1
