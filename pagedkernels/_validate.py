"""Argument checks shared by the ops. Every failure is a ValueError naming the argument and what
was wrong with it, raised before any kernel launch.

Each public op has one function that checks all its arguments from their metadata alone (type,
rank, dtype, device, shape, strides; never a tensor's values): the op calls it first, and so does its
fake implementation (``pagedkernels.torch_ops``), which is the public op itself on fake tensors (see
:func:`pagedkernels._backend.has_no_data`). A call that fails on the device fails in the same way
under ``FakeTensorMode`` or while ``torch.compile`` traces it. Checks that read values (block ids,
sequence lengths, slots) are separate, per op, and run only where there are values to read."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# KV caches: the activation dtypes, or float8 e4m3 with per-layer k/v scales (pagedkernels/_fp8.py).
KV_CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)
# Attention head sizes: every multiple of 16 from 32 to 256. The Triton kernels pad the head
# dimension of their tiles to the next power of two and mask the rest (tl.dot needs power-of-two
# tiles of >= 16); the PyTorch and native kernels take any size and accept the same set, so every
# backend serves the same models.
MIN_HEAD_SIZE, MAX_HEAD_SIZE, HEAD_SIZE_MULTIPLE = 32, 256, 16
ATTENTION_HEAD_SIZES = tuple(range(MIN_HEAD_SIZE, MAX_HEAD_SIZE + 1, HEAD_SIZE_MULTIPLE))


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    like: tuple[str, torch.Tensor] | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Check type, rank, dtype, device and (partially given) shape. ``None`` in ``shape`` is a
    wildcard. ``like=(other_name, other)``: on ``other``'s device (every tensor argument of an op
    shares one device; the message names both). Returns the tensor for chaining."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        if not isinstance(dtypes, (tuple, frozenset, set)):
            dtypes = tuple(dtypes)
        if tensor.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name} must have dtype in ({allowed}), got {str(tensor.dtype).replace('torch.', '')}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on device {device}, got {tensor.device}")
    if like is not None and tensor.device != like[1].device:
        raise ValueError(f"{name} is on {tensor.device} but {like[0]} is on {like[1].device}: the tensor "
                         f"arguments must all be on one device")
    if shape is not None:
        got_shape = tensor.shape
        mismatch = len(got_shape) != len(shape)
        if not mismatch:
            for want, got in zip(shape, got_shape):
                if want is not None and want != got:
                    mismatch = True
                    break
        if mismatch:
            want_str = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want_str}, got {list(tensor.shape)}")
    return tensor


def check_same_dtype(name: str, tensor: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if tensor.dtype != like.dtype:
        raise ValueError(f"{name} must have the same dtype as {like_name} ({like.dtype}), got {tensor.dtype}")


def check_head_size(name: str, head_size: int) -> None:
    if head_size not in ATTENTION_HEAD_SIZES:
        raise ValueError(f"{name}: head size {head_size} is not supported; supported: multiples of "
                         f"{HEAD_SIZE_MULTIPLE} from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}")


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Returns the query-heads-per-KV-head group size."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q: num_q_heads ({num_q_heads}) must be a multiple of the caches' num_kv_heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_kv_caches(key_cache: object, value_cache: object, *,
                    like: tuple[str, torch.Tensor] | None = None) -> tuple[int, int, int, int]:
    """key_cache/value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype (one of
    KV_CACHE_DTYPES) and device (``like``'s, when given). Returns their shape."""
    check_tensor("key_cache", key_cache, ndim=4, dtypes=KV_CACHE_DTYPES, like=like)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=KV_CACHE_DTYPES, like=("key_cache", key_cache),
                 shape=tuple(key_cache.shape))
    check_same_dtype("value_cache", value_cache, "key_cache", key_cache)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must be contiguous in their last (head_dim) dimension")
    return tuple(key_cache.shape)


def check_attention_options(scale: object, sliding_window: object, softcap: object) -> None:
    """The scalar options every attention op takes: ``scale`` and ``softcap`` positive numbers,
    ``sliding_window`` a positive int; each may be None."""
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def check_cache_dtype(cache_name: str, cache: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """A cache holds ``tensor``'s dtype, or float8 e4m3 (quantized on write, de-quantized on read)."""
    if cache.dtype != torch.float8_e4m3fn:
        check_same_dtype(cache_name, cache, name, tensor)


def check_kv_scales(k_scale: object, v_scale: object, cache: torch.Tensor) -> None:
    """k_scale / v_scale: positive finite numbers; other than 1.0 only for a float8 cache (another cache
    holds the values themselves, so a scale there would be a mistake, not a no-op)."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if value != 1.0 and cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}={value!r} applies to a float8_e4m3fn KV cache only; this cache is "
                             f"{str(cache.dtype).replace('torch.', '')}")
