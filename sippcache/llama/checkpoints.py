"""Where a prefill stores intermediate snapshots: the one plan `PrefixCache`, `SessionPool` and `BatchEngine` follow.

A prompt evaluated in one go leaves one state, of all its tokens. A later prompt that shares
only part of it (the same system prompt, another question) finds nothing shorter to restore.
So a long evaluation stops on the way and stores the state there too: every `interval` tokens
(`CacheOptions.checkpoint_interval`), and where the prompt leaves the stored entry it shares the
most with, the place the next conversation is likeliest to leave it too (docs/llama.md, "What is
stored").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHECKPOINT_ALIGNMENT", "CheckpointPlan", "checkpoint_positions"]

#: Checkpoints where a prompt leaves a stored one are rounded down to a multiple of
#: this. llama.cpp's quantized kernels give results that depend on where a batch
#: is split: measured on gemma-3-270m (q4_k_m, AVX-512), splitting an evaluation
#: at a multiple of 8 tokens is bit-identical to not splitting it, while splitting
#: at 999 or 1,001 moves logits by up to 1.1. Aligned, a checkpoint costs nothing
#: in exactness (and at most 31 tokens of reuse).
CHECKPOINT_ALIGNMENT = 32


@dataclass
class CheckpointPlan:
    """Where one prefill stores intermediate snapshots (`positions`, ascending) and the
    bytes they may still take (`budget`; None: no limit). Made by `SequenceCache.plan`,
    spent by `SequenceCache.checkpoint`."""

    positions: list[int]
    budget: int | None = None

    def next_stop(self, position: int, end: int) -> int:
        """The first checkpoint after `position`, else `end`."""
        return next((b for b in self.positions if b > position), end)

    def add(self, position: int) -> None:
        """Stop (and store a checkpoint) at `position` too."""
        if position not in self.positions:
            self.positions = sorted([*self.positions, position])

    def skip_to(self, position: int) -> None:
        """Forget the checkpoints up to `position` (the sequence got there without them)."""
        self.positions = [b for b in self.positions if b > position]


def checkpoint_positions(start: int, branch: int, final: int, *, interval: int, min_tokens: int) -> list[int]:
    """Where an evaluation from `start` to `final` stores intermediate snapshots, ascending:
    every `interval` tokens, and where the prompt leaves the entry it shares most with
    (`branch`, rounded down to `CHECKPOINT_ALIGNMENT`); none shorter than `min_tokens`.
    The one plan `PrefixCache`, `SessionPool` and `BatchEngine` follow."""
    found = {b for b in range((start // interval + 1) * interval, final, interval) if b >= min_tokens}
    branch -= branch % CHECKPOINT_ALIGNMENT
    if start < branch < final and branch >= min_tokens:
        found.add(branch)
    return sorted(found)
