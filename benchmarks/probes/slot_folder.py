"""Decided: a slot folder on a tmpfs with huge pages is offered as a measured trade, not a default
(75794ac: docs/proxy.md's "a RAM disk with huge pages"; the proxy's --staging-dir, 924ee7e).

What a folder costs slot files: llama-server's save (a new file), and the proxy's read and removal of it.

llama-server writes every slot save as a new file, in writes of a layer's rows (--piece); the
proxy maps the file, reads it through, unmaps it and removes it. On a tmpfs with 4 KiB pages
each page of that is allocated, mapped and freed on its own; a tmpfs mounted with
``huge=always`` or ``huge=within_size`` takes 2 MiB pages. But where freed memory goes back to
a hypervisor (virtio-balloon's free page reporting, which hands back free 2 MiB blocks after
about 2 s), a huge page freed a while ago is cold again, and allocating it costs a fault on the
host. So each folder's new file is written twice over: back to back (the file before it just
removed) and after --pause seconds (a save after a quiet spell, as a chat's turns come).

Per folder (--dirs; default /dev/shm and every tmpfs mounted with huge pages), alternating,
medians of --repeat, against a memory copy of the same bytes in the same run:

    python -m benchmarks.probes.slot_folder [--dirs /dev/shm,/mnt/slots] [--size 256M] [--pause 3] [--repeat 3]
        [--no-goals]
        [--llama-server PATH --model GGUF [--tokens 4096]]

With --llama-server, each folder also gets a llama-server of its own (its --slot-save-path),
holding a prompt of --tokens; its own save and restore of that slot are timed as it reports them.

Goal: on a folder with huge pages, the proxy's part (map, read through, unmap, remove) at
least 0.3x a memory copy (the issue's goal for sippcache's own part of a save). Exit status 1
if missed (unless --no-goals).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import xxhash

from benchmarks.state_path import filesystem, parse_size, random_bytes
from sippcache.engine.directory import huge_pages

STAGES = ("save, back to back", "save, after the pause", "proxy: map, read, unmap, remove")
#: With --llama-server: its own save (a new file of the prompt's state) and restore, each as it times it.
SERVER_STAGES = ("llama-server's save", "llama-server's restore")


def huge_folders() -> list[str]:
    """The tmpfs mount points here whose files get huge pages."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[2] == "tmpfs"]
    return [p for p in dict.fromkeys(points) if huge_pages(p) and os.access(p, os.W_OK)]


def save(path: str, piece: memoryview, pieces: int) -> float:
    """Seconds to write a new file as llama-server saves one: a small head, then the pieces."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(b"\0" * 37)  # the slot file's header: the pieces after it are not page aligned
        for _ in range(pieces):
            f.write(piece)
    return time.perf_counter() - started


def read_and_remove(path: str) -> float:
    """Seconds to map the file, read it through (xxh3: at memory speed), unmap it and remove it."""
    started = time.perf_counter()
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    xxhash.xxh3_64_intdigest(mapped)
    mapped.close()
    os.unlink(path)
    return time.perf_counter() - started


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return dict(json.loads(response.read()))


@contextmanager
def llama_servers(binary: str, model: str, places: dict[str, str], tokens: int) -> Iterator[dict[str, str]]:
    """One llama-server a folder (its --slot-save-path), each holding a prompt of `tokens`: their URLs."""
    procs, urls = [], {}
    try:
        for d, place in places.items():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            argv = [binary, "-m", model, "--port", str(port), "-c", str(tokens + 256), "-np", "1", "-fa", "on"]
            argv += ["--slot-save-path", place + os.sep, "--cache-ram", "0"]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls[d] = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(urls[d] + "/health", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or procs[-1].poll() is not None:
                        raise RuntimeError(f"llama-server for {d} did not start") from None
                    time.sleep(0.5)
            post(urls[d] + "/completion", {"prompt": [1 + i * 7 % 200 for i in range(tokens)], "n_predict": 1})
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirs", help="comma-separated folders (default: /dev/shm and every tmpfs with huge pages)")
    parser.add_argument("--size", default="256M", help="the slot file's size (256M)")
    parser.add_argument("--piece", default="4M", help="llama-server's writes: a layer's rows (4M)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds before a save after a pause (3)")
    parser.add_argument("--repeat", type=int, default=3, help="samples of each stage; the median is shown (3)")
    parser.add_argument("--llama-server", metavar="PATH", help="also llama-server's own save and restore, per folder")
    parser.add_argument("--model", metavar="GGUF", help="the model for --llama-server")
    parser.add_argument("--tokens", type=int, default=4096, help="the prompt each llama-server saves (4096)")
    parser.add_argument("--no-goals", action="store_true", help="report only: exit 0 whatever the ratios")
    args = parser.parse_args()
    if bool(args.llama_server) != bool(args.model):
        parser.error("--llama-server and --model go together")
    dirs = args.dirs.split(",") if args.dirs else ["/dev/shm", *huge_folders()]
    size, piece = parse_size(args.size), parse_size(args.piece)
    pieces = max(1, size // piece)
    data = memoryview(random_bytes(piece, 1))
    source, target = bytearray(random_bytes(pieces * piece, 2)), bytearray(pieces * piece)
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    copies = []
    places = {d: tempfile.mkdtemp(prefix="sippcache-slot-folder-", dir=d) for d in dirs}
    try:
        with (
            llama_servers(args.llama_server, args.model, places, args.tokens)
            if args.llama_server
            else nullcontext({}) as urls
        ):
            for place in places.values():  # untimed: each folder's first file
                save(os.path.join(place, "first"), data, pieces)
                read_and_remove(os.path.join(place, "first"))
            for i in range(args.repeat):
                started = time.perf_counter()
                target[:] = source
                copies.append(time.perf_counter() - started)
                for d, place in places.items():
                    path = os.path.join(place, f"slot-{i}")
                    for stage, pause in ((STAGES[0], 0.0), (STAGES[1], args.pause)):
                        time.sleep(pause)
                        times[d, stage].append(save(path, data, pieces))
                        times[d, STAGES[2]].append(read_and_remove(path))
                    if d in urls:  # llama-server's own, timed by llama-server
                        answer = post(urls[d] + "/slots/0?action=save", {"filename": f"server-{i}"})
                        times[d, SERVER_STAGES[0]].append(answer["timings"]["save_ms"] / 1e3)
                        answer = post(urls[d] + "/slots/0?action=restore", {"filename": f"server-{i}"})
                        times[d, SERVER_STAGES[1]].append(answer["timings"]["restore_ms"] / 1e3)
                        os.unlink(os.path.join(place, f"server-{i}"))
    finally:
        for place in places.values():
            for name in os.listdir(place):
                os.unlink(os.path.join(place, name))
            os.rmdir(place)
    memcpy = statistics.median(copies)
    print(
        f"{pieces * piece / 2**20:,.0f} MiB files in {piece >> 10} KiB writes; memcpy {memcpy * 1e3:.1f} ms; "
        f"medians of {args.repeat}; pause {args.pause:g} s"
        + (f"; llama-server: {os.path.basename(args.model)}, {args.tokens} tokens" if args.llama_server else "")
    )
    missed = []
    for d in dirs:
        huge = huge_pages(d)
        print(f"{d} ({filesystem(d)})")
        for stage in (*STAGES, *SERVER_STAGES):
            if not times[d, stage]:
                continue
            ms = statistics.median(times[d, stage])
            every = ", ".join(f"{t * 1e3:.0f}" for t in times[d, stage])
            ratio = f"{memcpy / ms:>5.2f}x memcpy" if stage in STAGES else " " * 12
            print(f"  {stage:<34} {ms * 1e3:>9,.1f} ms  {ratio}  (all: {every})")
            if huge and stage == STAGES[2] and memcpy / ms < 0.3:
                missed.append(f"{d}: the proxy's part {memcpy / ms:.2f}x memcpy < 0.3x")
    for line in missed:
        print(f"MISS{' (--no-goals)' if args.no_goals else ''}: {line}")
    return 1 if missed and not args.no_goals else 0


if __name__ == "__main__":
    sys.exit(main())
