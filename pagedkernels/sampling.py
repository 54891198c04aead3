"""Next-token draws from a batch of logits in one kernel: ``sample_from_logits``.

A serving step that samples at temperature draws one token per row of ``[num_rows, vocab]`` logits. Written as
PyTorch ops that is eight to ten passes over the logits (NaN clean-up, row maximum, argmax, shift and scale,
exponentials, cumulative sum, search), each a kernel reading and most writing ``num_rows x vocab`` float32: at 256
rows of a 151,936-token vocabulary, 155 MB a pass, about a millisecond of an H200's step. Here one program per
row reads its logits at most three times and writes nothing but the row's id and maximum: once for the maximum
and the argmax, and for a row that samples once for its total weight and once more, stopping at the block that
holds the draw, for the draw.

The draw is by inverse CDF, as the engine's sampler draws (engine/worker/sampler.py): with the row's
``uniform`` number ``u`` in [0, 1), the first token whose running sum of ``exp((logit - max) / temperature)``
exceeds ``u`` times the row's total, so that one number per row (from a seeded generator where a request asks)
decides the draw. A token of weight 0 (a logit of -inf, or NaN) is never drawn. Rows of temperature 0 take the
argmax (the first index on ties). NaN logits count as -inf and +inf as the largest float32, as the sampler
cleans them. The PyTorch twin computes the same with tensor ops; the two agree on every draw except where the
uniform falls within rounding of a boundary between two tokens (their exponentials and sums round differently).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import has_no_data, use_triton
from ._validate import FLOAT_DTYPES, check_tensor

FLOAT32_MAX = torch.finfo(torch.float32).max
_BLOCK = 4096   # logits a program reads per iteration: 16 KiB of float32 in flight per row
_NUM_WARPS = 8


@triton.jit
def _clean(x):
    """NaN -> -inf, +inf -> the largest float32 (the sampler's clean-up)."""
    x = tl.where(x != x, float("-inf"), x)
    return tl.where(x == float("inf"), 3.4028234663852886e38, x)


@triton.jit
def _sample_kernel(
    logits_ptr,  # [num_rows, vocab], fp32/fp16/bf16
    temperature_ptr,  # float32 [num_rows]; 0 = greedy
    uniform_ptr,  # float32 [num_rows] in [0, 1)
    ids_ptr,  # int64 [num_rows]
    row_max_ptr,  # float32 [num_rows]
    vocab,
    stride_row: tl.int64,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)

    # Pass 1: the row's maximum and its first index.
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        x = _clean(tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
        block_max = tl.max(x, axis=0)
        block_idx = tl.min(tl.where(x == block_max, idx, vocab), axis=0)
        better = block_max > best   # strictly: an earlier block keeps its tie
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_max, best)
    chosen = best_idx

    temperature = tl.minimum(tl.load(temperature_ptr + row), 3.4028234663852886e38)
    if (temperature > 0) & (best > float("-inf")):
        # Pass 2: the total weight, block by block. Pass 3 adds the same block sums in the same order, so the
        # block whose carry passes the target is found exactly where pass 2's sum put it.
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = _clean(tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
            w = tl.where(x > float("-inf"), tl.exp((x - best) / temperature), 0.0)
            total += tl.sum(w, axis=0)
        # Strictly below the total (its float32 predecessor; total >= 1, the maximum's own weight).
        target = tl.minimum(tl.load(uniform_ptr + row) * total,
                            (total.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True))
        # Pass 3: the first token whose running sum exceeds the target, from the first block whose carry does.
        carry = tl.full((), 0.0, tl.float32)
        last_live = tl.full((), 0, tl.int32)   # the last token of weight > 0 seen (a fallback never reached)
        found = tl.full((), 0, tl.int32)
        pos = tl.full((), 0, tl.int32)
        while pos < vocab:
            idx = pos + offs
            x = _clean(tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
            w = tl.where(x > float("-inf"), tl.exp((x - best) / temperature), 0.0)
            block_sum = tl.sum(w, axis=0)
            live_here = tl.max(tl.where(w > 0, idx, -1), axis=0)
            last_live = tl.where(live_here >= 0, live_here, last_live)
            if target < carry + block_sum:
                # A token of weight 0 repeats its predecessor's running sum, so the first sum past the target
                # is a live token's; the last live one if rounding put every sum of the block at or below it.
                running = carry + tl.cumsum(w, axis=0)
                at_or_below = tl.sum(((running <= target) & (idx < vocab)).to(tl.int32), axis=0)
                chosen = tl.minimum(pos + at_or_below, live_here)
                found = tl.full((), 1, tl.int32)
                pos = vocab
            carry += block_sum
            pos += BLOCK
        chosen = tl.where(found == 1, chosen, last_live)

    tl.store(ids_ptr + row, chosen.to(tl.int64))
    tl.store(row_max_ptr + row, best)


def check_sample_from_logits_args(logits, temperature, uniform) -> None:
    """Every check of :func:`sample_from_logits`'s arguments that reads no tensor value."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have at least one column (the vocabulary), got shape "
                         f"{list(logits.shape)}")
    if vocab >= 2**31 - _BLOCK:
        raise ValueError(f"logits: a vocabulary of {vocab} is too large (int32 token ids)")
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous in its last dimension")
    check_tensor("temperature", temperature, dtypes=(torch.float32,), like=("logits", logits), shape=(num_rows,))
    check_tensor("uniform", uniform, dtypes=(torch.float32,), like=("logits", logits), shape=(num_rows,))


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                       uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` (see the module docstring).

    logits: ``[num_rows, vocab]`` fp32/fp16/bf16 (last dim contiguous; not modified). temperature: float32
    ``[num_rows]``, 0 for a greedy row (the argmax), above float32's range taken as its largest value.
    uniform: float32 ``[num_rows]`` in [0, 1), one number per row (a greedy row's is not read). Returns
    ``(ids, row_max)``: int64 ``[num_rows]`` token ids, and float32 ``[num_rows]`` each row's maximum after the
    clean-up, -inf for a row with nothing to draw (every logit -inf or NaN: its id is then 0, and the caller
    decides what such a row takes). No value is read back to the host: CUDA-graph capturable.
    """
    check_sample_from_logits_args(logits, temperature, uniform)
    num_rows, vocab = logits.shape
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if has_no_data(logits, temperature, uniform) or num_rows == 0:
        return ids, row_max
    if use_triton(logits):
        _sample_kernel[(num_rows,)](logits, temperature, uniform, ids, row_max, vocab, logits.stride(0),
                                    BLOCK=_BLOCK, num_warps=_NUM_WARPS)
        return ids, row_max
    return _sample_torch(logits, temperature, uniform, ids, row_max)


def _sample_torch(logits, temperature, uniform, ids, row_max):
    """The PyTorch twin: the same draw with tensor ops (the engine sampler's way: engine/worker/sampler.py)."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))
    torch.amax(x, dim=-1, out=row_max)
    torch.argmax(x, dim=-1, out=ids)
    sample = (temperature > 0) & (row_max > float("-inf"))
    scale = torch.where(temperature > 0, temperature.clamp(max=FLOAT32_MAX), 1.0).unsqueeze(1)
    weights = x.sub_(row_max.unsqueeze(1)).div_(scale).nan_to_num_(nan=float("-inf")).exp_()
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
    ids.copy_(torch.where(sample, drawn, ids))
    return ids, row_max
