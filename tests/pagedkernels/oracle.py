"""Independent float64 references for the pagedkernels tests.

Nothing here calls pagedkernels: K/V are drawn per sequence in dense form, scattered into a paged
cache with plain Python indexing, and attention is computed densely in float64 from the dense
tensors. Everything a kernel must not read (unused slots, blocks past a sequence's end, spare
blocks) is NaN, so an unmasked read shows up as NaN in the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    keys: list[torch.Tensor]  # float64 [seq_len, num_kv_heads, head_dim] per sequence (values as stored)
    values: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    generator: torch.Generator,
    spare_blocks: int = 3,
    extra_table_columns: int = 2,
) -> PagedKV:
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    used, spare = perm[: sum(blocks_per_seq)], perm[sum(blocks_per_seq):]
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    width = max(blocks_per_seq) + extra_table_columns
    block_tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
    keys, values = [], []
    cursor = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = used[cursor: cursor + nb]
        cursor += nb
        # Entries past the end point at NaN-filled spare blocks: in range, so reading them would
        # not fault, but would poison the result.
        pad = [spare[i % len(spare)] for i in range(width - nb)] if spare else [0] * (width - nb)
        block_tables[s] = torch.tensor(table + pad, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        for t in range(n):
            key_cache[table[t // block_size], t % block_size] = k[t]
            value_cache[table[t // block_size], t % block_size] = v[t]
        keys.append(k.double())
        values.append(v.double())
    return PagedKV(
        key_cache.to(device), value_cache.to(device), block_tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), keys, values,
    )


def attention_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense causal attention for one sequence, bottom-right aligned, in float64.

    q: [num_queries, num_q_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim]. Query i sits
    at position ``seq_len - num_queries + i`` and sees key positions j with
    ``pos - sliding_window < j <= pos``. Returns [num_queries, num_q_heads, head_dim] float64.
    """
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    num_queries, num_q_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    k = k.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - num_queries, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


# (atol, rtol) per dtype for attention outputs compared with the float64 oracle, element by element.
ATTENTION_TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 1.5e-2),
}
# Largest relative error ||out - ref|| / ||ref|| of one output vector (a token's head). An element
# tolerance fixed in absolute terms loses its meaning as contexts grow (an output averages more
# values, so its entries shrink like 1/sqrt(len): at 4096 tokens they are about as small as the
# bf16 atol), so attention is also held to this scale-free bound. A correct 16-bit kernel (fp32
# scores, P rounded to the input dtype for the P @ V dot, fp32 accumulators and softmax sums, one
# rounding of the output) stays at about half of it at any length; one that keeps its accumulator or
# its softmax sum in the 16-bit dtype exceeds it by 3x to 10x at 4096 tokens
# (tests/pagedkernels/test_tolerances.py emulates both).
ATTENTION_VECTOR_RTOL = {
    torch.float32: 2e-5,
    torch.float16: 8e-4,
    torch.bfloat16: 6e-3,
}


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, *, msg: str | None = None) -> None:
    """``out`` (any device, the kernel's dtype) against the float64 ``expected``: element by element
    with ATTENTION_TOLERANCES, and per output vector (last dimension) with ATTENTION_VECTOR_RTOL."""
    dtype = out.dtype
    got = out.double().cpu()
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=None if msg is None else lambda m: f"{msg}: {m}")
    norm = expected.norm(dim=-1)
    # rows with no visible key are exactly zero (checked above); the others have norm > 0
    rel = (got - expected).norm(dim=-1)[norm > 0] / norm[norm > 0]
    if rel.numel():
        worst = rel.max().item()
        assert worst <= ATTENTION_VECTOR_RTOL[dtype], (
            f"{msg + ': ' if msg else ''}an output vector is off by {worst:.2e} of its norm "
            f"(> {ATTENTION_VECTOR_RTOL[dtype]:.0e} for {dtype})")
