"""Paged attention layer: writes the new tokens' K/V into this layer's cache, then attends over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.layers import pk_ops


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened batch, shared by every layer of one forward pass (built by the ModelRunner).

    slot_mapping: int64 ``[num_tokens]``, cache slot (``block_id * block_size + offset``) of each new token.
    block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, entries past a sequence's end unused.
    seq_lens: int32 ``[num_seqs]``, tokens in the cache per sequence once the new ones are written.
    cu_seqlens_q: int32 ``[num_seqs + 1]``, sequence s owns new tokens ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``.
    is_decode: every sequence has exactly one new token.
    """
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    is_decode: bool


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window
        # Pure-decode batches take the split-K decode kernel where it runs as Triton (CUDA). On CPU
        # the prefill op, which serves 1-token rows too, is the faster PyTorch path (per-sequence
        # SDPA over exactly the cached tokens instead of a padded gather): ~3x at 48 sequences of
        # 30-250 tokens, re-measured against the batched-matmul decode twin. The ModelRunner sets this.
        self.use_decode_kernel = True
        # [num_blocks, block_size, num_kv_heads, head_dim] each; views into the runner's KV cache,
        # bound by ModelRunner before the first forward.
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]`` (strided
        views are fine) -> ``[num_tokens, num_heads * head_dim]``."""
        ops = pk_ops()
        ops.reshape_and_cache(k, v, self.key_cache, self.value_cache, meta.slot_mapping)
        if meta.is_decode and self.use_decode_kernel:
            out = ops.paged_decode_attention(q, self.key_cache, self.value_cache, meta.block_tables, meta.seq_lens,
                                             scale=self.scale, sliding_window=self.sliding_window)
        else:
            out = ops.paged_prefill_attention(q, self.key_cache, self.value_cache, meta.block_tables,
                                              meta.cu_seqlens_q, meta.seq_lens, scale=self.scale,
                                              sliding_window=self.sliding_window)
        return out.view(-1, self.num_heads * self.head_dim)
