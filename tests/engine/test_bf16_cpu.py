"""A bf16 model on the CPU (dtype="bfloat16", or "auto" on a CPU with AMX-BF16 / AVX512-BF16): its linears, its
numerics against a float64 reference, and its decode steps as CPU graphs.

The linears take oneDNN's prepacked bf16 inner product where oneDNN multiplies bf16 (AVX512BW/VL/DQ or
AVX-NE-CONVERT; AMX tiles where present) and the panel-packed kernel (pagedkernels.w16_gemm, vdpbf16ps where the CPU
has it) for products of few rows, or of every size where oneDNN has no bf16 (this AVX2 machine); each is checked
against the float64 product. A model's log-probabilities are held to transformers' own bf16 error: against the
float64 model with the same (bf16) weights, the engine in bf16 may be off by no more than 1.25x what transformers in
bf16 is off by (an attention scale 5% wrong is 2x off, 1.7x the bound, on the tiny llama).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagedkernels as pk
from engine.worker.model_runner import ModelRunner
from pagedkernels import _native
from pagedkernels.cpu_graph import CPUGraph
from tests.engine.models_util import engine_config, hf_log_softmax, load_hf_model
from tests.engine.test_cuda_graph_runner import NUM_KV_BLOCKS, _run, _sequences
from tests.engine.test_model_runner import BLOCK_SIZE, MIXED_SCHEDULE, mixed_sequences, run_schedule, scatter_blocks
from tests.pagedkernels.test_w16_gemm import assert_product as assert_unbiased_product

pytestmark = pytest.mark.skipif(_native.library() is None, reason="native CPU kernels unavailable (no C compiler)")


def bf16_runner(model_dir: str, *, enforce_eager: bool, max_num_seqs: int = 8,
                num_kv_blocks: int = 64) -> ModelRunner:
    config = engine_config(model_dir, device="cpu", dtype="bfloat16", max_model_len=256, block_size=BLOCK_SIZE,
                           num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                           enforce_eager=enforce_eager)
    runner = ModelRunner(config)
    runner.kv_cache.fill_(float("nan"))  # any read of a slot not written shows
    return runner


def assert_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """bf16 ``out`` against ``x @ weight^T + bias`` in float64: float32 accumulation and a bf16 rounding of the
    product (test_w16_gemm's bound), and with a bias one more bf16 rounding of the sum."""
    if bias is None:
        assert_unbiased_product(out, x, weight)
        return
    product = x.double() @ weight.double().t()
    exact = product + bias.double()
    eps = torch.finfo(torch.bfloat16).eps
    bound = (x.double().abs() @ weight.double().abs().t()) * 2.0 ** -21 * 4 + (product.abs() + exact.abs()) * eps
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"off the float64 product by {excess:.3g} past the bound"


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "decode-graph"])
def test_bf16_linears_match_float64(monkeypatch, in_graph):
    """Prepacked bf16 linears (a biased one, an odd K, an LM head tied to its embedding) against the float64 product
    of their bf16 values, at row counts either side of the panel kernel's limit; which copies a layer keeps follows
    the machine (oneDNN's where it multiplies bf16, the panels always), and the plain weight goes unless shared.
    While a decode graph records, the limit is the graph's (set to 3 here: the machine's may be every row)."""
    import contextlib
    from engine.layers.embed_head import LMHead, VocabEmbedding
    from engine.layers.linear import Linear, prepack_linears
    from engine.layers.quantization import unquantized

    g = torch.Generator().manual_seed(5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = nn.Module()
        model.biased, model.odd_k = Linear(64, 40, bias=True), Linear(40, 24)
        model.embed, model.head = VocabEmbedding(100, 64), LMHead(100, 64)
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 4)
    model.head.weight = model.embed.weight
    plain = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    assert prepack_linears(model) == 3
    onednn = unquantized._onednn_bf16_available()
    for name in ("biased", "odd_k", "head"):
        layer = getattr(model, name)
        assert layer.w16_weight is not None and layer.w16_weight.dtype == torch.bfloat16
        assert (layer.packed_weight is not None) == onednn
        assert layer.weight.numel() == (100 * 64 if name == "head" else 0)   # the head's weight is the embedding's

    calls = []
    real = pk.w16_gemm
    monkeypatch.setattr(pk, "w16_gemm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    limit = unquantized.BF16_W16_MAX_ROWS
    if in_graph:
        monkeypatch.setattr(unquantized, "BF16_W16_GRAPH_MAX_ROWS", 3)
        limit = 3
    counts = sorted({1, 3, 70} | ({limit, limit + 1} if limit else set()))
    with unquantized.recording_decode_graph() if in_graph else contextlib.nullcontext():
        assert unquantized.bf16_w16_max_rows() == limit
        products(model, plain, counts, g)
    assert unquantized.bf16_w16_max_rows() == unquantized.BF16_W16_MAX_ROWS   # the graph's limit ends with it
    panel_rows = [rows for rows in counts if not onednn or limit is None or rows <= limit]
    assert calls == [rows for rows in panel_rows for _ in range(3)]


def products(model: nn.Module, plain: dict, counts: list[int], g: torch.Generator) -> None:
    """Each of ``model``'s three linears at each row count, against the float64 product of its ``plain`` weight."""
    for rows in counts:
        for name in ("biased", "odd_k", "head"):
            layer = getattr(model, name)
            weight = plain["embed.weight" if name == "head" else f"{name}.weight"]
            x = torch.randn(rows, weight.shape[1], generator=g).to(torch.bfloat16)
            out = layer(x)
            assert out.dtype == (torch.float32 if name == "head" else torch.bfloat16)   # logits: float32
            bias = plain["biased.bias"] if name == "biased" else None
            assert_product(out.to(torch.bfloat16), x, weight, bias)


MOE_ARCHS = ("mixtral", "olmoe")


@pytest.mark.parametrize("arch", ["llama", "gemma2", *MOE_ARCHS])
def test_bf16_model_is_as_close_to_float64_as_transformers_bf16(tiny_model_dir, arch):
    """Chunked prefills and decodes mixed (runner.compute_logits_for, blocks scattered over a NaN cache) in bf16: the
    log-probabilities' largest error against transformers in float64 on the same bf16 weights is at most 1.25x that
    of transformers in bf16 (gemma2: softcaps, GELU, scaled embeddings).

    Mixtures of experts (mixtral: renormalized float32 routing weights; olmoe: bf16 ones, q/k norms) run their experts
    on the native MoE kernel, bf16 panels and hidden states. Their router picks experts by bf16 logits, and a near-tie
    flips an expert under any rounding (on these tiny models both sides' largest errors are such flips, 2-3 nats):
    for them the bound is on the mean over positions of each position's largest error."""
    from engine.layers.fused_moe import FusedMoE

    model_dir = tiny_model_dir(arch)
    runner = bf16_runner(model_dir, enforce_eager=True)
    assert runner.kv_cache.dtype == torch.bfloat16
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert bool(experts) == (arch in MOE_ARCHS)
    assert all(m.w13_packed.dtype == m.w2_packed.dtype == torch.bfloat16 and m.w13_weight.numel() == 0
               for m in experts), "a bf16 MoE model's experts run on the native kernel's bf16 panels"
    seqs = mixed_sequences(runner.config.vocab_size, seed=10)
    scatter_blocks(seqs, runner.num_kv_blocks, seed=1)
    results = run_schedule(runner, seqs, MIXED_SCHEDULE)
    exact = load_hf_model(model_dir).to(torch.bfloat16).to(torch.float64)
    if experts:
        exact.set_experts_implementation("eager")  # torch._grouped_mm, transformers' default, has no float64
    rounded = load_hf_model(model_dir, torch.bfloat16)
    references = [hf_log_softmax(exact, seq.token_ids) for seq in seqs]
    theirs = [hf_log_softmax(rounded, seq.token_ids) for seq in seqs]
    summary = (lambda errors: sum(errors) / len(errors)) if experts else max
    ours_error = summary([(lp - references[i][p]).abs().max().item() for i, p, lp in results])
    their_error = summary([(theirs[i][p] - references[i][p]).abs().max().item() for i, p, _ in results])
    assert all(torch.isfinite(lp).all() for _, _, lp in results)
    assert ours_error <= 1.25 * their_error, f"engine bf16 off by {ours_error:.3f}, transformers bf16 {their_error:.3f}"


def test_bf16_decode_replays_cpu_graphs_as_eager(tiny_model_dir, monkeypatch):
    """bf16 decode steps go through CPU graphs as float32 ones do (captured per ladder size, smaller batches over
    just their rows), with eager's logits and KV cache. With oneDNN's products from the first row in eager steps, a
    graph's products still take the panels up to the graph's limit (every row here)."""
    from engine.layers.quantization import unquantized

    monkeypatch.setattr(unquantized, "BF16_W16_MAX_ROWS", 0)
    monkeypatch.setattr(unquantized, "BF16_W16_GRAPH_MAX_ROWS", None)
    calls = []
    real = pk.w16_gemm
    monkeypatch.setattr(pk, "w16_gemm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    model_dir = tiny_model_dir("llama")
    eager = bf16_runner(model_dir, enforce_eager=True, max_num_seqs=10, num_kv_blocks=NUM_KV_BLOCKS)
    graphed = bf16_runner(model_dir, enforce_eager=False, max_num_seqs=10, num_kv_blocks=NUM_KV_BLOCKS)
    assert graphed.graph_runner_class is CPUGraph
    expected = _run(eager, _sequences(eager.config.vocab_size))
    eager_calls, calls[:] = len(calls), []
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    assert calls and (eager_calls == 0) == unquantized._onednn_bf16_available()
    assert not graphed.enforce_eager, "the capture fell back to eager"
    assert sorted(graphed.graphs) == [1, 4, 8, 10]
    assert all(g.num_kernel_calls > 0 and g.resizable for g in graphed.graphs.values())
    # oneDNN's bf16 products (where the CPU has them) may round a row differently in a padded graph batch
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=2e-2, rtol=2e-2, equal_nan=True)
