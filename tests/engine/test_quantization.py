"""Quantized checkpoints through the engine (issue 22): GPTQ (4/8-bit, group sizes 32/64/128/-1, act-order,
symmetric and not, both checkpoint formats), AWQ (GEMM packing, zero points), FP8 checkpoints (vLLM's fp8 per
tensor, static and dynamic; compressed-tensors per tensor and per channel) and fp8 applied on load.

Each checkpoint is written here in its published layout (tests/engine/quant_checkpoints.py: no reference
quantizer installs on this CPU machine) beside the float32 model holding its de-quantized weights (computed
from the packed tensors by the formats' definitions). transformers cannot run GPTQ/AWQ on the CPU without
those tools, so the reference is the engine's own float32 path on the de-quantized model.

The parity tests run pagedkernels' exact backend ("torch": the quantized weight de-quantized in float32 and
multiplied), so any loading, packing, sharding or act-order mistake shows: log-probabilities within
``LOGPROB_ATOL`` of the reference (measured: 3e-5 to 4e-5) and greedy tokens equal, for every format.
Tensor parallelism (2 gloo ranks) gives the same greedy tokens as one process, including act-order GPTQ in
row-parallel layers (its per-rank regrouping). The default CPU GEMM for int4/int8 (native: the activation
quantized to int8 per 32 values, llama.cpp's scheme, bounded in tests/pagedkernels/test_quant_gemm.py) is
held to ``NATIVE_LOGPROB_ATOL`` on this deliberately sharp tiny model (measured 0.78-1.25; logits spread
over ~40).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.quantization import resolve_quant_config
from tests.engine.models_util import engine_config, random_token_ids
from tests.engine.quant_checkpoints import (INT_CHECKPOINT_CASES, fp8_tensors, quantization_config,
                                           quantize_model_dir)
from tests.engine.test_model_runner import (BLOCK_SIZE, MIXED_SCHEDULE, mixed_sequences, run_schedule,
                                           scatter_blocks)

LOGPROB_ATOL = 2e-4
NATIVE_LOGPROB_ATOL = 2.0

GPTQ_CASES = [
    dict(bits=4, group_size=128, desc_act=False, sym=True),
    dict(bits=4, group_size=32, desc_act=True, sym=True),
    dict(bits=8, group_size=64, desc_act=False, sym=True),
    dict(bits=4, group_size=-1, desc_act=False, sym=False),
    dict(bits=8, group_size=32, desc_act=True, sym=False),
    dict(bits=4, group_size=64, desc_act=True, sym=False, checkpoint_format="gptq_v2"),
]
FP8_CASES = [
    ("fp8", dict(activation_scheme="dynamic")),
    ("fp8", dict(activation_scheme="static")),
    ("compressed-tensors", dict(strategy="channel", static=False)),
    ("compressed-tensors", dict(strategy="tensor", static=True)),
]


@pytest.fixture(autouse=True)
def exact_kernels(request, monkeypatch):
    """pagedkernels' exact ("torch") backend, here and in tensor-parallel workers (they read the variable);
    tests marked ``native_kernels`` keep the default."""
    import pagedkernels as pk

    if "native_kernels" in request.keywords:
        yield
        return
    previous = pk.get_backend()
    monkeypatch.setenv("PAGEDKERNELS_BACKEND", "torch")
    pk.set_backend("torch")
    try:
        yield
    finally:
        pk.set_backend(previous)


def _case_id(case) -> str:
    if isinstance(case, tuple):
        return case[0] + "-" + "-".join(f"{v}" for v in case[1].values())
    return "-".join(f"{k}{v}" for k, v in case.items())


def _logprobs(model_dir: str, quantization: str | None = None, **runner_kwargs) -> tuple[list, object]:
    from engine.worker.model_runner import ModelRunner

    config = engine_config(model_dir, device="cpu", max_model_len=256, block_size=BLOCK_SIZE, num_kv_blocks=64,
                           max_num_seqs=8, max_num_batched_tokens=512, enforce_eager=True, quantization=quantization)
    runner = ModelRunner(config, **runner_kwargs)
    runner.kv_cache.fill_(float("nan"))  # any read of a slot not written shows
    seqs = mixed_sequences(runner.config.vocab_size, seed=7)
    scatter_blocks(seqs, runner.num_kv_blocks, seed=2)
    return run_schedule(runner, seqs, MIXED_SCHEDULE), runner


def _assert_parity(quant_dir: str, deq_dir: str, atol: float, *, greedy: bool = True) -> object:
    results, runner = _logprobs(quant_dir)
    reference, _ = _logprobs(deq_dir)
    worst = 0.0
    for (index, position, logprobs), (_, _, expected) in zip(results, reference):
        assert torch.isfinite(logprobs).all()
        worst = max(worst, float((logprobs - expected).abs().max()))
        if greedy:
            assert int(logprobs.argmax()) == int(expected.argmax()), f"seq {index} position {position}: greedy differs"
    assert worst <= atol, f"log-probabilities differ by {worst} > {atol}"
    return runner


@pytest.mark.native_kernels
@pytest.mark.parametrize("method, opts", INT_CHECKPOINT_CASES)
def test_default_cpu_gemm_stays_close(llama_dir, tmp_path, method, opts):
    """The default CPU path (native int8-activation GEMM): a wrong layout would be off by tens."""
    import pagedkernels as pk

    if pk.get_backend() != "auto":
        pytest.skip(f"PAGEDKERNELS_BACKEND={pk.get_backend()} overrides the default CPU path this test is about")
    quant_dir, deq_dir = quantize_model_dir(llama_dir, str(tmp_path), method, **opts)
    _assert_parity(quant_dir, deq_dir, NATIVE_LOGPROB_ATOL, greedy=False)


@pytest.mark.parametrize("case", GPTQ_CASES, ids=_case_id)
def test_gptq_checkpoint_matches_dequantized_model(llama_dir, tmp_path, case):
    quant_dir, deq_dir = quantize_model_dir(llama_dir, str(tmp_path), "gptq", **case)
    runner = _assert_parity(quant_dir, deq_dir, LOGPROB_ATOL)
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    # Converted into pagedkernels' layout: uint8 codes, act-order as a column permutation.
    assert layer.qweight.dtype == torch.uint8 and layer.wq_bits == case["bits"]
    assert (layer.perm is not None) == case["desc_act"]
    assert (layer.zeros is None) == case["sym"]
    assert runner.model.lm_head.weight.dtype == torch.float32   # never quantized


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_checkpoint_matches_dequantized_model(llama_dir, tmp_path, group_size):
    quant_dir, deq_dir = quantize_model_dir(llama_dir, str(tmp_path), "awq", group_size=group_size)
    runner = _assert_parity(quant_dir, deq_dir, LOGPROB_ATOL)
    assert runner.model.model.layers[1].mlp.down_proj.qweight.dtype == torch.uint8


@pytest.mark.parametrize("case", FP8_CASES, ids=_case_id)
def test_fp8_checkpoint_matches_dequantized_model(llama_dir, tmp_path, case):
    method, opts = case
    quant_dir, deq_dir = quantize_model_dir(llama_dir, str(tmp_path), method, **opts)
    runner = _assert_parity(quant_dir, deq_dir, LOGPROB_ATOL)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    # q, k and v each kept their own scale (per channel after loading, or per tensor each).
    assert qkv.weight_scale.shape == (qkv.weight.shape[0],)
    assert (qkv.input_scale is not None) == bool(opts.get("static") or opts.get("activation_scheme") == "static")


def test_fp8_on_load_matches_its_rounding(llama_dir, tmp_path):
    """quantization="fp8" on a float checkpoint: each linear weight becomes e4m3 with one scale per output
    channel; the model equals the float one with those weights rounded the same way (computed here)."""
    from safetensors.torch import load_file, save_file

    rounded_dir = tmp_path / "rounded"
    shutil.copytree(llama_dir, rounded_dir)
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q, scale = fp8_tensors(tensor, per_channel=True)
            tensors[name] = (q.float() * scale).contiguous()
    save_file(tensors, str(rounded_dir / "model.safetensors"), metadata={"format": "pt"})
    results, runner = _logprobs(llama_dir, quantization="fp8")
    reference, _ = _logprobs(str(rounded_dir))
    for (_, _, logprobs), (_, _, expected) in zip(results, reference):
        torch.testing.assert_close(logprobs, expected, atol=LOGPROB_ATOL, rtol=0)
    layer = runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (layer.weight.shape[0],)
    assert runner.model.lm_head.weight.dtype == torch.float32


def _greedy(model_dir: str, **kwargs) -> list[list[int]]:
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32, **kwargs)
    try:
        prompts = [{"prompt_token_ids": random_token_ids(n, seed=60 + n)} for n in (5, 37, 12)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("method, opts", [
    ("gptq", dict(bits=4, group_size=32, desc_act=True, sym=True)),
    ("awq", dict(group_size=64)),
    ("compressed-tensors", dict(strategy="tensor", static=False)),
], ids=["gptq-act-order", "awq", "fp8"])
def test_tensor_parallel_equals_one_process_and_dequantized(llama_dir, tmp_path, method, opts):
    """Greedy generation: the quantized checkpoint on 2 ranks equals it on 1 (which the parity tests hold to the
    de-quantized model). Column-parallel layers split packed N (AWQ) and per-shard fp8 scales, row-parallel ones
    packed K and groups; GPTQ with act-order splits o_proj/down_proj through its regrouping (gptq.py)."""
    quant_dir, _ = quantize_model_dir(llama_dir, str(tmp_path), method, **opts)
    assert _greedy(quant_dir, tensor_parallel_size=2) == _greedy(quant_dir)


def _config_with(llama_dir: str, tmp_path, quant: dict | None) -> str:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in os.listdir(llama_dir):
        os.symlink(os.path.join(llama_dir, name), model_dir / name)
    os.unlink(model_dir / "config.json")
    with open(os.path.join(llama_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if quant is not None:
        config["quantization_config"] = quant
    (model_dir / "config.json").write_text(json.dumps(config))
    return str(model_dir)


@pytest.mark.parametrize("quant, asked, match", [
    ({**quantization_config("gptq", bits=3, group_size=128, desc_act=False, sym=True)}, None, "bits=3"),
    ({**quantization_config("gptq", bits=4, group_size=16, desc_act=False, sym=True)}, None, "group_size=16"),
    ({**quantization_config("gptq", bits=4, group_size=128, desc_act=False, sym=True),
      "checkpoint_format": "marlin"}, None, "marlin"),
    ({**quantization_config("gptq", bits=4, group_size=128, desc_act=False, sym=True), "lm_head": True}, None,
     "lm_head"),
    ({**quantization_config("awq", group_size=128), "version": "gemv"}, None, "gemv"),
    ({**quantization_config("awq", group_size=128), "zero_point": False}, None, "zero_point"),
    ({**quantization_config("fp8"), "weight_block_size": [128, 128]}, None, "weight_block_size"),
    ({**quantization_config("compressed-tensors"), "format": "pack-quantized"}, None, "pack-quantized"),
    ({"quant_method": "bitsandbytes"}, None, "'bitsandbytes' is not supported"),
    (quantization_config("gptq", bits=4, group_size=128, desc_act=False, sym=True), "awq", "quantized with 'gptq'"),
    (None, "gptq", "needs a checkpoint quantized"),
    (None, "int3", "'int3' is not supported"),
])
def test_unsupported_quantization_is_a_clear_error(llama_dir, tmp_path, quant, asked, match):
    model_dir = _config_with(llama_dir, tmp_path, quant)
    with pytest.raises(ValueError, match=match):
        engine_config(model_dir, quantization=asked)


def test_group_size_must_divide_each_ranks_input(monkeypatch):
    """GPTQ group 128 over o_proj's 256 inputs split on 4 ranks (64 each): refused when the layer is built."""
    import engine.layers.linear as linear_module

    config = resolve_quant_config({"quantization_config": quantization_config(
        "gptq", bits=4, group_size=128, desc_act=False, sym=True)}, None)
    prefix = "model.layers.0.self_attn.o_proj"
    linear_module.Linear(256, 64, parallel="row", quant_config=config, prefix=prefix)  # one rank: fine
    monkeypatch.setattr(linear_module, "get_tp_world_size", lambda: 4)
    with pytest.raises(ValueError, match="group_size 128 does not divide its 64 input features"):
        linear_module.Linear(256, 64, parallel="row", quant_config=config, prefix=prefix)


@pytest.mark.native_kernels
def test_compiled_step_runs_quantized_layers(llama_dir, tmp_path):
    """torch.compile (fullgraph, dynamic) of a quantized model: the GEMMs stay opaque custom ops
    (torch.ops.pagedkernels.wq_gemm, with act-order's column gather) and give what eager mode gives."""
    quant_dir, _ = quantize_model_dir(llama_dir, str(tmp_path), "gptq", bits=4, group_size=32, desc_act=True,
                                      sym=True)
    compiled, runner = _logprobs(quant_dir, compile_model=True)
    assert runner.compiled
    eager, _ = _logprobs(quant_dir)
    for (_, _, a), (_, _, b) in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.native_kernels
@pytest.mark.parametrize("method, opts", [
    ("gptq", dict(bits=4, group_size=32, desc_act=True, sym=True)),
    ("fp8", dict(activation_scheme="dynamic")),
], ids=["gptq4-act-order", "fp8-dynamic"])
def test_quantized_decode_replays_cpu_graphs_as_eager(llama_dir, tmp_path, method, opts):
    """A quantized model's decode steps are CPU graphs, as a float one's: no quantized op reads a tensor value on the
    host (act-order GPTQ decoded eagerly while wq_gemm checked its perm on every call; the check is at load now,
    pagedkernels.wq_gemm.check_wq_perm). Graphs per ladder size, smaller batches over their rows, eager's logits."""
    from engine.worker.model_runner import ModelRunner
    from pagedkernels import _native
    from pagedkernels.cpu_graph import CPUGraph
    from tests.engine.test_cuda_graph_runner import NUM_KV_BLOCKS, _run, _sequences

    if _native.library() is None:
        pytest.skip(f"CPU graphs replay the native kernels, unavailable here: {_native.build_error()}")
    quant_dir, _ = quantize_model_dir(llama_dir, str(tmp_path), method, **opts)
    runs = {}
    for enforce_eager in (True, False):
        config = engine_config(quant_dir, device="cpu", max_model_len=256, block_size=BLOCK_SIZE,
                               num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=10, max_num_batched_tokens=512,
                               enforce_eager=enforce_eager)
        runner = ModelRunner(config)
        runner.kv_cache.fill_(float("nan"))
        runs[enforce_eager] = runner, _run(runner, _sequences(runner.config.vocab_size))
    graphed, got = runs[False]
    assert graphed.graph_runner_class is CPUGraph and not graphed.enforce_eager, "decode fell back to eager"
    assert sorted(graphed.graphs) == [1, 4, 8, 10] and all(g.resizable for g in graphed.graphs.values())
    for step, (a, b) in enumerate(zip(got, runs[True][1])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")


@pytest.mark.native_kernels   # the default backend: Triton and torch._scaled_mm on a CUDA device
def test_fp8_checkpoint_runs_the_cuda_paths(llama_dir, tmp_path):
    """On the fake CUDA device (tests/engine/fake_cuda.py), a compressed-tensors fp8 checkpoint in bf16: the weights
    and scales on the device, a mixed batch through the fp8 GEMM's argument checks (every tensor where the op wants
    it; the fake op computes nothing) and the decode-graph ladder captured without a host sync. (The other formats
    convert their tensors at load by reading values, which a device without data cannot; the GPU suite's
    tests/engine/test_cuda_features.py runs every format's GEMM on a GPU.)"""
    from engine.worker.model_runner import ModelRunner
    from tests.engine.fake_cuda import FakeGraphRunner, fake_cuda
    from tests.engine.models_util import ScheduledSeq as Entry

    quant_dir, _ = quantize_model_dir(llama_dir, str(tmp_path), "compressed-tensors", strategy="channel", static=False)
    prefill, decode = Entry(random_token_ids(37, seed=1), 0, [5, 9, 2]), Entry(random_token_ids(20, seed=3), 19, [8, 6])
    decodes = [(Entry(random_token_ids(n + 1, seed=n), n, list(range(10, 11 + n // BLOCK_SIZE))), 1) for n in (3, 40)]
    FakeGraphRunner.captured_batch_sizes = []
    with fake_cuda():
        config = engine_config(quant_dir, device="cuda", dtype="bfloat16", max_model_len=128, block_size=BLOCK_SIZE,
                               num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=96)
        runner = ModelRunner(config, graph_runner_class=FakeGraphRunner, compile_model=False,
                             capture_graphs_at_startup=True)
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight.device.type == "cuda"
        logits = runner.compute_logits_for([(prefill, 37), (decode, 1)])
        assert logits.shape == (2, runner.config.vocab_size) and logits.device.type == "cuda"
        assert runner.compute_logits_for(decodes).device.type == "cuda"   # the decode graph of 2
    assert sorted(FakeGraphRunner.captured_batch_sizes) == [1, 2, 4, 8]
