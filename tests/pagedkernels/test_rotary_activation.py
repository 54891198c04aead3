"""rotary_embedding, compute_cos_sin_cache and silu_and_mul against float64 references."""

import math

import pytest
import torch

import pagedkernels as pk

BACKENDS = ["triton", "torch", "native"]
# (dtype, atol, rtol) vs float64: a few ulps of the output dtype (computation is fp32).
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-3, 2e-3),
    (torch.bfloat16, 1e-2, 1.6e-2),
]


def skip_bf16_interpreter(backend: str, dtype: torch.dtype, device: str) -> None:
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


# ----------------------------------------------------------------------------------------------
# rotary
# ----------------------------------------------------------------------------------------------


def make_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_size]. Rotation as multiplication by e^{i theta} of the
    complex numbers formed by each rotated pair, in float64."""
    x, cos_sin = x.double().cpu(), cos_sin.double().cpu()[positions.cpu()]
    rot_dim = cos_sin.shape[-1]
    half = rot_dim // 2
    rotation = torch.complex(cos_sin[:, :half], cos_sin[:, half:])[:, None, :]  # [tokens, 1, half]
    out = x.clone()
    if is_neox:
        pairs = torch.complex(x[..., :half], x[..., half:rot_dim]) * rotation
        out[..., :half], out[..., half:rot_dim] = pairs.real, pairs.imag
    else:
        pairs = torch.view_as_complex(x[..., :rot_dim].reshape(*x.shape[:2], half, 2).contiguous()) * rotation
        out[..., :rot_dim] = torch.view_as_real(pairs).flatten(-2)
    return out


# (num_q_heads, num_kv_heads, head_size, rot_dim): full, partial with a non-power-of-two head,
# rot_dim/2 = 48 (padded tile), and 20 heads of 256 (two head chunks per program in Triton).
ROTARY_SHAPES = [(4, 2, 64, 64), (6, 3, 80, 32), (2, 1, 128, 96), (20, 4, 256, 256)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size, rot_dim", ROTARY_SHAPES)
def test_rotary_embedding(backend, device, dtype, atol, rtol, is_neox, num_q_heads, num_kv_heads, head_size, rot_dim):
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(head_size + rot_dim + is_neox)
    num_tokens, max_position = 7, 50
    positions = torch.randint(0, max_position, (num_tokens,), generator=g).to(device)
    # fp32 cache for the full-rotary shapes, model-dtype cache for the others.
    cache_dtype = torch.float32 if rot_dim == head_size else dtype
    cos_sin = make_cos_sin_cache(max_position, rot_dim).to(cache_dtype).to(device)
    # q and k are strided 2-D views into a fused qkv buffer; v must come out untouched.
    q_width, kv_width = num_q_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=g).to(dtype).to(device)
    q, k, v = qkv[:, :q_width], qkv[:, q_width: q_width + kv_width], qkv[:, q_width + kv_width:]
    q_ref = rotary_ref(q.view(num_tokens, num_q_heads, head_size), positions, cos_sin, is_neox)
    k_ref = rotary_ref(k.view(num_tokens, num_kv_heads, head_size), positions, cos_sin, is_neox)
    v_before = v.clone()

    with pk.use_backend(backend):
        pk.rotary_embedding(positions, q, k, cos_sin, is_neox=is_neox, head_size=head_size)

    q3 = q.view(num_tokens, num_q_heads, head_size).cpu()
    k3 = k.view(num_tokens, num_kv_heads, head_size).cpu()
    torch.testing.assert_close(q3.double(), q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k3.double(), k_ref, atol=atol, rtol=rtol)
    # Dimensions past rot_dim are copied bit for bit (never round-tripped through fp32 math).
    assert torch.equal(q3[..., rot_dim:], q_ref[..., rot_dim:].to(dtype))
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_embedding_3d_q_without_k(backend, device):
    g = torch.Generator().manual_seed(11)
    positions = torch.tensor([0, 9, 3, 9, 17, 9, 3, 9], device=device)[::2]  # strided: [0, 3, 17, 3]
    cos_sin = make_cos_sin_cache(20, 64).float().to(device)
    q = torch.randn(4, 3, 64, generator=g).to(device)
    q_ref = rotary_ref(q, positions, cos_sin, True)
    with pk.use_backend(backend):
        pk.rotary_embedding(positions, q, None, cos_sin)
    torch.testing.assert_close(q.cpu().double(), q_ref, atol=1e-5, rtol=1e-5)
    # Position 0 is the identity rotation.
    torch.testing.assert_close(q[0].cpu().double(), q_ref[0], atol=0, rtol=0)


def qk_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm in float64: x [num_tokens, num_heads, head_size]."""
    x = x.double().cpu()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double().cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size, rot_dim", ROTARY_SHAPES)
def test_qk_norm_rotary_embedding(backend, device, dtype, atol, rtol, is_neox, num_q_heads, num_kv_heads, head_size,
                                  rot_dim):
    """Qwen3's q/k norm and the rotation in one call against the float64 oracle (the norm, then the rotation),
    on strided views of a fused qkv buffer whose v comes out untouched."""
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(3 * head_size + rot_dim + is_neox)
    num_tokens, max_position, eps = 5, 40, 1e-6
    positions = torch.randint(0, max_position, (num_tokens,), generator=g).to(device)
    cos_sin = make_cos_sin_cache(max_position, rot_dim).to(torch.float32).to(device)
    q_width, kv_width = num_q_heads * head_size, num_kv_heads * head_size
    qkv = (3 * torch.randn(num_tokens, q_width + 2 * kv_width, generator=g)).to(dtype).to(device)
    q, k, v = qkv[:, :q_width], qkv[:, q_width: q_width + kv_width], qkv[:, q_width + kv_width:]
    q_weight = (0.5 + torch.rand(head_size, generator=g)).to(dtype).to(device)
    k_weight = (0.5 + torch.rand(head_size, generator=g)).to(device)   # float32: any float dtype
    q3, k3 = q.view(num_tokens, num_q_heads, head_size), k.view(num_tokens, num_kv_heads, head_size)
    q_ref = rotary_ref(qk_norm_ref(q3, q_weight, eps), positions, cos_sin, is_neox)
    k_ref = rotary_ref(qk_norm_ref(k3, k_weight, eps), positions, cos_sin, is_neox)
    v_before = v.clone()

    with pk.use_backend(backend):
        pk.qk_norm_rotary_embedding(positions, q, k, q_weight, k_weight, eps, cos_sin, is_neox=is_neox,
                                    head_size=head_size)

    # the normed value is rounded to the dtype before it rotates (as the unfused ops store it): two roundings
    torch.testing.assert_close(q3.cpu().double(), q_ref, atol=2 * atol, rtol=2 * rtol)
    torch.testing.assert_close(k3.cpu().double(), k_ref, atol=2 * atol, rtol=2 * rtol)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qk_norm_rotary_embedding_matches_the_unfused_ops(backend, device):
    """The fused call gives what rms_norm on q and k, then rotary_embedding give (float32; the sum of squares
    may add in another order)."""
    g = torch.Generator().manual_seed(5)
    positions = torch.tensor([0, 7, 3, 19], device=device)
    cos_sin = make_cos_sin_cache(20, 64).float().to(device)
    qkv = torch.randn(4, (4 + 2 * 2) * 64, generator=g).to(device)
    weights = torch.rand(2, 64, generator=g).to(device)
    fused, unfused = qkv.clone(), qkv.clone()
    with pk.use_backend(backend):
        q, k = fused[:, :256].view(4, 4, 64), fused[:, 256:384].view(4, 2, 64)
        pk.qk_norm_rotary_embedding(positions, q, k, weights[0], weights[1], 1e-5, cos_sin)
        q, k = unfused[:, :256].view(4, 4, 64), unfused[:, 256:384].view(4, 2, 64)
        q.copy_(pk.rms_norm(q, weights[0], 1e-5))
        k.copy_(pk.rms_norm(k, weights[1], 1e-5))
        pk.rotary_embedding(positions, q, k, cos_sin)
    torch.testing.assert_close(fused, unfused, atol=2e-6, rtol=2e-6)


def test_qk_norm_rotary_validation():
    positions = torch.tensor([0, 1, 2])
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    w = torch.ones(64)
    cos_sin = make_cos_sin_cache(8, 64).float()
    cases = [
        (dict(k=None), "k must be given"),
        (dict(q_weight=torch.ones(32)), "q_weight"),
        (dict(k_weight=torch.ones(64, 1)), "k_weight"),
        (dict(k_weight=torch.ones(64, dtype=torch.int32)), "k_weight"),
        (dict(eps=-1.0), "eps"),
        (dict(eps=None), "eps"),
        (dict(positions=torch.tensor([0, 1, 8])), "positions"),
        (dict(q=torch.randn(2, 4, 64)), "q"),
    ]
    for override, match in cases:
        args = dict(positions=positions, q=q, k=k, q_weight=w, k_weight=w, eps=1e-6, cos_sin_cache=cos_sin)
        args.update(override)
        with pytest.raises(ValueError, match=match):
            pk.qk_norm_rotary_embedding(**args)


# (num_q_heads, num_kv_heads, head_size, rot_dim, block_size): the rotary shapes, over caches of several block sizes
ROTARY_CACHE_SHAPES = [(4, 2, 64, 64, 16), (6, 3, 80, 32, 8), (2, 1, 128, 96, 32), (20, 4, 256, 256, 16)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("cache_dtype", ["model", "fp8"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_size, rot_dim, block_size", ROTARY_CACHE_SHAPES)
def test_rotary_embedding_and_cache_equals_the_unfused_ops(backend, device, dtype, norm, cache_dtype, num_q_heads,
                                                           num_kv_heads, head_size, rot_dim, block_size):
    """q and k rotated (after the per-head norms with ``norm``) and the rotated k and v written into their slots, as
    qk_norm_rotary_embedding (or rotary_embedding) then reshape_and_cache do it: the same bits. A padding token
    (slot -1) is rotated and not cached; every other slot keeps its NaN."""
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(7 * head_size + rot_dim + norm)
    num_tokens, max_position, num_blocks, eps = 5, 40, 6, 1e-6
    positions = torch.randint(0, max_position, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[2] = -1
    slots = slots.to(device)
    cos_sin = make_cos_sin_cache(max_position, rot_dim).to(torch.float32).to(device)
    q_width, kv_width = num_q_heads * head_size, num_kv_heads * head_size
    qkv = (3 * torch.randn(num_tokens, q_width + 2 * kv_width, generator=g)).to(dtype).to(device)
    weights = (0.5 + torch.rand(2, head_size, generator=g)).to(device) if norm else (None, None)
    fp8 = cache_dtype == "fp8"
    scales = dict(k_scale=0.05, v_scale=0.03) if fp8 else {}

    def caches():
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        if fp8:   # NaN codes (0x7f) where nothing is written
            return [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
                    for _ in range(2)]
        return [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(2)]

    def split(buffer):
        return (buffer[:, :q_width].view(num_tokens, num_q_heads, head_size),
                buffer[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_size),
                buffer[:, q_width + kv_width:].view(num_tokens, num_kv_heads, head_size))

    fused, unfused = qkv.clone(), qkv.clone()
    fused_caches, unfused_caches = caches(), caches()
    with pk.use_backend(backend):
        q, k, v = split(fused)
        pk.rotary_embedding_and_cache(positions, q, k, v, *fused_caches, slots, cos_sin, head_size=head_size,
                                      q_weight=weights[0], k_weight=weights[1], eps=eps if norm else None, **scales)
        q, k, v = split(unfused)
        if norm:
            pk.qk_norm_rotary_embedding(positions, q, k, weights[0], weights[1], eps, cos_sin, head_size=head_size)
        else:
            pk.rotary_embedding(positions, q, k, cos_sin, head_size=head_size)
        pk.reshape_and_cache(k, v, *unfused_caches, slots, **scales)
    assert torch.equal(fused, unfused)
    for got, expected in zip(fused_caches, unfused_caches):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(fused, qkv), "nothing was rotated"


def test_rotary_embedding_and_cache_validation():
    positions, slots = torch.tensor([0, 1, 2]), torch.tensor([4, 9, -1])
    q, k, v = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    caches = (torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64))
    cos_sin = make_cos_sin_cache(8, 64).float()
    w = torch.ones(64)
    cases = [
        (dict(k=None), "k must be given"),
        (dict(q_weight=w), "q_weight and k_weight go together"),
        (dict(eps=1e-6), "eps is the per-head norms'"),
        (dict(q_weight=w, k_weight=w), "eps"),
        (dict(v=torch.randn(3, 3, 64)), "value must have shape"),
        (dict(key_cache=torch.zeros(4, 8, 3, 64)), "key_cache|value_cache"),
        (dict(slot_mapping=torch.tensor([0, 1])), "slot_mapping"),
        (dict(k_scale=0.5), "k_scale"),
        (dict(positions=torch.tensor([0, 1, 8])), "positions"),
        (dict(slot_mapping=torch.tensor([0, 1, 32])), "slot_mapping"),
    ]
    for override, match in cases:
        args = dict(positions=positions, q=q, k=k, v=v, key_cache=caches[0], value_cache=caches[1],
                    slot_mapping=slots, cos_sin_cache=cos_sin)
        args.update(override)
        with pytest.raises(ValueError, match=match):
            pk.rotary_embedding_and_cache(**args)


def test_compute_cos_sin_cache():
    cache = pk.compute_cos_sin_cache(100, 16, 500000.0)
    assert cache.shape == (100, 16) and cache.dtype == torch.float32
    torch.testing.assert_close(cache.double(), make_cos_sin_cache(100, 16, 500000.0), atol=1e-6, rtol=0)
    inv_freq = torch.rand(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    scaled = pk.compute_cos_sin_cache(10, 16, 10000.0, inv_freq=inv_freq, dtype=torch.float64)
    assert math.isclose(scaled[7, 3].item(), math.cos(7 * inv_freq[3].item()), rel_tol=1e-12)
    assert math.isclose(scaled[7, 8 + 3].item(), math.sin(7 * inv_freq[3].item()), rel_tol=1e-12)
    with pytest.raises(ValueError, match="rot_dim"):
        pk.compute_cos_sin_cache(10, 15, 10000.0)
    with pytest.raises(ValueError, match="inv_freq"):
        pk.compute_cos_sin_cache(10, 16, 10000.0, inv_freq=torch.rand(4))


def test_rotary_validation():
    positions = torch.tensor([0, 1, 2])
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    cos_sin = make_cos_sin_cache(8, 64).float()
    cases = [
        (dict(positions=positions.int()), "positions"),
        (dict(positions=torch.tensor([0, 1, 8])), "positions"),  # == max_position
        (dict(positions=torch.tensor([0, -1, 2])), "positions"),
        (dict(q=torch.randn(2, 4, 64)), "q"),
        (dict(q=q.long()), "q"),
        (dict(q=torch.randn(3, 4, 64, 2)[..., 0]), "q"),  # last dim not contiguous
        (dict(k=k.half()), "k"),
        (dict(k=torch.randn(3, 100)), "k"),  # not a multiple of head_size 64
        (dict(cos_sin_cache=cos_sin[:, :63]), "cos_sin_cache"),  # odd rot_dim
        (dict(cos_sin_cache=make_cos_sin_cache(8, 128).float()), "cos_sin_cache"),  # rot_dim > head_size
        (dict(cos_sin_cache=cos_sin.long()), "cos_sin_cache"),
    ]
    for override, name in cases:
        args = dict(positions=positions, q=q, k=k, cos_sin_cache=cos_sin)
        args.update(override)
        with pytest.raises(ValueError, match=name):
            pk.rotary_embedding(**args)


# ----------------------------------------------------------------------------------------------
# silu_and_mul
# ----------------------------------------------------------------------------------------------


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    x = x.double().cpu()
    gate, up = x.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("d", [123, 769, 1500])  # 1500 > one program's 1024-element tile
def test_silu_and_mul(backend, device, dtype, atol, rtol, d):
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(d)
    # Strided rows: a slice of a wider NaN-padded buffer.
    buffer = torch.full((2, 3, 2 * d + 8), float("nan"), dtype=dtype, device=device)
    buffer[..., : 2 * d] = (torch.randn(2, 3, 2 * d, generator=g) * 3).to(dtype).to(device)
    x = buffer[..., : 2 * d]
    with pk.use_backend(backend):
        y = pk.silu_and_mul(x)
    assert y.shape == (2, 3, d) and y.dtype == dtype
    torch.testing.assert_close(y.cpu().double(), silu_and_mul_ref(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_and_mul_out(backend, device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2 * 64, generator=g).half().to(device)
    out = torch.full((5, 64), float("nan"), dtype=torch.float16, device=device)
    with pk.use_backend(backend):
        y = pk.silu_and_mul(x, out=out)
    assert y is out
    torch.testing.assert_close(out.cpu().double(), silu_and_mul_ref(x), atol=1e-3, rtol=2e-3)


def test_silu_and_mul_validation():
    x = torch.randn(4, 64)
    cases = [
        (lambda: pk.silu_and_mul(torch.randn(4, 63)), "x"),
        (lambda: pk.silu_and_mul(x.long()), "x"),
        (lambda: pk.silu_and_mul(torch.randn(64, 4).t()), "x"),
        (lambda: pk.silu_and_mul(x, out=torch.empty(4, 64)), "out"),
        (lambda: pk.silu_and_mul(x, out=torch.empty(4, 32, dtype=torch.float16)), "out"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
