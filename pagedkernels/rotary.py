"""Rotary position embedding (RoPE), applied in place to q and k."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, pdl_launch, use_native, use_triton, value_checks_enabled
from ._pdl import pdl_wait
from ._validate import FLOAT_DTYPES, check_tensor
from ._fp8 import is_fp8
from .cache_ops import (_check_slots, _store_heads_to_cache, cache_write_tile, check_reshape_and_cache_args,
                        reshape_and_cache)
from .rms_norm import rms_norm


def compute_cos_sin_cache(
    max_position: int,
    rot_dim: int,
    base: float,
    *,
    dtype: torch.dtype = torch.float32,
    inv_freq: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[max_position, rot_dim]`` = ``cat(cos, sin, dim=-1)`` with angle ``pos * inv_freq[i]``.

    inv_freq defaults to ``base ** (-arange(0, rot_dim, 2) / rot_dim)``; pass your own
    ``[rot_dim // 2]`` tensor to apply a scaling scheme (Llama-3, YaRN, ...). Computed in float64 on the CPU
    whatever ``with torch.device(...)`` block the call is in, then moved to ``device`` (default: torch's
    default device, which such a block sets).
    """
    if not isinstance(rot_dim, int) or rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even integer, got {rot_dim!r}")
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position must be a positive integer, got {max_position!r}")
    if inv_freq is None:
        inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64, device="cpu") / rot_dim)
    else:
        check_tensor("inv_freq", inv_freq, ndim=1, shape=(rot_dim // 2,))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64, device="cpu"),
                         inv_freq.to(dtype=torch.float64, device="cpu"))
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    if device is None:   # the default device (a factory function follows `with torch.device(...)`)
        return torch.empty(table.shape, dtype=dtype).copy_(table)
    return table.to(dtype=dtype, device=device)


@triton.jit
def _pair_offsets(half, IS_NEOX: tl.constexpr, HALF_PAD: tl.constexpr):
    """A head's rotated pairs as two [HALF_PAD] offset vectors: neox (d, d + half), GPT-J (2d, 2d + 1)."""
    offs_d = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        offs_1 = offs_d
        offs_2 = offs_d + half
    else:
        offs_1 = 2 * offs_d
        offs_2 = 2 * offs_d + 1
    return offs_1, offs_2


@triton.jit
def _token_cos_sin(positions_ptr, token, cos_sin_ptr, stride_cs_pos, half, HALF_PAD: tl.constexpr):
    """cos and sin ([HALF_PAD] fp32, zero past half) of the token's position, from the cos_sin cache."""
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF_PAD)
    cs_row = cos_sin_ptr + pos * stride_cs_pos
    cos = tl.load(cs_row + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + half + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    base_ptr,  # [num_heads, head_size] for one token (head stride given)
    stride_head: tl.int64,
    num_heads,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr,  # cdiv(num_heads, BLOCK_H), compile-time loop bound
):
    offs_d = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    offs_1, offs_2 = _pair_offsets(half, IS_NEOX, HALF_PAD)
    for head_block in range(NUM_HEAD_BLOCKS):
        offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)  # [BLOCK_H, HALF_PAD]
        row = base_ptr + offs_h[:, None] * stride_head
        x1 = tl.load(row + offs_1[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + offs_2[None, :], mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        o1 = x1f * cos[None, :] - x2f * sin[None, :]
        o2 = x2f * cos[None, :] + x1f * sin[None, :]
        tl.store(row + offs_1[None, :], o1.to(x1.dtype), mask=mask)
        tl.store(row + offs_2[None, :], o2.to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_ptr,  # [num_tokens, num_kv_heads, head_size]  (HAS_K only)
    cos_sin_ptr,  # [max_position, rot_dim]: cos in [:rot_dim/2], sin in [rot_dim/2:]
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_cs_pos: tl.int64,
    num_q_heads,
    num_kv_heads,
    half,  # rot_dim // 2
    IS_NEOX: tl.constexpr,
    HAS_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,  # half padded to a power of two
    Q_HEAD_BLOCKS: tl.constexpr,  # cdiv(num_q_heads, BLOCK_H)
    K_HEAD_BLOCKS: tl.constexpr,  # cdiv(num_kv_heads, BLOCK_H)
):
    """One program per token; cos/sin are loaded once and applied to every q and k head.

    With (x1, x2) a rotated pair (neox: x[d], x[d + rot/2]; GPT-J: x[2d], x[2d + 1]) and
    theta = pos * inv_freq[d]:  x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin  (fp32).
    Dimensions past rot_dim are left untouched (partial rotary).
    """
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(positions_ptr, token, cos_sin_ptr, stride_cs_pos, half, HALF_PAD)
    _rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, cos, sin, half,
                  IS_NEOX, BLOCK_H, HALF_PAD, Q_HEAD_BLOCKS)
    if HAS_K:
        _rotate_heads(k_ptr + token * stride_k_tok, stride_k_head, num_kv_heads, cos, sin, half,
                      IS_NEOX, BLOCK_H, HALF_PAD, K_HEAD_BLOCKS)


@triton.jit
def _norm_rotate_heads(
    base_ptr,  # [num_heads, head_size] for one token (head stride given)
    stride_head: tl.int64,
    num_heads,
    w_ptr,  # [head_size]: the norm's weight
    eps,
    head_size,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,  # head_size - rot_dim padded to a power of two (0: the whole head rotates)
    NUM_HEAD_BLOCKS: tl.constexpr,
):
    """Each head: RMSNorm over its head_size values (fp32 sum of squares, the product with the weight rounded to
    the tensor's dtype, as pagedkernels.rms_norm stores it), then the rotation of _rotate_heads on those rounded
    values. The head is read once and written once."""
    offs_d = tl.arange(0, HALF_PAD)
    offs_1, offs_2 = _pair_offsets(half, IS_NEOX, HALF_PAD)
    d_mask = offs_d < half
    w1 = tl.load(w_ptr + offs_1, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs_2, mask=d_mask, other=0.0).to(tl.float32)
    if REST_PAD > 0:
        offs_r = 2 * half + tl.arange(0, REST_PAD)
        r_mask = offs_r < head_size
        w_r = tl.load(w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    for head_block in range(NUM_HEAD_BLOCKS):
        offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < num_heads
        mask = h_mask[:, None] & d_mask[None, :]
        row = base_ptr + offs_h[:, None] * stride_head
        x1 = tl.load(row + offs_1[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + offs_2[None, :], mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        squares = tl.sum(x1f * x1f + x2f * x2f, axis=1)  # [BLOCK_H]
        if REST_PAD > 0:
            rest_mask = h_mask[:, None] & r_mask[None, :]
            xr = tl.load(row + offs_r[None, :], mask=rest_mask, other=0.0)
            xrf = xr.to(tl.float32)
            squares += tl.sum(xrf * xrf, axis=1)
        rstd = 1.0 / tl.sqrt(squares / head_size + eps)
        n1 = (x1f * rstd[:, None] * w1[None, :]).to(x1.dtype).to(tl.float32)
        n2 = (x2f * rstd[:, None] * w2[None, :]).to(x2.dtype).to(tl.float32)
        tl.store(row + offs_1[None, :], (n1 * cos[None, :] - n2 * sin[None, :]).to(x1.dtype), mask=mask)
        tl.store(row + offs_2[None, :], (n2 * cos[None, :] + n1 * sin[None, :]).to(x2.dtype), mask=mask)
        if REST_PAD > 0:
            tl.store(row + offs_r[None, :], (xrf * rstd[:, None] * w_r[None, :]).to(xr.dtype), mask=rest_mask)


@triton.jit
def _qk_norm_rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_ptr,  # [num_tokens, num_kv_heads, head_size]
    q_weight_ptr,  # [head_size]
    k_weight_ptr,  # [head_size]
    cos_sin_ptr,  # [max_position, rot_dim]
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_cs_pos: tl.int64,
    num_q_heads,
    num_kv_heads,
    head_size,
    half,
    eps,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
    Q_HEAD_BLOCKS: tl.constexpr,
    K_HEAD_BLOCKS: tl.constexpr,
):
    """One program per token: q_norm then rotary on its q heads, k_norm then rotary on its k heads (Qwen3's
    attention), what rms_norm, rms_norm and rotary_embedding do in three launches."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(positions_ptr, token, cos_sin_ptr, stride_cs_pos, half, HALF_PAD)
    _norm_rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, q_weight_ptr, eps, head_size,
                       cos, sin, half, IS_NEOX, BLOCK_H, HALF_PAD, REST_PAD, Q_HEAD_BLOCKS)
    _norm_rotate_heads(k_ptr + token * stride_k_tok, stride_k_head, num_kv_heads, k_weight_ptr, eps, head_size,
                       cos, sin, half, IS_NEOX, BLOCK_H, HALF_PAD, REST_PAD, K_HEAD_BLOCKS)


@triton.jit
def _rotary_cache_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_ptr,  # [num_tokens, num_kv_heads, head_size]
    v_ptr,  # [num_tokens, num_kv_heads, head_size]
    q_weight_ptr,  # [head_size] (NORM)
    k_weight_ptr,  # [head_size] (NORM)
    cos_sin_ptr,  # [max_position, rot_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]; uint8 view of an fp8 cache
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale,
    v_scale,
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_cs_pos: tl.int64,
    stride_kc_blk: tl.int64,
    stride_kc_slot: tl.int64,
    stride_kc_head: tl.int64,
    stride_vc_blk: tl.int64,
    stride_vc_slot: tl.int64,
    stride_vc_head: tl.int64,
    num_q_heads,
    num_kv_heads,
    head_size,
    half,
    eps,
    block_size,
    IS_NEOX: tl.constexpr,
    NORM: tl.constexpr,  # Qwen3's per-head q/k norms first
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
    Q_HEAD_BLOCKS: tl.constexpr,
    K_HEAD_BLOCKS: tl.constexpr,
    CACHE_BLOCK_H: tl.constexpr,
    CACHE_BLOCK_D: tl.constexpr,
    CACHE_HEAD_BLOCKS: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (_backend.programmatic_dependent_launch)
):
    """One program per token: _qk_norm_rotary_kernel's work (or _rotary_kernel's without NORM) on its q and k heads,
    then _reshape_and_cache_kernel's for its k (as just stored) and v: the rotary embedding and the KV-cache write
    of an attention layer in one launch."""
    if USE_PDL:   # q, k and v are the kernel ahead's outputs
        pdl_wait()
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(positions_ptr, token, cos_sin_ptr, stride_cs_pos, half, HALF_PAD)
    k_row = k_ptr + token * stride_k_tok
    if NORM:
        _norm_rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, q_weight_ptr, eps, head_size,
                           cos, sin, half, IS_NEOX, BLOCK_H, HALF_PAD, REST_PAD, Q_HEAD_BLOCKS)
        _norm_rotate_heads(k_row, stride_k_head, num_kv_heads, k_weight_ptr, eps, head_size,
                           cos, sin, half, IS_NEOX, BLOCK_H, HALF_PAD, REST_PAD, K_HEAD_BLOCKS)
    else:
        _rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, cos, sin, half,
                      IS_NEOX, BLOCK_H, HALF_PAD, Q_HEAD_BLOCKS)
        _rotate_heads(k_row, stride_k_head, num_kv_heads, cos, sin, half, IS_NEOX, BLOCK_H, HALF_PAD, K_HEAD_BLOCKS)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:  # a negative slot: padding, nothing cached
        tl.debug_barrier()  # the rotated k, stored by every thread of the program, read back below
        block_id = slot // block_size
        block_offset = slot % block_size
        for head_block in range(CACHE_HEAD_BLOCKS):
            _store_heads_to_cache(k_row, v_ptr + token * stride_v_tok,
                                  key_cache_ptr + block_id * stride_kc_blk + block_offset * stride_kc_slot,
                                  value_cache_ptr + block_id * stride_vc_blk + block_offset * stride_vc_slot,
                                  stride_k_head, stride_v_head, stride_kc_head, stride_vc_head, k_scale, v_scale,
                                  head_block * CACHE_BLOCK_H, num_kv_heads, head_size, CACHE_BLOCK_H, CACHE_BLOCK_D,
                                  FP8)


def _as_heads(name: str, t: object, num_tokens: int, head_size: int,
              like: tuple[str, torch.Tensor]) -> torch.Tensor:
    """[num_tokens, num_heads, head_size] view of a 2-D or 3-D q/k (never a copy)."""
    check_tensor(name, t, dtypes=FLOAT_DTYPES, like=like)
    if t.dim() not in (2, 3) or t.shape[0] != num_tokens:
        raise ValueError(f"{name} must have shape [{num_tokens}, num_heads, head_size] or "
                         f"[{num_tokens}, num_heads * head_size], got {list(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    if t.dim() == 3:
        if t.shape[2] != head_size:
            raise ValueError(f"{name}: head size {t.shape[2]} != head_size {head_size}")
        return t
    if t.shape[1] % head_size:
        raise ValueError(f"{name}: last dimension {t.shape[1]} is not a multiple of head_size {head_size}")
    return t.view(num_tokens, t.shape[1] // head_size, head_size)


def check_rotary_args(positions, q, k, cos_sin_cache, head_size=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every check of :func:`rotary_embedding`'s arguments that reads no tensor value, shared with its
    fake implementation. Returns q and k (or None) as ``[num_tokens, num_heads, head_size]`` views."""
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,))
    num_tokens = positions.shape[0]
    on_positions = ("positions", positions)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, like=on_positions)
    max_position, rot_dim = cos_sin_cache.shape
    if rot_dim == 0 or rot_dim % 2:
        raise ValueError(f"cos_sin_cache: rot_dim (last dimension) must be positive and even, got {rot_dim}")
    if cos_sin_cache.stride(-1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dimension")
    if head_size is not None and (isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1):
        raise ValueError(f"head_size must be a positive int or None, got {head_size!r}")
    if head_size is None:
        head_size = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 3 else rot_dim
    if rot_dim > head_size:
        raise ValueError(f"cos_sin_cache: rot_dim {rot_dim} exceeds head_size {head_size}")
    q3 = _as_heads("q", q, num_tokens, head_size, on_positions)
    k3 = None if k is None else _as_heads("k", k, num_tokens, head_size, on_positions)
    if k3 is not None and k3.dtype != q3.dtype:
        raise ValueError(f"k must have the same dtype as q ({q3.dtype}), got {k3.dtype}")
    return q3, k3


def _check_positions(positions: torch.Tensor, max_position: int) -> None:
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_position:
        raise ValueError(f"positions must lie in [0, {max_position}), got values in [{lo}, {hi}]")


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
    head_size: int | None = None,
) -> None:
    """Rotate q and k in place by their tokens' positions.

    positions: int64 ``[num_tokens]`` in ``[0, max_position)``.
    q: ``[num_tokens, num_q_heads, head_size]`` or ``[num_tokens, num_q_heads * head_size]``;
    k: the same with num_kv_heads, or None. Rows may be strided (e.g. views of a fused qkv
        tensor); the last dimension must be contiguous.
    cos_sin_cache: ``[max_position, rot_dim]`` = ``cat(cos, sin, -1)`` (see
        :func:`compute_cos_sin_cache`), float32 or the model dtype. Only the first ``rot_dim``
        dims of each head rotate (partial rotary when ``rot_dim < head_size``).
    is_neox: rotate halves (x[:rot/2], x[rot/2:rot]); False = GPT-J interleaved pairs.
    head_size: needed for 2-D q/k when it differs from rot_dim (defaults to q.shape[-1] for
        3-D q, else rot_dim).
    """
    q3, k3 = check_rotary_args(positions, q, k, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    max_position, rot_dim = cos_sin_cache.shape
    if has_no_data(positions, q, k, cos_sin_cache) or num_tokens == 0:
        return  # nothing to rotate (meta or fake tensors: checked only, the fake implementation)
    # The native kernel checks the positions itself, before it rotates anything.
    native = not use_triton(q3) and use_native(q3) and rot_dim <= _native.MAX_ROTARY_DIM
    if value_checks_enabled(positions) and not native:
        _check_positions(positions, max_position)
    if native:
        if not _native.rotary_embedding(positions, q3, k3, cos_sin_cache, is_neox):
            _check_positions(positions, max_position)
            raise RuntimeError("pagedkernels native rotary_embedding rejected positions the checks accept")
        return

    if use_triton(q3):
        half = rot_dim // 2
        half_pad = triton.next_power_of_2(half)
        num_heads = max(q3.shape[1], 0 if k3 is None else k3.shape[1])
        block_h = _rotary_block_h(num_heads, half_pad)
        k_arg = k3 if k3 is not None else q3
        _rotary_kernel[(num_tokens,)](
            positions.contiguous(), q3, k_arg, cos_sin_cache,
            q3.stride(0), q3.stride(1), k_arg.stride(0), k_arg.stride(1), cos_sin_cache.stride(0),
            q3.shape[1], k_arg.shape[1], half,
            IS_NEOX=bool(is_neox), HAS_K=k3 is not None, BLOCK_H=block_h, HALF_PAD=half_pad,
            Q_HEAD_BLOCKS=triton.cdiv(q3.shape[1], block_h), K_HEAD_BLOCKS=triton.cdiv(k_arg.shape[1], block_h),
        )
        return

    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [num_tokens, rot_dim]
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [num_tokens, 1, rot_dim / 2]
    for t in (q3, k3):
        if t is None:
            continue
        rot = t[..., :rot_dim]
        if is_neox:
            x1, x2 = rot.float().chunk(2, dim=-1)
            rot.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
        else:
            x1, x2 = rot[..., 0::2].float(), rot[..., 1::2].float()
            rot.copy_(torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2))


def check_qk_norm_rotary_args(positions, q, k, q_weight, k_weight, eps, cos_sin_cache,
                              head_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every check of :func:`qk_norm_rotary_embedding`'s arguments that reads no tensor value, shared with its
    fake implementation. Returns q and k as ``[num_tokens, num_heads, head_size]`` views."""
    if k is None:
        raise ValueError("k must be given: qk_norm_rotary_embedding normalizes and rotates q and k")
    q3, k3 = check_rotary_args(positions, q, k, cos_sin_cache, head_size)
    head_size = q3.shape[2]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(name, weight, ndim=1, shape=(head_size,), dtypes=FLOAT_DTYPES, like=("q", q3))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return q3, k3


def qk_norm_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
    head_size: int | None = None,
) -> None:
    """Qwen3's attention inputs in one pass, in place: each q head becomes ``rms_norm(head) * q_weight`` (over
    its head_size values, fp32 sum of squares, rounded to q's dtype as :func:`rms_norm` stores it), then rotated
    by its token's position as :func:`rotary_embedding` rotates; each k head likewise with ``k_weight``.

    The same values as ``q.copy_(rms_norm(q, q_weight, eps)); k.copy_(rms_norm(k, k_weight, eps));
    rotary_embedding(positions, q, k, cos_sin_cache)``, which is what the CPU backends run; on CUDA one Triton
    launch instead of three (a decode step of Qwen3-0.6B is ~420 launches, 56 of them the two norms).

    positions, q, k, cos_sin_cache, is_neox, head_size: as :func:`rotary_embedding` (k required; rows may be
    strided views of a fused qkv tensor). q_weight, k_weight: ``[head_size]``, any float dtype. eps: the norm's.
    """
    q3, k3 = check_qk_norm_rotary_args(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    max_position, rot_dim = cos_sin_cache.shape
    if has_no_data(positions, q, k, q_weight, k_weight, cos_sin_cache) or num_tokens == 0:
        return  # nothing to compute (meta or fake tensors: checked only, the fake implementation)
    head_size = q3.shape[2]
    if not use_triton(q3):
        q3.copy_(rms_norm(q3, q_weight, eps))
        k3.copy_(rms_norm(k3, k_weight, eps))
        rotary_embedding(positions, q3, k3, cos_sin_cache, is_neox=is_neox, head_size=head_size)
        return
    if value_checks_enabled(positions):
        _check_positions(positions, max_position)
    half = rot_dim // 2
    half_pad = triton.next_power_of_2(half)
    rest = head_size - rot_dim
    rest_pad = triton.next_power_of_2(rest) if rest else 0
    num_heads = max(q3.shape[1], k3.shape[1])
    block_h = _norm_rotary_block_h(num_heads, half_pad, rest_pad)
    _qk_norm_rotary_kernel[(num_tokens,)](
        positions.contiguous(), q3, k3, q_weight, k_weight, cos_sin_cache,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin_cache.stride(0),
        q3.shape[1], k3.shape[1], head_size, half, float(eps),
        IS_NEOX=bool(is_neox), BLOCK_H=block_h, HALF_PAD=half_pad, REST_PAD=rest_pad,
        Q_HEAD_BLOCKS=triton.cdiv(q3.shape[1], block_h), K_HEAD_BLOCKS=triton.cdiv(k3.shape[1], block_h),
    )


def check_rotary_and_cache_args(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache,
                                head_size=None, q_weight=None, k_weight=None, eps=None, k_scale=1.0,
                                v_scale=1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every check of :func:`rotary_embedding_and_cache`'s arguments that reads no tensor value. Returns q, k and v
    as ``[num_tokens, num_heads, head_size]`` views."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together (the per-head norms of q and k)")
    if q_weight is not None:
        q3, k3 = check_qk_norm_rotary_args(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, head_size)
    else:
        if eps is not None:
            raise ValueError("eps is the per-head norms': give it with q_weight and k_weight")
        if k is None:
            raise ValueError("k must be given: rotary_embedding_and_cache writes it into key_cache")
        q3, k3 = check_rotary_args(positions, q, k, cos_sin_cache, head_size)
    v3 = _as_heads("v", v, positions.shape[0], q3.shape[2], ("positions", positions))
    check_reshape_and_cache_args(k3, v3, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return q3, k3, v3


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
    head_size: int | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """An attention layer's inputs in one pass: q and k rotated in place (after Qwen3's per-head norms when
    ``q_weight`` / ``k_weight`` / ``eps`` are given), then each token's rotated k and its v written into its cache
    slot. The same values as :func:`qk_norm_rotary_embedding` (or :func:`rotary_embedding`) followed by
    :func:`reshape_and_cache`, which is what the CPU backends run; on CUDA one Triton launch instead of two (the
    decode step of a small model at batch 1 is bound by its launches).

    positions, q, k, cos_sin_cache, is_neox, head_size: as :func:`rotary_embedding`; v like k (strided views of a
    fused qkv are fine). key_cache, value_cache, slot_mapping, k_scale, v_scale: as :func:`reshape_and_cache` (a
    negative slot: nothing cached for that token, its q and k still rotated). q_weight, k_weight, eps: as
    :func:`qk_norm_rotary_embedding`.
    """
    q3, k3, v3 = check_rotary_and_cache_args(positions, q, k, v, key_cache, value_cache, slot_mapping,
                                             cos_sin_cache, head_size, q_weight, k_weight, eps, k_scale, v_scale)
    num_tokens = positions.shape[0]
    if (has_no_data(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, q_weight, k_weight)
            or num_tokens == 0):
        return  # nothing to compute (meta or fake tensors: checked only)
    head_size = q3.shape[2]
    if not use_triton(q3):
        if q_weight is not None:
            qk_norm_rotary_embedding(positions, q3, k3, q_weight, k_weight, eps, cos_sin_cache, is_neox=is_neox,
                                     head_size=head_size)
        else:
            rotary_embedding(positions, q3, k3, cos_sin_cache, is_neox=is_neox, head_size=head_size)
        reshape_and_cache(k3, v3, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    max_position, rot_dim = cos_sin_cache.shape
    if value_checks_enabled(positions):
        _check_positions(positions, max_position)
        _check_slots(slot_mapping, key_cache.shape[0], key_cache.shape[1])
    half = rot_dim // 2
    half_pad = triton.next_power_of_2(half)
    norm = q_weight is not None
    rest = head_size - rot_dim
    rest_pad = triton.next_power_of_2(rest) if rest and norm else 0
    num_heads = max(q3.shape[1], k3.shape[1])
    block_h = _norm_rotary_block_h(num_heads, half_pad, rest_pad) if norm else _rotary_block_h(num_heads, half_pad)
    num_kv_heads = k3.shape[1]
    cache_block_h, cache_block_d = cache_write_tile(num_kv_heads, head_size)
    fp8 = is_fp8(key_cache)
    _rotary_cache_kernel[(num_tokens,)](
        positions.contiguous(), q3, k3, v3, q_weight if norm else cos_sin_cache, k_weight if norm else cos_sin_cache,
        cos_sin_cache, key_cache.view(torch.uint8) if fp8 else key_cache,
        value_cache.view(torch.uint8) if fp8 else value_cache, slot_mapping.contiguous(),
        float(k_scale), float(v_scale),
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        q3.shape[1], num_kv_heads, head_size, half, float(eps) if norm else 0.0, key_cache.shape[1],
        IS_NEOX=bool(is_neox), NORM=norm, FP8=fp8, BLOCK_H=block_h, HALF_PAD=half_pad, REST_PAD=rest_pad,
        Q_HEAD_BLOCKS=triton.cdiv(q3.shape[1], block_h), K_HEAD_BLOCKS=triton.cdiv(num_kv_heads, block_h),
        CACHE_BLOCK_H=cache_block_h, CACHE_BLOCK_D=cache_block_d,
        CACHE_HEAD_BLOCKS=triton.cdiv(num_kv_heads, cache_block_h), **pdl_launch(q3.device),
    )


def _rotary_block_h(num_heads: int, half_pad: int) -> int:
    """Heads a rotary tile takes: up to 2048 pairs (4096 elements), so all heads of common models (32 x 64 pairs) go
    in one step and wide ones keep their registers bounded."""
    return min(triton.next_power_of_2(num_heads), max(1, 2048 // half_pad))


def _norm_rotary_block_h(num_heads: int, half_pad: int, rest_pad: int) -> int:
    """Heads a q/k-norm rotary tile takes, a power of two: up to 4096 values (each head's pairs and the rest of it,
    all live at once for the norm)."""
    fit = max(1, 4096 // (2 * half_pad + rest_pad))
    return min(triton.next_power_of_2(num_heads), 1 << (fit.bit_length() - 1))
