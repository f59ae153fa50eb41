"""Commands that change stores: prune, pin, clear, copy."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

import click
from rich.filesize import decimal as human_size
from rich.progress import Progress

from ..errors import CacheFull
from ..eviction import DEFAULT_POLICY
from ..frame import secret_from_environment
from ..protocol import CacheBackend, EntryInfo
from ..registry import redact_url
from ..state.chunkentries import pin_chain
from .errors import CLIError, one_line_errors, open_store, same_store
from .output import ID_LENGTH, byte_progress, echo_json, entries, entry_id
from .params import json_option, parse_age, parse_size, resolve_url, url_argument


@click.command()
@url_argument
@click.option(
    "--max-bytes",
    metavar="SIZE",
    callback=parse_size,
    help="Delete entries down to SIZE (2GiB), in the order the store evicts them.",
)
@click.option(
    "--older-than", metavar="AGE", callback=parse_age, help="Delete entries unused for AGE (30s, 15m, 12h, 7d, 2w)."
)
@click.option("--namespace", "-n", metavar="N", help="Only prune (and count) this namespace.")
@json_option
@one_line_errors
def prune(
    url: str | None,
    cache_option: str | None,
    max_bytes: int | None,
    older_than: float | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """Delete old entries, or entries beyond a size; pinned entries stay.

    --older-than goes first, then --max-bytes; sizes count as in stats
    (blob plus 4 bytes per token; pinned entries count too). At least one of
    the two is required. --max-bytes deletes in the order the store's own
    eviction does (sippcache.eviction's default policy: entries a later one
    took the place of first, then the least valuable, least recently used).
    """
    if max_bytes is None and older_than is None:
        raise click.UsageError("give --max-bytes, --older-than or both")
    url = resolve_url(url, cache_option)
    with open_store(url, read_only=False) as cache:
        listed = list(cache.entries(namespace))
        kept = [e for e in listed if not e.pinned]
        doomed: list[EntryInfo] = []
        if older_than is not None:
            cutoff = time.time() - older_than
            doomed = [e for e in kept if e.last_used < cutoff]
            kept = [e for e in kept if e.last_used >= cutoff]
        if max_bytes is not None:
            total = sum(e.size for e in listed if e.pinned) + sum(e.size for e in kept)
            for entry in DEFAULT_POLICY.order(kept):
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
        echo_json(result)
    else:
        click.echo(
            f"deleted {entries(result['deleted'])} ({human_size(result['bytes'])}); "
            f"{entries(result['remaining_entries'])} ({human_size(result['remaining_bytes'])}) left"
        )


@click.command()
@click.argument("ids", nargs=-1, required=True, metavar="ID...")
@click.option(
    "--cache",
    "cache_option",
    metavar="URL",
    help="The cache URL (default: $SIPPCACHE_URL, else LMDB in the user cache folder).",
)
@click.option("--unpin", is_flag=True, help="Make the entries evictable again.")
@json_option
@one_line_errors
def pin(ids: tuple[str, ...], cache_option: str | None, unpin: bool, as_json: bool) -> None:
    """Pin entries (by the ids `sippcache ls` shows, or a unique start of one):
    budgets never evict them and prune leaves them. A state stored in chunks is
    pinned with its chain. --unpin undoes it.

    Pinning more than the store's max_bytes is refused.
    """
    url = resolve_url(None, cache_option)
    secret = secret_from_environment()
    with open_store(url, read_only=False) as cache:
        listed = list(cache.entries())
        chosen = [_find_entry(listed, wanted) for wanted in ids]
        for entry in chosen:
            pin_chain(cache, list(entry.key), namespace=entry.namespace, pinned=not unpin, secret=secret)
    done = [entry_id(entry) for entry in chosen]
    if as_json:
        echo_json({"unpinned" if unpin else "pinned": done})
    else:
        click.echo(f"{'unpinned' if unpin else 'pinned'} {entries(len(done))}: {' '.join(done)}")


def _find_entry(listed: list[EntryInfo], wanted: str) -> EntryInfo:
    """The one entry whose id starts with `wanted`."""
    wanted = wanted.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{4,32}", wanted):
        raise CLIError(f"{wanted!r} is not an entry id (4 or more hex digits, as `sippcache ls` shows)")
    found = [e for e in listed if entry_id(e).startswith(wanted[:ID_LENGTH])]
    if not found:
        raise CLIError(f"no entry with id {wanted}")
    if len(found) > 1:
        raise CLIError(f"id {wanted} is ambiguous ({len(found)} entries); give more digits")
    return found[0]


@click.command()
@url_argument
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@one_line_errors
def clear(url: str | None, cache_option: str | None, yes: bool, as_json: bool) -> None:
    """Remove every entry in every namespace (asks first unless --yes)."""
    url = resolve_url(url, cache_option)
    with open_store(url, read_only=False) as cache:
        info = cache.stats()
        if not yes:
            click.confirm(
                f"Remove all {entries(info.entries)} ({human_size(info.bytes)}) from {info.location}?",
                abort=True,
                err=True,
            )
        cache.clear()
    if as_json:
        echo_json({"deleted": info.entries, "bytes": info.bytes})
    else:
        click.echo(f"removed {entries(info.entries)} ({human_size(info.bytes)}) from {info.location}")


def _copy_entries(
    src: CacheBackend, dst: CacheBackend, listed: Iterable[EntryInfo], progress: Progress
) -> tuple[int, int, int, int]:
    """Copy `listed` entries (with their pins, priorities and generations) from `src` to
    `dst`; (copied, their bytes, skipped because gone, copied unpinned for lack of room)."""
    listed = list(listed)
    task = progress.add_task("copy", total=sum(e.size for e in listed))
    copied = size = skipped = unpinned = 0
    for entry in listed:
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
            try:
                dst.store(
                    key,
                    blob,
                    namespace=entry.namespace,
                    priority=entry.priority,
                    generation=entry.generation,
                    pinned=entry.pinned,
                )
            except CacheFull:  # more pinned entries than the destination's budget: copy it unpinned
                dst.store(key, blob, namespace=entry.namespace, priority=entry.priority, generation=entry.generation)
                unpinned += 1
            copied += 1
            size += entry.size
        progress.advance(task, entry.size)
    return copied, size, skipped, unpinned


@click.command()
@click.argument("src_url", metavar="SRC_URL")
@click.argument("dst_url", metavar="DST_URL")
@click.option("--namespace", "-n", metavar="N", help="Only copy this namespace.")
@json_option
@one_line_errors
def copy(src_url: str, dst_url: str, namespace: str | None, as_json: bool) -> None:
    """Copy entries (same namespaces, keys, pins, priorities and generations)
    from one store into another.

    The destination is created if needed; its own limits apply, so it may
    evict, and pinned entries beyond its budget are copied unpinned. Entries
    are copied least recently used first, so the destination keeps the
    source's recency order, but their times become the copy's. Reading the
    source does not count as a use.
    """
    shown_src, shown_dst = redact_url(src_url), redact_url(dst_url)
    if same_store(src_url, dst_url):
        raise CLIError(f"{shown_src} and {shown_dst} are the same store")
    with open_store(src_url, read_only=True) as src, open_store(dst_url, read_only=False, must_exist=False) as dst:
        listed = list(src.entries(namespace))
        with byte_progress("copying") as progress:
            copied, size, skipped, unpinned = _copy_entries(src, dst, listed, progress)
        counters = dst.stats()
    result = {
        "copied": copied,
        "bytes": size,
        "skipped": skipped,
        "evicted": counters.evictions,
        "refused": counters.refused,
        "unpinned": unpinned,
        "source": shown_src,
        "destination": shown_dst,
    }
    if as_json:
        echo_json(result)
        return
    click.echo(f"copied {entries(copied)} ({human_size(size)}) from {shown_src} to {shown_dst}")
    if skipped:
        click.echo(f"skipped {entries(skipped)} deleted from the source meanwhile")
    if unpinned:
        click.echo(
            f"warning: {entries(unpinned)} copied unpinned: pinned entries exceed the destination's budget", err=True
        )
    if counters.evictions or counters.refused:
        click.echo(
            f"warning: the destination evicted {counters.evictions:,} and refused {counters.refused:,} entries "
            "to stay within its limits",
            err=True,
        )
