"""Independent float64 references for the mixture-of-experts tests (nothing here calls pagedkernels).

``moe_reference`` runs each token through each of its experts one by one, in float64, from the tensors'
stored values; it also returns, per output element, the magnitude of its terms (every product taken in
absolute value), against which the kernels' rounding is bounded. ``routing_reference`` is the router's math
in float64 with the selection sorted by numpy.
"""

from __future__ import annotations

import numpy as np
import torch


def random_moe(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, dtype: torch.dtype,
               generator: torch.Generator, *, skew: float = 0.0):
    """hidden ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` in ``dtype`` (values ~ 1 / sqrt(fan-in), so
    activations stay O(1)); routing weights float32 ``[T, k]`` (positive, not normalized); ids int32 ``[T, k]``,
    distinct per token. ``skew`` > 0 sends that share of the tokens to experts 0..k-1 (long runs for a few
    experts, most experts with few tokens or none)."""
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5 * 2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate ** 0.5 * 2).to(dtype)
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=generator), dim=1)[:, :top_k]
    skewed = torch.rand(num_tokens, generator=generator) < skew
    ids[skewed] = torch.arange(top_k)
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    return x, w13, w2, weights, ids.to(torch.int32)


def _act(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return gate / (1.0 + torch.exp(-gate))
    return 0.5 * gate * (1.0 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))


def moe_reference(x, w13, w2, weights, ids, activation="silu", expert_map=None, activation_dtype=None):
    """(out, magnitude) float64 ``[T, H]``: out[t] = sum_j w[t, j] w2[e] (act(gate) * up), e = the slot's expert
    (through ``expert_map``; a slot mapped to -1 adds nothing); magnitude the same sum over |terms|, with
    |act(gate)| bounded by 1.2 |gate| (act's slope, for the rounding of gate) and each GEMM's terms in absolute
    value. Expert by expert, each a float64 product of the rows routed to it (by a mask, not a sort).
    ``activation_dtype``: the activated rows ``act(gate) * up`` rounded to it (to nearest) before the down
    projection, as a kernel that feeds the second GEMM 16-bit rows does."""
    intermediate = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    magnitude = torch.zeros_like(out)
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    xd = x.double()
    for e in range(w13.shape[0]):
        tokens, slots = (local == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        w13e, w2e = w13[e].double(), w2[e].double()
        gate_up = xd[tokens] @ w13e.t()
        abs_gate_up = xd[tokens].abs() @ w13e.abs().t()
        y = _act(gate_up[:, :intermediate], activation) * gate_up[:, intermediate:]
        if activation_dtype is not None:
            y = y.to(activation_dtype).double()
        abs_y = abs_gate_up[:, :intermediate] * 1.2 * abs_gate_up[:, intermediate:]
        w = weights.double()[tokens, slots][:, None]
        out.index_add_(0, tokens, w * (y @ w2e.t()))
        magnitude.index_add_(0, tokens, w.abs() * (abs_y @ w2e.abs().t()))
    return out, magnitude


def assert_moe_close(out: torch.Tensor, reference, tolerance: float, what: str = "fused_moe") -> None:
    """|out - ref| <= tolerance * magnitude + 1e-6, elementwise (NaN fails)."""
    ref, magnitude = reference
    error = (out.double() - ref).abs()
    excess = (error - tolerance * magnitude - 1e-6).max().item()
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    assert excess <= 0, (f"{what}: off the float64 reference by {error.max().item():.3g} (past the bound by "
                         f"{excess:.3g}; magnitude up to {magnitude.max().item():.3g})")


def routing_reference(logits, top_k, scoring="softmax", renormalize=False, correction_bias=None,
                      num_expert_group=1, topk_group=1):
    """(weights float64 [T, k], ids int64 [T, k]) by the router's math in float64 (see pagedkernels/moe_topk.py's
    docstring), the selection by numpy's stable sort (decreasing score, lower id first on ties)."""
    z = logits.double().numpy()
    if scoring == "softmax":
        e = np.exp(z - z.max(axis=1, keepdims=True))
        scores = e / e.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-z))
    select = scores + (0.0 if correction_bias is None else correction_bias.double().numpy()[None, :])
    num_tokens, num_experts = z.shape
    if num_expert_group > 1:
        size = num_experts // num_expert_group
        select = select.copy()
        for t in range(num_tokens):
            groups = select[t].reshape(num_expert_group, size)
            top = -np.sort(-groups, axis=1)
            group_score = top[:, 0] + (top[:, 1] if correction_bias is not None else 0.0)
            kept = np.argsort(-group_score, kind="stable")[:topk_group]
            for g in range(num_expert_group):
                if g not in kept:
                    select[t, g * size:(g + 1) * size] = -np.inf
    ids = np.argsort(-select, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return torch.from_numpy(weights), torch.from_numpy(ids)
