"""Deprecated: moved to `sippcache.state.modelfile`.

`sippcache.modelfile` re-exports the public names it had, for one release, so that code written
against it keeps working meanwhile; importing it warns (`DeprecationWarning`). Import from
`sippcache.state.modelfile` instead (CHANGELOG.md).
"""

from __future__ import annotations

import warnings

from .state.modelfile import (
    HEAD_BYTES,
    TAIL_BYTES,
    MemoryKind,
    ModelFacts,
    file_digest,
    read_metadata,
    read_model_facts,
)

__all__ = [
    "HEAD_BYTES",
    "TAIL_BYTES",
    "MemoryKind",
    "ModelFacts",
    "file_digest",
    "read_metadata",
    "read_model_facts",
]

warnings.warn(
    "sippcache.modelfile is deprecated and goes in the next release: import from sippcache.state.modelfile",
    DeprecationWarning,
    stacklevel=2,
)
