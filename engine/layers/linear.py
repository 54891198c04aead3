"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Fused projections keep one weight for several checkpoint tensors: ``QKVLinear`` holds q/k/v
stacked along the output dimension, ``MergedLinear`` holds gate/up. Each parameter carries a
``weight_loader(param, loaded, shard_id)`` and the ``shard_ids`` it expects, so the loader can
copy tensors in one by one and report any that never arrived. A checkpoint that stores the fused
tensor itself (Phi-3) passes ``shard_id=None``; the loader still copies it shard by shard, so a
sharded (tensor-parallel) parameter only has to change where each shard goes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_linear_op():
    """``torch.ops.mkldnn._linear_pointwise`` where this torch build has it, else None."""
    if os.environ.get("ENGINE_CPU_LINEAR", "onednn") != "onednn" or not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN_LINEAR = _onednn_linear_op()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except float32 on CPU in eager mode, which goes straight to oneDNN's inner product.

    torch's CPU float32 ``F.linear`` calls the BLAS it was built with (MKL in the PyPI wheels), which
    takes a slow code path on AMD CPUs; oneDNN's kernels are 1.5-3x faster at the engine's shapes
    (measured on a 2-core AMD EPYC with torch 2.13: [48, 576] x [576, 1536] 0.38 ms against 0.78 ms,
    the 49152-row LM head for one token 3.5 ms against 11.4 ms). bf16 ``F.linear`` already uses oneDNN.
    Under ``torch.compile`` inductor picks its own GEMM, so this stays ``F.linear`` there.
    ``ENGINE_CPU_LINEAR=torch`` turns the oneDNN path off.
    """
    if _onednn_applies(x) and weight.dtype == torch.float32:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_applies(x: torch.Tensor) -> bool:
    return (_ONEDNN_LINEAR is not None and x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling())


# Batch size oneDNN tunes a prepacked weight's layout for. It matters little (16-128 measured within a
# few percent of each other at 1-1024 rows); 32 is what vLLM's CPU backend passes.
PREPACK_BATCH_HINT = 32


class PackableLinearMixin:
    """A float32 CPU weight reordered once into oneDNN's blocked layout (``prepack``), so the inner
    product does not repack the plain weight on every call: 1.3-2.5x faster at 8-48 rows, the decode
    batches (measured on a 2-core AMD EPYC: [48, 576] x [576, 3072] 0.44 ms against 0.73 ms, the LM
    head for one token 2.6 ms against 5.1 ms), equal for single rows and long prefills."""

    packed_weight: torch.Tensor | None = None

    def prepack(self, *, keep_weight: bool) -> bool:
        """Pack ``self.weight`` if the oneDNN path applies to it (float32, CPU, not disabled); without
        ``keep_weight`` the plain weight is then freed (as vLLM's CPU backend does) and rebuilt from the
        packed one only if a call cannot take the packed path. Returns whether it packed."""
        weight = self.weight
        if (_ONEDNN_LINEAR is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or weight.dim() != 2 or weight.numel() == 0):
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_BATCH_HINT)
        if not keep_weight:
            self.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        return True

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is None:
            return linear(x, self.weight, bias)
        if _onednn_applies(x):
            return _ONEDNN_LINEAR(x, self.packed_weight, bias, "none", [], "")
        weight = self.weight if self.weight.numel() else self.packed_weight.to_dense()
        return linear(x, weight, bias)


def prepack_linears(model: nn.Module) -> int:
    """Prepack every packable weight of ``model`` (see :class:`PackableLinearMixin`); weights that
    another module also uses (a tied LM head's embedding) are kept. Returns how many were packed."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    return sum(module.prepack(keep_weight=users.get(id(module.weight), 0) > 1)
               for module in model.modules() if isinstance(module, PackableLinearMixin))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if loaded.shape != param.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _copy_shard(param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int) -> None:
    shard = param.data.narrow(0, offset, size)
    if loaded.shape != shard.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match shard shape {tuple(shard.shape)}")
    shard.copy_(loaded)


def _load_shards(param: nn.Parameter, loaded: torch.Tensor, shard_id, shards: dict) -> None:
    """Copy one checkpoint shard (``shards[shard_id]`` = (offset, size) along dim 0) or, with shard_id
    None, a whole fused tensor, shard by shard."""
    if shard_id is not None:
        _copy_shard(param, loaded, *shards[shard_id])
        return
    if loaded.shape != param.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match fused parameter shape {tuple(param.shape)}")
    for offset, size in shards.values():
        _copy_shard(param, loaded.narrow(0, offset, size), offset, size)


class Linear(PackableLinearMixin, nn.Module):
    """``y = x W^T (+ b)``; W: ``[output_size, input_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim (gate_up_proj: shard 0 = gate,
    1 = up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        for param in self.parameters():
            param.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        shards = {i: (sum(self.output_sizes[:i]), size) for i, size in enumerate(self.output_sizes)}
        _load_shards(param, loaded, shard_id, shards)


class QKVLinear(Linear):
    """q, k and v projections fused: output rows ``[q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)]``."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        for param in self.parameters():
            param.shard_ids = ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        shards = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                  "v": (self.q_size + self.kv_size, self.kv_size)}
        _load_shards(param, loaded, shard_id, shards)
