"""The 16-bit attention tolerances (oracle.ATTENTION_TOLERANCES and ATTENTION_VECTOR_RTOL) are met by a
correct kernel and missed by a wrong one.

The Triton kernels' bf16 arithmetic can only be checked on CUDA (the interpreter's is wrong), so the
bounds those tests apply are set here, on the CPU, against an emulation of the kernels' rounding: the
flash-attention loop of pagedkernels' decode and prefill kernels over 32-key tiles, with the scores,
the running max, the softmax sum and the P @ V accumulator in fp32, P rounded to the input dtype for
the P @ V dot (as ``P.to(V.dtype)`` does), and the output rounded once. That emulation must pass with
room to spare at every head size, length, window and softcap; the same loop with its accumulator or
its softmax sum kept in the 16-bit dtype (what a kernel that forgot an fp32 accumulator computes)
must fail at 4096 tokens, where such errors have grown.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.pagedkernels.oracle import ATTENTION_VECTOR_RTOL, assert_attention_close, attention_oracle

TILE_N = 32


def flash_emulation(q, k, v, dtype, *, sliding_window=None, softcap=None, bug=None):
    """One query per head at the last position of k/v: q ``[heads, head_dim]``, k/v ``[len, heads,
    head_dim]`` (already in ``dtype``'s values). ``bug``: None, ``"accumulator"`` or ``"softmax_sum"``
    (kept in ``dtype`` between tiles). Returns float64 ``[heads, head_dim]`` of ``dtype``'s values."""
    q, k, v = q.float(), k.float(), v.float()
    length, heads, head_dim = k.shape
    scale = head_dim ** -0.5
    first = 0 if sliding_window is None else max(0, length - sliding_window)
    m = torch.full((heads,), -math.inf)
    total = torch.zeros(heads)
    acc = torch.zeros(heads, head_dim)
    for start in range(first - first % TILE_N, length, TILE_N):
        keys, values = k[start:start + TILE_N], v[start:start + TILE_N]
        positions = torch.arange(start, start + keys.shape[0])
        s = torch.einsum("hd,thd->ht", q, keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(positions[None, :] < first, -math.inf)
        m_new = torch.maximum(m, s.max(1).values)
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        total = total * alpha + p.sum(1)
        acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p.to(dtype).float(), values)
        if bug == "accumulator":
            acc = acc.to(dtype).float()
        if bug == "softmax_sum":
            total = total.to(dtype).float()
        m = m_new
    return (acc / total[:, None]).to(dtype).double()


def _case(dtype, length, head_dim, heads=8, seed=0):
    gen = torch.Generator().manual_seed(seed + length + head_dim)
    # q scaled by 2 as the kernel tests do: sharper softmax rows, more of them dominated by few keys
    q = (2 * torch.randn(heads, head_dim, generator=gen)).to(dtype)
    k = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    return q, k, v


def _relative_errors(out, expected):
    return ((out - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()


OPTIONS = [{}, dict(sliding_window=1000), dict(softcap=5.0), dict(sliding_window=20, softcap=10.0)]


# every head size at short lengths (few keys: the output is least averaged), two at 4096 tokens
SHAPES = [(length, head_dim) for length in (2, 5, 70) for head_dim in (32, 64, 128, 256)] + [(4096, 32), (4096, 128)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("length,head_dim", SHAPES)
def test_a_correct_16_bit_kernel_meets_the_tolerances(dtype, head_dim, length):
    """With room to spare: a correct kernel's worst output vector stays under 60% of the bound, so
    CUDA's own (equally correct) rounding order cannot make it flaky."""
    q, k, v = _case(dtype, length, head_dim)
    for options in OPTIONS:
        expected = attention_oracle(q[None], k, v, **options)[0]
        out = flash_emulation(q, k, v, dtype, **options).to(dtype)
        assert_attention_close(out, expected, msg=str(options))
        assert _relative_errors(out.double(), expected) < 0.6 * ATTENTION_VECTOR_RTOL[dtype], options


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bug", ["accumulator", "softmax_sum"])
@pytest.mark.parametrize("options", [{}, dict(sliding_window=2000)], ids=["full", "window"])
def test_a_16_bit_accumulator_or_sum_fails_them(dtype, bug, options):
    q, k, v = _case(dtype, 4096, 128)
    expected = attention_oracle(q[None], k, v, **options)[0]
    out = flash_emulation(q, k, v, dtype, bug=bug, **options).to(dtype)
    with pytest.raises(AssertionError, match="of its norm"):
        assert_attention_close(out, expected)


def test_the_element_tolerance_alone_would_not_catch_them():
    """Why the per-vector bound exists: at 4096 tokens the bf16 outputs are so small that the element
    tolerance (atol 1.5e-2) passes the 16-bit accumulator."""
    from tests.pagedkernels.oracle import ATTENTION_TOLERANCES

    dtype = torch.bfloat16
    q, k, v = _case(dtype, 4096, 128)
    expected = attention_oracle(q[None], k, v)[0]
    out = flash_emulation(q, k, v, dtype, bug="accumulator")
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
