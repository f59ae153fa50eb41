"""The exceptions sippcache raises.

Each names what went wrong and what to do about it. They all derive from
`SippcacheError`, and where a built-in exception fits too (ValueError for bad
input, ImportError for a missing package) they derive from that as well, so
callers can catch either.
"""

from __future__ import annotations


class SippcacheError(Exception):
    """Base class of every sippcache error."""


class UnknownBackend(SippcacheError, ValueError):
    """A URL scheme names no installed backend."""


class MissingDependency(SippcacheError, ImportError):
    """A backend's or feature's library is not installed; the message names what to install."""


class BrokenPlugin(SippcacheError):
    """A third-party backend's entry point failed to load."""


class BadOption(SippcacheError, ValueError):
    """A URL option is unknown or its value has the wrong form."""


class CorruptEntry(SippcacheError, ValueError):
    """A stored entry failed its integrity checks and must not be used."""


class UnsupportedEntry(CorruptEntry):
    """An entry in a format version this sippcache does not read (written by a newer
    one): unusable here, but not damaged, so it is skipped rather than deleted."""


class CorruptStore(SippcacheError):
    """The store's files are damaged, are not a sippcache store, or are not what
    they should be (e.g. a symbolic link planted in the store directory)."""


class CacheFull(SippcacheError):
    """The store has no room for an entry even after evicting."""


class CacheClosed(SippcacheError):
    """The cache was used after `close()`."""


class NoStore(SippcacheError):
    """There is no store at a location: it was opened with `must_exist` (or
    `read_only`) and nothing is there, or the location cannot hold a store (a
    regular file where a directory should be)."""


class ReadOnlyStore(SippcacheError):
    """A write to a store that cannot be written: the handle was opened
    `read_only`, or this user may not write the store's files."""


class StoreError(SippcacheError):
    """The backend's storage library failed in a way that is not damage (a lock
    it could not take, a limit it hit); the message names the store."""
