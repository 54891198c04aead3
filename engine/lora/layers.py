"""LoRA on the engine's linear layers: each projection of a decoder layer wrapped with its adapters' slots.

:class:`LoRALinear` wraps a :class:`~engine.layers.linear.Linear` (plain, ``QKVLinear`` or ``MergedLinear``; any
quantization method) after its weights are loaded, as vLLM's ``*WithLoRA`` layers do, and keeps ``max_loras``
slots of stacked adapter weights next to it (buffers, in the model's dtype, zero where no adapter is):

    lora_a  [max_loras, num_slices * max_rank, input features of this rank]
    lora_b  [max_loras, output features of this rank, max_rank]     (the adapter's scaling folded in)
    lora_ranks  int32 [max_loras, num_slices]: each slot's own rank per slice (0 where its adapter does not target
                the slice, or the slot is empty)

The kernels take ``lora_ranks``: an adapter of rank 8 in a stack of 16 costs what rank 8 does, and a slice the
adapter leaves alone costs nothing.

A fused projection is one slice per checkpoint projection (q / k / v, gate / up) in the order of its output rows.
Its forward is the base layer's, plus ``pagedkernels.add_lora`` (``lora_shrink`` then ``lora_expand``, two launches
on CUDA) over the step's tokens, each token on the slot :class:`LoRABatch` names for it (-1: none).

Tensor parallelism (Megatron, as the base layer): a column-parallel layer keeps the whole A and its rank's block
of each slice's B rows (the base weight's rows: for q/k/v the rank's heads, a replicated KV head included); a
row-parallel layer keeps its rank's block of A's input columns and the whole B, and adds its partial delta to its
partial output before the all-reduce: sum_r (x_r A_r^T) B^T = x A^T B^T, so the delta needs no collective of its
own.

:class:`LoRABatch` is the seam the model runner (engine/worker/model_runner.py) drives: preallocated device
buffers of ``max_num_tokens`` entries, so CUDA graphs capture reads of them and replays see what the runner wrote
since.
Before each forward (and each graph replay) the runner calls :meth:`LoRABatch.prepare` with the slot of every
token the forward runs, padding rows included. ``active`` is False when no token of the step has an adapter: the
layers then skip the kernels (a step of base-model requests pays nothing). It is read in Python, so a graph
captured with one value replays that value: capture LoRA and non-LoRA graphs apart (and under torch.compile, it
is a guard: two variants).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import pagedkernels as pk
from engine.distributed.communication import tensor_model_parallel_all_reduce
from engine.layers import pk_ops
from engine.layers.linear import Linear

# Projections inside a decoder layer: the modules LoRA applies to (not the embeddings, the LM head or OPT's
# project_in / project_out).
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


class LoRABatch:
    """The adapter slot of each token of the step, in device buffers the layers read.

    token_lora_indices: int32 ``[max_num_tokens]``, the slot of token t (-1: none); the forward of n tokens reads
    the first n. On CUDA also the grouping the Triton kernels take (``pagedkernels.lora_mapping``), computed by
    :meth:`prepare` into ``sorted_token_ids`` ``[max_num_tokens]`` and ``lora_token_starts`` ``[max_loras + 1]``.
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device | str):
        for name, value in (("max_num_tokens", max_num_tokens), ("max_loras", max_loras)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_num_tokens, self.max_loras = max_num_tokens, max_loras
        self.device = torch.device(device)
        self.token_lora_indices = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=self.device)
        self.grouped = self.device.type == "cuda"
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device)
        self.lora_token_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=self.device)
        self.num_tokens = 0
        self.active = False

    def prepare(self, token_slots: np.ndarray | torch.Tensor | None, num_tokens: int | None = None, *,
                active: bool | None = None) -> None:
        """Set the slots of the next forward's tokens: ``token_slots`` int ``[n]`` (host array or tensor; values
        in ``[-1, max_loras)``) or None for a forward with no adapter; ``num_tokens`` (default n) rows run, those
        past n padding (-1). ``active`` overrides whether the layers run the LoRA kernels (default: whether a
        token has an adapter; True to capture a graph's LoRA variant on padding rows). Host work plus one copy;
        on CUDA the grouping, on the device."""
        n = 0 if token_slots is None else len(token_slots)
        num_tokens = n if num_tokens is None else num_tokens
        if not n <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"num_tokens must lie in [{n} (the slots given), {self.max_num_tokens}], got {num_tokens}")
        if n:
            slots = token_slots if isinstance(token_slots, torch.Tensor) else torch.as_tensor(token_slots)
            if slots.dtype != torch.int32:
                slots = slots.to(torch.int32)
            if slots.device.type == "cpu":
                bad = (slots < -1) | (slots >= self.max_loras)
                if bool(bad.any()):
                    raise ValueError(f"token_slots must lie in [-1, {self.max_loras}), got "
                                     f"{int(slots[bad.nonzero()[0, 0]])}")
                self.active = bool((slots >= 0).any())
            else:
                self.active = True
            self.token_lora_indices[:n].copy_(slots, non_blocking=True)
        else:
            self.active = False
        self.token_lora_indices[n:num_tokens].fill_(-1)
        self.num_tokens = num_tokens
        if active is not None:
            self.active = bool(active)
        if self.grouped and self.active:
            pk.lora_mapping(self.token_lora_indices[:num_tokens], self.max_loras,
                            sorted_token_ids=self.sorted_token_ids[:num_tokens],
                            lora_token_starts=self.lora_token_starts)

    def mapping(self, num_tokens: int) -> dict:
        """The ops' grouping arguments for a forward of ``num_tokens`` rows (none off CUDA: the native kernels and
        the twin group the tokens themselves)."""
        if not self.grouped:
            return {}
        return {"sorted_token_ids": self.sorted_token_ids[:num_tokens], "lora_token_starts": self.lora_token_starts}


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """A checkpoint projection an adapter may target: the wrapped layer, its slice (None: the fused layer as a
    whole, A shared by its slices), and the projection's whole (unsharded) input and output sizes."""
    layer: "LoRALinear"
    slice_index: int | None
    in_features: int
    out_features: int


class LoRALinear(nn.Module):
    """A loaded :class:`Linear` plus ``max_loras`` slots of adapters (see the module docstring)."""

    def __init__(self, base: Linear, batch: LoRABatch, *, max_rank: int, dtype: torch.dtype | None = None,
                 slice_names: list[str] | None = None):
        super().__init__()
        self.base_layer = base
        self.batch = batch
        self.prefix = base.prefix
        self.max_rank = max_rank
        self.parallel, self.tp_size, self.tp_rank = base.parallel, base.tp_size, base.tp_rank
        # (this rank's output offset, size) and (the slice's whole rows, where this rank's part starts) per slice
        if base.shards:
            self.slice_local = [base.shards[sid] for sid in base.shards]
            self.slice_source = [base.source[sid] for sid in base.shards]
        else:
            column = base.parallel == "column"
            self.slice_local = [(0, base.output_size)]
            self.slice_source = [(base.full_output_size, base.tp_rank * base.output_size if column else 0)]
        self.slice_sizes = tuple(size for _, size in self.slice_local)
        self.slice_names = list(slice_names or [base.prefix] * len(self.slice_sizes))
        num_slices = len(self.slice_sizes)
        weight_dtype = dtype or _param_dtype(base)
        device = next(base.parameters()).device
        self.register_buffer("lora_a", torch.zeros(batch.max_loras, num_slices * max_rank, base.input_size,
                                                   dtype=weight_dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(batch.max_loras, base.output_size, max_rank, dtype=weight_dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_ranks", torch.zeros(batch.max_loras, num_slices, dtype=torch.int32, device=device),
                             persistent=False)

    # -- the slots -------------------------------------------------------------------------------------------

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_ranks[slot].zero_()

    def set_slice(self, slot: int, slice_index: int | None, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Write one adapter's projection into ``slot``: ``lora_a [r, in_features]`` and ``lora_b [out_features,
        r]`` (scaling folded in) as the checkpoint holds them, whole; this rank keeps its part. ``slice_index``
        None: the fused layer as a whole (A for every slice, B's rows split between them)."""
        rank = lora_a.shape[0]
        if rank > self.max_rank:
            raise ValueError(f"{self.prefix}: adapter rank {rank} exceeds max_lora_rank={self.max_rank}")
        if self.parallel == "row" and self.tp_size > 1:
            local = self.base_layer.input_size
            lora_a = lora_a[:, self.tp_rank * local:(self.tp_rank + 1) * local]
        indices = range(len(self.slice_sizes)) if slice_index is None else [slice_index]
        row = 0
        for s in indices:
            offset, size = self.slice_local[s]
            full, start = self.slice_source[s]
            b = lora_b[row:row + full] if slice_index is None else lora_b
            row += full
            self.lora_a[slot, s * self.max_rank: s * self.max_rank + rank] = lora_a
            self.lora_ranks[slot, s] = rank
            if self.parallel == "row":
                self.lora_b[slot, :, :rank] = b
            else:
                self.lora_b[slot, offset:offset + size, :rank] = b[start:start + size]

    # -- forward ---------------------------------------------------------------------------------------------

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output before a row-parallel layer's all-reduce (and bias), the adapters' deltas added."""
        base = self.base_layer
        reduced_later = base.parallel == "row" and base.tp_size > 1
        out = base.quant_method.apply(base, x, None if reduced_later else base.bias)
        if self.batch.active:
            ops = pk_ops()
            num_tokens = x.shape[0]
            indices = self.batch.token_lora_indices[:num_tokens]
            mapping = self.batch.mapping(num_tokens)
            out = ops.add_lora(x, self.lora_a, self.lora_b, indices, out, slice_sizes=self.slice_sizes,
                               lora_ranks=self.lora_ranks, **mapping)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.forward_local(x)
        base = self.base_layer
        if base.parallel != "row" or base.tp_size == 1:
            return out
        out = tensor_model_parallel_all_reduce(out)
        return out if base.bias is None else out + base.bias

    def extra_repr(self) -> str:
        return (f"prefix={self.prefix!r}, slices={list(zip(self.slice_names, self.slice_sizes))}, "
                f"max_loras={self.lora_a.shape[0]}, max_rank={self.max_rank}")


def _param_dtype(layer: nn.Module) -> torch.dtype:
    """The layer's float dtype (its activations' dtype): the first floating parameter's, else the default."""
    for param in layer.parameters():
        if param.dtype.is_floating_point and param.element_size() > 1:
            return param.dtype
    return torch.get_default_dtype()


def _slice_names(layer: Linear, packed_modules_mapping: dict) -> list[str]:
    """The checkpoint names of a layer's slices: q/k/v_proj for a qkv_proj whose model maps them so, else the
    layer's own name for each (a checkpoint that stores the fused projection, as Phi-3's)."""
    head, _, fused = layer.prefix.rpartition(".")
    if layer.shards:
        by_shard = {sid: fragment for fragment, (target, sid) in packed_modules_mapping.items() if target == fused}
        if set(by_shard) == set(layer.shards):
            return [f"{head}.{by_shard[sid]}" if head else by_shard[sid] for sid in layer.shards]
    return [layer.prefix] * len(layer.output_partition_sizes)


def apply_lora(model: nn.Module, batch: LoRABatch, *, max_rank: int,
               dtype: torch.dtype | None = None) -> dict[str, LoRATarget]:
    """Wrap every :class:`Linear` of ``model``'s decoder layers in a :class:`LoRALinear` (in place, after its
    weights are loaded) and return the projections adapters may target, by checkpoint name (the module names PEFT
    saves under): each slice of a fused layer under its own name (``...q_proj``), or, where the checkpoint stores
    the fused projection itself (Phi-3's ``...qkv_proj``), the fused layer as a whole, A shared by its slices."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} already has LoRA layers: apply_lora wraps a model once")
    packed = getattr(model, "packed_modules_mapping", {})
    targets: dict[str, LoRATarget] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or not _DECODER_LAYER.search(child.prefix or ""):
                continue
            names = _slice_names(child, packed)
            layer = LoRALinear(child, batch, max_rank=max_rank, dtype=dtype, slice_names=names)
            setattr(parent, child_name, layer)
            in_features = child.full_input_size
            if len(set(names)) == len(names):
                for s, name in enumerate(names):
                    targets[name] = LoRATarget(layer, s if len(names) > 1 else None, in_features,
                                               layer.slice_source[s][0])
            else:   # a checkpoint that stores the fused projection: adapters target it whole
                targets[child.prefix] = LoRATarget(layer, None, in_features,
                                                   sum(full for full, _ in layer.slice_source))
    if not targets:
        raise ValueError(f"{type(model).__name__} has no linear layers inside its decoder layers for LoRA")
    return targets
