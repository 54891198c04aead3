"""Activations: gated ones on a fused gate_up projection (SwiGLU, GeGLU) and plain ones (OPT's ReLU).

Names are transformers' ``hidden_act`` / ``hidden_activation`` / ``activation_function`` values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import pk_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[num_tokens, 2 * d]`` (gate | up) -> ``silu(gate) * up``: ``[num_tokens, d]``."""
        return pk_ops().silu_and_mul(x)


class GeluAndMul(nn.Module):
    """GeGLU: ``gelu(gate) * up``; ``approximate="tanh"`` is transformers' ``gelu_pytorch_tanh`` (Gemma 2),
    ``"none"`` the exact erf form. Two torch ops (pagedkernels has no fused GeGLU)."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[num_tokens, 2 * d]`` (gate | up) -> ``gelu(gate) * up``: ``[num_tokens, d]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


# transformers name -> gated activation on [gate | up]
_GATED = {
    "silu": SiluAndMul, "swish": SiluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"), "gelu_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"), "gelu": lambda: GeluAndMul("none"),
}


def gated_activation(name: str) -> nn.Module:
    """The ``act(gate) * up`` module for transformers' activation ``name``; ValueError naming it if unknown."""
    if name not in _GATED:
        raise ValueError(f"hidden_act={name!r} is not supported (supported: {', '.join(_GATED)})")
    return _GATED[name]()


PLAIN_ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh")


def check_plain_activation(name: str) -> str:
    """``name`` if :class:`Activation` supports it, else a ValueError naming it."""
    if name not in PLAIN_ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(PLAIN_ACTIVATIONS)})")
    return name


class Activation(nn.Module):
    """A plain elementwise activation, in place on its input (the output of the linear before it, which
    nothing else reads): ``relu``, ``gelu`` (erf), ``gelu_new`` / ``gelu_pytorch_tanh`` (tanh form)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = check_plain_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "relu":
            return torch.relu_(x)
        return F.gelu(x, approximate="none" if self.name == "gelu" else "tanh")
