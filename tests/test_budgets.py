"""The budget is saved with the store: handles opened without limits, other processes and
read-only handles go by it; a URL's limits change it; handles given limits keep their own.

Real LMDB and diskcache stores, another process where it says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sippcache
from sippcache.backends.lmdb import DEFAULT_MAX_BYTES


@pytest.fixture(params=["lmdb", "diskcache"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"{request.param}://{tmp_path / 'store'}"


def fill(cache: sippcache.CacheBackend, first: int, count: int) -> None:
    for i in range(first, first + count):
        cache.store([i], bytes(1000))  # 1,004 bytes each with the key


def test_a_handle_without_limits_follows_the_stores_budget(url: str) -> None:
    with sippcache.open(f"{url}?max_bytes=3500&max_entries=50") as sized:
        fill(sized, 0, 3)
    with sippcache.open(url) as plain:
        assert (plain.stats().max_bytes, plain.stats().max_entries) == (3500, 50)
        fill(plain, 3, 1)  # over the store's budget: one goes
        assert len(plain) == 3 and plain.stats().evictions == 1
    with sippcache.open(url, read_only=True) as reader:
        assert reader.stats().max_bytes == 3500


def test_a_store_without_a_saved_budget_has_the_backends_default(url: str) -> None:
    with sippcache.open(url) as plain:
        fill(plain, 0, 3)
        assert plain.stats().max_bytes == DEFAULT_MAX_BYTES and plain.stats().max_entries is None
    with sippcache.open(f"{url}?max_bytes=3500") as sized:
        assert sized.stats().max_bytes == 3500
    with sippcache.open(url) as plain:  # the URL above saved its budget
        assert plain.stats().max_bytes == 3500 and plain.stats().max_entries is None


def test_handles_that_disagree(url: str) -> None:
    """Each handle given limits enforces its own; the store keeps the last one given (at a
    handle's first use), which a handle given none follows without reopening."""
    tight = sippcache.open(f"{url}?max_bytes=3500")
    roomy = sippcache.open(f"{url}?max_bytes=10000")
    plain = sippcache.open(url)
    try:
        assert len(tight) == 0 and plain.stats().max_bytes == 3500
        fill(roomy, 0, 6)  # its first use saves 10,000; 6,024 bytes fit it
        assert len(roomy) == 6 and roomy.stats().evictions == 0
        assert plain.stats().max_bytes == 10000
        fill(tight, 6, 1)  # tight still holds itself to 3,500
        assert len(tight) == 3 and tight.stats().max_bytes == 3500
        assert plain.stats().max_bytes == 10000  # tight saved its budget once, at its first use
        fill(plain, 7, 7)
        assert plain.stats().bytes <= 10000 < plain.stats().bytes + 1004
    finally:
        for cache in (tight, roomy, plain):
            cache.close()


def test_another_process_goes_by_the_saved_budget(url: str) -> None:
    with sippcache.open(f"{url}?max_bytes=3500") as sized:
        fill(sized, 0, 3)
    child = textwrap.dedent(
        """
        import json, sys
        import sippcache
        with sippcache.open(sys.argv[1]) as cache:
            cache.store([99], bytes(1000))
            print(json.dumps([cache.stats().max_bytes, len(cache)]))
        """
    )
    done = subprocess.run([sys.executable, "-c", child, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [3500, 3]


def test_a_budget_too_large_to_save_is_a_bad_option(url: str) -> None:
    with pytest.raises(sippcache.BadOption, match="max_bytes"):
        sippcache.open(f"{url}?max_bytes={2**63}")
