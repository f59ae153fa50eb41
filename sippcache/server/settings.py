"""The server's settings: parsed exactly as ``python -m llama_cpp.server`` parses them, plus ours.

Upstream's `Settings` fields and ``--config_file`` (JSON or YAML) work as
there. Added: ``--cache URL`` (the store; it takes the place of upstream's
boolean ``--cache``) and, per model in a config file, ``cache_url``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import TypeVar, cast

import xxhash
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings

__all__ = [
    "CACHE_URL_KEY",
    "STATE_SETTINGS",
    "UPSTREAM_CACHE_SETTINGS",
    "ServeError",
    "build_parser",
    "load_settings",
    "resolve_cache_value",
    "scope_for",
]

#: The per-model config file key naming its cache (not an upstream setting).
CACHE_URL_KEY = "cache_url"
#: `--cache` / `cache_url` values that keep upstream's boolean meaning.
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no", "none"})
#: Model settings that change what the KV cache holds and that the model fingerprint
#: (sippcache.llama.fingerprint) does not cover: a model loaded with other values gets
#: another scope, so its entries never mix with the defaults'.
STATE_SETTINGS = (
    "rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx", "kv_overrides", "lora_base",
)  # fmt: skip
#: Upstream's own cache settings: accepted (so config files keep validating), unused.
UPSTREAM_CACHE_SETTINGS = ("cache", "cache_type", "cache_size")


class ServeError(Exception):
    """A problem reported as one ``error: ...`` line, exit code 2."""


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


def resolve_cache_value(value: str | None, default: Callable[[], str]) -> str | None:
    """A `--cache`/`cache_url` value: a URL, None or a true word (the default store), a false word (no cache)."""
    if value is None or value.strip().lower() in TRUE_WORDS:
        return default()
    if value.strip().lower() in FALSE_WORDS:
        return None
    return value
