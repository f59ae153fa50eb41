"""`sippcache.proxy.ready`: the slot files a proxy keeps for restores that copy nothing. Real files
in a real folder: what is kept, renamed, removed for room or superseded, held while read, and
adopted by the next proxy; and `SlotStore.keep` handing a stored save's file over."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sippcache
from sippcache.proxy import slotfile
from sippcache.proxy.ready import READY_PREFIX, ReadyFiles
from sippcache.proxy.slots import Origin
from sippcache.proxy.store import SlotStore, Snapshot
from tests.test_proxy_store import real_state

SYSTEM = tuple(range(1000, 1400))
NS = "llama-server:f/"


def saved(folder: Path, tokens: tuple[int, ...], state: int | bytes = 1000) -> str:
    """A slot file as llama-server saves one: `tokens` and a state (bytes, or that many zeros: the
    proxy reads no more than the header of a file it kept itself)."""
    path = folder / f"sippcache-save-{os.getpid()}-{len(tokens)}-{tokens[-1]}.slot"
    version = 4 if isinstance(state, int) else 3  # a real state here: llama-cpp-python's llama.cpp writes 3
    path.write_bytes(b"".join(slotfile.build(version, tokens, bytes(state) if isinstance(state, int) else state)))
    return str(path)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real llama.cpp state (the tiny model's): what a proxy checks in a file another proxy kept."""
    import llama_cpp

    from harness.tinymodel import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("proxy-ready-model") / "tiny.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False)
    try:
        return real_state(llm, (1, *range(10, 80)))
    finally:
        llm.close()


def ready_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(READY_PREFIX))


def best_tokens(ready: ReadyFiles, tokens: tuple[int, ...], namespace: str = NS) -> tuple[tuple[int, ...], int] | None:
    with ready.best(namespace, tokens) as found:
        return None if found is None else (found[0].origin.tokens, found[1])


def test_a_kept_file_serves_the_prompt_it_shares_most_with(tmp_path: Path) -> None:
    ready = ReadyFiles(str(tmp_path), 1 << 20)
    alice, bob = (*SYSTEM, 1, 2, 3), (*SYSTEM, 7, 8)
    for tokens in (alice, bob):
        path = saved(tmp_path, tokens)
        assert ready.add(path, NS, Origin(tokens, len(tokens)))
        assert not os.path.exists(path)  # renamed, not copied
    assert len(ready) == 2 and len(ready_names(tmp_path)) == 2
    assert best_tokens(ready, (*alice, 4, 5)) == (alice, len(alice))
    assert best_tokens(ready, (*bob, 9)) == (bob, len(bob))
    assert best_tokens(ready, (*SYSTEM, 5)) is not None  # the system prompt: either gives it
    assert best_tokens(ready, (*alice, 4), namespace="llama-server:f/tenant") is None  # another scope's
    assert best_tokens(ready, (5, 6, 7)) is None


def test_the_least_recently_used_go_for_room_and_a_file_being_read_stays(tmp_path: Path) -> None:
    each = len(b"".join(slotfile.build(4, (*SYSTEM, 0), bytes(1000))))
    ready = ReadyFiles(str(tmp_path), 2 * each)
    first, second, third = ((*SYSTEM, n) for n in (1, 2, 3))
    ready.add(saved(tmp_path, first), NS, Origin(first, len(SYSTEM)))
    ready.add(saved(tmp_path, second), NS, Origin(second, len(SYSTEM)))
    with ready.best(NS, (*first, 9)) as found:  # the first is used now: the second goes for the third
        assert found is not None and found[0].origin.tokens == first
        ready.used(found[0])
    ready.add(saved(tmp_path, third), NS, Origin(third, len(SYSTEM)))
    assert sorted(f.origin.tokens for f in ready._files) == [first, third]
    assert len(ready_names(tmp_path)) == 2
    with ready.best(NS, (*third, 9)) as held:  # held while llama-server reads it: not removed
        assert held is not None
        ready.add(saved(tmp_path, second), NS, Origin(second, len(SYSTEM)))
        assert held[0] in ready._files and os.path.exists(held[0].path)
    assert ready.nbytes <= 2 * each
    too_big = saved(tmp_path, (*SYSTEM, 4), state=3 * each)
    assert not ready.add(too_big, NS, Origin((*SYSTEM, 4), 0))
    assert not os.path.exists(too_big)  # a file over the budget is removed, nothing else is
    assert len(ready) == 2


def test_a_conversations_later_turn_replaces_its_earlier_file(tmp_path: Path) -> None:
    """The store's supersede rule: a state that keeps all of an earlier one's prompt and all but the
    end of its answer replaces it; a new conversation over the same system prompt does not."""
    ready = ReadyFiles(str(tmp_path), 1 << 20)
    turn1 = (*SYSTEM, 1, 2, 3, 50, 51)
    ready.add(saved(tmp_path, turn1), NS, Origin(turn1, len(turn1) - 2))
    other = (*SYSTEM, 9, 9)
    ready.add(saved(tmp_path, other), NS, Origin(other, len(other)))
    turn2 = (*turn1[:-1], 99, 7, 8, 60)
    ready.add(saved(tmp_path, turn2), NS, Origin(turn2, len(turn2) - 1))
    assert sorted(f.origin.tokens for f in ready._files) == sorted([other, turn2])
    ready.add(saved(tmp_path, other), NS, Origin(other, len(other)))  # the same state saved again
    assert sorted(f.origin.tokens for f in ready._files) == sorted([other, turn2])
    assert len(ready_names(tmp_path)) == 2


def test_recurrent_states_serve_only_prompts_they_are_a_prefix_of(tmp_path: Path) -> None:
    ready = ReadyFiles(str(tmp_path), 1 << 20, can_cut=False)
    turn1 = (*SYSTEM, 1, 2)
    ready.add(saved(tmp_path, turn1), NS, Origin(turn1, len(turn1)))
    turn2 = (*turn1, 3, 4)
    ready.add(saved(tmp_path, turn2), NS, Origin(turn2, len(turn2)))
    ready.add(saved(tmp_path, turn2), NS, Origin(turn2, len(turn2)))  # the same state again: one file
    assert len(ready) == 2  # both kept: a state is extended only at exactly its length
    assert best_tokens(ready, (*turn1, 3, 4, 5)) == (turn2, len(turn2))
    assert best_tokens(ready, (*turn1, 9)) == (turn1, len(turn1))
    assert best_tokens(ready, (*SYSTEM, 9)) is None


def test_without_a_folder_to_keep_them_in_close_removes_every_file(tmp_path: Path) -> None:
    ready = ReadyFiles(str(tmp_path), 1 << 20)
    ready.add(saved(tmp_path, (*SYSTEM, 1)), NS, Origin((*SYSTEM, 1), 0))
    ready.add(saved(tmp_path, (*SYSTEM, 2)), "llama-server:f/b", Origin((*SYSTEM, 2), 0))
    ready.close()
    assert list(tmp_path.iterdir()) == []


def test_kept_files_are_adopted_by_the_next_proxy_newest_first_within_its_budget(tmp_path: Path, state: bytes) -> None:
    """With a folder to keep them in, close moves the files there; the next proxy takes them into
    its own folder (named with its pid), reads their tokens from their headers, and removes what
    its budget has no room for, oldest first. A live process's files are never taken."""
    staging, kept, later = tmp_path / "staging", tmp_path / "kept", tmp_path / "later"
    for folder in (staging, kept, later):
        folder.mkdir()
    first = ReadyFiles(str(staging), 1 << 20, keep_in=str(kept))
    tokens = [(*SYSTEM, n, n) for n in range(3)]
    for i, t in enumerate(tokens):
        first.add(saved(staging, t, state), NS, Origin(t, len(SYSTEM) + i))
        time.sleep(0.01)  # distinct times: the newest is known
    live = kept / f"{READY_PREFIX}{os.getpid()}-{ReadyFiles.space(NS)}-0-ab.slot"
    live.write_bytes(b"".join(slotfile.build(3, tokens[0], state)))  # a running proxy's
    first.close()
    assert list(staging.iterdir()) == [] and len(ready_names(kept)) == 4
    # Their names carry this test's pid, alive: named as a finished process's, as a restarted proxy finds them.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    gone = int(done.stdout)
    for path in kept.iterdir():
        if path != live:
            path.rename(kept / path.name.replace(f"{READY_PREFIX}{os.getpid()}-", f"{READY_PREFIX}{gone}-"))
    each = os.path.getsize(live)
    second = ReadyFiles(str(later), 2 * each, keep_in=str(kept))
    assert sorted(f.origin.tokens for f in second._files) == sorted(tokens[1:])  # the two newest
    assert {f.origin.prompt for f in second._files} == {len(SYSTEM) + 1, len(SYSTEM) + 2}
    assert all(os.path.basename(f.path).startswith(f"{READY_PREFIX}{os.getpid()}-") for f in second._files)
    assert ready_names(kept) == [live.name]  # the oldest removed for room; the live process's left
    assert best_tokens(second, (*tokens[2], 5)) == (tokens[2], len(tokens[2]))
    second.add(saved(later, (*SYSTEM, 7, 7)), NS, Origin((*SYSTEM, 7, 7), 0))  # the oldest adopted goes first
    assert sorted(f.origin.tokens for f in second._files) == sorted([tokens[2], (*SYSTEM, 7, 7)])


def test_a_stored_save_leaves_its_slot_file_ready_and_a_failed_one_removes_it(tmp_path: Path) -> None:
    store = SlotStore(
        sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path), ready_bytes=1 << 20
    )
    tokens = (*SYSTEM, 1, 2, 3)
    path = saved(tmp_path, tokens)
    assert store.keep(Snapshot(path, tokens, len(SYSTEM), time.perf_counter()), None, "") is not None
    assert not os.path.exists(path) and len(store.ready) == 1
    (file,) = store.ready._files
    assert file.origin == Origin(tokens, len(SYSTEM))
    assert slotfile.read_tokens(file.path) == tokens  # llama-server's own file, as it wrote it
    short = saved(tmp_path, (1, 2, 3))  # under min_tokens: not stored, not kept
    assert store.keep(Snapshot(short, (1, 2, 3), 3, time.perf_counter()), None, "") is None
    broken = tmp_path / "sippcache-save-broken.slot"
    broken.write_bytes(b"not a slot file at all")
    assert store.keep(Snapshot(str(broken), tokens, 3, time.perf_counter()), None, "") is None
    assert not os.path.exists(short) and not broken.exists() and len(store.ready) == 1
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_ready_files_a_proxy_killed_outright_left_are_removed_unless_kept(tmp_path: Path, state: bytes) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    name = f"{READY_PREFIX}{int(done.stdout)}-{ReadyFiles.space(NS)}-3-ab.slot"
    (tmp_path / name).write_bytes(b"".join(slotfile.build(3, (*SYSTEM, 1), state)))
    keeping = SlotStore(
        sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path),
        ready_bytes=1 << 20, keep_ready_in=str(tmp_path),
    )  # fmt: skip
    assert len(keeping.ready) == 1  # adopted
    keeping.close()
    adopted = name.replace(str(int(done.stdout)), str(os.getpid()), 1)
    assert [p.name for p in tmp_path.iterdir()] == [adopted]  # kept, now this process's
    (tmp_path / name).write_bytes(b"".join(slotfile.build(4, (*SYSTEM, 2), bytes(10))))  # another one left
    SlotStore(sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [adopted]  # removed: a live process's stays


def test_the_ready_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ready-bytes takes a size (default: a quarter of the slot folder's room, at most 8 GiB), a
    wrong one is refused in one line; --ready-keep's folder beside a managed proxy's staging
    folders is private, and one that is not is refused."""
    from sippcache.proxy.settings import build_parser
    from sippcache.proxy.staging import READY_BYTES, kept_dir, ready_budget

    args = build_parser().parse_args(["--upstream", "u", "--slot-dir", "d", "--ready-bytes", "512MiB", "--keep-ready"])
    assert args.ready_bytes == 512 << 20 and args.ready_keep
    assert build_parser().parse_args(["--upstream", "u"]).ready_bytes is None  # the default, from the folder
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--ready-bytes", "lots"])
    assert exited.value.code == 2 and "'lots' is not a size" in capsys.readouterr().err
    assert ready_budget(4 << 30) == 1 << 30 and ready_budget(1 << 40) == READY_BYTES == 8 << 30
    kept = kept_dir(str(tmp_path))
    assert os.stat(kept).st_mode & 0o777 == 0o700 and kept_dir(str(tmp_path)) == kept
    os.chmod(kept, 0o755)
    with pytest.raises(PermissionError, match="not a folder only this user may use"):
        kept_dir(str(tmp_path))


def test_a_kept_file_cut_short_or_changed_is_never_given_to_llama_server(tmp_path: Path, state: bytes) -> None:
    """llama-server aborts on a slot file cut short (GGML_ASSERT in llama_state_seq_load_file): a kept
    file whose state does not read through to its end is not adopted, and a file changed since this
    proxy kept it is removed when a lookup finds it (the store then serves the prompt)."""
    gone = int(subprocess.run([sys.executable, "-c", "print(__import__('os').getpid())"], capture_output=True).stdout)
    whole, short = (*SYSTEM, 1), (*SYSTEM, 2)
    for tokens, cut in ((whole, 0), (short, 100)):
        data = b"".join(slotfile.build(3, tokens, state))
        name = f"{READY_PREFIX}{gone}-{ReadyFiles.space(NS)}-0-{tokens[-1]}.slot"
        (tmp_path / name).write_bytes(data[: len(data) - cut])
    ready = ReadyFiles(str(tmp_path), 1 << 20, keep_in=str(tmp_path))
    assert [f.origin.tokens for f in ready._files] == [whole]
    assert len(ready_names(tmp_path)) == 1  # the one cut short removed
    (file,) = ready._files
    assert best_tokens(ready, (*whole, 5)) == (whole, len(whole))
    with open(file.path, "r+b") as f:
        f.truncate(os.path.getsize(file.path) - 1)
    assert best_tokens(ready, (*whole, 5)) is None
    assert ready_names(tmp_path) == [] and len(ready) == 0
