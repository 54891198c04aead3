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

from engine.distributed.communication import tensor_model_parallel_all_reduce
from engine.distributed.parallel_state import get_tp_rank, get_tp_world_size, num_kv_heads_per_rank


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


def _narrow_checked(loaded: torch.Tensor, dim: int, full_size: int, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a checkpoint tensor along ``dim``, after checking it has ``full_size`` there."""
    if loaded.dim() <= dim or loaded.shape[dim] != full_size:
        raise ValueError(f"shape {tuple(loaded.shape)} does not have {full_size} along dim {dim}")
    return loaded.narrow(dim, start, size)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


class Linear(PackableLinearMixin, nn.Module):
    """``y = x W^T (+ b)``; W: ``[output_size, input_size]`` (this rank's part of it).

    Tensor parallelism (Megatron): ``parallel="column"`` keeps rank r's block of output rows (its outputs
    stay sharded: the next layer takes them as they are), ``parallel="row"`` keeps rank r's block of input
    columns and sums the partial products over the ranks (all-reduce), adding the bias once, after the sum.
    A column layer followed by a row layer (q/k/v -> o, gate/up -> down) needs one all-reduce. With one rank
    both are the plain layer. The checkpoint holds the whole tensors; each rank's loader narrows to its part.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, parallel: str | None = None):
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        self.parallel = parallel
        self.tp_size, self.tp_rank = get_tp_world_size(), get_tp_rank()
        self.full_input_size, self.full_output_size = input_size, output_size
        if parallel == "column":
            output_size = _divide(output_size, self.tp_size, "output_size")
        elif parallel == "row":
            input_size = _divide(input_size, self.tp_size, "input_size")
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.parallel == "column":
            loaded = _narrow_checked(loaded, 0, self.full_output_size, self.tp_rank * self.output_size,
                                     self.output_size)
        elif self.parallel == "row" and param.dim() == 2:   # a row layer's bias is whole on every rank
            loaded = _narrow_checked(loaded, 1, self.full_input_size, self.tp_rank * self.input_size,
                                     self.input_size)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row" or self.tp_size == 1:
            return self._linear(x, self.bias)
        out = tensor_model_parallel_all_reduce(self._linear(x, None))
        return out if self.bias is None else out + self.bias


class _ShardedOutputLinear(Linear):
    """A column-parallel layer whose output rows are several checkpoint tensors (fused projections). Each
    shard id names one checkpoint tensor: ``self.shards[shard_id] = (offset, size)`` is where this rank's part
    of it goes in the parameter, ``self.source[shard_id] = (full_size, start)`` where that part lies in the
    checkpoint tensor (``full_size`` rows, this rank's ``size`` rows from ``start``)."""

    shards: dict
    source: dict

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            self._load_shard(param, loaded, shard_id)
            return
        # The fused tensor itself (Phi-3's qkv_proj / gate_up_proj): cut it into its checkpoint shards first.
        full_sizes = [self.source[sid][0] for sid in self.shards]
        full_shape = (sum(full_sizes),) + tuple(param.shape[1:])
        if tuple(loaded.shape) != full_shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match fused parameter shape {full_shape}")
        for sid, part in zip(self.shards, loaded.split(full_sizes, dim=0)):
            self._load_shard(param, part, sid)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        full_size, start = self.source[shard_id]
        offset, size = self.shards[shard_id]
        _copy_shard(param, _narrow_checked(loaded, 0, full_size, start, size), offset, size)


class MergedLinear(_ShardedOutputLinear):
    """Several projections of one input stacked along the output dim (gate_up_proj: shard 0 = gate,
    1 = up); column-parallel under tensor parallelism (each rank keeps its block of every projection)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp_size = get_tp_world_size()
        self.full_output_sizes = list(output_sizes)
        self.output_sizes = [_divide(size, tp_size, "output_sizes") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, parallel="column")
        self.shards = {i: (sum(self.output_sizes[:i]), size) for i, size in enumerate(self.output_sizes)}
        self.source = {i: (full, self.tp_rank * size)
                       for i, (full, size) in enumerate(zip(self.full_output_sizes, self.output_sizes))}
        for param in self.parameters():
            param.shard_ids = tuple(range(len(output_sizes)))


class QKVLinear(_ShardedOutputLinear):
    """q, k and v projections fused: output rows ``[q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)]``
    of this rank's heads. Under tensor parallelism each rank keeps ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` KV heads; with fewer KV heads than ranks, each rank keeps one, the KV head of its
    query heads (replicated on the ranks that share it). ``num_heads`` / ``num_kv_heads`` are this rank's."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = _divide(num_heads, tp_size, "num_heads")
        if num_kv_heads >= tp_size:
            _divide(num_kv_heads, tp_size, "num_kv_heads")
        elif tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_kv_heads = num_kv_heads_per_rank(num_kv_heads, tp_size)
        # The KV head(s) of this rank's query heads.
        first_kv_head = tp_rank * self.num_heads // (num_heads // num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        # Declared whole (column-parallel divides by tp); the real local size is set right after.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias, parallel="column")
        self.shards = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                       "v": (self.q_size + self.kv_size, self.kv_size)}
        kv_start = first_kv_head * head_dim
        self.source = {"q": (full_q, tp_rank * self.q_size), "k": (full_kv, kv_start), "v": (full_kv, kv_start)}
        for param in self.parameters():
            param.shard_ids = ("q", "k", "v")
