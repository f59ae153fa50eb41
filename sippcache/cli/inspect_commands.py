"""Commands that report on stores: backends, stats, ls, verify.

Only ``verify --delete`` changes a store; the others open it `read_only`.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TypedDict

import click
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.table import Table

from .. import frame as _frame
from .. import tokens as _tokens
from ..base import BaseBackend
from ..protocol import CacheBackend, EntryInfo
from ..registry import backends as list_backends
from ..registry import redact_url
from ..state import chunkentries
from .absent import AbsentStore
from .errors import one_line_errors, open_store
from .output import (
    EntryRow,
    add_row,
    byte_progress,
    echo_json,
    entries,
    entry_id,
    entry_row,
    first_that_fits,
    literal,
    local_time,
    namespace_label,
    print_table,
    short_size,
    size_and_bytes,
    split_namespace,
)
from .params import is_default_store, json_option, resolve_url, url_argument


class NamespaceRow(TypedDict):
    """One namespace in ``stats --json``."""

    namespace: str
    model: str | None
    scope: str | None
    entries: int
    bytes: int


class BadEntry(TypedDict):
    """One bad entry in ``verify --json``."""

    namespace: str
    tokens: int
    reason: str


@click.command()
@json_option
def backends(as_json: bool) -> None:
    """List every backend, where it comes from, and whether it is usable here (and why not)."""
    info = list_backends()
    if as_json:
        echo_json({name: asdict(item) for name, item in info.items()})
        return
    table = Table()
    table.add_column("backend", overflow="fold")
    table.add_column("from", overflow="fold")
    table.add_column("usable", no_wrap=True)
    table.add_column("problem", overflow="fold", ratio=1)  # the long one: it takes what is left
    for item in info.values():
        add_row(table, item.name, item.origin, "yes" if item.usable else "no", item.problem or "")
    print_table(table)


@click.command()
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
    process has none. With no URL, a default store that does not exist yet is
    shown empty (the first store creates it); a store you name must exist.
    """
    default = is_default_store(url, cache_option)
    url = resolve_url(url, cache_option)
    with open_store(url, read_only=True, default=default) as cache:
        exists = not isinstance(cache, AbsentStore)
        info = cache.stats()
        per_namespace: dict[str, list[int]] = {}
        listed = list(cache.entries())
        for entry in listed:
            counts = per_namespace.setdefault(entry.namespace, [0, 0])
            counts[0] += 1
            counts[1] += entry.size
    chunked = chunkentries.usage(listed)
    namespaces: list[NamespaceRow] = []
    for namespace, (count, size) in sorted(per_namespace.items()):
        model, scope = split_namespace(namespace)
        namespaces.append({"namespace": namespace, "model": model, "scope": scope, "entries": count, "bytes": size})
    if as_json:
        echo_json(
            {
                "url": redact_url(url),
                "backend": info.backend,
                "location": info.location,
                "exists": exists,
                "entries": info.entries,
                "bytes": info.bytes,
                "max_bytes": info.max_bytes,
                "max_entries": info.max_entries,
                "namespaces": namespaces,
                "chunked": [{**asdict(use), "per_distinct": round(use.per_distinct, 3)} for use in chunked],
            }
        )
        return
    summary = Table(show_header=False, box=None)
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column(overflow="fold")  # a long store path folds, whole
    add_row(summary, "store", f"{info.location} ({info.backend})")
    if not exists:
        add_row(summary, "exists", "not yet: the first store creates it")
    add_row(summary, "entries", f"{info.entries:,}")
    add_row(summary, "bytes", size_and_bytes(info.bytes))
    add_row(summary, "max_bytes", size_and_bytes(info.max_bytes))
    if info.max_entries is not None:
        add_row(summary, "max_entries", f"{info.max_entries:,}")
    add_row(summary, "namespaces", f"{len(namespaces):,}")
    print_table(summary)
    if namespaces:
        # Roomy: llama namespaces split into model and scope. Narrow: every namespace whole, folded.
        split = _counts_table("namespace", "model", "scope")
        whole = _counts_table("namespace")
        for row in namespaces:
            numbers = f"{row['entries']:,}", short_size(row["bytes"])
            label = "llama" if row["model"] else namespace_label(row["namespace"])
            add_row(split, label, row["model"] or "", row["scope"] or "", *numbers)
            add_row(whole, namespace_label(row["namespace"]), *numbers)
        labels = [namespace_label(row["namespace"]) for row in namespaces]
        split_folding = [
            ["llama" if row["model"] else label for row, label in zip(namespaces, labels, strict=True)],
            [row["scope"] or "" for row in namespaces],
        ]
        table = first_that_fits([(split, split_folding), (whole, [labels])])
        llama_rows = table is split and any(row["model"] for row in namespaces)
        print_table(table, "llama rows: namespace llama:<model>/<scope>" if llama_rows else None)
    if chunked:
        shared = Table()
        for name in ("states of", "states", "chunks", "bytes", "distinct tokens", "x their K/V"):
            shared.add_column(name, overflow="fold", justify="left" if name == "states of" else "right")
        for use in chunked:
            add_row(
                shared,
                namespace_label(use.namespace),
                f"{use.states:,}",
                f"{use.chunks:,}",
                short_size(use.state_bytes + use.chunk_bytes),
                f"{use.distinct_tokens:,}",
                f"{use.per_distinct:.2f}",
            )
        print_table(
            shared,
            "chunked states: the bytes stored against the K/V bytes of the distinct tokens their keys hold "
            "(1.00: each token stored once)",
        )


def _counts_table(*names: str) -> Table:
    """A table of namespaces (columns `names`, folding; a model fingerprint never wraps) with entries and bytes."""
    table = Table()
    for name in names:
        table.add_column(name, no_wrap=name == "model", overflow="fold")
    table.add_column("entries", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    return table


@click.command(name="ls")
@url_argument
@click.option(
    "--namespace", "-n", metavar="N", help='Only this namespace ("" is the default one) and its states\' chunks.'
)
@click.option("--chunks", "each_chunk", is_flag=True, help="List every entry, chunks included, one per row.")
@json_option
@one_line_errors
def ls(url: str | None, cache_option: str | None, namespace: str | None, each_chunk: bool, as_json: bool) -> None:
    """List the states of a store, least recently used first, with their chunks.

    A state (the tail of a state stored in chunks, or a whole entry) is shown
    with the chunks of its chain the store holds (what a restore of it reads),
    how many of those another listed state's chain holds too (a shared system
    prompt's), and the bytes of its chain and its entry together. Chunks that
    no listed state reaches are summed up in one line. --chunks lists every
    entry instead, each chunk in a row of its own. Times are local in the
    table, ISO 8601 (UTC) in JSON; last-use times are saved in batches, so the
    newest uses may show a second or so late. In a narrow terminal the table
    leaves out times (--json has them). With no URL, a default store that does
    not exist yet lists nothing.
    """
    default = is_default_store(url, cache_option)
    url = resolve_url(url, cache_option)
    with open_store(url, read_only=True, default=default) as cache:
        listed = _selected(cache, namespace)
        absent = _absent_note(cache)
    if each_chunk:
        _print_entries(listed, absent, as_json)
        return
    chained, orphans = _chains(listed)
    users = Counter(id(chunk) for state in chained for chunk in state.chain)  # the states each chunk serves
    rows = [_state_row(state, sum(users[id(chunk)] > 1 for chunk in state.chain)) for state in chained]
    orphan_bytes = sum(chunk.size for chunk in orphans)
    if as_json:
        orphan: list[OrphanRow] = [{"orphan_chunks": len(orphans), "bytes": orphan_bytes}] if orphans else []
        echo_json([*rows, *orphan])
        return
    if not users and not orphans:  # no chunks: the table of entries it always was
        _print_entries(listed, absent, as_json=False)
        return
    labels = [namespace_label(row["namespace"]) for row in rows]
    # Roomiest first: with creation times; without; the last-use time on two lines; no times.
    layouts = [
        (_states_table(chained, rows, created=created, used=used, wrap_times=wrap), [labels])
        for created, used, wrap in (
            (True, True, False),
            (False, True, False),
            (False, True, True),
            (False, False, False),
        )
    ]
    table = first_that_fits(layouts)
    reached = {id(chunk): chunk.size for state in chained for chunk in state.chain}
    total = sum(state.entry.size for state in chained) + sum(reached.values())
    shared = sum(count > 1 for count in users.values())
    pinned = sum(row["pinned"] for row in rows)
    caption = (
        f"{_count(len(rows), 'state')} restored with {_count(len(reached), 'chunk')} ({shared:,} shared), "
        f"{human_size(total)} in all; a state's bytes: its chunks' and its own"
    )
    print_table(table, caption + (f"; {pinned:,} pinned" if pinned else ""))
    if orphans:
        orphaned = f"{_count(len(orphans), 'chunk')} no listed state is restored with, {human_size(orphan_bytes)}"
        Console().print(literal(orphaned))


class StateRow(EntryRow):
    """One state (a tail or a whole entry) in ``ls --json``: its entry, and the chain it is restored with."""

    #: The chunk size of its chain (None: no chunk of it is held).
    chunk_tokens: int | None
    #: Chunks of its chain the store holds (from the first, up to the first one missing).
    chunks: int
    #: Those of them that another listed state's chain holds too.
    chunks_shared: int
    #: The bytes of those chunks; and of them and its own entry together.
    chunk_bytes: int
    total_bytes: int


class OrphanRow(TypedDict):
    """The last row of ``ls --json`` where there are chunks that no listed state is restored with."""

    orphan_chunks: int
    bytes: int


@dataclass(frozen=True)
class _Chained:
    """A state, and the chunk entries of its chain that a listing holds, in order."""

    entry: EntryInfo
    chunk_tokens: int | None
    chain: list[EntryInfo]


def _selected(cache: CacheBackend, namespace: str | None) -> list[EntryInfo]:
    """Every entry, least recently used first; with `namespace`, those of it and of its chunk
    namespaces (the chunks its states are restored with live apart: `chunkentries.chunk_namespace`)."""
    listed = list(cache.entries())
    if namespace is None:
        return listed

    def wanted(entry: EntryInfo) -> bool:
        owner = chunkentries.chunk_namespace_parts(entry.namespace)
        return entry.namespace == namespace if owner is None else owner[0] == namespace

    return [entry for entry in listed if wanted(entry)]


def _chains(listed: list[EntryInfo]) -> tuple[list[_Chained], list[EntryInfo]]:
    """Each state of `listed` (an entry outside the chunk namespaces) with its chain as a restore
    reads it: the chunks under its first k*C tokens for k = 1, 2, ... while listed and k*C is
    less than its tokens, in a chunk namespace of its own namespace (of several, other sizes or
    layouts, the one holding most of it); and the chunk entries no state's chain holds. From the
    listing alone, as `chunkentries.usage`: no entry is read, so ``ls`` costs what it always did."""
    held: dict[str, dict[bytes, EntryInfo]] = {}  # chunk namespace -> its entries by key bytes
    sizes: dict[str, list[tuple[str, int]]] = {}  # a states' namespace -> (chunk namespace, C)
    states: list[EntryInfo] = []
    for entry in listed:
        owner = chunkentries.chunk_namespace_parts(entry.namespace)
        if owner is None:
            states.append(entry)
            continue
        if entry.namespace not in held:
            held[entry.namespace] = {}
            if owner[1] > 0:  # a size that cannot be read: no state reaches the namespace
                sizes.setdefault(owner[0], []).append((entry.namespace, owner[1]))
        held[entry.namespace][_tokens.encode(entry.key)] = entry
    chained: list[_Chained] = []
    for entry in states:
        key, best = _tokens.encode(entry.key), _Chained(entry, None, [])
        for namespace, size in sizes.get(entry.namespace, []):
            chain: list[EntryInfo] = []
            for end in range(4 * size, len(key), 4 * size):  # 4 bytes a token
                chunk = held[namespace].get(key[:end])
                if chunk is None:
                    break
                chain.append(chunk)
            if len(chain) > len(best.chain):
                best = _Chained(entry, size, chain)
        chained.append(best)
    reached = {id(chunk) for state in chained for chunk in state.chain}
    orphans = [chunk for chunks in held.values() for chunk in chunks.values() if id(chunk) not in reached]
    return chained, orphans


def _state_row(state: _Chained, shared: int) -> StateRow:
    """A state as ``ls --json`` prints it: its entry's row, and its chain (`shared` of whose chunks
    another state's chain holds too)."""
    chunk_bytes = sum(chunk.size for chunk in state.chain)
    return {
        **entry_row(state.entry),
        "chunk_tokens": state.chunk_tokens,
        "chunks": len(state.chain),
        "chunks_shared": shared,
        "chunk_bytes": chunk_bytes,
        "total_bytes": chunk_bytes + state.entry.size,
    }


def _count(n: int, thing: str) -> str:
    """``1 chunk``, ``1,024 chunks``."""
    return f"{n:,} {thing}" if n == 1 else f"{n:,} {thing}s"


def _print_entries(listed: list[EntryInfo], absent: str, as_json: bool) -> None:
    """Every entry of `listed`, one per row (``ls --chunks``, and ``ls`` of a store without chunks)."""
    if as_json:
        echo_json([entry_row(entry) for entry in listed])
        return
    if absent:  # one line rather than an empty table
        Console().print(literal(f"{entries(0)}{absent}"))
        return
    labels = [namespace_label(entry.namespace) for entry in listed]
    # Roomiest first: with creation times; without; with the last-use time on two lines (date, time).
    layouts = [
        (_entries_table(listed, created=created, wrap_times=wrap), [labels])
        for created, wrap in ((True, False), (False, False), (False, True))
    ]
    table = first_that_fits(layouts)
    pinned = sum(e.pinned for e in listed)
    caption = f"{entries(len(listed))}, {human_size(sum(e.size for e in listed))}"
    print_table(table, caption + (f"; {pinned:,} pinned" if pinned else ""))


def _states_table(
    chained: list[_Chained], rows: list[StateRow], *, created: bool, used: bool, wrap_times: bool
) -> Table:
    """The `ls` table of states (`rows`, of `chained`): as `_entries_table`, with their chunks, and the
    bytes of chain and entry together."""
    table = Table()
    table.add_column("id", no_wrap=True)
    table.add_column("namespace", overflow="fold")
    for name in ("tokens", "chunks", "shared", "bytes"):
        table.add_column(name, justify="right", no_wrap=True)
    if created:
        table.add_column("created", no_wrap=True)
    if used:
        table.add_column("last used", no_wrap=not wrap_times, max_width=10 if wrap_times else None)
    table.add_column("pinned", no_wrap=True)
    for state, row in zip(chained, rows, strict=True):
        times = [local_time(state.entry.created)] if created else []
        times += [local_time(state.entry.last_used)] if used else []
        add_row(
            table,
            row["id"],
            namespace_label(row["namespace"]),
            f"{row['tokens']:,}",
            f"{row['chunks']:,}",
            f"{row['chunks_shared']:,}",
            short_size(row["total_bytes"]),
            *times,
            "pinned" if row["pinned"] else "",
        )
    return table


def _absent_note(cache: CacheBackend) -> str:
    """For a default store that does not exist yet: a note saying so; else ""."""
    if not isinstance(cache, AbsentStore):
        return ""
    return f"; no store at {cache.location} yet: the first store creates it"


def _entries_table(listed: list[EntryInfo], *, created: bool, wrap_times: bool) -> Table:
    """The `ls` table: ids, counts and times never wrap (unless `wrap_times`: at the space), namespaces fold."""
    table = Table()
    table.add_column("id", no_wrap=True)
    table.add_column("namespace", overflow="fold")
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    if created:
        table.add_column("created", no_wrap=True)
    table.add_column("last used", no_wrap=not wrap_times, max_width=10 if wrap_times else None)
    table.add_column("pinned", no_wrap=True)
    for entry in listed:
        times = [local_time(entry.created)] if created else []
        add_row(
            table,
            entry_id(entry),
            namespace_label(entry.namespace),
            f"{len(entry.key):,}",
            short_size(entry.size),
            *times,
            local_time(entry.last_used),
            "pinned" if entry.pinned else "",
        )
    return table


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
        if chunkentries.is_chunk_namespace(entry.namespace):
            same = chunkentries.chunk_matches_key(decoded, entry.key)
        else:
            same = decoded.tokens == tuple(entry.key)
        del decoded  # its sections are views of the blob
        return None if same else "the frame's tokens differ from the entry's key"
    finally:
        match.release()


@click.command()
@url_argument
@click.option("--delete", is_flag=True, help="Delete the bad entries.")
@json_option
@one_line_errors
def verify(url: str | None, cache_option: str | None, delete: bool, as_json: bool) -> None:
    """Read every entry and check its frame (checksums, sizes, tokens = key).

    With SIPPCACHE_SECRET set, entries must also carry a valid MAC made with it.
    Exit code 1 if bad entries were found and not deleted. Reading does not
    count as a use: recency and last-used times stay as they were. With no
    URL, a default store that does not exist yet has nothing to check.
    """
    default = is_default_store(url, cache_option)
    url = resolve_url(url, cache_option)
    secret = _frame.secret_from_environment()
    bad: list[BadEntry] = []
    deleted = 0
    with open_store(url, read_only=not delete, default=default) as cache:
        absent = _absent_note(cache)
        listed = list(cache.entries())
        damaged = cache.stats().damaged
        if damaged:
            bad.append({"namespace": "?", "tokens": 0, "reason": f"{damaged} entries with an unreadable index record"})
            if delete and isinstance(cache, BaseBackend):  # purge_damaged is BaseBackend's, not the protocol's
                deleted += cache.purge_damaged()
        with byte_progress("verifying") as progress:
            task = progress.add_task("verify", total=sum(e.size for e in listed))
            for entry in listed:
                reason = _check_entry(cache, entry, secret)
                if reason is not None:
                    bad.append({"namespace": entry.namespace, "tokens": len(entry.key), "reason": reason})
                    if delete and cache.delete(list(entry.key), namespace=entry.namespace):
                        deleted += 1
                progress.advance(task, entry.size)
    if as_json:
        echo_json({"checked": len(listed), "bad": bad, "deleted": deleted})
    else:
        if bad:
            table = Table()
            table.add_column("namespace", overflow="fold")
            table.add_column("tokens", justify="right", no_wrap=True)
            table.add_column("reason", overflow="fold")
            for row in bad:
                add_row(table, namespace_label(row["namespace"]), f"{row['tokens']:,}", row["reason"])
            print_table(table)
        note = f", deleted {deleted}" if delete else ""
        Console().print(literal(f"checked {entries(len(listed))}: {len(bad):,} bad{note}{absent}"))
    if bad and not delete:
        sys.exit(1)
