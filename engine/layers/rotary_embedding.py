"""Rotary position embedding (neox style, full or partial), with the rope scalings the supported models use."""

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
    plain = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    inv_freqs = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(rope_scaling[key], dtype=torch.float64)
        if ext.shape != plain.shape:
            raise ValueError(f"rope_scaling {key} has {ext.numel()} entries, expected rotary_dim // 2 = "
                             f"{plain.numel()}")
        inv_freqs.append(1.0 / (ext * plain))
    return inv_freqs[0], inv_freqs[1], float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each q and k head in place by position (neox halves);
    the cos/sin table covers ``max_position`` positions.

    LongRoPE (``rope_scaling["rope_type"] == "longrope"``) keeps two tables, short factors then long ones,
    both scaled by the attention factor. transformers picks the set per forward pass: the long one when the
    sequence is longer than ``original_max_position_embeddings`` once the pass's tokens are in. The engine
    makes the same choice per sequence and step (see :meth:`cache_positions`): a prompt prefilled in one
    step and every decode step rotate exactly as transformers' ``generate``; keys cached by earlier steps
    keep the rotation they were written with, as in transformers' cache.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None, *,
                 rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        self.max_position = max_position
        self.longrope_threshold: int | None = None
        # [max_position, rotary_dim] = cat(cos, sin) (LongRoPE: [2 * max_position, ...], short rows first);
        # a buffer so it follows the module's device. float32 whatever the model dtype: the kernels rotate
        # in fp32.
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            short, long, attention_factor = longrope_inv_freqs(rotary_dim, base, rope_scaling)
            cache = torch.cat([pk.compute_cos_sin_cache(max_position, rotary_dim, base, inv_freq=inv_freq,
                                                        dtype=torch.float64) for inv_freq in (short, long)])
            cache = (cache * attention_factor).float()
            self.longrope_threshold = int(rope_scaling["original_max_position_embeddings"])
        else:
            inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling)
            cache = pk.compute_cos_sin_cache(max_position, rotary_dim, base, inv_freq=inv_freq, dtype=torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cache_positions(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor) -> torch.Tensor:
        """The cos/sin rows the batch's tokens rotate by: ``positions`` itself, except with LongRoPE, where a
        token of a sequence holding more than ``original_max_position_embeddings`` tokens after this step
        reads the long table (``position + max_position``). Computed once per forward, for all layers.

        positions int64 ``[num_tokens]``; seq_lens int32 ``[num_seqs]``, cu_seqlens_q int32 ``[num_seqs + 1]``
        (the attention metadata) -> int64 ``[num_tokens]``."""
        if self.longrope_threshold is None:
            return positions
        num_new_tokens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        token_seq_lens = torch.repeat_interleave(seq_lens.long(), num_new_tokens, output_size=positions.shape[0])
        return positions + (token_seq_lens > self.longrope_threshold).long() * self.max_position

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """positions int64 ``[num_tokens]`` (rows of the cos/sin table: :meth:`cache_positions`); q
        ``[num_tokens, num_heads, head_dim]``, k likewise with the KV heads (strided views of the fused qkv
        are fine)."""
        pk_ops().rotary_embedding(positions, q, k, self.cos_sin_cache, is_neox=True)

