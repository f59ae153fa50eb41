"""`sippcache serve`: llama-cpp-python's OpenAI-compatible server, with sippcache's cache.

This runs llama-cpp-python's own server (``llama_cpp.server``: its FastAPI app,
endpoints, settings, config file and chat formats, unchanged) with every
model's cache replaced by sippcache's, picked by URL, and adds two read-only
endpoints: ``GET /metrics`` (Prometheus text) and ``GET /v1/cache/stats``
(the same as JSON).

    sippcache serve --model model.gguf --cache lmdb:///var/cache/sipp
    python -m sippcache.serve --config_file models.yaml     # each model may name its own cache_url

Arguments are parsed exactly as ``python -m llama_cpp.server`` parses them
(its `Settings` fields, ``--config_file`` JSON or YAML), plus ``--cache URL``
(default: `sippcache.default_url()`, so ``SIPPCACHE_URL`` is honoured), which
takes the place of upstream's boolean ``--cache``. In a config file, each model
may have a ``cache_url`` key.

Upstream internals are relied on in two documented places: the server's in
`CachingLlamaProxy` and `install` (how the app builds its proxy and where the
proxy loads models: `tests/test_serve_upstream.py` fails, naming the symbol,
if llama-cpp-python moves any of them), and `llama_cpp.Llama`'s use of
``logits_all`` and ``scores`` in `ServedLlama` (tests compare logprobs with a
plain `llama_cpp.Llama`'s).
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, TypeVar, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import llama_cpp
import llama_cpp.server.app as upstream_app
import numpy as np
import xxhash
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings

from . import llama as sippllama
from .metrics import CONTENT_TYPE_LATEST, ServeMetrics, StoreReader
from .protocol import CacheBackend
from .registry import default_url
from .registry import open as open_cache

log = logging.getLogger("sippcache")

__all__ = [
    "CachePool",
    "CachingLlamaProxy",
    "ServeError",
    "ServedLlama",
    "build_parser",
    "create_server_app",
    "install",
    "load_settings",
    "main",
    "redact_url",
    "scope_for",
]

#: The per-model config file key naming its cache (not an upstream setting).
CACHE_URL_KEY = "cache_url"
#: `--cache` / `cache_url` values that keep upstream's boolean meaning.
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no", "none"})
#: Model settings that change what the KV cache holds and that the model fingerprint
#: (sippcache.fingerprint) does not cover: a model loaded with other values gets
#: another scope, so its entries never mix with the defaults'.
STATE_SETTINGS = (
    "rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx", "kv_overrides", "lora_base",
)  # fmt: skip
#: Upstream's own cache settings: accepted (so config files keep validating), unused.
UPSTREAM_CACHE_SETTINGS = ("cache", "cache_type", "cache_size")


class ServeError(Exception):
    """A problem reported as one ``error: ...`` line, exit code 2."""


# -- settings: parsed exactly as `python -m llama_cpp.server` does ------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Upstream's parser (every `Settings` field and ``--config_file``), with ``--cache URL``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="llama-cpp-python's OpenAI-compatible server with sippcache's prefix cache. "
        "Every option of `python -m llama_cpp.server` works as there; --cache names the cache.",
        conflict_handler="resolve",  # our --cache URL replaces upstream's boolean --cache
    )
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", type=str, help="Path to a config file to load.")
    parser.add_argument(
        "--cache", dest="cache_url", metavar="URL",
        help="The sippcache store every model uses (a model in --config_file may name its own with "
        f"'{CACHE_URL_KEY}'): lmdb:///path, diskcache:///path, ram://, redis://host, tiered://... "
        "(default: $SIPPCACHE_URL, else LMDB in the user cache folder). 'true' means the default; "
        "'false' serves without a cache. Upstream's cache_type and cache_size are ignored.",
    )  # fmt: skip
    return parser


def load_settings(args: argparse.Namespace) -> tuple[ServerSettings, list[ModelSettings], dict[str, str | None]]:
    """(server settings, model settings, {model alias: its config file `cache_url`}), as upstream reads them.

    As upstream: ``$CONFIG_FILE`` wins over ``--config_file``; with a config file,
    the other command-line settings are not used. ``cache_url`` keys are taken
    out of the models before upstream's models (which forbid unknown keys)
    validate them.
    """
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    try:
        if not config_file:
            server_settings = _settings_from_args(ServerSettings, args)
            model_settings = [_settings_from_args(ModelSettings, args)]
            return server_settings, model_settings, {}
        if not os.path.exists(config_file):
            raise ServeError(f"config file {config_file} not found")
        with open(config_file, "rb") as f:
            if config_file.endswith((".yaml", ".yml")):
                import yaml

                raw = yaml.safe_load(f)
            else:
                raw = json.loads(f.read())
        cache_urls: list[str | None] = []
        if isinstance(raw, dict) and isinstance(raw.get("models"), list):
            for model in raw["models"]:
                url = model.pop(CACHE_URL_KEY, None) if isinstance(model, dict) else None
                if url is not None and not isinstance(url, (str, bool)):
                    raise ServeError(f"{CACHE_URL_KEY} must be a cache URL, not {url!r}")
                cache_urls.append(None if url is None else str(url).lower() if isinstance(url, bool) else url)
        config = ConfigFileSettings.model_validate_json(json.dumps(raw))
        server_settings = ServerSettings.model_validate(config)
        model_settings = config.models
    except ServeError:
        raise
    except Exception as exc:  # pydantic's ValidationError, JSON and YAML syntax errors, unreadable files
        raise ServeError(f"invalid settings: {_describe_settings_error(exc)}") from None
    urls: dict[str, str | None] = {}
    for settings, url in zip(model_settings, cache_urls, strict=False):
        urls[settings.model_alias or settings.model] = url  # the key LlamaProxy files the model under
    return server_settings, model_settings, urls


_Settings = TypeVar("_Settings", ServerSettings, ModelSettings)


def _settings_from_args(model: type[_Settings], args: argparse.Namespace) -> _Settings:
    """Upstream's `parse_model_from_args`, typed as what it returns (an instance; upstream's
    annotation says the class)."""
    return cast(_Settings, parse_model_from_args(model, args))


def _describe_settings_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = [f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in errors()]
            return "; ".join(parts)
        except Exception:  # not pydantic's shape after all
            pass
    return " ".join(str(exc).split()) or type(exc).__name__


def scope_for(settings: ModelSettings) -> str:
    """The cache scope of a model: "default", unless settings that change the KV
    contents and that the model fingerprint does not cover (RoPE and YaRN
    parameters, kv_overrides, lora_base) differ from upstream's defaults."""
    changed = {}
    for name in STATE_SETTINGS:
        value = getattr(settings, name, None)
        if value != ModelSettings.model_fields[name].default:
            changed[name] = value
    if not changed:
        return "default"
    return "settings-" + xxhash.xxh3_64_hexdigest(json.dumps(changed, sort_keys=True, default=str).encode())


def redact_url(url: str) -> str:
    """`url` with passwords replaced by ``***`` (also inside percent-encoded inner URLs, as tiered:// has)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    head, sep, tail = url.partition("?")
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if colon:
            head = head.replace(parts.netloc, f"{user}:***@{host}", 1)
    if sep:
        query, hash_, fragment = tail.partition("#")
        try:
            pairs = parse_qsl(query, keep_blank_values=True)
        except ValueError:
            pairs = []
        if any("://" in value or name.lower() in _SECRET_OPTIONS for name, value in pairs):
            query = urlencode(
                [(k, "***" if k.lower() in _SECRET_OPTIONS else redact_url(v) if "://" in v else v) for k, v in pairs],
                safe="/:*@", quote_via=quote,
            )  # fmt: skip
        tail = query + hash_ + fragment
    return head + sep + tail


_SECRET_OPTIONS = frozenset({"password", "pass", "secret", "token"})


# -- the caches: one open store per URL, shared by every model and every reload -------------


@dataclass
class _Model:
    """A model alias: its store (None: no cache), scope, and counters."""

    alias: str
    store: str | None  # the store's label (a redacted URL)
    scope: str
    retired: dict[str, float] = field(default_factory=dict)  # counted by instances since closed
    live: ServedLlama | None = None
    namespace: str | None = None


class CachePool:
    """The stores the server uses (opened once per URL, before the server starts) and
    each model alias's counters, across loads and unloads of its model."""

    def __init__(self) -> None:
        self._stores: dict[str, CacheBackend] = {}  # label -> open backend
        self._readers: dict[str, StoreReader] = {}
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self.metrics = ServeMetrics(self, [])

    @classmethod
    def open(
        cls, model_settings: Sequence[ModelSettings], cache_urls: dict[str, str | None], cache: str | None
    ) -> CachePool:
        """Open every store the models name. Raises `ServeError` (one line) for a bad URL."""
        pool = cls()
        try:
            default = _resolve(cache, default_url)
            for settings in model_settings:
                alias = settings.model_alias or settings.model
                own = cache_urls.get(alias)
                url = default if own is None else _resolve(own, default_url)
                label = pool._open_store(url) if url is not None else None
                pool._models[alias] = _Model(alias, label, scope_for(settings))
        except BaseException:
            pool.close()
            raise
        pool.metrics = ServeMetrics(pool, list(pool._models))
        return pool

    def _open_store(self, url: str) -> str:
        label = redact_url(url)
        if label not in self._stores:
            try:
                backend = open_cache(url)
            except Exception as exc:
                message = " ".join(str(exc).split()) or type(exc).__name__
                ours = isinstance(exc, (ValueError, OSError, ImportError)) or type(exc).__module__ == "sippcache.errors"
                if not ours:
                    message = f"{type(exc).__name__}: {message}"
                raise ServeError(f"cannot open the cache {label}: {message}") from None
            self._stores[label] = backend
            self._readers[label] = StoreReader(label, backend)
        return label

    # -- models coming and going ----------------------------------------------------------

    def attach(self, model: llama_cpp.Llama, settings: ModelSettings) -> llama_cpp.Llama:
        """Turn a model upstream's loader made into a `ServedLlama` with its alias's cache."""
        if type(model) is not llama_cpp.Llama:
            raise RuntimeError(
                "sippcache serve: llama_cpp.server.model.LlamaProxy.load_llama_from_model_settings returned a "
                f"{type(model).__module__}.{type(model).__qualname__}, not a llama_cpp.Llama; this llama-cpp-python "
                "is not supported by sippcache serve"
            )
        alias = settings.model_alias or settings.model
        with self._lock:
            entry = self._models.get(alias)
            if entry is None:  # a model added after the start (LlamaProxy.__setitem__): the default store
                stores = list(self._stores)
                entry = self._models[alias] = _Model(alias, stores[0] if stores else None, scope_for(settings))
        model.__class__ = ServedLlama  # it only overrides methods: see ServedLlama
        served: ServedLlama = model  # type: ignore[assignment]
        served._sippcache_pool, served._sippcache_alias = self, alias
        if entry.store is None or settings.vocab_only:
            served.set_cache(None)
            return served
        logits_all = served._logits_all
        try:
            # The adapter keeps whole prompts with their logits (and answers exact repeats
            # from them) unless the model keeps logits for every position; a served model
            # needs only the last prompt position's (see ServedLlama), so the cache is made
            # as for logits_all=False.
            served._logits_all = False
            cache = sippllama.LlamaCache(
                self._stores[entry.store], llm=served, scope=entry.scope,
                on_prefill=self.metrics.prefill_observer(alias),
            )  # fmt: skip
            prefix_cache = cache.prefix_cache(served)
        except Exception as exc:  # a store that fails now costs speed only: serve uncached
            log.warning("sippcache: serving %s without a cache: %s: %s", alias, type(exc).__name__, exc)
            with self._lock:
                entry.retired["backend_errors"] = entry.retired.get("backend_errors", 0) + 1
            served.set_cache(None)
            return served
        finally:
            served._logits_all = logits_all
        served._sippcache = cache
        served.set_cache(cache)
        with self._lock:
            entry.live, entry.namespace = served, prefix_cache.namespace
        return served

    def detach(self, model: ServedLlama) -> None:
        """A model is being freed: write its pending entries, stop its writer, keep its counts."""
        cache, model._sippcache = model._sippcache, None
        model.cache = None  # also breaks the model <-> cache reference cycle
        if cache is None:
            return
        prefix_cache = cache.prefix_cache(model)
        try:
            cache.close()  # flushes and stops the model's writer; the shared store stays open
        finally:
            final = prefix_cache.stats()
            with self._lock:
                entry = self._models[model._sippcache_alias]
                for key, value in final.items():
                    entry.retired[key] = entry.retired.get(key, 0) + value
                if entry.live is model:
                    entry.live = None

    def close(self) -> None:
        """Flush and close every loaded model's cache, then the stores."""
        for entry in list(self._models.values()):
            if entry.live is not None:
                self.detach(entry.live)
        for backend in self._stores.values():
            try:
                backend.close()
            except Exception as exc:
                log.warning("sippcache: closing a store failed: %s: %s", type(exc).__name__, exc)
        self._stores.clear()

    # -- what the metrics read --------------------------------------------------------------

    def model_rows(self) -> list[dict[str, Any]]:
        rows = []
        with self._lock:
            entries = [(e, e.live, dict(e.retired)) for e in self._models.values()]
        zeros = {**sippllama.PrefixStats().as_dict(), "write_failures": 0}
        for entry, live, retired in entries:
            totals = {**zeros, **retired}
            cache = live._sippcache if live is not None else None
            if cache is not None:
                for key, value in cache.prefix_cache().stats().items():
                    totals[key] = totals.get(key, 0) + value
            rows.append({
                "model": entry.alias, "store": entry.store, "scope": entry.scope, "namespace": entry.namespace,
                "loaded": live is not None, **totals,
            })  # fmt: skip
        return rows

    def store_readers(self) -> list[StoreReader]:
        return list(self._readers.values())


def _resolve(value: str | None, default: Callable[[], str]) -> str | None:
    """A `--cache`/`cache_url` value: a URL, None or a true word (the default store), a false word (no cache)."""
    if value is None or value.strip().lower() in TRUE_WORDS:
        return default()
    if value.strip().lower() in FALSE_WORDS:
        return None
    return value


# -- the served model ------------------------------------------------------------------------

_COMPLETION_SIGNATURE = inspect.signature(llama_cpp.Llama.create_completion)


class ServedLlama(sippllama.Llama):
    """The class of every model the server loads (assigned to the instance upstream's
    loader made: this class adds no state a constructor would set up).

    On top of `sippcache.llama.Llama` (stored logits, no scores copies):

    - `close()` first writes the model's pending cache entries and stops its
      writer (the proxy closes a model when a request names another alias);
    - with ``logits_all`` (upstream's server default, for ``logprobs``), the
      prompt the cache prefills is evaluated with logits for its last position
      only, which is the only prompt position anything reads (the first
      generated token's logprobs), copied into ``scores`` (from the store, on
      an exact repeat answered with stored logits). Computing logits for
      every prompt position costs more than the rest of gemma-3-270m's forward
      pass (a 262k vocabulary), and the rows of positions restored from the
      cache would hold none anyway. Upstream's own evaluation (generation)
      keeps every row;
    - a completion asking for the prompt's own logprobs (``echo`` with
      ``logprobs``) reads those rows: it is evaluated from scratch, uncached,
      by upstream's code alone.
    """

    _sippcache: sippllama.LlamaCache | None = None
    _sippcache_pool: CachePool | None = None
    _sippcache_alias: str = ""
    #: True from the start of a completion until upstream's generate() runs: the cache's prefill.
    _sippcache_prefill: bool = False

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        arguments = _COMPLETION_SIGNATURE.bind(self, *args, **kwargs).arguments
        if arguments.get("echo") and arguments.get("logprobs") is not None:
            self.cache, self._sippcache_prefill = None, False
            self.reset()  # generate() then evaluates every prompt position, filling its scores
        else:
            self.cache, self._sippcache_prefill = self._sippcache, self._sippcache is not None
        return super().create_completion(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        # Runs at the first next(), after the cache's prefill: from here on, upstream's evaluation.
        self._sippcache_prefill = False
        stored = self._stored_logits
        if self._logits_all and stored is not None and stored[0] == self.n_tokens:
            self.scores[self.n_tokens - 1, :] = stored[1]  # an exact repeat: its logits came from the store
        return (yield from super().generate(*args, **kwargs))

    def eval(self, tokens: Sequence[int]) -> None:
        if not (self._sippcache_prefill and self._logits_all and len(tokens)):
            return super().eval(tokens)
        self._logits_all = False  # upstream's eval then asks llama.cpp for the last position's logits only
        try:
            super().eval(tokens)
        finally:
            self._logits_all = True
        last = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        self.scores[self.n_tokens - 1, :] = np.ctypeslib.as_array(
            ctypes.cast(last, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,)
        )

    def close(self) -> None:
        pool, self._sippcache_pool = self._sippcache_pool, None
        if pool is not None:
            pool.detach(self)
        super().close()


# -- the one coupling point with llama-cpp-python's server internals ----------------------------


class CachingLlamaProxy(LlamaProxy):
    """Upstream's `LlamaProxy` (one model loaded at a time, swapped by alias) whose
    loader attaches sippcache.

    This class and `install` are the only code that relies on the server's
    internals: ``LlamaProxy.load_llama_from_model_settings`` (a static method,
    called through ``self``, the only place upstream creates caches),
    ``llama_cpp.server.app.LlamaProxy`` (the name `create_app` instantiates),
    ``llama_cpp.server.app.authenticate`` (the API key check), and the settings
    fields ``cache``, ``model_alias`` and ``vocab_only``. The loader here calls
    upstream's with ``cache=False`` (so no LlamaRAMCache/LlamaDiskCache is
    made), then gives the model its sippcache cache.
    """

    pool: ClassVar[CachePool | None] = None  # set by `install`

    @classmethod
    def load_llama_from_model_settings(cls, settings: ModelSettings) -> llama_cpp.Llama:
        model = LlamaProxy.load_llama_from_model_settings(settings.model_copy(update={"cache": False}))
        if cls.pool is None:
            return model
        return cls.pool.attach(model, settings)


def install(pool: CachePool) -> None:
    """Make `llama_cpp.server.app.create_app` build a `CachingLlamaProxy` using `pool`."""
    CachingLlamaProxy.pool = pool
    upstream_app.LlamaProxy = CachingLlamaProxy  # type: ignore[attr-defined]  # app.py imports it, not re-exported


def create_server_app(
    server_settings: ServerSettings, model_settings: list[ModelSettings], pool: CachePool
) -> Any:
    """Upstream's FastAPI app (`create_app`), with sippcache's caches and metrics endpoints."""
    from fastapi import Depends
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool

    install(pool)
    app = upstream_app.create_app(server_settings=server_settings, model_settings=model_settings)
    auth = [Depends(upstream_app.authenticate)]  # the API key, when one is set, as on upstream's endpoints

    # No return annotations: with postponed annotations FastAPI would try to resolve them for the schema.
    async def metrics():  # type: ignore[no-untyped-def]
        return Response(await run_in_threadpool(pool.metrics.render), media_type=CONTENT_TYPE_LATEST)

    async def cache_stats():  # type: ignore[no-untyped-def]
        return JSONResponse(await run_in_threadpool(pool.metrics.as_json))

    app.add_api_route(
        "/metrics", metrics, methods=["GET"], dependencies=auth, include_in_schema=False, response_model=None
    )
    app.add_api_route(
        "/v1/cache/stats", cache_stats, methods=["GET"], dependencies=auth, response_model=None,
        summary="Cache stats", tags=["sippcache"],
    )  # fmt: skip
    return app


# -- the command ------------------------------------------------------------------------------


def _fail(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the server until it is stopped (SIGINT/SIGTERM); pending cache writes are flushed on the way out."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        server_settings, model_settings, cache_urls = load_settings(args)
        os.environ.pop("CONFIG_FILE", None)  # read above; create_app would read it again, without cache_url
        pool = CachePool.open(model_settings, cache_urls, args.cache_url)
    except ServeError as exc:
        _fail(str(exc))
    ignored = sorted({name for s in model_settings for name in UPSTREAM_CACHE_SETTINGS if name in s.model_fields_set})
    if ignored:
        print(f"sippcache serve: ignoring llama-cpp-python's own cache settings ({', '.join(ignored)}): "
              "the cache is sippcache's (--cache URL)", file=sys.stderr)  # fmt: skip
    try:
        try:
            app = create_server_app(server_settings, model_settings, pool)
        except Exception as exc:  # the model cannot be loaded: upstream's own errors, in one line
            _fail(f"cannot start the server: {type(exc).__name__}: {exc}")
        import uvicorn

        uvicorn.run(
            app,
            host=os.getenv("HOST", server_settings.host),
            port=int(os.getenv("PORT", server_settings.port)),
            ssl_keyfile=server_settings.ssl_keyfile,
            ssl_certfile=server_settings.ssl_certfile,
        )
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
