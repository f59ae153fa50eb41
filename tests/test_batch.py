"""`BatchEngine` on the tiny generated model: continuous batching, one step at a time.

The tiny model has float32 weights, so a sequence's tokens do not depend on the
batch it is in (its logits move by float rounding only, measured under 1e-3):
every job here must give exactly the tokens it gives alone. What is checked:
jobs joining while others decode, a long prompt taken a chunk per step with the
others decoding at every step, cancellation freeing the slot at the next step,
a shared prefix evaluated once and copied (`llama_memory_seq_cp`), finished
jobs stored with `store_finished`, and a failure that empties the engine and
leaves it working.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from sippcache.llama import CacheOptions
from sippcache.llama.batch import BatchEngine, Job
from sippcache.llama.fingerprint import llama_fingerprint
from sippcache.llama.pool import Sampling
from sippcache.llama.seqcache import SequenceCache
from sippcache.llama.states import MemoryKind


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


@pytest.fixture
def llm(tiny_model: Path) -> Iterator[llama_cpp.Llama]:
    model = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=256, n_batch=512, verbose=False)
    yield model
    model.close()


@pytest.fixture
def make_engine(llm: llama_cpp.Llama) -> Iterator[object]:
    made: list[tuple[BatchEngine, SequenceCache]] = []
    chains: list[object] = []

    def make(slots: int = 4, chunk: int = 512, store_finished: bool = False, url: str = "ram://") -> BatchEngine:
        cache = SequenceCache(
            url,
            fingerprint=llama_fingerprint(llm),
            kind=MemoryKind(),
            n_vocab=llm.n_vocab(),
            options=CacheOptions(scope="test"),
        )
        engine = BatchEngine(llm, cache, slots=slots, n_ctx=slots * 1024, chunk=chunk, store_finished=store_finished)
        made.append((engine, cache))
        return engine

    def job(tokens: list[int], max_new: int = 8, **kwargs: object) -> Job:
        chain = Sampling().chain(llm.n_vocab())
        chains.append(chain)
        return Job(tokens, chain, max_new, **kwargs)  # type: ignore[arg-type]

    make.job = job  # type: ignore[attr-defined]
    yield make
    for engine, cache in made:
        engine.free()
        cache.close()
    for chain in chains:
        llama_cpp.llama_sampler_free(chain)


def run(engine: BatchEngine, *jobs: Job) -> None:
    for job in jobs:
        if job.state == "queued" and job.submitted_at == 0.0:
            engine.submit(job)
    while any(job.state != "done" for job in jobs):
        engine.step()


def alone(make_engine, tokens: list[int], max_new: int) -> list[int]:
    engine = make_engine(slots=1)
    job = make_engine.job(tokens, max_new)
    run(engine, job)
    return job.generated


def test_a_job_joining_between_steps_equals_it_alone(make_engine) -> None:
    a_tokens, b_tokens = prompt(120, 1), prompt(90, 2)
    engine = make_engine()
    a, b = make_engine.job(a_tokens, 20), make_engine.job(b_tokens, 12)
    engine.submit(a)
    for _ in range(6):  # a is decoding when b comes
        engine.step()
    assert a.state == "decode" and len(a.generated) == 6
    run(engine, a, b)
    assert a.generated == alone(make_engine, a_tokens, 20)
    assert b.generated == alone(make_engine, b_tokens, 12)
    assert a.finish_reason == b.finish_reason == "length"


def test_a_long_prompt_comes_in_a_chunk_per_step_while_the_others_decode(make_engine) -> None:
    engine = make_engine(chunk=64)
    running = make_engine.job(prompt(40, 3), 200)
    run(engine, make_engine.job(prompt(5, 9), 1))  # warm the engine
    engine.submit(running)
    while running.state != "decode":
        engine.step()
    newcomer = make_engine.job(prompt(700, 4), 4)
    engine.submit(newcomer)
    reports = []
    while newcomer.state != "decode":
        reports.append(engine.step())
    assert len(reports) >= 700 // 64
    for report in reports:
        assert report.decoded == 1 and 0 < report.prompt_tokens <= 64  # never a step without the other's token
    engine.cancel(running)
    run(engine, newcomer)
    assert newcomer.generated == alone(make_engine, newcomer.prompt, 4)


def test_cancelling_frees_the_slot_at_the_next_step(make_engine) -> None:
    engine = make_engine(slots=1)
    first, second = make_engine.job(prompt(30, 5), 500), make_engine.job(prompt(30, 6), 3)
    engine.submit(first)
    engine.submit(second)
    for _ in range(3):
        engine.step()
    assert first.state == "decode" and second.state == "queued"
    engine.cancel(first)
    report = engine.step()
    assert first.state == "done" and first.finish_reason == "cancelled" and report.finished == 1
    assert second.state != "queued"
    run(engine, second)
    assert len(first.generated) < 10 and second.generated == alone(make_engine, second.prompt, 3)


def test_a_shared_prefix_is_evaluated_once(make_engine) -> None:
    system = prompt(300, 7)
    engine = make_engine()
    jobs = [make_engine.job(system + prompt(20, 10 + i)[1:], 6) for i in range(3)]
    run(engine, *jobs)
    assert engine.counters["borrowed_tokens"] >= 2 * 299
    assert engine.counters["prompt_tokens_evaluated"] <= 300 + 3 * 20
    assert [j.admitted for j in jobs] == ["cold", "shared", "shared"]
    for job in jobs:
        assert job.generated == alone(make_engine, job.prompt, 6)


def test_finished_jobs_are_stored_with_store_finished(make_engine, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    engine = make_engine(store_finished=True, url=url)
    job = make_engine.job(prompt(50, 11), 5)
    run(engine, job)
    engine.cache.flush()
    held = job.prompt + job.generated[:-1]  # the last token is sampled, not evaluated
    assert job.context == held
    assert engine.cache.peek(held, partial=False).length == len(held)
    # a new engine on the store continues it warm
    again = make_engine(url=url)
    follow = make_engine.job(held + [5, 6, 7], 3)
    run(again, follow)
    assert follow.admitted == "warm" and follow.reused >= len(held)


def test_an_exact_repeat_samples_its_first_token_from_stored_logits(make_engine, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    engine = make_engine(url=url)
    tokens = prompt(60, 12)
    first = make_engine.job(tokens, 5)
    run(engine, first)
    engine.cache.flush()
    other = make_engine(url=url)  # another engine: nothing live to reuse
    again = make_engine.job(tokens, 5)
    run(other, again)
    assert again.logits_from_store and again.reused == len(tokens) and again.generated == first.generated


def test_abort_ends_every_job_and_the_engine_goes_on(make_engine) -> None:
    engine = make_engine(slots=1)
    running, waiting = make_engine.job(prompt(30, 13), 100), make_engine.job(prompt(30, 14), 100)
    engine.submit(running)
    engine.submit(waiting)
    engine.step()
    engine.abort(RuntimeError("boom"))
    assert running.finish_reason == waiting.finish_reason == "error" and str(running.error) == "boom"
    assert engine.running == engine.queued == 0
    later = make_engine.job(prompt(30, 15), 4)
    run(engine, later)
    assert later.generated == alone(make_engine, later.prompt, 4) and later.admitted == "cold"


def test_bad_arguments(make_engine, llm: llama_cpp.Llama) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(make_engine.job([], 4))
    with pytest.raises(ValueError, match="max_new"):
        engine.submit(make_engine.job([1, 2], 0))
    for chunk in (16, 100, "64"):
        with pytest.raises(ValueError, match="chunk"):
            BatchEngine(llm, engine.cache, slots=2, n_ctx=512, chunk=chunk)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slots"):
        BatchEngine(llm, engine.cache, slots=llama_cpp.llama_max_parallel_sequences() + 1, n_ctx=512)
    done = make_engine.job([1, 2, 3], 1)
    run(engine, done)
    with pytest.raises(ValueError, match="runs once"):
        engine.submit(done)
