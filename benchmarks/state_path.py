"""State-path benchmark: how fast sippcache moves a llama.cpp state's bytes, stage by stage.

On a GPU the compute is cheap: an H200 prefills 32K tokens of an 8B model in about 0.6 s, and
llama-server's own slot save/restore of that 1 GB state already takes 0.5-0.7 s (1.6-2 GB/s). So
a state's bytes are the whole cost of a restore, and this benchmark prices every copy and hash of
them as GB/s and as a ratio to a plain memory copy of the same bytes measured in the same run
(1.0x: as fast as memcpy; 0.5x: costs two memcpys). Per state size:

- anchors: memcpy into a preallocated buffer, into a new buffer (page faults included), xxh3_64,
  writing a new file and rewriting an existing one on the --dir filesystem, and a slot file read
  once through a mapping, unmapped and removed (the floor of a save's own part below: any save of
  llama-server's file pays it, and on a tmpfs of 4 KiB pages it is most of the cost);
- chunks joined (`sippcache.state.joined(...).write_into` one kept buffer, as the llama-cpp-python
  layer restores a state stored in chunks of ``--chunk-tokens``): V as rows (flash attention on)
  and V transposed (off: each dimension's runs of every chunk gathered; beside it, alternating,
  the gather as it was before 2026-11-29's second change, each run copied as bytes); and the
  other way, chunks cut out (`sippcache.state.cut`, each chunk's pieces copied into a buffer, deepest
  first, as a first save frames them): V rows, and V transposed (a group of chunks at a time;
  beside it, alternating, each chunk's runs cut alone, as before 2026-11-29);
- framing: `frame.encode` of a one-section state, `frame.decode` of it (checksum checked);
- each backend, opened by URL: `store` of the framed blob (a new key each repetition), `lookup` +
  xxh3 of the whole blob (so mapped pages are read) + release; LMDB runs with ``sync=false`` and
  its disk sync (fsync of data.mdb) is a row of its own; ``tiered`` (not run by default) is LMDB in
  front of diskcache: its store times the LMDB write and the queueing (the L2 write is awaited untimed);
- the proxy (`sippcache.proxy.store.SlotStore`, kind "full") on each backend: ``keep`` of a slot
  file in llama-server's format (read + framing + store write; the file is written untimed first)
  (beside it, ``keep`` as a proxy with ready files makes it: the slot file kept, renamed, not
  removed; `sippcache.proxy.ready`) and ``_stage`` of the entry (lookup + decode + writing the
  staging slot file: one per slot, as
  the proxy keeps it, so the first restore, which creates it, is untimed), and ``_stage`` right
  after a restore of a state a quarter as long (the file left long; beside it, cut to each state's
  length, as for slot-file version 1 and before 2026-11-28); beside them, the same
  save and restore as the proxy made them before 2026-11-27 (a read into a new buffer and two more
  copies; a new staging file per restore), the alternative measured in the same run. Whole states
  (``--chunk-tokens 0``), then in chunks: a save into an empty store (every chunk new; also with
  the slot file kept ready, the proxy's default), a save of a
  state sharing every chunk with a stored one (only its tail new: a chat's next turn), and a restore
  joined from chunks (beside it, the same restore with the chunks checked as before 2026-11-27:
  on other threads while the state is joined, not as the join copies them). Each save also has a
  row less the time spent in the backend's own `store`
  calls ("sippcache's own part": reading the slot file, cutting, framing, checksums), which the
  issue asks to report apart from a backend's write.

Each save is also timed with the other framing (a row of its own): frames as new bytes where the
backend copies what it is given into its own storage (the only framing until 2026-11-27),
frames in a buffer used again where it keeps the bytes it is given (RAM, tiered: `keeps_bytes`).

Sizes are the KV of 2K, 8K and 32K tokens of an 8B-class model (32 KiB a token). Goals, judged on
the largest size: the proxy's restore (``_stage``, whole and from chunks) on RAM at least 0.5x
memcpy; its save's own part (``keep`` less the backend's ``store`` calls; whole, and in chunks
every chunk new, with the slot file removed and kept ready) on LMDB at least 0.3x (the RAM
backend keeps the frame it is given, so there the frame's new memory is the backend's write; a
save's goal line also gives its floor, the slot file read and removed alone); the chunks joined
(both V layouts) at least 0.5x.
Exit status 1 if a goal fails (unless --no-goals). Needs sippcache's ``proxy`` extra (httpx,
starlette: `sippcache.proxy` imports them), not llama_cpp. Run it on an idle machine:

    python -m benchmarks.state_path                            # 64M, 256M, 1G: a few GB of RAM
    python -m benchmarks.state_path --sizes 16M --repeat 1     # a quick smoke test
    python -m benchmarks.state_path --backends ram,lmdb,tiered --dir /var/tmp --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import closing, contextmanager, nullcontext
from typing import Any

import xxhash

import sippcache
from sippcache import frame
from sippcache import state as sf
from sippcache.backends.tiered import tiered_url
from sippcache.engine.directory import huge_pages, mount_of
from sippcache.options import Size
from sippcache.protocol import Blob
from sippcache.proxy import slotfile
from sippcache.proxy.store import KIND, SlotStore, Snapshot
from sippcache.state import chunks, copier
from sippcache.state.chunks import DEFAULT_CHUNK_TOKENS, Assembled, ChunkedStates

KV_BYTES_PER_TOKEN = 32 * 1024  # Llama-3-8B, f16 K and V
VOCAB = 128_256
SLOT_VERSION = 4
DEFAULT_SIZES = "64M,256M,1G"
URLS = {
    "ram": "ram://?max_bytes=64GiB",
    "lmdb": "lmdb://{dir}/lmdb?sync=false&max_bytes=64GiB",
    "diskcache": "diskcache://{dir}/diskcache?max_bytes=64GiB",
    "tiered": "",  # LMDB in front of diskcache, built in `backend_url`
}
RESTORE_GOAL, SAVE_GOAL = 0.5, 0.3
#: Where each goal is judged: a restore on RAM (its read is a view: the rest is sippcache's); a
#: save by sippcache's own part on LMDB, the default store, which copies a frame into its file
#: (the RAM backend keeps the frame it is given: there the frame's new memory is its write).
RESTORE_BACKEND, SAVE_BACKEND = "ram", "lmdb"
CHUNKED, CHUNKED_RESTORE = "proxy save, chunks, every chunk new", "proxy restore, chunks"
CHUNKED_NEXT = "proxy save, chunks, only the tail new"
#: The proxy's default save of a new state: chunks, and the slot file kept ready, not removed.
CHUNKED_READY = "proxy save, chunks, every chunk new, the file kept ready"
AFTER_SHORTER = "proxy restore after one a quarter as long: _stage"
CUT = ", cut to each state (slot-file version 1)"
#: A restore from chunks is timed as this host checks it (`chunks.MEANWHILE_THREADS`), and the other way.
CHECKS_AS_COPIED = chunks.check_threads() < chunks.MEANWHILE_THREADS
OTHER_WAY = ", chunks checked meanwhile" if CHECKS_AS_COPIED else ", each chunk hashed as copied"
WRITE_CHECKED = ChunkedStates.write_checked
ASSEMBLE_ROWS = "chunks: join into one buffer (V rows)"
ASSEMBLE_COLUMNS = "chunks: join into one buffer (V transposed)"
RUNS_AS_BYTES = ", each run copied as bytes (before)"
CUT_ROWS = "chunks: cut out of a state, each copied into a buffer (V rows)"
CUT_COLUMNS = "chunks: cut out of a state, each copied into a buffer (V transposed)"
CUT_ALONE = ", each chunk's runs cut alone"
#: The issue's goal for assembly: the chunks joined at least 0.5x a memcpy of the same bytes.
ASSEMBLE_GOAL = 0.5
MEMCPY, LMDB_SYNC = "memcpy (preallocated buffer)", "lmdb: disk sync (fsync data.mdb)"
SLOT_FILE_FLOOR = "slot file: read once through a mapping, unmapped, removed"
#: After a save's stage name: the same save less the backend's own `store` calls.
OWN_PART = ", sippcache's own part"
#: The proxy's save with ready files on (its default): the slot file kept, not removed.
KEPT_READY = "proxy save: keep, the file kept ready"


def parse_size(text: str) -> int:
    """``16M``, ``1G`` (binary: MiB, GiB), or anything `sippcache.options.Size` reads (``1.5GB``)."""
    text = text.strip()
    return int(Size.parse(text + "iB" if text[-1:].upper() in "KMGT" and text[-1:].isalpha() else text))


def show_size(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def random_bytes(size: int, seed: int) -> bytes:
    """`size` random bytes (numpy's generator if importable, else a random 1 MiB block repeated)."""
    try:
        import numpy as np
    except ImportError:
        block = os.urandom(1 << 20)
        return (block * (size // len(block) + 1))[:size]
    return np.random.default_rng(seed).bytes(size)


def synthetic_state(n_tokens: int, seed: int, *, v_transposed: bool = False) -> bytes:
    """A slot file's state of `n_tokens` cells in llama.cpp's format (version `SLOT_VERSION`; what
    `sippcache.state` reads and cuts): Llama-3-8B's shape, 32 layers of f16 K and V rows of
    512 bytes (8 KV heads of 128 over 4 layers' worth: the same bytes a token), random rows. With
    `v_transposed`, V as llama.cpp writes it with flash attention off: each layer's 256 dimensions,
    each a run of every cell's value (the same bytes, other headers)."""
    layers, row, f16 = 32, KV_BYTES_PER_TOKEN // 64, 1
    cells = b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(n_tokens))
    rows = random_bytes(2 * layers * row * n_tokens, seed)
    parts = [struct.pack("<II", 1, n_tokens), cells, struct.pack("<IIII", int(v_transposed), layers, 0, 0)]
    for i in range(2 * layers):  # every layer's K rows, then every layer's V rows (or columns)
        head = struct.pack("<iII", f16, 2, row // 2) if v_transposed and i >= layers else struct.pack("<iQ", f16, row)
        parts += [head, rows[i * row * n_tokens : (i + 1) * row * n_tokens]]
    return b"".join(parts)


def filesystem(path: str) -> str:
    """The type of the file system `path` is on, and for a tmpfs whether it keeps huge pages."""
    mount = mount_of(path)
    if mount is None:
        return "unknown"
    huge = huge_pages(path)
    return mount.kind if huge is None else f"{mount.kind}, {'huge' if huge else '4 KiB'} pages"


class Clock:
    """Times of the stages, in the order first timed."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def __call__(self, stage: str, apart: StoreTimer | None = None) -> Iterator[None]:
        """Time `stage`; with `apart`, also `stage` less the time spent in the backend's own
        `store` meanwhile, as the stage's row with OWN_PART after it."""
        start, stored = time.perf_counter(), apart.seconds if apart else 0.0
        yield
        took = time.perf_counter() - start
        self.times[stage].append(took)
        if apart is not None:
            self.times[stage + OWN_PART].append(took - (apart.seconds - stored))


class StoreTimer:
    """Sums the seconds spent in a cache's `store` while it is entered (the backend's own write,
    which the issue reports apart from sippcache's part of a save)."""

    def __init__(self, cache: sippcache.CacheBackend) -> None:
        self.seconds = 0.0
        self._cache = cache
        self._store = cache.store

    def __enter__(self) -> StoreTimer:
        self._cache.store = self._timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._cache.store  # the class's method again (and no cycle keeping the store alive)

    def _timed(self, *args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        try:
            return self._store(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def keeps_bytes(cache: sippcache.CacheBackend) -> bool:
    """Whether `cache` keeps the bytes it is given (an optional attribute of a backend)."""
    return bool(getattr(cache, "keeps_bytes", False))


def other_framing(cache: sippcache.CacheBackend) -> str:
    """The label of a save's row with the framing `cache` is not given (`framed_as`)."""
    return ", frames in a used buffer" if keeps_bytes(cache) else ", frames as new bytes"


@contextmanager
def framed_as(cache: sippcache.CacheBackend, keeps: bool | None) -> Iterator[None]:
    """Entries framed for `cache` as for a store that keeps bytes (`keeps` True: new bytes) or
    not (a buffer used again), whatever it says (None: as it says): each backend's save with the
    other framing, the alternative measured beside it."""
    if keeps is not None:
        setattr(cache, "keeps_bytes", keeps)  # noqa: B010  # the instance's own, for this save
    try:
        yield
    finally:
        cache.__dict__.pop("keeps_bytes", None)


def backend_url(name: str, root: str) -> str:
    if name == "tiered":
        l1, l2 = URLS["lmdb"].format(dir=root), URLS["diskcache"].format(dir=root)
        return tiered_url(l1, l2, queue_bytes="4GiB")
    return URLS[name].format(dir=root)


def bench_slots(cache: sippcache.CacheBackend, staging: str, **options: Any) -> SlotStore:
    """A proxy's slot store on `cache`, as these rows use it (states of 16 tokens and more kept)."""
    return SlotStore(cache, fingerprint="bench", facts={}, kind="full", staging=staging, min_tokens=16, **options)


def write_slot_file(path: str, key: tuple[int, ...], state: Blob) -> None:
    """The slot file llama-server would save for `key` and `state` (untimed, before a save's row)."""
    with open(path, "wb") as f:
        f.writelines(slotfile.build(SLOT_VERSION, key, state))


def anchors(clock: Clock, state: bytes, repeat: int, root: str) -> None:
    """memcpy, xxh3 and file writes of the state: what every other row is compared with; and the
    floor of a proxy save's own part (`SLOT_FILE_FLOOR`): llama-server's slot file mapped as the
    proxy maps it, each byte read once (xxh3, faster than a copy), unmapped and removed."""
    target = bytearray(len(state))
    memoryview(target)[:] = state  # fault the target's pages in first
    for _ in range(repeat):
        with clock(MEMCPY):
            memoryview(target)[:] = state
    del target
    for _ in range(repeat):
        with clock("memcpy (new buffer)"):
            fresh = bytearray(state)
        del fresh
    for _ in range(repeat):
        with clock("xxh3_64"):
            xxhash.xxh3_64_intdigest(state)
    path = os.path.join(root, "anchor.bin")
    for _ in range(repeat):
        with clock("file: write a new one"), open(path, "wb") as f:
            f.write(state)
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(state)
    for _ in range(repeat):
        with clock("file: rewrite an existing one"), open(path, "r+b") as f:
            f.write(state)
    os.unlink(path)
    for _ in range(repeat):  # llama-server's save, untimed; then the least a save of it reads and frees
        with open(path, "wb") as f:
            f.write(state)
        with clock(SLOT_FILE_FLOOR):
            with open(path, "rb") as f:  # mapped as `SlotStore._store` maps it
                mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            xxhash.xxh3_64_intdigest(mapped)
            mapped.close()
            os.unlink(path)


def framing(clock: Clock, state: bytes, tokens: tuple[int, ...], repeat: int) -> bytes:
    blob = b""
    for _ in range(repeat):
        blob = b""  # free the last one before making the next
        with clock("frame.encode"):
            blob = frame.encode(tokens, [state], fingerprint="bench", kind=KIND, roles=["state"])
    for _ in range(repeat):
        with clock("frame.decode (checksum checked)"):
            decoded = frame.decode(blob)
        if decoded.payload_size != len(state):
            sys.exit(f"FAIL: frame.decode gave {decoded.payload_size} bytes, expected {len(state)}")
        del decoded
    return blob


def backend(clock: Clock, name: str, url: str, blob: bytes, keys: list[tuple[int, ...]]) -> None:
    """store (new key each time) and lookup + read + release of the framed blob."""
    repeat, last = len(keys), keys[-1]
    digest = xxhash.xxh3_64_intdigest(blob)
    with sippcache.open(url) as cache:
        data_file = os.path.join(getattr(cache, "path", ""), "data.mdb") if name == "lmdb" else ""
        for i in range(repeat):
            with clock(f"{name}: store"):
                stored = cache.store(keys[i], blob)
            if not stored:
                sys.exit(f"FAIL: {name} refused a {len(blob):,}-byte entry")
            if data_file:
                with clock(LMDB_SYNC):
                    fd = os.open(data_file, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            len(cache)  # tiered: wait for the L2 write (untimed)
            if i < repeat - 1:
                cache.delete(keys[i])
        for _ in range(repeat):
            with clock(f"{name}: lookup + read + release"):
                match = cache.lookup(last)
                assert match is not None
                with match:
                    read = xxhash.xxh3_64_intdigest(match.blob)
            if read != digest or match.length != len(last):
                sys.exit(f"FAIL: {name} returned other bytes or another key")


def holds(path: str, parts: list[Any]) -> bool:
    """Whether the slot file at `path` begins with the slot file `parts` make (llama.cpp reads a
    state as far as it goes: a staging file may be longer)."""
    expected = b"".join(parts)
    with open(path, "rb") as f:
        return f.read(len(expected)) == expected


def proxy(clock: Clock, name: str, url: str, state: bytes, keys: list[tuple[int, ...]], staging: str) -> None:
    """`SlotStore.keep` of a llama-server slot file, then `SlotStore._stage` of the entry back to one."""
    repeat, last = len(keys), keys[-1]
    os.makedirs(staging)
    with (
        sippcache.open(url) as cache,
        StoreTimer(cache) as stores,
        closing(
            bench_slots(cache, staging, chunk_tokens=0)
        ) as slots,  # closed: its staging file, kept mapped, is freed
    ):
        namespace = slots.namespace("bench")
        for i in range(repeat):
            path = os.path.join(staging, f"save-{i}.slot")
            for label, framing in ("", None), (other_framing(cache), not keeps_bytes(cache)):
                write_slot_file(path, keys[i], state)  # what llama-server's slot save writes (untimed)
                with clock(f"proxy save: keep ({name}){label}", stores), framed_as(cache, framing):
                    saved = slots.keep(Snapshot(path, keys[i], len(keys[i]), time.perf_counter()), None, "bench")
                if saved is None or os.path.exists(path):
                    sys.exit(f"FAIL: SlotStore.keep on {name} stored nothing (errors: {slots.errors})")
                len(cache)  # tiered: wait for the L2 write (untimed)
                if i < repeat - 1 or not label:  # the last one is restored below
                    cache.delete(keys[i], namespace=namespace)
        for i in range(repeat):  # the same save as the proxy made it before 2026-11-27, side by side
            path = os.path.join(staging, f"save-before-{i}.slot")
            write_slot_file(path, last, state)
            with clock(f"proxy save, before: read + 3 copies ({name})"):
                keep_before(cache, path, namespace)
        for _ in range(repeat):
            with clock(f"proxy restore, before: a new staging file ({name})"):
                stage_before(cache, last, namespace, os.path.join(staging, "restore-before.slot"))
        path = os.path.join(staging, "restore.slot")  # one per slot, as the proxy keeps it
        for i in range(repeat + 1):  # the first creates the staging file: untimed, and checked
            with clock(f"proxy restore: _stage ({name})") if i else nullcontext():
                staged = slots._stage(last, namespace, path)
            if staged is None or staged[1] != len(state):
                sys.exit(f"FAIL: SlotStore._stage on {name} staged nothing (errors: {slots.errors})")
            if i == 0 and not holds(path, slotfile.build(SLOT_VERSION, last, state)):
                sys.exit(f"FAIL: SlotStore._stage on {name} wrote another slot file")
        ready = bench_slots(cache, staging, chunk_tokens=0, ready_bytes=2 * len(state))
        cache.delete(last, namespace=namespace)  # after the saves above: the store has grown as far for this one
        for i in range(repeat):  # the save as a proxy with ready files makes it: the file kept, not removed
            path = os.path.join(staging, f"save-ready-{i}.slot")
            write_slot_file(path, keys[i], state)
            with clock(f"{KEPT_READY} ({name})", stores):
                saved = ready.keep(Snapshot(path, keys[i], len(keys[i]), time.perf_counter()), None, "bench")
            if saved is None or os.path.exists(path) or len(ready.ready) != 1:
                sys.exit(f"FAIL: SlotStore.keep on {name} kept no ready file (errors: {ready.errors})")
            ready.close()  # untimed: the file removed, as room or the proxy's exit removes it later
            cache.delete(keys[i], namespace=namespace)


def proxy_after_shorter(
    clock: Clock, name: str, url: str, state: bytes, n_tokens: int, repeat: int, staging: str
) -> None:
    """`SlotStore._stage` of a state right after one a quarter as long into the same slot, as a
    slot's restores go where conversations of several lengths take turns in it: the staging file
    left as long as it was (slot-file version 4), and beside it cut to each state's length (version
    1, written also by llama.cpp builds that abort on a longer file), which frees the pages past
    the shorter state that the next longer one must allocate and fault in again."""
    os.makedirs(staging)
    states = [synthetic_state(n_tokens // 4, n_tokens), state]  # the state of the other rows, and a shorter one
    keys = [(first, *range(3, 2 + n)) for first, n in ((1, n_tokens // 4), (2, n_tokens))]  # parting at once
    with (
        sippcache.open(url) as cache,
        closing(bench_slots(cache, staging, chunk_tokens=0)) as slots,
    ):
        for version, label in (SLOT_VERSION, ""), (1, CUT):
            scope = f"v{version}"
            for key, state in zip(keys, states, strict=True):
                path = os.path.join(staging, "save.slot")
                with open(path, "wb") as f:
                    f.writelines(slotfile.build(version, key, state))
                if slots.keep(Snapshot(path, key, len(key), time.perf_counter()), None, scope) is None:
                    sys.exit(f"FAIL: SlotStore.keep on {name} stored nothing (errors: {slots.errors})")
            path = os.path.join(staging, f"restore-v{version}.slot")
            for i in range(repeat + 1):  # the first makes the staging file: untimed
                if slots._stage(keys[0], slots.namespace(scope), path) is None:
                    sys.exit(f"FAIL: SlotStore._stage on {name} staged nothing (errors: {slots.errors})")
                with clock(f"{AFTER_SHORTER} ({name}){label}") if i else nullcontext():
                    staged = slots._stage(keys[1], slots.namespace(scope), path)
                if staged is None or staged[1] != len(states[1]):
                    sys.exit(f"FAIL: SlotStore._stage on {name} staged nothing (errors: {slots.errors})")


def proxy_chunked(
    clock: Clock, name: str, url: str, state: bytes, keys: list[tuple[int, ...]], staging: str, chunk_tokens: int
) -> None:
    """`SlotStore.keep` and `_stage` with states in chunks of `chunk_tokens` tokens: a new state
    each time, into an empty store (every chunk is written); then the last one restored, joined
    from its chunks."""
    os.makedirs(staging)
    with (
        sippcache.open(url) as cache,
        StoreTimer(cache) as stores,
        closing(bench_slots(cache, staging, chunk_tokens=chunk_tokens)) as slots,
    ):
        namespace = slots.namespace("bench")
        for i, key in enumerate(keys):
            for label, framing in ("", None), (other_framing(cache), not keeps_bytes(cache)):
                cache.clear()  # untimed
                path = os.path.join(staging, f"save-{i}.slot")
                write_slot_file(path, key, state)
                with clock(f"{CHUNKED}: keep ({name}){label}", stores), framed_as(cache, framing):
                    saved = slots.keep(Snapshot(path, key, len(key), time.perf_counter()), None, "bench")
                if saved is None or len(cache) < len(key) // chunk_tokens:
                    sys.exit(f"FAIL: SlotStore.keep on {name} stored no chunks (errors: {slots.errors})")
        ready = bench_slots(cache, staging, chunk_tokens=chunk_tokens, ready_bytes=2 * len(state))
        for i, key in enumerate(keys):  # the proxy's default: the file kept ready, not removed
            cache.clear()  # untimed
            path = os.path.join(staging, f"save-ready-{i}.slot")
            write_slot_file(path, key, state)
            with clock(f"{CHUNKED_READY}: keep ({name})", stores):
                saved = ready.keep(Snapshot(path, key, len(key), time.perf_counter()), None, "bench")
            if saved is None or os.path.exists(path) or len(ready.ready) != 1:
                sys.exit(f"FAIL: SlotStore.keep on {name} kept no ready file (errors: {ready.errors})")
            ready.close()  # untimed: the file removed, as room or the proxy's exit removes it later
        for i, key in enumerate(keys):  # states that share every chunk with the stored one: a tail each
            path, nxt = os.path.join(staging, f"next-{i}.slot"), (*key[:-1], (key[-1] + 1) % VOCAB)
            write_slot_file(path, nxt, state)
            with clock(f"{CHUNKED_NEXT}: keep ({name})", stores):
                saved = slots.keep(Snapshot(path, nxt, len(nxt), time.perf_counter()), None, "bench")
            if saved is None or saved.nbytes >= len(state) // 4:
                sys.exit(f"FAIL: SlotStore.keep on {name} wrote the chunks again (errors: {slots.errors})")
        path = os.path.join(staging, "restore.slot")
        for i in range(len(keys) + 1):  # the first creates the staging file: untimed, and checked
            for label, checks in ("", nullcontext()), (OTHER_WAY, checked_the_other_way()):
                with clock(f"{CHUNKED_RESTORE}: _stage ({name}){label}") if i else nullcontext(), checks:
                    staged = slots._stage(keys[-1], namespace, path)
                if staged is None or staged[1] != len(state):
                    sys.exit(f"FAIL: SlotStore._stage on {name} staged nothing from chunks (errors: {slots.errors})")
                if i == 0 and not holds(path, slotfile.build(SLOT_VERSION, keys[-1], state)):
                    sys.exit(f"FAIL: SlotStore._stage on {name} joined another slot file")


def assembly(clock: Clock, n_tokens: int, seed: int, chunk_tokens: int, repeat: int) -> None:
    """`sippcache.state.joined(...).write_into` of a state cut in chunks of `chunk_tokens`, into one
    kept buffer: the llama-cpp-python layer's restore (the proxy writes the same parts into its
    staging file). V rows (flash attention on: every part one copy) and V transposed (off: each
    dimension's runs of every chunk gathered). Before it, the other way: `sippcache.state.cut` of the
    state, each chunk's pieces copied into a kept buffer of a chunk's size, deepest first (a first
    save, less its framing and store)."""
    for label, transposed in ((ASSEMBLE_ROWS, False), (ASSEMBLE_COLUMNS, True)):
        state = synthetic_state(n_tokens, seed, v_transposed=transposed)
        parsed = sf.parse(state, header=False, version=SLOT_VERSION)
        cuts = range(chunk_tokens, n_tokens, chunk_tokens)
        pieces = sf.split(parsed, cuts)  # its chunks checked below: joined, they are the state
        chunk = memoryview(bytearray(max(map(len, pieces.chunks))))
        cut_label = CUT_COLUMNS if transposed else CUT_ROWS
        ways = [(cut_label, nullcontext)] + ([(cut_label + CUT_ALONE, chunks_cut_alone)] if transposed else [])
        for i in range(repeat + 1):  # the first untimed, and checked
            for name, way in ways:  # alternating
                with way(), clock(name) if i else nullcontext():
                    copied = copy_out(sf.cut(parsed, cuts), chunk, hashed=not i)
                if copied and copied != [xxhash.xxh3_64_intdigest(c) for c in reversed(pieces.chunks)]:
                    sys.exit(f"FAIL: {name}: the chunks cut out are not the state's")
        del parsed
        out = mmap.mmap(-1, len(state))
        view = memoryview(out)
        ways = [(label, nullcontext)] + ([(label + RUNS_AS_BYTES, runs_copied_byte_by_byte)] if transposed else [])
        for i in range(repeat + 1):  # the first faults the buffer's pages in: untimed, and checked
            for name, way in ways:  # alternating
                with way(), clock(name) if i else nullcontext():
                    sf.joined(pieces.meta, pieces.chunks, pieces.tail).write_into(view)
                if i == 0 and xxhash.xxh3_64_intdigest(view) != xxhash.xxh3_64_intdigest(state):
                    sys.exit(f"FAIL: {name}: the joined state is not the state")
        view.release()
        out.close()
        del state, pieces
        gc.collect()


def copy_out(pieces: sf.Cut, out: memoryview, *, hashed: bool = False) -> list[int]:
    """Each chunk's pieces copied into `out`, deepest chunk first (as a store writes them); with
    `hashed`, each chunk's xxh3_64 as copied, in that order."""
    digests = []
    for i in reversed(range(len(pieces))):
        at = 0
        for piece in pieces.pieces(i):
            data = memoryview(piece).cast("B")
            out[at : at + data.nbytes] = data
            at += data.nbytes
        if hashed:
            digests.append(xxhash.xxh3_64_intdigest(out[:at]))
    return digests


@contextmanager
def chunks_cut_alone() -> Iterator[None]:
    """A transposed V cut out a chunk at a time (before 2026-11-29: each chunk's runs read from
    every one of a layer's rows, layer after layer), where now a group of chunks is cut at once."""
    real = sf.Cut._columns_of
    sf.Cut._columns_of = lambda self, index: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        sf.Cut._columns_of = real  # type: ignore[method-assign]


@contextmanager
def runs_copied_byte_by_byte() -> Iterator[None]:
    """The transposed-V gather as it was before 2026-11-29 (second change that day): a group's
    stacked tables copied across the layer's rows as tables of bytes, each run a loop over its
    bytes, where now each run is one element of its width (`copier._across`)."""
    real = copier._across

    def across(band: Any, stacked: Any, chunks: int, width: int) -> None:
        across_bytes = band.reshape(band.shape[0], chunks, width)
        across_bytes[...] = stacked.reshape(chunks, band.shape[0], width).transpose(1, 0, 2)

    copier._across = across
    try:
        yield
    finally:
        copier._across = real


@contextmanager
def checked_the_other_way() -> Iterator[None]:
    """Restores from chunks checked the other way than this host's (`chunks.MEANWHILE_THREADS`):
    where it hashes each chunk as it is copied, the state joined and every chunk's payload checked
    on other threads meanwhile (`check_meanwhile`, each chunk read from memory twice); where it
    checks meanwhile, each chunk hashed as copied (one checking thread, as on 2 cores)."""
    if not CHECKS_AS_COPIED:
        real = chunks.check_threads
        chunks.check_threads = lambda: 1
        try:
            yield
        finally:
            chunks.check_threads = real
        return

    def write_checked(states: ChunkedStates, assembled: Assembled, out: memoryview) -> bool:
        checked = states.check_meanwhile(assembled) if assembled.unchecked else None
        try:
            assembled.write_into(out)
        finally:
            passed = checked is None or checked.result()
        return passed

    ChunkedStates.write_checked = write_checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ChunkedStates.write_checked = WRITE_CHECKED  # type: ignore[method-assign]


def keep_before(cache: sippcache.CacheBackend, path: str, namespace: str) -> None:
    """`SlotStore.keep` as it was: the file read into a new buffer, the sequence header joined to a
    copy of the state, the frame joined again, the file removed."""
    with open(path, "rb") as f:
        parsed = slotfile.parse(f.read())
    seq = b"".join((struct.pack("<Ii", slotfile.SEQ_STATE_MAGIC, 0), parsed.state))
    meta = {"slot_version": parsed.version, "memory": "full", "prompt": len(parsed.tokens)}
    blob = frame.encode(parsed.tokens, [seq], fingerprint="bench", kind=KIND, meta=meta, roles=["state"])
    cache.store(parsed.tokens, blob, namespace=namespace)
    os.unlink(path)


def stage_before(cache: sippcache.CacheBackend, tokens: tuple[int, ...], namespace: str, path: str) -> None:
    """`SlotStore._stage` as it was: a new staging file per restore, removed after llama-server read it."""
    match = cache.lookup(tokens, namespace=namespace, partial=True)
    assert match is not None
    with match:
        entry = frame.decode(match.blob)
        with open(path, "wb") as f:
            for part in slotfile.build(SLOT_VERSION, match.key, slotfile.state_of(entry.sections[0])):
                f.write(part)
        del entry
    os.unlink(path)


def bench_size(size: int, backends: list[str], repeat: int, root: str, chunk_tokens: int) -> list[dict[str, Any]]:
    """Every stage for one state size; rows of stage, median seconds, GB/s and ratio to memcpy."""
    n_tokens = max(16, size // KV_BYTES_PER_TOKEN)
    state = synthetic_state(n_tokens, seed=size)
    words = (int.from_bytes(state[-i - 4 : -i], "little") % VOCAB for i in range(4, 4 * n_tokens + 4, 4))
    prefix = tuple(words)[:-1]
    keys = [(*prefix, i % VOCAB) for i in range(repeat)]  # a new key each repetition
    clock = Clock()
    anchors(clock, state, repeat, root)
    assembly(clock, n_tokens, size, chunk_tokens, repeat)
    blob = framing(clock, state, keys[0], repeat)
    for name in backends:
        print(f"  {show_size(size)}: {name} ...", file=sys.stderr, flush=True)
        where = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
        backend(clock, name, backend_url(name, where), blob, keys)
        shutil.rmtree(where)
    del blob
    gc.collect()
    for name in backends:
        print(f"  {show_size(size)}: proxy on {name} ...", file=sys.stderr, flush=True)
        where = tempfile.mkdtemp(prefix=f"{name}-proxy-", dir=root)
        proxy(clock, name, backend_url(name, where), state, keys, os.path.join(where, "staging"))
        shutil.rmtree(where)
        where = tempfile.mkdtemp(prefix=f"{name}-shorter-", dir=root)
        proxy_after_shorter(
            clock, name, backend_url(name, where), state, n_tokens, repeat, os.path.join(where, "staging")
        )
        shutil.rmtree(where)
        where = tempfile.mkdtemp(prefix=f"{name}-chunks-", dir=root)
        proxy_chunked(clock, name, backend_url(name, where), state, keys, os.path.join(where, "staging"), chunk_tokens)
        shutil.rmtree(where)
    del state
    gc.collect()
    memcpy = statistics.median(clock.times[MEMCPY])
    rows = []
    for stage, times in clock.times.items():
        seconds = statistics.median(times)
        rows.append(
            {
                "size": size,
                "tokens": n_tokens,
                "stage": stage,
                "seconds": seconds,
                "gb_per_s": size / seconds / 1e9 if seconds else float("inf"),
                "x_memcpy": memcpy / seconds if seconds else float("inf"),
            }
        )
    return rows


def print_table(size: int, rows: list[dict[str, Any]], repeat: int) -> None:
    from rich.console import Console
    from rich.table import Table

    tokens = rows[0]["tokens"]
    table = Table(
        title=f"A {show_size(size)} state ({tokens:,} tokens at {KV_BYTES_PER_TOKEN // 1024} KiB)",
        caption=f"median of {repeat}; x memcpy: memcpy's time over the stage's (1.0x: as fast as memcpy)",
    )
    for column in ("stage", "ms", "GB/s", "x memcpy"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in rows:
        table.add_row(row["stage"], f"{row['seconds'] * 1e3:,.1f}", f"{row['gb_per_s']:.2f}", f"{row['x_memcpy']:.2f}x")
    Console().print(table)


def totals(rows: list[dict[str, Any]], backends: list[str]) -> list[dict[str, Any]]:
    """The proxy's whole-state save, restore and round trip per backend, as ratios to memcpy."""
    by_stage = {row["stage"]: row for row in rows}
    memcpy = by_stage[MEMCPY]["seconds"]
    out = []
    for name in backends:
        save, restore = by_stage[f"proxy save: keep ({name})"], by_stage[f"proxy restore: _stage ({name})"]
        save_before = by_stage[f"proxy save, before: read + 3 copies ({name})"]
        restore_before = by_stage[f"proxy restore, before: a new staging file ({name})"]
        chunked_save, chunked_restore = (
            by_stage[f"{CHUNKED}: keep ({name})"],
            by_stage[f"{CHUNKED_RESTORE}: _stage ({name})"],
        )
        trip = save["seconds"] + restore["seconds"]
        sync = by_stage.get(LMDB_SYNC) if name == "lmdb" else None
        out.append(
            {
                "size": rows[0]["size"],
                "backend": name,
                "save_x": save["x_memcpy"],
                "save_own_x": by_stage[f"proxy save: keep ({name}){OWN_PART}"]["x_memcpy"],
                "save_ready_own_x": by_stage[f"{KEPT_READY} ({name}){OWN_PART}"]["x_memcpy"],
                "slot_file_x": by_stage[SLOT_FILE_FLOOR]["x_memcpy"],
                "restore_x": restore["x_memcpy"],
                "round_trip_x": 2 * memcpy / trip,
                "save_before_x": save_before["x_memcpy"],
                "restore_before_x": restore_before["x_memcpy"],
                "chunked_save_x": chunked_save["x_memcpy"],
                "chunked_save_own_x": by_stage[f"{CHUNKED}: keep ({name}){OWN_PART}"]["x_memcpy"],
                "chunked_save_ready_own_x": by_stage[f"{CHUNKED_READY}: keep ({name}){OWN_PART}"]["x_memcpy"],
                "chunked_next_save_x": by_stage[f"{CHUNKED_NEXT}: keep ({name})"]["x_memcpy"],
                "chunked_restore_x": chunked_restore["x_memcpy"],
                "chunked_restore_other_x": by_stage[f"{CHUNKED_RESTORE}: _stage ({name}){OTHER_WAY}"]["x_memcpy"],
                "after_shorter_x": by_stage[f"{AFTER_SHORTER} ({name})"]["x_memcpy"],
                "after_shorter_cut_x": by_stage[f"{AFTER_SHORTER} ({name}){CUT}"]["x_memcpy"],
                "save_ms": save["seconds"] * 1e3,
                "restore_ms": restore["seconds"] * 1e3,
                "sync_ms": None if sync is None else sync["seconds"] * 1e3,
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"comma-separated, e.g. 16M,1G (default {DEFAULT_SIZES})"
    )
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of each stage; the median is shown (5)")
    parser.add_argument("--backends", default="ram,lmdb,diskcache", help=f"of {', '.join(URLS)} (ram,lmdb,diskcache)")
    parser.add_argument("--dir", help="where stores and files go (default: a temp dir under /dev/shm, if it exists)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument(
        "--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help=f"tokens a chunk ({DEFAULT_CHUNK_TOKENS})"
    )
    parser.add_argument("--no-goals", action="store_true", help="report only: exit 0 whatever the ratios")
    args = parser.parse_args()
    sizes = sorted(parse_size(s) for s in args.sizes.split(",") if s.strip())
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in backends if b not in URLS]:
        parser.error(f"unknown backends {', '.join(unknown)} (known: {', '.join(URLS)})")
    if args.repeat < 1 or not sizes or min(sizes) < KV_BYTES_PER_TOKEN:
        parser.error(f"--repeat must be >= 1 and every size >= {KV_BYTES_PER_TOKEN // 1024} KiB")
    parent = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="sippcache-state-path-", dir=parent)
    fs = filesystem(os.path.realpath(root))
    print(f"files in {root} ({fs}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    results: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    try:
        for size in sizes:
            rows = bench_size(size, backends, args.repeat, root, args.chunk_tokens)
            print_table(size, rows, args.repeat)
            results += rows
            summary += totals(rows, backends)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("proxy totals (save: keep; restore: _stage; round trip: both, against two memcpys):")
    for t in summary:
        sync = f", fsync {t['sync_ms']:,.1f} ms more" if t["sync_ms"] is not None else ""
        print(
            f"  {show_size(t['size']):>8} {t['backend']:<10} save {t['save_ms']:,.1f} ms ({t['save_x']:.2f}x memcpy;"
            f" sippcache's own part {t['save_own_x']:.2f}x;"
            f" the slot file read and removed alone {t['slot_file_x']:.2f}x;"
            f" own part with the file kept ready {t['save_ready_own_x']:.2f}x)"
            f"{sync}, restore {t['restore_ms']:,.1f} ms ({t['restore_x']:.2f}x), round trip {t['round_trip_x']:.2f}x;"
            f" before: save {t['save_before_x']:.2f}x, restore {t['restore_before_x']:.2f}x;"
            f" chunks of {args.chunk_tokens} tokens: save {t['chunked_save_x']:.2f}x (every chunk new;"
            f" own part {t['chunked_save_own_x']:.2f}x; with the file kept ready {t['chunked_save_ready_own_x']:.2f}x),"
            f" {t['chunked_next_save_x']:.2f}x (only the tail new),"
            f" restore {t['chunked_restore_x']:.2f}x ({OTHER_WAY[2:]}: {t['chunked_restore_other_x']:.2f}x);"
            f" a restore after one a quarter as long {t['after_shorter_x']:.2f}x"
            f" (the file cut to each state: {t['after_shorter_cut_x']:.2f}x)"
        )
    checks = (  # (what, judged on, goal, ratio, whether a slot file's read and removal is its floor)
        ("restore", RESTORE_BACKEND, RESTORE_GOAL, "restore_x", False),
        ("chunked restore", RESTORE_BACKEND, RESTORE_GOAL, "chunked_restore_x", False),
        ("save, sippcache's own part,", SAVE_BACKEND, SAVE_GOAL, "save_own_x", True),
        ("chunked save (every chunk new), sippcache's own part,", SAVE_BACKEND, SAVE_GOAL, "chunked_save_own_x", True),
        (
            "chunked save (every chunk new), the file kept ready (the default), sippcache's own part,",
            SAVE_BACKEND,
            SAVE_GOAL,
            "chunked_save_ready_own_x",
            False,
        ),
    )
    goals: dict[str, bool | None] = {}
    for what, backend, goal, ratio, floored in checks:
        judged = [t for t in summary if t["size"] == sizes[-1] and t["backend"] == backend]
        if not judged:
            goals[what] = None
            print(f"goal not judged: the proxy {what} is judged on the {backend} backend, which was not run")
            continue
        goals[what] = judged[0][ratio] >= goal
        verdict = "PASS" if goals[what] else "MISS (--no-goals)" if args.no_goals else "FAIL"
        ratio_of = judged[0][ratio]
        floor = f" (the slot file read and removed alone: {judged[0]['slot_file_x']:.2f}x)" if floored else ""
        print(
            f"{verdict}: proxy {what} of a {show_size(sizes[-1])} state on {backend} {ratio_of:.2f}x memcpy >= {goal}x"
            f"{floor}"
        )
    largest = {row["stage"]: row for row in results if row["size"] == sizes[-1]}
    for label in (ASSEMBLE_ROWS, ASSEMBLE_COLUMNS):
        ratio = largest[label]["x_memcpy"]
        goals[label] = ratio >= ASSEMBLE_GOAL
        verdict = "PASS" if goals[label] else "MISS (--no-goals)" if args.no_goals else "FAIL"
        print(f"{verdict}: {label} of a {show_size(sizes[-1])} state {ratio:.2f}x memcpy >= {ASSEMBLE_GOAL}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"dir": parent, "filesystem": fs, "repeat": args.repeat, "sizes": sizes, "backends": backends,
                 "load_average": os.getloadavg()[0], "rows": results, "totals": summary, "goals": goals},
                f, indent=1,
            )  # fmt: skip
    failed = any(ok is False for ok in goals.values())
    return 1 if failed and not args.no_goals else 0


if __name__ == "__main__":
    sys.exit(main())
