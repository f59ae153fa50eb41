"""Backends by name: the built-ins and the `sippcache.backends` entry points.

Each backend is known as a dotted string (``"package.module:Class"``) and
imported only when a URL asks for it, so one broken or half-installed plugin
never breaks the others. `open` turns a URL into a backend:
``scheme://location?option=value&...``.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import cast
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import BadOption, BrokenPlugin, MissingDependency, NoStore, UnknownBackend
from .protocol import CacheBackend

log = logging.getLogger("sippcache")

ENTRY_POINT_GROUP = "sippcache.backends"
#: Environment variable holding the URL `open()` uses when given none.
URL_ENVIRONMENT_VARIABLE = "SIPPCACHE_URL"

# name -> (target, the package it needs, the extra that installs it)
BUILTINS: dict[str, tuple[str, str | None, str | None]] = {
    "ram": ("sippcache.backends.ram:RAMBackend", None, None),
    "lmdb": ("sippcache.backends.lmdb:LMDBBackend", "lmdb", "lmdb"),
    "diskcache": ("sippcache.backends.diskcache:DiskCacheBackend", "diskcache", "diskcache"),
    "tiered": ("sippcache.backends.tiered:TieredBackend", None, None),
}


@dataclass(frozen=True)
class BackendInfo:
    """Where a backend comes from and whether it can be used here."""

    name: str
    target: str
    origin: str  # "built-in" or "<distribution> <version>"
    usable: bool
    problem: str | None = None


def default_url() -> str:
    """`SIPPCACHE_URL` if set, else an LMDB store in the user cache folder."""
    url = os.environ.get(URL_ENVIRONMENT_VARIABLE, "").strip()
    if url:
        return url
    import platformdirs

    return "lmdb://" + os.path.join(platformdirs.user_cache_dir("sippcache"), "lmdb")


def _plugins() -> dict[str, tuple[str, str]]:
    """name -> (target, origin) for every entry point in our group."""
    found: dict[str, tuple[str, str]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        if ep.name in BUILTINS:
            log.warning("sippcache: ignoring plugin %r from %s: it shadows a built-in backend", ep.name, origin)
            continue
        found[ep.name] = (ep.value, origin)
    return found


def _load(name: str) -> type:
    """Import the class registered as `name`; raise one of the documented errors."""
    if name in BUILTINS:
        target, package, extra = BUILTINS[name]
        try:
            return _import(target)
        except ImportError as exc:
            if package is not None and exc.name == package:
                raise MissingDependency(
                    f"the {name!r} backend needs the {package!r} package: pip install \"sippcache[{extra}]\""
                ) from exc
            raise
    plugins = _plugins()
    if name not in plugins:
        known = ", ".join(sorted([*BUILTINS, *plugins]))
        raise UnknownBackend(f"no cache backend named {name!r} (known: {known})")
    target, origin = plugins[name]
    try:
        cls = _import(target)
    except MissingDependency:
        raise
    except Exception as exc:
        raise BrokenPlugin(
            f"cache backend {name!r} (entry point {name} = {target} in {origin}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(cls, type):
        raise BrokenPlugin(f"cache backend {name!r} (entry point {target} in {origin}) is not a class")
    return cls


def _import(target: str) -> type:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return cast(type, obj)


def backends() -> dict[str, BackendInfo]:
    """Every known backend: where it comes from and whether it imports here (and why not)."""
    table = {name: (target, "built-in") for name, (target, _, _) in BUILTINS.items()}
    table.update(_plugins())
    out = {}
    for name, (target, origin) in sorted(table.items()):
        try:
            _load(name)
        except Exception as exc:
            out[name] = BackendInfo(name, target, origin, False, str(exc))
        else:
            out[name] = BackendInfo(name, target, origin, True)
    return out


def parse_url(url: str) -> tuple[str, str, dict[str, str]]:
    """Split a cache URL into (backend name, location, raw options)."""
    if not isinstance(url, str):
        raise TypeError(f"cache URL must be a str, not {type(url).__name__}")
    parts = urlsplit(url.strip())
    if not parts.scheme or "://" not in url:
        raise UnknownBackend(f"{url!r} is not a cache URL (expected e.g. lmdb:///path or ram://)")
    if parts.fragment:
        raise BadOption(f"cache URL {url!r} has a fragment ('#...'); options go after '?'")
    options: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise BadOption(f"cannot parse the options of {url!r}: expected name=value&name=value") from None
    for name, value in pairs:
        if name in options:
            raise BadOption(f"option {name!r} is given twice in {url!r}")
        options[name] = value
    location = unquote(parts.netloc + parts.path)
    return parts.scheme.lower(), location, options


def open(url: str | None = None, *, read_only: bool = False, must_exist: bool = False) -> CacheBackend:
    """Open the cache a URL names; with no URL, `default_url()`.

    ``ram://?max_bytes=2GiB``, ``lmdb:///var/cache/sipp?max_bytes=20GiB``,
    ``diskcache:///path``, or ``<plugin>://...`` for an installed plugin.

    `must_exist`: raise `NoStore` rather than create a store where there is none
    (for backends that can tell; see `BaseBackend.missing_store`). `read_only`:
    open for reading only, where this user may not write the store; writes
    through the handle raise `ReadOnlyStore` (backends that cannot open
    read-only open normally). A read-only open never creates a store either.
    """
    url = default_url() if url is None else url
    name, location, options = parse_url(url)
    cls = _load(name)
    if must_exist or read_only:
        _require_store(cls, url, location)
    opener = (getattr(cls, "open_read_only", None) if read_only else None) or getattr(cls, "from_url", None)
    if opener is None:
        if options:
            raise BadOption(f"backend {name!r} takes no options, got {', '.join(options)}")
        backend = cls(location)
    else:
        backend = opener(location, options)
    if not isinstance(backend, CacheBackend):
        raise BrokenPlugin(f"backend {name!r} ({cls.__module__}.{cls.__qualname__}) does not implement CacheBackend")
    return backend


def _require_store(cls: type, url: str, location: str) -> None:
    """Raise `NoStore` if the backend can tell there is no store at `location`."""
    missing_store = getattr(cls, "missing_store", None)
    problem = missing_store(location) if missing_store is not None else None
    if problem is not None:
        raise NoStore(f"no cache at {url} ({problem})")
