"""`BatchedLlama`: one request's `llama_cpp.Llama`, whose tokens come from the scheduler.

With ``--parallel N`` the proxy hands every request a `BatchedLlama` of its
own instead of the shared model. It is a `llama_cpp.Llama` that borrows
everything from the model it stands for (weights, tokenizer, chat formats and
handlers, settings) and keeps per request only what upstream's code changes
while it runs a completion (the seed, the tokens so far, logits for
logprobs). So upstream's own methods run on it unchanged: endpoints,
``create_chat_completion`` and its chat handlers (the prompt text is the one
upstream's handler makes), ``create_completion`` (stop strings, ``max_tokens``,
usage, streaming chunks, logprobs, seeds, logit bias, grammars and JSON
schemas). Only `generate` differs: it builds upstream's sampler chain for the
request (``Llama._init_sampler``, so sampling means what it means upstream),
hands the prompt and the chain to the model's `Scheduler`, and yields the
tokens the scheduler samples, batched with every other request's. A
``logit_bias`` is added by llama.cpp's logit-bias sampler where upstream's
Python logits processor would add it (see `create_completion`).

What cannot run batched runs on the shared model, behind its lock, as with
``--parallel 1`` (`serialized`): a completion asking for the prompt's own
logprobs (``echo`` with ``logprobs``: every prompt position's logits), and
embeddings. A model whose chat handler drives the context itself (multimodal
handlers) or that has a draft model (speculative decoding) is served that way
altogether: the proxy hands out the shared model (`sippcache.server.stores`).
"""

from __future__ import annotations

import inspect
import queue
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_grammar import LlamaGrammar

from ..llama import Llama
from ..llama.batch import Job
from .door import CURRENT, RequestContext

__all__ = ["BatchedLlama", "Batcher", "serialized_reason"]

_T = TypeVar("_T")


class Batcher(Protocol):
    """What a request's `BatchedLlama` hands its work to: the model's scheduler
    (`sippcache.server.scheduler.Scheduler`, which makes the requests, so builds on this module)."""

    def submit(self, job: Job, request: RequestContext | None = None) -> None:
        """Run `job`, batched with the others."""

    def allow(self, job: Job, tokens: int) -> None:
        """Let `job` sample up to `tokens` tokens."""

    def cancel(self, job: Job) -> None:
        """End `job` at the next step."""

    def serialized(self, reason: str, call: Callable[[], _T]) -> _T:
        """`call()` on the shared model, one at a time."""

    def take_seed(self) -> int:
        """The model's seed for a request that reads it."""

    def give_seed(self, seed: int) -> None:
        """A request set its seed: the shared model's from now on."""


_COMPLETION_SIGNATURE = inspect.signature(llama_cpp.Llama.create_completion)


def serialized_reason(arguments: dict[str, Any]) -> str | None:
    """Why a completion with these arguments runs on the shared model, or None."""
    if arguments.get("echo") and arguments.get("logprobs") is not None:
        return "prompt_logprobs"
    return None


class BatchedLlama(llama_cpp.Llama):
    """A `llama_cpp.Llama` for one request to `base`, generating through `scheduler`."""

    def __init__(self, base: Llama, scheduler: Batcher) -> None:  # no super(): nothing to load
        self.__dict__["_base"] = base  # before any attribute: `__getattr__` reads it
        self._scheduler = scheduler
        self._own_seed: int | None = None
        self.cache = None  # the engine looks prompts up and stores states itself
        self.verbose = False  # upstream's verbose paths time the shared context
        self.scores = np.empty((0, 0), dtype=np.single)  # rows only for logprobs: see `generate`
        self._job: Job | None = None
        self._wants_rows = False  # logprobs or a stopping criterion read a row of logits per token
        self._logit_bias: dict[int, float] = {}  # applied by llama.cpp's own sampler: see `create_completion`
        self._max_tokens: int | None = None  # the completion's own bound: see `generate`

    def __getattr__(self, name: str) -> Any:
        """Anything this request does not own is the model's (weights, tokenizer, settings)."""
        return getattr(self.__dict__["_base"], name)

    # -- what upstream's completion code reads -----------------------------------------

    @property
    def n_tokens(self) -> int:
        job = self._job
        return job.evaluated if job is not None else 0

    @n_tokens.setter
    def n_tokens(self, value: int) -> None:
        pass  # derived from the job

    @property
    def _input_ids(self) -> npt.NDArray[np.intc]:
        job = self._job
        return np.asarray(job.context if job is not None else [], dtype=np.intc)

    @property
    def _scores(self) -> npt.NDArray[np.single]:
        return self.scores[: self.n_tokens, :]

    # -- completions -----------------------------------------------------------------------

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        arguments = _COMPLETION_SIGNATURE.bind(self, *args, **kwargs).arguments
        reason = serialized_reason(arguments)
        if reason is not None:
            return self._scheduler.serialized(reason, lambda: self._base.create_completion(*args, **kwargs))
        self._wants_rows = arguments.get("logprobs") is not None or arguments.get("stopping_criteria") is not None
        max_tokens = arguments.get("max_tokens", _COMPLETION_SIGNATURE.parameters["max_tokens"].default)
        self._max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None
        self._logit_bias = {}
        if arguments.get("logit_bias") and arguments.get("logits_processor") is None:
            # Upstream adds a bias with a Python logits processor that copies the whole
            # vocabulary's logits for every token, called back from llama.cpp's sampling (on
            # the scheduler's thread, for every request in the step). llama.cpp's logit-bias
            # sampler, first in the chain where upstream puts its processor, adds the same
            # float32 values in place (`generate`).
            self._logit_bias = {int(k): float(v) for k, v in arguments.pop("logit_bias").items()}
            del arguments["self"]
            return super().create_completion(**arguments)
        return super().create_completion(*args, **kwargs)

    def generate(  # type: ignore[override]
        self,
        tokens: Sequence[int],
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        reset: bool = True,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        penalize_nl: bool = True,
        logits_processor: llama_cpp.LogitsProcessorList | None = None,
        stopping_criteria: llama_cpp.StoppingCriteriaList | None = None,
        grammar: LlamaGrammar | None = None,
    ) -> Iterator[int]:
        """Upstream's `generate`, run by the scheduler: the prompt is prefilled (from the
        cache, another slot, or evaluated), then each token is sampled with upstream's
        sampler chain for these arguments, in a batch with the other requests'."""
        prompt = [int(t) for t in tokens]
        sampler = self._init_sampler(
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typical_p=typical_p,
            temp=temp,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            tfs_z=tfs_z,
            mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
            penalize_nl=penalize_nl,
            logits_processor=logits_processor,
            grammar=grammar,
        )
        if self._logit_bias:
            _put_first(sampler, self._n_vocab, self._logit_bias)
        rows = self._wants_rows or stopping_criteria is not None
        if rows:  # logprobs read a row per position; zeroed pages cost nothing until written
            self.scores = np.zeros((self._n_ctx, self._n_vocab), dtype=np.single)
        tokens_out: queue.SimpleQueue[int | None] = queue.SimpleQueue()

        def on_token(job: Job, token: int, logits: np.ndarray | None) -> None:  # on the scheduler's thread
            if logits is not None:
                self.scores[job.evaluated - 1, :] = logits
            tokens_out.put(token)

        # The job samples what upstream's completion reads (its `max_tokens`, and one token more
        # each time it asks past them: the end of a character cut in two), not what the engine had
        # got to by the time the request's thread closed this generator: tokens no client sees,
        # as many as the thread's lateness allowed (a whole context, for a slow reader), would sit
        # in the slot, and what a stop or an idle time stored of it, and where a next turn's
        # computation started, would depend on timing.
        job = Job(
            prompt,
            sampler.sampler,
            max_new=max(1, self._n_ctx - len(prompt)),
            allowed=self._max_tokens,
            keep_logits=rows,
            on_token=on_token,
            on_finish=lambda job: tokens_out.put(None),
            keepalive=sampler,
        )
        self._job = job
        self._scheduler.submit(job, CURRENT.get())
        read = 0
        try:
            while True:
                if job.allowed is not None and read >= job.allowed:
                    self._scheduler.allow(job, read + 1)  # upstream reads on past its max_tokens
                token = tokens_out.get()
                if token is None:
                    if job.error is not None:
                        raise RuntimeError(f"the batched step failed: {job.error}") from job.error
                    return
                if stopping_criteria is not None and stopping_criteria(
                    self._input_ids, self.scores[job.evaluated - 1, :]
                ):
                    return
                read += 1
                yield token
        finally:
            self._scheduler.cancel(job)  # the consumer stopped (or left): free the slot at the next step

    # -- what runs on the shared model instead ------------------------------------------------

    def create_embedding(self, *args: Any, **kwargs: Any) -> Any:
        return self._scheduler.serialized("embedding", lambda: self._base.create_embedding(*args, **kwargs))

    def embed(self, *args: Any, **kwargs: Any) -> Any:
        return self._scheduler.serialized("embedding", lambda: self._base.embed(*args, **kwargs))

    # -- what a request must not do to the shared model -----------------------------------------

    @property
    def _seed(self) -> int:
        """This request's seed: its own once set, else its turn in the model's chain."""
        if self._own_seed is None:
            self._own_seed = self._scheduler.take_seed()
        return self._own_seed

    @_seed.setter
    def _seed(self, seed: int) -> None:
        self._own_seed = seed

    def set_seed(self, seed: int) -> None:
        self._own_seed = seed
        self._scheduler.give_seed(seed)

    def reset(self) -> None:
        pass  # nothing of this request's lives in a context until the scheduler runs it

    def eval(self, tokens: Sequence[int]) -> None:
        raise NotImplementedError("a batched request is evaluated by the scheduler")

    def set_cache(self, cache: Any) -> None:
        raise NotImplementedError("a batched request uses its model's cache")

    def save_state(self) -> Any:
        raise NotImplementedError("a batched request's state is its sequence in the scheduler's context")

    def load_state(self, state: Any) -> None:
        raise NotImplementedError("a batched request's state is its sequence in the scheduler's context")

    def close(self) -> None:
        pass  # the model is the proxy's to close

    def __del__(self) -> None:
        pass


def _put_first(sampler: Any, n_vocab: int, logit_bias: dict[int, float]) -> None:
    """Make llama.cpp's logit-bias sampler the first of `sampler`'s chain (upstream's
    `_init_sampler` puts its logits processors first)."""
    assert not sampler.custom_samplers  # their positions are upstream's to free by
    chain = sampler.sampler
    rest = [llama_cpp.llama_sampler_chain_remove(chain, 0) for _ in range(llama_cpp.llama_sampler_chain_n(chain))]
    sampler.add_logit_bias(n_vocab, logit_bias)
    for each in rest:
        llama_cpp.llama_sampler_chain_add(chain, each)
