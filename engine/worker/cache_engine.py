"""The CPU swap space: KV blocks of preempted requests, moved to and from the runner's cache by swap_blocks.

The swap space has the layout of `ModelRunner.kv_cache`, `[2 (K, V), num_layers, num_swap_blocks, block_size,
num_kv_heads, head_dim]`, in pinned host memory where CUDA exists (so the copies are asynchronous DMA), and its
own block ids (allocated by BlockManager's swap allocator). Every copy (and every later write of a reused block)
is enqueued on the current CUDA stream, so stream order alone keeps them apart: no host synchronization.
"""
import torch

import pagedkernels as pk


def num_swap_blocks_for(swap_space_gib: float, kv_cache: torch.Tensor) -> int:
    """How many blocks of `kv_cache`'s shape fit in `swap_space_gib` GiB."""
    block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    return int(swap_space_gib * (1 << 30) // block_bytes)


class CacheEngine:
    def __init__(self, kv_cache: torch.Tensor, num_swap_blocks: int):
        """kv_cache: the runner's `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` cache."""
        self.kv_cache = kv_cache
        shape = list(kv_cache.shape)
        shape[2] = num_swap_blocks
        pin = kv_cache.is_cuda and torch.cuda.is_available()
        self.swap_cache = torch.empty(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=pin)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy cache blocks to swap blocks: pairs of (cache block id, swap block id)."""
        self._swap(self.kv_cache, self.swap_cache, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy swap blocks back into cache blocks: pairs of (swap block id, cache block id). Enqueued on the
        current stream, so the forward that follows sees them."""
        self._swap(self.swap_cache, self.kv_cache, pairs)

    @staticmethod
    def _swap(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for kv in range(src.shape[0]):
            for layer in range(src.shape[1]):
                pk.swap_blocks(src[kv, layer], dst[kv, layer], mapping)
