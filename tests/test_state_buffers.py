"""States are copied out of llama.cpp into buffers used again once stored (`sippcache.state.buffers.StateBuffers`):
a new buffer's pages cost several times the copy. A buffer is reused only after its state is
stored, so every stored state is still the one llama.cpp gave (logits after a restore equal the
never-cached path's)."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.llama_tools import last_logits, reference_logits
from sippcache.llama import PrefixCache
from sippcache.state.buffers import StateBuffers, allocate


def test_a_buffer_given_back_serves_the_next_state_that_fits() -> None:
    buffers = StateBuffers()
    first = buffers.take(1000)
    assert isinstance(first, mmap.mmap) and len(first) >= 2000  # room for a longer next state
    buffers.give_back(memoryview(first)[:1000])
    assert buffers.free_bytes == 1000
    again = buffers.take(1500)  # the conversation's next, longer state: the same pages
    assert again is first and buffers.free_bytes == 0
    other = buffers.take(1500)  # the first is taken: a new one
    assert other is not first
    buffers.give_back(memoryview(again)[:1500])
    buffers.give_back(memoryview(again)[:1500])  # given back twice: kept once
    assert buffers.free_bytes == 1500
    buffers.give_back(memoryview(bytearray(100)))  # not one of these buffers: ignored
    buffers.give_back(memoryview(mmap.mmap(-1, 100)))
    assert buffers.free_bytes == 1500
    larger = buffers.take(10**6)
    assert larger is not first and larger is not other


def test_free_buffers_kept_are_bounded_by_count_and_bytes() -> None:
    buffers = StateBuffers(keep=2, limit=10_000)
    taken = [buffers.take(size) for size in (1000, 2000, 3000)]
    for buffer, size in zip(taken, (1000, 2000, 3000), strict=True):
        buffers.give_back(memoryview(buffer)[:size])
    assert buffers.free_bytes == 5000  # two kept: the smallest went first
    assert buffers.take(2000) is taken[1] and buffers.take(3000) is taken[2]
    big = buffers.take(20_000)
    buffers.give_back(memoryview(big)[:20_000])
    assert buffers.free_bytes == 0  # over the limit: not kept


@pytest.mark.parametrize("chunk_tokens", [0, 64])
def test_states_copied_into_reused_buffers_restore_exactly(
    make_llama: Any, tiny_model: Path, tmp_path: Path, chunk_tokens: int
) -> None:
    """Two prompts stored one after the other, the second copied into the first's buffer once it
    was stored; each then restores with the never-cached path's logits."""
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 260) for _ in range(n)] for n in (300, 400)]
    url = f"lmdb://{tmp_path}/store"
    with PrefixCache(make_llama(tiny_model), url, chunk_tokens=chunk_tokens) as cache:
        buffers = cache._states._buffers
        for tokens in prompts:
            cache.prefill(tokens)
            cache.flush()
            assert buffers.free_bytes > 0  # stored: its buffer is free for the next state
        assert cache.stats()["entries_written"] == 2
    for tokens in prompts:
        llm = make_llama(tiny_model)
        with PrefixCache(llm, url, chunk_tokens=chunk_tokens) as cache:
            reused = cache.prefill(tokens + [7]).restored
            assert reused >= len(tokens) - 1  # the prompt's end: restored but its last token
        _, split = reference_logits(make_llama, tiny_model, tokens + [7], (reused,))
        np.testing.assert_array_equal(last_logits(llm), split)


def _resident_kib(path: Path) -> int:
    """The resident KiB of this process's mapping of `path` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            return next(int(r.split()[1]) for r in lines[i + 1 :] if r.startswith("Rss:"))
    raise AssertionError(f"{path} is not mapped")


def test_populate_makes_a_mappings_pages_present_while_other_threads_run(ram_dir: Path) -> None:
    """The proxy makes its staging files ready this way, in a worker thread at start: in one call
    (``mmap(MAP_POPULATE)``) the GIL was held throughout, and its event loop waited (a restarted
    proxy's first request, 350-580 ms on an H200 host). Here the pages are all present after, and
    the main thread ran between the slices (a count it keeps went up from one slice to a later one:
    asked before each slice, `stop` notes it)."""
    import os
    import sys
    import threading

    from sippcache.state.buffers import populate

    path = ram_dir / "populated"
    size = 256 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    switch = sys.getswitchinterval()
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        assert _resident_kib(path) < 1024  # nothing made yet
        count, marks = [0], []
        ended = threading.Event()

        def make() -> None:
            assert populate(mapping, stop=lambda: marks.append(count[0]) or False)
            ended.set()

        sys.setswitchinterval(0.0005)  # the GIL changes hands often: any slice boundary lets it go
        worker = threading.Thread(target=make)
        worker.start()
        while not ended.is_set():
            count[0] += 1
        worker.join()
        assert _resident_kib(path) == size // 1024  # every page present
        assert len(marks) == size // (2 << 20)  # asked before each 2 MiB slice
        assert marks[-1] > marks[0], marks[:8]  # this thread ran meanwhile
        mapping.close()
    finally:
        sys.setswitchinterval(switch)
        os.close(fd)
        path.unlink()


@pytest.mark.parametrize("fallocate", [True, False], ids=["posix_fallocate", "zeros written (macOS)"])
def test_allocate_grows_a_file_with_its_blocks_made(tmp_path: Path, monkeypatch: Any, fallocate: bool) -> None:
    """What a file's mapping is written through gets its blocks first (a page a file system cannot
    allocate when a copy reaches it is a SIGBUS); where there is no posix_fallocate, by writing zeros."""
    if not fallocate:
        monkeypatch.delattr(os, "posix_fallocate", raising=False)
    path = tmp_path / "staging.slot"
    path.write_bytes(b"abc")
    length = 5 << 20 | 7  # past a slice of zeros, and not a multiple of one
    fd = os.open(path, os.O_RDWR)
    try:
        allocate(fd, 3, length)
        allocate(fd, 0, 0)  # nothing to do
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[:3] == b"abc" and len(data) == 3 + length and data[3:] == bytes(length)
    assert os.stat(path).st_blocks * 512 >= len(data)  # blocks, not a hole
