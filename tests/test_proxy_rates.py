"""Restore only when it beats recomputing: `sippcache.state.rates` on its own, the proxy's judgement of an
ineffective restore, and the proxy in front of real llama-server processes (the tiny model) with
its rates preset one way or the other. No timed assertions: the rates are preset or fed, never
measured against a clock."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sippcache
from harness.proxy_tools import LlamaServer, ProxyServer, llama_server_binary, metric, settle
from harness.servers import parse_metrics
from sippcache.protocol import CacheBackend
from sippcache.proxy.app import REUSED_HEADER, Proxy
from sippcache.proxy.metrics import ProxyMetrics
from sippcache.proxy.restoring import Restore
from sippcache.proxy.settings import build_parser
from sippcache.proxy.slots import Origin, SlotTable
from sippcache.proxy.staging import STAGING_PREFIX, staging_base
from sippcache.proxy.store import Restored, SlotStore
from sippcache.proxy.upstream import Upstream
from sippcache.state.rates import KEEP_EVERY, MIN_PREFILL_TOKENS, RESTORE_PER_SERVER_SAVE, WINDOW, RestoreRates

HERE = "http://127.0.0.1:8080"
PARTS = ("sippcache", "llama_server")  # sippcache_proxy_restore_part_seconds' parts
THERE = "http://127.0.0.1:8081"

# -- the rates on their own ------------------------------------------------------------------------


def test_with_nothing_measured_it_restores() -> None:
    rates = RestoreRates()
    decision = rates.decide(HERE, tokens=1000, nbytes=10**9)
    assert decision and decision.reason == "unmeasured"
    rates.record_prefill(HERE, 1000, 1.0)  # one side only: still nothing to compare
    assert rates.decide(HERE, tokens=1000, nbytes=10**9).reason == "unmeasured"
    assert rates.decide(HERE, tokens=1000, nbytes=None).reason == "unmeasured"  # the size not known


def test_a_restore_slower_than_the_prefill_is_declined() -> None:
    rates = RestoreRates()
    rates.record_prefill(HERE, 32768, 0.685)  # the H200's cold prefill: about 48,000 tokens a second
    rates.record_restore(HERE, nbytes=1_074_000_000, seconds=1.0, tokens=32768)  # staging + load: 1 s
    decision = rates.decide(HERE, tokens=32768, nbytes=1_074_000_000)
    assert not decision and decision.reason == "slower_than_prefill"
    assert decision.restore_seconds is not None and decision.prefill_seconds is not None
    assert decision.restore_seconds > decision.prefill_seconds
    assert rates.decide(THERE, tokens=32768, nbytes=1_074_000_000).reason == "unmeasured"  # another place


def test_a_restore_faster_than_the_prefill_is_done() -> None:
    rates = RestoreRates()
    rates.record_prefill(HERE, 1502, 3.5)  # a CPU: 430 tokens a second
    rates.record_restore(HERE, nbytes=12_500_000, seconds=0.002, tokens=1502)
    decision = rates.decide(HERE, tokens=1502, nbytes=12_500_000)
    assert decision and decision.reason == "faster_than_prefill"


def test_the_margin_is_how_much_slower_a_restore_may_be() -> None:
    for margin, restores in ((1.0, False), (2.5, True)):
        rates = RestoreRates(margin=margin)
        rates.record_prefill(HERE, 1000, 1.0)
        rates.record_restore(HERE, nbytes=1000, seconds=2.0, tokens=1000)
        assert rates.decide(HERE, tokens=1000, nbytes=1000).restore is restores


def test_always_and_never_ignore_the_rates() -> None:
    for mode, restores in (("always", True), ("never", False)):
        rates = RestoreRates(mode)  # type: ignore[arg-type]
        rates.record_prefill(HERE, 1000, 0.001)
        rates.record_restore(HERE, nbytes=1000, seconds=100.0, tokens=1000)  # a hopeless restore
        decisions = [rates.decide(HERE, tokens=1000, nbytes=10**6) for _ in range(100)]  # no probes either
        assert {(d.restore, d.reason) for d in decisions} == {(restores, mode)}
    with pytest.raises(ValueError, match="auto, always, never"):
        RestoreRates("sometimes")  # type: ignore[arg-type]


def test_short_prefills_are_not_samples() -> None:
    rates = RestoreRates()
    assert not rates.record_prefill(HERE, MIN_PREFILL_TOKENS - 1, 10.0)  # a follow-up's few new tokens
    assert not rates.record_prefill(HERE, 1000, 0.0)
    assert rates.measured(HERE).prefill_samples == 0
    assert rates.record_prefill(HERE, MIN_PREFILL_TOKENS, 0.064)
    assert rates.measured(HERE).prefill_tokens_per_second == pytest.approx(1000)


def test_a_rate_is_read_from_samples_of_about_that_size() -> None:
    """Per token, a long prompt may cost less than a short suffix (a GPU's batch filled) or more
    (attention): a long restore is weighed against long prefills, a short one against short ones."""
    rates = RestoreRates()
    rates.record_prefill(HERE, 30000, 0.6)  # 50,000 tokens a second
    rates.record_prefill(HERE, 100, 0.015)  # 6,700 tokens a second
    rates.record_restore(HERE, nbytes=10**9, seconds=0.8, tokens=30000)
    long = rates.decide(HERE, tokens=30000, nbytes=10**9)
    assert not long and long.prefill_seconds == pytest.approx(0.6)
    short = rates.decide(HERE, tokens=100, nbytes=rates.size_of(HERE, 100))
    assert short and short.prefill_seconds == pytest.approx(0.015)
    rates.record_prefill(HERE, 110, 1.0)  # one odd sample moves its own size's rate by its share
    assert rates.estimate(HERE, tokens=100, nbytes=None).prefill_seconds == pytest.approx(100 * 1.015 / 210)
    assert rates.estimate(HERE, tokens=30000, nbytes=None).prefill_seconds == pytest.approx(0.6)


def test_a_size_never_seen_is_priced_on_the_line_through_the_nearest_sizes() -> None:
    """A restore carries a fixed cost (calls, a staging file opened, the server's load set up): a
    64 MB restore's rate charges it to few bytes. A 1 GB restore, with no sample of its size, is
    priced on the line through the 64 MB and 256 MB restores' means: fixed cost once, then the
    bytes. Proportionally, from 256 MB alone, it would look slower than its prefill and lose a win."""
    mb = 2**20
    rates = RestoreRates()
    rates.record_prefill(HERE, 32768, 0.700)
    rates.record_restore(HERE, nbytes=64 * mb, seconds=0.085, tokens=2048)  # 45 ms fixed + 0.625 ms a MB
    rates.record_restore(HERE, nbytes=256 * mb, seconds=0.205, tokens=8192)
    decision = rates.decide(HERE, tokens=32768, nbytes=1024 * mb)
    assert decision.restore_seconds == pytest.approx(0.045 + 0.000625 * 1024)
    assert decision and decision.reason == "faster_than_prefill"
    assert 4 * 0.205 > 0.700  # what the 256 MB rate alone would have said: slower than the prefill
    # Between two sizes the line interpolates; within a size's own bucket its own rate rules.
    assert rates.estimate(HERE, tokens=32768, nbytes=128 * mb).restore_seconds == pytest.approx(0.045 + 0.08)
    assert rates.estimate(HERE, tokens=32768, nbytes=300 * mb).restore_seconds == pytest.approx(0.205 * 300 / 256)
    # The state size is read off such a line too: a header of a fixed size, then bytes a token.
    rates = RestoreRates()
    rates.record_size(HERE, 1000, 1_000_000 + 4096)
    rates.record_size(HERE, 4000, 4_000_000 + 4096)
    assert rates.size_of(HERE, 100_000) == 100_000_000 + 4096


def test_a_line_that_does_not_rise_falls_back_to_the_nearest_rate() -> None:
    """Two sizes whose means fall (a warm-up's slow sample among the small ones) give no line: the
    nearest size's own rate prices the one between or beyond them."""
    rates = RestoreRates()
    rates.record_prefill(HERE, 100, 1.0)  # a first request's one-time costs
    rates.record_prefill(HERE, 1000, 0.1)
    assert rates.estimate(HERE, tokens=4000, nbytes=None).prefill_seconds == pytest.approx(0.4)
    assert rates.estimate(HERE, tokens=50, nbytes=None).prefill_seconds == pytest.approx(0.5)


def test_a_ready_file_is_priced_at_the_servers_own_load_where_the_store_path_loses() -> None:
    """The H200's 32K-token state (2026-11-28): prefill 685 ms, the proxy's restore through the store
    1.0 s (declined), llama-server's own save of it 670 ms and load 534 ms (timings.save_ms,
    restore_ms): a ready file, which llama-server loads as it is, is restored, priced at the
    server's save until a load is measured, then at its loads. Its own restores price it from
    then on, and never the store's; with neither known it is priced as a whole restore."""
    gb = 1_074_000_000
    rates = RestoreRates()
    rates.record_prefill(HERE, 32768, 0.685)
    assert rates.decide(HERE, tokens=32768, nbytes=gb, ready=True).reason == "unmeasured"
    rates.record_restore(HERE, nbytes=gb, seconds=1.0, tokens=32768)  # no load part known
    assert not rates.decide(HERE, tokens=32768, nbytes=gb, ready=True)  # priced as the whole restore
    rates.record_save(HERE, nbytes=gb, seconds=4.6, server_seconds=0.67)  # the H200's save: llama-server's part
    by_save = rates.decide(HERE, tokens=32768, nbytes=gb, ready=True)
    assert by_save and by_save.from_saves and by_save.restore_seconds == pytest.approx(0.67)
    rates.record_restore(HERE, nbytes=gb, seconds=1.0, tokens=32768, loaded=0.534)
    assert not rates.decide(HERE, tokens=32768, nbytes=gb)
    ready = rates.decide(HERE, tokens=32768, nbytes=gb, ready=True)
    assert ready and ready.reason == "faster_than_prefill" and ready.restore_seconds == pytest.approx(0.534)
    for _ in range(WINDOW):
        rates.record_restore(HERE, nbytes=gb, seconds=0.55, tokens=32768, ready=True)
    assert rates.decide(HERE, tokens=32768, nbytes=gb, ready=True).restore_seconds == pytest.approx(0.55)
    store = rates.decide(HERE, tokens=32768, nbytes=gb)  # the store path's own samples, untouched
    assert not store and store.restore_seconds == pytest.approx(1.0)
    rates.record_restore(HERE, nbytes=gb, seconds=0.6, tokens=32768, useful=0.0, ready=True)
    rates.record_restore(HERE, nbytes=gb, seconds=0.6, tokens=32768, useful=0.0, ready=True)
    assert rates.decide(HERE, tokens=32768, nbytes=gb, ready=True).reason == "ineffective"  # wasted, either way


def test_load_rates_are_kept_and_a_file_from_before_them_is_read(tmp_path: Path) -> None:
    path = tmp_path / "here.json"
    first = RestoreRates()
    first.keep(HERE, path)
    first.record_prefill(HERE, 32768, 0.685)
    first.record_restore(HERE, nbytes=10**9, seconds=1.0, tokens=32768, loaded=0.5)
    first.flush(force=True)
    second = RestoreRates()
    assert second.keep(HERE, path) == 4  # prefill, restore, size, load
    assert second.decide(HERE, tokens=32768, nbytes=10**9, ready=True).restore_seconds == pytest.approx(0.5)
    data = json.loads(path.read_text())
    del data["loads"]  # as a proxy before ready files wrote it
    path.write_text(json.dumps(data))
    assert RestoreRates().keep(HERE, path) == 3


def test_until_a_restore_is_measured_it_is_priced_as_a_save_of_its_bytes() -> None:
    """A place that saved states but never restored one (a proxy restarted after its first run)
    prices a restore as a save of as many bytes: slower than the prefill, declined; faster,
    done. Once a restore is measured, its own rate decides. (Synthetic rates.)"""
    gb = 10**9
    rates = RestoreRates()
    rates.record_prefill(HERE, 32768, 0.6)
    assert rates.record_save(HERE, nbytes=gb, seconds=1.5, tokens=32768)
    declined = rates.decide(HERE, tokens=32768, nbytes=gb)
    assert not declined and declined.reason == "slower_than_prefill" and declined.from_saves
    assert declined.restore_seconds == pytest.approx(1.5)
    fast = RestoreRates()
    fast.record_prefill(HERE, 32768, 0.6)
    fast.record_save(HERE, nbytes=gb, seconds=0.3, tokens=32768)
    done = fast.decide(HERE, tokens=32768, nbytes=gb)
    assert done and done.reason == "faster_than_prefill" and done.from_saves
    rates.record_restore(HERE, nbytes=gb, seconds=0.4, tokens=32768)  # measured: the saves no longer decide
    measured = rates.decide(HERE, tokens=32768, nbytes=gb)
    assert measured and not measured.from_saves and measured.restore_seconds == pytest.approx(0.4)
    assert rates.measured(HERE).save_samples == 1 and rates.measured(HERE).save_bytes_per_second == pytest.approx(
        gb / 1.5
    )


def test_a_save_with_the_servers_part_prices_a_restore_from_that_part() -> None:
    """Where llama-server said how long its own part of a save took (`timings.save_ms`), an
    unmeasured restore is priced at `RESTORE_PER_SERVER_SAVE` times that part, not at the whole
    save (framing and the store write are not what a restore does)."""
    gb = 10**9
    rates = RestoreRates()
    rates.record_prefill(HERE, 32768, 0.8)
    assert rates.record_save(HERE, nbytes=gb, seconds=3.0, tokens=32768, server_seconds=0.3)
    done = rates.decide(HERE, tokens=32768, nbytes=gb)
    assert done and done.reason == "faster_than_prefill" and done.from_saves
    assert done.restore_seconds == pytest.approx(RESTORE_PER_SERVER_SAVE * 0.3)
    whole = RestoreRates()
    whole.record_prefill(HERE, 32768, 0.8)
    whole.record_save(HERE, nbytes=gb, seconds=3.0, tokens=32768, server_seconds=None)  # not said: the whole save
    assert whole.decide(HERE, tokens=32768, nbytes=gb).restore_seconds == pytest.approx(3.0)
    assert not whole.record_save(HERE, nbytes=gb, seconds=0.0, tokens=32768, server_seconds=0.0)  # no time


# Measured on an H200 (2026-11-28, `benchmarks/gpu/run.sh`; docs/proxy.md's table), per shape: the
# first proxy's warm-up (512 tokens) and cold prefills (llama-server's prompt_n, prompt_ms), and its
# saves of each prompt's state (tokens, state bytes, save + store seconds, llama-server's own save
# seconds); then the restarted proxy's warm-up. A restore (`--restore always`) won by more than 5%
# only for 4 of Llama-3-70B's layers at 32K tokens (726 ms against 859 ms cold); it was a wash for
# 8K of both and for 32K q8_0 (0.99x-1.05x), and lost on every other row.
H200_RUN = {
    "8b-slice": {
        "warmups": [(512, 0.0856), (512, 0.1094)],
        "prefills": [(2046, 0.0298), (8190, 0.1145), (32766, 0.6391)],
        "saves": [(2048, 67_141_876, 0.1693, 0.0420), (8192, 268_566_772, 0.6219, 0.1235)]
        + [(32768, 1_074_266_356, 3.0006, 0.5105)],
    },
    "8b-slice:q8_0": {
        "warmups": [(512, 0.1109), (512, 0.1107)],
        "prefills": [(2046, 0.0358), (8190, 0.1172), (32766, 0.6944)],
        "saves": [(2048, 35_684_596, 0.1077, 0.0176), (8192, 142_737_652, 0.3797, 0.0799)]
        + [(32768, 570_949_876, 1.5968, 0.3362)],
    },
    "70b-slice": {
        "warmups": [(512, 0.2044), (512, 0.1746)],
        "prefills": [(2046, 0.0363), (8190, 0.1407), (32766, 0.7732)],
        "saves": [(2048, 33_587_348, 0.0964, 0.0220), (8192, 134_348_948, 0.3686, 0.0874)]
        + [(32768, 537_395_348, 1.5616, 0.3349)],
    },
}


@pytest.mark.parametrize("priced", ["server_part", "whole_save"])
def test_restores_priced_from_the_servers_save_part_follow_the_h200_run(priced: str) -> None:
    """Replayed, the H200 run's samples make the restarted proxy restore where restoring won
    clearly and compute elsewhere; priced from the whole saves (as it was on the GPU), every
    restore was declined."""
    restored = set()
    for shape, run in H200_RUN.items():
        rates = RestoreRates()
        for tokens, seconds in [run["warmups"][0], *run["prefills"], run["warmups"][1]]:
            rates.record_prefill(HERE, tokens, seconds)
        for tokens, nbytes, seconds, server in run["saves"]:
            server_seconds = server if priced == "server_part" else None
            assert rates.record_save(HERE, nbytes=nbytes, seconds=seconds, tokens=tokens, server_seconds=server_seconds)
        for tokens, _, _, _ in run["saves"]:  # the follow-ups, in the run's order
            decision = rates.decide(HERE, tokens=tokens, nbytes=rates.size_of(HERE, tokens))
            if decision:
                restored.add((shape, tokens))
                break  # measured from then on: the run's later rows would be priced from that restore
    assert restored == ({("70b-slice", 32768)} if priced == "server_part" else set())


def test_a_save_that_wrote_little_of_its_state_prices_nothing() -> None:
    """A chat's next turn writes its tail only (its chunks were stored before): its time says
    nothing of moving a state. Its size still counts."""
    rates = RestoreRates()
    assert not rates.record_save(HERE, nbytes=10**8, seconds=0.01, tokens=4096, written=10**6)
    assert rates.measured(HERE).save_samples == 0 and rates.size_of(HERE, 4096) == 10**8
    assert rates.record_save(HERE, nbytes=10**8, seconds=0.2, tokens=4096, written=10**8 + 500)  # frames' headers
    assert not rates.record_save(HERE, nbytes=10**8, seconds=0.0, tokens=4096)
    assert rates.measured(HERE).save_samples == 1


def test_threads_may_share_the_rates() -> None:
    """The llama-cpp-python layer learns its saves on its writer thread while its model's thread
    decides and writes the kept file: no sample is lost, nothing raises."""
    import tempfile
    import threading

    rates = RestoreRates()
    with tempfile.TemporaryDirectory() as tmp:
        rates.keep(HERE, os.path.join(tmp, "here.json"))
        rounds = 2000

        def saves() -> None:
            for i in range(rounds):
                rates.record_save(HERE, nbytes=10**6 + i, seconds=0.01, tokens=1000 + i)

        writer = threading.Thread(target=saves)
        writer.start()
        for i in range(rounds):
            rates.record_prefill(HERE, 100 + i, 0.01)
            rates.decide(HERE, tokens=500, nbytes=10**6)
            rates.flush(force=i % 100 == 0)
        writer.join()
        rates.flush(force=True)
        again = RestoreRates()
        assert again.keep(HERE, os.path.join(tmp, "here.json")) > 0
        assert again.measured(HERE) == rates.measured(HERE)  # every kind written whole, and read back
        assert again.largest_state(HERE) == rates.largest_state(HERE)


def test_restores_that_bought_nothing_stop_restores() -> None:
    rates = RestoreRates(probe_every=1000)
    rates.record_prefill(HERE, 1000, 1.0)
    rates.record_restore(HERE, nbytes=1000, seconds=0.01, tokens=1000, useful=0.0)  # thrown away
    decision = rates.decide(HERE, tokens=1000, nbytes=1000)
    assert not decision and decision.reason == "ineffective"
    assert rates.measured(HERE).restore_bytes_per_second == 0.0
    # One that was used makes restores pay again, at the cost of the wasted one: seconds per useful byte.
    rates.record_restore(HERE, nbytes=1000, seconds=0.01, tokens=1000)
    assert rates.measured(HERE).restore_bytes_per_second == pytest.approx(1000 / 0.02)
    assert rates.decide(HERE, tokens=1000, nbytes=1000).reason == "faster_than_prefill"


def test_wasted_restores_in_a_row_stop_restores_until_a_probe_finds_them_used() -> None:
    rates = RestoreRates(probe_every=3)
    rates.record_prefill(HERE, 1000, 1.0)
    for _ in range(8):
        rates.record_restore(HERE, nbytes=1000, seconds=0.001, tokens=1000)  # used, and fast
    rates.record_restore(HERE, nbytes=1000, seconds=0.001, tokens=1000, useful=0.1)
    assert rates.decide(HERE, tokens=1000, nbytes=1000).reason == "faster_than_prefill"  # one: a fluke
    rates.record_restore(HERE, nbytes=1000, seconds=0.001, tokens=1000, useful=0.0)
    reasons = [rates.decide(HERE, tokens=1000, nbytes=1000).reason for _ in range(3)]
    assert reasons == ["ineffective", "ineffective", "probe"]
    rates.record_restore(HERE, nbytes=1000, seconds=0.001, tokens=1000)  # the probe was used
    assert rates.decide(HERE, tokens=1000, nbytes=1000).reason == "faster_than_prefill"


def test_a_half_used_restore_costs_twice_as_much() -> None:
    rates = RestoreRates()
    rates.record_prefill(HERE, 1000, 1.0)  # 1 ms a token
    rates.record_restore(HERE, nbytes=1000, seconds=0.6, tokens=1000, useful=0.5)
    # 0.6 s bought 500 useful bytes: 1.2 ms a byte, slower than computing.
    assert rates.decide(HERE, tokens=1000, nbytes=1000).reason == "slower_than_prefill"


def test_after_many_declines_one_restore_measures_again() -> None:
    rates = RestoreRates(probe_every=4)
    rates.record_prefill(HERE, 1000, 0.001)
    rates.record_restore(HERE, nbytes=1000, seconds=1.0, tokens=1000)
    reasons = [rates.decide(HERE, tokens=1000, nbytes=1000).reason for _ in range(8)]
    assert reasons == ["slower_than_prefill"] * 3 + ["probe"] + ["slower_than_prefill"] * 3 + ["probe"]
    assert rates.estimate(HERE, tokens=1000, nbytes=1000).reason == "slower_than_prefill"  # estimate: no probe


def test_the_size_of_a_state_is_learned_per_token() -> None:
    rates = RestoreRates()
    assert rates.size_of(HERE, 1000) is None
    rates.record_size(HERE, 100, 3_200_000)  # a save
    rates.record_restore(HERE, nbytes=9_600_000, seconds=0.01, tokens=300)
    assert rates.size_of(HERE, 1000) == 32_000_000
    assert rates.size_of(THERE, 1000) is None


# -- rates kept across processes --------------------------------------------------------------------

# Measured on an H200 (2026-11-27, `benchmarks/gpu/run.sh`; docs/proxy.md's table), 8 of Llama-3-8B's
# layers, f16 KV, through the proxy: the cold prefills of its first run (llama-server's prompt_n,
# prompt_ms), the states it saved (tokens, bytes), the first request after a restart (512 tokens,
# with the new process's one-time costs), and the first restore after the restart (2,048 tokens,
# store read to llama-server loaded). Forced restores lost at 8K (262 ms against 113 ms cold) and 32K
# (1,221 ms against 673 ms): the restarted proxy, which had forgotten the prefills, restored them.
H200_PREFILLS = [(2046, 0.0284), (8190, 0.1082), (32766, 0.6084)]
H200_STATES = [(2048, 67_141_876), (8192, 268_566_772), (32768, 1_074_266_356)]
H200_WARMUP = (512, 0.1027)
H200_FIRST_RESTORE = {"nbytes": 67_142_291, "seconds": 0.0847, "tokens": 2048}


def _h200_first_run(path: Path) -> None:
    first = RestoreRates()
    assert first.keep(HERE, path) == 0  # nothing there yet
    first.record_prefill(HERE, *H200_WARMUP)
    for tokens, seconds in H200_PREFILLS:
        first.record_prefill(HERE, tokens, seconds)
    for tokens, nbytes in H200_STATES:
        first.record_size(HERE, tokens, nbytes)
    first.flush(force=True)  # the proxy's shutdown


def test_rates_kept_across_a_restart_decline_the_restores_a_gpu_lost(tmp_path: Path) -> None:
    path = tmp_path / "rates" / "here.json"  # its folder is made by the first write
    _h200_first_run(path)
    restarted = RestoreRates()
    assert restarted.keep(HERE, path) == 1 + len(H200_PREFILLS) + len(H200_STATES)
    restarted.record_prefill(HERE, *H200_WARMUP)
    first = restarted.decide(HERE, tokens=2048, nbytes=restarted.size_of(HERE, 2048))
    assert first and first.reason == "unmeasured"  # no restore measured on this host yet: one is done
    restarted.record_restore(HERE, **H200_FIRST_RESTORE)
    for tokens in (8192, 32768):
        decision = restarted.decide(HERE, tokens=tokens, nbytes=restarted.size_of(HERE, tokens))
        assert not decision and decision.reason == "slower_than_prefill", (tokens, decision)
        assert decision.prefill_seconds is not None and decision.restore_seconds is not None
        assert decision.restore_seconds > 2 * decision.prefill_seconds

    # What the restarted proxy did without them: from the warm-up alone, a prefill looks 15x slower a
    # token than it is at 8K, and both restores that lost were done.
    forgot = RestoreRates()
    forgot.record_prefill(HERE, *H200_WARMUP)
    forgot.record_restore(HERE, **H200_FIRST_RESTORE)
    for tokens, nbytes in H200_STATES:
        assert forgot.decide(HERE, tokens=tokens, nbytes=nbytes).reason == "faster_than_prefill"


def test_the_largest_state_seen_is_known_kept_or_not(tmp_path: Path) -> None:
    """What a slot's staging file is made for at a proxy's start (`SlotStore.prepare`)."""
    path = tmp_path / "here.json"
    rates = RestoreRates()
    rates.keep(HERE, path)
    assert rates.largest_state(HERE) is None
    rates.record_size(HERE, 100, 3_200_000)
    rates.record_restore(HERE, nbytes=9_600_000, seconds=0.01, tokens=300)
    rates.record_size(HERE, 200, 6_400_000)
    assert rates.largest_state(HERE) == 9_600_000
    assert rates.largest_state(THERE) is None
    rates.flush(force=True)
    restarted = RestoreRates()
    restarted.keep(HERE, path)
    assert restarted.largest_state(HERE) == 9_600_000


def test_kept_samples_are_older_than_new_ones_and_a_place_keeps_its_own(tmp_path: Path) -> None:
    here, there = tmp_path / "here.json", tmp_path / "there.json"
    first = RestoreRates()
    first.keep(HERE, here)
    first.keep(THERE, there)
    for _ in range(WINDOW):
        first.record_prefill(HERE, 1000, 1.0)  # a thousand tokens a second
    first.record_prefill(THERE, 1000, 0.001)
    first.flush(force=True)
    second = RestoreRates()
    assert second.keep(HERE, here) == WINDOW
    assert second.measured(HERE).prefill_tokens_per_second == pytest.approx(1000)
    assert second.measured(THERE).prefill_samples == 0  # not kept for this one yet
    for _ in range(WINDOW // 2):
        second.record_prefill(HERE, 1000, 0.1)  # faster now: the oldest kept samples make way
    assert second.measured(HERE).prefill_samples == WINDOW
    assert second.measured(HERE).prefill_tokens_per_second == pytest.approx(1000 * WINDOW / (WINDOW // 2 * 1.1))
    assert second.keep(THERE, there) == 1


def test_kept_rates_are_written_every_few_seconds_and_at_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "here.json"
    clock = [1000.0]
    monkeypatch.setattr("sippcache.state.rates.time.monotonic", lambda: clock[0])
    rates = RestoreRates()
    rates.keep(HERE, path)
    rates.flush(force=True)
    assert not path.exists()  # nothing measured: nothing written
    rates.record_prefill(HERE, 1000, 1.0)
    rates.flush()
    assert not path.exists()  # the last flush was under KEEP_EVERY seconds ago
    clock[0] += KEEP_EVERY
    rates.flush()
    assert json.loads(path.read_text())["prefill"]
    rates.record_restore(HERE, nbytes=10**6, seconds=0.01, tokens=100)
    rates.flush()
    assert not json.loads(path.read_text())["restore"]  # written again no sooner than KEEP_EVERY later
    rates.flush(force=True)
    assert json.loads(path.read_text())["restore"]
    assert [p.name for p in tmp_path.iterdir()] == ["here.json"]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"version": 2, "prefill": {}, "restore": {}, "sizes": {}}',
        '{"version": 1, "prefill": {"11": [[1000, -1]]}, "restore": {}, "sizes": {}}',
        '{"version": 1, "prefill": {"eleven": [[1000, 1]]}, "restore": {}, "sizes": {}}',
        '{"version": 1, "prefill": {"11": [[1000, 1, 2]]}, "restore": {}, "sizes": {}}',
        '{"version": 1, "prefill": {"11": [[1000, "1"]]}, "restore": {}, "sizes": {}}',
        '{"version": 1, "prefill": {}, "restore": {}}',
        "[]",
    ],
)
def test_a_kept_file_that_is_not_right_is_measured_again(tmp_path: Path, content: str, caplog: Any) -> None:
    path = tmp_path / "here.json"
    path.write_text(content)
    rates = RestoreRates()
    with caplog.at_level(logging.WARNING, logger="sippcache.state.rates"):
        assert rates.keep(HERE, path) == 0
    assert str(path) in caplog.text
    assert rates.measured(HERE).prefill_samples == 0
    rates.record_prefill(HERE, 1000, 1.0)
    rates.flush(force=True)  # replaced by a good one
    assert RestoreRates().keep(HERE, path) == 1


def test_a_kept_file_that_cannot_be_written_is_logged_and_the_rates_stay(tmp_path: Path, caplog: Any) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the folder should be")
    rates = RestoreRates()
    rates.keep(HERE, blocker / "here.json")
    rates.record_prefill(HERE, 1000, 1.0)
    with caplog.at_level(logging.WARNING, logger="sippcache.state.rates"):
        rates.flush(force=True)
    assert "cannot write the restore rates" in caplog.text
    assert rates.measured(HERE).prefill_samples == 1
    blocker.unlink()
    rates.flush(force=True)  # still to be written: it is, once it can be
    assert RestoreRates().keep(HERE, blocker / "here.json") == 1


# -- the proxy's judgement of a restore ------------------------------------------------------------


@pytest.fixture
def bare_proxy(tmp_path: Path) -> Iterator[Proxy]:
    """A proxy over two upstreams it never calls: for what it does with an answer's timings."""
    client = httpx.AsyncClient()
    store = SlotStore(sippcache.open("ram://"), fingerprint="f", facts={}, kind="full", staging=str(tmp_path))
    upstreams = [Upstream(HERE, client), Upstream(THERE, client)]
    yield Proxy(upstreams, SlotTable([1, 1]), store, ProxyMetrics(), client)
    asyncio.run(client.aclose())


def _restore(promised: int = 900) -> Restore:
    return Restore(Restored(Origin(tuple(range(1000)), 900), nbytes=10**6, seconds=0.001), promised)


def counted(proxy: Proxy, name: str, **labels: str) -> float:
    total = 0.0
    for key, value in parse_metrics(proxy.metrics.render().decode()).items():
        series, _, rest = key.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def test_a_restore_llama_server_did_not_use_is_ineffective(bare_proxy: Proxy, caplog: Any) -> None:
    proxy = bare_proxy
    proxy.rates.record_prefill(HERE, 1000, 1.0)
    with caplog.at_level(logging.DEBUG, logger="sippcache.proxy"):
        proxy.restorer.learn(HERE, {"prompt_n": 905, "prompt_ms": 900.0, "cache_n": 0}, _restore())
        proxy.restorer.learn(HERE, {"prompt_n": 905, "prompt_ms": 900.0, "cache_n": 3}, _restore())
        proxy.restorer.learn(THERE, {"prompt_n": 5, "prompt_ms": 1.0, "cache_n": 899}, _restore())  # used: fine
    assert counted(proxy, "sippcache_proxy_restores_ineffective_total", upstream=HERE) == 2
    assert counted(proxy, "sippcache_proxy_restores_ineffective_total", upstream=THERE) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "reused" in r.getMessage()]
    assert len(warnings) == 1 and HERE in warnings[0].getMessage()  # once per upstream
    assert proxy.rates.measured(HERE).prefill_samples == 3  # the preset one and the two answers'
    assert proxy.rates.measured(THERE).prefill_samples == 0  # 5 tokens: not a sample
    decision = proxy.rates.decide(HERE, tokens=900, nbytes=10**6)
    assert not decision and decision.reason == "ineffective"
    assert proxy.rates.measured(THERE).restore_samples == 1


def test_a_restore_whose_answer_has_no_timings_counts_as_used(bare_proxy: Proxy) -> None:
    bare_proxy.restorer.learn(HERE, {}, _restore())  # a client that left before the first event
    assert counted(bare_proxy, "sippcache_proxy_restores_ineffective_total") == 0
    assert bare_proxy.rates.measured(HERE).restore_bytes_per_second == pytest.approx(10**6 / 0.001)


def test_no_wait_for_a_state_in_flight_that_would_not_be_restored(bare_proxy: Proxy) -> None:
    """A request waits for another request's state only to restore it."""
    restorer, urls = bare_proxy.restorer, (HERE, THERE)
    assert restorer.would_restore(5000, 4000, urls)  # nothing measured: it would be restored
    for url in urls:
        bare_proxy.rates.record_prefill(url, 5000, 0.001)
        bare_proxy.rates.record_restore(url, nbytes=10**6, seconds=1.0, tokens=5000)
    assert not restorer.would_restore(5000, 4000, urls)
    bare_proxy.rates.mode = "always"
    assert restorer.would_restore(5000, 4000, urls)


# -- in front of real llama-servers ----------------------------------------------------------------

SYSTEM = (
    "You are the archivist of a lighthouse on the northern cape. You keep the keeper's log: every ship that "
    "passed, its flag, the hour, the weather and the state of the sea. Answer briefly and plainly. "
) * 4  # about 850 tokens on the tiny model's byte-level vocabulary
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "which ship passed first?"}]
FOLLOW = [*FIRST, {"role": "assistant", "content": "the Eider"}, {"role": "user", "content": "and her flag?"}]


@contextlib.asynccontextmanager
async def in_process(url: str, slots: Path, cache: CacheBackend, rates: RestoreRates) -> AsyncIterator[Any]:
    """A `Proxy` built as the command line builds it, in this process (its rates at hand), in front
    of the llama-server at `url`; (the proxy, an HTTP client for it). Its store writes are waited for."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None), limits=limits) as client:
        upstream = Upstream(url, client)
        info = await upstream.info()
        store = SlotStore(cache, fingerprint="rates", facts={}, kind="full", staging=str(slots))
        proxy = Proxy([upstream], SlotTable([info.slots]), store, ProxyMetrics(), client, rates=rates)
        transport = httpx.ASGITransport(app=proxy)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=600) as front:
                yield proxy, front
        finally:
            await proxy.drain()


async def ask(client: httpx.AsyncClient, messages: list[dict[str, str]], **extra: Any) -> tuple[str, int, Any]:
    """(the answer, the X-Sippcache-Prompt-Reused header or -1, llama-server's timings)."""
    response = await client.post("/v1/chat/completions", json={"messages": messages, **GREEDY, **extra})
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["message"]["content"], int(response.headers.get(REUSED_HEADER) or -1), data["timings"]


@pytest.fixture
def restarted(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[[], LlamaServer]]:
    """`restarted()`: a new llama-server process (empty slots) on the shared slot directory; the
    last one is stopped first. Teardown stops the last."""
    slots = tmp_path / "slots"
    slots.mkdir()
    running: list[LlamaServer] = []
    numbers = itertools.count()

    def start() -> LlamaServer:
        if running:
            running.pop().stop()
        args = ("-c", "4096", "-np", "1", "--slot-save-path", str(slots), "--no-cache-idle-slots")
        server = LlamaServer(tiny_model, tmp_path / f"llama-{next(numbers)}.log", *args)
        running.append(server.start())
        return server

    yield start
    for server in running:
        server.stop()


def stored_first_turn(restarted: Callable[[], LlamaServer], slots: Path, cache: CacheBackend) -> None:
    """The first turn through a proxy, stored; then the server restarts (its slot is empty)."""
    server = restarted()

    async def first() -> None:
        async with in_process(server.url, slots, cache, RestoreRates()) as (proxy, front):
            await ask(front, FIRST)
        assert counted(proxy, "sippcache_proxy_saves_total") == 1

    asyncio.run(first())


def test_a_save_is_split_by_who_spent_it_and_prices_restores_from_llama_servers_part(
    restarted: Any, tmp_path: Path
) -> None:
    """The proxy reads llama-server's own save time from the slot save's answer: /metrics split the
    save (sippcache_proxy_save_part_seconds), and an unmeasured restore is priced from that part."""
    server = restarted()
    rates = RestoreRates()

    async def first() -> Proxy:
        async with in_process(server.url, tmp_path / "slots", sippcache.open("ram://"), rates) as (proxy, front):
            await ask(front, FIRST)
        return proxy

    proxy = asyncio.run(first())
    url = server.url
    assert counted(proxy, "sippcache_proxy_saves_total") == 1
    own = {p: counted(proxy, "sippcache_proxy_save_part_seconds_sum", part=p) for p in PARTS}
    assert all(counted(proxy, "sippcache_proxy_save_part_seconds_count", part=p) == 1 for p in PARTS)
    assert own["llama_server"] > 0 and own["sippcache"] >= 0
    whole = counted(proxy, "sippcache_proxy_save_seconds_sum")
    assert own["llama_server"] + own["sippcache"] == pytest.approx(whole)
    state = rates.largest_state(url)
    assert state is not None and rates.measured(url).save_samples == 1
    priced = state / rates.measured(url).save_bytes_per_second  # type: ignore[operator]
    assert priced == pytest.approx(RESTORE_PER_SERVER_SAVE * own["llama_server"])


def test_a_restore_preset_slower_than_prefill_is_skipped(restarted: Any, tmp_path: Path) -> None:
    cache = sippcache.open("ram://")
    stored_first_turn(restarted, tmp_path / "slots", cache)
    server = restarted()
    rates = RestoreRates()
    rates.record_prefill(server.url, 100_000, 0.001)  # a hundred million tokens a second
    rates.record_restore(server.url, nbytes=1000, seconds=10.0, tokens=10)  # 100 bytes a second

    async def follow_up() -> tuple[Proxy, tuple[str, int, Any], str]:
        async with in_process(server.url, tmp_path / "slots", cache, rates) as (proxy, front):
            answer = await ask(front, FOLLOW)
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as plain:  # after: it fills the slot
            response = await plain.post(
                "/v1/chat/completions", json={"messages": FOLLOW, **GREEDY, "cache_prompt": False}
            )
        return proxy, answer, response.json()["choices"][0]["message"]["content"]

    proxy, (text, reused, timings), cold = asyncio.run(follow_up())
    assert reused == timings["cache_n"] == 0, timings  # nothing restored: all of it computed
    assert text == cold
    url = server.url
    assert counted(proxy, "sippcache_proxy_restores_skipped_total", upstream=url, reason="slower_than_prefill") == 1
    assert counted(proxy, "sippcache_proxy_restores_total") == 0
    assert rates.measured(url).prefill_samples == 2  # the preset one, and this answer's


def test_a_restore_preset_faster_than_prefill_is_done(restarted: Any, tmp_path: Path) -> None:
    cache = sippcache.open("ram://")
    stored_first_turn(restarted, tmp_path / "slots", cache)
    server = restarted()
    rates = RestoreRates()
    rates.record_prefill(server.url, 100, 100.0)  # a token a second
    rates.record_restore(server.url, nbytes=10**9, seconds=0.001, tokens=10**6)

    async def follow_up() -> tuple[Proxy, tuple[str, int, Any], str]:
        async with in_process(server.url, tmp_path / "slots", cache, rates) as (proxy, front):
            answer = await ask(front, FOLLOW)
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as plain:
            response = await plain.post(
                "/v1/chat/completions", json={"messages": FOLLOW, **GREEDY, "cache_prompt": False}
            )
        return proxy, answer, response.json()["choices"][0]["message"]["content"]

    proxy, (text, reused, timings), cold = asyncio.run(follow_up())
    assert reused == timings["cache_n"] > 800, timings  # the stored first turn, restored
    assert text == cold
    url = server.url
    assert counted(proxy, "sippcache_proxy_restores_total", upstream=url, outcome="ok") == 1
    assert counted(proxy, "sippcache_proxy_restores_skipped_total") == 0
    assert counted(proxy, "sippcache_proxy_restores_ineffective_total") == 0
    assert rates.measured(url).restore_samples == 2  # the preset one, and this restore
    # the restore's time split: sippcache's staging, then llama-server's own load (its timings.restore_ms)
    parts = {p: counted(proxy, "sippcache_proxy_restore_part_seconds_sum", part=p) for p in PARTS}
    assert all(counted(proxy, "sippcache_proxy_restore_part_seconds_count", part=p) == 1 for p in parts)
    assert all(seconds > 0 for seconds in parts.values()), parts
    assert sum(parts.values()) <= counted(proxy, "sippcache_proxy_restore_seconds_sum")


# -- the command line ----------------------------------------------------------------------------------


def test_the_restore_option(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--restore, else $SIPPCACHE_RESTORE (resolved at start), else auto; a bad value is one line."""
    parser = build_parser()
    assert parser.parse_args(["--upstream", HERE]).restore is None
    assert parser.parse_args(["--restore", "never"]).restore == "never"
    with pytest.raises(SystemExit):
        parser.parse_args(["--restore", "sometimes"])
    from sippcache.proxy.cli import main

    monkeypatch.setenv("SIPPCACHE_RESTORE", "sometimes")
    with pytest.raises(SystemExit) as stopped:
        main(["--upstream", HERE, "--slot-dir", "/nonexistent"])
    assert stopped.value.code == 2
    assert "SIPPCACHE_RESTORE='sometimes'" in capsys.readouterr().err


def test_restore_never_on_the_command_line(tiny_model: Path, tmp_path: Path) -> None:
    cache = f"lmdb://{tmp_path}/store"
    managed = ["--llama-server", str(llama_server_binary()), "--model", str(tiny_model), "--cache", cache]
    body = {"messages": FOLLOW, **GREEDY}
    started: list[ProxyServer] = []
    try:
        for i, extra in enumerate(([], ["--restore", "never"])):
            started.append(ProxyServer([*managed, *extra, "--", "-c", "4096"], tmp_path / f"proxy-{i}.log"))
            proxy = started[-1]
            proxy.wait_ready()
            status, headers, answer = proxy.post("/v1/chat/completions", body)
            assert status == 200, answer
            settle(proxy)
            skipped = metric(proxy, "sippcache_proxy_restores_skipped_total", reason="never")
            proxy.stop()
        # The second proxy's llama-server started empty, and the stored state was not restored.
        assert headers[REUSED_HEADER.lower()] == "0" and answer["timings"]["cache_n"] == 0
        assert skipped == 1
    finally:
        for proxy in started:
            proxy.stop()


def test_a_restarted_proxy_decides_from_the_rates_kept_before(tiny_model: Path, tmp_path: Path) -> None:
    """`sippcache proxy` keeps each upstream's rates in --rates-dir for the next one at the same place.
    The first proxy stores the first turn and keeps its prefill rate; that file then says restores are
    slow there (as they are on a fast GPU), and the restarted proxy computes the follow-up instead of
    restoring it, with the answer plain llama-server gives."""
    cache, rates_dir = f"lmdb://{tmp_path}/store", tmp_path / "rates"
    managed = ["--llama-server", str(llama_server_binary()), "--model", str(tiny_model), "--cache", cache]
    managed += ["--rates-dir", str(rates_dir), "--restore", "auto", "--", "-c", "4096"]  # the suite's default: always
    first = ProxyServer(managed, tmp_path / "proxy-1.log")
    try:
        first.wait_ready()
        status, _, answer = first.post("/v1/chat/completions", {"messages": FIRST, **GREEDY})
        assert status == 200, answer
        settle(first)
    finally:
        first.stop()
    [kept] = rates_dir.iterdir()
    assert "(0 samples from before)" in first.log_tail(20_000)
    rates = RestoreRates()
    assert rates.keep("there", kept) >= 3  # the answer's prefill, its state's size and its save, written at shutdown
    assert rates.measured("there").save_samples >= 1  # a new conversation: stored whole, its time a sample
    rates.record_restore("there", nbytes=1000, seconds=10.0, tokens=10)  # 100 bytes a second
    rates.flush(force=True)

    # The store path (a ready file made after the start is priced at llama-server's own load)
    second = ProxyServer(["--no-warm-ready", *managed], tmp_path / "proxy-2.log")
    plain = None
    try:
        second.wait_ready()
        # its slot's staging file made at start for the largest state the kept rates saw, before any request
        pattern = os.path.join(staging_base(), f"{STAGING_PREFIX}{second.process.pid}-*", "sippcache-restore-*")
        deadline = time.monotonic() + 60
        while not (made := glob.glob(pattern)) or os.stat(made[0]).st_size < rates.largest_state("there"):
            assert time.monotonic() < deadline, "no staging file made ahead"
            time.sleep(0.1)
        status, headers, answer = second.post("/v1/chat/completions", {"messages": FOLLOW, **GREEDY})
        assert status == 200, answer
        settle(second)
        assert headers[REUSED_HEADER.lower()] == "0" and answer["timings"]["cache_n"] == 0  # computed
        assert metric(second, "sippcache_proxy_restores_skipped_total", reason="slower_than_prefill") == 1
        assert metric(second, "sippcache_proxy_restores_total") == 0
        plain = LlamaServer(tiny_model, tmp_path / "plain.log", "-c", "4096").start()
        expected = httpx.post(plain.url + "/v1/chat/completions", json={"messages": FOLLOW, **GREEDY}, timeout=600)
        assert answer["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]
    finally:
        second.stop()
        if plain is not None:
            plain.stop()
    assert "samples from before)" in second.log_tail(20_000)
