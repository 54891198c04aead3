"""Programmatic dependent launch of the decode path's kernels (pagedkernels.set_programmatic_dependent_launch):
the setting, the launch arguments it gives on each device, the AOT table's sm_90-only PDL variants, and on a Hopper
GPU the kernels' results with PDL on equal to theirs with it off, eager and replayed from a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter looks for it in a jit function's module)

import pagedkernels as pk
from pagedkernels import _aot, _backend


@pytest.fixture
def pdl_on():
    previous = pk.set_programmatic_dependent_launch(True)
    yield
    pk.set_programmatic_dependent_launch(previous)


def test_the_setting_is_off_by_default_and_returns_the_previous_one():
    code = ("import torch, pagedkernels as pk; from pagedkernels import _backend; "
            "on = _backend.simulate_cuda_launches(); on.__enter__(); "
            "print(pk.programmatic_dependent_launch(torch.device('cuda')))")
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKERNELS_PDL"}
    for value, expected in ((None, "False"), ("1", "True"), ("0", "False")):
        run_env = env if value is None else {**env, "PAGEDKERNELS_PDL": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stderr[-2000:])
    previous = pk.set_programmatic_dependent_launch(True)
    try:
        assert pk.set_programmatic_dependent_launch(True) is True
    finally:
        pk.set_programmatic_dependent_launch(previous)
    with pytest.raises(ValueError, match="enabled must be a bool"):
        pk.set_programmatic_dependent_launch(1)


def test_launch_arguments_follow_the_device(pdl_on):
    """On: the CPU (the interpreter has no griddepcontrol) launches as before; a simulated H100 with launch_pdl and
    the kernels' USE_PDL. Off: USE_PDL False everywhere, and no launch_pdl option."""
    assert _backend.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    with _backend.simulate_cuda_launches(capability=(8, 0)):   # an A100: no griddepcontrol
        assert _backend.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    with _backend.simulate_cuda_launches():
        assert _backend.pdl_launch(torch.device("cpu")) == {"USE_PDL": True, "launch_pdl": True}
        pk.set_programmatic_dependent_launch(False)
        assert _backend.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}


def test_the_aot_table_builds_the_pdl_variants_for_sm90_only():
    with _aot.record_launches() as (launches, case):
        for label, call in _aot._pdl_cases():
            case[0] = label
            call(torch.Generator().manual_seed(0))
    assert {launch.kernel.__name__ for launch in launches} == {
        "_skinny_gemm_kernel", "_rotary_cache_kernel", "_decode_split_kernel", "_decode_reduce_kernel",
        "_moe_gemv_up_kernel", "_moe_gemv_down_kernel"}
    assert all(launch.kwargs.get("launch_pdl") is True and launch.kwargs["USE_PDL"] is True for launch in launches)
    # a variant's compile options are its launch's (num_warps, launch_pdl, ...): griddepcontrol is sm_90's
    made_by_both = dict(capabilities={90, 80})
    assert _aot.variant_targets(SimpleNamespace(option_kwargs={"num_warps": 4, "launch_pdl": True}, **made_by_both),
                                (90, 80)) == (90,)
    assert _aot.variant_targets(SimpleNamespace(option_kwargs={"num_warps": 4}, **made_by_both), (90, 80)) == (90, 80)
    # a launch config chosen for Hopper alone (fused_moe's widest tiles) is built for sm_90 alone
    assert _aot.variant_targets(SimpleNamespace(option_kwargs={"num_warps": 8}, capabilities={90}), (90, 80)) == (90,)


def _decode_path_calls(dtype: torch.dtype, device: str) -> list:
    """Each decode-path op on small inputs (on CUDA also at Qwen3-0.6B's batch-1 projections), as functions returning
    their outputs (fresh copies of what they write in place): skinny_gemm with K of one tile, several and not a
    multiple of it, one row and several, every prologue and the residual epilogue; a decode that writes its output
    directly and one that splits; the rotary embedding with the cache write, with and without q/k norms, alone and
    in the decode split kernel; fused_moe's matrix-vector launches."""
    g = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    def ints(values):
        return torch.tensor(values, device=device)

    calls = []
    shapes = [(1, 24, 100, "norm", False), (1, 10, 1100, "silu", True), (3, 9, 600, None, True),
              (2, 17, 530, "norm", False), (1, 33, 1024, None, False)]
    if device == "cuda":
        shapes += [(1, 4096, 1024, "norm", False), (1, 1024, 3072, "silu", True)]
    for M, N, K, prologue, residual in shapes:
        x, w = randn(M, 2 * K if prologue == "silu" else K), randn(N, K) * K ** -0.5
        norm, res = randn(K) if prologue == "norm" else None, randn(M, N) if residual else None
        calls.append(lambda x=x, w=w, norm=norm, res=res, prologue=prologue: pk.skinny_gemm(
            x, w, norm_weight=norm, eps=1e-6 if norm is not None else None, gated="silu" if prologue == "silu" else None,
            residual=res.clone() if res is not None else None))
    key_cache, value_cache = randn(6, 16, 2, 64), randn(6, 16, 2, 64)
    table, lens, q = ints([[0, 1, 2], [3, 4, 5]]).int(), ints([40, 17]).int(), randn(2, 4, 64)
    for splits in (1, 2):
        calls.append(lambda splits=splits: pk.paged_decode_attention(q, key_cache, value_cache, table, lens,
                                                                      num_splits=splits))
    cos_sin = pk.compute_cos_sin_cache(64, 64, 1e4, device=device)
    qkv, q_weight, k_weight = randn(2, 8 * 64), randn(64), randn(64)
    for norm in (True, False):
        weights = dict(q_weight=q_weight, k_weight=k_weight, eps=1e-6) if norm else {}

        def rotary_cache(weights=weights):
            q_, k_, v_ = qkv.clone().split([256, 128, 128], 1)
            kc, vc = key_cache.clone(), value_cache.clone()
            pk.rotary_embedding_and_cache(ints([39, 16]), q_, k_, v_, kc, vc, ints([39, 3 * 16 + 16]), cos_sin,
                                          head_size=64, **weights)
            return q_, k_, kc, vc
        calls.append(rotary_cache)

        def rotary_cache_decode(weights=weights):   # the same in the decode split kernel, then attention
            q_, k_, v_ = qkv.split([256, 128, 128], 1)
            kc, vc = key_cache.clone(), value_cache.clone()
            out = pk.rotary_cache_decode_attention(ints([39, 16]), q_.view(2, 4, 64), k_, v_, kc, vc,
                                                   ints([39, 3 * 16 + 16]), cos_sin, table, lens, num_splits=2,
                                                   **weights)
            return out, kc, vc
        calls.append(rotary_cache_decode)
    # fused_moe's matrix-vector launches (pagedkernels.set_moe_gemv_max_tokens): the activation, then the down
    # projection with the top-k sum, one token over 16 experts top-4 and three over 4 experts top-2
    for tokens, experts, top_k in ((1, 16, 4), (3, 4, 2)):
        x, w13, w2 = randn(tokens, 48), randn(experts, 2 * 40, 48) * 0.15, randn(experts, 48, 40) * 0.15
        weights = torch.rand(tokens, top_k, generator=g).to(device)
        ids = torch.randperm(experts, generator=g)[:top_k].repeat(tokens, 1).to(device=device, dtype=torch.int32)

        def moe(x=x, w13=w13, w2=w2, weights=weights, ids=ids):
            previous = pk.set_moe_gemv_max_tokens(4)
            try:
                return pk.fused_moe(x, w13, w2, weights, ids)
            finally:
                pk.set_moe_gemv_max_tokens(previous)
        calls.append(moe)
    return calls


def _assert_same_bits(got: list, expected: list) -> None:
    for i, (a, b) in enumerate(zip(got, expected)):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), f"call {i}"


@triton.jit
def _no_wait():
    pass


@pytest.mark.triton
@pytest.mark.skipif(not _backend.interpreter_active(),
                    reason="runs the kernels in Triton's interpreter, which is off where a GPU is (there "
                           "test_results_with_pdl_equal_those_without runs them compiled, with griddepcontrol)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_pdl_code_paths_compute_what_the_plain_ones_do(dtype, monkeypatch):
    """In the interpreter, with the wait stood in for (it has no griddepcontrol): the kernels' USE_PDL code, skinny_gemm
    computing its first weight tile before the loop over the rest, gives the same bits as the plain launch."""
    import importlib

    calls = _decode_path_calls(dtype, "cpu")
    with pk.use_backend("triton"):
        expected = [call() for call in calls]
        for name in ("skinny_gemm", "decode_attention", "rotary", "fused_moe"):
            module = importlib.import_module(f"pagedkernels.{name}")
            monkeypatch.setattr(module, "pdl_wait", _no_wait)
            monkeypatch.setattr(module, "pdl_launch", lambda device: {"USE_PDL": True})
        got = [call() for call in calls]
    _assert_same_bits(got, expected)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="programmatic dependent launch needs a GPU of compute capability 9.0 or later")


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_results_with_pdl_equal_those_without(dtype):
    """The same bits: PDL changes when a kernel starts, not what it computes."""
    calls = _decode_path_calls(dtype, "cuda")
    expected = [call() for call in calls]
    previous = pk.set_programmatic_dependent_launch(True)
    try:
        got = [call() for call in calls]
    finally:
        pk.set_programmatic_dependent_launch(previous)
    torch.cuda.synchronize()
    _assert_same_bits(got, expected)


@hopper
def test_a_chain_replayed_from_a_cuda_graph_equals_eager(pdl_on):
    """A decode layer's chain of PDL launches (norm+product, rotary+cache write, split and reduce, product+residual)
    captured in a CUDA graph and replayed gives what the eager launches gave: each kernel waits for the one ahead
    before reading what it wrote."""
    dtype, head = torch.bfloat16, 128
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    hidden, w_qkv, w_o, norm = randn(1, 1024), randn(32 * head, 1024) * 0.03, randn(1024, 16 * head) * 0.03, randn(1024)
    key_cache, value_cache = randn(16, 16, 8, head), randn(16, 16, 8, head)
    table = torch.arange(16, device="cuda", dtype=torch.int32).view(1, 16)
    lens, positions, slots = (torch.tensor([200], device="cuda", dtype=torch.int32), torch.tensor([199], device="cuda"),
                              torch.tensor([199], device="cuda"))
    cos_sin = pk.compute_cos_sin_cache(256, head, 1e6, device="cuda")
    residual = torch.empty_like(hidden)

    def chain():
        residual.copy_(hidden)
        qkv = pk.skinny_gemm(residual, w_qkv, norm_weight=norm, eps=1e-6)
        q, k, v = qkv.split([16 * head, 8 * head, 8 * head], 1)
        pk.rotary_embedding_and_cache(positions, q, k, v, key_cache, value_cache, slots, cos_sin, head_size=head)
        attn = pk.paged_decode_attention(q.view(1, 16, head), key_cache, value_cache, table, lens, num_splits=4)
        return pk.skinny_gemm(attn.view(1, -1), w_o, residual=residual)

    expected = chain().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
