"""The tensor-parallel group: every rank of the job (tensor parallelism only, no pipeline stages).

Rank r holds shard r of every sharded weight and its share of the KV heads. The group is torch.distributed's
default group, set up by `init_distributed_environment` through its standard rendezvous: "env://" (torchrun sets
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; multi-node works the same way) or an explicit "tcp://host:port". NCCL
carries tensors between GPUs, gloo between CPU processes. Step metadata (Python objects, small) goes over a
second, gloo group, so a GPU job never moves pickles through NCCL.

The engine's own record of the group (`_STATE`) is what the layers ask: without it every query answers as a
single rank (world size 1, rank 0), so the layers run unchanged in a single process, even in a process where the
user initialized torch.distributed for something else. `destroy_distributed_environment` leaves the process as
`init_distributed_environment` found it: it destroys only what it created.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Workers wait for rank 0's next step record in a broadcast on the object group; a server with no requests
# keeps them waiting there indefinitely, so that group's timeout is "never" in practice (gloo still notices a
# peer that is gone at once). The tensor collectives, which every rank enters together, keep `timeout_s`.
_OBJECT_GROUP_TIMEOUT = datetime.timedelta(days=365)


@dataclass(slots=True)
class _GroupState:
    world_size: int
    rank: int
    cpu_group: object          # gloo group over the same ranks, for objects (step metadata)
    owns_world: bool           # init_distributed_environment created the default group (and destroys it)


_STATE: _GroupState | None = None
_PLANNED: tuple[int, int] | None = None   # (world_size, rank) answered by planned_layout, without a group


def init_distributed_environment(world_size: int, rank: int, *, init_method: str = "env://",
                                 backend: str | None = None, local_rank: int | None = None,
                                 timeout_s: float = 600.0) -> None:
    """Join the job's process group (blocking until all `world_size` ranks joined or `timeout_s` passed).

    backend: "nccl" for CUDA, "gloo" for CPU; None picks by whether CUDA is available. With NCCL the process's
    CUDA device becomes `local_rank` (default: rank modulo the visible devices). When torch.distributed is
    already initialized (by the caller, e.g. under torchrun), its default group is used as is and left in place
    by `destroy_distributed_environment`; its rank and world size must be these."""
    global _STATE
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if _STATE is not None:
        raise ValueError(f"this process is already rank {_STATE.rank} of a tensor-parallel group of "
                         f"{_STATE.world_size}; call destroy_distributed_environment() first")
    owns_world = not dist.is_initialized()
    if not owns_world:
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, not rank {rank} of {world_size}")
    else:
        if backend == "nccl":
            local_rank = rank % torch.cuda.device_count() if local_rank is None else local_rank
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    try:
        cpu_group = dist.new_group(backend="gloo", timeout=_OBJECT_GROUP_TIMEOUT)
    except BaseException:
        if owns_world:
            dist.destroy_process_group()
        raise
    _STATE = _GroupState(world_size=world_size, rank=rank, cpu_group=cpu_group, owns_world=owns_world)


def is_distributed_initialized() -> bool:
    """Whether this process is a rank of the engine's tensor-parallel group."""
    return _STATE is not None


def get_tp_group():
    """The tensor-parallel process group (None in a single process)."""
    return dist.group.WORLD if _STATE is not None else None


def get_cpu_group():
    """The gloo group over the tensor-parallel ranks, for Python objects (None in a single process)."""
    return _STATE.cpu_group if _STATE is not None else None


def get_tp_world_size() -> int:
    if _PLANNED is not None:
        return _PLANNED[0]
    return _STATE.world_size if _STATE is not None else 1


def get_tp_rank() -> int:
    if _PLANNED is not None:
        return _PLANNED[1]
    return _STATE.rank if _STATE is not None else 0


@contextlib.contextmanager
def planned_layout(world_size: int, rank: int = 0):
    """Inside, the layers see rank `rank` of `world_size` without any process group: to build a model on the
    meta device and find out whether its shapes shard before a process is started or a group joined. No
    collective may run inside."""
    global _PLANNED
    previous, _PLANNED = _PLANNED, (world_size, rank)
    try:
        yield
    finally:
        _PLANNED = previous


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int | None = None) -> int:
    """KV heads one rank holds: its share, or one (replicated) when there are fewer KV heads than ranks."""
    tp_size = get_tp_world_size() if tp_size is None else tp_size
    return num_kv_heads // tp_size if num_kv_heads >= tp_size else 1


def destroy_distributed_environment() -> None:
    """Leave the tensor-parallel group (no-op when there is none): the object group, and the default group when
    init_distributed_environment created it."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    if state.owns_world:
        dist.destroy_process_group()     # every group, the object group included
    else:
        dist.destroy_process_group(state.cpu_group)


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
