"""llama.cpp sequence states: copying them out, restoring them, and the entries that hold them.

Shared by `sippcache.llama.PrefixCache` (sequence 0 of one context) and
`sippcache.llama.SessionPool` (one sequence per slot), so both follow the same
rules: a restored state must hold exactly the positions its key says, and it
is truncated only where llama.cpp can do that exactly (the sliding-window
rule: docs/llama.md, "Why a hit never changes the result").

An entry is a `sippcache.frame` with the sequence state as section "state"
and, for a whole prompt, the last position's logits (float32, one per
vocabulary token) as section "logits": with them an exact repeat needs no
evaluation at all.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from .. import frame
from ..errors import CorruptEntry

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


@dataclass
class Entry:
    """A decoded, checked entry: views of the stored blob (keep the match open while used)."""

    state: memoryview
    logits: memoryview | None


def memory(ctx: Any) -> Any:
    return llama_cpp.llama_get_memory(ctx)


def state_size(ctx: Any, seq: int) -> int:
    """Bytes `copy_state` would copy."""
    return int(llama_cpp.llama_state_seq_get_size(ctx, seq))


def copy_state(ctx: Any, seq: int) -> memoryview | None:
    """Sequence `seq`'s state, copied; None if llama.cpp cannot copy it."""
    size = state_size(ctx, seq)
    buffer = bytearray(size)
    written = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buffer), size, seq)
    if written == 0 or written > size:
        return None
    return memoryview(buffer)[:written]


def copy_logits(ctx: Any, n_vocab: int, index: int = -1) -> np.ndarray:
    """A copy of the logits of output `index` of the last evaluation."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()


def restore_state(ctx: Any, seq: int, state: memoryview | np.ndarray, length: int, n_swa: int) -> bool:
    """Load `state` into sequence `seq` (zero-copy from the view); True only if llama.cpp
    took all of it and the sequence now holds exactly positions 0..length-1."""
    payload = np.frombuffer(state, dtype=np.uint8)  # a view of the stored bytes: no copy
    size = payload.nbytes
    loaded = llama_cpp.llama_state_seq_set_data(ctx, payload.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
    del payload
    return loaded == size and holds_positions(memory(ctx), seq, length, n_swa)


def holds_positions(mem: Any, seq: int, length: int, n_swa: int) -> bool:
    """Sequence `seq` ends at position length - 1 and (without a sliding window) starts at 0."""
    if llama_cpp.llama_memory_seq_pos_max(mem, seq) != length - 1:
        return False
    return n_swa > 0 or llama_cpp.llama_memory_seq_pos_min(mem, seq) == 0


def can_truncate(mem: Any, seq: int, length: int, n_swa: int) -> bool:
    """Whether cutting sequence `seq` to `length` positions is exact. A sliding-window
    layer lets the token at position `length` see positions length - n_swa + 1 and
    later, and a restored sequence keeps only its last n_swa positions there, so
    cutting below what they hold silently corrupts the logits. (llama.cpp's server
    asks for one position more than needed; measured on gemma-3-270m: a restored
    state cut by one token gives the logits of a live context cut the same way, bit
    for bit, and cut by two it does not.)"""
    return llama_cpp.llama_memory_seq_pos_min(mem, seq) <= max(0, length - n_swa + 1) if n_swa > 0 else True


def may_truncate_restored(key_length: int, length: int, n_swa: int) -> bool:
    """Whether a state restored from an entry of `key_length` tokens is likely to pass
    `can_truncate` for `length`: a restored sequence keeps the last n_swa positions of
    its sliding-window layers, so it starts at max(0, key_length - n_swa), and can be
    cut by one token at most. Used to skip fetching an entry that could not be used;
    the real check runs after the restore."""
    return length >= key_length - 1 or n_swa == 0 or key_length <= n_swa


def truncate(mem: Any, seq: int, length: int, n_swa: int) -> bool:
    """Cut sequence `seq` to its first `length` positions if that is exact."""
    return can_truncate(mem, seq, length, n_swa) and bool(llama_cpp.llama_memory_seq_rm(mem, seq, length, -1))


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


def encode_entry(snapshot: Snapshot, *, fingerprint: str, n_swa: int, scope: str, secret: bytes | None) -> bytes:
    """Frame a snapshot: state, and logits when it has them."""
    sections: list[Any] = [snapshot.state]
    roles = [STATE]
    if snapshot.logits is not None:
        sections.append(snapshot.logits.data.cast("B"))
        roles.append(LOGITS)
    return frame.encode(
        snapshot.key,
        sections,
        fingerprint=fingerprint,
        kind=KIND,
        versions={"llama_cpp_python": llama_cpp.__version__},
        meta={"n_swa": n_swa, "scope": scope, "pid": os.getpid()},
        roles=roles,
        secret=secret,
    )


def decode_entry(blob: Any, key: tuple[int, ...], *, fingerprint: str, n_vocab: int, secret: bytes | None) -> Entry:
    """Check that `blob` is an entry for exactly `key` of this model; raise `CorruptEntry`
    (or `UnsupportedEntry`) saying why not."""
    entry = frame.decode(blob, secret=secret)
    state = entry.section(STATE) if STATE in entry.roles else entry.sections[0] if len(entry.sections) == 1 else None
    logits = entry.section(LOGITS)
    if (entry.kind, entry.fingerprint, entry.tokens) != (KIND, fingerprint, tuple(key)) or state is None:
        raise CorruptEntry("its header does not match its key and model")
    if logits is not None and len(logits) != 4 * n_vocab:
        raise CorruptEntry(f"its logits are {len(logits)} bytes, not 4 x n_vocab ({n_vocab})")
    return Entry(state, logits)
