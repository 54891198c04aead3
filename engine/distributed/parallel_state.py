"""The tensor-parallel group: every rank of the job (tensor parallelism only, no pipeline stages).

Rank r holds shard r of every sharded weight and its share of the KV heads. The group is torch.distributed's
default group, set up by `init_distributed_environment` through its standard rendezvous: "env://" (torchrun sets
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; multi-node works the same way) or an explicit "tcp://host:port". NCCL
carries tensors between GPUs, gloo between CPU processes. Step metadata (Python objects, small) goes over a
second, gloo group, so a GPU job never moves pickles through NCCL.

Without an initialized group every query answers as a single rank (world size 1, rank 0), so the layers run
unchanged in a single process.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_CPU_GROUP = None   # gloo group over the same ranks, for objects (step metadata); the default group when gloo


def init_distributed_environment(world_size: int, rank: int, *, init_method: str = "env://",
                                 backend: str | None = None, local_rank: int | None = None,
                                 timeout_s: float = 600.0) -> None:
    """Join the job's process group (blocking until all `world_size` ranks joined or `timeout_s` passed).

    backend: "nccl" for CUDA, "gloo" for CPU; None picks by whether CUDA is available. With NCCL the process's
    CUDA device becomes `local_rank` (default: rank modulo the visible devices)."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, not rank {rank} of {world_size}")
    else:
        if backend == "nccl":
            local_rank = rank % torch.cuda.device_count() if local_rank is None else local_rank
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    global _CPU_GROUP
    _CPU_GROUP = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def is_distributed_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_group():
    """The tensor-parallel process group (None in a single process)."""
    return dist.group.WORLD if is_distributed_initialized() else None


def get_cpu_group():
    """The gloo group over the tensor-parallel ranks, for Python objects (None in a single process)."""
    return _CPU_GROUP if is_distributed_initialized() else None


def get_tp_world_size() -> int:
    return dist.get_world_size() if is_distributed_initialized() else 1


def get_tp_rank() -> int:
    return dist.get_rank() if is_distributed_initialized() else 0


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int | None = None) -> int:
    """KV heads one rank holds: its share, or one (replicated) when there are fewer KV heads than ranks."""
    tp_size = get_tp_world_size() if tp_size is None else tp_size
    return num_kv_heads // tp_size if num_kv_heads >= tp_size else 1


def destroy_distributed_environment() -> None:
    """Leave the process group (no-op when there is none)."""
    global _CPU_GROUP
    if is_distributed_initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a single-machine "tcp://127.0.0.1:PORT" rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_rank_and_world_size() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when this process was started by torchrun (or another env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
