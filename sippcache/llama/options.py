"""`CacheOptions`: how a llama.cpp layer object uses its store, as one checked value.

`PrefixCache`, `LlamaCache`, `SessionPool` and `SequenceCache` (and through it
`BatchEngine` and ``sippcache serve``) all take the same eight settings. They
are one frozen value, checked once, when it is made, before anything is
opened::

    options = CacheOptions(scope="tenant-a", checkpoint_interval=512)
    PrefixCache(llm, url, options=options)
    SessionPool(model, url, options=options)

The public constructors also take the fields as keywords, which build the
value (``PrefixCache(llm, url, scope="tenant-a")``); passing `options` and
keywords together is a TypeError. Not to be confused with `sippcache.options`,
the coercion of a backend URL's query options.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..frame import Secret
from ..state.chunks import DEFAULT_CHUNK_TOKENS
from ..state.rates import MODES, Mode

__all__ = [
    "DEFAULT_CHECKPOINT_INTERVAL",
    "DEFAULT_MIN_TOKENS",
    "FIELDS",
    "MAX_SCOPE_BYTES",
    "CacheOptions",
    "CacheSettings",
]

DEFAULT_MIN_TOKENS = 16
DEFAULT_CHECKPOINT_INTERVAL = 2048
#: A scope's UTF-8 length limit: its namespace (``llama:<fingerprint>/<scope>``) must
#: fit in a backend's 1,024 bytes, or every lookup and store would fail.
MAX_SCOPE_BYTES = 900


@dataclass(frozen=True)
class CacheOptions:
    """The cache settings of a `PrefixCache`, `LlamaCache`, `SessionPool` or `SequenceCache`.

    - `scope` keeps tenants apart: the same prompt in two scopes never shares
      an entry (a str of at most `MAX_SCOPE_BYTES` UTF-8 bytes);
    - prefixes shorter than `min_tokens` are neither stored nor restored;
    - a long prefill stores a checkpoint every `checkpoint_interval` tokens;
    - at most `max_pending_writes` snapshots wait for the background writer
      before a prefill blocks;
    - with a `secret` (None: `SIPPCACHE_SECRET`, read when the cache is made)
      every entry carries a MAC and entries without a valid one are misses.
      It is left out of `repr`;
    - `restore`: ``"auto"`` restores a stored state only where loading it is
      expected to beat computing its tokens, from the rates this cache measures
      (`sippcache.state.rates`: on a CPU restoring always wins; on a fast GPU it may
      not); ``"always"``; ``"never"`` (states are still stored); None:
      ``SIPPCACHE_RESTORE``, read when the cache is made, else ``"auto"``;
    - `rates_dir`: the folder where those rates are kept for the next process
      with the same model, settings and store on this host, so a restart does
      not restore blindly until it has measured again; None:
      ``SIPPCACHE_RATES_DIR``, else ``rates/`` in the user cache folder
      (`sippcache.state.rates.rates_dir`); ``""``: not kept;
    - `chunk_tokens`: states are stored as chunks of that many tokens and a tail
      (`sippcache.state.chunks`: a chat's next turn writes about its own tokens, and a
      prompt shared by many conversations is stored once); 0 stores every state
      whole. States llama.cpp's format cannot be cut in (recurrent and hybrid
      models) are stored whole whatever it says.

    Bad values raise TypeError (wrong type) or ValueError (out of range),
    naming the option.
    """

    scope: str = "default"
    min_tokens: int = DEFAULT_MIN_TOKENS
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL
    max_pending_writes: int = 4
    secret: Secret | None = field(default=None, repr=False)
    restore: Mode | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    rates_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        scope: Any = self.scope
        if not isinstance(scope, str):
            raise TypeError(f"scope must be a str, not {type(scope).__name__}")
        try:
            size = len(scope.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"scope must be valid text (UTF-8 encodable), got {scope!r}") from None
        if size > MAX_SCOPE_BYTES:
            raise ValueError(f"scope must be at most {MAX_SCOPE_BYTES} bytes (UTF-8), got {size}")
        for name in ("min_tokens", "checkpoint_interval", "max_pending_writes"):
            value: Any = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        chunk_tokens: Any = self.chunk_tokens
        if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool):
            raise TypeError(f"chunk_tokens must be an int, not {type(chunk_tokens).__name__}")
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be at least 0 (0: whole states), got {chunk_tokens}")
        secret: Any = self.secret
        if secret is not None and (not isinstance(secret, (str, bytes)) or not secret):
            raise TypeError(f"secret must be a non-empty str or bytes, not {_describe(secret)}")
        if self.restore is not None and self.restore not in MODES:
            raise ValueError(f"restore must be one of {', '.join(MODES)}, got {self.restore!r}")
        rates_dir: Any = self.rates_dir
        if rates_dir is not None and not isinstance(rates_dir, (str, os.PathLike)):
            raise TypeError(f"rates_dir must be a str or a path, not {type(rates_dir).__name__}")

    def replace(self, **changes: Any) -> CacheOptions:
        """A copy with `changes` (checked as a new value is)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, options: CacheOptions | None, settings: Mapping[str, Any]) -> CacheOptions:
        """The options a constructor was given: `options`, or a value built from its
        keyword `settings` (fields of this class); TypeError for both or a name that
        is not a field."""
        if options is not None:
            if not isinstance(options, CacheOptions):
                raise TypeError(f"options must be a CacheOptions, not {type(options).__name__}")
            if settings:
                raise TypeError(f"pass options= or {', '.join(f'{k}=' for k in settings)} (its fields), not both")
            return options
        unknown = [name for name in settings if name not in FIELDS]
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (cache options: {', '.join(FIELDS)})")
        return cls(**settings)


class CacheSettings(TypedDict, total=False):
    """`CacheOptions`' fields as keyword arguments (``**settings: Unpack[CacheSettings]``)."""

    scope: str
    min_tokens: int
    checkpoint_interval: int
    max_pending_writes: int
    secret: Secret | None
    restore: Mode | None
    chunk_tokens: int
    rates_dir: str | os.PathLike[str] | None


#: The field names, in order.
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CacheOptions))


def _describe(value: Any) -> str:
    return "an empty value" if isinstance(value, (str, bytes)) else type(value).__name__
