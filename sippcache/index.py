"""Prefix index: a radix tree over token ids, one tree per namespace.

Both questions the cache asks (longest stored prefix of a query, and the entry
sharing the longest common prefix with it) are one walk down the query, so a
lookup costs O(query length) whatever the number of entries (the RadixAttention
idea). Keys are the little-endian uint32 bytes of `sippcache.tokens.encode`, so
edge comparisons are C-level `bytes.startswith` calls.

Every node remembers the most recently used entry below it, so ties in a
partial match go to that entry without visiting the subtree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any

from .protocol import Blob
from .tokens import halved_to_difference

_TOKEN = 4  # bytes per token


def common_prefix_bytes(a: Blob, b: Blob) -> int:
    """Length in bytes of the longest common prefix of `a` and `b`. Compared as bytes (memcmp;
    memoryviews compare item by item, and turning a whole key into an int is slower still), the
    first difference found by halving, then the last few bytes at once: a long key costs about
    two memory passes, not a conversion per byte."""
    n = min(len(a), len(b))
    a, b = bytes(a[:n]), bytes(b[:n])
    if a == b:
        return n
    low = halved_to_difference(a, b, 64)
    diff = int.from_bytes(a[low : low + 64], "little") ^ int.from_bytes(b[low : low + 64], "little")
    return low + ((diff & -diff).bit_length() - 1) // 8


class _Node:
    __slots__ = ("best", "best_rank", "children", "edge", "entry", "parent", "rank")

    def __init__(self, edge: bytes, parent: _Node | None, entry: bytes | None = None, rank: int = -1) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.entry = entry  # id of the entry whose key ends here
        self.rank = rank  # that entry's recency
        self.best = entry  # most recently used entry in this subtree (set for a leaf; `_raise_best` after)
        self.best_rank = rank


@dataclass(frozen=True)
class IndexHit:
    """An index answer: the entry's id and how many query tokens it covers."""

    entry_id: bytes
    length: int


class PrefixIndex:
    """Radix trees of entry keys, per namespace, with per-subtree recency.

    Entries are identified by opaque ids (the engine uses a hash of namespace
    and key). `rank` is any integer that grows with recency of use.
    """

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._nodes: dict[bytes, _Node] = {}
        self._namespace: dict[bytes, str] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, entry_id: bytes) -> bool:
        return entry_id in self._nodes

    def namespaces(self) -> list[str]:
        """Namespaces that hold at least one entry."""
        return list(self._roots)

    def namespace_of(self, entry_id: bytes) -> str:
        return self._namespace[entry_id]

    def key_of(self, entry_id: bytes) -> bytes:
        """The full key (token bytes) of an indexed entry."""
        parts = []
        node: _Node | None = self._nodes[entry_id]
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return b"".join(reversed(parts))

    def insert(self, namespace: str, key: bytes, entry_id: bytes, rank: int) -> None:
        """Index `key` as `entry_id`; an entry already at that key is replaced."""
        if entry_id in self._nodes:
            self.remove(entry_id)
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node(b"", None)
        pos = 0
        while pos < len(key):
            first = key[pos : pos + _TOKEN]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(key[pos:], node)
                node.children[first] = leaf
                node = leaf
                break
            edge = child.edge
            if key.startswith(edge, pos):
                pos += len(edge)
                node = child
                continue
            split = common_prefix_bytes(memoryview(key)[pos:], edge) // _TOKEN * _TOKEN
            mid = _Node(edge[:split], node)
            mid.best, mid.best_rank = child.best, child.best_rank
            node.children[first] = mid
            child.edge = edge[split:]
            child.parent = mid
            mid.children[child.edge[:_TOKEN]] = child
            node = mid
            pos += split
        replaced = node.entry
        node.entry = entry_id
        node.rank = rank
        self._nodes[entry_id] = node
        self._namespace[entry_id] = namespace
        if replaced is not None:  # another id for the same key: forget it
            del self._nodes[replaced]
            del self._namespace[replaced]
            self._lower_best(node, replaced)
        self._raise_best(node, entry_id, rank)

    def touch(self, entry_id: bytes, rank: int) -> None:
        """Record a use of `entry_id` (no-op for unknown ids)."""
        node = self._nodes.get(entry_id)
        if node is None or rank <= node.rank:
            return
        node.rank = rank
        self._raise_best(node, entry_id, rank)

    def touch_many(self, uses: list[tuple[bytes, int]]) -> None:
        """`touch` for several entries at once: the ranks first, then each node's best raised
        from the highest rank down, so that a walk stops where a higher one passed already (a
        chain of N chunks read by one restore costs O(N) steps, not N walks to the root)."""
        raised: list[tuple[int, bytes, _Node]] = []
        for entry_id, rank in uses:
            node = self._nodes.get(entry_id)
            if node is not None and rank > node.rank:
                node.rank = rank
                raised.append((rank, entry_id, node))
        raised.sort(key=lambda item: item[0], reverse=True)
        for rank, entry_id, node in raised:
            self._raise_best(node, entry_id, rank)

    def remove(self, entry_id: bytes) -> bool:
        """Drop `entry_id` from the index; False if it was not there."""
        node = self._nodes.pop(entry_id, None)
        if node is None:
            return False
        namespace = self._namespace.pop(entry_id)
        node.entry = None
        node.rank = -1
        # Prune an empty leaf, then merge a pass-through node into its only child.
        parent = node.parent
        if not node.children and parent is not None:
            del parent.children[node.edge[:_TOKEN]]
            node = parent
        if node.entry is None and len(node.children) == 1 and node.parent is not None:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[child.edge[:_TOKEN]] = child
            node = child
        self._lower_best(node, entry_id)
        if not self._roots[namespace].children:
            del self._roots[namespace]
        return True

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    def dump(self) -> list[list[Any]]:
        """The trees as plain lists that msgpack packs in C, so a store can keep its
        index and `load` it without inserting every key again: per namespace
        `[namespace, edges, parent positions, entry ids (None for none), ranks
        (-1 for none)]`, nodes in preorder (a parent before its children, the root first)."""
        trees = []
        for namespace, root in self._roots.items():
            edges: list[bytes] = []
            parents: list[int] = []
            entries: list[bytes | None] = []
            ranks: list[int] = []
            stack: list[tuple[_Node, int]] = [(root, -1)]
            while stack:
                node, parent = stack.pop()
                position = len(edges)
                edges.append(node.edge)
                parents.append(parent)
                entries.append(node.entry)
                ranks.append(node.rank)
                stack.extend((child, position) for child in node.children.values())
            trees.append([namespace, edges, parents, entries, ranks])
        return trees

    def load(self, trees: list[list[Any]]) -> None:
        """Replace the contents by a `dump()`. A dump that is not well formed raises
        (ValueError, TypeError, IndexError) and leaves the index unusable: clear it then."""
        self.clear()
        nodes_of, namespace_of = self._nodes, self._namespace
        listed = 0
        by_rank = attrgetter("best_rank")
        for namespace, edges, parents, entries, ranks in trees:
            _check_dump(namespace, edges, parents, entries, ranks)
            if namespace in self._roots:
                raise ValueError("a namespace twice in an index dump")
            root = _Node(b"", None)
            nodes = [root]
            append = nodes.append
            for edge, parent, entry, rank in zip(edges[1:], parents[1:], entries[1:], ranks[1:], strict=True):
                above = nodes[parent]
                node = _Node(edge, above, entry, rank)
                above.children[edge[:_TOKEN]] = node
                append(node)
            ids = list(compress(entries, entries))
            nodes_of.update(zip(ids, compress(nodes, entries), strict=True))
            namespace_of.update(dict.fromkeys(ids, namespace))
            listed += len(ids)
            # Every node with children, deepest first (children follow their parents): its best is its
            # own entry's or its most recent child's.
            for position in sorted(set(parents[1:]), reverse=True):
                node = nodes[position]
                child = max(node.children.values(), key=by_rank)
                if child.best_rank > node.best_rank:
                    node.best, node.best_rank = child.best, child.best_rank
            self._roots[namespace] = root
        if len(nodes_of) != listed:
            raise ValueError("an entry twice in an index dump")

    def _path(self, namespace: str, query: bytes) -> Iterator[tuple[int, _Node]]:
        """The nodes down the tree along `query`, with the bytes of it each one is at (the root
        at 0), as far as `query` holds whole edges."""
        node = self._roots.get(namespace)
        pos = 0
        while node is not None:
            yield pos, node
            if pos >= len(query):
                return
            child = node.children.get(query[pos : pos + _TOKEN])
            if child is None or not query.startswith(child.edge, pos):
                return
            pos += len(child.edge)
            node = child

    def longest_prefix(self, namespace: str, query: bytes) -> IndexHit | None:
        """The entry whose key is the longest prefix of `query`, if any."""
        found: IndexHit | None = None
        for pos, node in self._path(namespace, query):
            if node.entry is not None:
                found = IndexHit(node.entry, pos // _TOKEN)
        return found

    def entries_along(self, namespace: str, query: bytes, ends: Sequence[int]) -> list[bytes]:
        """The ids of the entries stored under exactly ``query[:end]`` for each of `ends`
        (lengths in bytes, ascending), up to the first that is not stored: one walk down the
        tree for a whole chain of keys, each a prefix of the next."""
        found: list[bytes] = []
        wanted = iter(ends)
        want = next(wanted, None)
        for pos, node in self._path(namespace, query):
            if want is None or want < pos:  # done, or the wanted key ends inside an edge: not stored
                break
            while want == pos:
                if node.entry is None:
                    return found
                found.append(node.entry)
                want = next(wanted, None)
        return found

    def longest_common(self, namespace: str, query: bytes) -> IndexHit | None:
        """The most recently used entry among those sharing the longest common prefix with `query`."""
        node = self._roots.get(namespace)
        if node is None:
            return None
        pos = 0
        while pos < len(query):
            child = node.children.get(query[pos : pos + _TOKEN])
            if child is None:
                break
            if query.startswith(child.edge, pos):
                pos += len(child.edge)
                node = child
                continue
            # The query leaves the tree inside this edge: every entry below shares `pos + common`.
            common = common_prefix_bytes(memoryview(query)[pos:], child.edge) // _TOKEN * _TOKEN
            node, pos = child, pos + common
            break
        if pos == 0 or node.best is None:
            return None
        return IndexHit(node.best, pos // _TOKEN)

    def branch_of(self, namespace: str, key: bytes) -> IndexHit | None:
        """The entry whose place in the tree `key` would take, with the tokens they share:
        where `key` leaves the tree, if no other key leaves it there. Inside an edge,
        that is the most recently used entry below the edge (every entry there shares
        the same tokens with `key`); at a node, the entry whose key ends there, if no
        other key extends it. None if `key` ends inside the tree (it is a prefix of a
        stored key, or one) or leaves it at a node where other keys branch off."""
        node = self._roots.get(namespace)
        if node is None:
            return None
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + _TOKEN])
            if child is None:
                if node.entry is None or node.children:
                    return None
                return IndexHit(node.entry, pos // _TOKEN)
            if key.startswith(child.edge, pos):
                pos += len(child.edge)
                node = child
                continue
            pos += common_prefix_bytes(memoryview(key)[pos:], child.edge) // _TOKEN * _TOKEN
            if pos >= len(key) or child.best is None:
                return None  # `key` ends inside the edge
            return IndexHit(child.best, pos // _TOKEN)
        return None

    def _raise_best(self, node: _Node | None, entry_id: bytes, rank: int) -> None:
        while node is not None and (rank >= node.best_rank or node.best == entry_id):
            node.best, node.best_rank = entry_id, max(rank, node.best_rank)
            node = node.parent

    def _lower_best(self, node: _Node | None, removed: bytes) -> None:
        """Recompute `best` on the path to the root wherever it pointed at the removed entry."""
        while node is not None:
            if node.best == removed:
                best, best_rank = node.entry, node.rank
                for child in node.children.values():
                    if child.best_rank > best_rank:
                        best, best_rank = child.best, child.best_rank
                node.best, node.best_rank = best, best_rank
            node = node.parent


def _check_dump(namespace: Any, edges: list[Any], parents: list[Any], entries: list[Any], ranks: list[Any]) -> None:
    """Raise ValueError unless one tree of a dump is well formed: a root first, every
    other node after its parent with a non-empty edge of whole tokens, ids bytes or
    None, integer ranks. Checked with C-level passes over the columns: a load must stay fast."""
    count = len(edges)
    if not (type(namespace) is str and count == len(parents) == len(entries) == len(ranks) > 1):
        raise ValueError("not an index dump: columns")
    if edges[0] != b"" or parents[0] != -1 or entries[0] is not None:
        raise ValueError("not an index dump: no root")
    if set(map(type, edges)) != {bytes} or not set(map(type, entries)) <= {bytes, type(None)}:
        raise ValueError("not an index dump: types")
    if not all(edges[1:]) or any(map((_TOKEN - 1).__and__, map(len, edges))):
        raise ValueError("not an index dump: edges")
    if set(map(type, ranks)) != {int} or set(map(type, parents)) != {int}:
        raise ValueError("not an index dump: numbers")
    if min(parents[1:]) < 0 or not all(map(int.__lt__, parents[1:], range(1, count))):
        raise ValueError("not an index dump: parents")
