"""The `sippcache` command, run as a user would: a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


# The console script pip installed beside this interpreter (not whatever is first on PATH).
SCRIPT = Path(sys.executable).with_name("sippcache")


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"the sippcache console script is not installed at {SCRIPT}"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_backends_table() -> None:
    result = run("backends")
    assert result.returncode == 0, result.stderr
    for name in ("ram", "lmdb", "diskcache"):
        assert name in result.stdout
    assert "built-in" in result.stdout


def test_backends_json() -> None:
    result = run("backends", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["lmdb"]["usable"] is True and info["lmdb"]["origin"] == "built-in"


def test_unknown_command_fails_cleanly() -> None:
    result = run("no-such-command")
    assert result.returncode != 0 and "Traceback" not in result.stderr
