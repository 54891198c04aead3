"""GPU memory: the counters the KV-cache budget is computed from, and the arithmetic, as vLLM profiles it.

    budget = gpu_memory_utilization * total - (torch's peak while loading the weights and running the profile
             step) - (memory taken outside torch meanwhile: CUDA context growth, cuBLAS/NCCL workspaces)

The engine may use `gpu_memory_utilization * total` bytes of the device; what other processes (or this process
before the engine) hold must fit in the rest, which is checked against the memory free when the engine starts
(`torch.cuda.mem_get_info`), before anything is loaded. The profile step is the largest the engine runs: a
forward of max_num_batched_tokens tokens, the logits of every one of them (the most prompt logprobs a step can
ask for), and the sampler on max_num_seqs rows with every stage on.

The counters come through `device_memory(device)`, so a test can script them (tests/engine/fake_cuda.py) and
check the arithmetic without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 2 ** 30


class CudaMemory:
    """torch.cuda's memory counters of one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> CudaMemory:
    """The memory counters of `device` (a CUDA device)."""
    return CudaMemory(device)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """The counters at one moment."""
    free: int
    total: int
    allocated: int   # by torch's caching allocator, in tensors
    reserved: int    # by torch's caching allocator, in segments

    @classmethod
    def take(cls, memory: CudaMemory) -> "MemorySnapshot":
        memory.synchronize()
        free, total = memory.mem_get_info()
        return cls(free=free, total=total, allocated=memory.memory_allocated(), reserved=memory.memory_reserved())


def check_free_memory(start: MemorySnapshot, gpu_memory_utilization: float) -> None:
    """The engine may take gpu_memory_utilization of the device: that much must be free when it starts."""
    requested = gpu_memory_utilization * start.total
    if start.free < requested:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} asks for {requested / GiB:.2f} GiB of the "
                         f"device's {start.total / GiB:.2f} GiB, but only {start.free / GiB:.2f} GiB is free (other "
                         f"processes or tensors hold the rest): lower gpu_memory_utilization or free the device")


@dataclass(frozen=True, slots=True)
class KVBudget:
    """What the profile measured and the KV cache's share, in bytes."""
    requested: float        # gpu_memory_utilization * total
    torch_peak: int         # torch's peak allocation since the start (weights + the profile step)
    non_torch: int          # growth of memory used outside torch's allocator since the start
    kv_cache: float         # requested - torch_peak - non_torch (may be negative: nothing left)


def kv_cache_budget(start: MemorySnapshot, after_profile: MemorySnapshot, peak_allocated: int,
                    gpu_memory_utilization: float) -> KVBudget:
    """The KV cache's budget from the snapshots before loading the model and right after the profile step (its
    tensors released, torch's cache not yet emptied) and the peak allocation in between."""
    torch_peak = max(0, peak_allocated - start.allocated)
    used_growth = start.free - after_profile.free
    non_torch = max(0, used_growth - (after_profile.reserved - start.reserved))
    requested = gpu_memory_utilization * start.total
    return KVBudget(requested=requested, torch_peak=torch_peak, non_torch=non_torch,
                    kv_cache=requested - torch_peak - non_torch)
