"""Rotary position embeddings: the scaling variants of the supported families, partial rotary (the first
`rotary_dim` dimensions of a head rotate, the rest pass through) and Gemma's local base."""

import math
from typing import Any

import torch

from kvserve.model.spec import ROPE_GLOBAL, ROPE_LOCAL, ModelConfig


def inverse_frequencies(
    config: ModelConfig, max_positions: int, kind_of_layer: str = ROPE_GLOBAL
) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies and the factor that scales cos/sin (1.0 except for YaRN and
    LongRoPE). `max_positions`: the longest context served (LongRoPE picks its factors by it). The global
    rope's frequencies are then divided by `config.rope_freq_factors`, where it has them."""
    inv_freq, scale = _scaled(config, max_positions, kind_of_layer)
    if kind_of_layer == ROPE_GLOBAL and config.rope_freq_factors:
        # As llama.cpp applies its rope_freqs tensor: each pair's frequency over its factor.
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq, scale


def _scaled(config: ModelConfig, max_positions: int, kind_of_layer: str) -> tuple[torch.Tensor, float]:
    dim = config.rotary_dim
    base = config.local_rope_theta if kind_of_layer == ROPE_LOCAL else config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = {} if kind_of_layer == ROPE_LOCAL else config.rope_scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(config, scaling)
    if kind == "longrope":
        return _longrope(config, scaling, max_positions)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3, yarn, longrope")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


# Llama 3.x's published scaling, but for its factor (8 for 3.1 and 3.3, 32 for 3.2).
META_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_divisors(config: ModelConfig, scaling: dict[str, Any]) -> torch.Tensor:
    """The per-pair divisors of the frequencies that llama.cpp's converter writes (its rope_freqs) for
    llama3 `scaling`, with its float32 arithmetic: 1 above the high-frequency band, the factor below the
    low one, between them the reciprocal of the smoothed multiplier."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen > context / low, torch.full_like(inv_freq, factor), between)
    return torch.where(wavelen < context / high, torch.ones_like(inv_freq), divisors)


def llama3_of_divisors(config: ModelConfig, divisors: tuple[float, ...]) -> dict[str, Any] | None:
    """The llama3 scaling whose converter divisors are exactly `divisors`, where they are Meta's
    (META_LLAMA3, the factor their largest): transformers' frequencies from it are exact, where the
    divisions by the stored divisors are off by an ulp in the smoothed band. None otherwise."""
    if len(divisors) != config.rotary_dim // 2 or max(divisors) <= 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": "llama3", "factor": max(divisors), **META_LLAMA3}
    expected = llama3_divisors(config, scaling)
    return scaling if torch.equal(expected, torch.tensor(divisors, dtype=torch.float32)) else None


def _yarn(config: ModelConfig, scaling: dict[str, float]) -> tuple[torch.Tensor, float]:
    dim = config.rotary_dim
    base = config.rope_theta
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    # gpt-oss keeps the correction range unrounded (`truncate: false`); the others round it outward.
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = float(max(low, 0)), float(min(high, dim - 1))
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(config: ModelConfig, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-pair factors, the long ones when the served context passes the pretraining
    length. Transformers switches per call on the sequence's length, which would change the KV of every
    cached token as a sequence grows; here the choice is made once from the longest context served, as
    llama.cpp makes it from its context size, so cached KV stays valid (and equals transformers' for
    sequences on the same side of the pretraining length)."""
    dim = config.rotary_dim
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors must number {dim // 2} (rotary dim / 2), not {len(factors)}")
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * config.rope_theta**shape), float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables for the positions below `rows` (default `max_positions`, the longest context
    served; fewer where the KV pool cannot hold that many tokens), looked up per step by position ids.
    `kind_of_layer`: ROPE_GLOBAL (the model's rope) or ROPE_LOCAL (the sliding layers' base)."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        kind_of_layer: str = ROPE_GLOBAL,
        rows: int | None = None,
    ):
        inv_freq, scale = inverse_frequencies(config, max_positions, kind_of_layer)
        positions = max_positions if rows is None else min(rows, max_positions)
        t = torch.arange(positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq.float())
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scale).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, 1, rotary_dim/2], ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + r/2) of the first r = 2 * cos.shape[-1] dimensions of x [tokens, heads,
    head_dim], the Hugging Face (neox) layout; the dimensions past r pass through."""
    rotated = 2 * cos.shape[-1]
    if rotated != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
