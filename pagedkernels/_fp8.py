"""float8 e4m3 (``torch.float8_e4m3fn``: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
infinities, NaN = S.1111.111, largest finite 448, smallest subnormal 2**-9) for the fp8 KV cache: the
conversions every backend shares, written on the bits.

Writing (``reshape_and_cache``): ``code = e4m3(clamp(x / scale, -448, 448))``, rounded to nearest, ties
to even, exactly as ``torch.Tensor.to(torch.float8_e4m3fn)`` rounds (the PyTorch twin uses it; the
Triton and C kernels compute the same bits, and the tests compare all three bit for bit). Reading
(attention): ``x = value(code) * scale``; the kernels fold ``k_scale`` into the score scale and
``v_scale`` into the output's normalization, so K and V enter the products as the exact e4m3 values.

The Triton helpers use integer and float16 bit operations only, not Triton's fp8 types: Ampere (sm_80)
has no ``fp8e4nv`` conversions in Triton, and the Triton interpreter rounds float32 -> fp8e4nv wrongly
where the rounding carries into the exponent (31.02 -> 16 instead of 32), so neither backend would be
exact with them. Caches reach the kernels as uint8 views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch twin of the cache write: e4m3 of clamp(x / scale, -448, 448), computed in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@triton.jit
def _e4m3_to_float(code):
    """uint8 e4m3 codes -> float32 values. The code's 7 magnitude bits placed at float16 bits 7..13 read
    as a float16 2**8 times too small, subnormals included (float16's exponent bias is 15 = 7 + 8), so
    one bitcast, an exact widening and a power-of-two multiply convert it."""
    c = code.to(tl.uint16)
    half_bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _float_to_e4m3(x):
    """float32 (already divided by the scale) -> uint8 e4m3 codes: clamp to +-448, round to nearest even.
    NaN stays NaN (0x7F with its sign)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag = tl.minimum(tl.abs(x), 448.0)  # NaN propagates through neither branch below: handled last
    mag_bits = mag.to(tl.uint32, bitcast=True)
    # Normal results (|x| >= 2**-6): rebias the exponent from 127 to 7 and round 20 mantissa bits away.
    rebased = mag_bits - (120 << 23)
    normal = (rebased + 0x7FFFF + ((rebased >> 20) & 1)) >> 20
    # Subnormal results: multiples of 2**-9, rounded to nearest even by the float adder (2**14 has an
    # ulp of 2**-9 in float32).
    sub = (((mag + 16384.0) - 16384.0) * 512.0).to(tl.uint32)
    code = tl.where(mag >= 0.015625, normal, sub).to(tl.uint8)
    code = tl.where(x != x, 0x7F, code)
    return code | sign
