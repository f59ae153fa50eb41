"""Every `sippcache` command in README.md and docs/, as it is spelled there.

The README's managed-proxy command once failed as a user typed it (the entry point
dropped the ``--`` before llama-server's arguments) while every test started
``python -m sippcache.proxy``. So the commands are read out of the pages' shell
blocks, not copied into the tests: each one goes through the `sippcache` entry
point and the parser of the program it starts, and the managed proxy runs for real
through the installed console script.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from sippcache.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHELL = {"bash", "sh", "shell", "console"}


def shell_blocks(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, command line) of every command in the page's shell blocks, with
    backslash continuations joined and a console's ``$`` prompt dropped."""
    language: str | None = None
    pending, start = "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            language = None if language is not None else fence.group(1)
            continue
        if language not in _SHELL:
            continue
        if language == "console":
            if not line.startswith("$ "):
                continue  # a console block's output
            line = line[2:]
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def sippcache_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments after `sippcache`) for every `sippcache` invocation in the pages."""
    found = []
    for page in PAGES:
        for number, line in shell_blocks(page):
            for part in re.split(r"&&|\|\||;", line):
                words = shlex.split(part, comments=True)
                if words and Path(words[0]).name == "sippcache":
                    found.append((f"{page.relative_to(ROOT)}:{number}", words[1:]))
    return found


COMMANDS = sippcache_commands()


def test_the_pages_spell_the_commands_the_tests_run() -> None:
    """The reader finds the commands (README's demo, serve and both proxy forms at least)."""
    spelled = {" ".join(args[:1]) for _, args in COMMANDS}
    assert {"demo", "backends", "serve", "proxy"} <= spelled
    assert any(args[0] == "proxy" and "--" in args for _, args in COMMANDS)


def _handed_over(args: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str] | None:
    """Run `sippcache ARGS` through the click entry point; for `serve` and `proxy`, the
    arguments their own programs receive (those programs replaced by a recorder)."""
    received: list[list[str]] = []

    def record(argv: list[str], prog: str | None = None) -> int:
        received.append(list(argv))
        return 0

    import sippcache.proxy
    import sippcache.server

    monkeypatch.setattr(sippcache.proxy, "main", record)
    monkeypatch.setattr(sippcache.server, "main", record)
    name = args[0]
    if name in ("serve", "proxy"):
        with pytest.raises(SystemExit) as stopped:
            main.main(args, prog_name="sippcache", standalone_mode=False)
        assert stopped.value.code == 0
        return received[0]
    # Any other command: its options must parse (running it is other tests' work: the demo loads gemma).
    context = main.make_context("sippcache", list(args))
    command = main.get_command(context, name)
    assert command is not None, f"no command {name!r}"
    command.make_context(name, list(args[1:]), parent=context)
    return None


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_command_parses_as_spelled(where: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point hands `serve` and `proxy` every argument as typed (``--`` included),
    and their own parsers take them."""
    try:
        handed = _handed_over(args, monkeypatch)
    except click.ClickException as exc:
        pytest.fail(f"{where}: sippcache {' '.join(args)}: {exc.format_message()}")
    if handed is None:
        return
    assert handed == args[1:], f"{where}: the entry point changed the arguments"
    if args[0] == "proxy":
        from sippcache.proxy.settings import build_parser

        parsed = build_parser().parse_args(handed)
        after = handed[handed.index("--") + 1 :] if "--" in handed else []
        assert parsed.server_args == after, f"{where}: llama-server's arguments were not kept apart"
    else:
        from sippcache.server.settings import build_parser as serve_parser

        serve_parser().parse_args(handed)


def test_proxy_passes_llama_server_arguments_after_the_separator(monkeypatch: pytest.MonkeyPatch) -> None:
    """What failed from outside: `sippcache proxy ... -- -c 4096` said "unrecognized arguments: -c"."""
    args = ["proxy", "--llama-server", "ls", "--model", "m.gguf", "--", "-c", "4096", "--no-warmup"]
    assert _handed_over(args, monkeypatch) == args[1:]


def test_backends_runs_as_spelled() -> None:
    """`sippcache backends` as the pages spell it, through the installed console script: every
    built-in backend listed as usable."""
    import subprocess

    script = Path(sys.executable).parent / "sippcache"
    spelled = {tuple(args) for _, args in COMMANDS if args[0] == "backends"}
    assert spelled
    for args in spelled:
        done = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("│")}
        for name in ("ram", "lmdb", "diskcache", "tiered"):
            assert "yes" in rows[name], done.stdout


def _readme_managed_proxy() -> list[str]:
    return next(a for w, a in COMMANDS if w.startswith("README") and a[0] == "proxy" and "--llama-server" in a)


def test_readme_managed_proxy_starts_and_answers(tmp_path: Path) -> None:
    """README's managed command, started by the `sippcache` console script with the
    placeholders filled in (a free port, the store in $SIPPCACHE_URL): llama-server gets the arguments after
    ``--`` (its context size shows them) and a completion is answered."""
    from harness.proxy_tools import ProxyServer, llama_server_binary
    from harness.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "model.gguf", n_ctx_train=65536)
    args = _readme_managed_proxy()[1:]
    filled = [
        str(llama_server_binary()) if a.endswith("/llama-server") else str(model) if a == "model.gguf" else a
        for a in args
    ]
    after = filled[filled.index("--") + 1 :]
    program = [str(Path(sys.executable).parent / "sippcache"), "proxy"]
    store = {"SIPPCACHE_URL": f"lmdb://{tmp_path}/store"}  # its default store, not the user cache folder
    proxy = ProxyServer(filled, tmp_path / "proxy.log", program=program, env=store)
    try:
        proxy.wait_ready()
        props: dict[str, Any] = json.loads(proxy.get("/props"))
        n_ctx = props["default_generation_settings"]["n_ctx"]
        parallel = int(filled[filled.index("--parallel") + 1])
        assert n_ctx * parallel == int(after[after.index("-c") + 1]), proxy.log_tail()
        status, _, answer = proxy.post("/completion", {"prompt": "The keeper's log", "n_predict": 4})
        assert status == 200 and answer["tokens_predicted"] >= 1, answer
    finally:
        proxy.stop()


def _attach_pair(page: Path) -> tuple[list[str], list[str]]:
    """The page's attach example: its `llama-server` command and the `sippcache proxy --upstream` one."""
    lines = [shlex.split(line) for _, line in shell_blocks(page)]
    server = next(words for words in lines if words and words[0] == "llama-server")
    proxy = next(words for words in lines if words[:2] == ["sippcache", "proxy"] and "--upstream" in words)
    return server, proxy


def test_proxy_attach_example_starts_and_answers(tmp_path: Path) -> None:
    """docs/proxy.md's attach example as spelled, placeholders filled (the model, a free port for
    8080, a folder for /dev/shm/slots, the store): llama-server takes its flags, the proxy's start
    checks pass (the probe slot save lands in --slot-dir), and a completion is answered through it."""
    from harness.proxy_tools import LlamaServer, ProxyServer, llama_server_binary
    from harness.servers import free_port
    from harness.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "model.gguf", n_ctx_train=8192)
    port = free_port()
    slots = tmp_path / "slots"
    slots.mkdir()
    filled = {"model.gguf": str(model), "8080": str(port), "/dev/shm/slots": str(slots)}
    filled["lmdb:///var/cache/sipp"] = f"lmdb://{tmp_path}/store"

    def fill(words: list[str]) -> list[str]:
        out = []
        for word in words:
            for placeholder, value in filled.items():
                word = word.replace(placeholder, value)
            out.append(word)
        return out

    server_words, proxy_words = _attach_pair(ROOT / "docs" / "proxy.md")
    server = LlamaServer(model, tmp_path / "llama-server.log", port=port)
    server.argv = [str(llama_server_binary()), *fill(server_words[1:]), "-c", "4096"]
    program = [str(Path(sys.executable).parent / "sippcache"), "proxy"]
    try:
        server.start()
        proxy = ProxyServer(fill(proxy_words[2:]), tmp_path / "proxy.log", program=program)
        try:
            proxy.wait_ready()
            status, _, answer = proxy.post("/completion", {"prompt": "The keeper's log", "n_predict": 4})
            assert status == 200 and answer["tokens_predicted"] >= 1, answer
        finally:
            proxy.stop()
    finally:
        server.stop()
