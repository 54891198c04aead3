"""GGUF block-quantized weights used as they are stored: de-quantization and GEMM.

A GGUF tensor of shape [N, K] (N output features) in one of the block types below is, byte for byte,
a uint8 ``[N, K / block_values * block_bytes]`` tensor: each row is its blocks back to back, as in
the file (ggml's ``block_*`` structs, little-endian float16 scales):

    type   values/bytes  block                                           value
    Q8_0   32 / 34       d f16, qs[32] int8                              d * qs[i]
    Q4_0   32 / 18       d f16, qs[16]: value j low nibble of qs[j],     d * (q - 8)
                         value 16 + j its high nibble
    Q4_1   32 / 20       d f16, m f16, qs[16] as Q4_0                    d * q + m
    Q4_K   256 / 144     d f16, dmin f16, scales[12] (8 x 6-bit scale    d * sc[j] * q - dmin * m[j],
                         and min), qs[128]: sub-blocks 2c and 2c + 1     j = sub-block of 32
                         in the low and high nibbles of qs[32c:32c+32]
    Q6_K   256 / 210     ql[128], qh[64], scales[16] int8, d f16         d * sc[16-value group] * (q - 32),
                         6-bit q: 4 low bits in ql, 2 high bits in qh    q from ql/qh as in ggml

Three CPU layouts of the same blocks, ``Q4_0x8``, ``Q4_1x8`` and ``Q8_0x8`` (:func:`gguf_interleave`; N a
multiple of 8): each group of 8 rows stores, per block, the 8 rows' scales (and minima) side by side and their
16 bytes of nibbles (32 int8 values) 4 bytes of each row at a time, so the native GEMM computes 8 rows of a block in one set of vector
instructions and scales them with one (``csrc/quant_cpu.c`` gives the byte layout). Same bytes in all; every
op takes them, the native kernels directly, the Triton and PyTorch paths through :func:`gguf_deinterleave`.

``gguf_gemm`` on the CPU computes on the blocks directly (``csrc/quant_cpu.c``, llama.cpp's scheme: the
activation quantized to int8 per 32 values, integer dot products per block; above
``wq_gemm.NATIVE_MAX_ROWS`` rows the weight is de-quantized natively and torch multiplies). On CUDA it
de-quantizes with a Triton kernel into x's dtype and multiplies with torch (Q4_0/Q4_1/Q8_0/Q4_K also
convert to the canonical int4/int8 layout for ``wq_gemm``: ``quant_formats.gguf_to_wq``). The PyTorch
twin de-quantizes in float32 and multiplies. References: ggml-quants.c ``dequantize_row_*`` and the
``gguf`` package's ``gguf.quants`` (the tests compare with it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _huge_pages, _native
from ._backend import has_no_data, use_native, use_triton
from ._validate import FLOAT_DTYPES, check_tensor

__all__ = ["GGUF_BLOCKS", "GGUF_TYPE_IDS", "GGUF_INTERLEAVED", "gguf_dequantize", "gguf_gemm", "gguf_interleave",
           "gguf_deinterleave", "gguf_take_rows", "check_gguf_weight"]

# type -> (values per block, bytes per block): the table lives with the other weight formats, below this module
from .quant_formats import GGUF_BLOCKS  # noqa: E402
# ggml's type ids (gguf.GGMLQuantizationType), for callers holding those.
GGUF_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


# The 8-row interleaved CPU layouts -> the block type they hold (module docstring).
GGUF_INTERLEAVED = {"Q4_0x8": "Q4_0", "Q4_1x8": "Q4_1", "Q8_0x8": "Q8_0"}
_INTERLEAVE_ROWS = 8


def _type_name(quant_type: object) -> str:
    if isinstance(quant_type, str) and (quant_type in GGUF_BLOCKS or quant_type in GGUF_INTERLEAVED):
        return quant_type
    if isinstance(quant_type, int) and not isinstance(quant_type, bool):
        for name, type_id in GGUF_TYPE_IDS.items():
            if type_id == int(quant_type):
                return name
    raise ValueError(f"quant_type must be one of {tuple(GGUF_BLOCKS) + tuple(GGUF_INTERLEAVED)} (or a ggml id of "
                     f"the first five), got {quant_type!r}")


def check_gguf_weight(qweight, quant_type, *, like=None) -> tuple[str, int, int]:
    """qweight: uint8 ``[N, blocks * block_bytes]``, contiguous (N a multiple of 8 for the interleaved layouts).
    Returns (type name, N, K)."""
    name = _type_name(quant_type)
    values, nbytes = GGUF_BLOCKS[GGUF_INTERLEAVED.get(name, name)]
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.uint8,), like=like)
    if qweight.shape[1] % nbytes:
        raise ValueError(f"qweight: rows of {qweight.shape[1]} bytes are not whole {name} blocks of {nbytes} bytes")
    if name in GGUF_INTERLEAVED and qweight.shape[0] % _INTERLEAVE_ROWS:
        raise ValueError(f"qweight: {name} holds groups of {_INTERLEAVE_ROWS} rows, got {qweight.shape[0]} rows")
    if not qweight.is_contiguous():
        raise ValueError("qweight must be contiguous")
    return name, qweight.shape[0], qweight.shape[1] // nbytes * values


def _interleave_shape(N: int, row_bytes: int, name: str) -> tuple[int, int, int, int]:
    """(groups, blocks, parameter bytes per row-block, value bytes per row-block) of a Q4_0/Q4_1/Q8_0 weight."""
    nbytes = GGUF_BLOCKS[name][1]
    values = 32 if name == "Q8_0" else 16
    return N // _INTERLEAVE_ROWS, row_bytes // nbytes, nbytes - values, values


def gguf_interleave(qweight: torch.Tensor, quant_type: str | int) -> torch.Tensor:
    """A Q4_0, Q4_1 or Q8_0 weight in its 8-row interleaved layout (``"Q4_0x8"`` / ``"Q4_1x8"`` / ``"Q8_0x8"``,
    module docstring):
    a new uint8 tensor of qweight's shape. N must be a multiple of 8. Exact: :func:`gguf_deinterleave` gives the
    same bytes back."""
    name, N, K = check_gguf_weight(qweight, quant_type)
    if name not in GGUF_INTERLEAVED.values():
        raise ValueError(f"gguf_interleave takes {', '.join(GGUF_INTERLEAVED.values())} weights, got {name}")
    if N % _INTERLEAVE_ROWS:
        raise ValueError(f"gguf_interleave needs a multiple of {_INTERLEAVE_ROWS} rows, got {N}")
    G, nb, head, values = _interleave_shape(N, qweight.shape[1], name)
    blocks = qweight.view(G, _INTERLEAVE_ROWS, nb, head + values)
    params = blocks[..., :head].reshape(G, _INTERLEAVE_ROWS, nb, head // 2, 2).permute(0, 2, 3, 1, 4)
    chunks = blocks[..., head:].reshape(G, _INTERLEAVE_ROWS, nb, values // 4, 4).permute(0, 2, 3, 1, 4)
    out = torch.cat([params.reshape(G, nb, head * _INTERLEAVE_ROWS),
                     chunks.reshape(G, nb, values * _INTERLEAVE_ROWS)], dim=-1).reshape(N, -1)
    if qweight.device.type != "cpu":
        return out.contiguous()
    # A decode step streams the whole weight: huge pages where the system gives them (_huge_pages).
    return _huge_pages.empty(out.shape, out.dtype).copy_(out)


def gguf_deinterleave(qweight: torch.Tensor, quant_type: str) -> torch.Tensor:
    """The inverse of :func:`gguf_interleave`: a ``"Q4_0x8"`` / ``"Q4_1x8"`` weight's blocks in GGUF's own row
    layout (a new tensor), for the paths that read that layout."""
    name, N, K = check_gguf_weight(qweight, quant_type)
    if name not in GGUF_INTERLEAVED:
        raise ValueError(f"gguf_deinterleave takes {tuple(GGUF_INTERLEAVED)} weights, got {name}")
    base = GGUF_INTERLEAVED[name]
    G, nb, head, values = _interleave_shape(N, qweight.shape[1], base)
    blocks = qweight.view(G, nb, _INTERLEAVE_ROWS * (head + values))
    params = blocks[..., :head * _INTERLEAVE_ROWS].reshape(G, nb, head // 2, _INTERLEAVE_ROWS, 2)
    chunks = blocks[..., head * _INTERLEAVE_ROWS:].reshape(G, nb, values // 4, _INTERLEAVE_ROWS, 4)
    out = torch.cat([params.permute(0, 3, 1, 2, 4).reshape(G, _INTERLEAVE_ROWS, nb, head),
                     chunks.permute(0, 3, 1, 2, 4).reshape(G, _INTERLEAVE_ROWS, nb, values)], dim=-1)
    return out.reshape(N, -1).contiguous()


def gguf_take_rows(qweight: torch.Tensor, quant_type: str, ids: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Rows ``ids`` (int64 ``[n]``) of a GGUF weight in GGUF's row layout, and their block type: an index_select
    for the row layouts; for the interleaved ones the ids' groups of 8 rows, de-interleaved, each id's row taken
    (an embedding lookup in blocks shared with an interleaved LM head). Reads no value on the host."""
    name, N, _ = check_gguf_weight(qweight, quant_type)
    if name not in GGUF_INTERLEAVED:
        return qweight.index_select(0, ids), name
    row_bytes = qweight.shape[1]
    groups = qweight.view(N // _INTERLEAVE_ROWS, _INTERLEAVE_ROWS * row_bytes).index_select(
        0, torch.div(ids, _INTERLEAVE_ROWS, rounding_mode="floor"))
    rows = gguf_deinterleave(groups.view(-1, row_bytes), name).view(-1, _INTERLEAVE_ROWS, row_bytes)
    which = torch.remainder(ids, _INTERLEAVE_ROWS).view(-1, 1, 1).expand(-1, 1, row_bytes)
    return rows.gather(1, which).view(-1, row_bytes), GGUF_INTERLEAVED[name]


def _row_layout(qweight: torch.Tensor, name: str) -> tuple[torch.Tensor, str]:
    """(weight, type) in GGUF's row layout: the interleaved layouts de-interleaved, others as they are."""
    if name in GGUF_INTERLEAVED:
        return gguf_deinterleave(qweight, name), GGUF_INTERLEAVED[name]
    return qweight, name


# ----------------------------------------------------------------------------------------------
# PyTorch twin
# ----------------------------------------------------------------------------------------------


def _f16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian) -> float32 [...]."""
    return pairs.contiguous().view(torch.float16)[..., 0].float()


def _dequantize_torch(qweight: torch.Tensor, name: str) -> torch.Tensor:
    """float32 [N, K], following ggml's dequantize_row_* (vectorized)."""
    values, nbytes = GGUF_BLOCKS[name]
    N = qweight.shape[0]
    nb = qweight.shape[1] // nbytes
    blk = qweight.view(N, nb, nbytes)
    if name == "Q8_0":
        return (_f16(blk[..., :2])[..., None] * blk[..., 2:].contiguous().view(torch.int8).float()).view(N, -1)
    if name in ("Q4_0", "Q4_1"):
        qs = blk[..., -16:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # [N, nb, 32]
        d = _f16(blk[..., :2])[..., None]
        if name == "Q4_0":
            return (d * (q - 8.0)).view(N, -1)
        return (d * q + _f16(blk[..., 2:4])[..., None]).view(N, -1)
    if name == "Q4_K":
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        s = blk[..., 4:16].to(torch.int32)
        lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([lo & 63, (mix & 0xF) | ((lo >> 6) << 4)], -1).float()  # [N, nb, 8]
        mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], -1).float()
        qs = blk[..., 16:].reshape(N, nb, 4, 1, 32)
        q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(N, nb, 8, 32).float()
        return ((d[..., None] * sc)[..., None] * q - (dmin[..., None] * mn)[..., None]).view(N, -1)
    # Q6_K: per half of 128 values, ql[64], qh[32]; part p of 32 values takes ql[l + 32 (p & 1)] (low
    # nibble for p < 2, high for p >= 2) and bits 2p..2p+1 of qh[l].
    ql = blk[..., 0:128].reshape(N, nb, 2, 2, 32)  # [.., half, ql block (p & 1), l]
    qh = blk[..., 128:192].reshape(N, nb, 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [.., half, p, l] with p = 2 * (nibble) + (p & 1)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qweight.device).view(1, 1, 1, 4, 1)) & 3
    q = (low | (high << 4)).float() - 32.0  # [N, nb, 2, 4, 32]
    sc = blk[..., 192:208].contiguous().view(torch.int8).float().view(N, nb, 2, 4, 2, 1)
    d = _f16(blk[..., 208:210]).view(N, nb, 1, 1, 1, 1)
    return (d * sc * q.view(N, nb, 2, 4, 2, 16)).view(N, -1)


# ----------------------------------------------------------------------------------------------
# Triton de-quantization
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_f16(ptr, mask):
    """The float16 at ptr (2 bytes, any alignment) as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_dequantize_kernel(
    w_ptr,  # uint8 [N, row_bytes]
    out_ptr,  # [N, K]
    K,
    row_bytes,
    stride_out_n: tl.int64,
    QTYPE: tl.constexpr,  # ggml type id: 8 Q8_0, 2 Q4_0, 3 Q4_1, 12 Q4_K, 14 Q6_K
    BLOCK_E: tl.constexpr,  # values per program (a multiple of 256)
):
    # grid: (N, cdiv(K, BLOCK_E)); each value gathers its bytes (L1-resident within a block).
    row = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # (BLOCK_E,) value index in the row
    mask = e < K
    base = w_ptr + row * row_bytes
    if QTYPE == 8:  # Q8_0
        blk = base + (e // 32) * 34
        i = e % 32
        q = tl.load(blk + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _load_f16(blk, mask) * q
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0, Q4_1
        nbytes: tl.constexpr = 18 if QTYPE == 2 else 20
        blk = base + (e // 32) * nbytes
        i = e % 32
        byte = tl.load(blk + (nbytes - 16) + i % 16, mask=mask, other=0)
        q = ((byte >> ((i // 16) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        d = _load_f16(blk, mask)
        if QTYPE == 2:
            w = d * (q - 8.0)
        else:
            w = d * q + _load_f16(blk + 2, mask)
    elif QTYPE == 12:  # Q4_K
        blk = base + (e // 256) * 144
        r = e % 256
        j = r // 32  # sub-block
        byte = tl.load(blk + 16 + (j // 2) * 32 + r % 32, mask=mask, other=0)
        q = ((byte >> ((j % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        sc_lo = tl.load(blk + 4 + j % 4, mask=mask, other=0).to(tl.int32)  # scales[j] (j < 4), scales[j - 4]
        m_lo = tl.load(blk + 8 + j % 4, mask=mask, other=0).to(tl.int32)  # scales[j + 4] (j < 4), scales[j]
        mix = tl.load(blk + 12 + j % 4, mask=mask, other=0).to(tl.int32)  # scales[j + 4] for j >= 4
        sc = tl.where(j < 4, sc_lo & 63, (mix & 0xF) | ((sc_lo >> 6) << 4))
        mn = tl.where(j < 4, m_lo & 63, (mix >> 4) | ((m_lo >> 6) << 4))
        w = _load_f16(blk, mask) * sc.to(tl.float32) * q - _load_f16(blk + 2, mask) * mn.to(tl.float32)
    else:  # Q6_K
        blk = base + (e // 256) * 210
        r = e % 256
        half = r // 128
        part = (r % 128) // 32
        l = r % 32
        ql = tl.load(blk + half * 64 + (part % 2) * 32 + l, mask=mask, other=0)
        qh = tl.load(blk + 128 + half * 32 + l, mask=mask, other=0)
        low = tl.where(part >= 2, ql >> 4, ql & 0xF)
        high = (qh >> (2 * part).to(tl.uint8)) & 3
        q = (low | (high << 4)).to(tl.float32) - 32.0
        sc = tl.load(blk + 192 + half * 8 + part * 2 + l // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _load_f16(blk + 208, mask) * sc.to(tl.float32) * q
    tl.store(out_ptr + row * stride_out_n + e, w.to(out_ptr.dtype.element_ty), mask=mask)


_DEQUANT_VALUES_PER_PROGRAM = 1024


def _dequantize_triton(qweight: torch.Tensor, name: str, out: torch.Tensor) -> None:
    N, K = out.shape
    grid = (N, triton.cdiv(K, _DEQUANT_VALUES_PER_PROGRAM))
    _gguf_dequantize_kernel[grid](qweight, out, K, qweight.shape[1], out.stride(0), QTYPE=GGUF_TYPE_IDS[name],
                                  BLOCK_E=_DEQUANT_VALUES_PER_PROGRAM, num_warps=4)


# ----------------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------------


def gguf_dequantize(qweight: torch.Tensor, quant_type: str | int, *, dtype: torch.dtype = torch.float32,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """De-quantize a GGUF tensor (see the module docstring for the block types).

    Args:
        qweight: uint8 ``[N, K / block_values * block_bytes]``, contiguous: the tensor's bytes as stored.
        quant_type: ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``, ``"Q4_K"``, ``"Q6_K"`` (or ggml's type id), or an
            interleaved layout, ``"Q4_0x8"`` / ``"Q4_1x8"`` (:func:`gguf_interleave`).
        dtype: fp16/bf16/fp32 of the result (values computed in float32, rounded once).
        out: optional ``[N, K]`` of ``dtype``, last dimension contiguous.

    Returns ``[N, K]``.
    """
    name, N, K = check_gguf_weight(qweight, quant_type)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    else:
        check_tensor("out", out, dtypes=(dtype,), like=("qweight", qweight), shape=(N, K))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    if has_no_data(qweight, out) or N == 0:
        return out
    if use_triton(qweight):
        _dequantize_triton(*_row_layout(qweight, name), out)
    elif use_native(qweight):
        _native.quant_dequantize(qweight, N, K, name, 0, None, None, out)
    else:
        out.copy_(_dequantize_torch(*_row_layout(qweight, name)))
    return out


def check_gguf_gemm_args(x, qweight, quant_type, out=None) -> tuple[str, int, int, int]:
    """Every check of :func:`gguf_gemm`'s arguments that reads no tensor value. Returns (type, M, N, K)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (K) dimension")
    name, N, K = check_gguf_weight(qweight, quant_type, like=("x", x))
    M = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"x: K = {x.shape[1]} but qweight's {name} rows hold {K} values")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), like=("x", x), shape=(M, N))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (N) dimension")
    return name, M, N, K


def gguf_gemm(x: torch.Tensor, qweight: torch.Tensor, quant_type: str | int, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T`` for a GGUF-quantized weight W kept in its blocks.

    Args:
        x: ``[M, K]`` fp16/bf16/fp32, last dimension contiguous.
        qweight: uint8 ``[N, K / block_values * block_bytes]`` (see :func:`gguf_dequantize`).
        quant_type: ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``, ``"Q4_K"``, ``"Q6_K"`` (or ggml's type id), or an
            interleaved layout, ``"Q4_0x8"`` / ``"Q4_1x8"`` (:func:`gguf_interleave`).
        out: optional ``[M, N]`` in x's dtype, last dimension contiguous.

    Returns ``[M, N]`` in x's dtype. The native CPU path quantizes x to int8 per 32 values (as llama.cpp
    does): the result differs from x @ W^T by at most sum_k |w[n,k]| * max|x block| / 254.
    """
    from .wq_gemm import NATIVE_MAX_ROWS, _matmul_into

    name, M, N, K = check_gguf_gemm_args(x, qweight, quant_type, out)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if has_no_data(x, qweight, out) or M == 0 or N == 0:
        return out
    if use_triton(x):
        weight = torch.empty(N, K, dtype=x.dtype, device=x.device)
        _dequantize_triton(*_row_layout(qweight, name), weight)
        torch.matmul(x, weight.t(), out=out)
    elif use_native(x):
        if M <= NATIVE_MAX_ROWS:
            _native.quant_gemm(x, qweight, name, 0, None, None, out)
        else:
            weight = torch.empty(N, K, dtype=torch.float32)
            _native.quant_dequantize(qweight, N, K, name, 0, None, None, weight)
            _matmul_into(x, weight, out)
    else:
        out.copy_(x.float() @ _dequantize_torch(*_row_layout(qweight, name)).t())
    return out
