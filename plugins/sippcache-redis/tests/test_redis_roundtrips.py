"""A lookup costs one round trip (the sync script) whatever the store size and the prompt
length; a hit adds its chunk GETs, pipelined in 16 MiB windows. Counted on the servers
(INFO commandstats) and by the client (`round_trips`)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sippcache_redis.servers import ValkeyCluster, ValkeyServer
from sippcache_redis.testing import bulk_fill, commands_during

import sippcache

MiB = 1024**2


def _measure(
    url: str, servers: list[Any], prompts: dict[int, tuple[list[int], bytes]]
) -> dict[tuple[int, str], tuple[dict[str, int], int]]:
    """For each prompt length: the commands and client round trips of a miss and of a hit."""
    out = {}
    with sippcache.open(url) as cache:
        assert cache.lookup([1]) is None  # the first use rebuilds the mirror and loads the scripts
        for prompt, _ in prompts.values():  # and connects to every node the blobs live on
            assert cache.lookup([*prompt, 7], touch=False) is not None
        for length, (prompt, blob) in prompts.items():
            for what, query in (("miss", [2**31 - 1, *prompt[1:]]), ("hit", [*prompt, 7])):
                before = cache.round_trips
                found: list[Any] = []
                commands = commands_during(
                    servers, lambda found=found, query=query: found.append(cache.lookup(query, touch=False))
                )
                if what == "hit":
                    assert found[0] is not None and found[0].length == length and bytes(found[0].blob) == blob
                else:
                    assert found[0] is None
                out[(length, what)] = (commands, cache.round_trips - before)
    return out


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_lookup_cost_is_flat(
    where: str, valkey_server: ValkeyServer, valkey_cluster: ValkeyCluster, prefix: str
) -> None:
    if where == "server":
        url, servers, bulk = valkey_server.url, [valkey_server.client()], valkey_server.client()
    else:
        url, servers, bulk = valkey_cluster.url, [n.client() for n in valkey_cluster.nodes], valkey_cluster.client()
    rng = random.Random(5)
    prompts = {
        100: ([rng.randrange(1000) for _ in range(100)], rng.randbytes(100_000)),
        32_000: ([rng.randrange(1000) for _ in range(32_000)], rng.randbytes(20 * MiB)),  # 20 chunks: 2 windows
    }
    results = {}
    for entries in (10, 100_000):
        store_url = f"{url}?prefix={prefix}-{entries}&max_bytes=1GiB"
        bulk_fill(bulk, f"{prefix}-{entries}", entries, seed=entries)
        with sippcache.open(store_url) as cache:
            for prompt, blob in prompts.values():
                assert cache.store(prompt, blob)
            assert len(cache) == entries + 2
        results[entries] = _measure(store_url, servers, prompts)
    for entries, measured in results.items():
        for (length, what), (commands, trips) in measured.items():
            scripts = {name: n for name, n in commands.items() if name not in ("evalsha", "get")}
            top = {name: n for name, n in commands.items() if name in ("evalsha", "get")}
            chunks = -(-len(prompts[length][1]) // MiB)
            windows = -(-len(prompts[length][1]) // (16 * MiB))
            if what == "miss":
                assert top == {"evalsha": 1} and trips == 1, (entries, length, commands)
            else:
                assert top == {"evalsha": 1, "get": chunks} and trips == 1 + windows, (entries, length, commands)
            # Inside the script: the same few commands every time (nothing per entry or token).
            assert scripts == {"type": 4, "hmget": 1, "hlen": 1}, (entries, length, what, commands)
    print({entries: {k: v for k, v in measured.items()} for entries, measured in results.items()})


def test_peek_is_one_round_trip_and_moves_no_blob(valkey_server: ValkeyServer, prefix: str) -> None:
    """The adapter peeks at its candidates and fetches only the one it restores."""
    url = f"{valkey_server.url}?prefix={prefix}"
    servers = [valkey_server.client()]
    with sippcache.open(url) as cache:
        cache.store([1, 2, 3], b"a" * 3 * MiB)
        for partial in (False, True):
            peeked: list[Any] = []
            counts = commands_during(
                servers, lambda peeked=peeked, partial=partial: peeked.append(cache.peek([1, 2, 3, 4], partial=partial))
            )
            # One round trip (the sync script; INFO also counts the commands it runs inside), no GET.
            assert counts["evalsha"] == 1 and "get" not in counts and peeked == [sippcache.Peek(3, 3, False)]
        fetched = commands_during(servers, lambda: cache.lookup([1, 2, 3, 4]).release())
        assert fetched["evalsha"] == 1 and fetched["get"] == 3


def test_a_chain_of_chunks_is_read_in_two_round_trips(valkey_server: ValkeyServer, prefix: str) -> None:
    """`lookup_prefixes` (a chunked state's restore, `sippcache.state.chunks`): the sync, then every
    entry's GETs in one pipeline, however many entries; a gap ends the chain."""
    url = f"{valkey_server.url}?prefix={prefix}&max_bytes=1GiB"
    servers = [valkey_server.client()]
    rng = random.Random(9)
    key = [rng.randrange(1000) for _ in range(64 * 300)]
    blobs = {n: rng.randbytes(20_000) for n in range(64, len(key) + 1, 64)}
    with sippcache.open(url) as cache:
        for n, blob in blobs.items():
            cache.store(key[:n], blob)
        cache.delete(key[: 64 * 250])
        assert cache.lookup([1]) is None  # the scripts loaded
        before = cache.round_trips
        found: list[list[sippcache.Match]] = []
        counts = commands_during(servers, lambda: found.append(cache.lookup_prefixes(key, list(blobs), touch=False)))
        matches = found[0]
        assert cache.round_trips - before == 2 and counts["evalsha"] == 1 and counts["get"] == 249
        assert [(m.length, bytes(m.blob)) for m in matches] == [(n, blobs[n]) for n in range(64, 64 * 250, 64)]
        for match in matches:
            match.release()
