"""`sippcache serve` and llama-cpp-python's server: the coupling point, settings, the
command line, start-up failures. Fast: no gemma here (the tiny generated model
where a model is needed).

`test_upstream_symbols_are_where_serve_expects_them` is the tripwire: if a
llama-cpp-python upgrade moves anything `sippcache.server` relies on, it fails
and says which symbol.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from sippcache.server.model import ARCHITECTURE_CHAT_FORMATS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).with_name("sippcache")


def test_upstream_symbols_are_where_serve_expects_them() -> None:
    import llama_cpp.server.app as app
    import llama_cpp.server.cli as cli
    import llama_cpp.server.model as model
    import llama_cpp.server.settings as settings

    def need(condition: bool, symbol: str, why: str) -> None:
        assert condition, (
            f"llama-cpp-python {llama_cpp.__version__} moved {symbol}: sippcache.server relies on it ({why})"
        )

    need(callable(getattr(app, "create_app", None)), "llama_cpp.server.app.create_app", "it builds the app")
    parameters = inspect.signature(app.create_app).parameters if hasattr(app, "create_app") else {}
    need(
        {"server_settings", "model_settings"} <= set(parameters),
        "create_app(server_settings=, model_settings=)",
        "serve passes the parsed settings",
    )
    need(
        getattr(app, "LlamaProxy", None) is model.LlamaProxy or getattr(app, "LlamaProxy", None) is not None,
        "llama_cpp.server.app.LlamaProxy",
        "install() replaces this module global, which create_app instantiates",
    )
    need(
        "LlamaProxy(models=" in inspect.getsource(app.set_llama_proxy),
        "llama_cpp.server.app.set_llama_proxy",
        "it must build the proxy by the module-global name LlamaProxy",
    )
    need(hasattr(app, "_llama_proxy"), "llama_cpp.server.app._llama_proxy", "the proxy the endpoints use")
    need(
        callable(getattr(app, "authenticate", None)),
        "llama_cpp.server.app.authenticate",
        "the API key check on /metrics",
    )
    loader = inspect.getattr_static(model.LlamaProxy, "load_llama_from_model_settings", None)
    need(
        isinstance(loader, staticmethod),
        "LlamaProxy.load_llama_from_model_settings (a staticmethod)",
        "CachingLlamaProxy overrides it",
    )
    source = inspect.getsource(model.LlamaProxy)
    need(
        source.count("self.load_llama_from_model_settings(") >= 2,
        "LlamaProxy.__init__/__call__",
        "they must load models through self.load_llama_from_model_settings",
    )
    need(
        "settings.cache" in inspect.getsource(model.LlamaProxy.load_llama_from_model_settings),
        "ModelSettings.cache in the loader",
        "serve turns upstream's cache off with cache=False",
    )
    need(
        callable(getattr(cli, "add_args_from_model", None)) and callable(getattr(cli, "parse_model_from_args", None)),
        "llama_cpp.server.cli.add_args_from_model/parse_model_from_args",
        "serve parses arguments with them",
    )
    for name in ("Settings", "ServerSettings", "ModelSettings", "ConfigFileSettings"):
        need(hasattr(settings, name), f"llama_cpp.server.settings.{name}", "serve parses settings with it")
    from sippcache.server.settings import STATE_SETTINGS, UPSTREAM_CACHE_SETTINGS

    fields = settings.ModelSettings.model_fields
    for name in ("model", "model_alias", "vocab_only", *UPSTREAM_CACHE_SETTINGS, *STATE_SETTINGS):
        need(name in fields, f"ModelSettings.{name}", "serve reads it")
    need("models" in settings.ConfigFileSettings.model_fields, "ConfigFileSettings.models", "config files list models")
    for name in ("host", "port", "ssl_keyfile", "ssl_certfile"):
        need(name in settings.ServerSettings.model_fields, f"ServerSettings.{name}", "serve passes it to uvicorn")
    need(
        "self._chat_handlers.get(self.chat_format)" in inspect.getsource(llama_cpp.Llama.create_chat_completion),
        "Llama._chat_handlers, read by create_chat_completion",
        "serve gives a model sippcache's own chat formats there (sippcache.server.model.CHAT_HANDLERS)",
    )


def test_upstream_loader_returns_a_plain_llama_and_makes_a_cache_only_when_asked(tiny_model: Path) -> None:
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings

    plain = LlamaProxy.load_llama_from_model_settings(ModelSettings(model=str(tiny_model), n_ctx=512, verbose=False))
    try:
        assert type(plain) is llama_cpp.Llama  # what ServedLlama's __class__ swap requires
        assert plain.cache is None
    finally:
        plain.close()
    cached = LlamaProxy.load_llama_from_model_settings(
        ModelSettings(model=str(tiny_model), n_ctx=512, verbose=False, cache=True)
    )
    try:  # why CachingLlamaProxy passes cache=False
        assert isinstance(cached.cache, llama_cpp.LlamaRAMCache)
    finally:
        cached.close()


def test_the_app_uses_the_caching_proxy_and_every_model_gets_its_cache(tiny_model: Path, tmp_path: Path) -> None:
    """In process, on the tiny model: create_app builds our proxy; completions use sippcache;
    swapping aliases frees one model (its writes flushed, its counts kept) and loads the other."""
    import llama_cpp.server.app as app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from sippcache.llama import LlamaCache
    from sippcache.server.app import create_server_app
    from sippcache.server.model import ServedLlama
    from sippcache.server.settings import ModelOptions, Settings
    from sippcache.server.stores import CachePool
    from sippcache.server.upstream import CachingLlamaProxy

    models = [
        ModelSettings(model=str(tiny_model), model_alias="a", n_ctx=512, verbose=False, logits_all=False),
        ModelSettings(model=str(tiny_model), model_alias="b", n_ctx=512, verbose=False, rope_freq_base=20000.0),
    ]
    one_at_a_time = {m.model_alias or m.model: ModelOptions(parallel=1) for m in models}
    pool = CachePool.open(Settings(ServerSettings(), models, one_at_a_time), f"lmdb://{tmp_path}/store")
    original = app.LlamaProxy
    try:
        fastapi_app = create_server_app(ServerSettings(), models, pool)
        ours = {getattr(route, "path", None) for route in fastapi_app.routes}
        assert {"/metrics", "/v1/cache/stats"} <= ours
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(fastapi_app.openapi()["paths"])
        proxy = app._llama_proxy
        assert isinstance(proxy, CachingLlamaProxy)
        prompt = " ".join(f"w{i}" for i in range(60))
        llm = proxy("a")
        assert type(llm) is ServedLlama and isinstance(llm.cache, LlamaCache)
        first = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        llm = proxy("b")  # frees "a"
        llm.create_completion(prompt, max_tokens=4, temperature=0)
        llm = proxy("a")  # back: warm from the store
        again = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        assert again == first
        rows = {row["model"]: row for row in pool.model_rows()}
        assert rows["a"]["lookups"] == 2 and rows["a"]["hits"] == 1 and rows["a"]["loaded"]
        assert rows["a"]["logits_hits"] == 1  # logits_all=False: the exact repeat evaluated nothing
        assert rows["b"]["entries_written"] >= 1 and not rows["b"]["loaded"]  # flushed when freed
        assert rows["a"]["scope"] == "default" and rows["b"]["scope"].startswith("settings-")
        assert rows["a"]["namespace"] != rows["b"]["namespace"]  # other RoPE base: never mixed
        text = pool.metrics.render().decode()
        assert 'sippcache_hits_total{model="a"} 1.0' in text
        assert 'sippcache_model_loaded{model="b"} 0.0' in text
        assert "sippcache_store_entries{" in text
        assert json.loads(json.dumps(pool.metrics.as_json()))["models"]["a"]["hits"] == 1
    finally:
        app.LlamaProxy = original
        if app._llama_proxy is not None:
            app._llama_proxy.free()
            app._llama_proxy = None
        pool.close()


def test_logprobs_are_upstream_s(tiny_model: Path, tmp_path: Path) -> None:
    """With logits_all (upstream's server default), the served model evaluates the
    prompt with logits for its last position only, and answers an exact repeat from
    stored logits: the logprobs a completion reports are still upstream's, from a
    cold cache and from a warm one, and prompt logprobs (echo) too."""
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from sippcache.server.settings import ModelOptions, Settings
    from sippcache.server.stores import CachePool
    from sippcache.server.upstream import CachingLlamaProxy, install

    settings = ModelSettings(model=str(tiny_model), model_alias="t", n_ctx=512, verbose=False)
    assert settings.logits_all
    plain = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=512, logits_all=True, verbose=False)
    pool = CachePool.open(
        Settings(ServerSettings(), [settings], {"t": ModelOptions(parallel=1)}), f"lmdb://{tmp_path}/store"
    )
    install(pool)
    try:
        served = CachingLlamaProxy.load_llama_from_model_settings(settings)
        prompt = " ".join(f"w{i}" for i in range(50))
        for echo in (False, True):
            expected = plain.create_completion(prompt, max_tokens=4, temperature=0, logprobs=3, echo=echo)
            for _ in ("cold", "warm"):
                served.create_completion("something else entirely " * 8, max_tokens=1)  # the live context moves on
                got = served.create_completion(prompt, max_tokens=4, temperature=0, logprobs=3, echo=echo)
                assert got["choices"][0]["text"] == expected["choices"][0]["text"]
                want, have = expected["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
                assert have["tokens"] == want["tokens"]
                for a, b in zip(have["token_logprobs"], want["token_logprobs"], strict=False):
                    assert (a is None and b is None) or abs(a - b) < 1e-3, (
                        echo,
                        have["token_logprobs"],
                        want["token_logprobs"],
                    )
        row = pool.model_rows()[0]
        assert row["hits"] >= 2  # the warm one, and the other prompt's
        assert row["logits_hits"] >= 1  # the warm one was an exact repeat: answered from stored logits
        served.close()
    finally:
        import llama_cpp.server.app as app

        app.LlamaProxy = LlamaProxy
        plain.close()
        pool.close()


def test_config_file_cache_url_is_taken_out_before_upstream_validates(tmp_path: Path, monkeypatch) -> None:
    from sippcache.server.settings import build_parser, load_settings

    config = {
        "host": "127.0.0.1",
        "models": [
            {"model": "a.gguf", "model_alias": "a", "cache_url": "ram://"},
            {"model": "b.gguf", "n_ctx": 1024},
            {"model": "c.gguf", "model_alias": "c", "cache_url": False},
        ],
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = build_parser().parse_args(["--config_file", str(path)])
    loaded = load_settings(args)
    server_settings, models = loaded.server, loaded.models
    urls = {alias: options.cache_url for alias, options in loaded.options.items()}
    assert server_settings.host == "127.0.0.1"
    assert [m.model_alias for m in models] == ["a", None, "c"] and models[1].n_ctx == 1024
    assert urls == {"a": "ram://", "b.gguf": None, "c": "false"}
    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text("models:\n  - model: a.gguf\n    cache_url: lmdb:///tmp/x\n")
    monkeypatch.setenv("CONFIG_FILE", str(yaml_path))  # as upstream: the variable wins over --config_file
    loaded = load_settings(args)
    assert {alias: options.cache_url for alias, options in loaded.options.items()} == {"a.gguf": "lmdb:///tmp/x"}


def test_flash_attention_is_on_for_parallel_unless_set(tmp_path: Path) -> None:
    """--parallel N > 1 turns flash attention on (llama.cpp's CPU kernels then skip the other
    slots' cells of the unified KV) unless the user chose; --parallel 1 keeps upstream's default."""
    from sippcache.server.settings import build_parser, load_settings

    notes: list[str] = []

    def flash(*argv: str) -> bool:
        loaded = load_settings(build_parser().parse_args(["--model", "m.gguf", *argv]))
        notes.extend(loaded.notes)
        return bool(loaded.models[0].flash_attn)

    assert flash() and flash("--parallel", "8")
    assert "flash attention on for --parallel 4" in notes[0] and len(notes) == 2
    assert not flash("--parallel", "1") and not flash("--flash_attn", "false")
    assert len(notes) == 2
    assert flash("--parallel", "1", "--flash_attn", "true")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "models": [
                    {"model": "a.gguf", "parallel": 2},
                    {"model": "b.gguf", "flash_attn": False},
                    {"model": "c.gguf", "parallel": 1},
                ]
            }
        )
    )
    loaded = load_settings(build_parser().parse_args(["--config_file", str(config)]))
    assert [m.flash_attn for m in loaded.models] == [True, False, False]


def test_cache_values_and_scopes() -> None:
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from sippcache import default_url, redact_url
    from sippcache.server.settings import ModelOptions, Settings, scope_for
    from sippcache.server.stores import CachePool

    models = [ModelSettings(model="a"), ModelSettings(model="b"), ModelSettings(model="c")]
    urls = {"a": "ram://", "b": "false", "c": "true"}
    options = {alias: ModelOptions(cache_url=url) for alias, url in urls.items()}
    pool = CachePool.open(Settings(ServerSettings(), models, options), "ram://?max_bytes=1MiB")
    try:
        rows = {row["model"]: row for row in pool.model_rows()}
        assert rows["a"]["store"] == "ram://" and rows["b"]["store"] is None
        assert rows["c"]["store"] == redact_url(default_url())
    finally:
        pool.close()
    assert scope_for(ModelSettings(model="m")) == "default"
    assert scope_for(ModelSettings(model="m", n_ctx=8192, type_k=8, chat_format="chatml")) == "default"
    rope = scope_for(ModelSettings(model="m", rope_freq_base=1e6))
    assert rope.startswith("settings-") and rope == scope_for(ModelSettings(model="m", rope_freq_base=1e6))
    assert rope != scope_for(ModelSettings(model="m", kv_overrides=["a.b=int:3"]))


def test_redact_url() -> None:
    from sippcache import redact_url

    assert redact_url("lmdb:///var/cache/sipp?max_bytes=2GiB") == "lmdb:///var/cache/sipp?max_bytes=2GiB"
    assert redact_url("redis://app:hunter2@cache:6379/0?prefix=p") == "redis://app:***@cache:6379/0?prefix=p"
    assert "hunter2" not in redact_url("rediss://h?password=hunter2")
    inner = "tiered://?l1=lmdb%3A%2F%2F%2Ftmp%2Fa&l2=redis%3A%2F%2Fu%3Ahunter2%40h%3A6379%2F0"
    assert "hunter2" not in redact_url(inner) and "redis://u:***@h:6379/0" in redact_url(inner)


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sippcache.server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("cache", "says"),
    [
        ("nosuch://x", "no cache backend named 'nosuch'"),
        ("notaurl", "is not a cache URL"),
        ("lmdb:///tmp/sippcache-serve-test?max_bytes=lots", "max_bytes"),
    ],
)
def test_a_bad_cache_url_stops_the_server_with_one_line(tiny_model: Path, cache: str, says: str) -> None:
    result = run_serve("--model", str(tiny_model), "--cache", cache, "--port", "9")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot open the cache") and says in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_bad_settings_and_a_bad_default_url_are_one_line_too(tiny_model: Path, tmp_path: Path) -> None:
    result = run_serve("--model", str(tiny_model), env={"SIPPCACHE_URL": "bogus://"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "bogus" in result.stderr, result.stderr
    result = run_serve("--n_ctx", "512")  # no --model
    assert result.returncode == 2 and result.stderr.strip() == "error: invalid settings: model: Field required"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": [{"model": str(tiny_model), "cache_url": 3}]}))
    result = run_serve("--config_file", str(config))
    assert result.returncode == 2 and "cache_url must be a cache URL" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_serve("--model", str(tmp_path / "missing.gguf"), "--cache", "ram://")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot start the server")
    assert "Traceback" not in result.stderr


def test_the_sippcache_command_serves_with_upstream_options() -> None:
    assert SCRIPT.exists(), f"the sippcache console script is not installed at {SCRIPT}"
    result = subprocess.run([str(SCRIPT), "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--model", "--n_ctx", "--chat_format", "--config_file", "--api_key", "--cache URL"):
        assert option in result.stdout
    assert result.stdout.startswith("usage: sippcache serve")
    result = subprocess.run(
        [str(SCRIPT), "serve", "--model", "m.gguf", "--cache", "nosuch://"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and result.stderr.startswith("error: cannot open the cache nosuch://")
    assert result.stderr.count("\n") == 1


def test_metrics_need_the_api_key_when_one_is_set(tiny_model: Path, tmp_path: Path) -> None:
    import time
    import urllib.error
    import urllib.request

    from harness.servers import Server

    def get(path: str, key: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(server.url + path, headers=headers), timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    server = Server(
        ["--model", str(tiny_model), "--n_ctx", "512", "--api_key", "k3y", "--cache", "ram://"], tmp_path / "server.log"
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # up when it answers at all (401 included)
            assert server.process.poll() is None, server.log_tail()
            try:
                get("/v1/models")
                break
            except OSError:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.2)
        for path in ("/metrics", "/v1/cache/stats", "/v1/models"):
            assert get(path) == 401, path
            assert get(path, "k3y") == 200, path
    finally:
        server.stop()


def test_a_batched_request_answers_as_upstream_s_llama(tiny_model: Path, tmp_path: Path) -> None:
    """With --parallel, a request runs upstream's own completion code on a `BatchedLlama`
    whose tokens come from the scheduler: on the tiny model (float32) every answer is a
    plain `llama_cpp.Llama`'s, field for field (logprobs to float rounding)."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from sippcache.server.batched import BatchedLlama
    from sippcache.server.settings import ModelOptions, Settings
    from sippcache.server.stores import CachePool
    from sippcache.server.upstream import CachingLlamaProxy, LlamaProxy, install

    settings = ModelSettings(model=str(tiny_model), model_alias="t", n_ctx=512, verbose=False, chat_format="chatml")
    pool = CachePool.open(
        Settings(ServerSettings(), [settings], {"t": ModelOptions(parallel=2)}), f"lmdb://{tmp_path}/store"
    )
    install(pool)
    plain = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=512, logits_all=True, verbose=False, chat_format="chatml")
    proxy = CachingLlamaProxy([settings])
    try:
        prompt = " ".join(f"w{i}" for i in range(50))
        cases: list[dict[str, Any]] = [
            {"max_tokens": 8, "temperature": 0},
            {"max_tokens": 8, "temperature": 0, "logprobs": 3},
            {"max_tokens": 8, "temperature": 0.9, "seed": 11, "top_k": 20, "repeat_penalty": 1.2},
            {"max_tokens": 12, "temperature": 0, "stop": ["w"]},
            {"max_tokens": 8, "temperature": 0, "logit_bias": {"100": -100.0, "101": 5.0}},
            # a bias on a prompt token the repetition penalty also scales: upstream biases first
            {"max_tokens": 8, "temperature": 0, "repeat_penalty": 1.5, "logit_bias": {"55": 4.0}},
            {"max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2},  # the serialized path
            {"max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2, "logit_bias": {"55": 4.0}},  # its bias
            # a bias beside the caller's own logits processors stays upstream's (which, as of 0.3.x, drops
            # both: `LogitsProcessorList.extend` returns None)
            {
                "max_tokens": 8,
                "temperature": 0,
                "logit_bias": {"55": 4.0},
                "logits_processor": llama_cpp.LogitsProcessorList([llama_cpp.MinTokensLogitsProcessor(4, 2)]),
            },
            {"max_tokens": 6, "temperature": 0, "grammar": llama_cpp.LlamaGrammar.from_string('root ::= "ab"+')},
        ]
        for case in cases:
            request = proxy("t")
            assert type(request) is BatchedLlama
            want = plain.create_completion(prompt, **case)
            got = request.create_completion(prompt, **case)
            assert_same_completion(got, want, case)
            streamed = list(proxy("t").create_completion(prompt, stream=True, **case))
            expected = list(plain.create_completion(prompt, stream=True, **case))
            assert [c["choices"][0]["text"] for c in streamed] == [c["choices"][0]["text"] for c in expected], case
        request = proxy("t")  # one request's second completion (a chat handler may make several) has its own bias
        biased = {"max_tokens": 8, "temperature": 0, "repeat_penalty": 1.5, "logit_bias": {"55": 4.0}}
        assert_same_completion(
            request.create_completion(prompt, **biased), plain.create_completion(prompt, **biased), biased
        )
        unbiased = {"max_tokens": 8, "temperature": 0, "repeat_penalty": 1.5}
        assert_same_completion(
            request.create_completion(prompt, **unbiased), plain.create_completion(prompt, **unbiased), unbiased
        )
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        for fields in ({}, {"logit_bias": {"55": 4.0}, "repeat_penalty": 1.5}):  # the chat handler passes the bias on
            got = proxy("t").create_chat_completion(messages=messages, max_tokens=8, temperature=0, **fields)
            want = plain.create_chat_completion(messages=messages, max_tokens=8, temperature=0, **fields)
            assert got["choices"][0]["message"] == want["choices"][0]["message"], fields
            assert got["usage"] == want["usage"], fields
        row = pool.model_rows()[0]
        assert row["parallel"] == 2 and row["serialized_prompt_logprobs"] == 4
    finally:
        import llama_cpp.server.app as app

        app.LlamaProxy = LlamaProxy
        proxy.free()
        plain.close()
        pool.close()


def assert_same_completion(got: dict[str, Any], want: dict[str, Any], case: dict[str, Any]) -> None:
    mine, theirs = got["choices"][0], want["choices"][0]
    assert mine["text"] == theirs["text"] and mine["finish_reason"] == theirs["finish_reason"], case
    assert got["usage"] == want["usage"], case
    if theirs["logprobs"] is not None:
        assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"], case
        for a, b in zip(mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"], strict=True):
            assert (a is None and b is None) or abs(a - b) < 1e-3, case


# -- the chat format the server picks for a model file without a chat template ----------------

#: Instructions long enough that a prompt without them is plainly shorter.
INSTRUCTIONS = "You are the archivist of a lighthouse. Answer from the keeper's log only, in one sentence. " * 4


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURE_CHAT_FORMATS))
def test_a_system_message_reaches_the_model_in_every_format_the_server_picks(
    tiny_model: Path, make_llama, architecture: str
) -> None:
    """For every architecture the server maps to a chat format by itself, a chat's system
    message is in the prompt the model evaluates (``usage.prompt_tokens``): llama-cpp-python's
    ``gemma`` format, which the server used to pick, drops it (issue 24).

    The tiny model is a llama file; the choice reads only its ``general.architecture``, set
    here to each one, and the prompt is tokenized and evaluated by the real model."""
    from llama_cpp.server.settings import ModelSettings

    from sippcache.server.model import use_chat_format

    llm = make_llama(tiny_model, n_ctx=2048)
    assert "tokenizer.chat_template" not in llm.metadata
    llm.metadata["general.architecture"] = architecture
    assert use_chat_format(llm, ModelSettings(model=str(tiny_model))) == ARCHITECTURE_CHAT_FORMATS[architecture]
    question = {"role": "user", "content": "Which ship passed first?"}

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        reply = llm.create_chat_completion(messages=messages, max_tokens=1, temperature=0)
        return int(reply["usage"]["prompt_tokens"])

    alone = prompt_tokens([question])
    briefed = prompt_tokens([{"role": "system", "content": INSTRUCTIONS}, question])
    # Most of the instructions' tokens are added (qwen's format has a short default system
    # message of its own, which they replace).
    assert briefed - alone > len(llm.tokenize(INSTRUCTIONS.encode(), add_bos=False)) // 2, (alone, briefed)


def test_the_served_gemma_format_can_be_named(tiny_model: Path, make_llama) -> None:
    """``--chat_format sippcache-gemma`` (upstream's loader passes it to the `Llama` as is)
    gives any model the format that keeps a system message."""
    from llama_cpp.server.settings import ModelSettings

    from sippcache.server.model import use_chat_format

    llm = make_llama(tiny_model, chat_format="sippcache-gemma")
    assert use_chat_format(llm, ModelSettings(model=str(tiny_model), chat_format="sippcache-gemma")) is None
    question = {"role": "user", "content": "Which ship passed first?"}
    alone, briefed = (
        llm.create_chat_completion(messages=messages, max_tokens=1)["usage"]["prompt_tokens"]
        for messages in ([question], [{"role": "system", "content": INSTRUCTIONS}, question])
    )
    assert briefed - alone >= len(llm.tokenize(INSTRUCTIONS.encode(), add_bos=False)), (alone, briefed)


def test_the_served_gemma_format_is_gemma_3_s_template_and_stays_the_server_s() -> None:
    """Gemma 3's template puts the system text and a blank line at the start of the first
    user turn; sippcache's gemma format makes that prompt (BOS comes from the tokenizer),
    and is not in llama-cpp-python's registry, where a plain `llama_cpp.Llama` looks."""
    from llama_cpp import llama_chat_format

    from sippcache.server.model import CHAT_HANDLERS, format_gemma

    chat: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "Name a ship."}]},
    ]
    assert format_gemma(chat).prompt == (
        "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi.<end_of_turn>\n"
        "<start_of_turn>user\nName a ship.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert format_gemma(chat[1:3]).prompt == llama_chat_format.format_gemma(chat[1:3]).prompt  # no system: upstream's
    # A system message later in the chat opens the next user turn; the turns before it stay.
    later = [*chat[1:3], {"role": "system", "content": "Answer in French."}, chat[3]]
    assert format_gemma(later).prompt == (
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi.<end_of_turn>\n"
        "<start_of_turn>user\nAnswer in French.\n\nName a ship.<end_of_turn>\n<start_of_turn>model\n"
    )
    assert format_gemma(chat[:1]).prompt == "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"
    for name in CHAT_HANDLERS:
        with pytest.raises(llama_chat_format.LlamaChatCompletionHandlerNotFoundException):
            llama_chat_format.get_chat_completion_handler(name)
