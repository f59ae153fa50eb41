"""URLs, options and the errors of the backend registry."""

from __future__ import annotations

import sys

import pytest

import sippcache
from sippcache import BadOption, MissingDependency, UnknownBackend
from sippcache.options import Size, coerce_options
from sippcache.registry import parse_url


@pytest.mark.parametrize(
    "url, expected",
    [
        ("ram://", ("ram", "", {})),
        ("ram://?max_bytes=2GiB", ("ram", "", {"max_bytes": "2GiB"})),
        ("lmdb:///var/cache/sipp?max_bytes=20GiB&sync=false",
         ("lmdb", "/var/cache/sipp", {"max_bytes": "20GiB", "sync": "false"})),
        ("diskcache://relative/dir", ("diskcache", "relative/dir", {})),
        ("LMDB:///with%20space", ("lmdb", "/with space", {})),
    ],
)  # fmt: skip
def test_parse_url(url, expected) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["", "/just/a/path", "lmdb:/one-slash", "nocolon"])
def test_not_a_url(url) -> None:
    with pytest.raises(UnknownBackend, match="not a cache URL"):
        sippcache.open(url)


@pytest.mark.parametrize(
    "url, message",
    [("ram://?max_bytes=1GiB&max_bytes=2GiB", "twice"), ("ram://?max_bytes", "max_bytes"),
     ("ram://#frag", "fragment"), ("ram://?max_bytes=-1", "max_bytes"), ("ram://?max_entries=many", "whole number"),
     ("lmdb:///tmp/x?sync=maybe", "true/false"), ("ram://?colour=red", "no option 'colour'"),
     ("ram://?max_bytes=0", "max_bytes must be positive"), ("ram://?max_entries=0", "max_entries"),
     ("ram:///some/path", "takes no path"), ("lmdb://", "needs a directory"), ("diskcache://", "needs a directory")],
)  # fmt: skip
def test_bad_options(url, message) -> None:
    with pytest.raises(BadOption, match=message):
        sippcache.open(url)


def test_unknown_scheme_lists_known_backends() -> None:
    with pytest.raises(UnknownBackend, match=r"no cache backend named 'nosuch' \(known: .*diskcache, lmdb, ram"):
        sippcache.open("nosuch:///x")


@pytest.mark.parametrize(
    "text, value",
    [("1048576", 1048576), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000),
     ("10k", 10_000), (" 3 KiB ", 3072)],
)  # fmt: skip
def test_sizes(text, value) -> None:
    assert Size.parse(text) == value


def test_coercion_of_every_type() -> None:
    spec = {"s": Size, "i": int, "f": float, "b": bool, "t": str}
    raw = {"s": "1KiB", "i": "7", "f": "0.5", "b": "yes", "t": "x"}
    assert coerce_options("demo", raw, spec) == {"s": 1024, "i": 7, "f": 0.5, "b": True, "t": "x"}


def test_missing_dependency_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lmdb", None)  # makes `import lmdb` fail
    monkeypatch.delitem(sys.modules, "sippcache.backends.lmdb", raising=False)
    with pytest.raises(MissingDependency, match=r'pip install "sippcache\[lmdb\]"'):
        sippcache.open("lmdb:///tmp/never-created")
    info = sippcache.backends()
    assert not info["lmdb"].usable and "sippcache[lmdb]" in (info["lmdb"].problem or "")
    assert info["ram"].usable  # the others keep working


def test_default_url(monkeypatch, tmp_path) -> None:
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
