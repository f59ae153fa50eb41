"""Backends by name: the built-ins, the `sippcache.backends` entry points, and
the classes registered at run time with `register_backend`.

Each backend is known as a dotted string (``"package.module:Class"``) and
imported only when a URL asks for it, so one broken or half-installed plugin
never breaks the others. `open` turns a URL into a backend:
``scheme://location?option=value&...``.

The entry points are read once per process (reading them walks every installed
distribution); `reset_backends` starts over, for tests that install plugins.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import cast
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from .errors import BadOption, BrokenPlugin, MissingDependency, NoStore, UnknownBackend
from .protocol import CacheBackend

log = logging.getLogger("sippcache")

ENTRY_POINT_GROUP = "sippcache.backends"
#: Environment variable holding the URL `open()` uses when given none.
URL_ENVIRONMENT_VARIABLE = "SIPPCACHE_URL"

# name -> (target, the module it imports, its requirement: one of sippcache's own dependencies
# in pyproject.toml, so a plain `pip install sippcache` makes every built-in backend usable)
BUILTINS: dict[str, tuple[str, str | None, str | None]] = {
    "ram": ("sippcache.backends.ram:RAMBackend", None, None),
    "lmdb": ("sippcache.backends.lmdb:LMDBBackend", "lmdb", "lmdb>=1.4"),
    "diskcache": ("sippcache.backends.diskcache:DiskCacheBackend", "diskcache", "diskcache>=5.6,<6"),
    "tiered": ("sippcache.backends.tiered:TieredBackend", None, None),
}

#: `BackendInfo.origin` of a backend registered with `register_backend`.
RUNTIME_ORIGIN = "registered at run time"
#: What `open` can reach: `urlsplit` accepts these scheme characters, and `open` lowercases the scheme.
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")

# name -> target, from register_backend; the lock makes its check-then-add one step.
_registered: dict[str, str] = {}
_registered_lock = threading.Lock()


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


@functools.cache
def _plugins() -> dict[str, tuple[str, str]]:
    """name -> (target, origin) for every entry point in our group (read once: see `reset_backends`)."""
    found: dict[str, tuple[str, str]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        if ep.name in BUILTINS:
            log.warning("sippcache: ignoring plugin %r from %s: it shadows a built-in backend", ep.name, origin)
            continue
        found[ep.name] = (ep.value, origin)
    return found


def backend_class(name: str) -> type:
    """Import the class registered as `name`; raise one of the documented errors."""
    if name in BUILTINS:
        target, package, requirement = BUILTINS[name]
        try:
            return _import(target)
        except ImportError as exc:
            if package is not None and exc.name == package:
                raise MissingDependency(
                    f"the {name!r} backend needs the {package!r} package, a dependency of sippcache that is"
                    f' missing here: pip install "{requirement}"'
                ) from exc
            raise
    if name in _registered:
        target = _registered[name]
        source = f"register_backend({name!r}, {target!r})"
    else:
        plugins = _plugins()
        if name not in plugins:
            known = ", ".join(sorted([*BUILTINS, *plugins, *_registered]))
            raise UnknownBackend(f"no cache backend named {name!r} (known: {known})")
        target, origin = plugins[name]
        source = f"entry point {name} = {target} in {origin}"
    try:
        cls = _import(target)
    except MissingDependency:
        raise
    except Exception as exc:
        raise BrokenPlugin(f"cache backend {name!r} ({source}) failed to load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(cls, type):
        raise BrokenPlugin(f"cache backend {name!r} ({source}) is not a class")
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
    table.update((name, (target, RUNTIME_ORIGIN)) for name, target in _registered.items())
    out = {}
    for name, (target, origin) in sorted(table.items()):
        try:
            backend_class(name)
        except Exception as exc:
            out[name] = BackendInfo(name, target, origin, False, str(exc))
        else:
            out[name] = BackendInfo(name, target, origin, True)
    return out


def register_backend(name: str, target: str) -> None:
    """Make ``name://`` URLs open the class `target` (``"package.module:Class"``) in this process.

    For a backend that is no installed distribution: an application's own, or a
    test's. Like an entry point, the class is imported only when a URL asks for
    it. Registering the same target again does nothing. Raises `ValueError` for
    a name that is not a lowercase URL scheme, a target not of the form
    ``module:Class``, or a name already taken by a built-in, an installed entry
    point or another registered target: a scheme never changes meaning behind
    the back of code that already uses it.
    """
    if not isinstance(name, str) or not _SCHEME.fullmatch(name):
        raise ValueError(f"backend name {name!r} is not a lowercase URL scheme (letters, digits, '+', '-', '.')")
    if not isinstance(target, str) or not _is_target(target):
        raise ValueError(f"backend target {target!r} is not of the form 'package.module:Class'")
    if name in BUILTINS:
        raise ValueError(f"backend name {name!r} is taken by a built-in backend")
    if name in _plugins():
        raise ValueError(f"backend name {name!r} is taken by the entry point in {_plugins()[name][1]}")
    with _registered_lock:
        if _registered.setdefault(name, target) != target:
            raise ValueError(f"backend name {name!r} is already registered for {_registered[name]!r}")


def _is_target(text: str) -> bool:
    """Whether `text` reads ``package.module:Class`` (dotted names on both sides of one colon)."""
    module, colon, attr = text.partition(":")
    return bool(colon) and all(part.isidentifier() for part in [*module.split("."), *attr.split(".")])


def reset_backends() -> None:
    """Forget the run-time registrations and read the entry points again at next use.

    For tests: one that puts a plugin on `sys.path`, or registers a backend,
    leaves the process as it found it.
    """
    with _registered_lock:
        _registered.clear()
    _plugins.cache_clear()


#: Query options whose values are secrets: `redact_url` hides them.
SECRET_OPTIONS = frozenset({"password", "pass", "secret", "token"})


def redact_url(url: str) -> str:
    """`url` with passwords replaced by ``***`` (also inside percent-encoded inner URLs, as
    tiered:// has): what every command and the server print or report of a store."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    head, sep, tail = url.partition("?")
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if colon:
            head = head.replace(parts.netloc, f"{user}:***@{host}", 1)
    if sep:
        query, hash_, fragment = tail.partition("#")
        try:
            pairs = parse_qsl(query, keep_blank_values=True)
        except ValueError:
            pairs = []
        if any("://" in value or name.lower() in SECRET_OPTIONS for name, value in pairs):
            query = urlencode(
                [(k, "***" if k.lower() in SECRET_OPTIONS else redact_url(v) if "://" in v else v) for k, v in pairs],
                safe="/:*@",
                quote_via=quote,
            )
        tail = query + hash_ + fragment
    return head + sep + tail


def parse_url(url: str) -> tuple[str, str, dict[str, str]]:
    """Split a cache URL into (backend name, location, raw options)."""
    if not isinstance(url, str):
        raise TypeError(f"cache URL must be a str, not {type(url).__name__}")
    parts = urlsplit(url.strip())
    if not parts.scheme or "://" not in url:
        raise UnknownBackend(f"{redact_url(url)!r} is not a cache URL (expected e.g. lmdb:///path or ram://)")
    if parts.fragment:
        raise BadOption(f"cache URL {redact_url(url)!r} has a fragment ('#...'); options go after '?'")
    options: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise BadOption(f"cannot parse the options of {redact_url(url)!r}: expected name=value&name=value") from None
    for name, value in pairs:
        if name in options:
            raise BadOption(f"option {name!r} is given twice in {redact_url(url)!r}")
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
    cls = backend_class(name)
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
        raise NoStore(f"no cache at {redact_url(url)} ({problem})")
