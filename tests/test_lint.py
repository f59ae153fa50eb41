"""Typing, lint and formatting are part of the test command: `mypy --strict`, `ruff check` (rule set in
pyproject.toml) and `ruff format --check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The installed code: the package and the Redis plugin's package.
TYPED = ["sippcache", "plugins/sippcache-redis/sippcache_redis"]
#: Everything of ours that is Python.
LINTED = ["sippcache", "plugins", "tests", "harness", "benchmarks"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # Bounded, generously: mypy with no cache takes minutes on 2 shared cores.
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False, timeout=1800
    )


def test_mypy_strict_finds_nothing() -> None:
    done = _run("mypy", "--strict", *TYPED)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", "--no-cache", *LINTED)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_changes_nothing() -> None:
    """Formatting is ruff's (`ruff format`) over the whole tree, as a contributor runs it from the
    root: the Python blocks of the docs' Markdown too; `# fmt: skip` only keeps a data table in rows."""
    done = _run("ruff", "format", "--check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr
