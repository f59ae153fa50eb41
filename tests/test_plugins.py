"""Third-party backends: real distributions, built and installed into a temporary
directory, found through the `sippcache.backends` entry point group."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import sippcache
from sippcache import BrokenPlugin, UnknownBackend, register_backend
from sippcache.registry import reset_backends

PLUGINS = Path(__file__).parent / "plugins"


def install_into(site: Path, source: Path) -> None:
    """pip-install the distribution in `source` into the directory `site` (offline, no deps)."""
    offline = ["--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", *offline, "--target", str(site), str(source)], check=True, timeout=600
    )


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the installed toy distributions (as a site-packages)."""
    site = tmp_path_factory.mktemp("site")
    for name in ("sqlite_toy", "broken_toy"):
        source = tmp_path_factory.mktemp("src") / name
        shutil.copytree(PLUGINS / name, source)
        install_into(site, source)
    assert list(site.glob("sippcache_sqlite_toy-1.0.dist-info/entry_points.txt"))
    return site


@pytest.fixture
def with_plugins(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(plugin_site))
    reset_backends()  # the entry points are read once per process: read them again with the site on sys.path
    yield plugin_site
    reset_backends()


def test_plugin_opens_by_url(with_plugins: Path, tmp_path: Path) -> None:
    with sippcache.open(f"sqlitetoy://{tmp_path}/db?max_bytes=1MiB") as cache:
        assert type(cache).__module__ == "sippcache_sqlite_toy"
        cache.store([1, 2, 3], b"plugin")
        match = cache.lookup([1, 2, 3, 4])
        assert match is not None and bytes(match.blob) == b"plugin"


def test_backends_lists_plugins_and_problems(with_plugins: Path) -> None:
    info = sippcache.backends()
    assert info["sqlitetoy"].usable and info["sqlitetoy"].origin == "sippcache-sqlite-toy 1.0"
    assert not info["brokentoy"].usable
    assert "broken on purpose" in (info["brokentoy"].problem or "")
    assert not info["ghosttoy"].usable
    assert all(info[name].usable for name in ("ram", "lmdb", "diskcache", "tiered"))


def test_broken_plugin_names_entry_point_and_distribution(with_plugins: Path) -> None:
    with pytest.raises(BrokenPlugin, match=r"brokentoy = sippcache_broken_toy:Backend in sippcache-broken-toy 0\.1"):
        sippcache.open("brokentoy:///x")
    with pytest.raises(BrokenPlugin, match="ModuleNotFoundError"):
        sippcache.open("ghosttoy:///x")
    with sippcache.open("ram://") as cache:  # a broken plugin breaks nothing else
        cache.store([1], b"fine")


def test_unknown_scheme_lists_plugins(with_plugins: Path) -> None:
    with pytest.raises(UnknownBackend) as info:
        sippcache.open("nope://")
    known = str(info.value).split("(known: ")[1].rstrip(")").split(", ")
    assert known == sorted(known)  # other installed plugins (sippcache-redis in a checkout) may be listed too
    assert {"brokentoy", "diskcache", "ghosttoy", "lmdb", "ram", "sqlitetoy", "tiered"} <= set(known)


def test_entry_points_are_read_once_per_process(
    plugin_site: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    reset_backends()
    try:
        with pytest.raises(UnknownBackend):
            sippcache.open("sqlitetoy:///x")  # read now, without the plugins
        monkeypatch.syspath_prepend(str(plugin_site))
        with pytest.raises(UnknownBackend):
            sippcache.open("sqlitetoy:///x")  # installed since: not read again
        reset_backends()
        with sippcache.open(f"sqlitetoy://{tmp_path}/db") as cache:
            cache.store([1], b"found after the reset")
    finally:
        reset_backends()


def test_run_time_registration_cannot_take_an_installed_plugins_name(with_plugins: Path) -> None:
    with pytest.raises(ValueError, match=r"'sqlitetoy' is taken by the entry point in sippcache-sqlite-toy 1\.0"):
        register_backend("sqlitetoy", "sippcache.backends.ram:RAMBackend")
    with pytest.raises(ValueError, match=r"sippcache-broken-toy 0\.1"):
        register_backend("brokentoy", "sippcache.backends.ram:RAMBackend")  # a broken one keeps its name too
    assert sippcache.backends()["sqlitetoy"].origin == "sippcache-sqlite-toy 1.0"


def test_conformance_suite_passes_on_the_plugin(plugin_site: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(PLUGINS / "sqlite_toy" / "test_conformance.py"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 45


def test_the_route_2_example_in_the_docs_passes_the_conformance_suite(tmp_path: Path) -> None:
    """docs/plugins.md's backend written from scratch, built into a real distribution as written."""
    text = (Path(__file__).parent.parent / "docs" / "plugins.md").read_text()
    section = text[text.index("## Route 2") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    source = tmp_path / "src"
    source.mkdir()
    (source / "sippcache_dict_doc.py").write_text(code)
    (source / "pyproject.toml").write_text(
        textwrap.dedent(
            """
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "sippcache-dict-doc"
        version = "1.0"
        dependencies = ["sippcache"]
        [project.entry-points."sippcache.backends"]
        dictdoc = "sippcache_dict_doc:DictBackend"
        [tool.setuptools]
        py-modules = ["sippcache_dict_doc"]
        """
        )
    )
    (source / "test_conformance.py").write_text(
        textwrap.dedent(
            """
        import pytest
        from sippcache.testing import BackendTests

        class TestDictDoc(BackendTests):
            @pytest.fixture
            def cache_url(self):
                return "dictdoc://"
        """
        )
    )
    site = tmp_path / "site"
    install_into(site, source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(source),
            str(source / "test_conformance.py"),
        ],
        env=env,
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 60
