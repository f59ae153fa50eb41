"""Deprecated: moved to `sippcache.state` (the state format: parsing, cutting, joining and the copier, one module each).

`sippcache.stateformat` re-exports the public names it had, for one release, so that code
written against it keeps working meanwhile; importing it warns (`DeprecationWarning`). Import
from `sippcache.state` (`parse`, `prefix`, `split`, `cut`, `join`, `joined`, the types) or its
modules instead (CHANGELOG.md).
"""

from __future__ import annotations

import warnings

from .state.copier import GATHER_GROUP_BYTES, HASH_STEP_BYTES, PARALLEL_GATHER_BYTES, SHORT_RUN_BYTES, gather_workers
from .state.cutting import CUT_GROUP_BYTES, Cut, Split, chunkable_caches, cut, prefix, split
from .state.joining import Joined, join, joined
from .state.meta import META_MAGIC
from .state.parsing import parse
from .state.seqstate import (
    CELL_EXT_SIZE,
    DSV4_STATE_MAGIC,
    KV_TYPES,
    MAX_CACHES,
    MAX_LAYERS,
    MAX_STREAMS,
    SEQ_STATE_MAGIC,
    VERSIONS,
    Buffer,
    Cache,
    Layer,
    SeqState,
    Stream,
    UnsupportedState,
)

__all__ = [
    "CELL_EXT_SIZE",
    "CUT_GROUP_BYTES",
    "DSV4_STATE_MAGIC",
    "GATHER_GROUP_BYTES",
    "HASH_STEP_BYTES",
    "KV_TYPES",
    "MAX_CACHES",
    "MAX_LAYERS",
    "MAX_STREAMS",
    "META_MAGIC",
    "PARALLEL_GATHER_BYTES",
    "SEQ_STATE_MAGIC",
    "SHORT_RUN_BYTES",
    "VERSIONS",
    "Buffer",
    "Cache",
    "Cut",
    "Joined",
    "Layer",
    "SeqState",
    "Split",
    "Stream",
    "UnsupportedState",
    "chunkable_caches",
    "cut",
    "gather_workers",
    "join",
    "joined",
    "parse",
    "prefix",
    "split",
]

warnings.warn(
    "sippcache.stateformat is deprecated and goes in the next release: import from sippcache.state",
    DeprecationWarning,
    stacklevel=2,
)
