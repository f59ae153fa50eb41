"""How a store grows: whole states against chunked ones (`sippcache.state.chunks`), through the proxy
(the default) or the llama-cpp-python layer (``--path dropin``: `sippcache.llama.Llama` with a
bound `LlamaCache`; ``--path pool``: a one-slot `SessionPool`; both on LMDB, the same
conversations as token lists, `run_llama`; ``--path serve``: ``sippcache serve --parallel 2``
over HTTP, the same conversations as text, `run_serve`).

N conversations (default 4) over one shared system prompt of about 1,200 tokens,
T turns each (default 5, short greedy answers), taken in turn (conversation 1's
first turn, conversation 2's first turn, ...: every turn finds its slot holding
another conversation and restores its own), through `sippcache proxy` in front
of a real llama-server it manages (one slot). Run once per setting, in one
process: whole states (``--chunk-tokens 0``) and chunked (``--chunk-tokens C``,
each C given). Every answer's state is saved as soon as its slot is free
(``--save-idle 0``): the worst case for bytes written (without it a conversation
that keeps its slot is saved once).

Reported, per setting: bytes written (the proxy's own
``sippcache_proxy_stored_bytes_total``; the other paths' ``bytes_written``), bytes in the store at the end
(``sippcache.open(url).stats()``: blobs and 4 bytes a key token), its entries,
the prompt tokens llama-server reused (``timings.cache_n``), and each against U:
the KV bytes of one token (read from a stored state with `sippcache.state`)
times the distinct tokens of all the conversations (a trie over each one's last
prompt, plus its last answer), and each turn's time to first token. The answers of every run
must be the same.

Goals (the chunked settings): bytes written at most 2 U and the store at most 1.3 U, where U
counts the caches that hold every position (full attention, and an iSWA model's sliding-window
cache where it is full-size: llama.cpp's default in llama-cpp-python, llama-server's
--swa-full; both are chunked). Where the window cache holds only the window (llama-server
without --swa-full), every tail holds it whole: there the goal is less than whole states',
written and kept, and both are reported against the window's floor (U plus a window per state
saved, or per conversation kept). Time to first token (each request streamed), turn by turn
against whole states' same turn: the median ratio at most 1.10, and the turns after the first
(which computes the system prompt cold in every setting) at most 1.05 in all (the machine's
noise; the goal is "no worse"). Answers may part from whole states' only at a
near-tie (the same tokens computed in other batches differ in their last bits: docs/proxy.md,
"Chunked states"). Exit code 1 if one is missed:

    python -m benchmarks.store_growth [--path proxy|dropin|pool|serve] [--model smollm2|tiny|gemma]
        [--chunk-tokens 64[,128,...]] [--conversations 4] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import sippcache
from harness.proxy_tools import ProxyServer, llama_server_binary, metric, settle
from sippcache import frame
from sippcache import state as sf
from sippcache.state import chunkentries, chunks

WRITTEN_GOAL, KEPT_GOAL = 2.0, 1.3
#: Time to first token against whole states', turn by turn: "no worse", up to the machine's noise.
TTFT_MEDIAN_GOAL, TTFT_SUM_GOAL = 1.10, 1.05
#: Answers may part from the baseline's only where its top-2 logprob margin was at most this (as
#: benchmarks/proxy.py): the same tokens computed in other batches differ in their last bits.
NEAR_TIE = 1.0
_WORD_TEXT = (
    "harbour lantern tide keeper north gale vessel flag hour weather sea swell cape beacon watch log schooner "
    "brig ketch cutter steamer ferry trawler frigate sloop barque yawl dory pilot reef shoal buoy mast rigging "
    "anchor chart compass fog signal horn current ebb flood squall"
)
_WORDS = _WORD_TEXT.split()
QUESTIONS = [
    "Which ship passed first today?",
    "What flag did she fly?",
    "At what hour was that?",
    "How was the sea then?",
    "Did the fog lift after?",
    "Which one came next?",
    "Was the beacon lit?",
]


def text(words: int, seed: int = 1) -> str:
    """A deterministic text of `words` words."""
    out, x = [], seed * 7919 + 1
    for i in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(_WORDS[x % len(_WORDS)] + ("." if i % 13 == 12 else ""))
    return " ".join(out)


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def post_streamed(url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """A streamed completion (chat or plain), put back together as the plain answer (its text,
    logprobs and timings), and the seconds to its first token (to the first chunk with text)."""
    request = urllib.request.Request(
        url + path, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    started, first = time.perf_counter(), None
    text_, steps, timings = [], [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            timings = event.get("timings") or timings
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                if piece:
                    first = time.perf_counter() if first is None else first
                    text_.append(piece)
                steps += (choice.get("logprobs") or {}).get("content") or []
    answer = "".join(text_)
    data = {"choices": [{"message": {"content": answer}, "text": answer, "logprobs": {"content": steps}}]}
    data["timings"] = timings
    return data, (first if first is not None else time.perf_counter()) - started


def prompt_tokens(url: str, messages: list[dict[str, str]]) -> list[int]:
    """The tokens llama-server makes of a chat request (its template and tokenizer, as the proxy asks)."""
    prompt = post(url, "/apply-template", {"messages": messages})["prompt"]
    body = {"content": prompt, "add_special": True, "parse_special": True}
    return [int(t) for t in post(url, "/tokenize", body)["tokens"]]


def top_two(data: dict[str, Any]) -> list[tuple[str, float]]:
    """Each generated token and its logprob margin over the runner-up."""
    content = ((data["choices"][0].get("logprobs") or {}).get("content")) or []
    out = []
    for step in content:
        top = sorted((float(t["logprob"]) for t in step.get("top_logprobs") or []), reverse=True)
        out.append((str(step.get("token")), top[0] - top[1] if len(top) > 1 else float("inf")))
    return out


def parting(ours: list[tuple[str, float]], base: list[tuple[str, float]]) -> float | None:
    """Where two answers part: the baseline's margin at the first token that differs (None: the same)."""
    for (token, _), (expected, margin) in zip(ours, base, strict=False):
        if token != expected:
            return margin
    return None if len(ours) == len(base) else 0.0


def trie_size(sequences: list[list[int]]) -> int:
    """Distinct prefixes (positions) over `sequences`: the tokens a store holding all of them needs."""
    root: dict[int, Any] = {}
    count = 0
    for sequence in sequences:
        node = root
        for token in sequence:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


@dataclass
class Run:
    chunk_tokens: int
    written: float
    kept: int
    entries: int
    saves: float
    stored_whole: float
    reused: int
    computed: int
    seconds: float
    answers: list[str]
    #: Per answer, per generated token: (the token, its margin over the runner-up in logprob).
    steps: list[list[tuple[str, float]]]
    #: Seconds to the first token of each answer, in order (the request streamed).
    ttft: list[float]
    per_turn: list[tuple[int, int]]  # (cache_n, prompt_n) of each answer, in order
    distinct: int
    kv_per_token: int
    #: Bytes of the sliding-window cache every stored state holds whole (iSWA; 0: full attention).
    window: int


def model_path(name: str, folder: Path) -> tuple[Path, dict[str, Any]]:
    """The model file, and the request options its answers need."""
    if name == "tiny":
        from harness.tinymodel import write_tiny_model

        # Letters only: the byte-level vocabulary tokenizes them back as generated.
        return write_tiny_model(folder / "tiny.gguf", n_ctx_train=16384), {"grammar": "root ::= [a-z ]+"}
    if name == "smollm2":
        from sippcache.demo.model import smollm2_model_path

        return smollm2_model_path(), {}
    from sippcache.demo.model import gemma_model_path

    return gemma_model_path(), {}


def system_prompt(count: Callable[[str], int], target: int) -> str:
    """A system prompt of about `target` tokens, as `count` counts a text's (each path tokenizes
    its own way: llama-server's chat template, the model's tokenizer with a BOS)."""
    words = target
    for _ in range(6):
        system = "You are the keeper's archivist. Answer in one short sentence. The log so far: " + text(words)
        n = count(system)
        if abs(n - target) <= 20:
            break
        words = max(10, int(words * target / n))
    return system


def run(
    model: Path, options: dict[str, Any], folder: Path, chunk_tokens: int, conversations: int, turns: int, target: int
) -> Run:
    url = f"lmdb://{folder}/store-{chunk_tokens}"
    args = [
        "--llama-server",
        str(llama_server_binary()),
        "--model",
        str(model),
        "--cache",
        url,
        "--restore",
        "always",
        "--save-idle",
        "0",
        "--chunk-tokens",
        str(chunk_tokens),
        "--",
        "-c",
        "8192",
    ]
    proxy = ProxyServer(args, folder / f"proxy-{chunk_tokens}.log").wait_ready()
    try:
        system = system_prompt(
            lambda text_: len(prompt_tokens(proxy.url, [{"role": "system", "content": text_}])), target
        )
        chats = [[{"role": "system", "content": system}] for _ in range(conversations)]
        answers: list[str] = []
        finals: list[list[int]] = []
        last_generated = [0] * conversations
        reused = computed = 0
        per_turn: list[tuple[int, int]] = []
        steps: list[list[tuple[str, float]]] = []
        ttft: list[float] = []
        started = time.perf_counter()
        for turn in range(turns):
            for c in range(conversations):
                question = f"Conversation {c + 1}. {QUESTIONS[(turn + c) % len(QUESTIONS)]}"
                chats[c].append({"role": "user", "content": question})
                body = {"messages": chats[c], "temperature": 0, "max_tokens": 16, **options}
                data, first = post_streamed(
                    proxy.url, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2}
                )
                ttft.append(first)
                answer = str(data["choices"][0]["message"]["content"] or "")
                steps.append(top_two(data))
                timings = data.get("timings") or {}
                reused += int(timings.get("cache_n", 0))
                computed += int(timings.get("prompt_n", 0))
                per_turn.append((int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))))
                last_generated[c] = int(timings.get("predicted_n", 0))
                answers.append(answer)
                chats[c].append({"role": "assistant", "content": answer})
        seconds = time.perf_counter() - started
        for c in range(conversations):  # each one's last prompt (its answer is counted apart)
            finals.append(prompt_tokens(proxy.url, chats[c][:-1]))
        distinct = trie_size(finals) + sum(last_generated)
        settle(proxy)
        written = metric(proxy, "sippcache_proxy_stored_bytes_total")
        saves = metric(proxy, "sippcache_proxy_saves_total")
        whole = metric(proxy, "sippcache_proxy_states_stored_whole")
        with sippcache.open(url) as store:
            stats = store.stats()
            kv, window = kv_per_token(store)
    finally:
        proxy.stop()
    return Run(
        chunk_tokens,
        written,
        stats.bytes,
        stats.entries,
        saves,
        whole,
        reused,
        computed,
        seconds,
        answers,
        steps,
        ttft,
        per_turn,
        distinct,
        kv,
        window,
    )


def run_llama(
    path: str, model: Path, folder: Path, chunk_tokens: int, conversations: int, turns: int, target: int
) -> Run:
    """The same conversations through the llama-cpp-python layer, on LMDB, as token lists (a plain
    "User:/Assistant:" layout; each turn extends the last prompt with its answer's tokens):
    ``dropin``, `sippcache.llama.Llama` with a bound `LlamaCache` (llama-cpp-python's own
    `create_completion`); ``pool``, a one-slot `SessionPool` (every turn parks the conversation
    before, as a server with more conversations than slots does)."""
    from sippcache.llama import Llama, LlamaCache, SessionPool

    url = f"lmdb://{folder}/{path}-{chunk_tokens}"
    llm = Llama(model_path=str(model), n_ctx=8192, n_batch=512, verbose=False)
    settings: dict[str, Any] = {"chunk_tokens": chunk_tokens, "restore": "always"}

    def tokens_of(text_: str, bos: bool = False) -> list[int]:
        return [int(t) for t in llm.tokenize(text_.encode(), add_bos=bos, special=False)]

    system = tokens_of(system_prompt(lambda text_: len(tokens_of(text_, True)), target), True)
    chats = [list(system) for _ in range(conversations)]
    pool: SessionPool | None = None
    cache: LlamaCache | None = None
    if path == "dropin":
        cache = LlamaCache(url, **settings)
        llm.set_cache(cache)
    else:
        pool = SessionPool(llm, url, slots=1, **settings)
    answers: list[str] = []
    ttft: list[float] = []
    last_answer = [0] * conversations
    started = time.perf_counter()
    try:
        for turn in range(turns):
            for c in range(conversations):
                question = f"\nUser: Conversation {c + 1}. {QUESTIONS[(turn + c) % len(QUESTIONS)]}\nAssistant:"
                chats[c] += tokens_of(question)
                asked, first = time.perf_counter(), None
                if pool is not None:
                    generated = []
                    for _, token in pool.stream({c: chats[c]}, max_tokens=16):
                        first = time.perf_counter() if first is None else first
                        generated.append(token)
                else:
                    pieces = []
                    for event in llm.create_completion(chats[c], max_tokens=16, temperature=0.0, stream=True):
                        first = time.perf_counter() if first is None else first
                        pieces.append(str(event["choices"][0]["text"]))
                    generated = tokens_of("".join(pieces))
                ttft.append((first if first is not None else time.perf_counter()) - asked)
                answers.append(llm.detokenize(generated).decode(errors="replace"))
                last_answer[c] = len(generated)
                chats[c] += generated
        seconds = time.perf_counter() - started
        if pool is not None:
            pool.close()  # parks the live conversation: stored, as at a server's shutdown
            stats = pool.stats()
        else:
            assert cache is not None
            prefix = cache.prefix_cache(llm)
            prefix.flush()
            stats = prefix.stats()
            cache.close()
    finally:
        llm.close()
    finals = [chat[: len(chat) - n] for chat, n in zip(chats, last_answer, strict=True)]
    return llama_layer_run(url, chunk_tokens, stats, seconds, answers, ttft, trie_size(finals) + sum(last_answer))


def run_serve(model: Path, folder: Path, chunk_tokens: int, conversations: int, turns: int, target: int) -> Run:
    """The same conversations through `sippcache serve --parallel 2` (``--save_idle 0``: every slot
    stored as soon as no request runs; with more conversations than slots, each turn finds its slot
    holding another), on LMDB, over HTTP: the completions endpoint, the prompts as text in the
    layout of `run_llama`, streamed."""
    from llama_cpp import Llama as Tokenizer

    from harness.servers import Server

    url = f"lmdb://{folder}/serve-{chunk_tokens}"
    vocab = Tokenizer(model_path=str(model), vocab_only=True, verbose=False)

    def tokens_of(text_: str, bos: bool = False) -> list[int]:
        return [int(t) for t in vocab.tokenize(text_.encode(), add_bos=bos, special=False)]

    system = system_prompt(lambda text_: len(tokens_of(text_, True)), target)
    args = ["--model", str(model), "--model_alias", "m", "--cache", url, "--n_ctx", "4096", "--parallel", "2"]
    args += ["--save_idle", "0", "--chunk_tokens", str(chunk_tokens)]
    server = Server(args, folder / f"serve-{chunk_tokens}.log").wait_ready()
    chats = [system for _ in range(conversations)]
    answers: list[str] = []
    ttft: list[float] = []
    last_answer = [0] * conversations
    started = time.perf_counter()
    try:
        for turn in range(turns):
            for c in range(conversations):
                chats[c] += f"\nUser: Conversation {c + 1}. {QUESTIONS[(turn + c) % len(QUESTIONS)]}\nAssistant:"
                body = {"model": "m", "prompt": chats[c], "max_tokens": 16, "temperature": 0}
                data, first = post_streamed(server.url, "/v1/completions", body)
                ttft.append(first)
                answer = str(data["choices"][0]["text"])
                answers.append(answer)
                last_answer[c] = len(tokens_of(answer))
                chats[c] += answer
        seconds = time.perf_counter() - started
        server.settle()
        stats = server.model_stats()
    finally:
        server.stop()
    finals = [tokens_of(chat, True) for chat in chats]
    finals = [tokens[: len(tokens) - n] for tokens, n in zip(finals, last_answer, strict=True)]
    return llama_layer_run(url, chunk_tokens, stats, seconds, answers, ttft, trie_size(finals) + sum(last_answer))


def llama_layer_run(
    url: str,
    chunk_tokens: int,
    stats: dict[str, Any],
    seconds: float,
    answers: list[str],
    ttft: list[float],
    distinct: int,
) -> Run:
    """A `Run` of the llama-cpp-python layer (drop-in, pool, server): from its counters (`PrefixStats`'
    names) and the store at `url` as the run left it (no logprobs, no llama-server timings)."""
    with sippcache.open(url) as store:
        kept = store.stats()
        kv, window = kv_per_token(store)
    return Run(
        chunk_tokens,
        float(stats["bytes_written"]),
        kept.bytes,
        kept.entries,
        float(stats["entries_written"]),
        0.0,
        int(stats["tokens_reused"]) + int(stats["context_tokens_reused"]),
        int(stats["tokens_evaluated"]),
        seconds,
        answers,
        [],
        ttft,
        [],
        distinct,
        kv,
        window,
    )


def kv_per_token(store: sippcache.CacheBackend) -> tuple[int, int]:
    """The KV bytes of one token, read from the longest stored state (whole entry or tail): what every
    layer of its caches that hold every position holds for one cell; and the bytes of a
    sliding-window cache that holds only its window, which every state then holds whole (0 for full
    attention, and for a full-size window cache)."""
    best = max(
        (e for e in store.entries() if not chunkentries.is_chunk_namespace(e.namespace)),
        key=lambda e: len(e.key),
        default=None,
    )
    if best is None:
        return 0, 0
    match = store.lookup(best.key, namespace=best.namespace, touch=False)
    assert match is not None
    with match:
        entry = frame.decode(match.blob)
        if entry.kind.endswith(chunkentries.TAIL_SUFFIX):
            cells, unchunked = entry.section("cells"), entry.section("caches")
            size = int(entry.meta["chunk_tokens"])
            tail = len(entry.tokens) - (len(entry.tokens) - 1) // size * size
            assert cells is not None
            return len(cells) // tail, len(unchunked or b"")
        state = sf.parse(entry.sections[0], header=True)
        per_token = max(1, sf.chunkable_caches(state))  # the caches holding every position (what chunks hold)
        held = [cache.active() for cache in state.caches]
        per_cell = [sum(layer.bytes_per_cell for layer in c[1].layers) if c else 0 for c in held]
        window = sum(c[1].n_cells * size for c, size in zip(held[per_token:], per_cell[per_token:], strict=True) if c)
        return sum(per_cell[:per_token]), window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny", "gemma"], default="smollm2")
    parser.add_argument("--path", choices=["proxy", "dropin", "pool", "serve"], default="proxy", help="which way in")
    parser.add_argument("--chunk-tokens", default=str(chunks.DEFAULT_CHUNK_TOKENS), help="chunk sizes, comma-separated")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=1200)
    args = parser.parse_args()
    sizes = [int(s) for s in args.chunk_tokens.split(",") if int(s) > 0]
    with tempfile.TemporaryDirectory(prefix="store-growth-") as tmp:
        folder = Path(tmp)
        model, options = model_path(args.model, folder)
        if args.path == "proxy":
            runs = [
                run(model, options, folder, size, args.conversations, args.turns, args.system_tokens)
                for size in [0, *sizes]
            ]
        elif args.path == "serve":
            runs = [
                run_serve(model, folder, size, args.conversations, args.turns, args.system_tokens)
                for size in [0, *sizes]
            ]
        else:
            runs = [
                run_llama(args.path, model, folder, size, args.conversations, args.turns, args.system_tokens)
                for size in [0, *sizes]
            ]
    base = runs[0]
    u = base.distinct * base.kv_per_token
    how = {
        "proxy": "one slot, --save-idle 0 (every answer saved)",
        "serve": "two slots (--parallel 2), --save_idle 0 (every slot saved once idle)",
    }.get(args.path, "one slot, saves: what the path stores")
    print(
        f"{args.path}, model {args.model}: {args.conversations} conversations x {args.turns} turns, taken in turn, "
        f"{how}; {base.distinct:,} distinct tokens x {base.kv_per_token:,} KV bytes a token = "
        f"U {u / 1e6:.2f} MB"
    )
    header = (
        f"{'setting':<16}{'written':>12}{'/ U':>7}{'kept':>12}{'/ U':>7}{'entries':>9}{'saves':>7}"
        f"{'whole':>7}{'reused':>9}{'computed':>10}{'seconds':>9}"
    )
    print(header)
    failed = False
    for r in runs:
        name = "whole states" if not r.chunk_tokens else f"chunks of {r.chunk_tokens}"
        print(
            f"{name:<16}{r.written / 1e6:>10.2f}MB{r.written / u:>7.2f}{r.kept / 1e6:>10.2f}MB{r.kept / u:>7.2f}"
            f"{r.entries:>9}{r.saves:>7.0f}{r.stored_whole:>7.0f}{r.reused:>9}{r.computed:>10}{r.seconds:>9.1f}"
        )
        for i, (a, b) in enumerate(zip(r.answers, base.answers, strict=True)):
            if a == b:
                continue
            if not r.steps:  # the llama-cpp-python paths: no logprobs to judge a near-tie by
                failed = True
                print(f"  FAIL: answer {i} parts from whole states': {a!r} against {b!r}")
                continue
            margin = parting(r.steps[i], base.steps[i])
            near = margin is not None and margin <= NEAR_TIE
            failed |= not near
            print(
                f"  {'near-tie' if near else 'FAIL'}: answer {i} parts from whole states' where its top-2 margin was "
                f"{margin if margin is None else round(margin, 3)}: {a!r} against {b!r} "
                f"(cache_n, prompt_n: {r.per_turn[i]} against {base.per_turn[i]})"
            )
    if base.window:
        print(
            f"sliding window: every stored state holds the window's cache whole ({base.window / 1e6:.2f} MB), so "
            "the floor of bytes written is U + a window per state saved, of bytes kept U + a window per conversation"
        )
        for r in runs:
            name = "whole states" if not r.chunk_tokens else f"chunks of {r.chunk_tokens}"
            written_floor = u + r.saves * base.window
            kept_floor = u + args.conversations * base.window
            print(
                f"  {name:<16} written {r.written / written_floor:.2f} x its floor ({written_floor / 1e6:.1f} MB), "
                f"kept {r.kept / kept_floor:.2f} x its floor ({kept_floor / 1e6:.1f} MB)"
            )
    print(
        "time to first token, each turn against whole states' same turn (turn: conversation 1's first, "
        "conversation 2's first, ...)"
    )
    for r in runs:
        name = "whole states" if not r.chunk_tokens else f"chunks of {r.chunk_tokens}"
        line = f"  {name:<16} median {median(r.ttft) * 1000:7.1f} ms, sum {sum(r.ttft):6.2f} s"
        if r is not base:
            ratios = [ours / theirs for ours, theirs in zip(r.ttft, base.ttft, strict=True)]
            worst = max(range(len(ratios)), key=ratios.__getitem__)
            line += (
                f"; per turn / whole: median {median(ratios):.2f}, worst {ratios[worst]:.2f} (turn {worst + 1}: "
                f"{r.ttft[worst] * 1000:.1f} ms against {base.ttft[worst] * 1000:.1f} ms); "
                f"sum {sum(r.ttft) / sum(base.ttft):.2f}"
            )
        print(line)
        print(f"    each turn, ms: {' '.join(f'{t * 1000:.0f}' for t in r.ttft)}")
        if r is not base:
            # The sum leaves out the first turn: it computes the system prompt cold in every setting.
            later = sum(r.ttft[1:]) / sum(base.ttft[1:])
            ok = median(ratios) <= TTFT_MEDIAN_GOAL and later <= TTFT_SUM_GOAL
            failed |= not ok
            print(
                f"{'PASS' if ok else 'FAIL'}: {name}: time to first token per turn / whole states' median "
                f"{median(ratios):.2f} (goal <= {TTFT_MEDIAN_GOAL}), the turns after the first in all {later:.2f} "
                f"(goal <= {TTFT_SUM_GOAL})"
            )
    for r in runs[1:]:
        name = f"chunks of {r.chunk_tokens}"
        for what, value, goal, whole in (
            ("written", r.written, WRITTEN_GOAL, base.written),
            ("kept", r.kept, KEPT_GOAL, base.kept),
        ):
            if base.window:  # iSWA with a window-only cache: every tail holds the window, which is not per token
                ok = value < whole
                print(f"{'PASS' if ok else 'FAIL'}: {name}: {what} {value / whole:.2f} x whole states' (goal < 1)")
            else:
                ok = value <= goal * u
                print(f"{'PASS' if ok else 'FAIL'}: {name}: {what} {value / u:.2f} U (goal <= {goal} U)")
            failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
