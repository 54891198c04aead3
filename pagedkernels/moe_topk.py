"""Mixture-of-experts routing: each token's top-k experts and their weights, from the router's logits.

For token t with router logits z = logits[t] (``[num_experts]``), computed in float32:

    s = softmax(z)          scoring "softmax" (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
    s = sigmoid(z)          scoring "sigmoid" (DeepSeek-V3, GLM-4.5)
    c = s + correction_bias (selection scores; c = s without a bias)

    grouped top-k (DeepSeek), with the experts in num_expert_group equal groups of consecutive ids: a group's
    score is its largest c (its two largest summed, with a correction bias: DeepSeek-V3); the experts outside
    the topk_group best groups are left out of the selection.

    ids[t]     = the top_k experts by c, in decreasing order (ties: the lower expert id first)
    weights[t] = s[ids[t]], divided by their sum when ``renormalize``

Backends: a Triton kernel (one program per ``BLOCK_ROWS`` tokens, a row of logits one tile: top-k is k
passes of an argmax), a native CPU kernel (``csrc/moe_cpu.c``: the same passes, parallel over tokens) and
the PyTorch twin (``torch.topk``), which the others are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, use_native, use_triton
from ._validate import FLOAT_DTYPES, check_tensor

__all__ = ["moe_topk", "check_moe_topk_args", "SCORING_FUNCTIONS", "MAX_EXPERTS"]

SCORING_FUNCTIONS = ("softmax", "sigmoid")
# A row of logits is one tile of the Triton kernel (padded to a power of two); DeepSeek-V3 has 256 experts.
MAX_EXPERTS = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_moe_topk_args(logits, top_k, scoring="softmax", renormalize=False, correction_bias=None,
                        num_expert_group=1, topk_group=1, weights_dtype=torch.float32) -> tuple[int, int]:
    """Every check of :func:`moe_topk`'s arguments (none reads a tensor value), shared with its fake
    implementation. Returns (num_tokens, num_experts)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_experts = logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"logits: num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring must be one of {SCORING_FUNCTIONS}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    if not _is_int(num_expert_group) or num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group must be a positive int dividing num_experts ({num_experts}), "
                         f"got {num_expert_group!r}")
    if not _is_int(topk_group) or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be an int in [1, num_expert_group={num_expert_group}], got {topk_group!r}")
    selectable = topk_group * (num_experts // num_expert_group)
    if not _is_int(top_k) or not 1 <= top_k <= selectable:
        raise ValueError(f"top_k must be an int in [1, {selectable}] (the experts of topk_group={topk_group} of "
                         f"{num_expert_group} groups of {num_experts} experts), got {top_k!r}")
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, dtypes=FLOAT_DTYPES, like=("logits", logits),
                     shape=(num_experts,))
        if num_expert_group > 1 and num_experts // num_expert_group < 2:
            raise ValueError("correction_bias with num_expert_group: a group's score sums its two best experts, "
                             f"so groups need at least 2 experts, got {num_experts // num_expert_group}")
    if weights_dtype not in FLOAT_DTYPES:
        raise ValueError(f"weights_dtype must be one of {FLOAT_DTYPES}, got {weights_dtype!r}")
    return num_tokens, num_experts


def moe_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each token routes to (see the module docstring for the math).

    Args:
        logits: ``[num_tokens, num_experts]`` fp16/bf16/fp32, the router's output; num_experts <= 1024.
        top_k: experts per token.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide each token's k weights by their sum (Mixtral always; Qwen and OLMoE when their
            config's ``norm_topk_prob`` says so).
        correction_bias: optional ``[num_experts]`` added to the scores for the selection only (DeepSeek-V3's
            ``e_score_correction_bias``); the weights stay the unbiased scores.
        num_expert_group, topk_group: grouped top-k (both 1: plain top-k).
        weights_dtype: dtype of the returned weights (float32; the model's dtype where a model rounds them so,
            as transformers' Qwen-MoE routers do).

    Returns:
        ``(topk_weights [num_tokens, top_k] weights_dtype, topk_ids [num_tokens, top_k] int32)``, both
        contiguous, each row in decreasing order of selection score.
    """
    num_tokens, num_experts = check_moe_topk_args(logits, top_k, scoring, renormalize, correction_bias,
                                                  num_expert_group, topk_group, weights_dtype)
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if has_no_data(logits, correction_bias) or num_tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if use_triton(logits):
        _moe_topk_triton(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
                         weights, ids)
    elif use_native(logits):
        _native.moe_topk(logits, top_k, SCORING_FUNCTIONS.index(scoring), renormalize, correction_bias,
                         num_expert_group, topk_group, weights, ids)
    else:
        w, i = _moe_topk_torch(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group)
        weights.copy_(w)
        ids.copy_(i)
    return weights, ids


def _moe_topk_torch(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group):
    """The PyTorch twin: float32 scores, torch.topk over the selection scores."""
    z = logits.float()
    scores = torch.softmax(z, dim=-1) if scoring == "softmax" else torch.sigmoid(z)
    select = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1:
        grouped = select.view(select.shape[0], num_expert_group, -1)
        if correction_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        select = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(select)
    ids = select.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _masked_best(select, cols, axis_len: tl.constexpr):
    """(argmax, max) of each row of ``select`` ``(R, E_PAD)``; the lower column wins ties."""
    best = tl.max(select, axis=1)  # (R,)
    # The first column holding the maximum: argmax with the lowest index on ties (tl.argmax's tie rule is
    # the same, written out so that every version agrees).
    first = tl.min(tl.where(select == best[:, None], cols[None, :], axis_len), axis=1)
    return first, best


# Not specialized on the step's tokens: a step of a new shape compiles no variant of its own
# (tests/engine/test_kernel_variants.py).
@triton.jit(do_not_specialize=["num_tokens"])
def _moe_topk_kernel(
    logits_ptr,  # [num_tokens, num_experts]
    bias_ptr,  # [num_experts], read when HAS_BIAS
    weights_ptr,  # [num_tokens, TOP_K], the weights' dtype
    ids_ptr,  # int32 [num_tokens, TOP_K]
    num_tokens,
    num_experts,
    stride_l: tl.int64,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= TOP_K
    E_PAD: tl.constexpr,  # next power of two >= num_experts
    BLOCK_ROWS: tl.constexpr,
    SIGMOID: tl.constexpr,  # scoring: sigmoid (else softmax)
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,  # grouped top-k when > 1
    TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # num_experts // NUM_GROUPS
):
    # grid: (cdiv(num_tokens, BLOCK_ROWS),); one program = BLOCK_ROWS tokens, each row one tile.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (R,)
    row_mask = rows < num_tokens
    cols = tl.arange(0, E_PAD)  # (E_PAD,)
    col_mask = cols < num_experts
    mask = row_mask[:, None] & col_mask[None, :]
    # Z : (R, E_PAD) float32; padding columns -inf (softmax weight 0, never selected)
    Z = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)
    if SIGMOID:
        S = 1.0 / (1.0 + tl.exp(-Z))
    else:
        z_max = tl.max(Z, axis=1)
        z_max = tl.where(row_mask, z_max, 0.0)  # rows past the end: all -inf, kept finite
        P = tl.exp(Z - z_max[:, None])
        total = tl.sum(P, axis=1)
        S = P / tl.where(total > 0, total, 1.0)[:, None]
    S = tl.where(mask, S, 0.0)
    C = S  # selection scores
    if HAS_BIAS:
        C = C + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    C = tl.where(col_mask[None, :], C, float("-inf"))
    if NUM_GROUPS > 1:
        group_of = cols // GROUP_SIZE  # (E_PAD,); padding columns fall past the last group
        groups = tl.arange(0, NUM_GROUPS)  # NUM_GROUPS is a power of two here (see the wrapper)
        G = tl.full([BLOCK_ROWS, NUM_GROUPS], float("-inf"), tl.float32)  # group scores
        for g in tl.static_range(NUM_GROUPS):
            in_group = (group_of == g)[None, :]
            Cg = tl.where(in_group, C, float("-inf"))
            first, best = _masked_best(Cg, cols, E_PAD)
            score = best
            if HAS_BIAS:  # DeepSeek-V3: the group's two best experts, summed
                second = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), Cg), axis=1)
                score = best + second
            G = tl.where(groups[None, :] == g, score[:, None], G)
        keep = tl.zeros([BLOCK_ROWS, E_PAD], tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            g_first, _ = _masked_best(G, groups, NUM_GROUPS)
            keep = keep | (group_of[None, :] == g_first[:, None])
            G = tl.where(groups[None, :] == g_first[:, None], float("-inf"), G)
        C = tl.where(keep, C, float("-inf"))
    k_offs = tl.arange(0, K_PAD)  # (K_PAD,)
    W = tl.zeros([BLOCK_ROWS, K_PAD], tl.float32)
    ID = tl.zeros([BLOCK_ROWS, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        first, _ = _masked_best(C, cols, E_PAD)  # (R,)
        chosen = cols[None, :] == first[:, None]  # (R, E_PAD), one column per row
        w = tl.sum(tl.where(chosen, S, 0.0), axis=1)
        W = tl.where(k_offs[None, :] == j, w[:, None], W)
        ID = tl.where(k_offs[None, :] == j, first[:, None], ID)
        C = tl.where(chosen, float("-inf"), C)
    if RENORMALIZE:
        total = tl.sum(W, axis=1)
        W = W / tl.where(total > 0, total, 1.0)[:, None]
    out_mask = row_mask[:, None] & (k_offs < TOP_K)[None, :]
    out_offs = rows.to(tl.int64)[:, None] * TOP_K + k_offs[None, :]
    tl.store(weights_ptr + out_offs, W.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out_offs, ID, mask=out_mask)


def topk_block_rows(num_experts: int) -> int:
    """Tokens per program: a [rows, next_power_of_2(num_experts)] float32 tile of at most 2048 values (16 per
    thread of 4 warps; the kernel keeps four such tiles live): 8 rows of 256 experts, 16 of 128, 32 of 64, 64
    (the most) of 32 or fewer. Tiles of 4096 spilled at 64 experts (sm_90 and sm_80, Triton 3.9)."""
    return max(1, min(64, 2048 // triton.next_power_of_2(num_experts)))


def _moe_topk_triton(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
                     weights, ids):
    num_tokens, num_experts = logits.shape
    num_groups = num_expert_group
    if num_groups > 1 and num_groups & (num_groups - 1):
        # The group scores are a (rows, NUM_GROUPS) tile: a power of two. Other counts (DeepSeek-V2's 8 of 160
        # experts are one) take the twin.
        w, i = _moe_topk_torch(logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group)
        weights.copy_(w)
        ids.copy_(i)
        return
    block_rows = topk_block_rows(num_experts)
    grid = (triton.cdiv(num_tokens, block_rows),)
    _moe_topk_kernel[grid](
        logits, logits if correction_bias is None else correction_bias, weights, ids,
        num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        BLOCK_ROWS=block_rows, SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize,
        HAS_BIAS=correction_bias is not None, NUM_GROUPS=num_groups, TOPK_GROUPS=topk_group,
        GROUP_SIZE=num_experts // num_groups, num_warps=4,
    )
