"""`sippcache.helpers`: work shared among helper threads, answered as one future."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from sippcache import helpers


def test_all_true_is_true_once_every_part_is() -> None:
    release = threading.Event()
    pool = helpers.pool("test-all-true", 3)
    parts = [pool.submit(release.wait, 10) for _ in range(3)]
    combined = helpers.all_true(parts)
    assert not combined.done()  # each part is waited for
    release.set()
    assert combined.result(10) is True


def test_all_true_is_false_if_a_part_is_and_raises_what_a_part_raised() -> None:
    done: list[Future[bool]] = [Future() for _ in range(3)]
    combined = helpers.all_true(done)
    for future, answer in zip(done, (True, False, True), strict=True):
        future.set_result(answer)
    assert combined.result() is False
    failing: list[Future[bool]] = [Future(), Future()]
    combined = helpers.all_true(failing)
    failing[0].set_result(True)
    failing[1].set_exception(OSError("read failed"))
    with pytest.raises(OSError, match="read failed"):
        combined.result()
    one: Future[bool] = Future()
    assert helpers.all_true([one]) is one  # one part: itself
