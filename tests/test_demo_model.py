"""The demo model's assembly leaves no partial files (250 MB each) behind: not on an
error, not on Ctrl-C, and not after a process killed outright (the next run removes them).

Real processes and the real gemma package; nothing is mocked.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from sippcache.demo.model import GEMMA_FILE_NAME, gemma_model_path, partial_path

_ASSEMBLE = "import sys; from pathlib import Path; from sippcache.demo.model import gemma_model_path; "


def partials(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.partial-*"))


def test_partial_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    target = tmp_path / GEMMA_FILE_NAME
    target.write_bytes(b"an assembled model")  # so the call assembles nothing
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale, in_use = partial_path(target, dead.pid), partial_path(target, alive.pid)
        for path in (stale, in_use):
            path.write_bytes(b"half a model")
        unrelated = tmp_path / "notes.partial-1"
        unrelated.write_text("not ours")
        assert gemma_model_path(tmp_path) == target
        assert partials(tmp_path) == sorted([in_use, unrelated])  # the live process's file stays
        assert target.read_bytes() == b"an assembled model"
    finally:
        alive.kill()
        alive.wait()
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
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and "File too large" in result.stderr, result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_assembly_leaves_no_partial_file(tmp_path: Path) -> None:
    """SIGINT while the 250 MB file is being written (retried if assembly won the race)."""
    for _ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", _ASSEMBLE + "gemma_model_path(Path(sys.argv[1]))", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not any(path.stat().st_size > 0 for path in partials(tmp_path)) and child.poll() is None:
            assert time.monotonic() < deadline, "assembly never started"
            time.sleep(0.001)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=60)
        if child.returncode == 0:  # finished before the signal: try again
            (tmp_path / GEMMA_FILE_NAME).unlink()
            continue
        assert child.returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr, stderr[-2000:]
        assert partials(tmp_path) == []
        return
    raise AssertionError("assembly finished before SIGINT every time")

