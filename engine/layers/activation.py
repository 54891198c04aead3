"""SwiGLU activation on a fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import pk_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[num_tokens, 2 * d]`` (gate | up) -> ``silu(gate) * up``: ``[num_tokens, d]``."""
        return pk_ops().silu_and_mul(x)
