"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Fused projections keep one weight for several checkpoint tensors: ``QKVLinear`` holds q/k/v
stacked along the output dimension, ``MergedLinear`` holds gate/up. Each parameter carries a
``weight_loader(param, loaded, shard_id)`` and the ``shard_ids`` it expects, so the loader can
copy tensors in one by one and report any that never arrived. A checkpoint that stores the fused
tensor itself (Phi-3) passes ``shard_id=None``; the loader still copies it shard by shard, so a
sharded (tensor-parallel) parameter only has to change where each shard goes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.communication import tensor_model_parallel_all_reduce
from engine.distributed.parallel_state import get_tp_rank, get_tp_world_size, num_kv_heads_per_rank
from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, set_weight_attrs
# The float path and its oneDNN prepack live with the unquantized method; re-exported for their users.
from engine.layers.quantization.unquantized import (  # noqa: F401
    _ONEDNN_LINEAR, PREPACK_BATCH_HINT, UnquantizedLinearMethod, _onednn_applies, linear, prepack_linears)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if loaded.shape != param.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _narrow_checked(loaded: torch.Tensor, dim: int, full_size: int, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a checkpoint tensor along ``dim``, after checking it has ``full_size`` there."""
    if loaded.dim() <= dim or loaded.shape[dim] != full_size:
        raise ValueError(f"shape {tuple(loaded.shape)} does not have {full_size} along dim {dim}")
    return loaded.narrow(dim, start, size)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


def _packed(param: nn.Parameter, dim: int, value: int, what: str) -> int:
    """``value`` output/input features in units of ``param``'s ``dim`` (divided by its pack factor there)."""
    if getattr(param, "packed_dim", None) != dim:
        return value
    factor = param.pack_factor
    if value % factor:
        raise ValueError(f"{what} ({value} features) does not split the packed tensor: not a multiple of its "
                         f"{factor} values per element")
    return value // factor


class Linear(nn.Module):
    """``y = x W^T (+ b)``; W: ``[output_size, input_size]`` (this rank's part of it).

    How W is stored and multiplied is the layer's ``quant_method`` (engine/layers/quantization/): the
    ``quant_config``'s method for the layer named ``prefix`` (its checkpoint name), else
    :class:`UnquantizedLinearMethod` (a float ``weight``). The method creates the parameters; each carries
    ``output_dim`` / ``input_dim`` (and ``packed_dim`` / ``pack_factor`` for packed integer tensors), from which
    this layer's ``weight_loader`` cuts the rank's part of a checkpoint tensor.

    Tensor parallelism (Megatron): ``parallel="column"`` keeps rank r's block of output rows (its outputs
    stay sharded: the next layer takes them as they are), ``parallel="row"`` keeps rank r's block of input
    columns and sums the partial products over the ranks (all-reduce), adding the bias once, after the sum.
    A column layer followed by a row layer (q/k/v -> o, gate/up -> down) needs one all-reduce. With one rank
    both are the plain layer. The checkpoint holds the whole tensors; each rank's loader narrows to its part
    (a packed dim by its packed size, a GPTQ/AWQ group scale by its groups).

    Fused subclasses pass ``shards`` (shard id -> (offset, size) of this rank's output rows) and ``source``
    (shard id -> (full rows of that checkpoint tensor, start of this rank's part in it)).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, parallel: str | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 shards: dict | None = None, source: dict | None = None, reduce_results: bool = True):
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        if not reduce_results and bias:
            raise ValueError("a row-parallel layer without its all-reduce cannot add its bias (once, after the sum)")
        self.parallel, self.prefix = parallel, prefix
        # False: a row-parallel layer returns this rank's partial product, for a caller that adds more to it
        # before one all-reduce of its own (the MoE block's shared expert).
        self.reduce_results = reduce_results
        self.tp_size, self.tp_rank = get_tp_world_size(), get_tp_rank()
        self.full_input_size, self.full_output_size = input_size, output_size
        if parallel == "column":
            output_size = _divide(output_size, self.tp_size, "output_size")
        elif parallel == "row":
            input_size = _divide(input_size, self.tp_size, "input_size")
        self.input_size, self.output_size = input_size, output_size
        self.shards, self.source = shards, source
        self.output_partition_sizes = [size for _, size in shards.values()] if shards else [output_size]
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes, self.full_input_size,
                                         self.full_output_size, torch.get_default_dtype(), self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, weight_loader=self.weight_loader, output_dim=0, input_dim=None)
        else:
            self.register_parameter("bias", None)
        if shards:
            for param in self.parameters():
                param.shard_ids = tuple(shards)
        # Shard-less parameters of fused layers (GPTQ's g_idx) already loaded from one of the shards.
        self._whole_loaded: dict[str, object] = {}

    # -- loading -------------------------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        input_dim, output_dim = getattr(param, "input_dim", None), getattr(param, "output_dim", None)
        if self.parallel == "row" and input_dim is not None:   # a row layer's bias is whole on every rank
            local = param.shape[input_dim]
            loaded = _narrow_checked(loaded, input_dim, local * self.tp_size, self.tp_rank * local, local)
        if getattr(param, "per_shard_scalar", False):
            self._load_shard_scalar(param, loaded, shard_id)
            return
        if output_dim is None:
            self._load_whole(param, loaded, shard_id)
            return
        if not self.shards:
            if self.parallel == "column":
                local = param.shape[output_dim]
                loaded = _narrow_checked(loaded, output_dim, local * self.tp_size, self.tp_rank * local, local)
            default_weight_loader(param, loaded)
            return
        if shard_id is not None:
            self._load_shard(param, loaded, shard_id)
            return
        # The fused tensor itself (Phi-3's qkv_proj / gate_up_proj): cut it into its checkpoint shards first.
        full_sizes = [_packed(param, output_dim, self.source[sid][0], f"shard {sid}") for sid in self.shards]
        full_shape = list(param.shape)
        full_shape[output_dim] = sum(full_sizes)
        if list(loaded.shape) != full_shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match fused parameter shape {tuple(full_shape)}")
        for sid, part in zip(self.shards, loaded.split(full_sizes, dim=output_dim)):
            self._load_shard(param, part, sid)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {list(self.shards)})")
        dim = param.output_dim
        full_size, start = (_packed(param, dim, v, f"shard {shard_id}") for v in self.source[shard_id])
        offset, size = (_packed(param, dim, v, f"shard {shard_id}") for v in self.shards[shard_id])
        part = _narrow_checked(loaded, dim, full_size, start, size)
        target = param.data.narrow(dim, offset, size)
        if part.shape != target.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match shard shape {tuple(target.shape)}")
        target.copy_(part)

    def _load_whole(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """A parameter with no output dim: the same tensor for every shard of a fused layer (GPTQ's g_idx of
        q, k and v: one input, one act-order). The shards must agree; the first one loads it."""
        if loaded.shape != param.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
        name = next(n for n, p in self.named_parameters() if p is param)
        if self.shards and name in self._whole_loaded:
            if not torch.equal(param.data, loaded.to(param.dtype)):
                raise ValueError(f"{name} of shard {shard_id!r} differs from shard {self._whole_loaded[name]!r}'s; "
                                 f"the fused layer holds one {name} for all its shards")
            return
        param.data.copy_(loaded)
        self._whole_loaded[name] = shard_id

    def _load_shard_scalar(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """One value per checkpoint tensor (an fp8 per-tensor scale): at the shard's index (all of them for a
        fused checkpoint tensor, or a layer that is not fused)."""
        if loaded.numel() != 1:
            raise ValueError(f"shape {tuple(loaded.shape)}: expected one value (a per-tensor scale)")
        if shard_id is None:
            param.data.fill_(loaded.reshape(()).item())
            return
        ids = list(self.shards or ())
        if shard_id not in ids:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {ids})")
        param.data[ids.index(shard_id)] = loaded.reshape(())

    # -- forward ------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row" or self.tp_size == 1 or not self.reduce_results:
            return self.quant_method.apply(self, x, self.bias)
        out = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim (gate_up_proj: shard 0 = gate,
    1 = up); column-parallel under tensor parallelism (each rank keeps its block of every projection)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        self.full_output_sizes = list(output_sizes)
        self.output_sizes = [_divide(size, tp_size, "output_sizes") for size in output_sizes]
        shards = {i: (sum(self.output_sizes[:i]), size) for i, size in enumerate(self.output_sizes)}
        source = {i: (full, tp_rank * size) for i, (full, size) in enumerate(zip(self.full_output_sizes,
                                                                                self.output_sizes))}
        super().__init__(input_size, sum(output_sizes), bias, parallel="column", quant_config=quant_config,
                         prefix=prefix, shards=shards, source=source)


class QKVLinear(Linear):
    """q, k and v projections fused: output rows ``[q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)]``
    of this rank's heads. Under tensor parallelism each rank keeps ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` KV heads; with fewer KV heads than ranks, each rank keeps one, the KV head of its
    query heads (replicated on the ranks that share it). ``num_heads`` / ``num_kv_heads`` are this rank's."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
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
        shards = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                  "v": (self.q_size + self.kv_size, self.kv_size)}
        kv_start = first_kv_head * head_dim
        source = {"q": (full_q, tp_rank * self.q_size), "k": (full_kv, kv_start), "v": (full_kv, kv_start)}
        # Declared whole (column-parallel divides by tp); the real local size is this rank's heads.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias, parallel="column",
                         quant_config=quant_config, prefix=prefix, shards=shards, source=source)
