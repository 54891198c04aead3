"""Rotary position embedding (neox style), with the rope scalings the supported models use."""

from __future__ import annotations

import math

import torch
from torch import nn

import pagedkernels as pk
from engine.layers import pk_ops


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """float64 ``[head_dim // 2]`` inverse frequencies ``base ** (-2i / head_dim)``, scaled:

    - ``linear``: all divided by ``factor``.
    - ``llama3`` (Llama 3.1): with wavelength ``2 pi / f`` and ``L = original_max_position_embeddings``,
      frequencies of wavelength above ``L / low_freq_factor`` are divided by ``factor``, those below
      ``L / high_freq_factor`` kept, and those in between interpolated with
      ``s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
      ``f' = (1 - s) f / factor + s f``.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_scaling is None:
        return inv_freq
    rope_type, factor = rope_scaling["rope_type"], float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
    old_context_len = float(rope_scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_context_len / high) & (wavelen <= old_context_len / low)
    return torch.where(medium, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by position; the cos/sin table covers ``max_position`` positions."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        # [max_position, head_dim] = cat(cos, sin); a buffer so it follows the module's device.
        # Kept in float32 whatever the model dtype: the kernels rotate in fp32.
        cache = pk.compute_cos_sin_cache(max_position, head_dim, base, inv_freq=inv_freq, dtype=torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """positions int64 ``[num_tokens]``; q ``[num_tokens, num_heads, head_dim]``, k likewise with
        the KV heads (strided views of the fused qkv are fine)."""
        pk_ops().rotary_embedding(positions, q, k, self.cos_sin_cache, is_neox=True)

