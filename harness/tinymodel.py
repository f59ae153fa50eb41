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


#: The memory kinds `write_tiny_model` writes a model of, by llama.cpp architecture:
#: full attention (llama), sliding window (gemma3, iSWA: layer 0 sees the last
#: `N_SWA` positions, layer 1 all of them), recurrent (mamba) and hybrid (jamba:
#: layer 0 Mamba, layer 1 attention).
ARCHITECTURES = {"attention": "llama", "swa": "gemma3", "recurrent": "mamba", "hybrid": "jamba"}
#: The sliding window of the iSWA model: small, so a test prompt runs far past it.
N_SWA = 64
#: Mamba layers: inner size (llama.cpp supports an expansion factor of 2 only),
#: convolution kernel, state size, time step rank.
SSM_INNER, SSM_CONV, SSM_STATE, SSM_DT_RANK = 2 * N_EMBD, 4, 16, 4


def write_tiny_model(
    path: str | os.PathLike[str], *, seed: int = 0, n_ctx_train: int = 4096, kind: str = "attention"
) -> pathlib.Path:
    """Write a tiny GGUF model of memory `kind` (see `ARCHITECTURES`) to `path`.

    The same `seed` always writes the same file, byte for byte; another
    seed gives other weights with the same shapes. `n_ctx_train` is the
    training context length recorded as ``<arch>.context_length``.
    """
    import gguf
    import numpy as np

    path = pathlib.Path(path)
    arch = ARCHITECTURES[kind]
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        """A float32 matrix of shape[0] outputs x shape[-1] inputs (numpy order)."""
        scale = 1.0 / math.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int = N_EMBD) -> np.ndarray:
        """An RMS-norm weight of ones."""
        return np.ones(n, dtype=np.float32)

    def mamba_layer(blk: str) -> None:
        """One Mamba layer (llama.cpp's `mamba`; `jamba` adds RMS norms of dt, B and C).
        A is negative (it is -exp(A_log)), so the state decays."""
        writer.add_tensor(f"{blk}.ssm_in.weight", weight(2 * SSM_INNER, N_EMBD))
        writer.add_tensor(f"{blk}.ssm_conv1d.weight", weight(SSM_INNER, SSM_CONV))
        writer.add_tensor(f"{blk}.ssm_conv1d.bias", np.zeros(SSM_INNER, dtype=np.float32))
        writer.add_tensor(f"{blk}.ssm_x.weight", weight(SSM_DT_RANK + 2 * SSM_STATE, SSM_INNER))
        writer.add_tensor(f"{blk}.ssm_dt.weight", weight(SSM_INNER, SSM_DT_RANK))
        writer.add_tensor(f"{blk}.ssm_dt.bias", np.zeros(SSM_INNER, dtype=np.float32))
        writer.add_tensor(f"{blk}.ssm_a", -np.tile(np.arange(1, SSM_STATE + 1, dtype=np.float32), (SSM_INNER, 1)))
        writer.add_tensor(f"{blk}.ssm_d", ones(SSM_INNER))
        writer.add_tensor(f"{blk}.ssm_out.weight", weight(N_EMBD, SSM_INNER))
        if kind == "hybrid":
            writer.add_tensor(f"{blk}.ssm_dt_norm.weight", ones(SSM_DT_RANK))
            writer.add_tensor(f"{blk}.ssm_b_norm.weight", ones(SSM_STATE))
            writer.add_tensor(f"{blk}.ssm_c_norm.weight", ones(SSM_STATE))

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    token_types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL]
    )

    writer = gguf.GGUFWriter(path, arch)  # before mamba_layer is called, which writes to it
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    if kind == "recurrent":
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_head_count_kv(0)
    else:
        writer.add_feed_forward_length(N_FF)
        writer.add_head_count(N_HEAD)
        writer.add_head_count_kv([0, N_HEAD_KV] if kind == "hybrid" else N_HEAD_KV)
    if kind in ("attention", "swa"):
        writer.add_rope_dimension_count(ROPE_DIM)
    if kind == "swa":
        writer.add_sliding_window(N_SWA)
        writer.add_sliding_window_pattern(2)  # layer 0 sliding, layer 1 global
    if kind in ("recurrent", "hybrid"):
        writer.add_ssm_conv_kernel(SSM_CONV)
        writer.add_ssm_inner_size(SSM_INNER)
        writer.add_ssm_state_size(SSM_STATE)
        writer.add_ssm_time_step_rank(SSM_DT_RANK)
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
        writer.add_tensor(f"{blk}.attn_norm.weight", ones())
        if kind == "recurrent" or (kind == "hybrid" and i == 0):
            mamba_layer(blk)
        else:
            writer.add_tensor(f"{blk}.attn_q.weight", weight(N_HEAD * HEAD_DIM, N_EMBD))
            writer.add_tensor(f"{blk}.attn_k.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
            writer.add_tensor(f"{blk}.attn_v.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
            writer.add_tensor(f"{blk}.attn_output.weight", weight(N_EMBD, N_HEAD * HEAD_DIM))
        if kind == "swa":
            writer.add_tensor(f"{blk}.attn_q_norm.weight", ones(HEAD_DIM))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", ones(HEAD_DIM))
            writer.add_tensor(f"{blk}.post_attention_norm.weight", ones())
            writer.add_tensor(f"{blk}.post_ffw_norm.weight", ones())
        if kind != "recurrent":
            writer.add_tensor(f"{blk}.ffn_norm.weight", ones())
            writer.add_tensor(f"{blk}.ffn_gate.weight", weight(N_FF, N_EMBD))
            writer.add_tensor(f"{blk}.ffn_up.weight", weight(N_FF, N_EMBD))
            writer.add_tensor(f"{blk}.ffn_down.weight", weight(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", ones())
    writer.add_tensor("output.weight", weight(N_VOCAB, N_EMBD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
