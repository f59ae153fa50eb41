"""llama.cpp sequence states: copying them out, restoring them, and the entries that hold them.

Shared by `sippcache.llama.PrefixCache` (sequence 0 of one context) and
`sippcache.llama.SessionPool` (one sequence per slot), so both follow the same
rules, which depend on the model's `MemoryKind`: a restored state must hold
exactly the positions its key says, and it is truncated (or shared between
sequences) only where llama.cpp can do that exactly: anywhere with full
attention, within one token of a restored state with a sliding window, never
for recurrent and hybrid models (docs/llama.md, "Why a hit never changes the
result").

An entry is a `sippcache.frame` with the sequence state as section "state"
and, for a whole prompt, the last position's logits (float32, one per
vocabulary token) as section "logits": with them an exact repeat needs no
evaluation at all.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ..state.buffers import StateBuffers

#: The `kind` of entries holding one llama.cpp sequence's state.
KIND = "llama.seq"
STATE = "state"
LOGITS = "logits"


@dataclass
class Snapshot:
    """A state copied out of a context (on the thread that owns it), ready to be framed
    and stored in the background. `generation` is when it was copied (ns)."""

    key: list[int]
    state: memoryview
    logits: np.ndarray | None
    generation: int
    pinned: bool = False
    supersede: bool = False  # a prompt's end: the entries under shorter prefixes of it go (`SequenceCache`)
    seconds: float = 0.0  # the copy out of the context took


def memory(ctx: Any) -> Any:
    return llama_cpp.llama_get_memory(ctx)


def state_size(ctx: Any, seq: int) -> int:
    """Bytes `copy_state` would copy."""
    return int(llama_cpp.llama_state_seq_get_size(ctx, seq))


def copy_state(ctx: Any, seq: int, buffers: StateBuffers | None = None) -> memoryview | None:
    """Sequence `seq`'s state, copied (into a buffer of `buffers`, to be given back once
    stored; else new memory); None if llama.cpp cannot copy it."""
    size = state_size(ctx, seq)
    buffer = bytearray(size) if buffers is None else buffers.take(size)
    written = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buffer), size, seq)
    if written == 0 or written > size:
        return None
    return memoryview(buffer)[:written]


def copy_logits(ctx: Any, n_vocab: int, index: int = -1) -> np.ndarray:
    """A copy of the logits of output `index` of the last evaluation."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()


@dataclass(frozen=True)
class MemoryKind:
    """How a model's llama.cpp memory keeps a sequence: what decides where a state may be
    cut back or shared. The one place the kinds are told apart; every path (PrefixCache,
    LlamaCache, SessionPool, BatchEngine) asks it.

    - Full attention (`n_swa` 0, neither flag): every position's K/V is kept, so a
      state can be cut anywhere.
    - Sliding window (iSWA, `n_swa` > 0): a restored state keeps only the last n_swa
      positions of the sliding-window layers, so it can be cut by one token at most.
    - Recurrent (Mamba, RWKV): one cell per sequence holds the state after its last
      position; llama.cpp cannot cut it back (`llama_memory_seq_rm` of a tail fails)
      and `llama_memory_seq_cp` shares that whole cell, whatever range it is given.
    - Hybrid (attention + recurrent or convolution layers: Jamba, LFM2, Granite 4 H,
      Nemotron-H, Falcon-H1, Qwen3-Next): the recurrent part decides, and its
      `seq_pos_min` is the larger of its two memories'.

    So a recurrent or hybrid state is only ever used at exactly the length it holds
    (`exact_length_only`): restored whole, kept live only when the prompt extends it,
    shared only when the other sequence needs all of it.
    """

    n_swa: int = 0
    recurrent: bool = False
    hybrid: bool = False

    @classmethod
    def of(cls, model: Any) -> MemoryKind:
        """The kind of a loaded `llama_model`."""
        return cls(
            n_swa=int(llama_cpp.llama_model_n_swa(model)),
            recurrent=bool(llama_cpp.llama_model_is_recurrent(model)),
            hybrid=bool(llama_cpp.llama_model_is_hybrid(model)),
        )

    @property
    def name(self) -> str:
        """ "attention", "swa", "recurrent" or "hybrid" (for logs, entry headers, docs)."""
        if self.hybrid:
            return "hybrid"
        if self.recurrent:
            return "recurrent"
        return "swa" if self.n_swa > 0 else "attention"

    @property
    def exact_length_only(self) -> bool:
        """A state can be used only at the length it holds: never cut, shared whole."""
        return self.recurrent or self.hybrid

    def holds_positions(self, mem: Any, seq: int, length: int) -> bool:
        """Sequence `seq` holds exactly positions 0..length-1, as far as llama.cpp shows it:
        it ends at length - 1 and starts at 0 (full attention), somewhere in the window
        (sliding window), or, recurrent and hybrid, at its one recurrent cell (length - 1)."""
        if llama_cpp.llama_memory_seq_pos_max(mem, seq) != length - 1:
            return False
        if self.exact_length_only:
            return bool(llama_cpp.llama_memory_seq_pos_min(mem, seq) == length - 1)
        return self.n_swa > 0 or llama_cpp.llama_memory_seq_pos_min(mem, seq) == 0

    def can_truncate(self, mem: Any, seq: int, length: int) -> bool:
        """Whether cutting sequence `seq` to `length` positions is exact (and, for
        `llama_memory_seq_cp`, whether its first `length` positions can be shared).
        Recurrent and hybrid: only when it holds exactly `length` (nothing to cut). A
        sliding-window layer lets the token at position `length` see positions
        length - n_swa + 1 and later, and a restored sequence keeps only its last n_swa
        positions there, so cutting below what they hold silently corrupts the logits.
        (llama.cpp's server asks for one position more than needed; measured on
        gemma-3-270m: a restored state cut by one token gives the logits of a live
        context cut the same way, bit for bit, and cut by two it does not.)"""
        if self.exact_length_only:
            return bool(llama_cpp.llama_memory_seq_pos_max(mem, seq) == length - 1)
        if self.n_swa > 0:
            return bool(llama_cpp.llama_memory_seq_pos_min(mem, seq) <= max(0, length - self.n_swa + 1))
        return True

    def may_truncate_restored(self, key_length: int, length: int) -> bool:
        """Whether a state restored from an entry of `key_length` tokens is likely to pass
        `can_truncate` for `length`: recurrent and hybrid states only uncut; a restored
        sliding-window sequence starts at max(0, key_length - n_swa) and can be cut by one
        token at most. Used to skip fetching an entry that could not be used; the real
        check runs after the restore."""
        if self.exact_length_only:
            return length >= key_length
        return length >= key_length - 1 or self.n_swa == 0 or key_length <= self.n_swa

    def truncate(self, mem: Any, seq: int, length: int) -> bool:
        """Cut sequence `seq` to its first `length` positions if that is exact."""
        return self.can_truncate(mem, seq, length) and bool(llama_cpp.llama_memory_seq_rm(mem, seq, length, -1))


#: Why a stored state was not used: the keys of `PrefixStats.refused` and the `reason`
#: label of /metrics' ``sippcache_refused_entries_total``.
REFUSED_LOAD = "load"  # llama.cpp did not take all of it (another layout, no room now): kept, others may use it
REFUSED_POSITIONS = "positions"  # taken, but holding other positions than its key says: a wrong entry, dropped
REFUSED_CUT = "cut"  # usable only cut back where this memory kind cannot cut exactly: kept
REFUSAL_REASONS = (REFUSED_LOAD, REFUSED_POSITIONS, REFUSED_CUT)


def restore_state(ctx: Any, seq: int, state: memoryview | np.ndarray, length: int, kind: MemoryKind) -> str | None:
    """Load `state` into sequence `seq` (zero-copy from the view). None if the sequence
    now holds exactly positions 0..length-1, else why not (`REFUSED_LOAD`,
    `REFUSED_POSITIONS`)."""
    payload = np.frombuffer(state, dtype=np.uint8)  # a view of the stored bytes: no copy
    size = payload.nbytes
    loaded = llama_cpp.llama_state_seq_set_data(ctx, payload.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
    del payload
    if loaded != size:
        return REFUSED_LOAD
    return None if kind.holds_positions(memory(ctx), seq, length) else REFUSED_POSITIONS


def clear(mem: Any, seq: int) -> None:
    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)


def copy_whole_state(ctx: Any) -> bytes:
    """The whole context's state (every sequence), as `llama_state_get_data` gives it."""
    size = llama_cpp.llama_state_get_size(ctx)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_get_data(ctx, buffer, size)
    if written == 0 or written > size:
        raise RuntimeError("failed to copy the llama state")
    return bytes(memoryview(buffer)[:written])


def restore_whole_state(ctx: Any, state: bytes, size: int) -> None:
    data = np.frombuffer(state, dtype=np.uint8)
    if llama_cpp.llama_state_set_data(ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size) != size:
        raise RuntimeError("failed to set the llama state")


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data
_token_ids: dict[int, np.ndarray] = {}


def sample_from_logits(sampler: Any, logits: np.ndarray) -> int:
    """Sample a token from `logits` with a llama.cpp sampler chain, exactly as
    `llama_sampler_sample` does from a context's logits: the same candidate array
    (every token, p = 0, unsorted), `llama_sampler_apply`, the selected token, and
    `llama_sampler_accept` (penalties and grammars see it)."""
    n_vocab = len(logits)
    ids = _token_ids.get(n_vocab)
    if ids is None:
        ids = _token_ids[n_vocab] = np.arange(n_vocab, dtype=np.int32)
    data = np.empty(n_vocab, dtype=_TOKEN_DATA)
    data["id"], data["logit"], data["p"] = ids, logits, 0.0
    candidates = llama_cpp.llama_token_data_array(
        data=data.ctypes.data_as(llama_cpp.llama_token_data_p), size=n_vocab, selected=-1, sorted=False
    )
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
    if not 0 <= candidates.selected < candidates.size:
        raise RuntimeError("the sampler chain selected no token")
    token = int(candidates.data[candidates.selected].id)
    llama_cpp.llama_sampler_accept(sampler, token)
    return token
