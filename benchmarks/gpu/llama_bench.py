"""Restore a stored KV state vs recompute it, through sippcache's llama-cpp-python layer.

Run by run.sh's llama phase (after it built llama-cpp-python's llama.cpp with CUDA: the bindings load
it from $LLAMA_CPP_LIB_PATH); bounded by $DEADLINE (epoch seconds) like bench.py, each step skipped
with a note when too little time is left. Results go to $OUT/llama.json after every step.

Per shape (LLAMA_SHAPES, default the first of SHAPES; a KV cache type may follow a colon,
"8b-slice:q8_0") and prompt length N (LLAMA_NS), each step in a new process, as a restarted user
process would be, which first evaluates WARMUP tokens (CUDA's first kernels and cuBLAS handles: not
measured) and clears its context:

  cold     plain `llama_cpp.Llama.eval` of the prompt + 32 new tokens (the follow-up), twice: the
           second is the one compared;
  store    `PrefixCache.prefill` of the prompt into an LMDB store on disk, then `flush`: its seconds
           and the state's bytes; the rates it measured kept in a rates folder of this N's own;
  follow   per restore mode (LLAMA_MODES, default auto,always,auto: the first `auto` prices the
           restore from the saves alone, the last one from the restore `always` measured), from a
           copy of that store and with the rates kept so far, `PrefixCache.prefill` of the
           follow-up: its seconds (to the last token's logits), the tokens restored and evaluated,
           the restore's own seconds.

Compared: cold over follow (above 1: the cache made the follow-up faster). The restore's bytes a
second and the prefill's tokens a second say which way a GPU host leans.

    GPU=0 LLAMA_SHAPES=wide LLAMA_NS=1024,4096 PYTHONPATH=.gpu python .gpu/llama_bench.py   # a CPU dry run
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time

OUT = os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu-out")
DEADLINE = float(os.environ.get("DEADLINE") or time.time() + 540)
T0 = float(os.environ.get("T0") or time.time())
GPU = os.environ.get("GPU", "1") == "1"
SHAPES = [s for s in os.environ.get("LLAMA_SHAPES", os.environ.get("SHAPES", "8b-slice").split(",")[0]).split(",") if s]
NS = [int(n) for n in os.environ.get("LLAMA_NS", "8192,32768").split(",") if n]
MODES = [m for m in os.environ.get("LLAMA_MODES", "auto,always,auto").split(",") if m]
FLASH = os.environ.get("LLAMA_FLASH", "1") == "1"  # off: V is transposed in a state, and a chunked one is gathered
STORE_DIR = os.environ.get("STORE_DIR", "/tmp/sippstore")
SUFFIX = 32  # tokens the follow-up adds
WARMUP = int(os.environ.get("WARMUP", "512"))
N_BATCH, N_UBATCH = 2048, 512  # llama-server's defaults
BOS, FIRST_BYTE, LAST_BYTE = 1, 3, 258  # mkmodel.py's tokenizer: <s>, then the 256 byte tokens

RESULTS: dict = {
    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0)),
    "gpu": GPU,
    "flash_attn": FLASH,
    "lib_path": os.environ.get("LLAMA_CPP_LIB_PATH"),
    "suffix_tokens": SUFFIX,
    "modes": MODES,
    "shapes": {},
    "skipped": [],
    "errors": [],
}


def left() -> float:
    return DEADLINE - time.time()


def say(msg: str) -> None:
    print(f"[+{time.time() - T0:6.1f}s {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_results() -> None:
    RESULTS["elapsed_s"] = round(time.time() - T0, 1)
    path = os.path.join(OUT, "llama.json")
    with open(path + ".part", "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    os.replace(path + ".part", path)


def skip(what: str, need: float) -> bool:
    """True (and noted) when fewer than `need` seconds are left before the deadline."""
    if left() >= need:
        return False
    RESULTS["skipped"].append(f"{what}: skipped, {left():.0f} s left (needs ~{need:.0f} s)")
    say(RESULTS["skipped"][-1])
    save_results()
    return True


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of `n` tokens (BOS, then byte tokens), the same for the same seed."""
    rng = random.Random(seed)
    return [BOS] + [rng.randint(FIRST_BYTE, LAST_BYTE) for _ in range(n - 1)]


# -- one step, in a process of its own --------------------------------------------------------


def step(kind: str, model: str, kv: str, n: int, url: str, rates: str, mode: str) -> dict:
    """One step in this (new) process: `kind` is cold, store or follow; a JSON-able result."""
    import llama_cpp

    from sippcache.llama import PrefixCache

    settings: dict = {}
    if kv:  # ggml's type number of the KV cache type (q8_0: 8)
        kv_type = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")
        settings = {"type_k": kv_type, "type_v": kv_type}
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=n + SUFFIX + 64,
        n_batch=N_BATCH,
        n_ubatch=N_UBATCH,
        n_gpu_layers=-1 if GPU else 0,
        flash_attn=FLASH,
        verbose=False,
        **settings,
    )
    loaded = time.perf_counter() - started
    prompt = tokens(n, n)
    follow = prompt + tokens(SUFFIX + 1, n + 1)[1:]
    llm.eval(tokens(WARMUP, 7))  # not measured
    clear(llm)
    out: dict = {"load_s": round(loaded, 3)}
    if kind == "cold":
        for i in (1, 2):
            began = time.perf_counter()
            llm.eval(follow)
            out[f"cold{i}_s"] = time.perf_counter() - began
            clear(llm)
        return out
    with PrefixCache(llm, url, restore=mode or "always", rates_dir=rates) as cache:
        if kind == "store":
            began = time.perf_counter()
            result = cache.prefill(prompt)
            out["prefill_s"] = time.perf_counter() - began
            began = time.perf_counter()
            cache.flush()
            out["flush_s"] = time.perf_counter() - began
            out["state_bytes"] = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
        else:
            began = time.perf_counter()
            result = cache.prefill(follow)
            out["follow_s"] = time.perf_counter() - began
            out["restore_s"] = result.restore_seconds
        out.update(restored=result.restored, evaluated=result.evaluated)
        out["stats"] = {k: v for k, v in cache.stats().items() if isinstance(v, (int, float))}
    return out


def clear(llm: object) -> None:
    """An empty context again: no tokens, no KV cells."""
    import llama_cpp

    llm.reset()  # type: ignore[attr-defined]
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)  # type: ignore[attr-defined]


def run_step(kind: str, model: str, kv: str, n: int, url: str = "", rates: str = "", mode: str = "") -> dict:
    """`step` in a new process (bounded by the deadline); its result, or {"error": ...}."""
    argv = [sys.executable, __file__, "--step", json.dumps([kind, model, kv, n, url, rates, mode])]
    began = time.time()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=max(10.0, left() - 5))
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"rc {done.returncode}: {done.stderr.strip()[-1500:]}"}
    result = json.loads(lines[-1])
    result["process_s"] = round(time.time() - began, 2)
    return result


# -- the phase --------------------------------------------------------------------------------


def make_model(shape: str) -> dict | None:
    import mkmodel  # beside this script, which Python puts first on sys.path

    if skip(f"{shape}: model", 15 + mkmodel.describe(shape)["params"] * 2 / 0.5e9):
        return None
    return mkmodel.ensure(shape, os.environ.get("MODEL_DIR", "/dev/shm"))


def brief(result: dict) -> dict:
    """A step's result without its counters, for the log."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k != "stats"}


def one_length(shape: str, model: dict, kv: str, n: int) -> dict:
    """Every step for prompts of `n` tokens."""
    res: dict = {}
    base = f"{STORE_DIR}-llama-{shape.replace(':', '-')}-{n}"
    store, rates = base + "-store", base + "-rates"
    for path in (store, rates):
        shutil.rmtree(path, ignore_errors=True)
    res["cold"] = run_step("cold", model["path"], kv, n)
    say(f"{shape} N={n}: cold {brief(res['cold'])}")
    res["store"] = run_step("store", model["path"], kv, n, f"lmdb://{store}", rates, "always")
    say(f"{shape} N={n}: store {brief(res['store'])}")
    if "error" in res["cold"] or "error" in res["store"]:
        return res
    cold = res["cold"]["cold2_s"]
    for i, mode in enumerate(MODES):
        if skip(f"{shape} N={n} follow {mode}", 20 + 3 * cold):
            break
        copy = f"{base}-copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(store, copy)  # each follow-up from the same store: a follow-up stores its own state
        try:
            follow = run_step("follow", model["path"], kv, n, f"lmdb://{copy}", rates, mode)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        if "follow_s" in follow:
            follow["cold_over_follow"] = round(cold / follow["follow_s"], 2)
            if follow.get("restored") and follow.get("restore_s"):
                follow["restore_gb_per_s"] = round(res["store"]["state_bytes"] / follow["restore_s"] / 1e9, 2)
        res[f"follow{i + 1}_{mode}"] = follow
        say(f"{shape} N={n}: follow-up, {mode}: {brief(follow)}")
        save_results()
    res["prefill_tokens_per_s"] = round((n + SUFFIX) / cold)
    if os.environ.get("KEEP") != "1":
        for path in (store, rates):
            shutil.rmtree(path, ignore_errors=True)
    return res


def summary() -> None:
    lines = ["", "=== llama-cpp-python layer: cold follow-up vs a restarted process's, from the store ==="]
    for shape, res in RESULTS["shapes"].items():
        model = res.get("model", {})
        flash = "on" if FLASH else "off"
        lines.append(f"{shape}: KV {model.get('kv_bytes_per_token')} B/token, flash attention {flash}")
        for n, r in res.get("runs", {}).items():
            cold, store, nan = r.get("cold", {}), r.get("store", {}), float("nan")
            failed = cold.get("error") or store.get("error")
            lines.append(
                f"  N={n}: cold {cold.get('cold2_s', nan) * 1e3:.1f} ms "
                f"({r.get('prefill_tokens_per_s')} tokens/s), state {store.get('state_bytes', 0) / 1e6:.1f} MB; "
                f"store step: prefill {store.get('prefill_s', nan):.3f} s, flush {store.get('flush_s', nan):.3f} s"
                + (f" ERROR {failed[:300]}" if failed else "")
            )
            for key, f in r.items():
                if key.startswith("follow"):
                    lines.append(
                        f"    {key}: {f.get('follow_s', float('nan')) * 1e3:.1f} ms (restored {f.get('restored')}, "
                        f"evaluated {f.get('evaluated')}, restore {f.get('restore_s', 0) * 1e3:.1f} ms, "
                        f"{f.get('restore_gb_per_s')} GB/s): x{f.get('cold_over_follow')} vs cold"
                        + (f" ERROR {f['error'][:200]}" if "error" in f else "")
                    )
    for note in RESULTS["skipped"] + RESULTS["errors"]:
        lines.append(note)
    print("\n".join(lines), flush=True)


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    save_results()
    say(f"llama bench: shapes {SHAPES}, N {NS}, modes {MODES}, {left():.0f} s left")
    try:
        for shape in SHAPES:
            base, _, kv = shape.partition(":")
            model = make_model(base)
            if model is None:
                continue
            res = RESULTS["shapes"].setdefault(shape, {"model": model, "runs": {}})
            for n in NS:
                if skip(f"{shape} N={n}", 60):
                    break
                try:
                    res["runs"][n] = one_length(shape, model, kv, n)
                except Exception as exc:
                    RESULTS["errors"].append(f"{shape} N={n}: {type(exc).__name__}: {exc}")
                save_results()
            if os.environ.get("KEEP") != "1":
                os.unlink(model["path"])
    finally:
        save_results()
        summary()
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--step":
        print(json.dumps(step(*json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    sys.exit(main())
