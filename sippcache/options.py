"""Typed URL options: one coercion helper every backend shares.

A backend declares its options as ``{"max_bytes": Size, "sync": bool, ...}``;
`coerce_options` turns the URL's query strings into those types and rejects
unknown names and malformed values with a `BadOption` that says what is
accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from .errors import BadOption


class Size(int):
    """A byte count written as ``512MiB``, ``2GiB``, ``1.5GB``, ``1048576``."""

    _UNITS: ClassVar[dict[str, int]] = {
        "": 1, "b": 1,
        "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
        "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    }  # fmt: skip
    _PATTERN = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")

    @classmethod
    def parse(cls, text: str) -> Size:
        match = cls._PATTERN.fullmatch(text)
        unit = cls._UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None or len(match.group(1)) > 30:
            raise ValueError(f"{text!r} is not a size (examples: 1048576, 512MiB, 2GiB, 1.5GB)")
        return cls(int(float(match.group(1)) * unit))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_DESCRIPTIONS = {
    Size: "a size such as 512MiB or 2GiB",
    int: "a whole number",
    float: "a number",
    bool: "true/false, yes/no, on/off or 1/0",
    str: "text",
}


def _coerce(kind: type, text: str) -> Any:
    if kind is Size:
        return Size.parse(text)
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise ValueError(text)
    if kind is int:
        return int(text.strip(), 10)
    if kind is float:
        return float(text)
    return kind(text)


def coerce_options(owner: str, raw: Mapping[str, str], spec: Mapping[str, type]) -> dict[str, Any]:
    """Convert `raw` string options to the types in `spec`; BadOption names any problem."""
    out: dict[str, Any] = {}
    for name, text in raw.items():
        kind = spec.get(name)
        if kind is None:
            known = ", ".join(sorted(spec)) or "none"
            raise BadOption(f"{owner} has no option {name!r} (options: {known})")
        try:
            out[name] = _coerce(kind, text)
        except (ValueError, TypeError, OverflowError):
            what = _DESCRIPTIONS.get(kind, kind.__name__)
            raise BadOption(f"option {name!r} of {owner} must be {what}, got {text!r}") from None
    return out
