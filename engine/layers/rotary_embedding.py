"""Rotary position embedding (neox style, full or partial), with the rope scalings the supported models use."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

import pagedkernels as pk
from engine.layers import pk_ops

logger = logging.getLogger(__name__)


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """float64 ``[head_dim // 2]`` inverse frequencies (on the CPU, whatever the default device) ``base ** (-2i / head_dim)``, scaled:

    - ``linear``: all divided by ``factor``.
    - ``llama3`` (Llama 3.1): with wavelength ``2 pi / f`` and ``L = original_max_position_embeddings``,
      frequencies of wavelength above ``L / low_freq_factor`` are divided by ``factor``, those below
      ``L / high_freq_factor`` kept, and those in between interpolated with
      ``s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
      ``f' = (1 - s) f / factor + s f``.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "longrope":
        raise ValueError("longrope has two frequency sets: use longrope_inv_freqs")
    factor = float(rope_scaling["factor"])
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


def longrope_inv_freqs(rotary_dim: int, base: float, rope_scaling: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3, "su" in older configs), as transformers computes it: float64 ``[rotary_dim // 2]``
    inverse frequencies ``1 / (ext[i] * base ** (2i / rotary_dim))`` with ``ext`` = ``short_factor`` (the
    short set) or ``long_factor`` (the long set), and the factor cos and sin are both multiplied by:
    ``attention_factor`` if given, else ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``
    (1 when ``factor <= 1``), ``factor`` being max_position_embeddings / original_max_position_embeddings
    unless the config names it. Returns (short inv_freq, long inv_freq, attention factor)."""
    original = float(rope_scaling["original_max_position_embeddings"])
    factor = float(rope_scaling["factor"])
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    plain = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim)
    inv_freqs = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(rope_scaling[key], dtype=torch.float64, device="cpu")
        if ext.shape != plain.shape:
            raise ValueError(f"rope_scaling {key} has {ext.numel()} entries, expected rotary_dim // 2 = "
                             f"{plain.numel()}")
        inv_freqs.append(1.0 / (ext * plain))
    return inv_freqs[0], inv_freqs[1], float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each q and k head in place by position (neox halves);
    the cos/sin table covers ``max_position`` positions (the engine's max_model_len).

    LongRoPE (``rope_scaling["rope_type"] == "longrope"``) uses one factor set for every token: the long one
    when the table reaches past ``original_max_position_embeddings`` (max_model_len above it), else the short
    one, both with the attention factor on cos and sin. transformers rotates a whole sequence with the long
    set once it is longer than the original context and the short one before (its Phi-3 ``generate`` drops
    the KV cache and recomputes the sequence at the crossing). A paged cache cannot recompute a sequence's
    blocks (they may be shared through the prefix cache), so the set is chosen per engine, as vLLM does:
    every sequence matches transformers exactly when max_model_len <= the original context (all short) and
    every sequence longer than the original context matches it in a long-context engine; only shorter
    sequences in a long-context engine rotate by the long set where transformers would use the short one.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None, *,
                 rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        self.uses_long_factors = False
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            short, long, attention_factor = longrope_inv_freqs(rotary_dim, base, rope_scaling)
            original = int(rope_scaling["original_max_position_embeddings"])
            self.uses_long_factors = max_position > original
            inv_freq = long if self.uses_long_factors else short
            if self.uses_long_factors:
                logger.warning("LongRoPE: max_model_len %d is past the original context %d, so every sequence "
                               "rotates by the long factors (transformers uses the short ones for sequences of "
                               "at most %d tokens); max_model_len <= %d keeps the short ones",
                               max_position, original, original, original)
        else:
            inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, rope_scaling), 1.0
        # [max_position, rotary_dim] = cat(cos, sin), computed in float64 on the CPU; a buffer on the device the
        # module is built on (torch's default device), so it follows the module. float32 whatever the model
        # dtype: the kernels rotate in fp32.
        cache = pk.compute_cos_sin_cache(max_position, rotary_dim, base, inv_freq=inv_freq, dtype=torch.float64,
                                         device="cpu")
        table = torch.empty(cache.shape, dtype=torch.float32)   # on the default device
        self.register_buffer("cos_sin_cache", table.copy_(cache * attention_factor), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """positions int64 ``[num_tokens]``; q ``[num_tokens, num_heads, head_dim]``, k likewise with the KV
        heads (strided views of the fused qkv are fine)."""
        pk_ops().rotary_embedding(positions, q, k, self.cos_sin_cache, is_neox=True)

    def forward_qk_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module,
                        k_norm: nn.Module, *, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head norms of q and k (``q_norm``, ``k_norm``: RMSNorm layers over head_dim), then the
        rotation; returns the new q and k. ``fused`` (default: on CUDA) runs them as one kernel
        (pagedkernels.qk_norm_rotary_embedding, when both norms share their eps) in place on q and k, which may
        be views of the fused qkv: one launch a layer instead of three. Otherwise the norms make new tensors,
        then the rotation runs on those (the CPU's path: its native norm and rotary kernels, each recorded in
        the CPU graph)."""
        if fused is None:
            fused = q.is_cuda
        if fused and q_norm.eps == k_norm.eps:
            pk_ops().qk_norm_rotary_embedding(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps,
                                              self.cos_sin_cache, is_neox=True)
            return q, k
        q, k = q_norm(q), k_norm(k)
        self.forward(positions, q, k)
        return q, k
