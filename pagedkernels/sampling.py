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
uniform falls within rounding of a boundary between two tokens (their exponentials and sums round differently; the
unfiltered draw's block sums, rescaled, round apart from the running sum within the draw's block, and a target that
rounding leaves past that block's sum takes its last live token).

**Min-p, top-k and top-p without a sort.** With per-row ``min_p`` / ``top_k`` / ``top_p``, the draw is among the
tokens they keep, with vLLM's semantics and order: min-p drops every token whose weight is below ``min_p`` times the
maximum's (a mask, in every pass), top-k keeps every token with fewer than ``k`` tokens above it (ties at the k-th
value all stay), then top-p keeps, of those, every token whose weight above it is below ``p`` times the top-k
survivors' weight (the maximum always stays). Each keeps an upper set of the row's values, so each is a threshold,
and the kernel searches for it instead of sorting the row. A search pass counts the tokens and sums the weight above
eight pivots at once, and records the smallest and largest value between each two; the interval that holds the
threshold then shrinks to the values inside it, until it holds a single value. The first pass places its pivots 32
to 1 temperatures below the row's maximum, where LLM distributions put the thresholds; later ones split the
interval's float32 keys (the values' bits, ordered as integers) evenly. On SmolLM2's logits a row took 1.63 search
passes on average for top-p 0.9 at temperature 0.6 (Llama 3's generation config) and 3.87 for top-k 20 and top-p
0.95 (Qwen3's) (``python -m bench.sampling_passes``), where a sort of 256 rows of a 151,936-token vocabulary orders
39M keys. The draw then is the same inverse-CDF draw, in token-id order, over the tokens at or above the threshold,
as the engine's draw among a top-k selection (engine/worker/sampler.py) takes its tokens in that order too. Where a
float32 sum decides a token's side of the top-p bound within rounding, the kernel and a sort may keep it
differently.
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
_SEARCH_BLOCK = 1024   # logits per iteration of a threshold search pass
_PIVOTS = 8   # intervals a search pass splits the current one into: it shrinks at least eightfold a pass
_MAX_CHUNKS = 1024   # blocks of a row the unfiltered draw's second kernel takes in one program


@triton.jit
def _clean(x):
    """NaN -> -inf, +inf -> the largest float32 (the sampler's clean-up)."""
    x = tl.where(x != x, float("-inf"), x)
    return tl.where(x == float("inf"), 3.4028234663852886e38, x)


@triton.jit
def _key(x):
    """float32 -> int32 key in the values' order, one key per value (-0.0 and +0.0 both 0): a negative float's
    magnitude bits flipped, plus one."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, (bits ^ 0x7FFFFFFF) + 1, bits)


@triton.jit
def _unkey(key):
    """The inverse of _key: int32 key -> float32."""
    bits = tl.where(key < 0, (key - 1) ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _weight(x, best, temperature):
    """The draw's weight of each cleaned logit: exp((x - max) / T), 0 for -inf."""
    return tl.where(x > float("-inf"), tl.exp((x - best) / temperature), 0.0)


@triton.jit
def _above(base, vocab, best, temperature, min_p, lower, upper, PIVOTS: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """One pass over the row for PIVOTS ascending intervals (lower, upper] (float32 [PIVOTS] each, every interval's
    lower bound the previous one's upper): per interval, how many tokens lie strictly above its upper bound and
    their total weight, and the smallest and largest value inside it (+inf / -inf: none). Tokens min-p drops count
    as -inf. The pivots are taken one at a time over each block (a [block, pivots] tensor would spill registers)."""
    offs = tl.arange(0, SEARCH_BLOCK)
    j = tl.arange(0, PIVOTS)
    count = tl.zeros([PIVOTS], dtype=tl.int32)
    mass = tl.zeros([PIVOTS], dtype=tl.float32)
    smallest = tl.full([PIVOTS], float("inf"), tl.float32)
    largest = tl.full([PIVOTS], float("-inf"), tl.float32)
    first_lower = tl.sum(tl.where(j == 0, lower, 0.0), axis=0)
    for start in range(0, vocab, SEARCH_BLOCK):
        idx = start + offs
        x = _clean(tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
        w = _weight(x, best, temperature)
        x = tl.where(w >= min_p, x, float("-inf"))
        w = tl.where(w >= min_p, w, 0.0)
        below = x > first_lower   # above the interval's lower bound
        for p in tl.static_range(PIVOTS):
            bound = tl.sum(tl.where(j == p, upper, 0.0), axis=0)
            above = x > bound
            inside = below & (x <= bound)
            here = j == p
            count = tl.where(here, count + tl.sum(above.to(tl.int32), axis=0), count)
            mass = tl.where(here, mass + tl.sum(tl.where(above, w, 0.0), axis=0), mass)
            smallest = tl.where(here, tl.minimum(smallest, tl.min(tl.where(inside, x, float("inf")), axis=0)),
                                smallest)
            largest = tl.where(here, tl.maximum(largest, tl.max(tl.where(inside, x, float("-inf")), axis=0)),
                               largest)
            below = above
    return count, mass, smallest, largest


@triton.jit
def _narrow(lo, hi, count_lo, mass_lo, count, mass, smallest, largest, holds, PIVOTS: tl.constexpr):
    """The search's interval (lo, hi] of int64 keys (its condition false at lo, true at hi; count_lo / mass_lo: the
    tokens and weight above lo) narrowed to the tokens of the first of _above's intervals where the condition
    (`holds` at each upper bound: false then true) becomes true: from the smallest of them (less one key: nothing
    lies between, so the condition is as false there as at the interval's lower bound) to the largest."""
    j = tl.arange(0, PIVOTS)
    first = tl.minimum(tl.sum((holds == 0).to(tl.int32), axis=0), PIVOTS - 1)
    key_lo = _key(tl.sum(tl.where(j == first, smallest, 0.0), axis=0)).to(tl.int64) - 1
    key_hi = _key(tl.sum(tl.where(j == first, largest, 0.0), axis=0)).to(tl.int64)
    take_lo = key_lo > lo
    count_lo = tl.where(take_lo & (first > 0), tl.sum(tl.where(j == first - 1, count, 0), axis=0), count_lo)
    mass_lo = tl.where(take_lo & (first > 0), tl.sum(tl.where(j == first - 1, mass, 0.0), axis=0), mass_lo)
    lo = tl.where(take_lo, key_lo, lo)
    hi = tl.minimum(key_hi, hi)
    return lo, hi, count_lo, mass_lo


@triton.jit
def _bisect(base, vocab, best, temperature, min_p, lo, hi, count_lo, mass_lo, limit, BY_MASS: tl.constexpr,
            PIVOTS: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """Passes over PIVOTS intervals evenly splitting the keys of (lo, hi], each narrowed to its tokens, until one
    value is left in it: every token from it up meets the condition (fewer than `limit` tokens above it, or with
    BY_MASS less weight than `limit`) and none below it does. A pass shrinks the interval's keys at least eightfold
    and never keeps an empty interval, so 11 passes cover the 2^32 keys; the cap of 64 only guards the loop."""
    j = tl.arange(0, PIVOTS).to(tl.int64)
    passes = 0
    while (hi - lo > 1) & (passes < 64):
        width = hi - lo
        upper = _unkey((lo + (width * (j + 1)) // PIVOTS).to(tl.int32))
        lower = _unkey((lo + (width * j) // PIVOTS).to(tl.int32))
        count, mass, smallest, largest = _above(base, vocab, best, temperature, min_p, lower, upper, PIVOTS,
                                                SEARCH_BLOCK)
        if BY_MASS:
            holds = mass < limit
        else:
            holds = count < limit
        lo, hi, count_lo, mass_lo = _narrow(lo, hi, count_lo, mass_lo, count, mass, smallest, largest, holds, PIVOTS)
        passes += 1
    return lo, count_lo, mass_lo, passes


@triton.jit
def _coverage_bound(j, best, temperature, PIVOTS: tl.constexpr):
    """The first pass's interval bounds: -inf, then 32, 16, ..., 1 temperatures below the row's maximum, then it."""
    below = best - temperature * tl.exp2((PIVOTS - 2 - j).to(tl.float32))
    return tl.where(j <= 0, float("-inf"), tl.where(j >= PIVOTS - 1, best, below))


@triton.jit
def _threshold(base, vocab, best, temperature, min_p, top_k, top_p, PIVOTS: tl.constexpr,
               SEARCH_BLOCK: tl.constexpr):
    """The smallest value a row keeps (-inf: every live token) under top_k (<= 0 or >= the tokens min-p leaves: off)
    then top_p (>= 1: off), and the passes over the row the search took."""
    j = tl.arange(0, PIVOTS)
    count, mass, smallest, largest = _above(base, vocab, best, temperature, min_p,
                                            _coverage_bound(j - 1, best, temperature, PIVOTS),
                                            _coverage_bound(j, best, temperature, PIVOTS), PIVOTS, SEARCH_BLOCK)
    live = tl.sum(tl.where(j == 0, count, 0), axis=0)        # above -inf
    count_lo = live
    mass_lo = tl.sum(tl.where(j == 0, mass, 0.0), axis=0)
    lo = _key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)
    top = _key(best).to(tl.int64)
    passes = 1
    if (top_k > 0) & (top_k < live):
        lo, hi, count_lo, mass_lo = _narrow(lo, top, count_lo, mass_lo, count, mass, smallest, largest,
                                            count < top_k, PIVOTS)
        lo, count_lo, mass_lo, k_passes = _bisect(base, vocab, best, temperature, min_p, lo, hi, count_lo, mass_lo,
                                                  top_k, False, PIVOTS, SEARCH_BLOCK)
        passes += k_passes
    if top_p < 1.0:
        # Of the top-k survivors' weight; above 0, so that the maximum stays even for a top_p of 0 or less.
        target = tl.maximum(top_p * mass_lo, 1e-30)
        lo, hi, count_lo, mass_lo = _narrow(lo, top, count_lo, mass_lo, count, mass, smallest, largest,
                                            mass < target, PIVOTS)
        lo, count_lo, mass_lo, p_passes = _bisect(base, vocab, best, temperature, min_p, lo, hi, count_lo, mass_lo,
                                                  target, True, PIVOTS, SEARCH_BLOCK)
        passes += p_passes
    return _unkey((lo + 1).to(tl.int32)), passes


@triton.jit
def _sample_kernel(
    logits_ptr,  # [num_rows, vocab], fp32/fp16/bf16
    temperature_ptr,  # float32 [num_rows]; 0 = greedy
    uniform_ptr,  # float32 [num_rows] in [0, 1)
    top_k_ptr,  # int32/int64 [num_rows], <= 0 or >= vocab: off
    top_p_ptr,  # float32 [num_rows], >= 1: off
    min_p_ptr,  # float32 [num_rows], 0: off
    ids_ptr,  # int64 [num_rows]
    row_max_ptr,  # float32 [num_rows]
    passes_ptr,  # int32 [num_rows]: the threshold search's passes over the row (written when COUNT_PASSES)
    vocab,
    stride_row: tl.int64,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    COUNT_PASSES: tl.constexpr,
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
        # The kept tokens: from `floor` up (every live one, or top-k's / top-p's smallest).
        floor = tl.full((), float("-inf"), tl.float32)
        top_k = tl.minimum(tl.load(top_k_ptr + row), vocab).to(tl.int32)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)   # a token's weight relative to the maximum's must reach it
        passes = 0
        if (top_k > 0) | (top_p < 1.0):
            floor, passes = _threshold(base, vocab, best, temperature, min_p, top_k, top_p, PIVOTS,
                                       SEARCH_BLOCK)
        if COUNT_PASSES:
            tl.store(passes_ptr + row, passes)
        # Pass 2: the total weight, block by block. Pass 3 adds the same block sums in the same order, so the
        # block whose carry passes the target is found exactly where pass 2's sum put it.
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = _clean(tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
            w = _weight(x, best, temperature)
            w = tl.where((x >= floor) & (w >= min_p), w, 0.0)
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
            w = _weight(x, best, temperature)
            w = tl.where((x >= floor) & (w >= min_p), w, 0.0)
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


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,  # [num_rows, vocab], fp32/fp16/bf16
    temperature_ptr,  # float32 [num_rows]; 0 = greedy
    chunk_max_ptr,  # float32 [num_rows, num_chunks]: each chunk's maximum (cleaned)
    chunk_idx_ptr,  # int32 [num_rows, num_chunks]: its first index
    chunk_sum_ptr,  # float32 [num_rows, num_chunks]: sum of exp((x - chunk max) / T) over the chunk
    vocab,
    stride_row: tl.int64,
    num_chunks,
    BLOCK: tl.constexpr,
):
    # grid: (num_rows, num_chunks). One block of a row: its maximum, the maximum's first index and its weight
    # relative to that maximum, so the row's programs read it once between them.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    x = _clean(tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
    chunk_max = tl.max(x, axis=0)
    temperature = tl.minimum(tl.load(temperature_ptr + row), 3.4028234663852886e38)
    temperature = tl.where(temperature > 0, temperature, 1.0)   # a greedy row's sum is not read
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, chunk_max)
    tl.store(chunk_idx_ptr + out, tl.min(tl.where(x == chunk_max, idx, vocab), axis=0))
    tl.store(chunk_sum_ptr + out, tl.sum(_weight(x, chunk_max, temperature), axis=0))


@triton.jit
def _chunk_draw_kernel(
    logits_ptr,  # [num_rows, vocab]
    temperature_ptr,  # float32 [num_rows]
    uniform_ptr,  # float32 [num_rows] in [0, 1)
    chunk_max_ptr,  # _chunk_stats_kernel's
    chunk_idx_ptr,
    chunk_sum_ptr,
    ids_ptr,  # int64 [num_rows]
    row_max_ptr,  # float32 [num_rows]
    vocab,
    stride_row: tl.int64,
    num_chunks,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,  # next power of two >= num_chunks
):
    # grid: (num_rows,). The row's maximum and argmax from its chunks'; for a row that samples, the chunk weights
    # rescaled to the row's maximum, the chunk where their running sum passes the target, and the token where the
    # running sum within that chunk does: one block of the row read again.
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    live_chunk = chunks < num_chunks
    stats = row * num_chunks + chunks
    chunk_max = tl.load(chunk_max_ptr + stats, mask=live_chunk, other=float("-inf"))
    best = tl.max(chunk_max, axis=0)
    first = tl.min(tl.where(chunk_max == best, chunks, CHUNKS), axis=0)   # the first chunk holding the maximum
    chosen = tl.load(chunk_idx_ptr + row * num_chunks + first)
    temperature = tl.minimum(tl.load(temperature_ptr + row), 3.4028234663852886e38)
    if (temperature > 0) & (best > float("-inf")):
        chunk_sum = tl.load(chunk_sum_ptr + stats, mask=live_chunk, other=0.0)
        weight = tl.where(chunk_max > float("-inf"), chunk_sum * tl.exp((chunk_max - best) / temperature), 0.0)
        total = tl.sum(weight, axis=0)
        # Strictly below the total (its float32 predecessor; total >= 1, the maximum's own weight).
        target = tl.minimum(tl.load(uniform_ptr + row) * total,
                            (total.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True))
        running = tl.cumsum(weight, axis=0)
        # The first chunk whose running sum passes the target (a chunk of weight 0 never is); the last chunk of
        # weight > 0 if rounding put every sum at or below it.
        chunk = tl.minimum(tl.sum((running <= target).to(tl.int32), axis=0),
                           tl.max(tl.where(weight > 0, chunks, -1), axis=0))
        carry = tl.sum(tl.where(chunks == chunk - 1, running, 0.0), axis=0)
        idx = chunk * BLOCK + tl.arange(0, BLOCK)
        x = _clean(tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf"))
                   .to(tl.float32))
        w = _weight(x, best, temperature)
        # As the one-program draw: a token of weight 0 repeats its predecessor's running sum, so the first sum past
        # the target is a live token's; the chunk's last live one if rounding put every sum at or below it (the
        # chunk weights above are rounded apart from these).
        at_or_below = tl.sum(((carry + tl.cumsum(w, axis=0) <= target) & (idx < vocab)).to(tl.int32), axis=0)
        chosen = tl.minimum(chunk * BLOCK + at_or_below, tl.max(tl.where(w > 0, idx, -1), axis=0))
    tl.store(ids_ptr + row, chosen.to(tl.int64))
    tl.store(row_max_ptr + row, best)


def check_sample_from_logits_args(logits, temperature, uniform, top_k=None, top_p=None, min_p=None) -> None:
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
    if top_k is not None:
        check_tensor("top_k", top_k, dtypes=(torch.int32, torch.int64), like=("logits", logits), shape=(num_rows,))
    if top_p is not None:
        check_tensor("top_p", top_p, dtypes=(torch.float32,), like=("logits", logits), shape=(num_rows,))
    if min_p is not None:
        check_tensor("min_p", min_p, dtypes=(torch.float32,), like=("logits", logits), shape=(num_rows,))


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
                       top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                       min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` (see the module docstring).

    logits: ``[num_rows, vocab]`` fp32/fp16/bf16 (last dim contiguous; not modified). temperature: float32
    ``[num_rows]``, 0 for a greedy row (the argmax), above float32's range taken as its largest value.
    uniform: float32 ``[num_rows]`` in [0, 1), one number per row (a greedy row's is not read). top_k: optional
    int32/int64 ``[num_rows]``, the row's top-k (0, or the vocabulary or more: off); top_p: optional float32
    ``[num_rows]`` in (0, 1], the row's top-p (1: off); min_p: optional float32 ``[num_rows]`` in [0, 1], the
    row's min-p (0: off), applied first: a token whose probability is below min-p times the most likely one's is
    dropped; a greedy row's are not read. Returns ``(ids, row_max)``:
    int64 ``[num_rows]`` token ids, and float32 ``[num_rows]`` each row's maximum after the clean-up, -inf for a
    row with nothing to draw (every logit -inf or NaN: its id is then 0, and the caller decides what such a row
    takes). No value is read back to the host: CUDA-graph capturable.
    """
    check_sample_from_logits_args(logits, temperature, uniform, top_k, top_p, min_p)
    num_rows = logits.shape[0]
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if has_no_data(logits, temperature, uniform, top_k, top_p, min_p) or num_rows == 0:
        return ids, row_max
    filters = None
    if top_k is not None or top_p is not None or min_p is not None:
        filters = _filters(num_rows, logits.device, top_k, top_p, min_p)
    if use_triton(logits):
        _launch(logits, temperature, uniform, filters, ids, row_max)
        return ids, row_max
    return _sample_torch(logits, temperature, uniform, ids, row_max, *(filters or ()))


def _filters(num_rows: int, device, top_k, top_p, min_p):
    """The three filters' tensors, each given or off (top-k 0, top-p 1, min-p 0)."""
    return (top_k if top_k is not None else torch.zeros(num_rows, dtype=torch.int32, device=device),
            top_p if top_p is not None else torch.ones(num_rows, dtype=torch.float32, device=device),
            min_p if min_p is not None else torch.zeros(num_rows, dtype=torch.float32, device=device))


def _launch(logits, temperature, uniform, filters, ids, row_max, passes=None) -> None:
    """The Triton kernels over every row: with `filters` (top_k, top_p, min_p) one program a row
    (_sample_kernel: the threshold search needs the whole row in one program), `passes` (int32 [num_rows]) to count
    its search's passes; without, the row's blocks in programs of their own, then one program a row for the draw
    (_chunk_stats_kernel, _chunk_draw_kernel)."""
    num_rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, _BLOCK)
    if filters is None and num_chunks > _MAX_CHUNKS:   # past 4M tokens: the row's program, its filters off
        filters = _filters(num_rows, logits.device, None, None, None)
    if filters is None:
        # Three planes, each starting 16-byte aligned whatever the row count (Triton compiles a variant per
        # pointer alignment: a step of another batch size must not compile the kernels again).
        plane = -(-num_rows * num_chunks // 4) * 4
        stats = torch.empty(3, plane, dtype=torch.float32, device=logits.device)[:, :num_rows * num_chunks]
        chunk_max, chunk_sum = stats[0].view(num_rows, num_chunks), stats[1].view(num_rows, num_chunks)
        chunk_idx = stats[2].view(torch.int32).view(num_rows, num_chunks)
        _chunk_stats_kernel[(num_rows, num_chunks)](logits, temperature, chunk_max, chunk_idx, chunk_sum, vocab,
                                                    logits.stride(0), num_chunks, BLOCK=_BLOCK,
                                                    num_warps=_NUM_WARPS)
        _chunk_draw_kernel[(num_rows,)](logits, temperature, uniform, chunk_max, chunk_idx, chunk_sum, ids, row_max,
                                        vocab, logits.stride(0), num_chunks, BLOCK=_BLOCK,
                                        CHUNKS=triton.next_power_of_2(num_chunks), num_warps=_NUM_WARPS)
        return
    top_k, top_p, min_p = filters
    _sample_kernel[(num_rows,)](logits, temperature, uniform, top_k, top_p, min_p, ids, row_max,
                                passes if passes is not None else ids, vocab, logits.stride(0), BLOCK=_BLOCK,
                                PIVOTS=_PIVOTS, SEARCH_BLOCK=_SEARCH_BLOCK, COUNT_PASSES=passes is not None,
                                num_warps=_NUM_WARPS)


def threshold_search_passes(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """How many passes over each row the Triton kernel's top-k / top-p threshold search takes (int32
    ``[num_rows]``; 0 for a row without either, greedy, or with nothing to draw): what it costs beyond the unfiltered
    draw's three passes. For benchmarks and tests (the interpreter counts the same passes on CPU tensors)."""
    uniform = torch.zeros_like(temperature)   # the draws are not kept
    check_sample_from_logits_args(logits, temperature, uniform, top_k, top_p, min_p)
    num_rows = logits.shape[0]
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    passes = torch.zeros(num_rows, dtype=torch.int32, device=logits.device)
    _launch(logits, temperature, uniform, _filters(num_rows, logits.device, top_k, top_p, min_p), ids, row_max, passes)
    return passes


def _kept_floor(x: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The twin of the kernel's threshold search, by a sort: per row of cleaned logits x [num_rows, vocab] and
    their draw weights, the smallest value top-k then top-p keep ([num_rows, 1]; -inf: every live token)."""
    num_rows, vocab = x.shape
    values, order = x.sort(dim=-1, descending=True)
    sorted_weights = weights.gather(1, order)
    live = (values > float("-inf")).sum(dim=-1, keepdim=True)
    # Per position: the tokens strictly above its value (the index of its value's first occurrence, descending).
    ascending = values.flip(-1).contiguous()
    above = vocab - torch.searchsorted(ascending, values, right=True)
    k = top_k.to(torch.int64).unsqueeze(1)
    k_on = (k > 0) & (k < live)
    kept = (values > float("-inf")) & (~k_on | (above < k))
    mass_above = (sorted_weights.cumsum(dim=-1) - sorted_weights).gather(1, above)
    survivors = torch.where(kept, sorted_weights, 0.0).sum(dim=-1, keepdim=True)
    p = top_p.unsqueeze(1)
    kept &= (p >= 1.0) | (mass_above < p * survivors)
    count = kept.sum(dim=-1, keepdim=True).clamp(min=1)
    floor = values.gather(1, count - 1)
    return torch.where((k_on | (p < 1.0)) & (live > 0), floor, float("-inf"))


def _sample_torch(logits, temperature, uniform, ids, row_max, top_k=None, top_p=None, min_p=None):
    """The PyTorch twin: the same draw with tensor ops (the engine sampler's way: engine/worker/sampler.py)."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))
    torch.amax(x, dim=-1, out=row_max)
    torch.argmax(x, dim=-1, out=ids)
    sample = (temperature > 0) & (row_max > float("-inf"))
    scale = torch.where(temperature > 0, temperature.clamp(max=FLOAT32_MAX), 1.0).unsqueeze(1)
    weights = (x - row_max.unsqueeze(1)).div_(scale).nan_to_num_(nan=float("-inf")).exp_()
    if min_p is not None:   # dropped tokens count as -inf for top-k / top-p
        dropped = weights < min_p.unsqueeze(1)
        weights.masked_fill_(dropped, 0.0)
        x.masked_fill_(dropped, float("-inf"))
    if top_k is not None:
        weights = weights.masked_fill_(x < _kept_floor(x, weights, top_k, top_p), 0.0)
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
    ids.copy_(torch.where(sample, drawn, ids))
    return ids, row_max
