"""Tools for tests and benchmarks of this backend: command counts and a fast bulk fill.

`commands_during` reads ``INFO commandstats`` on every server before and after an
action, so a test can show exactly which commands (and how many) a lookup costs.
`bulk_fill` writes entries straight into a store's hashes (pipelined), so a
store of 100,000 entries takes seconds instead of 400,000 round trips.
"""

from __future__ import annotations

import random
import secrets
import time
from typing import Any

import xxhash

from sippcache.plugin import EntryState, encode_tokens, entry_id

from .records import BlobRef, pack_meta, pack_values


def commandstats(clients: list[Any]) -> dict[str, int]:
    """Calls per command, summed over `clients` (one per server)."""
    total: dict[str, int] = {}
    for client in clients:
        for name, row in client.info("commandstats").items():
            name = name.removeprefix("cmdstat_")
            total[name] = total.get(name, 0) + int(row["calls"])
    return total


def commands_during(clients: list[Any], action: Any) -> dict[str, int]:
    """The commands the servers received while `action()` ran (our INFO calls subtracted)."""
    before = commandstats(clients)
    action()
    after = commandstats(clients)
    delta = {name: after[name] - before.get(name, 0) for name in after}
    delta["info"] -= len(clients)  # the INFO that read `before`
    return {name: count for name, count in delta.items() if count}


def bulk_fill(client: Any, prefix: str, count: int, *, tokens: int = 8, blob: bytes = b"x", seed: int = 0) -> None:
    """Write `count` entries straight into the store's hashes, pipelined (a store through the
    backend costs 4 round trips; 100,000 of them would take minutes), then start a new epoch
    so every client rebuilds its mirror from the hashes."""
    rng = random.Random(seed)
    tag = "{" + prefix + "}"
    now = time.time_ns()
    checksum = xxhash.xxh3_64_intdigest(blob)
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        key = encode_tokens([rng.randrange(2**31) for _ in range(tokens)])
        eid = entry_id("", key)
        ref = BlobRef(secrets.token_bytes(8), len(blob), 1024**2, checksum)
        state = EntryState("", tokens, len(blob) + len(key), float(tokens), now, now, now + i, 1.0)
        pipe.execute_command("HSET", f"{tag}:cat", eid, pack_meta(key, state, ref))
        pipe.execute_command("HSET", f"{tag}:val", eid, pack_values(state.used, state.value, False, False))
        pipe.execute_command("SET", f"{prefix}:b:{{{eid.hex()}}}:{ref.blob_id.hex()}:0", blob)
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    client.execute_command("DEL", f"{tag}:log")
    client.execute_command("HSET", f"{tag}:state", "epoch", secrets.token_hex(8), "seq", "0", "clock", "0")
