"""Collectives over the tensor-parallel group.

The tensor collectives are registered custom ops (`torch.ops.engine.tp_all_reduce`, `tp_all_gather`): inductor
keeps them as opaque nodes of a fullgraph compile instead of tracing into torch.distributed, and their fake
implementations give shapes for dynamic token counts. They are out-of-place (a fresh output), which is what a
graph can reason about; on NCCL the underlying calls are capturable by CUDA graphs. In a single process each one
returns its input unchanged and launches nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.distributed.parallel_state import get_cpu_group, get_tp_group, get_tp_rank, get_tp_world_size


@torch.library.custom_op("engine::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=get_tp_group())
    return out


@_tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# torch 2.13 renamed all_gather_into_tensor (the old name warns); the GPU image's torch 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.library.custom_op("engine::tp_all_gather", mutates_args=())
def _tp_all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """x [d0, ...] of every rank -> [world_size, d0, ...] (gathered flat along dim 0, as gloo and NCCL want)."""
    out = x.new_empty((world_size,) + tuple(x.shape))
    _all_gather_single(out.view((world_size * x.shape[0],) + tuple(x.shape[1:])), x.contiguous(),
                       group=get_tp_group())
    return out


@_tp_all_gather.register_fake
def _(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.new_empty((world_size,) + tuple(x.shape))


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (row-parallel linear outputs, vocab-parallel embeddings), same shape."""
    if get_tp_world_size() == 1:
        return x
    return torch.ops.engine.tp_all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (equal shapes on every rank)."""
    world_size = get_tp_world_size()
    if world_size == 1:
        return x
    dim = dim % x.dim()
    gathered = torch.ops.engine.tp_all_gather(x, world_size)          # [world_size, *x.shape]
    return gathered.movedim(0, dim).reshape(x.shape[:dim] + (world_size * x.shape[dim],) + x.shape[dim + 1:])


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """`x` of every rank concatenated along `dim` on rank `dst` only (the logits of a vocab-parallel LM head go
    to the rank that samples); None on the other ranks."""
    world_size = get_tp_world_size()
    if world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)] if get_tp_rank() == dst else None
    dist.gather(x, parts, dst=dst, group=get_tp_group())
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_tensor(tensor: torch.Tensor, src: int = 0) -> None:
    """In place: every rank's `tensor` becomes rank `src`'s (same shape and dtype on every rank), over the tensor
    group: on NCCL a device-side copy that makes no rank's host wait (async scheduling's sampled ids)."""
    if get_tp_world_size() > 1:
        dist.broadcast(tensor, src=src, group=get_tp_group())


def broadcast_object(obj=None, src: int = 0):
    """`obj` of rank `src`, returned on every rank (pickled over the gloo group: step metadata, sampled ids)."""
    if get_tp_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=get_cpu_group())
    return box[0]


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory allows), on every rank."""
    if get_tp_world_size() == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=get_cpu_group())
    return int(box.item())
