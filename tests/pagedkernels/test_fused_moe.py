"""pk.fused_moe, pk.moe_topk and pk.moe_align_block_size against float64 references (tests/pagedkernels/
moe_oracle.py), on every backend: the Triton kernels (under the interpreter on CPU tensors, compiled on a GPU),
the native CPU kernels (packed weights) and the PyTorch twins.

The weights of experts no token routes to are NaN (and, with an expert map, those of experts on "another rank"):
a kernel that reads them shows it in its output. ``out`` starts as NaN. The expert matrix runs from 2 to 128
experts and top-1 to top-8, token counts from 1 to thousands (the interpreter stops at a few hundred: its
thousands are behind PAGEDKERNELS_HEAVY_TESTS=1), with runs of an expert's slots shorter than a block, exactly
a block, and none."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native
from pagedkernels.fused_moe import fused_moe_launch_config, native_scratch_bytes, unpack_moe_weight
from pagedkernels.moe_align import max_num_tokens_padded
from tests.conftest import TRITON_DEVICE
from tests.pagedkernels.moe_oracle import assert_moe_close, moe_reference, random_moe, routing_reference

NATIVE = _native.library() is not None
NATIVE_PARAM = pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="no C compiler here"))
HEAVY = os.environ.get("PAGEDKERNELS_HEAVY_TESTS", "0") not in ("", "0")
# Bounds on |out - ref| relative to the magnitude of the terms: float32 throughout; 16-bit: the inputs exact,
# the activated intermediate, the per-expert outputs and the result each rounded once to the dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 6e-3, torch.bfloat16: 5e-2}


def _poison_unrouted(w13, w2, ids, expert_map=None):
    """NaN in the weights of every (local) expert no slot routes to."""
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    used = torch.zeros(w13.shape[0], dtype=torch.bool)
    used[local[local >= 0]] = True
    w13[~used] = float("nan")
    w2[~used] = float("nan")


def _run(backend, x, w13, w2, weights, ids, *, activation="silu", expert_map=None, weight_dtype=None):
    """pk.fused_moe on ``backend`` (native: packed weights, in ``weight_dtype``) into a NaN ``out``."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=device)
    args = [t.to(device) for t in (x, w13, w2, weights, ids)]
    if backend == "native":
        args[1], args[2] = pk.pack_moe_weight(w13, weight_dtype), pk.pack_moe_weight(w2, weight_dtype)
    with pk.use_backend(backend):
        result = pk.fused_moe(*args, activation=activation, out=out,
                              expert_map=None if expert_map is None else expert_map.to(device))
    assert result.data_ptr() == out.data_ptr()
    return out.cpu()


# (tokens, hidden, intermediate, experts, top_k, skew): one token over 128 experts top-8; top-1 of two experts;
# odd sizes across tile edges; every expert's run shorter than a 16-row block; a few long runs (skew) with most
# experts empty; 64 rows per expert (BLOCK_M 32); hundreds of rows per expert (BLOCK_M 64).
INTERPRETER_CASES = [(1, 64, 48, 128, 8, 0.0), (7, 40, 24, 2, 1, 0.0), (37, 72, 40, 8, 2, 0.0),
                     (24, 32, 16, 64, 3, 0.5), (48, 32, 16, 6, 6, 0.0), (150, 32, 16, 4, 4, 0.3)]
NATIVE_CASES = INTERPRETER_CASES + [(3000, 64, 32, 64, 8, 0.2), (1000, 96, 80, 8, 2, 0.0), (2, 33, 7, 128, 8, 0.0)]


def _case_id(case):
    return "T{}-H{}-I{}-E{}-k{}{}".format(*case[:5], f"-skew{case[5]}" if case[5] else "")


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=_case_id)
def test_triton_matches_the_float64_reference(case):
    """fp16 and fp32 (ieee dots) alternate over the cases (each case's tiles are the same in both)."""
    tokens, hidden, intermediate, experts, top_k, skew = case
    dtype = (torch.float16, torch.float32)[INTERPRETER_CASES.index(case) % 2]
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    x, w13, w2, weights, ids = random_moe(tokens, hidden, intermediate, experts, top_k, dtype, gen, skew=skew)
    _poison_unrouted(w13, w2, ids)
    out = _run("triton", x, w13, w2, weights, ids)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids), TOLERANCE[dtype])


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="bf16 arithmetic is wrong in the Triton interpreter; runs on GPUs")
@pytest.mark.parametrize("case", INTERPRETER_CASES[:4], ids=_case_id)
def test_triton_bf16_on_the_gpu(case):
    tokens, hidden, intermediate, experts, top_k, skew = case
    gen = torch.Generator().manual_seed(tokens + experts)
    x, w13, w2, weights, ids = random_moe(tokens, hidden, intermediate, experts, top_k, torch.bfloat16, gen, skew=skew)
    _poison_unrouted(w13, w2, ids)
    out = _run("triton", x, w13, w2, weights, ids)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids), TOLERANCE[torch.bfloat16])


@pytest.mark.skipif(not HEAVY and TRITON_DEVICE != "cuda",
                    reason="thousands of tokens under the Triton interpreter take minutes: set "
                           "PAGEDKERNELS_HEAVY_TESTS=1 (CI runs them on the native and PyTorch backends; GPUs always)")
@pytest.mark.parametrize("case", NATIVE_CASES[-3:], ids=_case_id)
def test_triton_thousands_of_tokens(case):
    tokens, hidden, intermediate, experts, top_k, skew = case
    gen = torch.Generator().manual_seed(tokens)
    x, w13, w2, weights, ids = random_moe(tokens, hidden, intermediate, experts, top_k, torch.float16, gen, skew=skew)
    _poison_unrouted(w13, w2, ids)
    assert_moe_close(_run("triton", x, w13, w2, weights, ids), moe_reference(x, w13, w2, weights, ids),
                     TOLERANCE[torch.float16])


# The twin's thousands are the 1000-token case (3000 would only repeat its loop, slowly).
CPU_CASES = ([pytest.param("native", case, id=f"native-{_case_id(case)}", marks=NATIVE_PARAM.marks)
              for case in NATIVE_CASES]
             + [pytest.param("torch", case, id=f"torch-{_case_id(case)}") for case in NATIVE_CASES if case[0] <= 1000])


@pytest.mark.parametrize("backend,case", CPU_CASES)
def test_cpu_backends_match_the_float64_reference(backend, case):
    """float32 activations; the native kernel's weights float32 panels or, for the odd cases, bf16 / fp16 panels
    of 16-bit values (its widening is exact). 16-bit activations: tests/pagedkernels/test_bf16_cpu.py."""
    tokens, hidden, intermediate, experts, top_k, skew = case
    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    weight_dtype = (None, torch.bfloat16, torch.float16)[tokens % 3] if backend == "native" else None
    x, w13, w2, weights, ids = random_moe(tokens, hidden, intermediate, experts, top_k, torch.float32, gen, skew=skew)
    if weight_dtype is not None:  # 16-bit values, kept as float32 here
        w13, w2 = w13.to(weight_dtype).float(), w2.to(weight_dtype).float()
    _poison_unrouted(w13, w2, ids)
    out = _run(backend, x, w13, w2, weights, ids, weight_dtype=weight_dtype)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids), TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", ["triton", "torch", NATIVE_PARAM])
def test_expert_parallel_map_and_gelu(backend):
    """12 global experts, 5 on this rank (expert_map: global -> local or -1): slots of the other 7 add nothing,
    their local weights do not exist, and unused local experts are NaN; GeGLU (tanh) as the activation."""
    gen = torch.Generator().manual_seed(5)
    x, _, _, weights, ids = random_moe(33, 48, 24, 12, 3, torch.float32, gen)
    local = torch.tensor([9, 2, 11, 4, 7])
    expert_map = torch.full((12,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(5, dtype=torch.int32)
    _, w13, w2, _, _ = random_moe(1, 48, 24, 5, 1, torch.float32, gen)
    ids[0] = torch.tensor([0, 1, 3])  # a token with no local expert at all: its output is zero
    _poison_unrouted(w13, w2, ids, expert_map)
    out = _run(backend, x, w13, w2, weights, ids, activation="gelu_tanh", expert_map=expert_map)
    reference = moe_reference(x, w13, w2, weights, ids, "gelu_tanh", expert_map)
    assert_moe_close(out, reference, TOLERANCE[torch.float32])
    assert torch.equal(out[0], torch.zeros(48))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_direct_layout_for_sparse_slots_skips_the_alignment(dtype, monkeypatch):
    """Decode of a fine-grained MoE (few slots over many experts): each slot its own block, no alignment launched
    (it raises here); right with slots that share an expert (three tokens on the same two experts), int64 ids,
    and under an expert map with a slot of no local expert."""
    fused = importlib.import_module("pagedkernels.fused_moe")  # the package's fused_moe is the function

    assert fused.direct_layout(8, 128, 16) and fused.direct_layout(32, 128, 16)
    assert not fused.direct_layout(33, 128, 16) and not fused.direct_layout(8, 128, 32)
    assert fused_moe_launch_config(1, 128, 8, 768, 2048, True, torch.bfloat16, "cuda").block_m == 16

    def no_alignment(*args, **kwargs):
        raise AssertionError("the direct layout launched the alignment")
    monkeypatch.setattr(fused, "moe_align_block_size", no_alignment)
    gen = torch.Generator().manual_seed(11)
    x, w13, w2, weights, ids = random_moe(4, 48, 40, 64, 4, dtype, gen)
    ids[1:, :2] = ids[0, :2]  # experts shared by every token: their weights read once a slot
    ids = ids.to(torch.int64)
    assert fused.direct_layout(ids.numel(), 64, fused_moe_launch_config(4, 64, 4, 40, 48, True, dtype, "cpu").block_m)
    _poison_unrouted(w13, w2, ids)
    assert_moe_close(_run("triton", x, w13, w2, weights, ids), moe_reference(x, w13, w2, weights, ids),
                     TOLERANCE[dtype])

    x, _, _, weights, ids = random_moe(1, 32, 16, 40, 4, dtype, gen)
    expert_map = torch.full((40,), -1, dtype=torch.int32)
    expert_map[ids[0, :3].long()] = torch.tensor([5, 0, 12], dtype=torch.int32)  # the fourth slot: another rank's
    _, w13, w2, _, _ = random_moe(1, 32, 16, 16, 1, dtype, gen)
    _poison_unrouted(w13, w2, ids, expert_map)
    out = _run("triton", x, w13, w2, weights, ids, expert_map=expert_map)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids, expert_map=expert_map), TOLERANCE[dtype])


@pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
def test_native_token_results_do_not_depend_on_the_batch():
    """A token's output is the same bits alone or in a batch (its rows' sums are the same additions in the same
    order): decode tokens do not change with what they are batched with; bf16 panels halve the weights' bytes and
    give the float32 panels' result."""
    gen = torch.Generator().manual_seed(11)
    x, w13, w2, weights, ids = random_moe(21, 80, 56, 8, 2, torch.float32, gen)
    w13, w2 = w13.bfloat16().float(), w2.bfloat16().float()
    packed = (pk.pack_moe_weight(w13, torch.bfloat16), pk.pack_moe_weight(w2, torch.bfloat16))
    assert packed[0].dtype == torch.bfloat16 and torch.equal(unpack_moe_weight(packed[1], 80).float(), w2)
    with pk.use_backend("native"):
        together = pk.fused_moe(x, *packed, weights, ids)
        alone = torch.cat([pk.fused_moe(x[i:i + 1], *packed, weights[i:i + 1], ids[i:i + 1]) for i in range(21)])
        float_panels = pk.fused_moe(x, pk.pack_moe_weight(w13), pk.pack_moe_weight(w2), weights, ids)
    assert torch.equal(together, alone) and torch.equal(together, float_panels)


@pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_moe_layer_replays_as_a_cpu_graph_over_fewer_rows(dtype):
    """Router product, top-k and the experts: three native kernel calls a CPU graph records (a decode step of a
    MoE model, float32 or bf16: the hidden states in the model's dtype); recorded for 8 tokens, a replay of 3 gives
    eager's first 3 rows from the inputs of the time, and of all 8 eager's whole result. The sorted layout, sized
    for 8 tokens, serves 3."""
    from pagedkernels.cpu_graph import CPUGraph

    gen = torch.Generator().manual_seed(13)
    x, w13, w2, _, _ = random_moe(8, 48, 40, 6, 2, dtype, gen)
    router = pk.pack_w16((torch.randn(6, 48, generator=gen) / 4).to(torch.bfloat16))
    packed = (pk.pack_moe_weight(w13), pk.pack_moe_weight(w2))

    def layer():
        weights, ids = pk.moe_topk(pk.w16_gemm(x, router, 6), 2, renormalize=True)
        return pk.fused_moe(x, *packed, weights, ids)

    with pk.use_backend("native"):
        graph = CPUGraph()
        graph.capture(layer, rows=8)
        assert graph.resizable and graph.num_kernel_calls == 3 and graph.num_torch_calls == 0
        x.copy_(torch.randn(x.shape, generator=gen))
        eager = layer()
        torch.testing.assert_close(graph.replay(3)[:3], eager[:3], rtol=0, atol=0)
        torch.testing.assert_close(graph.replay(8), eager, rtol=0, atol=0)


def test_native_scratch_layout_is_what_the_kernel_takes():
    """The Python size of the native kernel's scratch: its int32 tables, padded to 64 bytes, then the float rows."""
    assert native_scratch_bytes(3, 2, 10, 6, 4) == 4 * (32 + 6 * 12 + 6 * 6)
    assert native_scratch_bytes(1, 8, 2048, 768, 128) == 4 * (416 + 8 * 2048 + 8 * 768)
    # 16-bit hidden states: the tokens' float32 rows after them
    assert native_scratch_bytes(3, 2, 10, 6, 4, widened_rows=True) == 4 * (32 + 6 * 12 + 6 * 6 + 3 * 10)


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------

ROUTING_CASES = [
    # (tokens, experts, top_k, scoring, renormalize, bias, groups, topk_groups)
    (5, 2, 1, "softmax", False, False, 1, 1),
    (70, 8, 2, "softmax", True, False, 1, 1),     # Mixtral
    (9, 60, 4, "softmax", False, False, 1, 1),    # Qwen1.5-MoE: 60 experts (a padded tile)
    (33, 128, 8, "softmax", True, False, 1, 1),   # Qwen3-30B-A3B
    (6, 256, 8, "sigmoid", True, True, 8, 4),     # DeepSeek-V3: bias, 8 groups, best 4 by their top-2 sums
    (11, 64, 6, "softmax", False, False, 8, 3),   # DeepSeek-V2-Lite style: group max
    (4, 16, 3, "sigmoid", False, False, 1, 1),
]


@pytest.mark.parametrize("backend", ["triton", "torch", NATIVE_PARAM])
@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}-g{c[6]}")
def test_moe_topk_matches_the_float64_router(backend, case):
    tokens, experts, top_k, scoring, renormalize, with_bias, groups, topk_groups = case
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=gen) * 3
    bias = torch.randn(experts, generator=gen) * 0.5 if with_bias else None
    dtype = torch.float16 if experts == 60 and backend != "triton" else torch.float32
    logits = logits.to(dtype)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    with pk.use_backend(backend):
        weights, ids = pk.moe_topk(logits.to(device), top_k, scoring=scoring, renormalize=renormalize,
                                   correction_bias=None if bias is None else bias.to(device),
                                   num_expert_group=groups, topk_group=topk_groups)
    ref_weights, ref_ids = routing_reference(logits, top_k, scoring, renormalize, bias, groups, topk_groups)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, top_k)
    assert torch.equal(ids.cpu().long(), ref_ids)
    torch.testing.assert_close(weights.cpu().double(), ref_weights, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("backend", ["triton", "torch", NATIVE_PARAM])
def test_moe_topk_weights_in_the_model_dtype(backend):
    """weights_dtype rounds the weights once (transformers' Qwen-MoE routers cast them to the logits' dtype): within
    one fp16 rounding of the exact weights (a GPU's exp may land a float32 a hair across a rounding boundary)."""
    logits = torch.randn(7, 24, generator=torch.Generator().manual_seed(3))
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    with pk.use_backend(backend):
        weights, ids = pk.moe_topk(logits.to(device), 4, renormalize=True, weights_dtype=torch.float16)
    ref_weights, ref_ids = routing_reference(logits, 4, renormalize=True)
    assert weights.dtype == torch.float16 and torch.equal(ids.cpu().long(), ref_ids)
    torch.testing.assert_close(weights.cpu().double(), ref_weights, atol=0, rtol=2.0 ** -11)


# ---------------------------------------------------------------------------------------------
# alignment
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("tokens,experts,top_k,block", [(1, 128, 8, 16), (40, 4, 2, 16), (300, 8, 2, 64),
                                                        (17, 3, 3, 4), (2500, 64, 2, 32)])
def test_moe_align_block_size_layout(backend, tokens, experts, top_k, block):
    """Every slot of a local expert once, in its expert's run; runs start on block boundaries, padded with the
    sentinel num_slots; each block names its expert, -1 past the end; slots of no local expert (negative ids)
    take no row. The layout's size comes from shapes: an expert with nothing routed takes no room."""
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.argsort(torch.rand(tokens, experts, generator=gen), dim=1)[:, :top_k].to(torch.int32)
    ids[torch.rand(tokens, top_k, generator=gen) < 0.1] = -1
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    with pk.use_backend(backend):
        sorted_ids, expert_ids, post_padded = (t.cpu() for t in pk.moe_align_block_size(ids.to(device), block,
                                                                                         experts))
    num_slots = tokens * top_k
    assert sorted_ids.shape == (max_num_tokens_padded(num_slots, experts, block),)
    assert expert_ids.shape == (-(-sorted_ids.numel() // block),)
    flat = ids.flatten().long()
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    padded = (counts + block - 1) // block * block
    assert int(post_padded) == int(padded.sum())
    start = 0
    for e in range(experts):
        run = sorted_ids[start:start + padded[e]]
        slots, pad = run[:counts[e]], run[counts[e]:]
        assert sorted(slots.tolist()) == (flat == e).nonzero().flatten().tolist(), f"expert {e}"
        assert (pad == num_slots).all()
        assert (expert_ids[start // block:(start + padded[e]) // block] == e).all()
        start += int(padded[e])
    assert (sorted_ids[start:] == num_slots).all() and (expert_ids[start // block:] == -1).all()


# ---------------------------------------------------------------------------------------------
# launch configs and argument checks
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def gemv_on():
    """fused_moe's matrix-vector launches up to 8 tokens (pagedkernels.set_moe_gemv_max_tokens), then as before."""
    previous = pk.set_moe_gemv_max_tokens(8)
    yield
    pk.set_moe_gemv_max_tokens(previous)


class _NotLaunched:
    """Stands in for a Triton kernel that must not run: launching it (``kernel[grid](...)``) fails the test."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"the matrix-vector layout launched {self.name}")


# (tokens, hidden, intermediate, experts, top_k): one token over 128 experts top-8; top-1 of two experts; odd sizes
# across the 4 x 32 tiles; a token count past the setting (the tiled launches again); eight tokens on four experts.
GEMV_CASES = [(1, 64, 48, 128, 8), (3, 40, 24, 2, 1), (2, 72, 37, 8, 2), (9, 32, 16, 8, 2), (8, 33, 20, 4, 4)]


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "T{}-H{}-I{}-E{}-k{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemv_layout_matches_the_float64_reference(case, dtype, gemv_on, monkeypatch):
    """The matrix-vector launches (two: no tiled GEMM, alignment or top-k sum; those raise here) against the float64
    reference, unrouted experts' weights NaN, and equal to the tiled launches to the bit in fp16 (the same roundings:
    the activated rows, each expert's output, the weighted sum in float32 in slot order)."""
    fused = importlib.import_module("pagedkernels.fused_moe")
    tokens, hidden, intermediate, experts, top_k = case
    gen = torch.Generator().manual_seed(tokens * 17 + hidden)
    x, w13, w2, weights, ids = random_moe(tokens, hidden, intermediate, experts, top_k, dtype, gen)
    ids[-1, 0] = ids[0, -1]   # two slots on one expert: each reads its weights
    _poison_unrouted(w13, w2, ids)
    tiled = None
    if dtype == torch.float16:
        previous = pk.set_moe_gemv_max_tokens(0)
        try:
            tiled = _run("triton", x, w13, w2, weights, ids)
        finally:
            pk.set_moe_gemv_max_tokens(previous)
    assert fused.gemv_layout(tokens) == (tokens <= 8)
    if tokens <= 8:
        for kernel in ("_fused_moe_kernel", "_moe_sum_kernel", "moe_align_block_size"):
            monkeypatch.setattr(fused, kernel, _NotLaunched(kernel))
    out = _run("triton", x, w13, w2, weights, ids)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids), TOLERANCE[dtype])
    if tiled is not None:
        assert torch.equal(out, tiled)


def test_gemv_layout_under_an_expert_map_with_gelu(gemv_on):
    """Slots of experts on another rank (expert_map -1) add nothing and their rows are never read; a token with no
    local expert is zero; GeGLU (tanh); int64 ids."""
    gen = torch.Generator().manual_seed(9)
    x, _, _, weights, ids = random_moe(3, 48, 24, 12, 3, torch.float32, gen)
    expert_map = torch.full((12,), -1, dtype=torch.int32)
    expert_map[torch.tensor([9, 2, 11, 4, 7])] = torch.arange(5, dtype=torch.int32)
    _, w13, w2, _, _ = random_moe(1, 48, 24, 5, 1, torch.float32, gen)
    ids[0] = torch.tensor([0, 1, 3])
    _poison_unrouted(w13, w2, ids, expert_map)
    out = _run("triton", x, w13, w2, weights, ids.to(torch.int64), activation="gelu_tanh", expert_map=expert_map)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids, "gelu_tanh", expert_map), TOLERANCE[torch.float32])
    assert torch.equal(out[0], torch.zeros(48))


def test_gemv_setting_and_its_launches():
    """Off by default (PAGEDKERNELS_MOE_GEMV_MAX_TOKENS sets it); the setter returns the previous value and refuses
    what is no count; on a simulated H100 the tiles give about four programs a multiprocessor."""
    import subprocess
    import sys

    fused = importlib.import_module("pagedkernels.fused_moe")
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKERNELS_MOE_GEMV_MAX_TOKENS"}
    code = "import pagedkernels as pk; print(pk.moe_gemv_max_tokens())"
    for value, expected in ((None, "0"), ("4", "4"), ("0", "0")):
        run_env = env if value is None else {**env, "PAGEDKERNELS_MOE_GEMV_MAX_TOKENS": value}
        result = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True)
        assert result.stdout.strip() == expected, result.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "PAGEDKERNELS_MOE_GEMV_MAX_TOKENS": "x"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "PAGEDKERNELS_MOE_GEMV_MAX_TOKENS must be a non-negative int" in bad.stderr
    previous = pk.set_moe_gemv_max_tokens(3)
    try:
        assert pk.set_moe_gemv_max_tokens(5) == 3 and pk.moe_gemv_max_tokens() == 5
        assert fused.gemv_layout(5) and not fused.gemv_layout(6) and not fused.gemv_layout(0)
        for bad_value in (-1, 1.5, True):
            with pytest.raises(ValueError, match="max_tokens must be a non-negative int"):
                pk.set_moe_gemv_max_tokens(bad_value)
    finally:
        pk.set_moe_gemv_max_tokens(previous)
    # Qwen3-30B-A3B at one token: 8 slots x 768 gated columns (gate and up: 2 rows a column), then 1 token x 2048
    # columns read from its 8 experts together; 132 SMs
    config = fused.moe_gemv_config
    assert config(8, 768, 2048, 2, "cuda", 132) == (8, 256, 8)
    assert config(1, 2048, 768, 8, "cuda", 132) == (2, 256, 8)
    assert config(64, 2048, 768, 8, "cuda", 132) == (4, 128, 8)   # tiles of at most 4096 values
    assert config(1, 4096, 14336, 2, "cuda", 132) == (4, 256, 8)   # Mixtral's down projection
    assert config(1, 4096, 14336, 1, "cuda", 132) == (4, 256, 4)   # top-1: 1024 values
    assert config(4, 1000, 360, 2, "cuda", 132)[1] == 256   # K no multiple of 64
    assert config(2, 1000, 40, 2, "cuda", 132)[1] == 64
    assert config(1, 2048, 768, 8, "cpu", 4) == (4, 32, 4)


def test_launch_configs_from_shapes():
    """The launches the H200 sweep picked (bench/results/2026-11-30-nvidia-h200-phase9-tune): decode 16-row blocks of 32
    gated / 64 plain columns; from 64 slots an expert 128-row blocks of 128 gated / 256 plain columns over 8 warps and 4
    stages on Hopper, 64 / 128 elsewhere (the wider ones spill on sm_80); shapes whose I or H is no multiple of 16
    (unvectorized loads) the narrower tiles that do not spill, both GEMMs of a layer on the same BLOCK_M; fp32 (ieee
    dots) small tiles; every dot tile >= 16."""
    one = fused_moe_launch_config(1, 128, 8, 768, 2048, True, torch.bfloat16, "cuda")
    assert (one.block_m, one.block_n, one.block_k, one.num_stages) == (16, 32, 128, 3)
    down = fused_moe_launch_config(64, 128, 8, 2048, 768, False, torch.bfloat16, "cuda")
    assert (down.block_m, down.block_n) == (16, 64)
    middle = fused_moe_launch_config(512, 128, 8, 768, 2048, True, torch.bfloat16, "cuda")
    assert (middle.block_m, middle.block_n, middle.num_warps) == (32, 32, 4)
    for capability, gated_n, plain_n in (((9, 0), 128, 256), ((8, 0), 64, 128), (None, 64, 128)):
        big = fused_moe_launch_config(4096, 128, 8, 768, 2048, True, torch.bfloat16, "cuda", capability=capability)
        assert (big.block_m, big.block_n, big.block_k, big.num_warps, big.num_stages) == (128, gated_n, 64, 8, 4)
        big_down = fused_moe_launch_config(4096, 128, 8, 2048, 768, False, torch.bfloat16, "cuda",
                                           capability=capability)
        assert (big_down.block_m, big_down.block_n) == (128, plain_n)
    for gated, n, k in ((True, 360, 1000), (False, 1000, 360)):   # unaligned: H = 1000, I = 360
        assert (fused_moe_launch_config(1, 6, 2, n, k, gated, torch.bfloat16, "cuda").block_n) == 16
        wide = fused_moe_launch_config(4096, 6, 2, n, k, gated, torch.bfloat16, "cuda")
        assert (wide.block_m, wide.block_n, wide.num_warps) == (64, 32 if gated else 64, 8)
    for tokens in (1, 64, 4096):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for gated, n, k in ((True, 768, 2048), (False, 2048, 768), (True, 14336, 4096)):
                c = fused_moe_launch_config(tokens, 8, 2, n, k, gated, dtype, "cuda")
                assert min(c.block_m, c.block_n, c.block_k) >= 16


def _args(**changes):
    gen = torch.Generator().manual_seed(0)
    x, w13, w2, weights, ids = random_moe(4, 32, 16, 4, 2, torch.float32, gen)
    args = dict(hidden=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,match", [
    (dict(hidden=torch.zeros(4, 32, dtype=torch.float64)), r"hidden must have dtype"),
    (dict(hidden=torch.zeros(4, 64)[:, ::2]), r"hidden must be contiguous"),
    (dict(w13=torch.zeros(4, 33, 32)), r"w13 must be \[num_experts, 2 \* intermediate_size"),
    (dict(w13=torch.zeros(4, 32, 32, dtype=torch.float16)), r"w13 must have hidden's dtype"),
    (dict(w2=torch.zeros(4, 32, 8)), r"w2 must have shape \[4, 32, 16\]"),
    (dict(w2=torch.zeros(3, 32, 16)), r"w2 must have shape \[4, 32, 16\]"),
    (dict(topk_ids=torch.zeros(4, 2)), r"topk_ids must have dtype in \(int32, int64\)"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), r"topk_ids must have shape \[4, 2\]"),
    (dict(topk_weights=torch.zeros(4, 3)), r"topk_weights must have shape \[4, 2\]"),
    (dict(topk_ids=torch.tensor([[0, 4]] * 4, dtype=torch.int32)), r"topk_ids must be expert ids in \[0, 4\)"),
    (dict(topk_ids=torch.tensor([[0, -1]] * 4, dtype=torch.int32)), r"topk_ids must be expert ids in \[0, 4\)"),
    (dict(activation="relu"), r"activation must be one of"),
    (dict(expert_map=torch.zeros(6, dtype=torch.int64)), r"expert_map must have dtype in \(int32\)"),
    (dict(expert_map=torch.tensor([0, 1, 2, 4, -1, -1], dtype=torch.int32)),
     r"expert_map must hold local expert ids in \[0, 4\) or -1"),
    (dict(topk_ids=torch.tensor([[0, 6]] * 4, dtype=torch.int32), expert_map=torch.arange(6, dtype=torch.int32) % 4),
     r"topk_ids must be global expert ids \(expert_map's length\) in \[0, 6\)"),
])
def test_bad_arguments_are_value_errors_naming_them(changes, match):
    with pytest.raises(ValueError, match=match):
        pk.fused_moe(**_args(**changes))


@pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("changes,match", [
    (dict(topk_ids=torch.tensor([[0, 4]] * 4, dtype=torch.int32)), r"topk_ids must be expert ids in \[0, 4\)"),
    (dict(topk_ids=torch.tensor([[0, -1]] * 4, dtype=torch.int64)), r"topk_ids must be expert ids in \[0, 4\)"),
    (dict(expert_map=torch.tensor([0, 1, 2, 4, -1, -1], dtype=torch.int32)),
     r"expert_map must hold local expert ids in \[0, 4\) or -1"),
    (dict(topk_ids=torch.tensor([[0, 6]] * 4, dtype=torch.int32), expert_map=torch.arange(6, dtype=torch.int32) % 4),
     r"topk_ids must be global expert ids \(expert_map's length\) in \[0, 6\)"),
])
def test_native_kernel_rejects_bad_ids_before_writing(changes, match):
    """The native kernel checks the ids (and the whole expert map) in its sorting pass; the op then raises the
    checks' ValueError, and out is untouched."""
    args = _args(**changes)
    args["w13"], args["w2"] = pk.pack_moe_weight(args["w13"]), pk.pack_moe_weight(args["w2"])
    out = torch.full((4, 32), float("nan"))
    with pk.use_backend("native"), pytest.raises(ValueError, match=match):
        pk.fused_moe(**args, out=out)
    assert out.isnan().all()


def test_bad_routing_and_packing_arguments():
    logits = torch.randn(3, 8)
    for kwargs, match in [(dict(top_k=9), r"top_k must be an int in \[1, 8\]"),
                          (dict(top_k=2, scoring="tanh"), r"scoring must be one of"),
                          (dict(top_k=2, num_expert_group=3), r"num_expert_group must be a positive int dividing"),
                          (dict(top_k=5, num_expert_group=4, topk_group=2), r"top_k must be an int in \[1, 4\]"),
                          (dict(top_k=2, correction_bias=torch.zeros(7)), r"correction_bias must have shape \[8\]"),
                          (dict(top_k=2, renormalize=1), r"renormalize must be a bool")]:
        with pytest.raises(ValueError, match=match):
            pk.moe_topk(logits, **kwargs)
    with pytest.raises(ValueError, match=r"packed \(pack_moe_weight\) weights are for the native CPU backend"):
        w13, w2 = torch.empty(2, 1, 16, 32, device="meta"), torch.empty(2, 1, 4, 32, device="meta")
        pk.fused_moe(torch.empty(1, 16, dtype=torch.float16, device="meta"), w13, w2,
                     torch.ones(1, 1, device="meta"), torch.zeros(1, 1, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"block_size must be a positive int"):
        pk.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int32), 0, 4)
    with pytest.raises(ValueError, match=r"topk_ids holds expert ids >= num_experts \(4\)"):
        pk.moe_align_block_size(torch.tensor([[0, 4]], dtype=torch.int32), 16, 4)
