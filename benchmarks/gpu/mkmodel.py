"""Write a random-weight llama-architecture GGUF (F16 weights) for timing llama-server.

    python3 mkmodel.py SHAPE PATH        # SHAPE: 8b-slice | 1b | tiny

The tokenizer is harness/tinymodel.py's: llama (SPM) with <unk>, <s>, </s>, the 256 byte
tokens and "▁", so every byte of a text without spaces is one token and a prompt's
token count is known from its length. Weights are one block of N(0, 0.02) values
tiled over every matrix, and every layer shares the same arrays: a 3.5 GB file is
written as fast as the disk takes it. Prints one JSON line describing the model.

Shapes (head dim = n_embd / n_head):
- 8b-slice: Llama-3-8B's layer (n_embd 4096, 32 heads, 8 KV heads, head dim 128, n_ff 14336),
  8 layers of its 32: prefill FLOPs per token and KV bytes per token both scale with
  the layer count, so their ratio is Llama-3-8B's.
- 1b: Llama-3.2-1B's shape (n_embd 2048, 16 layers, 32 heads, 8 KV heads, n_ff 8192),
  without its 128k vocabulary.
- tiny: for dry runs on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

SHAPES = {
    "8b-slice": dict(n_embd=4096, n_layer=8, n_head=32, n_head_kv=8, n_ff=14336),
    "1b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),
    "70b-slice": dict(n_embd=8192, n_layer=4, n_head=64, n_head_kv=8, n_ff=28672),
    "tiny": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=768),
    # KV-heavy, compute-light: 64 KB of KV a token (half of Llama-3-8B f16) at ~110M parameters, so a CPU
    # prefills 4K tokens in seconds while a state is 256 MB: the byte path weighs as it does on a GPU
    "wide": dict(n_embd=512, n_layer=32, n_head=8, n_head_kv=8, n_ff=1536),
}
N_CTX_TRAIN = 65536
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_VOCAB = 3 + 256 + 1
BLOCK = 4_194_301  # a prime: tiled rows do not line up with any row length


def describe(shape: str) -> dict:
    s = dict(SHAPES[shape])
    head_dim = s["n_embd"] // s["n_head"]
    per_layer = (
        s["n_embd"] * s["n_head"] * head_dim * 2  # q, o
        + s["n_embd"] * s["n_head_kv"] * head_dim * 2  # k, v
        + 3 * s["n_embd"] * s["n_ff"]  # gate, up, down
    )
    params = per_layer * s["n_layer"] + 2 * N_VOCAB * s["n_embd"]
    s.update(
        shape=shape,
        head_dim=head_dim,
        n_vocab=N_VOCAB,
        n_ctx_train=N_CTX_TRAIN,
        params=params,
        # K and V, F16, per token, every layer (llama.cpp's default cache type)
        kv_bytes_per_token=2 * s["n_layer"] * s["n_head_kv"] * head_dim * 2,
        # 2 FLOPs per weight per token (the matmuls), attention excluded
        matmul_flops_per_token=2 * per_layer * s["n_layer"],
    )
    return s


def write(shape: str, path: str, seed: int = 0) -> dict:
    import gguf
    import numpy as np

    d = describe(shape)
    n_embd, n_layer, n_head, n_head_kv, n_ff, head_dim = (
        d["n_embd"],
        d["n_layer"],
        d["n_head"],
        d["n_head_kv"],
        d["n_ff"],
        d["head_dim"],
    )
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(BLOCK, dtype=np.float32) * 0.02).astype(np.float16)

    def mat(rows: int, cols: int) -> np.ndarray:
        """rows outputs x cols inputs (numpy order), F16, the block tiled."""
        return np.resize(block, rows * cols).reshape(rows, cols)

    ones = np.ones(n_embd, dtype=np.float32)
    wq, wo = mat(n_head * head_dim, n_embd), mat(n_embd, n_head * head_dim)
    wk, wv = mat(n_head_kv * head_dim, n_embd), mat(n_head_kv * head_dim, n_embd)
    wgate, wup, wdown = mat(n_ff, n_embd), mat(n_ff, n_embd), mat(n_embd, n_ff)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL]
    )
    tmp = path + ".part"
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"sippcache-gpu-{shape}")
    writer.add_file_type(1)  # MOSTLY_F16
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(N_VOCAB)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * N_VOCAB)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)

    writer.add_tensor("token_embd.weight", mat(N_VOCAB, n_embd))
    for i in range(n_layer):
        b = f"blk.{i}"
        writer.add_tensor(f"{b}.attn_norm.weight", ones)
        writer.add_tensor(f"{b}.attn_q.weight", wq)
        writer.add_tensor(f"{b}.attn_k.weight", wk)
        writer.add_tensor(f"{b}.attn_v.weight", wv)
        writer.add_tensor(f"{b}.attn_output.weight", wo)
        writer.add_tensor(f"{b}.ffn_norm.weight", ones)
        writer.add_tensor(f"{b}.ffn_gate.weight", wgate)
        writer.add_tensor(f"{b}.ffn_up.weight", wup)
        writer.add_tensor(f"{b}.ffn_down.weight", wdown)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", mat(N_VOCAB, n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    d.update(path=path, file_bytes=os.path.getsize(path), write_s=round(time.perf_counter() - started, 2))
    return d


def ensure(shape: str, directory: str) -> dict:
    """The model file of `shape` in `directory`: the one an earlier step wrote there, else written now."""
    path = os.path.join(directory, f"sipp-{shape}.gguf")
    if os.path.exists(path) and os.path.getsize(path) > 0:
        d = describe(shape)
        d.update(path=path, file_bytes=os.path.getsize(path), write_s=0.0, reused=True)
        return d
    return write(shape, path)


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        print(f"usage: python3 mkmodel.py {{{'|'.join(SHAPES)}}} PATH", file=sys.stderr)
        return 2
    print(json.dumps(write(sys.argv[1], sys.argv[2])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
