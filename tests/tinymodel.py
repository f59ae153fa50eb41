"""A tiny random-weight llama model, written on demand as a GGUF file.

Tests need a real llama.cpp model: real KV state, real logits, real restore
semantics. A downloaded model is slow to load and must not be fetched at run
time, and no model binary is committed to the repository. This module writes
a 2-layer llama model (about 470 KB) with the `gguf` package instead: it is
written and loaded in milliseconds and prefills 1,200 tokens in tens of
milliseconds.

The weights are random, so the text it produces is noise, but every logit is
a deterministic function of the seed and the tokens, which is all a cache
test needs. `gguf` and `numpy` are optional dependencies (the ``test`` and
``llama`` extras), imported only when a model is written.
"""

from __future__ import annotations

import math
import os
import pathlib

#: Hyperparameters of the tiny model.
N_EMBD = 64
N_LAYER = 2
N_FF = 128
N_HEAD = 4
N_HEAD_KV = 4
HEAD_DIM = N_EMBD // N_HEAD
ROPE_DIM = HEAD_DIM
RMS_EPS = 1e-5

#: Vocabulary: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, ``▁``.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_VOCAB = 3 + 256 + 1


def write_tiny_model(path: str | os.PathLike[str], *, seed: int = 0, n_ctx_train: int = 4096) -> pathlib.Path:
    """Write the tiny llama GGUF model to `path` and return the path.

    The same `seed` always writes the same file, byte for byte; another
    seed gives other weights with the same shapes. `n_ctx_train` is the
    training context length recorded as ``llama.context_length``.
    """
    import gguf
    import numpy as np

    path = pathlib.Path(path)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        """A float32 matrix of `rows` outputs x `cols` inputs (numpy order)."""
        scale = 1.0 / math.sqrt(cols)
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        """An RMS-norm weight of ones."""
        return np.ones(N_EMBD, dtype=np.float32)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    token_types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL]
    )

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(ROPE_DIM)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * N_VOCAB)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)

    writer.add_tensor("token_embd.weight", weight(N_VOCAB, N_EMBD))
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", norm())
        writer.add_tensor(f"{blk}.attn_q.weight", weight(N_HEAD * HEAD_DIM, N_EMBD))
        writer.add_tensor(f"{blk}.attn_k.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
        writer.add_tensor(f"{blk}.attn_v.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
        writer.add_tensor(f"{blk}.attn_output.weight", weight(N_EMBD, N_HEAD * HEAD_DIM))
        writer.add_tensor(f"{blk}.ffn_norm.weight", norm())
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor("output.weight", weight(N_VOCAB, N_EMBD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
