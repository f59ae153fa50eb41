"""URLs, options and the errors of the backend registry."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sippcache
from sippcache import BadOption, BrokenPlugin, MissingDependency, UnknownBackend, register_backend
from sippcache.backends.ram import RAMBackend
from sippcache.options import Size, coerce_options
from sippcache.registry import RUNTIME_ORIGIN, parse_url, reset_backends
from sippcache.testing import BackendTests, ReopenTests, SharedStoreTests

SQLITE_TOY = Path(__file__).parent / "plugins" / "sqlite_toy"


@pytest.mark.parametrize(
    "url, expected",
    [
        ("ram://", ("ram", "", {})),
        ("ram://?max_bytes=2GiB", ("ram", "", {"max_bytes": "2GiB"})),
        (
            "lmdb:///var/cache/sipp?max_bytes=20GiB&sync=false",
            ("lmdb", "/var/cache/sipp", {"max_bytes": "20GiB", "sync": "false"}),
        ),
        ("diskcache://relative/dir", ("diskcache", "relative/dir", {})),
        ("LMDB:///with%20space", ("lmdb", "/with space", {})),
    ],
)
def test_parse_url(url: str, expected: tuple[str, str, dict[str, str]]) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["", "/just/a/path", "lmdb:/one-slash", "nocolon"])
def test_not_a_url(url: str) -> None:
    with pytest.raises(UnknownBackend, match="not a cache URL"):
        sippcache.open(url)


@pytest.mark.parametrize(
    "url, message",
    [
        ("ram://?max_bytes=1GiB&max_bytes=2GiB", "twice"),
        ("ram://?max_bytes", "max_bytes"),
        ("ram://#frag", "fragment"),
        ("ram://?max_bytes=-1", "max_bytes"),
        ("ram://?max_entries=many", "whole number"),
        ("lmdb:///tmp/x?sync=maybe", "true/false"),
        ("ram://?colour=red", "no option 'colour'"),
        ("ram://?max_bytes=0", "max_bytes must be positive"),
        ("ram://?max_entries=0", "max_entries"),
        ("ram:///some/path", "takes no path"),
        ("lmdb://", "needs a directory"),
        ("diskcache://", "needs a directory"),
    ],
)
def test_bad_options(url: str, message: str) -> None:
    with pytest.raises(BadOption, match=message):
        sippcache.open(url)


def test_unknown_scheme_lists_known_backends() -> None:
    with pytest.raises(UnknownBackend, match=r"no cache backend named 'nosuch' \(known: .*diskcache, lmdb, ram"):
        sippcache.open("nosuch:///x")


@pytest.mark.parametrize(
    "text, value",
    [
        ("1048576", 1048576),
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("10k", 10_000),
        (" 3 KiB ", 3072),
    ],
)
def test_sizes(text: str, value: int) -> None:
    assert Size.parse(text) == value


def test_coercion_of_every_type() -> None:
    spec = {"s": Size, "i": int, "f": float, "b": bool, "t": str}
    raw = {"s": "1KiB", "i": "7", "f": "0.5", "b": "yes", "t": "x"}
    assert coerce_options("demo", raw, spec) == {"s": 1024, "i": 7, "f": 0.5, "b": True, "t": "x"}


@pytest.mark.parametrize("name, requirement", [("lmdb", "lmdb>=1.4"), ("diskcache", "diskcache>=5.6,<6")])
def test_a_missing_builtin_library_names_the_package_not_an_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, requirement: str
) -> None:
    """lmdb and diskcache are sippcache's own dependencies: no extra installs them, so the
    message (only an environment that lost the package sees it) names the package to install."""
    monkeypatch.setitem(sys.modules, name, None)  # makes `import lmdb` fail
    monkeypatch.delitem(sys.modules, f"sippcache.backends.{name}", raising=False)
    with pytest.raises(MissingDependency) as raised:
        sippcache.open(f"{name}://{tmp_path}/never-created")
    message = str(raised.value)
    assert f'pip install "{requirement}"' in message and "sippcache[" not in message, message
    assert not (tmp_path / "never-created").exists()
    info = sippcache.backends()
    assert not info[name].usable and info[name].problem == message
    assert info["ram"].usable  # the others keep working


def test_the_builtin_backends_libraries_are_base_dependencies() -> None:
    """A bare `pip install sippcache` opens every built-in backend (the default store is LMDB):
    their libraries are in [project] dependencies, with the requirement the registry names."""
    import tomllib

    from sippcache.registry import BUILTINS

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    needed = {requirement for _, package, requirement in BUILTINS.values() if package is not None}
    assert needed == {"lmdb>=1.4", "diskcache>=5.6,<6"}
    assert needed <= set(project["dependencies"])
    extras = project["optional-dependencies"]
    assert not {"lmdb", "diskcache", "all"} & set(extras)
    assert not any(name in req for reqs in extras.values() for req in reqs for name in ("[lmdb", "[diskcache", "[all"))


def test_default_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SIPPCACHE_URL", "ram://?max_bytes=1MiB")
    with sippcache.open() as cache:
        assert cache.stats().max_bytes == 2**20
    monkeypatch.delenv("SIPPCACHE_URL")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert sippcache.default_url() == f"lmdb://{tmp_path}/sippcache/lmdb"
    with sippcache.open() as cache:
        cache.store([1], b"x")
    assert (tmp_path / "sippcache" / "lmdb" / "data.mdb").exists()


def test_builtins_are_listed_as_usable() -> None:
    info = sippcache.backends()
    for name in ("ram", "lmdb", "diskcache"):
        assert info[name].usable and info[name].origin == "built-in"


# -- backends registered at run time -----------------------------------------------------


@pytest.fixture
def registry_restored() -> Iterator[None]:
    """Registrations are process-wide: each test leaves none behind."""
    yield
    reset_backends()


def test_a_registered_class_opens_by_url_and_is_listed(registry_restored: None) -> None:
    register_backend("memo", "sippcache.backends.ram:RAMBackend")
    register_backend("memo", "sippcache.backends.ram:RAMBackend")  # the same target again: nothing changes
    with sippcache.open("memo://?max_bytes=1MiB") as cache:
        assert isinstance(cache, RAMBackend) and cache.stats().max_bytes == 2**20
        cache.store([1, 2], b"registered")
        match = cache.lookup([1, 2, 3])
        assert match is not None and bytes(match.blob) == b"registered"
    info = sippcache.backends()["memo"]
    assert (info.usable, info.origin, info.target) == (True, RUNTIME_ORIGIN, "sippcache.backends.ram:RAMBackend")
    with pytest.raises(UnknownBackend, match=r"known: .*\bmemo\b"):
        sippcache.open("nosuch://")
    with pytest.raises(ValueError, match=r"already registered for 'sippcache\.backends\.ram:RAMBackend'"):
        register_backend("memo", "sippcache.backends.lmdb:LMDBBackend")


@pytest.mark.parametrize(
    "name, target, message",
    [
        ("Memo", "sippcache.backends.ram:RAMBackend", "lowercase URL scheme"),
        ("my_store", "sippcache.backends.ram:RAMBackend", "lowercase URL scheme"),
        ("", "sippcache.backends.ram:RAMBackend", "lowercase URL scheme"),
        ("9lives", "sippcache.backends.ram:RAMBackend", "lowercase URL scheme"),
        (None, "sippcache.backends.ram:RAMBackend", "lowercase URL scheme"),
        ("memo", "sippcache.backends.ram.RAMBackend", "package.module:Class"),
        ("memo", "sippcache.backends.ram:", "package.module:Class"),
        ("memo", ":RAMBackend", "package.module:Class"),
        ("memo", "sippcache.backends.ram:RAM:Backend", "package.module:Class"),
        ("memo", "sippcache-backends.ram:RAMBackend", "package.module:Class"),
        ("memo", RAMBackend, "package.module:Class"),
        ("lmdb", "sippcache.backends.ram:RAMBackend", "taken by a built-in"),
        ("tiered", "sippcache.backends.ram:RAMBackend", "taken by a built-in"),
    ],
)
def test_register_backend_refuses_bad_names_targets_and_built_in_names(
    registry_restored: None, name: Any, target: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        register_backend(name, target)
    assert "memo" not in sippcache.backends()


def test_a_registered_target_that_does_not_load_is_a_broken_plugin(registry_restored: None) -> None:
    register_backend("ghostly", "sippcache_no_such_module:Backend")
    register_backend("notaclass", "sippcache.registry:BUILTINS")
    with pytest.raises(BrokenPlugin, match=r"register_backend\('ghostly', .*ModuleNotFoundError"):
        sippcache.open("ghostly:///x")
    with pytest.raises(BrokenPlugin, match="is not a class"):
        sippcache.open("notaclass:///x")
    info = sippcache.backends()
    assert not info["ghostly"].usable and "sippcache_no_such_module" in (info["ghostly"].problem or "")
    assert info["ram"].usable  # nothing else is affected


class TestRegisteredAtRunTime(ReopenTests, SharedStoreTests, BackendTests):
    """The sqlite toy's module, importable but installed nowhere, registered at run time.

    The whole suite but `ProcessTests`: its children open the URL in a fresh
    interpreter, which knows nothing of this process's registration.
    """

    @pytest.fixture
    def cache_url(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
        monkeypatch.syspath_prepend(str(SQLITE_TOY))
        register_backend("sqliteruntime", "sippcache_sqlite_toy:SQLiteBackend")
        yield f"sqliteruntime://{tmp_path}/store"
        reset_backends()
        sys.modules.pop("sippcache_sqlite_toy", None)  # tests/test_plugins.py imports the installed copy
