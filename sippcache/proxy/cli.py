"""`sippcache proxy`: start (or attach to) llama-server, check it, and serve the proxy with uvicorn.

Two ways to start:

- managed: ``--llama-server PATH --model M.gguf [--parallel N] [-- ARGS]`` starts
  llama-server on loopback with every flag the proxy needs and stops it on exit;
- attach: ``--upstream URL`` (repeatable) ``--slot-dir DIR`` for servers already
  running with ``--slot-save-path DIR``; each is checked at start (for a
  sliding-window model, that it extends a restored state: ``--swa-full``), and
  the proxy refuses to start with one line that names what is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import httpx
import xxhash
from prometheus_client import Gauge

from .. import chunks, frame, registry
from ..engine.directory import free_bytes, huge_pages
from ..modelfile import ModelFacts, read_model_facts
from ..options import Size
from ..protocol import CacheBackend
from ..rates import MODES, RestoreRates, mode_from_environment, rates_dir, rates_file
from .app import SAVE_EVERY, SAVE_IDLE, Proxy
from .metrics import ProxyMetrics
from .slots import SlotTable
from .store import SlotStore, remove_stale_files
from .upstream import Upstream, UpstreamError, UpstreamInfo

log = logging.getLogger("sippcache.proxy")

__all__ = ["ProxyError", "build_parser", "main"]

#: Flags the managed llama-server always gets: slots that stay as the proxy left them
#: (no idle-slot clearing behind its back), full-size sliding-window caches so a
#: restored Gemma 3 state can be extended (llama-server ignores it for other models), and
#: no prompt cache of its own in RAM: the store is the cache, and llama-server's copies
#: each displaced slot state into new memory on the next request's path (on an H200,
#: 200 ms of a 32K-token request's time to first token). A user's flags come after these.
MANAGED_FLAGS = ("--no-cache-idle-slots", "--swa-full", "--cache-ram", "0")
#: How long a starting llama-server may take to load its model.
START_SECONDS = 300.0


class ProxyError(Exception):
    """A start-up problem, said in one line."""


class _Stopped(Exception):
    """SIGTERM, as uvicorn raises it again once it has shut down."""


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "sippcache proxy",
        description="An OpenAI-compatible proxy that gives llama.cpp's llama-server a persistent, shared prefix cache.",
    )
    managed = parser.add_argument_group("managed llama-server")
    managed.add_argument("--llama-server", metavar="PATH", help="the llama-server binary to start")
    managed.add_argument("--model", "-m", metavar="GGUF", help="the model llama-server loads")
    managed.add_argument("--parallel", "-np", type=int, default=1, help="slots: requests served at once (default 1)")
    managed.add_argument(
        "--staging-dir",
        metavar="DIR",
        help=f"where the proxy makes the private folder its slot files go through (default {RAM_DISK} where it has "
        f"{RAM_DISK_ROOM >> 30} GiB free, else the temporary folder); for a tmpfs with huge pages, see docs/proxy.md",
    )
    attach = parser.add_argument_group("attach to running llama-servers")
    attach.add_argument("--upstream", action="append", default=[], metavar="URL", help="a llama-server (repeatable)")
    attach.add_argument("--slot-dir", metavar="DIR", help="the --slot-save-path every upstream was started with")
    parser.add_argument(
        "--cache", metavar="URL", help="the store (default: $SIPPCACHE_URL, else LMDB in the user cache)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"), help="llama-server's --api-key, if any")
    parser.add_argument("--scope", default="", help="keeps tenants apart: entries of one scope are never another's")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before a 503")
    parser.add_argument(
        "--flight-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request whose long prefix another one in flight is computing waits up to this long for its "
        "stored state instead of computing it again (default 60; 0: never wait)",
    )
    parser.add_argument("--min-tokens", type=int, default=16, help="slot states shorter than this are not stored")
    parser.add_argument(
        "--save-every",
        type=int,
        default=SAVE_EVERY,
        metavar="TOKENS",
        help="a conversation's state left in its slot is saved once it holds this many tokens beyond what the "
        f"store holds: what a crash can lose (default {SAVE_EVERY}); it is saved anyway when the slot changes "
        "hands, sits idle, or the proxy stops",
    )
    parser.add_argument(
        "--save-idle",
        type=float,
        default=SAVE_IDLE,
        metavar="SECONDS",
        help=f"an unsaved slot is saved after this long unused (default {SAVE_IDLE:g}; 0: as soon as it is free)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=chunks.DEFAULT_CHUNK_TOKENS,
        metavar="N",
        help="store states as chunks of N tokens that every state sharing them shares, and a tail: a conversation's "
        f"later save writes only its new chunks (default {chunks.DEFAULT_CHUNK_TOKENS}; 0: every state whole); "
        "recurrent and hybrid models' states are stored whole",
    )
    parser.add_argument(
        "--restore",
        choices=MODES,
        help="when to restore a stored state: auto (default) when loading it is expected to be faster than "
        "llama-server computing its tokens, from the rates measured on each upstream; always; never "
        "(states are still stored); default: $SIPPCACHE_RESTORE, else auto",
    )
    parser.add_argument(
        "--rates-dir",
        default=rates_dir(),
        metavar="DIR",
        help="where the rates measured on each upstream are kept for the next proxy at the same place (same "
        "model, build and server), so a restart does not restore blindly until it has measured again "
        "(default: $SIPPCACHE_RATES_DIR, else rates/ in the user cache; '': not kept)",
    )
    parser.add_argument(
        "--ready-bytes",
        type=_size,
        metavar="SIZE",
        help="keep the slot files llama-server saved, up to SIZE (512MiB, 8GiB), in its slot folder: a prompt one "
        "serves at least as well as the store is restored from it with nothing read or copied, llama-server's "
        f"own restore (default: a quarter of the folder's free room at start, at most {READY_BYTES >> 30} GiB; 0: "
        "none)",
    )
    parser.add_argument(
        "--keep-ready",
        action="store_true",
        help="keep those files when the proxy exits, for the next proxy on this folder (and model) to restore "
        "from: they stay in RAM where the folder is a tmpfs; by default they go with the proxy",
    )
    parser.add_argument(
        "--warm-ready",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the start, make the store's most recently used states of this model (every scope's) ready files "
        "(within --ready-bytes, one at a time while no request runs), so a follow-up after a restart is "
        "llama-server's own restore (default: on)",
    )
    parser.add_argument("server_args", nargs="*", metavar="-- ARGS", help="more llama-server arguments (managed)")
    return parser


def _size(text: str) -> int:
    try:
        return Size.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class _Managed:
    process: subprocess.Popen[bytes]
    url: str


def _free_port(avoid: int) -> int:
    """A loopback port free now, other than `avoid`: the proxy's own, not yet listened on while its
    llama-server starts (given it, llama-server answered the proxy's clients, and the proxy
    could not listen: a test caught it, one start in many)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port


#: The private staging directories of managed proxies: this, the proxy's pid, "-", a random part.
STAGING_PREFIX = "sippcache-proxy-"
#: Where managed proxies with --keep-ready leave their ready slot files, beside their staging
#: directories: this and the user's id.
KEPT_PREFIX = "sippcache-kept-"
#: The most --ready-bytes takes by default: as llama-server's own --cache-ram (8192 MiB), which a
#: managed llama-server is started without.
READY_BYTES = 8 << 30


#: Managed proxies stage slot files in RAM here, where it has `RAM_DISK_ROOM` bytes free.
RAM_DISK = "/dev/shm"
#: A gigabyte: a state of 8K tokens of an 8B model in f16. A container's /dev/shm is 64 MB unless it
#: is given more: staged there, the states a proxy saves and restores would not fit.
RAM_DISK_ROOM = 1 << 30


def _staging_base() -> str:
    """Where managed proxies make their staging directories: in RAM where the machine has a tmpfs
    with room for states, else the temporary directory (a disk's page cache)."""
    base = tempfile.gettempdir()
    if not (os.path.isdir(RAM_DISK) and os.access(RAM_DISK, os.W_OK)):
        return base
    room = free_bytes(RAM_DISK) or 0
    if room >= RAM_DISK_ROOM:
        return RAM_DISK
    log.info(
        "sippcache proxy: %s has %d MiB free (under %d MiB): slot files go through %s",
        RAM_DISK,
        room >> 20,
        RAM_DISK_ROOM >> 20,
        base,
    )
    return base


def _note_pages(folder: str) -> None:
    """Say whether the tmpfs slot files go through keeps them in huge pages (nothing for a disk)."""
    huge = huge_pages(folder)
    if huge is None:
        return
    log.info(
        "sippcache proxy: slot files go through %s, a tmpfs with %s",
        folder,
        "huge pages" if huge else "4 KiB pages (one with huge pages: --staging-dir; docs/proxy.md)",
    )


def _warn_if_cramped(folder: str) -> None:
    """A warning where the folder slot files go through has room for less than a large state."""
    room = free_bytes(folder) or 0
    if room < RAM_DISK_ROOM:
        log.warning(
            "sippcache proxy: %s has %d MiB free: a state larger than that is neither saved nor restored",
            folder,
            room >> 20,
        )


def made_ahead(wanted: Sequence[tuple[str, int, int]], room: int) -> list[tuple[str, int, int]]:
    """The slots (upstream URL, slot, bytes) whose staging files are made at start, in order, while
    they take at most half the staging folder's `room`: made for every slot of a proxy with many
    (each as large as the largest state seen), they would fill a RAM disk, and llama-server's
    saves into it would fail. A slot left out makes its file at its first restore."""
    budget, ahead = room // 2, []
    for url, slot, nbytes in wanted:
        if nbytes > budget:
            break
        budget -= nbytes
        ahead.append((url, slot, nbytes))
    return ahead


def _staging_dir(base: str) -> str:
    """A private directory for slot files in `base`; those that proxies killed outright left there
    are removed first."""
    remove_stale_files(base, (STAGING_PREFIX,))
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=base)


def _kept_dir(base: str) -> str:
    """The folder in `base` where managed proxies of this user keep ready slot files between runs
    (--keep-ready): made private (0700); ProxyError where it is not this user's."""
    path = os.path.join(base, f"{KEPT_PREFIX}{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ProxyError(f"cannot make {path} for --keep-ready: {exc}") from exc
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ProxyError(f"{path} (for --keep-ready) is not a folder only this user may use")
    return path


def ready_budget(room: int) -> int:
    """The default --ready-bytes for a slot folder with `room` bytes free: a quarter of it (staging
    files made ahead take at most half: `made_ahead`), at most `READY_BYTES`."""
    return min(READY_BYTES, room // 4)


def start_llama_server(
    binary: str, model: str, parallel: int, staging: str, extra: Sequence[str], proxy_port: int
) -> _Managed:
    """Start llama-server on a free loopback port (not `proxy_port`) with the flags the proxy needs;
    wait until it is ready."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)) and shutil.which(binary) is None:
        raise ProxyError(f"--llama-server {binary}: no such executable")
    if not os.path.isfile(model):
        raise ProxyError(f"--model {model}: no such file")
    port = _free_port(proxy_port)
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--slot-save-path", staging + os.sep]
    argv += ["--parallel", str(parallel), *MANAGED_FLAGS, *extra]
    log_path = os.path.join(staging, "llama-server.log")
    with open(log_path, "wb") as log_file:
        # Its own session: a Ctrl+C (SIGINT to the terminal's process group) stops the proxy, which
        # finishes its slot saves and then stops llama-server; if the proxy dies, so does it.
        process = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log_path, "rb") as f:
                tail = f.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise ProxyError(f"llama-server exited ({process.returncode}): {' | '.join(tail)}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return _Managed(process, url)
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    process.wait(timeout=30)
    raise ProxyError(f"llama-server did not become ready in {START_SECONDS:.0f} s (log: {log_path})")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the proxy's process ends, however it ends (Linux)."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop_llama_server(managed: _Managed) -> None:
    managed.process.terminate()
    try:
        managed.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        managed.process.kill()
        managed.process.wait(timeout=30)


async def check_upstream(upstream: Upstream, slot_dir: str) -> UpstreamInfo:
    """What the proxy needs of a server: reachable, its props, and slot saves landing in `slot_dir`.
    Raises `ProxyError` naming the missing flag."""
    try:
        info = await upstream.info()
    except UpstreamError as exc:
        raise ProxyError(f"{upstream.url} does not answer /props and /v1/models ({exc})") from None
    probe = f"sippcache-probe-{uuid.uuid4().hex}.slot"
    try:
        await upstream.slot_action(0, "save", probe)
    except UpstreamError as exc:
        raise ProxyError(
            f"{upstream.url} cannot save slots: start llama-server with --slot-save-path {slot_dir} ({exc})"
        ) from None
    path = os.path.join(slot_dir, probe)
    if not os.path.exists(path):
        raise ProxyError(f"{upstream.url} saves slots elsewhere: start it with --slot-save-path {slot_dir}")
    try:
        os.unlink(path)
    except OSError as exc:
        raise ProxyError(
            f"this proxy cannot remove the slot files {upstream.url} writes in {slot_dir} ({exc.strerror}): run both "
            "as one user, or give both a group that may write the folder, without the sticky bit"
        ) from None
    return info


async def check_extends_restores(upstream: Upstream, slot_dir: str, n_swa: int, n_ctx: int) -> None:
    """A sliding-window model: check that the server extends a restored state (it runs with
    --swa-full), by asking it to. A prompt longer than the window is evaluated in slot 0, saved,
    restored and asked again with a few more tokens; `timings.cache_n` says what it reused. Slot 0
    is erased afterwards. Raises `ProxyError` naming the flag."""
    probe = f"sippcache-probe-{uuid.uuid4().hex}.slot"
    tokens = (await upstream.tokenize("the harbour " * (n_swa // 2 + 64)))[: (n_ctx or 1 << 30) - 16]
    body = {"n_predict": 1, "temperature": 0, "id_slot": 0, "cache_prompt": True}
    try:
        await upstream.call("POST", "/completion", {**body, "prompt": tokens}, timeout=600.0)
        await upstream.slot_action(0, "save", probe)
        await upstream.slot_action(0, "erase")
        await upstream.slot_action(0, "restore", probe)
        answer = await upstream.call("POST", "/completion", {**body, "prompt": tokens + tokens[-8:]}, timeout=600.0)
        await upstream.slot_action(0, "erase")
    except UpstreamError as exc:
        raise ProxyError(f"{upstream.url}: the check that it extends a restored state failed ({exc})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(slot_dir, probe))
    reused = int(((answer or {}).get("timings") or {}).get("cache_n", 0))
    if reused < n_swa:
        raise ProxyError(
            f"{upstream.url} recomputes every restored state of this sliding-window model (it reused {reused} of "
            f"{len(tokens)} restored tokens): start llama-server with --swa-full"
        )


def fingerprint(info: UpstreamInfo, facts: ModelFacts | None) -> tuple[str, dict[str, str]]:
    """What makes a slot state loadable by a server: the model file (its digest when the proxy can
    read it, else what llama-server says of it), the llama-server build and the slot layout.
    K/V types and the V layout are checked by llama.cpp itself when it reads a state."""
    model = (
        f"file:{facts.digest}"
        if facts
        else "server:" + ",".join(f"{k}={v}" for k, v in sorted(info.model_meta.items()))
    )
    described = {
        "model": model,
        "build_info": info.build_info,
        "slots": str(info.slots),
        "memory": facts.kind if facts else "unknown",
        "format": "1",
    }
    digest = xxhash.xxh3_128_hexdigest("\n".join(f"{k}={v}" for k, v in sorted(described.items())).encode())
    return digest, described


async def _connect(
    urls: Sequence[str], slot_dir: str, api_key: str | None, client: httpx.AsyncClient
) -> tuple[list[Upstream], list[UpstreamInfo]]:
    upstreams = [Upstream(url, client, api_key) for url in urls]
    infos = [await check_upstream(u, slot_dir) for u in upstreams]
    for upstream, info in zip(upstreams, infos, strict=True):
        upstream.multimodal = info.multimodal
    if len({(i.model_path, i.build_info) for i in infos}) > 1:
        raise ProxyError("the upstreams serve different models or builds: one proxy fronts one model")
    return upstreams, infos


def _fail(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the proxy until SIGINT/SIGTERM; a managed llama-server is stopped with it."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per call to llama-server
    if bool(args.llama_server) == bool(args.upstream):
        _fail("give either --llama-server PATH --model M (managed) or --upstream URL --slot-dir DIR (attach)")
    if args.upstream and not args.slot_dir:
        _fail("--upstream needs --slot-dir: the directory the servers were started with as --slot-save-path")
    if args.llama_server and not args.model:
        _fail("--llama-server needs --model")
    if args.staging_dir and not args.llama_server:
        _fail("--staging-dir is for a managed llama-server; attached ones save where --slot-dir says")
    if args.staging_dir and not (os.path.isdir(args.staging_dir) and os.access(args.staging_dir, os.W_OK | os.X_OK)):
        _fail(f"--staging-dir {args.staging_dir} is not a folder this user can write in")
    if args.parallel < 1:
        _fail("--parallel must be at least 1")
    if not args.flight_wait >= 0:
        _fail("--flight-wait must be 0 or more seconds")
    if args.save_every < 1:
        _fail("--save-every must be at least 1 token")
    if not args.save_idle >= 0:
        _fail("--save-idle must be 0 or more seconds")
    if args.chunk_tokens < 0:
        _fail("--chunk-tokens must be 0 (whole states) or more")
    try:
        args.restore = args.restore or mode_from_environment()
    except ValueError as exc:
        _fail(str(exc))
    managed: _Managed | None = None
    if args.llama_server:
        base = _staging_base() if args.staging_dir is None else os.path.abspath(args.staging_dir)
        staging = _staging_dir(base)
    else:
        staging = os.path.abspath(args.slot_dir)
    if args.keep_ready:
        try:
            args.keep_ready_in = _kept_dir(base) if args.llama_server else staging
        except ProxyError as exc:
            _fail(str(exc))
    else:
        args.keep_ready_in = None
    if args.ready_bytes is None:
        args.ready_bytes = ready_budget(free_bytes(staging) or 0)
    _warn_if_cramped(staging)
    _note_pages(staging)
    try:
        cache = registry.open(args.cache)
    except Exception as exc:
        _fail(f"cannot open the store: {exc}")
    try:
        if args.llama_server:
            managed = start_llama_server(
                args.llama_server, args.model, args.parallel, staging, args.server_args, args.port
            )
            urls = [managed.url]
        else:
            urls = args.upstream
        # uvicorn raises the signal that stopped it again after shutting down: for SIGTERM that
        # would end the process before the managed llama-server is stopped and staging removed.
        signal.signal(signal.SIGTERM, _stopped)
        asyncio.run(_serve(args, urls, staging, cache, managed))
    except (_Stopped, KeyboardInterrupt):  # uvicorn has shut down; stop llama-server below
        pass
    except ProxyError as exc:
        _fail(str(exc))
    finally:
        if managed is not None:
            stop_llama_server(managed)
            shutil.rmtree(staging, ignore_errors=True)
        cache.close()
    return 0


async def _index_then_warm(store: SlotStore, proxy: Proxy | None) -> None:
    """Read the store's index (`SlotStore.load_index`), then make ready files (`Proxy.warm`)."""
    await asyncio.to_thread(store.load_index)
    if proxy is not None:
        await proxy.warm()


async def _serve(
    args: argparse.Namespace, urls: Sequence[str], staging: str, cache: CacheBackend, managed: _Managed | None
) -> None:
    import uvicorn

    # No kept-alive connections: llama-server may close one after a streamed answer, and a request
    # sent on it would fail as if the server were down. A loopback connect costs a fraction of a ms.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None), limits=limits) as client:
        upstreams, infos = await _connect(urls, staging, args.api_key, client)
        model_path = args.model or infos[0].model_path
        facts = read_model_facts(model_path) if model_path and os.path.isfile(model_path) else None
        if facts and facts.kind == "swa" and managed is None:
            for upstream, info in zip(upstreams, infos, strict=True):
                if not info.n_ctx or info.n_ctx > facts.n_swa + 64:  # a window shorter than a slot
                    await check_extends_restores(upstream, staging, facts.n_swa, info.n_ctx)
        digest, described = fingerprint(infos[0], facts)
        store = SlotStore(
            cache,
            fingerprint=digest,
            facts=described,
            kind=facts.kind if facts else "full",
            staging=staging,
            min_tokens=args.min_tokens,
            secret=frame.secret_from_environment(),
            chunk_tokens=args.chunk_tokens,
            ready_bytes=args.ready_bytes,
            keep_ready_in=args.keep_ready_in,
        )
        metrics = ProxyMetrics()
        metrics.store_errors.set_function(lambda: store.errors)
        metrics.ready_files.set_function(lambda: len(store.ready))
        metrics.ready_bytes.set_function(lambda: store.ready.nbytes)
        Gauge(
            "sippcache_proxy_states_stored_whole",
            "Slot states stored as one whole entry although chunking is on: states stateformat could not cut.",
            registry=metrics.registry,
        ).set_function(lambda: store.stored_whole)
        proxy = Proxy(
            upstreams,
            SlotTable([i.slots for i in infos], args.max_queue, store.can_cut),
            store,
            metrics,
            client,
            args.scope,
            args.flight_wait,
            RestoreRates(args.restore),
            save_every=args.save_every,
            save_idle=args.save_idle,
        )
        if args.rates_dir:
            for upstream in upstreams:
                place = upstream.url
                if managed is not None:  # its URL is a new port each start: named by what it runs instead
                    place = "managed\n" + "\n".join([args.llama_server, args.model, *args.server_args])
                path = rates_file(args.rates_dir, digest, place)
                loaded = proxy.rates.keep(upstream.url, path)
                log.info("restore rates of %s kept in %s (%d samples from before)", upstream.url, path, loaded)
        wanted = [
            (upstream.url, slot, largest)
            for upstream, info in zip(upstreams, infos, strict=True)
            if (largest := proxy.rates.largest_state(upstream.url))
            for slot in range(info.slots)
        ]
        ahead = made_ahead(wanted, free_bytes(staging) or 0)
        if len(ahead) < len(wanted):
            log.info(
                "sippcache proxy: staging files made ahead for %d of %d slots (at most half of %s's room)",
                len(ahead),
                len(wanted),
                staging,
            )
        # In the background: the store's index, and each slot's staging file for the largest state seen there.
        # Then, with --warm-ready, ready files of the states used last.
        preparing = [asyncio.create_task(_index_then_warm(store, proxy if args.warm_ready else None))]
        preparing += [asyncio.create_task(asyncio.to_thread(store.prepare, url, *made)) for url, *made in ahead]
        config = uvicorn.Config(proxy, host=args.host, port=args.port, log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        print(
            f"sippcache proxy: http://{args.host}:{args.port} -> {', '.join(urls)} "
            f"({sum(i.slots for i in infos)} slots, {store.kind} memory, "
            f"{f'chunks of {store.chunk_tokens} tokens' if store.chunk_tokens else 'whole states'}, "
            f"cache {getattr(cache, 'location', type(cache).__name__)})",
            file=sys.stderr,
            flush=True,
        )
        try:
            await server.serve()
        finally:
            # uvicorn raises SIGINT again once it has shut down, and asyncio.run cancels this task for
            # it: the files are still closed (restore files removed, ready files removed or kept).
            try:
                proxy.stop_warming()
                await asyncio.gather(*preparing)
            finally:
                store.close()  # an attached server's --slot-save-path stays
