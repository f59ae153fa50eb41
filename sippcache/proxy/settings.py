"""``sippcache proxy``'s options, declared once (`sippcache.flags`): the parser, the checks and
docs/proxy.md's table come from `proxy_flags`.

None needs tuning: a user who gives only ``--llama-server`` and ``--model``
gets what was measured best for the machine it runs on (restores where the
rates measured there say they beat computing, ready files within a quarter of
the slot folder's room, staging in RAM where there is room).
"""

from __future__ import annotations

import argparse
import os

from ..flags import Flag, add_flags
from ..options import Size
from ..state.chunks import DEFAULT_CHUNK_TOKENS
from ..state.rates import MODES, rates_dir
from .saving import SAVE_EVERY, SAVE_IDLE
from .staging import RAM_DISK, RAM_DISK_ROOM, READY_BYTES

__all__ = ["build_parser", "proxy_flags"]

MANAGED = "start: a llama-server the proxy runs (managed)"
ATTACH = "start: llama-servers you run (attach)"
STORE = "the store"
SERVER = "the proxy's server"
TUNING = "tuning (measured defaults: none needs setting)"


def _size(text: str) -> int:
    try:
        return Size.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def proxy_flags() -> list[Flag]:
    """The proxy's options, in ``--help``'s order. Made when asked: defaults read the environment."""
    return [
        Flag("--llama-server", MANAGED, "the llama-server binary to start", metavar="PATH"),
        Flag("--model", MANAGED, "the model llama-server loads", metavar="GGUF", short=("-m",)),
        Flag("--parallel", MANAGED, "slots: requests served at once", int, 1, metavar="N", short=("-np",), lowest=1),
        Flag(
            "--staging-dir",
            MANAGED,
            "where the proxy makes the private folder its slot files go through; a tmpfs with huge pages is fastest",
            shown=f"{RAM_DISK} where it has {RAM_DISK_ROOM >> 30} GiB free, else the temporary folder",
            metavar="DIR",
            see="a-ram-disk-with-huge-pages",
        ),
        Flag("--upstream", ATTACH, "a llama-server (repeatable)", default=[], metavar="URL", action="append"),
        Flag("--slot-dir", ATTACH, "the --slot-save-path every upstream was started with", metavar="DIR"),
        Flag(
            "--cache",
            STORE,
            "the store",
            shown="$SIPPCACHE_URL, else LMDB in the user cache folder",
            metavar="URL",
        ),
        Flag(
            "--scope",
            STORE,
            "the default tenant: entries of one scope are never another's; a request's X-Sippcache-Scope "
            "header overrides it",
            default="",
            shown='""',
            metavar="S",
        ),
        Flag("--min-tokens", STORE, "slot states shorter than this are not stored", int, 16, metavar="N", lowest=1),
        Flag(
            "--chunk-tokens",
            STORE,
            "states are stored as chunks of N tokens, shared by every state with that prefix, and a tail: a "
            "conversation's later save writes only its new chunks (0: whole states; recurrent and hybrid models' "
            "are stored whole)",
            int,
            DEFAULT_CHUNK_TOKENS,
            metavar="N",
            aliases=("--chunk_tokens",),
            lowest=0,
            see="chunked-states",
        ),
        Flag("--host", SERVER, "where the proxy listens", default="127.0.0.1", metavar="HOST"),
        Flag("--port", SERVER, "the port it listens on", int, 8090, metavar="PORT"),
        Flag(
            "--api-key",
            SERVER,
            "llama-server's --api-key, for the proxy's own calls (clients send their own Authorization, "
            "forwarded as it is)",
            default=os.environ.get("LLAMA_API_KEY"),
            shown="$LLAMA_API_KEY",
            metavar="KEY",
        ),
        Flag(
            "--max-queue",
            SERVER,
            "requests waiting for a slot; past it a 503 with Retry-After",
            int,
            64,
            metavar="N",
            aliases=("--max_queue",),
            lowest=0,
        ),
        Flag(
            "--restore",
            TUNING,
            "when to restore a stored state: auto, where loading it is expected to be faster than llama-server "
            "computing its tokens, from the rates measured on each upstream; always; never (states are still "
            "stored)",
            shown="$SIPPCACHE_RESTORE, else auto",
            metavar="MODE",
            choices=MODES,
            see="when-a-restore-is-skipped",
        ),
        Flag(
            "--rates-dir",
            TUNING,
            "where the rates measured on each upstream are kept for the next proxy at the same place (same "
            "model, build and server), so a restart does not restore blindly until it has measured again "
            "('': not kept)",
            default=rates_dir(),
            shown="$SIPPCACHE_RATES_DIR, else rates/ in the user cache folder",
            metavar="DIR",
            see="rates-kept-across-restarts",
        ),
        Flag(
            "--flight-wait",
            TUNING,
            "how long a request waits for one in flight that computes a long prefix of its prompt, to restore "
            "its state instead of computing it again (0: never)",
            float,
            60.0,
            metavar="SECONDS",
            lowest=0,
            unit="seconds",
        ),
        Flag(
            "--save-every",
            TUNING,
            "a conversation's state left in its slot is saved once it holds this many tokens beyond the store: "
            "what a crash can lose (it is saved anyway when the slot changes hands, sits idle, or the proxy stops)",
            int,
            SAVE_EVERY,
            metavar="TOKENS",
            lowest=1,
            unit="token",
            see="when-a-slot-is-saved",
        ),
        Flag(
            "--save-idle",
            TUNING,
            "an unsaved slot is saved after this long unused (0: as soon as it is free)",
            float,
            SAVE_IDLE,
            metavar="SECONDS",
            aliases=("--save_idle",),
            lowest=0,
            unit="seconds",
        ),
        Flag(
            "--ready-bytes",
            TUNING,
            "ready files: the slot files llama-server saved, kept up to SIZE (512MiB, 8GiB) in its slot folder; "
            "a prompt one serves at least as well as the store is restored from it with nothing read or copied "
            "(0: none)",
            _size,
            shown=f"a quarter of the slot folder's free room at start, at most {READY_BYTES >> 30} GiB",
            metavar="SIZE",
            see="ready-slot-files-a-restore-with-no-copy",
        ),
        Flag(
            "--ready-keep",
            TUNING,
            "keep the ready files when the proxy exits, for the next proxy on this folder (and model): they stay "
            "in RAM where the folder is a tmpfs",
            default=False,
            action="store_true",
            aliases=("--keep-ready",),
        ),
        Flag(
            "--ready-warm",
            TUNING,
            "after the start, make the store's most recently used states of this model ready files (within "
            "--ready-bytes, one at a time while no request runs), so a follow-up after a restart is "
            "llama-server's own restore",
            default=True,
            action=argparse.BooleanOptionalAction,
            aliases=("--warm-ready",),
            see="made-at-start-a-restarts-follow-up-without-a-copy",
        ),
    ]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The proxy's parser: `proxy_flags` in their groups, then ``-- ARGS`` for a managed llama-server."""
    parser = argparse.ArgumentParser(
        prog=prog or "sippcache proxy",
        description="An OpenAI-compatible proxy that gives llama.cpp's llama-server a persistent, shared prefix cache.",
    )
    add_flags(parser, proxy_flags())
    parser.add_argument("server_args", nargs="*", metavar="-- ARGS", help="more llama-server arguments (managed)")
    return parser
