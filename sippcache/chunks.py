"""Deprecated: moved to `sippcache.state.chunks` (the chunk entries' names: `sippcache.state.chunkentries`).

`sippcache.chunks` re-exports the public names it had, for one release, so that code written
against it keeps working meanwhile; importing it warns (`DeprecationWarning`). Import from
`sippcache.state.chunks` or `sippcache.state.chunkentries` instead (CHANGELOG.md).
"""

from __future__ import annotations

import warnings

from .state.chunkentries import (
    CHUNK_FORMAT,
    CHUNK_SUFFIX,
    NAMESPACE_MARK,
    TAIL_SUFFIX,
    Usage,
    chain_digests,
    chunk_matches_key,
    chunk_namespace,
    chunk_namespace_parts,
    is_chunk_namespace,
    layout_of,
    pin_chain,
    usage,
)
from .state.chunks import (
    CHECK_THREADS,
    DEFAULT_CHUNK_TOKENS,
    MEANWHILE_THREADS,
    Assembled,
    ChunkedStates,
    Stored,
    Unchecked,
    check_threads,
)

__all__ = [
    "CHECK_THREADS",
    "CHUNK_FORMAT",
    "CHUNK_SUFFIX",
    "DEFAULT_CHUNK_TOKENS",
    "MEANWHILE_THREADS",
    "NAMESPACE_MARK",
    "TAIL_SUFFIX",
    "Assembled",
    "ChunkedStates",
    "Stored",
    "Unchecked",
    "Usage",
    "chain_digests",
    "check_threads",
    "chunk_matches_key",
    "chunk_namespace",
    "chunk_namespace_parts",
    "is_chunk_namespace",
    "layout_of",
    "pin_chain",
    "usage",
]

warnings.warn(
    "sippcache.chunks is deprecated and goes in the next release: "
    "import from sippcache.state.chunks and sippcache.state.chunkentries",
    DeprecationWarning,
    stacklevel=2,
)
