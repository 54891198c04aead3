"""Paged attention layer: writes the new tokens' K/V into this layer's cache, then attends over it.

Under ``torch.compile`` a layer runs as one custom op, ``engine::unified_attention`` (vLLM's design), which
finds the layer's KV cache through the forward context (:func:`forward_context`, set by the model runner
around each forward) by the layer's index instead of taking it as an argument. The K and V caches of
every layer are views of one allocation; passed into the graph, they would be aliased graph inputs that
an op mutates, which inductor (torch 2.13, CPU) gets wrong: it wrote the new K/V of decode steps into a
copy and attention read that copy. Kept out of the graph, the caches are mutated only inside the opaque
op, and the graph sees q/k/v and the batch metadata in, ``out`` written. The index, not the module, is
what the graph holds, so another engine's model of the same shape reuses the compiled graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

import pagedkernels as pk
from engine.layers import pk_ops

# The attention layers of the model whose forward is running (set by forward_context).
_forward_layers: Sequence["Attention"] | None = None
_forward_is_decode = False   # the running forward pass: a pure decode batch (forward_context)


@contextlib.contextmanager
def forward_context(layers: Sequence["Attention"], is_decode: bool) -> Iterator[None]:
    """Makes ``layers`` (a model's attention layers, in order of ``layer_index``) the ones
    ``engine::unified_attention`` runs for the duration of a forward pass, over a batch that is a pure decode or not
    (``AttentionMetadata.is_decode``). The op reads the batch's kind here rather than as an argument, as vLLM's
    attention reads its metadata from its forward context: the compiled graph then does not depend on it, and one
    compile of the model serves the mixed batches and the decode steps (a compile each at a CUDA engine's start-up
    before: the memory profile's batch, then the decode graphs)."""
    global _forward_layers, _forward_is_decode
    previous = _forward_layers, _forward_is_decode
    _forward_layers, _forward_is_decode = layers, is_decode
    try:
        yield
    finally:
        _forward_layers, _forward_is_decode = previous


@torch.library.custom_op("engine::unified_attention", mutates_args=("out",))
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, layer_index: int) -> None:
    """Attention layer ``layer_index`` of the running model on its KV cache: write k/v, attend into ``out``."""
    if _forward_layers is None:
        raise RuntimeError("engine::unified_attention ran outside engine.layers.attention.forward_context")
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
                             cu_seqlens_q=cu_seqlens_q, is_decode=_forward_is_decode)
    _forward_layers[layer_index].attend(q, k, v, meta, out=out)


@unified_attention.register_fake
def _(q, k, v, out, slot_mapping, block_tables, seq_lens, cu_seqlens_q, layer_index) -> None:
    return None


@torch.library.custom_op("engine::unified_attention_rope", mutates_args=("q", "k", "out"))
def unified_attention_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, layer_index: int, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                           eps: float | None) -> None:
    """:func:`unified_attention` with the rotary embedding (after q/k norms when their weights are given) and the K/V
    cache write in one kernel (``pagedkernels.rotary_embedding_and_cache``): q and k are rotated in place."""
    if _forward_layers is None:
        raise RuntimeError("engine::unified_attention_rope ran outside engine.layers.attention.forward_context")
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
                             cu_seqlens_q=cu_seqlens_q, is_decode=_forward_is_decode)
    rope = Rope(positions, cos_sin_cache, q_weight, k_weight, eps)
    _forward_layers[layer_index].attend(q, k, v, meta, out=out, rope=rope)


@unified_attention_rope.register_fake
def _(q, k, v, out, slot_mapping, block_tables, seq_lens, cu_seqlens_q, layer_index, positions,
      cos_sin_cache, q_weight, k_weight, eps) -> None:
    return None


@dataclass(slots=True)
class Rope:
    """The rotary embedding an attention layer applies itself, fused with its K/V cache write
    (``Attention.forward(..., rope=...)``): each token's position, the ``[max_position, rot_dim]`` cos/sin table
    (neox halves), and Qwen3's per-head q/k norm weights and eps (None: no norms)."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened batch, shared by every layer of one forward pass (built by the ModelRunner).

    slot_mapping: int64 ``[num_tokens]``, cache slot (``block_id * block_size + offset``) of each new token.
    block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, entries past a sequence's end unused.
    seq_lens: int32 ``[num_seqs]``, tokens in the cache per sequence once the new ones are written.
    cu_seqlens_q: int32 ``[num_seqs + 1]``, sequence s owns new tokens ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``.
    is_decode: every sequence has exactly one new token.
    skinny: the forward's decoder layers that can (engine/models/llama.py) multiply as few-row products
    (``pagedkernels.skinny_gemm``) with the norms and residual adds fused into them: set by the runner for batches up
    to its ``skinny_max_rows``. A Python bool: torch.compile traces a graph per value.
    """
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    is_decode: bool
    skinny: bool = False


class Attention(nn.Module):
    """Causal attention of the new tokens over their sequences' cached ones.

    The per-model knobs go straight to the pagedkernels ops: ``scale`` multiplies ``q @ k^T`` (default
    ``head_dim ** -0.5``; Gemma 2 uses ``query_pre_attn_scalar ** -0.5``), ``softcap`` then maps each score
    to ``softcap * tanh(score / softcap)`` (Gemma 2's attn_logit_softcapping), and ``sliding_window=W`` lets
    a query at position p see keys ``p - W < k <= p`` (Mistral, Gemma 2's alternate layers, Phi-3).

    A float8 e4m3 cache (kv_cache_dtype="fp8") holds e4m3(k / k_scale) and e4m3(v / v_scale); the ops de-quantize
    in registers. ``k_scale`` / ``v_scale`` are the layer's per-tensor scales, Python floats: 1.0, or the
    checkpoint's (set by the loader, ``kv_scales_loaded``). They reach the ops only for a float8 cache (a cache in
    the model's dtype holds the values themselves) and are read on the host inside the op call, never traced: no
    device tensor, so no host sync under a CUDA graph and nothing for torch.compile to guard on.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale must be positive, got {scale!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap!r}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.softcap = None if softcap is None else float(softcap)
        # Pure-decode batches take the split-K decode kernel where it runs as Triton (CUDA). On CPU
        # the prefill op, which serves 1-token rows too, is the faster PyTorch path (per-sequence
        # SDPA over exactly the cached tokens instead of a padded gather): ~3x at 48 sequences of
        # 30-250 tokens, re-measured against the batched-matmul decode twin. The ModelRunner sets this.
        self.use_decode_kernel = True
        # [num_blocks, block_size, num_kv_heads, head_dim] each; views into the runner's KV cache,
        # bound by ModelRunner before the first forward.
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.layer_index = 0  # position among the model's attention layers, set with the caches
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scales_loaded = False
        # Split-K scratch for the decode op (pagedkernels.decode_workspace), shared by the layers; set by the
        # ModelRunner on CUDA so graph capture sees no allocation. None: the op allocates its own.
        self.decode_workspace: torch.Tensor | None = None
        # Its split counters (pagedkernels.decode_split_counters) where the split kernel merges the splits itself
        # (DevicePolicy.decode_fused_reduce); None: a reduce kernel merges them.
        self.decode_split_counters: torch.Tensor | None = None
        # A decode step given ``rope`` rotates q/k, writes the new K/V and attends in the decode split kernel
        # (pagedkernels.rotary_cache_decode_attention; DevicePolicy.decode_fused_rope, set by the ModelRunner).
        self.decode_fused_rope = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, *,
                rope: Rope | None = None) -> torch.Tensor:
        """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]`` (strided
        views are fine) -> ``[num_tokens, num_heads * head_dim]``. ``rope``: q and k are not rotated yet; the layer
        rotates them in place as it writes the K/V cache (one kernel on CUDA)."""
        if torch.compiler.is_compiling():
            out = q.new_empty(q.shape[0], self.num_heads, self.head_dim)
            if rope is None:
                torch.ops.engine.unified_attention(q, k, v, out, meta.slot_mapping, meta.block_tables,
                                                   meta.seq_lens, meta.cu_seqlens_q, self.layer_index)
            else:
                torch.ops.engine.unified_attention_rope(q, k, v, out, meta.slot_mapping, meta.block_tables,
                                                        meta.seq_lens, meta.cu_seqlens_q, self.layer_index,
                                                        rope.positions, rope.cos_sin_cache,
                                                        rope.q_weight, rope.k_weight, rope.eps)
            return out.view(-1, self.num_heads * self.head_dim)
        return self.attend(q, k, v, meta, rope=rope).view(-1, self.num_heads * self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, *,
               out: torch.Tensor | None = None, rope: Rope | None = None) -> torch.Tensor:
        """The layer's work, eagerly: k/v into the cache (q and k rotated first with ``rope``, in the same kernel),
        attention -> ``[num_tokens, num_heads, head_dim]`` (into ``out`` when given)."""
        ops = pk_ops()
        if self.key_cache.dtype == torch.float8_e4m3fn:
            k_scale, v_scale = self.k_scale, self.v_scale
        else:
            k_scale = v_scale = 1.0
        # `out` only when given: the custom ops (pk_ops under a fake mode) return a new tensor instead.
        into = {} if out is None else {"out": out}
        decode = meta.is_decode and self.use_decode_kernel
        if rope is not None and decode and self.decode_fused_rope:   # q and k read, not rotated in place
            return pk.rotary_cache_decode_attention(
                rope.positions, q, k, v, self.key_cache, self.value_cache, meta.slot_mapping, rope.cos_sin_cache,
                meta.block_tables, meta.seq_lens, q_weight=rope.q_weight, k_weight=rope.k_weight, eps=rope.eps,
                scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
                workspace=self.decode_workspace, k_scale=k_scale, v_scale=v_scale,
                split_counters=self.decode_split_counters, **into)
        if rope is None:
            ops.reshape_and_cache(k, v, self.key_cache, self.value_cache, meta.slot_mapping, k_scale=k_scale,
                                  v_scale=v_scale)
        else:
            pk.rotary_embedding_and_cache(rope.positions, q, k, v, self.key_cache, self.value_cache,
                                          meta.slot_mapping, rope.cos_sin_cache, head_size=self.head_dim,
                                          q_weight=rope.q_weight, k_weight=rope.k_weight, eps=rope.eps,
                                          k_scale=k_scale, v_scale=v_scale)
        if decode:
            return ops.paged_decode_attention(q, self.key_cache, self.value_cache, meta.block_tables, meta.seq_lens,
                                              scale=self.scale, sliding_window=self.sliding_window,
                                              softcap=self.softcap, workspace=self.decode_workspace,
                                              k_scale=k_scale, v_scale=v_scale,
                                              split_counters=self.decode_split_counters, **into)
        return ops.paged_prefill_attention(q, self.key_cache, self.value_cache, meta.block_tables,
                                           meta.cu_seqlens_q, meta.seq_lens, scale=self.scale,
                                           sliding_window=self.sliding_window, softcap=self.softcap,
                                           k_scale=k_scale, v_scale=v_scale, **into)
