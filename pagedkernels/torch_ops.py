"""The pagedkernels ops as torch custom ops (``torch.ops.pagedkernels.*``), so ``torch.compile``
traces a model around them without graph breaks.

Each op is registered with ``torch.library.custom_op``: the real implementation is the public op
(Triton on CUDA, the PyTorch twin or the native kernel on CPU), called eagerly at run time. The fake
implementation, which gives dynamo/inductor (and ``FakeTensorMode``) the output's shape, dtype and
device, is the public op too: on meta or fake tensors a public op runs its argument checks (one
function per op, e.g. ``decode_attention.check_decode_args``, which reads no tensor value) and
allocates its output, nothing else (``_backend.has_no_data``). So a call the device would reject
(a wrong shape, dtype, or a tensor on another device) raises the same ValueError while tracing or
under ``FakeTensorMode``. In-place ops declare what they mutate (``mutates_args``) and return
nothing, as custom ops may not return aliases of their inputs; the wrappers below give back the
same values as the public ops.

Decode attention is two ops, ``paged_decode_attention`` (no workspace, mutates nothing) and
``paged_decode_attention_workspace`` (a caller's split-K workspace, required and declared mutated),
and :func:`paged_decode_attention` here picks one by whether ``workspace`` is given (a third,
``paged_decode_attention_fused_reduce``, takes ``split_counters`` beside the workspace). A single op
with an optional mutated ``Tensor? workspace=None`` breaks when the argument is left out: torch
2.11's ADInplaceOrView kernel indexes the mutated argument past the end of the call's arguments
(IndexError, eager and compiled), and inductor on torch 2.13 fails lowering the op with no
workspace ("getitem is not an OpOverload"). An op that always took a workspace would make the
wrapper allocate one per call (sized by the split heuristic, which depends on the device) or
pass an empty one, which caps the launch at one split; two ops keep both behaviours of the public
op, with nothing allocated for the caller.

The ops read tensor values (seq_lens, cu_seqlens on CPU; value checks) inside their real
implementations, which is fine there: a custom op is opaque to the compiler.
"""

from __future__ import annotations

import torch

from .activation import silu_and_mul as _silu_and_mul
from .cache_ops import reshape_and_cache as _reshape_and_cache
from .decode_attention import paged_decode_attention as _paged_decode_attention
from .fp8_gemm import fp8_gemm as _fp8_gemm
from .fused_moe import fused_moe as _fused_moe
from .gguf_quant import gguf_dequantize as _gguf_dequantize
from .gguf_quant import gguf_gemm as _gguf_gemm
from .lora import add_lora as _add_lora
from .lora import lora_expand as _lora_expand
from .lora import lora_shrink as _lora_shrink
from .moe_align import moe_align_block_size as _moe_align_block_size
from .moe_topk import moe_topk as _moe_topk
from .prefill_attention import paged_prefill_attention as _paged_prefill_attention
from .rms_norm import fused_add_rms_norm as _fused_add_rms_norm
from .rms_norm import rms_norm as _rms_norm
from .rotary import qk_norm_rotary_embedding as _qk_norm_rotary_embedding
from .rotary import rotary_embedding as _rotary_embedding
from .skinny_gemm import skinny_gemm as _skinny_gemm
from .w16_gemm import w16_gemm as _w16_gemm
from .wq_gemm import wq_gemm as _wq_gemm

__all__ = ["reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "fused_add_rms_norm", "rotary_embedding", "qk_norm_rotary_embedding", "silu_and_mul", "wq_gemm",
           "gguf_gemm", "gguf_dequantize", "fp8_gemm", "w16_gemm", "moe_topk", "moe_align_block_size", "fused_moe",
           "lora_shrink", "lora_expand", "add_lora", "skinny_gemm", "OPS"]

# Every op this module registers, by its name under torch.ops.pagedkernels.
OPS = ("reshape_and_cache", "paged_decode_attention", "paged_decode_attention_workspace",
       "paged_decode_attention_fused_reduce", "paged_prefill_attention",
       "rms_norm", "fused_add_rms_norm_", "rotary_embedding", "qk_norm_rotary_embedding", "silu_and_mul", "wq_gemm",
       "gguf_gemm", "gguf_dequantize", "fp8_gemm", "w16_gemm", "moe_topk", "moe_align_block_size", "fused_moe",
       "lora_shrink", "lora_expand_", "add_lora_", "skinny_gemm", "skinny_gemm_residual_")


# -- KV cache -----------------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def _reshape_and_cache_op(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


@_reshape_and_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    # checks only, on fake tensors
    _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """See :func:`pagedkernels.reshape_and_cache`."""
    _reshape_and_cache_op(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


# -- attention ----------------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::paged_decode_attention", mutates_args=())
def _paged_decode_attention_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                               sliding_window: int | None = None, softcap: float | None = None,
                               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)


@_paged_decode_attention_op.register_fake
def _(q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None, k_scale=1.0,
      v_scale=1.0):
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)


@torch.library.custom_op("pagedkernels::paged_decode_attention_workspace", mutates_args=("workspace",))
def _paged_decode_attention_workspace_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                         workspace: torch.Tensor, scale: float | None = None,
                                         sliding_window: int | None = None,
                                         softcap: float | None = None, k_scale: float = 1.0,
                                         v_scale: float = 1.0) -> torch.Tensor:
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, workspace=workspace,
                                   k_scale=k_scale, v_scale=v_scale)


@_paged_decode_attention_workspace_op.register_fake
def _(q, key_cache, value_cache, block_tables, seq_lens, workspace, scale=None, sliding_window=None, softcap=None,
      k_scale=1.0, v_scale=1.0):
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, workspace=workspace,
                                   k_scale=k_scale, v_scale=v_scale)


@torch.library.custom_op("pagedkernels::paged_decode_attention_fused_reduce",
                         mutates_args=("workspace", "split_counters"))
def _paged_decode_attention_fused_reduce_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                            workspace: torch.Tensor, split_counters: torch.Tensor,
                                            scale: float | None = None, sliding_window: int | None = None,
                                            softcap: float | None = None, k_scale: float = 1.0,
                                            v_scale: float = 1.0) -> torch.Tensor:
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, workspace=workspace,
                                   k_scale=k_scale, v_scale=v_scale, split_counters=split_counters)


@_paged_decode_attention_fused_reduce_op.register_fake
def _(q, key_cache, value_cache, block_tables, seq_lens, workspace, split_counters, scale=None, sliding_window=None,
      softcap=None, k_scale=1.0, v_scale=1.0):
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, workspace=workspace,
                                   k_scale=k_scale, v_scale=v_scale, split_counters=split_counters)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           workspace: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.paged_decode_attention`; returns a new ``[num_seqs, num_q_heads, head_dim]``.

    Without ``workspace``: ``torch.ops.pagedkernels.paged_decode_attention`` (the launch allocates its
    own split-K scratch). With it: ``torch.ops.pagedkernels.paged_decode_attention_workspace``, which
    overwrites it (declared mutated) and allocates nothing, as CUDA-graph capture wants; with
    ``split_counters`` too, ``torch.ops.pagedkernels.paged_decode_attention_fused_reduce`` (both declared
    mutated; the counters end at zero again). ``split_counters`` without a workspace is a ValueError here."""
    if split_counters is not None:
        if workspace is None:
            raise ValueError("split_counters needs a workspace under torch.compile (pagedkernels.decode_workspace)")
        return _paged_decode_attention_fused_reduce_op(q, key_cache, value_cache, block_tables, seq_lens, workspace,
                                                       split_counters, scale, sliding_window, softcap, k_scale,
                                                       v_scale)
    if workspace is None:
        return _paged_decode_attention_op(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                          softcap, k_scale, v_scale)
    return _paged_decode_attention_workspace_op(q, key_cache, value_cache, block_tables, seq_lens, workspace, scale,
                                                sliding_window, softcap, k_scale, v_scale)


@torch.library.custom_op("pagedkernels::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """See :func:`pagedkernels.paged_prefill_attention`; returns a new ``[num_tokens, num_q_heads, head_dim]``."""
    return _paged_prefill_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale,
                                    sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)


@paged_prefill_attention.register_fake
def _(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=None, sliding_window=None,
      softcap=None, k_scale=1.0, v_scale=1.0):
    return _paged_prefill_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale,
                                    sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)


# -- norms, rotary, activation ------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`pagedkernels.rms_norm`."""
    return _rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return _rms_norm(x, weight, eps)


@torch.library.custom_op("pagedkernels::fused_add_rms_norm_", mutates_args=("x", "residual"))
def _fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _fused_add_rms_norm(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps) -> None:
    _fused_add_rms_norm(x, residual, weight, eps)  # checks only, on fake tensors


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`pagedkernels.fused_add_rms_norm` (in place; returns ``(x, residual)``)."""
    _fused_add_rms_norm_op(x, residual, weight, eps)
    return x, residual


@torch.library.custom_op("pagedkernels::rotary_embedding", mutates_args=("q", "k"))
def _rotary_embedding_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                         is_neox: bool, head_size: int | None = None) -> None:
    _rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox, head_size=head_size)


@_rotary_embedding_op.register_fake
def _(positions, q, k, cos_sin_cache, is_neox, head_size=None) -> None:
    _rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox, head_size=head_size)  # checks only


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                     is_neox: bool = True, head_size: int | None = None) -> None:
    """See :func:`pagedkernels.rotary_embedding` (q and k both given, rotated in place)."""
    _rotary_embedding_op(positions, q, k, cos_sin_cache, is_neox, head_size)


@torch.library.custom_op("pagedkernels::qk_norm_rotary_embedding", mutates_args=("q", "k"))
def _qk_norm_rotary_embedding_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                 k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, is_neox: bool,
                                 head_size: int | None = None) -> None:
    _qk_norm_rotary_embedding(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox=is_neox,
                              head_size=head_size)


@_qk_norm_rotary_embedding_op.register_fake
def _(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox, head_size=None) -> None:
    _qk_norm_rotary_embedding(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox=is_neox,
                              head_size=head_size)  # checks only


def qk_norm_rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                             k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, *,
                             is_neox: bool = True, head_size: int | None = None) -> None:
    """See :func:`pagedkernels.qk_norm_rotary_embedding` (q and k normalized and rotated in place)."""
    _qk_norm_rotary_embedding_op(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox, head_size)


@torch.library.custom_op("pagedkernels::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See :func:`pagedkernels.silu_and_mul`."""
    return _silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return _silu_and_mul(x)



# -- quantized weights --------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::wq_gemm", mutates_args=())
def _wq_gemm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    return _wq_gemm(x, qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm)


@_wq_gemm_op.register_fake
def _(x, qweight, scales, zeros, bits, group_size, perm=None):
    return _wq_gemm(x, qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm)


def wq_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None, *,
            bits: int, group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.wq_gemm`; returns a new ``[M, N]``."""
    return _wq_gemm_op(x, qweight, scales, zeros, bits, group_size, perm)


@torch.library.custom_op("pagedkernels::gguf_gemm", mutates_args=())
def gguf_gemm(x: torch.Tensor, qweight: torch.Tensor, quant_type: str) -> torch.Tensor:
    """See :func:`pagedkernels.gguf_gemm` (``quant_type`` by name); returns a new ``[M, N]``."""
    return _gguf_gemm(x, qweight, quant_type)


@gguf_gemm.register_fake
def _(x, qweight, quant_type):
    return _gguf_gemm(x, qweight, quant_type)


@torch.library.custom_op("pagedkernels::gguf_dequantize", mutates_args=())
def _gguf_dequantize_op(qweight: torch.Tensor, quant_type: str, dtype: torch.dtype) -> torch.Tensor:
    return _gguf_dequantize(qweight, quant_type, dtype=dtype)


@_gguf_dequantize_op.register_fake
def _(qweight, quant_type, dtype):
    return _gguf_dequantize(qweight, quant_type, dtype=dtype)


def gguf_dequantize(qweight: torch.Tensor, quant_type: str, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """See :func:`pagedkernels.gguf_dequantize`; returns a new ``[N, K]``."""
    return _gguf_dequantize_op(qweight, quant_type, dtype)


@torch.library.custom_op("pagedkernels::fp8_gemm", mutates_args=())
def _fp8_gemm_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 act_scale: torch.Tensor | None = None) -> torch.Tensor:
    return _fp8_gemm(x, weight, weight_scale, act_scale=act_scale)


@_fp8_gemm_op.register_fake
def _(x, weight, weight_scale, act_scale=None):
    return _fp8_gemm(x, weight, weight_scale, act_scale=act_scale)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
             act_scale: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.fp8_gemm`; returns a new ``[M, N]``."""
    return _fp8_gemm_op(x, weight, weight_scale, act_scale)


@torch.library.custom_op("pagedkernels::w16_gemm", mutates_args=())
def w16_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """See :func:`pagedkernels.w16_gemm`; returns a new ``[M, n]``."""
    return _w16_gemm(x, packed, n)


@w16_gemm.register_fake
def _(x, packed, n):
    return _w16_gemm(x, packed, n)


# -- mixture of experts -------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::moe_topk", mutates_args=())
def _moe_topk_op(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                 correction_bias: torch.Tensor | None, num_expert_group: int, topk_group: int,
                 weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _moe_topk(logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias,
                     num_expert_group=num_expert_group, topk_group=topk_group, weights_dtype=weights_dtype)


@_moe_topk_op.register_fake
def _(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group, weights_dtype):
    return _moe_topk(logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias,
                     num_expert_group=num_expert_group, topk_group=topk_group, weights_dtype=weights_dtype)


def moe_topk(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = False,
             correction_bias: torch.Tensor | None = None, num_expert_group: int = 1, topk_group: int = 1,
             weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`pagedkernels.moe_topk`; returns new ``(topk_weights, topk_ids)``."""
    return _moe_topk_op(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
                        weights_dtype)


@torch.library.custom_op("pagedkernels::moe_align_block_size", mutates_args=())
def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`pagedkernels.moe_align_block_size`."""
    return _moe_align_block_size(topk_ids, block_size, num_experts)


@moe_align_block_size.register_fake
def _(topk_ids, block_size, num_experts):
    return _moe_align_block_size(topk_ids, block_size, num_experts)


@torch.library.custom_op("pagedkernels::fused_moe", mutates_args=())
def _fused_moe_op(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, expert_map: torch.Tensor | None) -> torch.Tensor:
    return _fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=activation, expert_map=expert_map)


@_fused_moe_op.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map):
    return _fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=activation, expert_map=expert_map)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu",
              expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.fused_moe`; returns a new ``[num_tokens, hidden_size]``."""
    return _fused_moe_op(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map)


# -- multi-LoRA -----------------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::lora_shrink", mutates_args=())
def _lora_shrink_op(x: torch.Tensor, lora_a: torch.Tensor, token_lora_indices: torch.Tensor, scale: float = 1.0,
                    num_splits: int | None = None, sorted_token_ids: torch.Tensor | None = None,
                    lora_token_starts: torch.Tensor | None = None,
                    lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    return _lora_shrink(x, lora_a, token_lora_indices, scale=scale, num_splits=num_splits,
                        sorted_token_ids=sorted_token_ids, lora_token_starts=lora_token_starts, lora_ranks=lora_ranks)


@_lora_shrink_op.register_fake
def _(x, lora_a, token_lora_indices, scale=1.0, num_splits=None, sorted_token_ids=None, lora_token_starts=None,
      lora_ranks=None):
    return _lora_shrink(x, lora_a, token_lora_indices, scale=scale, num_splits=num_splits,
                        sorted_token_ids=sorted_token_ids, lora_token_starts=lora_token_starts, lora_ranks=lora_ranks)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora_indices: torch.Tensor, *, scale: float = 1.0,
                num_splits: int | None = None, sorted_token_ids: torch.Tensor | None = None,
                lora_token_starts: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.lora_shrink`; returns a new float32 ``[num_tokens, S*R]``."""
    return _lora_shrink_op(x, lora_a, token_lora_indices, scale, num_splits, sorted_token_ids, lora_token_starts,
                           lora_ranks)


@torch.library.custom_op("pagedkernels::lora_expand_", mutates_args=("out",))
def _lora_expand_op(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor, out: torch.Tensor,
                    slice_sizes: list[int] | None = None, sorted_token_ids: torch.Tensor | None = None,
                    lora_token_starts: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> None:
    _lora_expand(buffer, lora_b, token_lora_indices, out, slice_sizes=slice_sizes, sorted_token_ids=sorted_token_ids,
                 lora_token_starts=lora_token_starts, lora_ranks=lora_ranks)


@_lora_expand_op.register_fake
def _(buffer, lora_b, token_lora_indices, out, slice_sizes=None, sorted_token_ids=None,
      lora_token_starts=None, lora_ranks=None) -> None:
    _lora_expand(buffer, lora_b, token_lora_indices, out, slice_sizes=slice_sizes, sorted_token_ids=sorted_token_ids,
                 lora_token_starts=lora_token_starts, lora_ranks=lora_ranks)  # checks only, on fake tensors


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor, out: torch.Tensor, *,
                slice_sizes=None, sorted_token_ids: torch.Tensor | None = None,
                lora_token_starts: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.lora_expand` (``out`` updated in place and returned)."""
    _lora_expand_op(buffer, lora_b, token_lora_indices, out, None if slice_sizes is None else list(slice_sizes),
                    sorted_token_ids, lora_token_starts, lora_ranks)
    return out


@torch.library.custom_op("pagedkernels::add_lora_", mutates_args=("out",))
def _add_lora_op(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor,
                 out: torch.Tensor, scale: float = 1.0, slice_sizes: list[int] | None = None,
                 num_splits: int | None = None, sorted_token_ids: torch.Tensor | None = None,
                 lora_token_starts: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> None:
    _add_lora(x, lora_a, lora_b, token_lora_indices, out, scale=scale, slice_sizes=slice_sizes, num_splits=num_splits,
              sorted_token_ids=sorted_token_ids, lora_token_starts=lora_token_starts, lora_ranks=lora_ranks)


@_add_lora_op.register_fake
def _(x, lora_a, lora_b, token_lora_indices, out, scale=1.0, slice_sizes=None, num_splits=None,
      sorted_token_ids=None, lora_token_starts=None, lora_ranks=None) -> None:
    _add_lora(x, lora_a, lora_b, token_lora_indices, out, scale=scale, slice_sizes=slice_sizes, num_splits=num_splits,
              sorted_token_ids=sorted_token_ids, lora_token_starts=lora_token_starts,
              lora_ranks=lora_ranks)  # checks only, on fake tensors


def add_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor,
             out: torch.Tensor, *, scale: float = 1.0, slice_sizes=None, num_splits: int | None = None,
             sorted_token_ids: torch.Tensor | None = None, lora_token_starts: torch.Tensor | None = None,
             lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.add_lora` (``out`` updated in place and returned)."""
    _add_lora_op(x, lora_a, lora_b, token_lora_indices, out, scale, None if slice_sizes is None else list(slice_sizes),
                 num_splits, sorted_token_ids, lora_token_starts, lora_ranks)
    return out


# -- few-row GEMM (decode at small batch) ----------------------------------------------------------
# Two ops, as decode attention's: the product returned (mutates nothing), or added into a residual (mutated).

@torch.library.custom_op("pagedkernels::skinny_gemm", mutates_args=())
def _skinny_gemm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float | None = None,
                    gated: str | None = None) -> torch.Tensor:
    return _skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated)


@_skinny_gemm_op.register_fake
def _(x, weight, bias=None, norm_weight=None, eps=None, gated=None):
    return _skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated)


@torch.library.custom_op("pagedkernels::skinny_gemm_residual_", mutates_args=("residual",))
def _skinny_gemm_residual_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                             bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                             eps: float | None = None, gated: str | None = None) -> None:
    _skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)


@_skinny_gemm_residual_op.register_fake
def _(x, weight, residual, bias=None, norm_weight=None, eps=None, gated=None) -> None:
    _skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)  # checks only


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm_weight: torch.Tensor | None = None, eps: float | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.skinny_gemm` (with ``residual``: added into it in place, and it is returned)."""
    if residual is None:
        return _skinny_gemm_op(x, weight, bias, norm_weight, eps, gated)
    _skinny_gemm_residual_op(x, weight, residual, bias, norm_weight, eps, gated)
    return residual
