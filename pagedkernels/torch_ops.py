"""The pagedkernels ops as torch custom ops (``torch.ops.pagedkernels.*``), so ``torch.compile``
traces a model around them without graph breaks.

Each op is registered with ``torch.library.custom_op``: the real implementation is the public op
(Triton on CUDA, the PyTorch twin on CPU), called eagerly at run time; a fake implementation gives
dynamo/inductor the output's shape, dtype and device without running it. In-place ops declare what
they mutate (``mutates_args``) and return nothing, as custom ops may not return aliases of their
inputs; the wrappers below give back the same values as the public ops.

The ops read tensor values (seq_lens, cu_seqlens on CPU; value checks) inside their
implementations, which is fine there: a custom op is opaque to the compiler.
"""

from __future__ import annotations

import torch

from .activation import silu_and_mul as _silu_and_mul
from .cache_ops import reshape_and_cache as _reshape_and_cache
from .decode_attention import paged_decode_attention as _paged_decode_attention
from .prefill_attention import paged_prefill_attention as _paged_prefill_attention
from .rms_norm import fused_add_rms_norm as _fused_add_rms_norm
from .rms_norm import rms_norm as _rms_norm
from .rotary import rotary_embedding as _rotary_embedding

__all__ = ["reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"]


# -- KV cache -----------------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """See :func:`pagedkernels.reshape_and_cache`."""
    _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


# -- attention ----------------------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::paged_decode_attention", mutates_args=("workspace",))
def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           workspace: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.paged_decode_attention`; returns a new ``[num_seqs, num_q_heads, head_dim]``.
    ``workspace`` is scratch the op overwrites (declared mutated)."""
    return _paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap, workspace=workspace)


@paged_decode_attention.register_fake
def _(q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
      workspace=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("pagedkernels::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """See :func:`pagedkernels.paged_prefill_attention`; returns a new ``[num_tokens, num_q_heads, head_dim]``."""
    return _paged_prefill_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale,
                                    sliding_window=sliding_window, softcap=softcap)


@paged_prefill_attention.register_fake
def _(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=None, sliding_window=None,
      softcap=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# -- norms, rotary, activation ------------------------------------------------------------------


@torch.library.custom_op("pagedkernels::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`pagedkernels.rms_norm`."""
    return _rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("pagedkernels::fused_add_rms_norm_", mutates_args=("x", "residual"))
def _fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _fused_add_rms_norm(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps) -> None:
    return None


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`pagedkernels.fused_add_rms_norm` (in place; returns ``(x, residual)``)."""
    _fused_add_rms_norm_op(x, residual, weight, eps)
    return x, residual


@torch.library.custom_op("pagedkernels::rotary_embedding", mutates_args=("q", "k"))
def _rotary_embedding_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                         is_neox: bool) -> None:
    _rotary_embedding(positions, q, k, cos_sin_cache, is_neox=is_neox)


@_rotary_embedding_op.register_fake
def _(positions, q, k, cos_sin_cache, is_neox) -> None:
    return None


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                     is_neox: bool = True) -> None:
    """See :func:`pagedkernels.rotary_embedding` (q and k both given, rotated in place)."""
    _rotary_embedding_op(positions, q, k, cos_sin_cache, is_neox)


@torch.library.custom_op("pagedkernels::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See :func:`pagedkernels.silu_and_mul`."""
    return _silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
