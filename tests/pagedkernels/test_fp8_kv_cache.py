"""The float8 e4m3 KV cache: reshape_and_cache writes e4m3(clamp(x / scale, +-448)) bit for bit as
torch's own float8_e4m3fn conversion rounds (ties to even, saturating), on every backend; decode and
prefill attention read it with the per-layer scales, against the float64 oracle on the de-quantized
K/V; copy_blocks and swap_blocks move its bytes; scales are checked before any launch.
"""

from __future__ import annotations

import pytest
import torch

import pagedkernels as pk
from tests.pagedkernels.oracle import assert_attention_close, attention_oracle, make_paged_kv

BACKENDS = ["triton", "torch", "native"]
FP8 = torch.float8_e4m3fn
NAN_CODE = 0x7F


def skip_unsupported(backend, dtype, device):
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference write: torch's conversion of the float32 quotient, saturated."""
    return (x.float() / scale).clamp(-448, 448).to(FP8)


def _hard_values(generator, n):
    """Values that stress the rounding: every e4m3 value, the midpoints between neighbours (ties),
    one float32 ulp either side of them, subnormals, magnitudes past 448 (saturation), zeros."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    pool = torch.cat([finite, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                      torch.tensor([1000.0, -1000.0, 460.0, -450.0, 1e-12, -1e-12, 0.0, -0.0]),
                      torch.randn(4096, generator=generator) * 30])
    return pool[torch.randint(0, pool.numel(), (n,), generator=generator)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_reshape_and_cache_writes_torchs_e4m3(backend, dtype, k_scale, v_scale, device):
    gen = torch.Generator().manual_seed(int(k_scale * 1000) + dtype.itemsize)
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 11, 3, 64, 8, 4
    qkv = _hard_values(gen, num_tokens * 4 * num_kv_heads * head_dim).view(num_tokens, -1).to(dtype)
    kv = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, 2, num_kv_heads, head_dim)
    key, value = kv[:, 0], kv[:, 1]  # strided views, as in the engine
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # padding
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, NAN_CODE, dtype=torch.uint8).view(FP8).to(device)
    value_cache = torch.full(shape, NAN_CODE, dtype=torch.uint8).view(FP8).to(device)
    with pk.use_backend(backend):
        pk.reshape_and_cache(key.to(device), value.to(device), key_cache, value_cache, slots.to(device),
                             k_scale=k_scale, v_scale=v_scale)
    written = slots >= 0
    flat_k = key_cache.cpu().view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.cpu().view(torch.uint8).view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[written]], e4m3(key[written], k_scale).view(torch.uint8))
    assert torch.equal(flat_v[slots[written]], e4m3(value[written], v_scale).view(torch.uint8))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert (flat_k[untouched] == NAN_CODE).all() and (flat_v[untouched] == NAN_CODE).all()


def test_hard_values_cover_ties_and_saturation():
    """Guards the test above: ties round both ways, saturation and subnormals occur."""
    x = _hard_values(torch.Generator().manual_seed(0), 20000)
    codes = e4m3(x, 1.0)
    assert (codes.float() == 448).any() and (x > 448).any()
    assert ((codes.float().abs() < 2 ** -6) & (codes.float() != 0)).any()
    truncated = x.abs().to(torch.float64)
    assert (codes.float().abs().double() > truncated).any() and (codes.float().abs().double() < truncated).any()


def _fp8_paged_kv(seq_lens, *, block_size, num_kv_heads, head_dim, k_scale, v_scale, device, generator):
    """make_paged_kv's NaN-poisoned caches as float8 with the scales, and its dense K/V replaced by the
    values the caches now mean (code * scale, float64)."""
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, "cpu", generator=generator)
    kv.keys = [e4m3(k, k_scale).double() * k_scale for k in kv.keys]
    kv.values = [e4m3(v, v_scale).double() * v_scale for v in kv.values]
    kv.key_cache = e4m3(kv.key_cache, k_scale).to(device)  # NaN slots stay NaN codes
    kv.value_cache = e4m3(kv.value_cache, v_scale).to(device)
    kv.block_tables, kv.seq_lens = kv.block_tables.to(device), kv.seq_lens.to(device)
    return kv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, dict(sliding_window=20, softcap=10.0, num_splits=3)])
def test_decode_reads_fp8(backend, dtype, options, device):
    skip_unsupported(backend, dtype, device)
    gen = torch.Generator().manual_seed(7 + len(options))
    k_scale, v_scale = 0.02, 0.05  # randn / scale spans most of e4m3's range
    kv = _fp8_paged_kv([1, 17, 40, 70], block_size=16, num_kv_heads=2, head_dim=64, k_scale=k_scale,
                       v_scale=v_scale, device=device, generator=gen)
    q = (torch.randn(4, 8, 64, generator=gen) * 2).to(dtype)
    with pk.use_backend(backend):
        out = pk.paged_decode_attention(q.to(device), kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        k_scale=k_scale, v_scale=v_scale, **options)
    oracle_options = {k: v for k, v in options.items() if k != "num_splits"}
    expected = torch.stack([attention_oracle(q[s:s + 1], kv.keys[s], kv.values[s], **oracle_options)[0]
                            for s in range(4)])
    assert_attention_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_reads_fp8(backend, dtype, device):
    skip_unsupported(backend, dtype, device)
    gen = torch.Generator().manual_seed(3)
    k_scale, v_scale = 0.03, 0.01
    seq_lens, q_lens = [37, 60, 45], [37, 20, 1]  # a first prefill, a chunk after a prefix, a decode row
    kv = _fp8_paged_kv(seq_lens, block_size=16, num_kv_heads=2, head_dim=64, k_scale=k_scale, v_scale=v_scale,
                       device=device, generator=gen)
    q = (torch.randn(sum(q_lens), 6, 64, generator=gen) * 2).to(dtype)
    cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32)
    with pk.use_backend(backend):
        out = pk.paged_prefill_attention(q.to(device), kv.key_cache, kv.value_cache, kv.block_tables, cu.to(device),
                                         kv.seq_lens, k_scale=k_scale, v_scale=v_scale, sliding_window=30)
    expected = torch.cat([attention_oracle(q[cu[s]:cu[s + 1]], kv.keys[s], kv.values[s], sliding_window=30)
                          for s in range(3)])
    assert_attention_close(out, expected)


def test_scales_change_the_result():
    """Guards the tests above: the scales are not no-ops."""
    gen = torch.Generator().manual_seed(4)
    kv = _fp8_paged_kv([30], block_size=16, num_kv_heads=1, head_dim=32, k_scale=0.05, v_scale=0.05,
                       device="cpu", generator=gen)
    q = torch.randn(1, 2, 32, generator=gen)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    with pk.use_backend("torch"):
        base = pk.paged_decode_attention(*args, k_scale=0.05, v_scale=0.05)
        assert (base - pk.paged_decode_attention(*args, k_scale=0.1, v_scale=0.05)).abs().max() > 1e-3
        torch.testing.assert_close(pk.paged_decode_attention(*args, k_scale=0.05, v_scale=0.1), 2 * base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_and_swap_blocks_move_fp8_bytes(backend, device):
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randint(0, 255, (6, 8, 2, 32), dtype=torch.uint8, generator=gen).view(FP8).to(device)
              for _ in range(4)]
    before = [c.cpu().view(torch.uint8).clone() for c in caches]
    mapping = torch.tensor([[0, 3], [4, 1]], device=device)
    with pk.use_backend(backend):
        pk.copy_blocks(caches[:2], caches[2:], mapping)
    for cache, old in zip(caches, before):
        expected = old.clone()
        expected[3], expected[1] = old[0], old[4]
        assert torch.equal(cache.cpu().view(torch.uint8), expected)
    host = torch.zeros(5, 8, 2, 32, dtype=FP8)
    pk.swap_blocks(caches[0], host, torch.tensor([[3, 0], [5, 4]]))
    assert torch.equal(host.view(torch.uint8)[0], caches[0].cpu().view(torch.uint8)[3])
    assert torch.equal(host.view(torch.uint8)[4], caches[0].cpu().view(torch.uint8)[5])


def test_fp8_holds_twice_the_blocks_of_fp16_in_the_same_bytes():
    fp16 = torch.empty(100, 16, 2, 64, dtype=torch.float16)
    fp8 = torch.empty(200, 16, 2, 64, dtype=FP8)
    assert fp8.numel() * fp8.element_size() == fp16.numel() * fp16.element_size()


def test_scale_checks():
    key = torch.randn(2, 1, 32)
    cache16 = torch.zeros(2, 8, 1, 32)
    cache8 = torch.zeros(2, 8, 1, 32, dtype=FP8)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="k_scale=0.5 applies to a float8_e4m3fn KV cache only"):
        pk.reshape_and_cache(key, key, cache16, cache16, slots, k_scale=0.5)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
            pk.reshape_and_cache(key, key, cache8, cache8, slots, v_scale=bad)
    with pytest.raises(ValueError, match=r"\bvalue\b"):
        pk.reshape_and_cache(key, key.half(), cache8, cache8, slots)
    with pytest.raises(ValueError, match=r"\bkey\b"):
        pk.reshape_and_cache(key.double(), key.double(), cache8, cache8, slots)
    q = torch.randn(1, 2, 32)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale"):
        pk.paged_decode_attention(q, cache16, cache16, table, lens, k_scale=2.0)
    with pytest.raises(ValueError, match="v_scale"):
        pk.paged_prefill_attention(q, cache8, cache8, table, torch.tensor([0, 1], dtype=torch.int32), lens,
                                   v_scale=-1.0)
    with pytest.raises(ValueError, match="value_cache"):
        pk.paged_decode_attention(q, cache8, cache16, table, lens)
