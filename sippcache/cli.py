"""The `sippcache` command: inspect, check, trim and copy cache stores.

Every command that works on a store takes its URL as an argument or with
``--cache URL`` (default: `sippcache.default_url()`). Errors are one line on
stderr (``error: ...``), never a traceback: exit code 2 for bad input or a
store that cannot be used, 1 for an aborted confirmation or (verify) bad
entries left in place.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from . import frame as _frame
from . import tokens as _tokens
from .engine import entry_id
from .errors import CacheFull, SippcacheError
from .options import Size
from .protocol import CacheBackend, EntryInfo
from .registry import backends as list_backends
from .registry import default_url, parse_url
from .registry import open as open_cache

F = TypeVar("F", bound=Callable[..., Any])

#: The file each built-in persistent backend keeps in its directory: without it there is no store.
_STORE_FILES = {"lmdb": "data.mdb", "diskcache": "cache.db"}
#: Namespaces made by the llama adapter: llama:<model fingerprint>/<scope>.
_LLAMA_NAMESPACE = re.compile(r"llama:([0-9a-f]{32})/(.*)", re.DOTALL)


# -- one-line errors ---------------------------------------------------------------


class CLIError(click.ClickException):
    """A failure reported as one ``error: ...`` line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {_one_line(self.format_message())}", err=True)


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "unknown error"


def _expected_errors() -> tuple[type[BaseException], ...]:
    """What bad input or an unusable store raises: reported in one line, not as a traceback."""
    errors: list[type[BaseException]] = [SippcacheError, ValueError, OSError, sqlite3.Error]
    lmdb = sys.modules.get("lmdb")  # only if a store used it: the package is optional
    if lmdb is not None:
        errors.append(lmdb.Error)
    return tuple(errors)


def one_line_errors(fn: F) -> F:
    """Turn the errors bad input causes into `CLIError` (``error: <message>``, exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as exc:
            if not isinstance(exc, _expected_errors()):
                raise
            raise CLIError(str(exc) or type(exc).__name__) from None

    return wrapper  # type: ignore[return-value]


class _OneLineUsageErrors(click.Group):
    """A group whose usage errors (unknown option, bad value, ...) are one line too."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        with _usage_errors_in_one_line():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_errors_in_one_line():
            return super().invoke(ctx)


_NoArgsIsHelp: tuple[type[BaseException], ...] = tuple(
    cls for cls in [getattr(click.exceptions, "NoArgsIsHelpError", None)] if cls is not None
)


@contextmanager
def _usage_errors_in_one_line() -> Iterator[None]:
    try:
        yield
    except _NoArgsIsHelp:  # `sippcache` alone prints the help
        raise
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        raise CLIError(_one_line(exc.format_message()) + hint) from None


# -- shared options and helpers ---------------------------------------------------------


def url_argument(fn: F) -> F:
    """The cache URL, as an optional argument or ``--cache URL`` (resolved by `_resolve_url`)."""
    fn = click.option("--cache", "cache_option", metavar="URL", help="The cache URL (same as the URL argument).")(fn)
    return click.argument("url", required=False, metavar="[URL]")(fn)  # type: ignore[return-value]


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


def _resolve_url(url: str | None, cache_option: str | None) -> str:
    if url is not None and cache_option is not None and url != cache_option:
        raise click.UsageError("give the cache URL as an argument or with --cache, not both")
    return url or cache_option or default_url()


def _store_path(url: str) -> tuple[str, str] | None:
    """(backend, absolute directory) for the built-in persistent backends; None otherwise."""
    name, location, _ = parse_url(url)
    if name not in _STORE_FILES or not location:
        return None
    return name, os.path.abspath(os.path.expanduser(location))


def _open(url: str, *, must_exist: bool = True) -> CacheBackend:
    """Open the store `url` names; with `must_exist`, never create one where there is none."""
    where = _store_path(url)
    if must_exist and where is not None:
        name, path = where
        if not os.path.isdir(path):
            raise CLIError(f"no cache at {url} (directory {path} does not exist)")
        if not os.path.exists(os.path.join(path, _STORE_FILES[name])):
            raise CLIError(f"no cache at {url} ({path} holds no {name} store)")
    try:
        return open_cache(url)
    except sqlite3.Error as exc:  # its messages do not say which file
        raise CLIError(f"cannot open {url}: {exc}") from None


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=None))


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _local_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int | None) -> str:
    return "unlimited" if n is None else f"{human_size(n)} ({n:,} B)" if n >= 1000 else f"{n} B"


def _entries(n: int) -> str:
    return f"{n:,} entry" if n == 1 else f"{n:,} entries"


def _namespace_label(namespace: str) -> str:
    return namespace if namespace else '""'


def _split_namespace(namespace: str) -> tuple[str | None, str | None]:
    """(model fingerprint, scope) of a llama adapter namespace, else (None, None)."""
    match = _LLAMA_NAMESPACE.fullmatch(namespace)
    return (match.group(1), match.group(2)) if match else (None, None)


def _entry_id(entry: EntryInfo) -> str:
    """A short id naming an entry on the command line (hex of its namespace and key hash)."""
    return entry_id(entry.namespace, _tokens.encode(entry.key)).hex()[:_ID_LENGTH]


_ID_LENGTH = 12


def _entry_row(entry: EntryInfo) -> dict[str, Any]:
    return {
        "id": _entry_id(entry),
        "namespace": entry.namespace,
        "tokens": len(entry.key),
        "bytes": entry.size,
        "created": _iso(entry.created),
        "last_used": _iso(entry.last_used),
        "pinned": entry.pinned,
        "priority": entry.priority,
    }


def _progress(what: str) -> Progress:
    """A progress bar in bytes on stderr (stdout stays clean for --json); silent when stderr is not a terminal."""
    console = Console(stderr=True)
    return Progress(
        TextColumn(what), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )  # fmt: skip


class SizeType(click.ParamType):
    """A byte count: 1048576, 512MiB, 2GiB, 1.5GB."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return Size.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class AgeType(click.ParamType):
    """A duration: a number and a unit, s, m, h, d or w (30s, 15m, 12h, 7d, 2w)."""

    name = "AGE"
    _UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    _PATTERN = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", re.IGNORECASE)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        match = self._PATTERN.fullmatch(value)
        if match is None:
            self.fail(f"{value!r} is not an age (examples: 30s, 15m, 12h, 7d, 2w)", param, ctx)
        return float(match.group(1)) * self._UNITS[match.group(2).lower()]


# -- commands -----------------------------------------------------------------------


@click.group(cls=_OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sippcache")
def main() -> None:
    """Persistent prefix-state cache for llama.cpp.

    Commands that work on a store take its URL as an argument or with --cache
    (default: $SIPPCACHE_URL, else an LMDB store in the user cache folder).
    """


@main.command()
@json_option
def backends(as_json: bool) -> None:
    """List every backend, where it comes from, and whether it is usable here (and why not)."""
    info = list_backends()
    if as_json:
        click.echo(json.dumps({name: asdict(item) for name, item in info.items()}))
        return
    table = Table("backend", "from", "usable", "problem")
    for item in info.values():
        table.add_row(item.name, item.origin, "yes" if item.usable else "no", item.problem or "")
    Console().print(table)


@main.command()
@url_argument
@json_option
@one_line_errors
def stats(url: str | None, cache_option: str | None, as_json: bool) -> None:
    """Entries, bytes and limits of a store, and its namespaces.

    Namespaces made by the llama adapter (llama:<model fingerprint>/<scope>)
    are shown as model and scope. max_bytes and max_entries are the limits of
    the handle this command opened (from the URL's options or the backend's
    defaults), not necessarily those your application uses. Hit and miss
    counters are not shown: they count one open handle's lookups, so a fresh
    process has none.
    """
    url = _resolve_url(url, cache_option)
    with _open(url) as cache:
        info = cache.stats()
        per_namespace: dict[str, list[int]] = {}
        for entry in cache.entries():
            counts = per_namespace.setdefault(entry.namespace, [0, 0])
            counts[0] += 1
            counts[1] += entry.size
    namespaces = []
    for namespace, (count, size) in sorted(per_namespace.items()):
        model, scope = _split_namespace(namespace)
        namespaces.append({"namespace": namespace, "model": model, "scope": scope, "entries": count, "bytes": size})
    if as_json:
        _echo_json(
            {
                "url": url,
                "backend": info.backend,
                "location": info.location,
                "entries": info.entries,
                "bytes": info.bytes,
                "max_bytes": info.max_bytes,
                "max_entries": info.max_entries,
                "namespaces": namespaces,
            }
        )
        return
    console = Console()
    summary = Table(show_header=False, box=None)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("store", f"{info.location} ({info.backend})")
    summary.add_row("entries", f"{info.entries:,}")
    summary.add_row("bytes", _size(info.bytes))
    summary.add_row("max_bytes", _size(info.max_bytes))
    if info.max_entries is not None:
        summary.add_row("max_entries", f"{info.max_entries:,}")
    summary.add_row("namespaces", f"{len(namespaces):,}")
    console.print(summary)
    if namespaces:
        table = Table("namespace", "model", "scope")
        table.add_column("entries", justify="right")
        table.add_column("bytes", justify="right")
        for row in namespaces:
            label = "llama" if row["model"] else _namespace_label(row["namespace"])
            model, scope = row["model"] or "", row["scope"] or ""
            table.add_row(label, model, scope, f"{row['entries']:,}", human_size(row["bytes"]))
        if any(row["model"] for row in namespaces):
            table.caption = "llama rows: namespace llama:<model>/<scope>"
        console.print(table)


@main.command(name="ls")
@url_argument
@click.option("--namespace", "-n", metavar="N", help="Only this namespace (\"\" is the default one).")
@json_option
@one_line_errors
def ls(url: str | None, cache_option: str | None, namespace: str | None, as_json: bool) -> None:
    """List the entries of a store, least recently used first.

    Times are local in the table, ISO 8601 (UTC) in JSON; last-use times are
    saved in batches, so the newest uses may show a second or so late.
    """
    url = _resolve_url(url, cache_option)
    with _open(url) as cache:
        entries = list(cache.entries(namespace))
    if as_json:
        _echo_json([_entry_row(entry) for entry in entries])
        return
    table = Table("id", "namespace")
    table.columns[0].no_wrap = True
    table.columns[1].overflow = "fold"
    for name in ("tokens", "bytes"):
        table.add_column(name, justify="right", no_wrap=True)
    for name in ("created", "last used", "pinned"):
        table.add_column(name, no_wrap=True)
    for entry in entries:
        table.add_row(
            _entry_id(entry), _namespace_label(entry.namespace), f"{len(entry.key):,}", human_size(entry.size),
            _local_time(entry.created), _local_time(entry.last_used), "pinned" if entry.pinned else "",
        )  # fmt: skip
    pinned = sum(e.pinned for e in entries)
    table.caption = f"{_entries(len(entries))}, {human_size(sum(e.size for e in entries))}" + (
        f"; {pinned:,} pinned" if pinned else ""
    )
    Console().print(table)


def _check_entry(cache: CacheBackend, entry: EntryInfo, secret: bytes | None) -> str | None:
    """Why `entry` is bad, or None if its blob is an intact frame for its key (with a
    valid MAC, if a secret is given)."""
    match = cache.lookup(list(entry.key), namespace=entry.namespace, touch=False)
    if match is None or match.length != len(entry.key) or tuple(match.key) != tuple(entry.key):
        if match is not None:
            match.release()
        return "a lookup of its key does not return it"
    try:
        try:
            decoded = _frame.decode(match.blob, secret=secret)
        except Exception as exc:  # any failure to parse the blob makes the entry unusable
            return str(exc) or type(exc).__name__
        same = decoded.tokens == tuple(entry.key)
        del decoded  # its sections are views of the blob
        return None if same else "the frame's tokens differ from the entry's key"
    finally:
        match.release()


@main.command()
@url_argument
@click.option("--delete", is_flag=True, help="Delete the bad entries.")
@json_option
@one_line_errors
def verify(url: str | None, cache_option: str | None, delete: bool, as_json: bool) -> None:
    """Read every entry and check its frame (checksums, sizes, tokens = key).

    With SIPPCACHE_SECRET set, entries must also carry a valid MAC made with it.
    Exit code 1 if bad entries were found and not deleted. Reading does not
    count as a use: recency and last-used times stay as they were.
    """
    url = _resolve_url(url, cache_option)
    secret = _frame.secret_from_environment()
    bad: list[dict[str, Any]] = []
    deleted = 0
    with _open(url) as cache:
        entries = list(cache.entries())
        damaged = cache.stats().damaged
        if damaged:
            bad.append({"namespace": "?", "tokens": 0, "reason": f"{damaged} entries with an unreadable index record"})
            purge = getattr(cache, "purge_damaged", None)
            if delete and purge is not None:
                deleted += purge()
        with _progress("verifying") as progress:
            task = progress.add_task("verify", total=sum(e.size for e in entries))
            for entry in entries:
                reason = _check_entry(cache, entry, secret)
                if reason is not None:
                    bad.append({"namespace": entry.namespace, "tokens": len(entry.key), "reason": reason})
                    if delete and cache.delete(list(entry.key), namespace=entry.namespace):
                        deleted += 1
                progress.advance(task, entry.size)
    if as_json:
        _echo_json({"checked": len(entries), "bad": bad, "deleted": deleted})
    else:
        console = Console()
        if bad:
            table = Table("namespace")
            table.columns[0].overflow = "fold"
            table.add_column("tokens", justify="right")
            table.add_column("reason")
            for row in bad:
                table.add_row(_namespace_label(row["namespace"]), f"{row['tokens']:,}", row["reason"])
            console.print(table)
        note = f", deleted {deleted}" if delete else ""
        console.print(f"checked {_entries(len(entries))}: {len(bad):,} bad{note}", highlight=False)
    if bad and not delete:
        sys.exit(1)


@main.command()
@url_argument
@click.option("--max-bytes", type=SizeType(), help="Delete least recently used entries down to SIZE (2GiB).")
@click.option("--older-than", type=AgeType(), help="Delete entries unused for AGE (30s, 15m, 12h, 7d, 2w).")
@click.option("--namespace", "-n", metavar="N", help="Only prune (and count) this namespace.")
@json_option
@one_line_errors
def prune(
    url: str | None, cache_option: str | None, max_bytes: int | None, older_than: float | None,
    namespace: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Delete old or least recently used entries; pinned entries stay.

    --older-than goes first, then --max-bytes; sizes count as in stats
    (blob plus 4 bytes per token; pinned entries count too). At least one of
    the two is required.
    """
    if max_bytes is None and older_than is None:
        raise click.UsageError("give --max-bytes, --older-than or both")
    url = _resolve_url(url, cache_option)
    with _open(url) as cache:
        listed = list(cache.entries(namespace))  # least recently used first
        entries = [e for e in listed if not e.pinned]
        doomed: list[EntryInfo] = []
        kept = entries
        pinned_bytes = sum(e.size for e in listed if e.pinned)
        if older_than is not None:
            cutoff = time.time() - older_than
            doomed = [e for e in entries if e.last_used < cutoff]
            kept = [e for e in entries if e.last_used >= cutoff]
        if max_bytes is not None:
            total = pinned_bytes + sum(e.size for e in kept)
            for entry in kept:
                if total <= max_bytes:
                    break
                doomed.append(entry)
                total -= entry.size
        deleted = [e for e in doomed if cache.delete(list(e.key), namespace=e.namespace)]
        remaining = list(cache.entries(namespace))
    result = {
        "deleted": len(deleted),
        "bytes": sum(e.size for e in deleted),
        "remaining_entries": len(remaining),
        "remaining_bytes": sum(e.size for e in remaining),
    }
    if as_json:
        _echo_json(result)
    else:
        click.echo(
            f"deleted {_entries(result['deleted'])} ({human_size(result['bytes'])}); "
            f"{_entries(result['remaining_entries'])} ({human_size(result['remaining_bytes'])}) left"
        )


@main.command()
@click.argument("ids", nargs=-1, required=True, metavar="ID...")
@click.option("--cache", "cache_option", metavar="URL", help="The cache URL (default: $SIPPCACHE_URL, else LMDB in the user cache folder).")
@click.option("--unpin", is_flag=True, help="Make the entries evictable again.")
@json_option
@one_line_errors
def pin(ids: tuple[str, ...], cache_option: str | None, unpin: bool, as_json: bool) -> None:
    """Pin entries (by the ids `sippcache ls` shows, or a unique start of one):
    budgets never evict them and prune leaves them. --unpin undoes it.

    Pinning more than the store's max_bytes is refused.
    """
    url = _resolve_url(None, cache_option)
    with _open(url) as cache:
        entries = list(cache.entries())
        chosen = [_find_entry(entries, wanted) for wanted in ids]
        for entry in chosen:
            (cache.unpin if unpin else cache.pin)(list(entry.key), namespace=entry.namespace)
    done = [_entry_id(entry) for entry in chosen]
    if as_json:
        _echo_json({"unpinned" if unpin else "pinned": done})
    else:
        click.echo(f"{'unpinned' if unpin else 'pinned'} {_entries(len(done))}: {' '.join(done)}")


def _find_entry(entries: list[EntryInfo], wanted: str) -> EntryInfo:
    """The one entry whose id starts with `wanted`."""
    wanted = wanted.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{4,32}", wanted):
        raise CLIError(f"{wanted!r} is not an entry id (4 or more hex digits, as `sippcache ls` shows)")
    found = [e for e in entries if _entry_id(e).startswith(wanted[:_ID_LENGTH])]
    if not found:
        raise CLIError(f"no entry with id {wanted}")
    if len(found) > 1:
        raise CLIError(f"id {wanted} is ambiguous ({len(found)} entries); give more digits")
    return found[0]


@main.command()
@url_argument
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@one_line_errors
def clear(url: str | None, cache_option: str | None, yes: bool, as_json: bool) -> None:
    """Remove every entry in every namespace (asks first unless --yes)."""
    url = _resolve_url(url, cache_option)
    with _open(url) as cache:
        info = cache.stats()
        if not yes:
            click.confirm(
                f"Remove all {_entries(info.entries)} ({human_size(info.bytes)}) from {info.location}?",
                abort=True, err=True,
            )  # fmt: skip
        cache.clear()
    if as_json:
        _echo_json({"deleted": info.entries, "bytes": info.bytes})
    else:
        click.echo(f"removed {_entries(info.entries)} ({human_size(info.bytes)}) from {info.location}")


def _copy_entries(
    src: CacheBackend, dst: CacheBackend, entries: Iterable[EntryInfo], progress: Progress
) -> tuple[int, int, int, int]:
    """Copy `entries` (with their pins, priorities and generations) from `src` to
    `dst`; (copied, their bytes, skipped because gone, copied unpinned for lack of room)."""
    entries = list(entries)
    task = progress.add_task("copy", total=sum(e.size for e in entries))
    copied = size = skipped = unpinned = 0
    for entry in entries:
        key = list(entry.key)
        match = src.lookup(key, namespace=entry.namespace, touch=False)
        if match is None or match.length != len(key):  # deleted since it was listed
            if match is not None:
                match.release()
            skipped += 1
        else:
            try:
                blob = bytes(match.blob)
            finally:
                match.release()
            retention = dict(namespace=entry.namespace, priority=entry.priority, generation=entry.generation)
            try:
                dst.store(key, blob, pinned=entry.pinned, **retention)
            except CacheFull:  # more pinned entries than the destination's budget: copy it unpinned
                dst.store(key, blob, **retention)
                unpinned += 1
            copied += 1
            size += entry.size
        progress.advance(task, entry.size)
    return copied, size, skipped, unpinned


@main.command()
@click.argument("src_url", metavar="SRC_URL")
@click.argument("dst_url", metavar="DST_URL")
@click.option("--namespace", "-n", metavar="N", help="Only copy this namespace.")
@json_option
@one_line_errors
def copy(src_url: str, dst_url: str, namespace: str | None, as_json: bool) -> None:
    """Copy entries (same namespaces, keys, pins, priorities and generations)
    from one store into another.

    The destination is created if needed; its own limits apply, so it may
    evict, and pinned entries beyond its budget are copied unpinned. Entries are copied least recently used first, so the destination
    keeps the source's recency order, but their times become the copy's.
    Reading the source does not count as a use.
    """
    src_where, dst_where = _store_path(src_url), _store_path(dst_url)
    if src_where is not None and src_where == dst_where:
        raise CLIError(f"{src_url} and {dst_url} are the same store")
    with _open(src_url) as src, _open(dst_url, must_exist=False) as dst:
        entries = list(src.entries(namespace))
        with _progress("copying") as progress:
            copied, size, skipped, unpinned = _copy_entries(src, dst, entries, progress)
        counters = dst.stats()
    result = {
        "copied": copied,
        "bytes": size,
        "skipped": skipped,
        "evicted": counters.evictions,
        "refused": counters.refused,
        "unpinned": unpinned,
        "source": src_url,
        "destination": dst_url,
    }
    if as_json:
        _echo_json(result)
        return
    click.echo(f"copied {_entries(copied)} ({human_size(size)}) from {src_url} to {dst_url}")
    if skipped:
        click.echo(f"skipped {_entries(skipped)} deleted from the source meanwhile")
    if unpinned:
        click.echo(f"warning: {_entries(unpinned)} copied unpinned: pinned entries exceed the destination's budget", err=True)
    if counters.evictions or counters.refused:
        click.echo(
            f"warning: the destination evicted {counters.evictions:,} and refused {counters.refused:,} entries "
            "to stay within its limits",
            err=True,
        )


# -- commands implemented in sippcache.demo (imported when run) ----------------------------

_FILE = click.Path(exists=True, dir_okay=False)
_json_report = click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")


@main.command()
@click.option("--cache", "cache_url", metavar="URL", help="The cache URL to use.")
@_json_report
@one_line_errors
def demo(cache_url: str | None, as_json: bool) -> None:
    """Show the cache at work on a small model: a cold and a warm request."""
    from .demo import run_demo

    sys.exit(run_demo(cache_url, as_json=as_json))


@main.command()
@click.option("--model", "model_path", required=True, type=_FILE, help="The GGUF model file.")
@click.option("--prompt-file", "prompt_files", multiple=True, type=_FILE, help="A prompt to precompute (repeatable).")
@click.option("--scope", default="default", show_default=True, help="The namespace scope (as in PrefixCache).")
@click.option("--pin", is_flag=True, help="Pin the prompts' entries (e.g. a system prompt): budgets never evict them.")
@url_argument
@_json_report
@one_line_errors
def warm(
    model_path: str, prompt_files: tuple[str, ...], scope: str, pin: bool,
    url: str | None, cache_option: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Precompute and store the states of prompts for a model."""
    from .demo import warm as run_warm

    cache_url = _resolve_url(url, cache_option)
    sys.exit(run_warm(model_path, list(prompt_files), cache_url, scope=scope, pin=pin, as_json=as_json))


@main.command()
@click.option("--quick", is_flag=True, help="A shorter run.")
@_json_report
@one_line_errors
def bench(quick: bool, as_json: bool) -> None:
    """Measure time to first token with and without the cache."""
    from .demo import bench as run_bench

    sys.exit(run_bench(quick=quick, as_json=as_json))


# -- the server, implemented in sippcache.serve (imported when run) --------------------------------


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[SERVER OPTIONS]... [--cache URL]")
def serve(args: tuple[str, ...]) -> None:
    """Serve models over HTTP: llama-cpp-python's OpenAI-compatible server with
    this cache (every option of `python -m llama_cpp.server`, plus --cache URL;
    see `sippcache serve --help`)."""
    try:
        from .serve import main as serve_main
    except ImportError as exc:
        raise CLIError(f'sippcache serve needs the server extra: pip install "sippcache[server]" ({exc})') from None
    sys.exit(serve_main(list(args), prog="sippcache serve"))


if __name__ == "__main__":
    main()
