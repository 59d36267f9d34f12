"""The rotary embedding's base and scaling, read from a HF config.json dict: the pre-5 keys
(``rope_theta``, ``rope_scaling``) or transformers 5's ``rope_parameters`` (both in one
dict). Every scaling key is checked against what its ``rope_type`` uses: a key this decoder
would ignore is refused, since the model would then compute something else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.hf_config_values import positive_float, positive_int

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# The scaling keys each rope_type reads, and those of them it cannot do without.
_ALLOWED_KEYS = {
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": tuple(sorted(_ALLOWED_KEYS["llama3"])),
    "yarn": ("original_max_position_embeddings",),
}


@dataclass(frozen=True)
class RopeScaling:
    """config.json's ``rope_scaling`` (``rope_parameters`` since transformers 5), as
    transformers applies it (``transformers.modeling_rope_utils``). ``dynamic`` rescales only
    past ``max_position_embeddings``, which the served context never is, so it computes the
    default rotary there, as transformers does."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None means from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


def rope_from_hf_dict(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling (None: the default rotary)."""
    spec = _rope_spec(d)
    theta_source = spec if "rope_theta" in spec else d
    theta = positive_float(theta_source, "rope_theta", 10000.0)
    spec.pop("rope_theta", None)
    rope_type = spec.pop("rope_type", None) or spec.pop("type", None) or "default"
    spec.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; "
            f"tokenpipe applies {', '.join(ROPE_TYPES)}"
        )
    if spec.pop("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise ValueError("rope_scaling 'partial_rotary_factor' other than 1 is not supported")
    if rope_type == "default":
        if spec:
            raise ValueError(
                f"rope_scaling keys {sorted(spec)} are not supported with the default rotary"
            )
        return theta, None
    _check_keys(rope_type, spec, d)
    values = _scaling_values(spec)
    if rope_type == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ValueError("rope_scaling 'llama3' needs high_freq_factor > low_freq_factor")
    return theta, RopeScaling(rope_type, **values)


def _rope_spec(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of the one scaling dict config.json gives, under either name ({} for none)."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ValueError("config keys 'rope_parameters' and 'rope_scaling' disagree")
    spec = params if params is not None else scaling
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"config key 'rope_scaling' must be an object, got {spec!r}")
    return dict(spec or {})


def _check_keys(rope_type: str, spec: dict[str, Any], d: dict[str, Any]) -> None:
    """Refuse a key ``rope_type`` does not read or a missing one it needs; a yarn ``factor``
    left out follows from the positions (``spec`` gains it)."""
    unknown = sorted(set(spec) - _ALLOWED_KEYS[rope_type])
    if unknown:
        raise ValueError(
            f"rope_scaling keys {unknown} are not supported with rope_type {rope_type!r}"
        )
    if rope_type == "yarn" and spec.get("factor") is None:
        if spec.get("original_max_position_embeddings") is None:
            raise ValueError(
                "rope_scaling 'yarn' needs 'factor' or 'original_max_position_embeddings'"
            )
        spec["factor"] = (
            positive_int(d, "max_position_embeddings") / spec["original_max_position_embeddings"]
        )
    for key in _REQUIRED_KEYS[rope_type]:
        if spec.get(key) is None:
            raise ValueError(f"rope_scaling {rope_type!r} needs {key!r}")


def _scaling_values(spec: dict[str, Any]) -> dict[str, Any]:
    """The set keys, each read as its type (null: the dataclass default)."""
    values: dict[str, Any] = {}
    for key, value in spec.items():
        if value is None:
            continue
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"rope_scaling 'truncate' must be a bool, got {value!r}")
            values[key] = value
        elif key == "original_max_position_embeddings":
            values[key] = positive_int(spec, key)
        else:
            values[key] = positive_float(spec, key, 1.0)
    return values
