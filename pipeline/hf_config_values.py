"""Typed reads of single config.json values, each refusing a value of the wrong type or sign
with the key's name: a broken config fails at load, never as a wrong model."""

from __future__ import annotations

from typing import Any


def positive_int(d: dict[str, Any], key: str) -> int:
    if key not in d:
        raise ValueError(f"config is missing required key {key!r}")
    value = d[key]
    # bool is an int subclass; `true` as a layer count is a broken config, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def positive_float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive number, got {value!r}")
    return float(value)


def flag(d: dict[str, Any], key: str) -> bool:
    """A bool that defaults to False (absent or null)."""
    value = d.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"config key {key!r} must be a bool, got {value!r}")
    return value
