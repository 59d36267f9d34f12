"""Rotary position tables: the inverse frequencies of each ``rope_scaling`` type as
transformers computes them (``transformers.modeling_rope_utils``), in float32 on the CPU so
every device gets bit-identical tables, then cos/sin in HF's rotate_half layout."""

from __future__ import annotations

import math

import torch

from pipeline.model_config import ModelConfig
from pipeline.rope_scaling import RopeScaling


def rotary_tables(cfg: ModelConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim], float32, YaRN's attention factor folded in."""
    inv_freq, attention_factor = inverse_frequencies(cfg)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    d, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    # "dynamic" rescales only past max_position_embeddings: never within the served context.
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling, cfg.max_position_embeddings), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(cfg, scaling)
    raise ValueError(f"rope_scaling type {scaling.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, max_positions: int) -> torch.Tensor:
    old_context = s.original_max_position_embeddings or max_positions
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, s: RopeScaling) -> tuple[torch.Tensor, float]:
    d, base, factor = cfg.head_dim, cfg.rope_theta, s.factor
    original = s.original_max_position_embeddings or cfg.max_position_embeddings
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(
                factor, s.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
