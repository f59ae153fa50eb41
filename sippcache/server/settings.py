"""The server's settings: parsed exactly as ``python -m llama_cpp.server`` parses them, plus ours.

Upstream's `Settings` fields and ``--config_file`` (JSON or YAML) work as
there. Added: ``--cache URL`` (the store; it takes the place of upstream's
boolean ``--cache``) and, per model in a config file, ``cache_url``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import xxhash
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings
from llama_cpp.server.settings import Settings as UpstreamSettings

from ..flags import Flag, add_flags
from ..llama.batch import DEFAULT_CHUNK
from ..state.chunks import DEFAULT_CHUNK_TOKENS

__all__ = [
    "CACHE_URL_KEY",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_PARALLEL",
    "DEFAULT_PREFILL_CHUNK",
    "DEFAULT_SAVE_IDLE",
    "SERVE_FLAGS",
    "STATE_SETTINGS",
    "UPSTREAM_CACHE_SETTINGS",
    "ModelOptions",
    "ServeError",
    "Settings",
    "build_parser",
    "load_settings",
    "resolve_cache_value",
    "scope_for",
]

#: The per-model config file key naming its cache (not an upstream setting).
CACHE_URL_KEY = "cache_url"
#: Requests each model runs at once, as llama-server's own default (see docs/serve.md,
#: "Tuning": decode steps of 4 sequences give 2.2x the tokens per second of 1 on
#: gemma-3-270m, 8 give 2.8x for twice the KV memory and 60% longer steps).
DEFAULT_PARALLEL = 4
#: Requests per model that may wait for a slot beyond the ones running; past it, 503.
DEFAULT_MAX_QUEUE = 64
#: Prompt tokens a step of the batched path evaluates, at most (see docs/serve.md, "Tuning").
DEFAULT_PREFILL_CHUNK = DEFAULT_CHUNK
#: Seconds without a job after which a ``--parallel`` model stores what its slots hold beyond the
#: store (see docs/serve.md, "When a state is stored"), as the proxy's ``--save-idle``.
DEFAULT_SAVE_IDLE = 30.0
#: `--cache` / `cache_url` values that keep upstream's boolean meaning.
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no", "none"})
#: Model settings that change what the KV cache holds and that the model fingerprint
#: (sippcache.llama.fingerprint) does not cover: a model loaded with other values gets
#: another scope, so its entries never mix with the defaults'.
STATE_SETTINGS = (
    "rope_scaling_type",
    "rope_freq_base",
    "rope_freq_scale",
    "yarn_ext_factor",
    "yarn_attn_factor",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_orig_ctx",
    "kv_overrides",
    "lora_base",
)
#: Upstream's own cache settings: accepted (so config files keep validating), unused.
UPSTREAM_CACHE_SETTINGS = ("cache", "cache_type", "cache_size")


#: sippcache's own options of ``sippcache serve`` (the rest are upstream's), declared once
#: (`sippcache.flags`): the parser and docs/serve.md's table come from here. Each default is None
#: on the command line (a config file's model may set its own); `shown` says what a model gets.
SERVE_GROUP = "sippcache"
SERVE_FLAGS = (
    Flag(
        "--cache",
        SERVE_GROUP,
        "the store every model uses, unless the config file names one for it (cache_url): lmdb:///path, "
        "diskcache:///path, ram://, redis://host, tiered://..., a plugin's URL; 'true' means the default, "
        "'false' serves without a cache (upstream's cache_type and cache_size are ignored)",
        shown="$SIPPCACHE_URL, else LMDB in the user cache folder",
        metavar="URL",
        dest=CACHE_URL_KEY,
    ),
    Flag(
        "--parallel",
        SERVE_GROUP,
        "requests each model runs at once, batched in one llama.cpp context whose KV cache holds N x n_ctx "
        "tokens; 1 serves one request at a time on upstream's own code path ('parallel' per model in a "
        "config file)",
        int,
        shown=str(DEFAULT_PARALLEL),
        metavar="N",
        see="many-requests-at-once---parallel-n",
    ),
    Flag(
        "--max-queue",
        SERVE_GROUP,
        "requests per model that may wait for a slot beyond the N running; more get 503 with Retry-After "
        "('max_queue' per model in a config file)",
        int,
        shown=str(DEFAULT_MAX_QUEUE),
        metavar="M",
        aliases=("--max_queue",),
    ),
    Flag(
        "--prefill-chunk",
        SERVE_GROUP,
        "with --parallel > 1: prompt tokens evaluated per step, at most, so a long new prompt holds the others' "
        "decoding back by one chunk at most (a multiple of 32; 'prefill_chunk' per model in a config file)",
        int,
        shown=str(DEFAULT_PREFILL_CHUNK),
        metavar="K",
        aliases=("--prefill_chunk",),
    ),
    Flag(
        "--save-idle",
        SERVE_GROUP,
        "with --parallel > 1: once a model has had no request for S seconds, what its slots hold beyond the "
        "store is stored (0: as soon as no request runs; 'save_idle' per model in a config file)",
        float,
        shown=f"{DEFAULT_SAVE_IDLE:g}",
        metavar="S",
        aliases=("--save_idle",),
        see="when-a-state-is-stored",
    ),
    Flag(
        "--chunk-tokens",
        SERVE_GROUP,
        "states are stored in chunks of C tokens: a conversation's next turn writes only its new tokens, and a "
        "prompt shared by several conversations is stored once (0: whole states; 'chunk_tokens' per model in a "
        "config file)",
        int,
        shown=str(DEFAULT_CHUNK_TOKENS),
        metavar="C",
        aliases=("--chunk_tokens",),
    ),
)


class ServeError(Exception):
    """A problem reported as one ``error: ...`` line, exit code 2."""


@dataclass(frozen=True)
class ModelOptions:
    """A model's settings that are sippcache's, not upstream's: its store (`cache_url`:
    None for the server's ``--cache``), how many requests it runs at once
    (`parallel`; 1 is upstream's one request at a time, on upstream's code path),
    how many more may wait (`max_queue`), the prompt tokens a step evaluates
    (`prefill_chunk`), the seconds without a job after which its slots are
    stored (`save_idle`), and the tokens of a stored state's chunks (`chunk_tokens`:
    `CacheOptions.chunk_tokens`, 0 for whole states)."""

    cache_url: str | None = None
    parallel: int = DEFAULT_PARALLEL
    max_queue: int = DEFAULT_MAX_QUEUE
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    save_idle: float = DEFAULT_SAVE_IDLE
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        for name, lowest in (("parallel", 1), ("max_queue", 0), ("prefill_chunk", 32), ("chunk_tokens", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ServeError(f"{name} must be an integer >= {lowest}, not {value!r}")
        if self.prefill_chunk % 32:
            raise ServeError(f"prefill_chunk must be a multiple of 32, not {self.prefill_chunk}")
        idle = self.save_idle
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 <= idle < math.inf:
            raise ServeError(f"save_idle must be a number of seconds >= 0, not {idle!r}")


#: ModelOptions fields a config file's model may set (taken out before upstream validates it).
OPTION_KEYS = tuple(flag.dest for flag in SERVE_FLAGS)  # cache_url, parallel, max_queue, ...


@dataclass(frozen=True)
class Settings:
    """Everything the server runs with: upstream's server and model settings, and each
    model alias's `ModelOptions`."""

    server: ServerSettings
    models: list[ModelSettings]
    options: dict[str, ModelOptions]
    #: Lines to print at start once the server can start (defaults sippcache chose).
    notes: list[str] = field(default_factory=list)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Upstream's parser (every `Settings` field and ``--config_file``), with ``--cache URL``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="llama-cpp-python's OpenAI-compatible server with sippcache's prefix cache. "
        "Every option of `python -m llama_cpp.server` works as there; --cache names the cache.",
        conflict_handler="resolve",  # our --cache URL replaces upstream's boolean --cache
    )
    add_args_from_model(parser, UpstreamSettings)
    parser.add_argument("--config_file", type=str, help="Path to a config file to load.")
    add_flags(parser, SERVE_FLAGS)
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings as upstream reads them, plus each model's `ModelOptions`.

    As upstream: ``$CONFIG_FILE`` wins over ``--config_file``; with a config file,
    the other command-line settings are not used, except ours (``--cache``,
    ``--parallel``, ``--max-queue``, ``--prefill-chunk``, ``--save-idle``, ``--chunk-tokens``), which are the defaults
    of the models that do not set their own. Our keys are taken out of the models
    before upstream's models (which forbid unknown keys) validate them. Unlike
    upstream, ``interrupt_requests`` is off unless set: on, a request waiting for
    the model ends a stream in progress, without an error or a finish reason.
    """
    defaults: dict[str, Any] = {
        name: getattr(args, name)
        for name in OPTION_KEYS
        if name != CACHE_URL_KEY and getattr(args, name, None) is not None
    }
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    try:
        if not config_file:
            server_settings = _settings_from_args(ServerSettings, args)
            model_settings = [_settings_from_args(ModelSettings, args)]
            own: list[dict[str, Any]] = [{}]
        else:
            if not os.path.exists(config_file):
                raise ServeError(f"config file {config_file} not found")
            with open(config_file, "rb") as f:
                if config_file.endswith((".yaml", ".yml")):
                    import yaml

                    raw = yaml.safe_load(f)
                else:
                    raw = json.loads(f.read())
            own = []
            if isinstance(raw, dict) and isinstance(raw.get("models"), list):
                for model in raw["models"]:
                    own.append({k: model.pop(k) for k in OPTION_KEYS if k in model} if isinstance(model, dict) else {})
            config = ConfigFileSettings.model_validate_json(json.dumps(raw))
            server_settings = ServerSettings.model_validate(config)
            model_settings = config.models
    except ServeError:
        raise
    except Exception as exc:  # pydantic's ValidationError, JSON and YAML syntax errors, unreadable files
        raise ServeError(f"invalid settings: {_describe_settings_error(exc)}") from None
    if "interrupt_requests" not in server_settings.model_fields_set:
        server_settings.interrupt_requests = False  # upstream's default cuts streams short, silently
    options: dict[str, ModelOptions] = {}
    notes: list[str] = []
    for settings, mine in zip(model_settings, own, strict=False):
        alias = settings.model_alias or settings.model  # the key LlamaProxy files the model under
        url = mine.pop(CACHE_URL_KEY, None)
        if url is not None and not isinstance(url, (str, bool)):
            raise ServeError(f"{CACHE_URL_KEY} must be a cache URL, not {url!r}")
        url = None if url is None else str(url).lower() if isinstance(url, bool) else url
        try:
            options[alias] = ModelOptions(cache_url=url, **{**defaults, **mine})
        except ServeError as exc:
            raise ServeError(f"model {alias}: {exc}") from None
        if options[alias].parallel > 1 and "flash_attn" not in settings.model_fields_set:
            # One unified KV buffer holds every slot's cells; without flash attention llama.cpp's
            # CPU kernels compute attention over all of them and mask, so a step costs more with
            # every other conversation held (llama-server's default is on, too): docs/serve.md.
            settings.flash_attn = True
            parallel = options[alias].parallel
            notes.append(f"{alias}: flash attention on for --parallel {parallel} (--flash_attn false to turn it off)")
    return Settings(server_settings, model_settings, options, notes)


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


def resolve_cache_value(value: str | None, default: Callable[[], str]) -> str | None:
    """A `--cache`/`cache_url` value: a URL, None or a true word (the default store), a false word (no cache)."""
    if value is None or value.strip().lower() in TRUE_WORDS:
        return default()
    if value.strip().lower() in FALSE_WORDS:
        return None
    return value
