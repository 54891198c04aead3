"""RMSNorm on pagedkernels' fused kernels."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import pk_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``; with ``residual``: ``residual += x`` then ``(rms_norm(residual), residual)``,
        both in place (x's buffer receives the normed output)."""
        if residual is None:
            return pk_ops().rms_norm(x, self.weight, self.eps)
        return pk_ops().fused_add_rms_norm(x, residual, self.weight, self.eps)
