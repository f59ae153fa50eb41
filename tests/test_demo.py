"""`sippcache demo` and `warm`, run as a user would: subprocesses on real stores
with the real gemma-3-270m model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sippcache
from sippcache.state.chunkentries import is_chunk_namespace

pytestmark = pytest.mark.gemma
SCRIPT = Path(sys.executable).with_name("sippcache")


def run(*args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def test_demo_twice_second_run_is_served_by_the_first(tmp_path: Path, gemma_model: Path) -> None:
    env = {"SIPPCACHE_URL": f"lmdb://{tmp_path}/cache"}
    reports, stored = [], []
    for _ in range(2):
        result = run("demo", "--json", env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        (line,) = result.stdout.strip().splitlines()
        reports.append(json.loads(line))
        with sippcache.open(env["SIPPCACHE_URL"]) as cache:
            stored.append([(e.namespace, e.key, e.created) for e in cache.entries()])
    first, second = reports
    assert first["restored_from_previous_run"] is False
    assert second["restored_from_previous_run"] is True
    for report in reports:
        assert report["reused_tokens"] == report["prompt_tokens"] > 2000  # the whole prompt, with its logits
        assert report["same_first_token"] is True
        assert report["warm_ttft_s"] > 0 and report["cold_ttft_s"] > 0
        assert report["cache_url"] == env["SIPPCACHE_URL"]
    assert stored[0] and stored[1] == stored[0]  # the second run wrote nothing: it reused the first run's entries


def test_demo_table(tmp_path: Path, gemma_model: Path) -> None:
    url = f"diskcache://{tmp_path}/[/]cache"  # the report shows it literally
    result = run("demo", "--cache", url, env={"COLUMNS": "200"})  # wide: the URL on one line
    assert result.returncode == 0, result.stderr[-2000:]
    assert url in result.stdout
    for label in (
        "cold time to first token",
        "warm time to first token",
        "speedup",
        "tokens reused",
        "cache entry",
        "served by an earlier process",
    ):
        assert label in result.stdout


def test_warm_prefills_prompt_files(tmp_path: Path, gemma_model: Path) -> None:
    prompt = tmp_path / "system.txt"
    prompt.write_text("You are a careful assistant for a harbour office. " * 40)
    url = f"lmdb://{tmp_path}/cache"
    result = run("warm", "--model", str(gemma_model), "--prompt-file", str(prompt), "--scope", "office", url, "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["prompts"][0]["reused"] == 0 and report["prompts"][0]["tokens"] > 300
    assert report["namespace"].endswith("/office")
    again = json.loads(
        run(
            "warm", "--model", str(gemma_model), "--prompt-file", str(prompt), "--scope", "office", url, "--json"
        ).stdout
    )
    assert again["prompts"][0]["reused"] == report["prompts"][0]["tokens"]  # the whole prompt, with its logits


def test_warm_pin_pins_the_prompt(tmp_path: Path, gemma_model: Path) -> None:
    prompt = tmp_path / "system.txt"
    prompt.write_text("You are a careful assistant for a harbour office. " * 10)
    url = f"lmdb://{tmp_path}/cache"
    result = run("warm", "--model", str(gemma_model), "--prompt-file", str(prompt), "--pin", url, "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    tokens = json.loads(result.stdout)["prompts"][0]["tokens"]
    with sippcache.open(url) as cache:  # the prompt's tail and its chain of 64-token chunks, all pinned
        pinned = sorted((is_chunk_namespace(e.namespace), len(e.key), e.pinned) for e in cache.entries())
    assert pinned == [(False, tokens, True), *((True, n, True) for n in range(64, tokens, 64))]


def test_warm_shows_a_prompt_file_name_literally(tmp_path: Path, gemma_model: Path) -> None:
    prompt = tmp_path / "team[red]x[bold].txt"  # rich markup: the progress bar and the report must not read it
    prompt.write_text("You are a careful assistant for a harbour office. " * 10)
    result = run("warm", "--model", str(gemma_model), "--prompt-file", str(prompt), f"lmdb://{tmp_path}/cache")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{prompt}: " in result.stdout


def test_warm_bad_input(tmp_path: Path) -> None:
    result = run("warm", "--model", str(tmp_path / "missing.gguf"), f"lmdb://{tmp_path}/cache")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    model = tmp_path / "not-a-model.gguf"
    model.write_bytes(b"garbage")
    result = run("warm", "--model", str(model), "--prompt-file", str(prompt), f"lmdb://{tmp_path}/cache")
    assert result.returncode != 0 and "Traceback" not in result.stderr
