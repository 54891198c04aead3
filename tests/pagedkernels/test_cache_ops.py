"""reshape_and_cache, copy_blocks and swap_blocks: exact copies, and nothing else touched.

Caches start NaN-poisoned (or filled with a sentinel per block) so that any write outside the
targeted slots, and any slot that was missed, shows.
"""

import importlib

import pytest
import torch

import pagedkernels as pk

cache_ops = importlib.import_module("pagedkernels.cache_ops")

BACKENDS = ["triton", "torch", "native"]
# bf16 runs through the interpreter too: these kernels only load and store, and the interpreter's
# bf16 problems are in arithmetic and conversions.
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------


# (num_tokens, num_kv_heads, head_dim, block_size); the last case needs two head chunks per token
# in the Triton launch (block_h = 4096 // 256 = 16 < 20 heads).
RESHAPE_CASES = [(13, 2, 64, 8), (9, 3, 80, 16), (5, 1, 128, 32), (3, 20, 256, 8)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim, block_size", RESHAPE_CASES)
def test_reshape_and_cache(backend, device, dtype, num_tokens, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(num_tokens * head_dim)
    num_blocks = (num_tokens + block_size - 1) // block_size + 3
    num_q_heads = 2 * num_kv_heads
    # key/value are strided views of a fused qkv projection [num_tokens, (q + k + v) heads * head_dim].
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    kv = qkv[:, num_q_heads * head_dim:].view(num_tokens, 2, num_kv_heads, head_dim)
    key, value = kv[:, 0], kv[:, 1]
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[: num_tokens // 3]] = -1  # padding tokens
    slot_mapping = torch.stack([slots, -slots], dim=1).to(device)[:, 0]  # a strided view
    key_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    value_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    with pk.use_backend(backend):
        pk.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    written = slots >= 0
    flat_k = key_cache.cpu().view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.cpu().view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[written]], key.cpu()[written])
    assert torch.equal(flat_v[slots[written]], value.cpu()[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_reshape_and_cache_validation():
    key_cache = torch.zeros(4, 8, 2, 64)
    value_cache = torch.zeros(4, 8, 2, 64)
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([0, 1, 2, -1, 31])
    cases = [
        (dict(key=key.half()), "key"),
        (dict(key=torch.randn(5, 3, 64)), "key"),
        (dict(key=torch.randn(5, 2, 64, 2)[..., 0]), "key"),  # last dim not contiguous
        (dict(value=torch.randn(4, 2, 64)), "value"),
        (dict(value=value.half()), "value"),
        (dict(key_cache=torch.zeros(4, 8, 2, 64, dtype=torch.int32)), "key_cache"),
        (dict(value_cache=torch.zeros(4, 8, 2, 32)), "value_cache"),
        (dict(slot_mapping=slots.int()), "slot_mapping"),
        (dict(slot_mapping=slots[:4]), "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, -1, 32])), "slot_mapping"),  # 4 blocks x 8 = 32 slots
    ]
    for override, name in cases:
        args = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
        args.update(override)
        with pytest.raises(ValueError, match=name):
            pk.reshape_and_cache(**args)
    assert (key_cache == 0).all()  # nothing was written by any failing call


# ----------------------------------------------------------------------------------------------
# copy_blocks
# ----------------------------------------------------------------------------------------------


class LaunchCounter:
    """Wraps a Triton kernel and counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(backend, device, dtype, monkeypatch):
    g = torch.Generator().manual_seed(3)
    num_layers, num_blocks, shape = 3, 10, (8, 3, 80)
    key_caches = [torch.randn(num_blocks, *shape, generator=g).to(dtype).to(device) for _ in range(num_layers)]
    value_caches = [torch.randn(num_blocks, *shape, generator=g).to(dtype).to(device) for _ in range(num_layers)]
    block_mapping = torch.tensor([[2, 7], [0, 5], [2, 9], [4, 1]], device=device)
    expected = []
    for cache in key_caches + value_caches:
        ref = cache.cpu().clone()
        for src, dst in block_mapping.tolist():
            ref[dst] = ref[src]
        expected.append(ref)
    counter = LaunchCounter(cache_ops._copy_blocks_kernel)
    monkeypatch.setattr(cache_ops, "_copy_blocks_kernel", counter)

    with pk.use_backend(backend):
        pk.copy_blocks(key_caches, value_caches, block_mapping)

    assert counter.launches == (1 if backend == "triton" else 0)
    for cache, ref in zip(key_caches + value_caches, expected):
        assert torch.equal(cache.cpu(), ref)


def test_copy_blocks_large_block_needs_several_chunks(triton_device):
    """A block larger than one program's tile (16 x 4 x 64 = 4096 > 2048 elements)."""
    g = torch.Generator().manual_seed(4)
    key_caches = [torch.randn(4, 16, 4, 64, generator=g).to(triton_device) for _ in range(2)]
    value_caches = [torch.randn(4, 16, 4, 64, generator=g).to(triton_device) for _ in range(2)]
    expected = [c.clone() for c in key_caches + value_caches]
    for ref in expected:
        ref[3] = ref[0]
    with pk.use_backend("triton"):
        pk.copy_blocks(key_caches, value_caches, torch.tensor([[0, 3]], device=triton_device))
    for cache, ref in zip(key_caches + value_caches, expected):
        assert torch.equal(cache, ref)


def test_copy_blocks_validation():
    def caches(n=2, **kw):
        return [torch.zeros(6, 4, 2, 16, **kw) for _ in range(n)]

    mapping = torch.tensor([[0, 1]])
    cases = [
        (lambda: pk.copy_blocks([], [], mapping), "key_caches"),
        (lambda: pk.copy_blocks(caches(), caches(3), mapping), "value_caches"),
        (lambda: pk.copy_blocks(caches(), caches()[:1] + [torch.zeros(6, 4, 2, 8)], mapping), r"value_caches\[1\]"),
        (lambda: pk.copy_blocks(caches(), caches(dtype=torch.float16), mapping), r"value_caches\[0\]"),
        (lambda: pk.copy_blocks(caches()[:1] + [torch.zeros(6, 4, 16, 2).transpose(2, 3)], caches(), mapping),
         r"key_caches\[1\]"),
        (lambda: pk.copy_blocks(caches(), caches(), mapping.int()), "block_mapping"),
        (lambda: pk.copy_blocks(caches(), caches(), torch.tensor([0, 1])), "block_mapping"),
        (lambda: pk.copy_blocks(caches(), caches(), torch.tensor([[0, 6]])), "block_mapping"),
        (lambda: pk.copy_blocks(caches(), caches(), torch.tensor([[-1, 2]])), "block_mapping"),
        (lambda: pk.copy_blocks(caches(), caches(), torch.tensor([[0, 2], [1, 2]])), "block_mapping"),
        (lambda: pk.copy_blocks(caches(), caches(), torch.tensor([[0, 2], [2, 3]])), "block_mapping"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()


# ----------------------------------------------------------------------------------------------
# swap_blocks
# ----------------------------------------------------------------------------------------------


SWAP_MAPPING = [[0, 3], [1, 4], [2, 5], [5, 0], [7, 8]]  # a run of three, then two single blocks


def check_swap(src: torch.Tensor, dst: torch.Tensor, mapping: list[list[int]]) -> None:
    """dst starts as NaN: mapped blocks must equal their sources, every other block stay NaN."""
    pk.swap_blocks(src, dst, torch.tensor(mapping))
    if dst.is_cuda or src.is_cuda:
        torch.cuda.synchronize()
    src_cpu, dst_cpu = src.cpu(), dst.cpu()
    for s, d in mapping:
        assert torch.equal(dst_cpu[d], src_cpu[s])
    unmapped = sorted(set(range(dst.shape[0])) - {d for _, d in mapping})
    assert dst_cpu[unmapped].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_same_device(device, dtype):
    g = torch.Generator().manual_seed(5)
    src = torch.randn(8, 4, 2, 16, generator=g).to(dtype).to(device)
    dst = torch.full((10, 4, 2, 16), float("nan"), dtype=dtype, device=device)
    check_swap(src, dst, SWAP_MAPPING)


def test_swap_blocks_cpu_to_cpu_both_directions():
    g = torch.Generator().manual_seed(6)
    gpu_like = torch.randn(8, 4, 2, 16, generator=g)
    host = torch.full((10, 4, 2, 16), float("nan"))
    check_swap(gpu_like, host, SWAP_MAPPING)  # swap out
    back = torch.full_like(gpu_like, float("nan"))
    check_swap(host, back, [[d, s] for s, d in SWAP_MAPPING])  # swap in
    assert torch.equal(back[[s for s, _ in SWAP_MAPPING]], gpu_like[[s for s, _ in SWAP_MAPPING]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks_cuda_and_host(pinned):
    g = torch.Generator().manual_seed(7)
    gpu = torch.randn(8, 4, 2, 16, generator=g).half().cuda()
    host = torch.full((10, 4, 2, 16), float("nan"), dtype=torch.float16, pin_memory=pinned)
    check_swap(gpu, host, SWAP_MAPPING)  # GPU -> CPU
    gpu_back = torch.full_like(gpu, float("nan"))
    check_swap(host, gpu_back, [[d, s] for s, d in SWAP_MAPPING])  # CPU -> GPU


def test_swap_blocks_validation():
    src, dst = torch.randn(4, 8, 16), torch.randn(6, 8, 16)
    mapping = torch.tensor([[0, 1]])
    cases = [
        (lambda: pk.swap_blocks(src.long(), dst, mapping), "src"),
        (lambda: pk.swap_blocks(src, torch.randn(6, 8, 8), mapping), "dst"),
        (lambda: pk.swap_blocks(src, dst.half(), mapping), "dst"),
        (lambda: pk.swap_blocks(src, dst, mapping.int()), "block_mapping"),
        (lambda: pk.swap_blocks(src, dst, torch.tensor([[0, 1, 2]])), "block_mapping"),
        (lambda: pk.swap_blocks(src, dst, torch.tensor([[4, 1]])), "source"),
        (lambda: pk.swap_blocks(src, dst, torch.tensor([[0, 6]])), "destination"),
        (lambda: pk.swap_blocks(src, dst, torch.tensor([[0, -1]])), "destination"),
    ]
    if torch.cuda.is_available():
        cases.append((lambda: pk.swap_blocks(src, dst, mapping.cuda()), "block_mapping"))
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
