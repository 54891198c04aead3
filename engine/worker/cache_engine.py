"""The CPU swap space: KV blocks of preempted requests, moved to and from the runner's cache by swap_blocks.

The swap space holds, for each KV cache of the runner (the model's, and a draft model's under speculative
decoding), a host copy of its layout `[2 (K, V), num_layers, num_swap_blocks, block_size, num_kv_heads,
head_dim]`, in pinned host memory where CUDA exists (so the copies are asynchronous DMA), and its own block ids
(allocated by BlockManager's swap allocator; a swap block holds the block of every cache). Every copy (and every
later write of a reused block) is enqueued on the current CUDA stream, so stream order alone keeps them apart: no
host synchronization.
"""
import torch

import pagedkernels as pk


def _block_bytes(kv_cache: torch.Tensor) -> int:
    return kv_cache[:, :, 0].numel() * kv_cache.element_size()


def num_swap_blocks_for(swap_space_gib: float, kv_caches: list[torch.Tensor]) -> int:
    """How many blocks of the caches `kv_caches` (one block in each) fit in `swap_space_gib` GiB."""
    return int(swap_space_gib * (1 << 30) // sum(_block_bytes(cache) for cache in kv_caches))


class CacheEngine:
    def __init__(self, kv_caches: list[torch.Tensor], num_swap_blocks: int):
        """kv_caches: the runner's `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` caches."""
        self.kv_caches = kv_caches
        self.swap_caches = []
        for kv_cache in kv_caches:
            shape = list(kv_cache.shape)
            shape[2] = num_swap_blocks
            pin = kv_cache.is_cuda and torch.cuda.is_available()
            self.swap_caches.append(torch.empty(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=pin))
        self.num_swap_blocks = num_swap_blocks

    def release(self) -> None:
        """Drop the caches and the (pinned) swap space: for an engine that is shut down."""
        self.kv_caches, self.swap_caches = [], []

    @property
    def swap_cache(self) -> torch.Tensor:
        """The swap space of the model's own cache."""
        return self.swap_caches[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy cache blocks to swap blocks: pairs of (cache block id, swap block id)."""
        for kv_cache, swap_cache in zip(self.kv_caches, self.swap_caches):
            self._swap(kv_cache, swap_cache, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy swap blocks back into cache blocks: pairs of (swap block id, cache block id). Enqueued on the
        current stream, so the forward that follows sees them."""
        for kv_cache, swap_cache in zip(self.kv_caches, self.swap_caches):
            self._swap(swap_cache, kv_cache, pairs)

    @staticmethod
    def _swap(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for kv in range(src.shape[0]):
            for layer in range(src.shape[1]):
                pk.swap_blocks(src[kv, layer], dst[kv, layer], mapping)
