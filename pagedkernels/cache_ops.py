"""KV-cache block ops: write new tokens into the paged cache, copy blocks (copy-on-write) and
swap blocks between devices.

Cache layout, one pair per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, last
dimension contiguous. A slot is ``block_id * block_size + offset``. Caches hold the activation dtype or
float8 e4m3 (``torch.float8_e4m3fn``): ``reshape_and_cache`` writes e4m3(x / k_scale) there (see
``pagedkernels/_fp8.py``), and the block copies move its bytes like any other cache's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, use_native, use_triton, value_checks_enabled
from ._fp8 import _float_to_e4m3, is_fp8, quantize_e4m3
from ._validate import FLOAT_DTYPES, KV_CACHE_DTYPES, check_kv_caches, check_kv_scales, check_same_dtype, check_tensor

# Elements one program copies per step: 2048 fp16 = 4 KiB, enough in-flight bytes per program for
# a memory-bound copy while keeping the tile in registers at 4 warps (16 elements per thread).
_COPY_TILE = 2048


# ----------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------


@triton.jit
def _store_heads_to_cache(
    key_row_ptr,  # one token's [num_kv_heads, head_dim] (head stride given)
    value_row_ptr,
    key_dst_ptr,  # the token's slot in each cache: [num_kv_heads, head_dim] (head stride given)
    value_dst_ptr,
    stride_k_head: tl.int64,
    stride_v_head: tl.int64,
    stride_kc_head: tl.int64,
    stride_vc_head: tl.int64,
    k_scale,
    v_scale,
    first_head,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    """Heads ``first_head .. first_head + BLOCK_H`` of one token's key and value into its cache slot (as they are,
    or as e4m3(x / scale) codes for a float8 cache)."""
    offs_h = first_head + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    src_k = key_row_ptr + offs_h[:, None] * stride_k_head + offs_d[None, :]
    src_v = value_row_ptr + offs_h[:, None] * stride_v_head + offs_d[None, :]
    dst_k = key_dst_ptr + offs_h[:, None] * stride_kc_head + offs_d[None, :]
    dst_v = value_dst_ptr + offs_h[:, None] * stride_vc_head + offs_d[None, :]
    if FP8:
        tl.store(dst_k, _float_to_e4m3(tl.load(src_k, mask=mask).to(tl.float32) / k_scale), mask=mask)
        tl.store(dst_v, _float_to_e4m3(tl.load(src_v, mask=mask).to(tl.float32) / v_scale), mask=mask)
    else:
        tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
        tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; uint8 view of an fp8 cache
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; uint8 view of an fp8 cache
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale,  # float, FP8 only: the cache holds e4m3(key / k_scale)
    v_scale,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_kc_blk: tl.int64,
    stride_kc_slot: tl.int64,
    stride_kc_head: tl.int64,
    stride_vc_blk: tl.int64,
    stride_vc_slot: tl.int64,
    stride_vc_head: tl.int64,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,  # heads per program (power of two)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    FP8: tl.constexpr,  # the caches are float8 e4m3 (as uint8 codes)
):
    token = tl.program_id(0).to(tl.int64)
    head_chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    block_id = slot // block_size
    block_offset = slot % block_size
    _store_heads_to_cache(key_ptr + token * stride_k_tok, value_ptr + token * stride_v_tok,
                          key_cache_ptr + block_id * stride_kc_blk + block_offset * stride_kc_slot,
                          value_cache_ptr + block_id * stride_vc_blk + block_offset * stride_vc_slot,
                          stride_k_head, stride_v_head, stride_kc_head, stride_vc_head, k_scale, v_scale,
                          head_chunk * BLOCK_H, num_kv_heads, head_dim, BLOCK_H, BLOCK_D, FP8)


def check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0,
                                 v_scale=1.0) -> tuple[int, int, int, int]:
    """Every check of :func:`reshape_and_cache`'s arguments that reads no tensor value, shared with its
    fake implementation. Returns the caches' shape."""
    check_tensor("key", key, ndim=3)
    on_key = ("key", key)
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_caches(key_cache, value_cache, like=on_key)
    check_tensor("key", key, shape=(None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor("value", value, like=on_key, shape=(num_tokens, num_kv_heads, head_dim))
    if is_fp8(key_cache):  # quantized on the way in: key and value in one activation dtype
        check_tensor("key", key, dtypes=FLOAT_DTYPES)
        check_same_dtype("value", value, "key", key)
    else:
        check_same_dtype("key", key, "key_cache", key_cache)
        check_same_dtype("value", value, "value_cache", value_cache)
    check_kv_scales(k_scale, v_scale, key_cache)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in their last (head_dim) dimension")
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), like=on_key, shape=(num_tokens,))
    return num_blocks, block_size, num_kv_heads, head_dim


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key/value into its cache slot, in place.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the caches (either dtype for
        float8 caches); may be strided views (e.g. slices of a fused qkv projection) as long as the
        last dimension is contiguous.
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; fp16/bf16/fp32, or
        ``torch.float8_e4m3fn``, which stores e4m3(clamp(x / scale, -448, 448)) rounded to nearest even.
    slot_mapping: int64 ``[num_tokens]``; slot = ``block_id * block_size + offset``; a negative
        slot skips the token (padding).
    k_scale, v_scale: the float8 cache's per-layer scales (1.0, or the checkpoint's); must stay 1.0
        for other caches.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_reshape_and_cache_args(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    fp8 = is_fp8(key_cache)
    num_tokens = key.shape[0]
    if has_no_data(key, value, key_cache, value_cache, slot_mapping) or num_tokens == 0:
        return  # nothing to write (meta or fake tensors: checked only, the fake implementation)
    # The native kernel checks the slots itself, in the pass that writes (nothing written on failure).
    native = (not use_triton(key_cache) and use_native(key_cache)
              and (not fp8 or head_dim <= _native.MAX_HEAD_DIM))  # fp8 rows convert in a fixed buffer
    has_padding = None  # known only where values are read
    if value_checks_enabled(slot_mapping) and not native:
        has_padding = _check_slots(slot_mapping, num_blocks, block_size)

    if use_triton(key_cache):
        block_h, block_d = cache_write_tile(num_kv_heads, head_dim)
        grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
        _reshape_and_cache_kernel[grid](
            key, value, key_cache.view(torch.uint8) if fp8 else key_cache,
            value_cache.view(torch.uint8) if fp8 else value_cache, slot_mapping.contiguous(),
            float(k_scale), float(v_scale),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            num_kv_heads, head_dim, block_size,
            BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8,
        )
        return
    if native:
        if not _native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
            _check_slots(slot_mapping, num_blocks, block_size)
            raise RuntimeError("pagedkernels native reshape_and_cache rejected slot_mapping the checks accept")
        return

    # Torch twin: index_copy_ of whole token rows into a [num_slots, num_kv_heads, head_dim] view of
    # the cache. Padding (negative slots) is dropped first; boolean indexing syncs on CUDA, where
    # this is the reference path only.
    if has_padding is None or has_padding:
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if fp8:  # index_copy_ has no float8 kernels: copy the codes as bytes
        key, value = quantize_e4m3(key, k_scale).view(torch.uint8), quantize_e4m3(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
    else:
        block_ids, offsets = slot_mapping // block_size, slot_mapping % block_size
        key_cache[block_ids, offsets] = key
        value_cache[block_ids, offsets] = value


def _check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> bool:
    """Raise if a slot is past the cache; returns whether there is padding (a negative slot)."""
    min_slot, max_slot = (int(x) for x in torch.aminmax(slot_mapping))
    if max_slot >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping: slot {max_slot} is out of range for a cache of {num_blocks} blocks x {block_size} slots")
    return min_slot < 0


# ----------------------------------------------------------------------------------------------
# copy_blocks
# ----------------------------------------------------------------------------------------------


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs,  # [2 * num_layers] int64: data_ptr of key_caches[0..L) then value_caches[0..L)
    typed_ptr,  # any cache; only its element type is used, to cast the raw addresses
    block_mapping_ptr,  # [num_pairs, 2] int64 (src, dst)
    stride_blk: tl.int64,  # elements per block in every cache (block stride)
    block_numel,  # block_size * num_kv_heads * head_dim
    TILE: tl.constexpr,
):
    cache = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs + cache).to(typed_ptr.dtype)
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    offs = chunk.to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE]
    mask = offs < block_numel
    vals = tl.load(base + src * stride_blk + offs, mask=mask)
    tl.store(base + dst * stride_blk + offs, vals, mask=mask)


@functools.lru_cache(maxsize=16)
def _pointer_table(data_ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Device int64 tensor of cache base addresses. Caches are allocated once per engine, so this
    host-to-device copy happens once, not per step; keyed on the addresses themselves, a cached
    table can never be stale."""
    return torch.tensor(data_ptrs, dtype=torch.int64).to(device)


def _launch_copy_blocks(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    first = caches[0]
    block_numel = first[0].numel()
    tile = min(_COPY_TILE, triton.next_power_of_2(block_numel))
    cache_ptrs = _pointer_table(tuple(c.data_ptr() for c in caches), first.device)
    # Caches on axis 0, pairs on axis 1 (CUDA allows 65535 there; a step's copy-on-write pairs
    # are far fewer), tiles of one block on axis 2.
    grid = (len(caches), block_mapping.shape[0], triton.cdiv(block_numel, tile))
    _copy_blocks_kernel[grid](cache_ptrs, first, block_mapping, first.stride(0), block_numel, TILE=tile)


def check_copy_blocks_args(key_caches, value_caches, block_mapping) -> None:
    """Every check of :func:`copy_blocks`'s arguments that reads no tensor value."""
    if not isinstance(key_caches, (list, tuple)) or len(key_caches) == 0:
        raise ValueError("key_caches must be a non-empty list of tensors")
    if not isinstance(value_caches, (list, tuple)) or len(value_caches) != len(key_caches):
        raise ValueError(f"value_caches must be a list with one tensor per layer ({len(key_caches)})")
    first = check_tensor("key_caches[0]", key_caches[0], ndim=4, dtypes=KV_CACHE_DTYPES)
    on_first = ("key_caches[0]", first)
    for kind, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        for layer, cache in enumerate(caches):
            name = f"{kind}[{layer}]"
            check_tensor(name, cache, like=on_first, shape=tuple(first.shape))
            check_same_dtype(name, cache, "key_caches[0]", first)
            if not cache.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
    check_tensor("block_mapping", block_mapping, dtypes=(torch.int64,), like=on_first, shape=(None, 2))


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks within each layer's caches (copy-on-write), all layers in one launch.

    key_caches, value_caches: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor per
        layer, all contiguous with the same shape, dtype and device.
    block_mapping: int64 ``[num_pairs, 2]`` of (src, dst) block ids, on the caches' device.
        Destinations must be distinct and must not be sources (so pairs are independent).
    """
    check_copy_blocks_args(key_caches, value_caches, block_mapping)
    first = key_caches[0]
    if has_no_data(block_mapping, *key_caches, *value_caches):
        return  # meta or fake tensors: checked, nothing to copy
    num_blocks = first.shape[0]
    num_pairs = block_mapping.shape[0]
    if value_checks_enabled(block_mapping) and num_pairs > 0:
        if int(block_mapping.min()) < 0 or int(block_mapping.max()) >= num_blocks:
            raise ValueError(f"block_mapping: block ids must lie in [0, {num_blocks})")
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        if dst.unique().numel() != num_pairs or bool(torch.isin(dst, src).any()):
            raise ValueError("block_mapping: destination blocks must be distinct and not be sources")
    if num_pairs == 0:
        return

    caches = list(key_caches) + list(value_caches)
    if is_fp8(first):  # bytes: no float8 index_copy_, and no fp8e4nv type in Triton on sm_80
        caches = [cache.view(torch.uint8) for cache in caches]
    if use_triton(first):
        _launch_copy_blocks(caches, block_mapping.contiguous())
        return

    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))


# ----------------------------------------------------------------------------------------------
# swap_blocks
# ----------------------------------------------------------------------------------------------


def check_swap_blocks_args(src, dst, block_mapping) -> None:
    """Every check of :func:`swap_blocks`'s arguments that reads no tensor value."""
    check_tensor("src", src, dtypes=KV_CACHE_DTYPES)
    if src.dim() < 1:
        raise ValueError("src must have a leading num_blocks dimension")
    if not isinstance(dst, torch.Tensor) or dst.dim() < 1 or tuple(dst.shape[1:]) != tuple(src.shape[1:]):
        got = list(dst.shape) if isinstance(dst, torch.Tensor) else type(dst).__name__
        raise ValueError(f"dst must have the same per-block shape as src {list(src.shape[1:])}, got {got}")
    check_same_dtype("dst", dst, "src", src)
    check_tensor("block_mapping", block_mapping, dtypes=(torch.int64,), device=torch.device("cpu"),
                 shape=(None, 2))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks ``src[s] -> dst[d]`` for each (s, d) row of ``block_mapping``.

    src, dst: ``[num_blocks_src, ...]`` and ``[num_blocks_dst, ...]`` caches with the same
        per-block shape and dtype, on any devices (typically GPU and pinned CPU memory, either way;
        the same device works too).
    block_mapping: int64 ``[num_pairs, 2]`` (src block, dst block), on the CPU.

    There is no Triton kernel on purpose: a kernel cannot read pageable host memory, and a copy
    between device and host is the DMA (copy) engine's job, which ``Tensor.copy_`` drives. Runs of
    consecutive source and destination blocks are coalesced into one slice copy each. When one
    side is CUDA and the host side is pinned the copies are ``non_blocking`` (enqueued on the
    current stream): synchronize that stream before reading a CPU destination.
    """
    check_swap_blocks_args(src, dst, block_mapping)
    if has_no_data(src, dst, block_mapping) or block_mapping.shape[0] == 0:
        return  # nothing to copy (meta or fake tensors: checked only)
    if int(block_mapping[:, 0].min()) < 0 or int(block_mapping[:, 0].max()) >= src.shape[0]:
        raise ValueError(f"block_mapping: source block ids must lie in [0, {src.shape[0]})")
    if int(block_mapping[:, 1].min()) < 0 or int(block_mapping[:, 1].max()) >= dst.shape[0]:
        raise ValueError(f"block_mapping: destination block ids must lie in [0, {dst.shape[0]})")

    def pinned_or_cuda(t: torch.Tensor) -> bool:
        return t.is_cuda or t.is_pinned()

    non_blocking = (src.is_cuda or dst.is_cuda) and pinned_or_cuda(src) and pinned_or_cuda(dst)
    pairs = block_mapping.tolist()  # on the CPU: no device sync
    run_src, run_dst, run_len = pairs[0][0], pairs[0][1], 1
    for s, d in pairs[1:] + [(None, None)]:
        if s is not None and s == run_src + run_len and d == run_dst + run_len:
            run_len += 1
            continue
        dst[run_dst: run_dst + run_len].copy_(src[run_src: run_src + run_len], non_blocking=non_blocking)
        if s is not None:
            run_src, run_dst, run_len = s, d, 1


def cache_write_tile(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(heads, padded head_dim) of one tile of a token's K/V write: up to 4096 elements (8 KiB of fp16 per tensor),
    so small models write a whole token per program and large ones spread its heads over a few."""
    block_d = triton.next_power_of_2(head_dim)
    return min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d)), block_d
