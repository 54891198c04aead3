"""skinny_gemm (few-row GEMM with an RMSNorm prologue or a residual-add epilogue) against a float64 oracle, both
backends, and its argument checks."""

import importlib
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter looks for it in a jit function's module)

import pagedkernels as pk
from pagedkernels import _backend, torch_ops
from pagedkernels.skinny_gemm import MAX_ROWS, skinny_gemm_config

BACKENDS = ["triton", "torch"]
# (dtype, atol, rtol) against float64 with the op's rounding points: a few ulps of the dtype at these sizes.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (6e-2, 2e-2)}
EPS = 1e-6


def skip_bf16_interpreter(backend, dtype, device):
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def oracle(x, weight, bias=None, norm_weight=None, eps=None, residual=None, gated=None):
    """float64 with the op's rounding points: the normalized rows (or SiLU-and-mul's output) and the product in x's
    dtype, the residual's sum in its dtype."""
    xd = x.double().cpu()
    if gated is not None:
        gate, up = xd.chunk(2, dim=-1)
        xd = (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype).double()
    if norm_weight is not None:
        xd = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double().cpu()).to(x.dtype)
        xd = xd.double()
    product = xd @ weight.double().cpu().t()
    if bias is not None:
        product = product + bias.double().cpu()
    product = product.to(x.dtype).double()
    if residual is None:
        return product
    return (product + residual.double().cpu()).to(residual.dtype).double()


def rand(*shape, g, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


# (M, N, K): every row count up to MAX_ROWS among them, N past a block and odd, K over one BLOCK_K (512) and not a
# multiple of it.
SHAPES = [(1, 40, 64), (2, 7, 100), (3, 33, 600), (4, 64, 1030), (5, 17, 48), (8, 24, 520), (7, 5, 16)]


def _inputs(M, N, K, kind, dtype, device):
    """(x, weight, bias, norm_weight, eps, residual, gated) of a call of ``kind`` ("plain", or "+"-joined "bias",
    "norm", "residual", "gated"); x's rows strided (a slice of a wider buffer, NaN past its width): only those values
    of a row are read."""
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    gated = "silu" if "gated" in kind else None
    width = 2 * K if gated else K
    buffer = torch.full((M, width + 3), float("nan"), dtype=dtype, device=device)
    buffer[:, :width] = rand(M, width, g=g, dtype=dtype, device=device, scale=2.0)
    weight = rand(N, K, g=g, dtype=dtype, device=device, scale=K ** -0.5)
    bias = rand(N, g=g, dtype=dtype, device=device) if "bias" in kind else None
    norm_weight = rand(K, g=g, dtype=torch.float32, device=device) if "norm" in kind else None
    residual = rand(M, N, g=g, dtype=dtype, device=device) if "residual" in kind else None
    return buffer[:, :width], weight, bias, norm_weight, EPS if norm_weight is not None else None, residual, gated


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("kind", ["plain", "bias", "norm", "residual", "norm+bias+residual", "gated+residual"])
def test_matches_the_oracle(backend, device, dtype, M, N, K, kind):
    skip_bf16_interpreter(backend, dtype, device)
    x, weight, bias, norm_weight, eps, residual, gated = _inputs(M, N, K, kind, dtype, device)
    residual_before = residual.clone() if residual is not None else None
    x_before = x.clone()
    with pk.use_backend(backend):
        result = pk.skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)
    expected = oracle(x, weight, bias, norm_weight, eps, residual_before, gated)
    atol, rtol = TOLERANCES[dtype]
    assert result.shape == (M, N) and result.dtype == dtype
    if residual is not None:
        assert result is residual
    torch.testing.assert_close(result.double().cpu(), expected, atol=atol, rtol=rtol)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_residual_and_out(backend, device):
    """A float32 residual stream beside fp16 activations (the sum rounded to float32, not to fp16), and ``out``."""
    g = torch.Generator().manual_seed(3)
    x = rand(3, 96, g=g, dtype=torch.float16, device=device)
    weight = rand(50, 96, g=g, dtype=torch.float16, device=device, scale=0.1)
    residual = rand(3, 50, g=g, dtype=torch.float32, device=device) * 1000
    before = residual.clone()
    with pk.use_backend(backend):
        pk.skinny_gemm(x, weight, residual=residual)
    torch.testing.assert_close(residual.double().cpu(), oracle(x, weight, residual=before), atol=1e-3, rtol=1e-6)
    out = torch.full((3, 50), float("nan"), dtype=torch.float16, device=device)
    with pk.use_backend(backend):
        assert pk.skinny_gemm(x, weight, out=out) is out
    torch.testing.assert_close(out.double().cpu(), oracle(x, weight), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_gated_prologue_equals_silu_and_mul_then_the_product(backend, device):
    g = torch.Generator().manual_seed(5)
    x = rand(3, 2 * 200, g=g, dtype=torch.float16, device=device, scale=3.0)
    weight = rand(40, 200, g=g, dtype=torch.float16, device=device, scale=0.07)
    with pk.use_backend(backend):
        fused = pk.skinny_gemm(x, weight, gated="silu")
        unfused = pk.skinny_gemm(pk.silu_and_mul(x), weight)
    if backend == "torch":
        assert torch.equal(fused, unfused)
    torch.testing.assert_close(fused.float(), unfused.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_prologue_equals_rms_norm_then_the_product(backend, device):
    """The fused norm is the unfused pair's: rms_norm rounded to x's dtype, then the product (fp16: the pair and the
    fused call agree to the product's own rounding)."""
    g = torch.Generator().manual_seed(4)
    x = rand(2, 300, g=g, dtype=torch.float16, device=device, scale=4.0)
    weight = rand(64, 300, g=g, dtype=torch.float16, device=device, scale=0.06)
    norm_weight = rand(300, g=g, dtype=torch.float16, device=device)
    with pk.use_backend(backend):
        fused = pk.skinny_gemm(x, weight, norm_weight=norm_weight, eps=EPS)
        unfused = pk.skinny_gemm(pk.rms_norm(x, norm_weight, EPS), weight)
    if backend == "torch":   # the same formula and order: the same bits
        assert torch.equal(fused, unfused)
    torch.testing.assert_close(fused.float(), unfused.float(), atol=2e-3, rtol=2e-3)


def test_config_fills_the_device_and_stays_in_bounds():
    for N in (1, 7, 1024, 4096, 6144, 151936):
        for K in (16, 1000, 1024, 14336):
            block_n, block_k, num_warps, prefetch = skinny_gemm_config(1, N, K, 132)
            assert block_n in (1, 2, 4, 8, 16) and 64 <= block_k <= 512 and num_warps in (4, 8)
            assert prefetch is False   # off unless set
            assert block_k >= min(K, 512) or block_k == 64
            programs = -(-N // block_n)
            assert block_n == 1 or programs >= 4 * 132   # fewer programs only when the rows run out
    assert skinny_gemm_config(1, 151936, 1024, 132)[0] == 16


def test_deep_setting_env_and_config():
    """Off by default; PAGEDKERNELS_SKINNY_DEEP=1 turns it on, anything but 0/1 is refused at import; the setter returns
    the previous value and takes bools only. On, the config widens K tiles up to 4096 values within K's power of two
    and prefetches (the first tile before the prologue; the next one ahead where K takes several)."""
    code = "import pagedkernels as pk; print(pk.skinny_gemm_deep())"
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKERNELS_SKINNY_DEEP"}
    for value, expected in ((None, "False"), ("1", "True"), ("0", "False")):
        run_env = env if value is None else {**env, "PAGEDKERNELS_SKINNY_DEEP": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stderr[-2000:])
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "PAGEDKERNELS_SKINNY_DEEP": "yes"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "PAGEDKERNELS_SKINNY_DEEP must be 0 or 1" in bad.stderr
    previous = pk.set_skinny_gemm_deep(True)
    try:
        assert pk.set_skinny_gemm_deep(True) is True and pk.skinny_gemm_deep() is True
        # Qwen3-0.6B on an H200: qkv and o and down whole rows in one tile, gate_up two tiles
        assert skinny_gemm_config(1, 4096, 1024, 132) == (4, 1024, 8, True)
        assert skinny_gemm_config(1, 1024, 2048, 132) == (1, 2048, 4, True)
        assert skinny_gemm_config(1, 1024, 3072, 132) == (1, 4096, 8, True)
        assert skinny_gemm_config(1, 6144, 1024, 132) == (8, 512, 8, True)
        # Llama-3-8B's down projection: 4 x 1024 tiles, fourteen of them, two in flight (8 warps: two tiles held)
        assert skinny_gemm_config(1, 4096, 14336, 132) == (4, 1024, 8, True)
        for N in (1, 7, 1024, 6144, 151936):
            for K in (16, 1000, 1024, 14336):
                block_n, block_k, num_warps, prefetch = skinny_gemm_config(1, N, K, 132)
                assert block_n * block_k <= 4096 or block_k == 512 and block_n * block_k <= 8192
                assert block_k <= max(512, 1 << (K - 1).bit_length()) and prefetch is True
                assert num_warps == (8 if block_n * block_k > (2048 if prefetch else 4096) else 4)
        with pytest.raises(ValueError, match="on must be a bool"):
            pk.set_skinny_gemm_deep(1)
    finally:
        pk.set_skinny_gemm_deep(previous)
    assert pk.skinny_gemm_deep() is previous


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N, K, kind", [(1, 40, 3000, "gated+residual"), (2, 9, 1030, "norm"),
                                           (1, 1100, 700, "plain"), (8, 24, 520, "norm+bias+residual")])
def test_deep_launches_match_the_oracle(backend, device, dtype, M, N, K, kind):
    """The deep launches (whole rows in one wide tile, or several tiles two in flight) against the float64 oracle."""
    skip_bf16_interpreter(backend, dtype, device)
    x, weight, bias, norm_weight, eps, residual, gated = _inputs(M, N, K, kind, dtype, device)
    before = residual.clone() if residual is not None else None
    previous = pk.set_skinny_gemm_deep(True)
    try:
        with pk.use_backend(backend):
            result = pk.skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated,
                                    residual=residual)
    finally:
        pk.set_skinny_gemm_deep(previous)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(result.double().cpu(), oracle(x, weight, bias, norm_weight, eps, before, gated),
                               atol=atol, rtol=rtol)


@triton.jit
def _no_wait():
    pass


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pdl", [False, True])
def test_prefetch_gives_the_same_bits(device, dtype, pdl, monkeypatch):
    """Two tiles in flight change when the weights are read, not what is summed or in which order: the same bits as
    the plain loop, for every prologue and the epilogue, one row and several, K of one tile (the load ahead wholly
    masked), of several, and not a multiple of the tile; with the PDL code path too (its wait stood in for in the
    interpreter, which has no griddepcontrol)."""
    skip_bf16_interpreter("triton", dtype, device)
    module = importlib.import_module("pagedkernels.skinny_gemm")   # the package's name is the function
    cases = [(1, 24, 100, "norm"), (1, 10, 1100, "gated+residual"), (3, 9, 600, "residual"), (2, 17, 1024, "norm"),
             (1, 33, 512, "plain"), (8, 5, 530, "norm+bias+residual")]
    calls = []
    for M, N, K, kind in cases:
        x, w, bias, norm, eps, res, gated = _inputs(M, N, K, kind, dtype, device)
        calls.append(lambda x=x, w=w, bias=bias, norm=norm, eps=eps, res=res, gated=gated: pk.skinny_gemm(
            x, w, bias, norm_weight=norm, eps=eps, gated=gated, residual=res.clone() if res is not None else None))
    config = module.skinny_gemm_config
    prefetched = []
    monkeypatch.setattr(module, "skinny_gemm_config", lambda *shape: (
        prefetched.append(shape) or (*config(*shape)[:3], prefetch)))
    if pdl and device == "cpu":
        monkeypatch.setattr(module, "pdl_wait", _no_wait)
        monkeypatch.setattr(module, "pdl_launch", lambda device: {"USE_PDL": True})
    elif pdl:
        if torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("programmatic dependent launch needs a GPU of compute capability 9.0 or later")
        monkeypatch.setattr(_backend, "_pdl", True)
    with pk.use_backend("triton"):
        prefetch = False
        expected = [call() for call in calls]
        prefetch = True
        got = [call() for call in calls]
    assert len(prefetched) == 2 * len(cases)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_custom_ops_trace_and_check_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 64, dtype=torch.float16)
        weight = torch.empty(32, 64, dtype=torch.float16)
        residual = torch.empty(2, 32, dtype=torch.float32)
        out = torch_ops.skinny_gemm(x, weight, norm_weight=torch.empty(64), eps=1e-6)
        assert out.shape == (2, 32) and out.dtype == torch.float16
        assert torch_ops.skinny_gemm(x, weight, residual=residual) is residual
        with pytest.raises(ValueError, match="weight must have shape"):
            torch_ops.skinny_gemm(x, torch.empty(32, 65, dtype=torch.float16))
    x = torch.randn(2, 64)
    weight = torch.randn(32, 64)
    residual = torch.randn(2, 32)
    expected = oracle(x, weight, residual=residual.clone())
    torch_ops.skinny_gemm(x, weight, residual=residual)
    torch.testing.assert_close(residual.double(), expected, atol=1e-4, rtol=1e-4)


def test_compiles_without_graph_breaks():
    def step(x, weight, norm_weight, residual):
        torch_ops.skinny_gemm(x, weight, norm_weight=norm_weight, eps=1e-6, residual=residual)
        return residual * 2

    x, weight, norm_weight = torch.randn(1, 32), torch.randn(32, 32), torch.randn(32)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    expected = step(x, weight, norm_weight, torch.ones(1, 32))
    torch.testing.assert_close(compiled(x, weight, norm_weight, torch.ones(1, 32)), expected)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: pk.skinny_gemm(x[:0], w), "1 to 8 rows"),
    (lambda x, w: pk.skinny_gemm(torch.randn(MAX_ROWS + 1, 16), w), "1 to 8 rows"),
    (lambda x, w: pk.skinny_gemm(x.t(), w), "x must have shape|contiguous"),
    (lambda x, w: pk.skinny_gemm(x, w.half()), "weight must have dtype"),
    (lambda x, w: pk.skinny_gemm(x, w[:, :8]), "weight must have shape"),
    (lambda x, w: pk.skinny_gemm(x, w, torch.randn(5)), "bias must have shape"),
    (lambda x, w: pk.skinny_gemm(x, w, norm_weight=torch.randn(16)), "eps must be a positive number"),
    (lambda x, w: pk.skinny_gemm(x, w, norm_weight=torch.randn(16), eps=0.0), "eps must be a positive number"),
    (lambda x, w: pk.skinny_gemm(x, w, eps=1e-6), "eps is the RMSNorm prologue's"),
    (lambda x, w: pk.skinny_gemm(x, w, norm_weight=torch.randn(15), eps=1e-6), "norm_weight must have shape"),
    (lambda x, w: pk.skinny_gemm(x, w, residual=torch.randn(2, 4)), "residual must have shape"),
    (lambda x, w: pk.skinny_gemm(x, w, residual=torch.randn(2, 8), out=torch.randn(2, 8)), "exclude each other"),
    (lambda x, w: pk.skinny_gemm(x, w, out=torch.randn(2, 8).half()), "out must have dtype"),
    (lambda x, w: pk.skinny_gemm(x, w, out=torch.randn(8, 2).t()), "out must be contiguous"),
    (lambda x, w: pk.skinny_gemm(x, w, gated="gelu"), "gated must be None or one of"),
    (lambda x, w: pk.skinny_gemm(x, w, gated="silu"), "weight must have shape"),   # K 16 gated: 8 per half
    (lambda x, w: pk.skinny_gemm(x[:, :15], w[:, :15], gated="silu"), r"x must have shape \[M, 2 \* K\]"),
    (lambda x, w: pk.skinny_gemm(x, w[:, :8], gated="silu", norm_weight=torch.randn(8), eps=1e-6),
     "exclude each other"),
])
def test_bad_arguments_raise_value_errors_naming_them(call, message):
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=message):
        call(x, weight)
