"""Deprecated: moved to `sippcache.state.buffers`.

`sippcache.buffers` re-exports the public names it had, for one release, so that code written
against it keeps working meanwhile; importing it warns (`DeprecationWarning`). Import from
`sippcache.state.buffers` instead (CHANGELOG.md).
"""

from __future__ import annotations

import warnings

from .state.buffers import MADV_POPULATE_WRITE, POPULATE_SLICE, StateBuffers, allocate, populate

__all__ = [
    "MADV_POPULATE_WRITE",
    "POPULATE_SLICE",
    "StateBuffers",
    "allocate",
    "populate",
]

warnings.warn(
    "sippcache.buffers is deprecated and goes in the next release: import from sippcache.state.buffers",
    DeprecationWarning,
    stacklevel=2,
)
