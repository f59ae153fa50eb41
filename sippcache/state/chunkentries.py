"""Chunk entries in a store: where they live, what their keys are, and what they take.

`sippcache.state.chunks.ChunkedStates` stores a state as chunk entries of C tokens and a
tail (docs/format.md, "Chunked states"). What names them is needed without a
`ChunkedStates` too: listing a store (`usage`, ``sippcache stats``), pinning a state's whole
chain (`pin_chain`, ``sippcache pin``), telling a chunk namespace from a caller's
(`is_chunk_namespace`). A chunk namespace is the caller's namespace, C and a digest of the
layout the chunks' bytes have (`layout_of`), so states of another layout or chunk size
never mix; a chunk's frame holds its own tokens and the chained digest of its whole key
(`chain_digests`), not the whole prefix.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from .. import frame
from .. import tokens as _tokens
from ..errors import CorruptEntry, UnsupportedEntry
from ..protocol import CacheBackend, EntryInfo
from ..tokens import Tokens
from .seqstate import SeqState

__all__ = [
    "CHUNK_SUFFIX",
    "NAMESPACE_MARK",
    "TAIL_SUFFIX",
    "Usage",
    "chain_digests",
    "chunk_matches_key",
    "chunk_namespace",
    "chunk_namespace_parts",
    "is_chunk_namespace",
    "layout_of",
    "pin_chain",
    "usage",
]

#: What joins a caller's namespace and a chunk namespace's own part (a character no HTTP header
#: value, and so no scope the proxy reads from one, can hold).
NAMESPACE_MARK = "\u2022chunks/"
#: Suffixes of the frame kinds of chunk and tail entries (after the caller's whole-state kind).
CHUNK_SUFFIX, TAIL_SUFFIX = ".chunk", ".tail"
#: The form of chunk entries, part of `layout_of` (so of the namespace they live in): 2, a frame
#: holding the chunk's own tokens and the chained digest of its whole key (`chain_digests`).
CHUNK_FORMAT = 2


def chunk_namespace(namespace: str, chunk_tokens: int, layout: str) -> str:
    """Where the chunks of states stored in `namespace` with `chunk_tokens` a chunk and layout
    `layout` (`layout_of`) live."""
    return f"{namespace}{NAMESPACE_MARK}{chunk_tokens}/{layout}"


def is_chunk_namespace(namespace: str) -> bool:
    """Whether `namespace` holds chunk entries (not states a lookup can use alone)."""
    return NAMESPACE_MARK in namespace


def chunk_namespace_parts(namespace: str) -> tuple[str, int] | None:
    """(the namespace of its states, its chunks' tokens) of a chunk namespace (`chunk_namespace`'s
    form; the tokens are 0 where they cannot be read); None for any other namespace."""
    owner, mark, rest = namespace.partition(NAMESPACE_MARK)
    if not mark:
        return None
    size = rest.split("/", 1)[0]
    # A namespace is anyone's string, and "²".isdigit() is True while int("²") fails.
    return owner, int(size) if size.isascii() and size.isdigit() else 0


def layout_of(state: SeqState, chunked: int = 1) -> str:
    """A digest of what a chunk's bytes depend on besides its tokens: the format version, cell
    extensions, the caches, and the chunked caches' (the first `chunked`) V layout, rotation and
    per-layer K/V types and sizes. Not the sequence id, the stream it sits in or the 8-byte
    header: chunks are the same bytes whichever sequence held them."""
    words = [CHUNK_FORMAT, state.version, int(state.cell_ext), len(state.caches)]
    if chunked > 1:  # (a layout of one chunked cache is digested as it was before there could be more)
        words.append(chunked)
    for cache in state.caches[:chunked]:
        found = cache.active()
        if found is not None:
            stream = found[1]
            words += [int(stream.v_trans), *(stream.rotation or (-1, -1))]
            for layer in stream.layers:
                words += [layer.k_type, layer.k_row, layer.v_type, layer.v_size, layer.v_dims]
    return xxhash.xxh3_64_hexdigest(struct.pack(f"<{len(words)}q", *words))


def pin_chain(
    cache: CacheBackend,
    tokens: Tokens,
    *,
    namespace: str = "",
    pinned: bool = True,
    secret: frame.Secret | None = None,
) -> bool:
    """Pin (or unpin) the entry stored under exactly `tokens` and, for a tail, the chunks it is
    restored with: a pinned state keeps its whole chain (`ChunkedStates.pin`, ``sippcache pin``).
    True if there is one. Unpinning unpins the chain, chunks another pinned state shares too
    (pin that one again). A tail whose frame cannot be read (damaged, or a MAC without its
    `secret`) is pinned alone: a restore finds it out. Raises `CacheFull` as `CacheBackend.pin`
    does."""
    key = tuple(tokens)
    change = cache.pin if pinned else cache.unpin
    if not change(key, namespace=namespace):
        return False
    match = cache.lookup(key, namespace=namespace, touch=False)
    if match is None:
        return True
    with match:
        try:
            entry = frame.decode(match.blob, secret=secret)
        except (CorruptEntry, UnsupportedEntry):
            return True
        size, layout = entry.meta.get("chunk_tokens"), entry.meta.get("chunk_layout")
        tail = entry.kind.endswith(TAIL_SUFFIX)
    if tail and isinstance(size, int) and not isinstance(size, bool) and size > 0 and isinstance(layout, str):
        ids, at = token_ids(key), chunk_namespace(namespace, size, layout)
        for end in range(size, len(key), size):
            change(ids[:end], namespace=at)
    return True


@dataclass(frozen=True)
class Usage:
    """What a namespace's chunked states take in a store (`usage`; `sippcache stats`)."""

    #: The caller's namespace (its chunks live in namespaces of their own: `chunk_namespace`).
    namespace: str
    #: Tails and whole entries: the states a lookup finds.
    states: int
    state_bytes: int
    #: Chunk entries, each shared by every state with its prefix.
    chunks: int
    chunk_bytes: int
    #: Token positions the states' keys hold between them (a shared prefix counted once).
    distinct_tokens: int
    #: The K/V bytes of one token, about (the chunks' bytes over their tokens, frames included).
    kv_bytes_per_token: float

    @property
    def per_distinct(self) -> float:
        """The bytes stored over the K/V bytes of the distinct tokens: 1.0 when every token is
        stored once; whole states of a chat's turns give many times that."""
        wanted = self.distinct_tokens * self.kv_bytes_per_token
        return (self.state_bytes + self.chunk_bytes) / wanted if wanted else 0.0


def usage(entries: Iterable[EntryInfo]) -> list[Usage]:
    """`Usage` of every namespace that has chunks, from a listing (`CacheBackend.entries`: no
    entry is read)."""
    states: dict[str, list[tuple[int, ...]]] = {}
    state_bytes: dict[str, int] = {}
    chunk_sizes: dict[str, list[tuple[int, int, int]]] = {}  # owner -> (chunk tokens, key tokens, size)
    for entry in entries:
        parts = chunk_namespace_parts(entry.namespace)
        if parts is not None:
            owner, size = parts
            if size > 0:
                chunk_sizes.setdefault(owner, []).append((size, len(entry.key), entry.size))
            continue
        states.setdefault(entry.namespace, []).append(tuple(entry.key))
        state_bytes[entry.namespace] = state_bytes.get(entry.namespace, 0) + entry.size
    out = []
    for owner, found in sorted(chunk_sizes.items()):
        keys = sorted(states.get(owner, []))
        distinct = sum(len(k) - _tokens.common_prefix(p, k) for p, k in zip([(), *keys], keys, strict=False))
        chunk_bytes = sum(size for _, _, size in found)
        kv = sum(size - 4 * n for _, n, size in found) / sum(c for c, _, _ in found)
        out.append(Usage(owner, len(keys), state_bytes.get(owner, 0), len(found), chunk_bytes, distinct, kv))
    return out


def chain_digests(ids: array[int], size: int, count: int) -> list[bytes]:
    """The chained digests of the first `count` chunks of `size` tokens of `ids` (uint32): each is
    the xxh3_128 of the one before and its chunk's tokens, so it stands for every token up to the
    chunk's end. A chunk entry's frame holds its own tokens and this digest, not the whole prefix
    its key is (4 bytes a token, again in every chunk: O(N^2 / C) for a state of N tokens)."""
    view = memoryview(ids).cast("B")
    digests: list[bytes] = []
    digest = b""
    for k in range(count):
        digest = xxhash.xxh3_128_digest(digest + view[4 * k * size : 4 * (k + 1) * size])
        digests.append(digest)
    return digests


def chunk_matches_key(entry: frame.Frame, key: Sequence[int]) -> bool:
    """Whether a decoded chunk entry is the one stored under `key` (its frame holds the chunk's own
    tokens and the chained digest of all of `key`: `chain_digests`)."""
    size = entry.meta.get("chunk_tokens")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or len(key) % size:
        return False
    ids = token_ids(key)
    return (
        entry.token_bytes == ids[-size:].tobytes()
        and entry.meta.get("chain") == chain_digests(ids, size, len(key) // size)[-1]
    )


def token_ids(key: Sequence[int]) -> array[int]:
    """The tokens as a uint32 array: its slices are the chunk keys, made without Python ints."""
    ids = array("I")
    ids.frombytes(_tokens.encode(key))
    return ids
