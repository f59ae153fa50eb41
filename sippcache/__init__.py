"""sippcache: llama.cpp prefix-state caching with pluggable storage.

    import sippcache
    with sippcache.open("lmdb:///var/cache/sipp?max_bytes=20GiB") as cache:
        cache.store(tokens, blob, namespace="model-a")
        match = cache.lookup(longer_tokens, namespace="model-a")

See README.md and docs/ for the backends, the entry format and the llama-cpp-python adapter;
docs/plugins.md for writing a backend (`KVBackend` and `KVTxn`, or `BaseBackend`) and
registering it (an entry point, or `register_backend`).
"""

from __future__ import annotations

# Import the `backends` subpackage before binding the `backends()` function: a
# first import of the subpackage later would otherwise rebind the name.
from . import backends as _backends_package  # noqa: F401
from .base import BaseBackend
from .engine import KVBackend, KVTxn
from .errors import (
    BadOption,
    BrokenPlugin,
    CacheClosed,
    CacheFull,
    CorruptEntry,
    CorruptStore,
    MissingDependency,
    NoStore,
    ReadOnlyStore,
    SippcacheError,
    StoreError,
    UnknownBackend,
    UnsupportedEntry,
)
from .protocol import CacheBackend, EntryInfo, Match, Peek, Stats, StoreOptions
from .registry import BackendInfo, backends, default_url, open, redact_url, register_backend

__version__ = "0.1.0"

__all__ = [
    "BackendInfo",
    "BadOption",
    "BaseBackend",
    "BrokenPlugin",
    "CacheBackend",
    "CacheClosed",
    "CacheFull",
    "CorruptEntry",
    "CorruptStore",
    "EntryInfo",
    "KVBackend",
    "KVTxn",
    "Match",
    "MissingDependency",
    "NoStore",
    "Peek",
    "ReadOnlyStore",
    "SippcacheError",
    "Stats",
    "StoreError",
    "StoreOptions",
    "UnknownBackend",
    "UnsupportedEntry",
    "backends",
    "default_url",
    "open",
    "redact_url",
    "register_backend",
]
