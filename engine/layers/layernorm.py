"""Normalization layers: RMSNorm on pagedkernels' fused kernels, LayerNorm (OPT) on torch's.

Both take an optional ``residual`` and then work on the residual stream the way the decoder layers
carry it: ``residual += x`` in place, and the norm of the sum is returned next to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import pk_ops


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, with ``weight = offset + checkpoint weight``.

    ``offset=1.0`` is Gemma's ``(1 + w)`` norm: the checkpoint stores ``w`` around 0. The offset is added
    once, when the weight is loaded (its ``weight_loader``), so the forward is the plain fused kernel with
    no per-call work. In float32 this is what transformers computes; in half precision ``1 + w`` is rounded
    to the model dtype once, where transformers adds it in float32 on every call (a relative difference of
    one rounding of the weight, within the dtype's own error).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
        # The sum in float32 (loaded may be bf16), then one rounding into the parameter's dtype.
        param.data.copy_(loaded.float() + self.offset if self.offset else loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``; with ``residual``: ``residual += x`` then ``(rms_norm(residual), residual)``,
        both in place (x's buffer receives the normed output)."""
        if residual is None:
            return pk_ops().rms_norm(x, self.weight, self.eps)
        return pk_ops().fused_add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """``(x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dimension (``bias=False``: none)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``[num_tokens, hidden_size]`` -> its layer norm; with ``residual``: ``residual += x`` in place,
        then ``(layer_norm(residual), residual)``."""
        if residual is None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        residual.add_(x)
        return F.layer_norm(residual, self.weight.shape, self.weight, self.bias, self.eps), residual
