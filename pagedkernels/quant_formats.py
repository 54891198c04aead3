"""pagedkernels' canonical layout for weight-only int4/int8 weights, and its conversions from GPTQ, AWQ
and GGUF checkpoints (run once, at load time; plain PyTorch, any device).

The layout (:func:`pagedkernels.wq_gemm` takes it; N output features, K input features)::

    w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g],   g = k // group_size

    qweight  uint8, bits=8: [N, K], qweight[n, k] = q[n, k] (unsigned, 0..255)
                    bits=4: [N, K // 2]; each row is K / 32 blocks of 16 bytes, and byte j of block b
                    holds q[n, 32 b + j] in its low nibble and q[n, 32 b + 16 + j] in its high nibble
                    (GGUF Q4_0's order: one 16-byte load gives a block's first 16 values from the low
                    nibbles and its last 16 from the high ones, each in column order)
    scales   [N, K // group_size] float16 / bfloat16 / float32
    zeros    like scales (a float zero point, usually a whole number), or None: 2 ** (bits - 1)
             (symmetric: 8 for int4, 128 for int8)
    perm     None, or int64 [K]: column k of the weight multiplies x[:, perm[k]] (act-order)

K is a multiple of 32; group_size is a multiple of 32 that divides K, or -1 (one group: per channel).
Rows by output feature keep a row's bytes, scales and zeros together: a CPU dot product streams one row;
the GPU kernel loads [BLOCK_K / 2, BLOCK_N] byte tiles and splits their nibbles into two half-tiles whose
activation columns it loads to match (``wq_gemm._wq_gemm_kernel``).

Conversions (each returns a :class:`WQWeight`; tests check them against the formats' own de-quantization):

- GPTQ (AutoGPTQ / GPTQModel, ``gptq_to_wq``): ``qweight`` int32 [K * bits / 32, N] packs 32 / bits
  values of one output column along K, value i of a word in bits [bits * i, bits * (i + 1)); ``qzeros``
  int32 [groups, N * bits / 32] packs along N the same way; ``scales`` [groups, N]; ``g_idx`` int32 [K]
  (group of input column k). The original format (``checkpoint_format="gptq"``, "v1") stores z - 1, so
  z = (stored + 1) & (2 ** bits - 1), as AutoGPTQ de-quantizes; ``"gptq_v2"`` stores z. Symmetric
  checkpoints store 7 (int4) / 127 (int8), i.e. z = 8 / 128, the default zero point: the conversion then
  gives ``zeros=None``. Act-order (``desc_act=True``): g_idx is no longer k // group_size; sorting the
  columns by g_idx (stable) makes every group contiguous again (each holds group_size columns, as GPTQ
  assigns them), so the canonical weight has its columns in that order and ``perm`` = the sort order:
  the GEMM gathers x's columns by it (one [M, K] gather) and reads groups as usual.
- AWQ (AutoAWQ GEMM packing, ``awq_to_wq``): ``qweight`` int32 [K, N / 8] packs along N: nibble i of word
  c holds output column 8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; ``qzeros`` int32 [groups, N / 8] the same way;
  ``scales`` [groups, N]; z used as stored (no +1). 4-bit only.
- GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K (``gguf_to_wq``, for GPUs, where GGUF's own blocks have no GEMM
  kernel here): one group per block of 32 (a Q4_K sub-block), ``scales`` = d (Q4_K: d * sc), ``zeros``
  = 8 (Q4_0), 128 (Q8_0, as signed bytes + 128), -m / d (Q4_1, Q4_K: dmin * m / (d * sc)), in float32
  by default so the float zero points lose nothing (a block whose scale is 0 is the constant m, stored as
  q = 1, z = 0, s = m). Q6_K (16-value groups of 6-bit values) has none;
  on the CPU every type runs on its own blocks (``pagedkernels.gguf_gemm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GGUF block types -> (values per block, bytes per block), as ggml lays them out (pagedkernels.gguf_quant's formats).
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}

__all__ = ["WQWeight", "pack_int4", "unpack_int4", "quantize_wq", "dequantize_wq", "gptq_to_wq", "awq_to_wq",
           "gguf_to_wq", "AWQ_ORDER"]

BLOCK = 32
# AWQ's GEMM packing: nibble i of a word holds output column 8 c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(slots=True)
class WQWeight:
    """A weight in the canonical layout (see the module docstring); the arguments of ``wq_gemm``."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int  # as given to wq_gemm: a multiple of 32, or -1 for one group per row
    perm: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in the original column order (``perm`` undone)."""
        return dequantize_wq(self.qweight, self.scales, self.zeros, bits=self.bits, group_size=self.group_size,
                             perm=self.perm, dtype=dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 (any integer dtype; K a multiple of 32) -> the canonical ``[N, K // 2]`` uint8."""
    N, K = q.shape
    if K % BLOCK:
        raise ValueError(f"q: K ({K}) must be a multiple of {BLOCK}")
    blocks = q.to(torch.uint8).view(N, K // BLOCK, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The canonical ``[N, K // 2]`` uint8 -> ``[N, K]`` uint8 values 0..15."""
    N, half = qweight.shape
    blocks = qweight.view(N, half // 16, 1, 16)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(N, 2 * half)


def _group(group_size: int, K: int) -> int:
    return K if group_size == -1 else group_size


def quantize_wq(weight: torch.Tensor, *, bits: int, group_size: int, symmetric: bool = False,
                scale_dtype: torch.dtype = torch.float16) -> WQWeight:
    """Round-to-nearest quantization of a float ``[N, K]`` weight into the canonical layout: per group,
    asymmetric min/max (scale = (max - min) / (2**bits - 1), zero = round(-min / scale)) or symmetric
    absmax (scale = max|w| / (2**(bits-1) - 1), zeros None). For tests, benchmarks and quantizing float
    checkpoints on load; GPTQ/AWQ checkpoints come through their conversions instead."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    N, K = weight.shape
    g = _group(group_size, K)
    if K % BLOCK or g % BLOCK or K % g:
        raise ValueError(f"K ({K}) and group_size ({group_size}) must be multiples of {BLOCK}, group_size dividing K")
    w = weight.float().view(N, K // g, g)
    qmax = 2 ** bits - 1
    if symmetric:
        scales = (w.abs().amax(-1) / (2 ** (bits - 1) - 1)).to(scale_dtype)
        s = scales.float().clamp_min(1e-12)[..., None]
        q = (torch.round(w / s) + 2 ** (bits - 1)).clamp(0, qmax)
        zeros = None
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo) / qmax).to(scale_dtype)
        s = scales.float().clamp_min(1e-12)
        zeros = torch.round(-lo / s).clamp(0, qmax).to(scale_dtype)
        q = (torch.round(w / s[..., None]) + zeros.float()[..., None]).clamp(0, qmax)
    q = q.view(N, K).to(torch.uint8)
    return WQWeight(pack_int4(q) if bits == 4 else q, scales, zeros, bits, group_size)


def dequantize_wq(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, bits: int,
                  group_size: int, perm: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The canonical layout de-quantized to ``[N, K]`` (float32 arithmetic, then ``dtype``); with ``perm``
    in the original column order (column perm[k] gets canonical column k). No argument checks: this is
    the formula, used by the PyTorch twin of ``wq_gemm`` (which checks first) and the tests."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    N, K = q.shape
    g = _group(group_size, K)
    s = scales.float().repeat_interleave(g, dim=1)
    z = float(2 ** (bits - 1)) if zeros is None else zeros.float().repeat_interleave(g, dim=1)
    w = (q.float() - z) * s
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm.long(), w)
    return w.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# GPTQ / AWQ
# ---------------------------------------------------------------------------------------------------------


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values (low bits first) spread along ``dim``, int32 0..2**bits-1."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # [..., per_word]
    if dim == 0:
        return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def _check_int32(name: str, t: object, shape: tuple[int, int]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape:
        got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be int32 of shape {list(shape)}, got {got}")


def _to_canonical(q_kn: torch.Tensor, z_gn: torch.Tensor, scales_gn: torch.Tensor, bits: int, group_size: int,
                  perm: torch.Tensor | None, scale_dtype: torch.dtype | None) -> WQWeight:
    """q [K, N] (columns in canonical order already), z and scales [groups, N] -> WQWeight."""
    q = q_kn.t().contiguous().to(torch.uint8)  # [N, K]
    dtype = scale_dtype or scales_gn.dtype
    scales = scales_gn.t().contiguous().to(dtype)
    zeros = None if bool((z_gn == 2 ** (bits - 1)).all()) else z_gn.t().contiguous().to(dtype)
    return WQWeight(pack_int4(q) if bits == 4 else q, scales, zeros, bits, group_size, perm)


def gptq_to_wq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
               g_idx: torch.Tensor | None = None, checkpoint_format: str = "gptq",
               scale_dtype: torch.dtype | None = None) -> WQWeight:
    """A GPTQ linear (see the module docstring) in the canonical layout. ``g_idx`` None (or k // group_size
    for every k) keeps the columns in order; any other grouping is act-order and gives ``perm``."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8 (GPTQ 2/3-bit are not supported), got {bits!r}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    per_word = 32 // bits
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
        raise ValueError("qweight must be a 2-D int32 tensor [K * bits / 32, N]")
    K, N = qweight.shape[0] * per_word, qweight.shape[1]
    g = _group(group_size, K)
    if K % g:
        raise ValueError(f"group_size ({group_size}) must divide K ({K})")
    groups = K // g
    _check_int32("qweight", qweight, (K // per_word, N))
    _check_int32("qzeros", qzeros, (groups, N // per_word))
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (groups, N) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float tensor of shape [{groups}, {N}]")
    q = _unpack_int32(qweight, bits, dim=0)  # [K, N]
    z = _unpack_int32(qzeros, bits, dim=1)  # [groups, N]
    if checkpoint_format == "gptq":
        z = (z + 1) & (2 ** bits - 1)
    perm = None
    if g_idx is not None:
        if not isinstance(g_idx, torch.Tensor) or g_idx.shape != (K,):
            raise ValueError(f"g_idx must be a tensor of shape [{K}]")
        g_idx = g_idx.long().to(q.device)
        in_order = torch.arange(K, device=q.device) // g
        if not torch.equal(g_idx, in_order):
            perm = torch.sort(g_idx, stable=True).indices
            if not torch.equal(g_idx[perm], in_order):
                raise ValueError(f"g_idx does not give every group exactly {g} columns; this layout needs that")
            q = q.index_select(0, perm)
    return _to_canonical(q, z, scales, bits, group_size, perm, scale_dtype)


def awq_to_wq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int,
              scale_dtype: torch.dtype | None = None) -> WQWeight:
    """An AWQ GEMM-packed 4-bit linear (see the module docstring) in the canonical layout."""
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
        raise ValueError("qweight must be a 2-D int32 tensor [K, N / 8]")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    g = _group(group_size, K)
    if K % g:
        raise ValueError(f"group_size ({group_size}) must divide K ({K})")
    _check_int32("qweight", qweight, (K, N // 8))
    _check_int32("qzeros", qzeros, (K // g, N // 8))
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (K // g, N) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float tensor of shape [{K // g}, {N}]")
    # Unpacked in nibble order, columns come out as 8 c + AWQ_ORDER[i]: put each back at its column.
    order = torch.tensor(AWQ_ORDER, device=qweight.device)
    undo = (torch.arange(N // 8, device=qweight.device)[:, None] * 8 + order).flatten()
    q = torch.empty(K, N, dtype=torch.int32, device=qweight.device)
    q[:, undo] = _unpack_int32(qweight, 4, dim=1)
    z = torch.empty(K // g, N, dtype=torch.int32, device=qweight.device)
    z[:, undo] = _unpack_int32(qzeros, 4, dim=1)
    return _to_canonical(q, z, scales, 4, group_size, None, scale_dtype)


# ---------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------


def _f16(byte_pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian -> float32 of the float16 they hold."""
    return byte_pairs.contiguous().view(torch.float16).squeeze(-1).float()


def gguf_to_wq(qweight: torch.Tensor, quant_type: str, *, scale_dtype: torch.dtype = torch.float32) -> WQWeight:
    """A GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K tensor (uint8 ``[N, row_bytes]``, its blocks as in the file) in the
    canonical layout with one group per 32 values. Exact with float32 scales and zeros (the default):
    Q4_1's and Q4_K's minimum becomes a float zero point -m / d."""
    if quant_type not in ("Q4_0", "Q4_1", "Q8_0", "Q4_K"):
        raise ValueError(f"quant_type must be Q4_0, Q4_1, Q8_0 or Q4_K, got {quant_type!r}")
    elems, nbytes = GGUF_BLOCKS[quant_type]
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8 or qweight.dim() != 2 \
            or qweight.shape[1] % nbytes:
        raise ValueError(f"qweight must be uint8 [N, blocks * {nbytes}] for {quant_type}")
    N = qweight.shape[0]
    nb = qweight.shape[1] // nbytes
    blocks = qweight.view(N, nb, nbytes)
    if quant_type == "Q8_0":
        d = _f16(blocks[..., 0:2])
        q = (blocks[..., 2:].view(torch.int8).to(torch.int32) + 128).to(torch.uint8).reshape(N, nb * 32)
        return WQWeight(q, d.to(scale_dtype), None, 8, BLOCK)
    if quant_type in ("Q4_0", "Q4_1"):
        start = 2 if quant_type == "Q4_0" else 4
        d = _f16(blocks[..., 0:2])
        qweight4 = blocks[..., start:].reshape(N, nb * 16)  # already the canonical nibble order
        if quant_type == "Q4_0":
            return WQWeight(qweight4.contiguous(), d.to(scale_dtype), None, 4, BLOCK)
        m = _f16(blocks[..., 2:4])
        scales, zeros, q = _constant_blocks(d, m, unpack_int4(qweight4.contiguous()).view(N, nb, 32))
        return WQWeight(pack_int4(q.view(N, nb * 32)), scales.to(scale_dtype), zeros.to(scale_dtype), 4, BLOCK)
    # Q4_K: super-blocks of 256 = 8 sub-blocks of 32 with 6-bit scales and mins.
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc_bytes = blocks[..., 4:16].to(torch.int32)
    lo, hi = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    mix = sc_bytes[..., 8:12]
    sc = torch.cat([lo & 63, (mix & 0xF) | ((lo >> 6) << 4)], -1).float()  # [N, nb, 8]
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], -1).float()
    qs = blocks[..., 16:].reshape(N, nb, 4, 1, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
    q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(N, nb * 8, 32)
    scales, zeros, q = _constant_blocks((d[..., None] * sc).view(N, nb * 8), -(dmin[..., None] * mn).view(N, nb * 8), q)
    return WQWeight(pack_int4(q.reshape(N, nb * 256)), scales.to(scale_dtype), zeros.to(scale_dtype), 4, BLOCK)


def _constant_blocks(scale: torch.Tensor, offset: torch.Tensor, q: torch.Tensor):
    """Blocks of ``w = scale * q + offset`` ([N, blocks], q [N, blocks, 32]) as (scales, zeros, q) of
    ``(q - z) * s``: z = -offset / scale. A block with scale 0 is the constant ``offset``, which that
    form cannot hold with its own q; it becomes q = 1, z = 0, s = offset (exact)."""
    constant = scale == 0
    zeros = torch.where(constant, 0.0, -offset / torch.where(constant, 1.0, scale))
    scales = torch.where(constant, offset, scale)
    q = torch.where(constant[..., None], torch.ones_like(q), q)
    return scales, zeros, q
