"""bench.engine_gpu's pieces that decide what a GPU run reports (the run itself: test_gpu_suite_dry_run.py)."""

from types import SimpleNamespace

import pytest

from bench.engine_gpu import check_generate_batch


def _out(tokens: int, error: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(generated_tokens=list(range(tokens)), error=error)


def test_generate_batch_results_count_only_when_every_request_came_back_whole():
    check_generate_batch({"a": _out(8), "b": _out(9)}, [8, 8])  # more than asked is fine (grouped max)
    # transformers 5.17 on the H100 returned every request with an error and raised nothing; the suite then
    # reported 42,771 tok/s for requests that generated nothing
    with pytest.raises(RuntimeError, match="2 of 2 requests failed: Inplace update"):
        check_generate_batch({"a": _out(0, "Inplace update to inference tensor"), "b": _out(0, "x")}, [8, 8])
    with pytest.raises(RuntimeError, match="1 of 2 requests missing"):
        check_generate_batch({"a": _out(8)}, [8, 8])
    with pytest.raises(RuntimeError, match="came back short"):
        check_generate_batch({"a": _out(8), "b": _out(3)}, [8, 8])


def test_gpu_busy_counts_each_device_interval_once():
    """An eager op's profiler row carries the device time of the kernels it launched, beside the kernels' own rows:
    the busy time is the device rows' alone."""
    import types

    from torch.autograd import DeviceType

    from bench.engine_gpu import kernel_events

    def row(name, device_type, device_us):
        return types.SimpleNamespace(key=name, device_type=device_type, self_device_time_total=device_us)

    events = [row("aten::mm", DeviceType.CPU, 40.0), row("sm90_xmma_gemm", DeviceType.CUDA, 40.0),
              row("aten::add", DeviceType.CPU, 0.0), row("Memcpy HtoD", DeviceType.CUDA, 3.0),
              row("idle_kernel_with_no_time", DeviceType.CUDA, 0.0)]
    kernels = kernel_events(events)
    assert [e.key for e in kernels] == ["sm90_xmma_gemm", "Memcpy HtoD"]
    assert sum(e.self_device_time_total for e in kernels) == 43.0


def test_lora_ratios_need_both_sides_whole():
    """bench.lora_engine_gpu: a ratio over a side cut at the budget, skipped or not run is n/a, with the reason."""
    from bench.lora_engine_gpu import ratios

    whole = {"output_tokens_per_s": 100.0, "complete": True}
    values, targets = ratios({"engine-lora": dict(whole, output_tokens_per_s=90.0), "engine-base": whole,
                              "peft": dict(whole, output_tokens_per_s=20.0)})
    assert values == {"engine-lora / engine-base": 0.9, "engine-lora / peft": 4.5}
    assert [t["status"] for t in targets] == ["pass", "fail"]
    values, targets = ratios({"engine-lora": whole, "engine-base": dict(whole, complete=False),
                              "peft": {"skipped": "peft is not installed here"}})
    assert values == {"engine-lora / engine-base": None, "engine-lora / peft": None}
    assert [(t["status"], t["note"]) for t in targets] == [("n/a", "engine-base: cut at the budget"),
                                                           ("n/a", "peft: peft is not installed here")]
    assert ratios({})[1][0]["note"] == "engine-lora: not run; engine-base: not run"


def test_a_failing_batch1_variant_leaves_the_rest_and_a_failing_part_frees_the_engine(monkeypatch):
    """A variant of batch-1 decode that raises (programmatic dependent launch refused, say) is recorded and the run
    goes on to the next model; a part that raises still shuts the engine down before the error leaves run()."""
    import torch

    from bench import engine_gpu

    def refused(*args, **kwargs):
        raise RuntimeError("launch refused")

    monkeypatch.setattr(engine_gpu, "batch1_pdl", refused)
    logged = []
    results = engine_gpu.run(torch.device("cpu"), tiny=True, models=["qwen3-0.6b", "llama-3-8b"], parts=("batch1",),
                             copy_gbps=10.0, log=logged.append)
    for name in ("qwen3-0.6b", "llama-3-8b"):
        row = results["models"][name]
        assert row["batch1"]["decode_tokens_per_s"] and row["batch1_pdl"] == {"error": "RuntimeError: launch refused"}
    assert sum("batch1_pdl failed: RuntimeError: launch refused" in line for line in logged) == 2

    shutdowns = []
    from engine.core.llm_engine import LLMEngine

    real_shutdown = LLMEngine.shutdown
    monkeypatch.setattr(LLMEngine, "shutdown", lambda self: (shutdowns.append(1), real_shutdown(self)))
    monkeypatch.setattr(engine_gpu, "batch1_decode", refused)
    with pytest.raises(RuntimeError, match="launch refused"):
        engine_gpu.run(torch.device("cpu"), tiny=True, models=["qwen3-0.6b"], parts=("batch1",), copy_gbps=10.0,
                       log=logged.append)
    assert shutdowns == [1]


def test_the_fused_rope_variants_change_the_engine_and_put_it_back(tmp_path):
    """batch1_fused_rope on a CPU engine whose decode graphs run the decode op (its layers take the setting; a CPU
    step has no few-row layers to use it): the other way measured and its ratio reported, the engine's own setting
    back after, from either side; ``everything`` with the fused merge too (a CPU cannot launch with PDL), back
    after; an eager engine (no decode kernel): None."""
    import torch

    from bench import engine_gpu
    from engine import LLM
    from tests.engine.models_util import build_tiny_model_dir

    model_dir = build_tiny_model_dir("qwen3", str(tmp_path))
    eager = LLM(model_dir, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2, enforce_eager=True)
    try:
        assert engine_gpu.batch1_fused_rope(eager, {}, 8, 4, 10.0) is None
        assert engine_gpu.batch1_fused_rope(eager, {}, 8, 4, 10.0, everything=True) is None
    finally:
        eager.llm_engine.shutdown()
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2)
    try:
        runner = llm.llm_engine.model_runner
        layers = runner.attention_layers
        assert all(layer.use_decode_kernel and not layer.decode_fused_rope for layer in layers)
        default = engine_gpu.batch1_decode(llm, 8, 4, 10.0)
        key, result = engine_gpu.batch1_fused_rope(llm, default, 8, 4, 10.0)
        assert key == "batch1_fused_rope" and result["same_leading_tokens"] == 4
        # The ratio where both sides have a rate (a tiny model's timer noise can leave either without one)
        rates = result["decode_tokens_per_s"], default["decode_tokens_per_s"]
        assert ("fused_rope_speedup" in result) == all(rates)
        assert not any(layer.decode_fused_rope for layer in layers)
        runner.decode_split_counters = torch.zeros(2 * layers[0].num_kv_heads, dtype=torch.int32)
        key, result = engine_gpu.batch1_fused_rope(llm, default, 8, 4, 10.0, everything=True)
        assert key == "batch1_all_fused" and result["same_leading_tokens"] == 4
        assert not any(layer.decode_fused_rope or layer.decode_split_counters is not None for layer in layers)
        runner.set_decode_fused_rope(True)   # an engine that fuses them compares the two kernels
        key, result = engine_gpu.batch1_fused_rope(llm, default, 8, 4, 10.0)
        assert key == "batch1_unfused_rope" and all(layer.decode_fused_rope for layer in layers)
    finally:
        llm.llm_engine.shutdown()


def test_the_moe_gemv_variant_measures_moe_engines_and_puts_the_setting_back(tmp_path):
    """batch1_moe_gemv: None for a dense model (and for PDL on a CPU); on an MoE engine the batch-1 decode with
    fused_moe's matrix-vector setting on, the same greedy tokens (a CPU runs the native kernel either way), the
    setting and the decode graphs' absence after as before."""
    import pagedkernels as pk
    from bench import engine_gpu
    from engine import LLM
    from tests.engine.models_util import build_tiny_model_dir

    dense = LLM(build_tiny_model_dir("qwen3", str(tmp_path / "dense")), device="cpu", dtype="float32",
                max_model_len=128, max_num_seqs=2, enforce_eager=True)
    try:
        assert engine_gpu.batch1_moe_gemv(dense, {}, 8, 4, 10.0) is None
    finally:
        dense.llm_engine.shutdown()
    llm = LLM(build_tiny_model_dir("qwen3_moe", str(tmp_path / "moe")), device="cpu", dtype="float32",
              max_model_len=128, max_num_seqs=2)
    try:
        assert engine_gpu.batch1_moe_gemv(llm, {}, 8, 4, 10.0, pdl=True) is None
        default = engine_gpu.batch1_decode(llm, 8, 4, 10.0)
        before = pk.moe_gemv_max_tokens()
        key, result = engine_gpu.batch1_moe_gemv(llm, default, 8, 4, 10.0)
        assert key == "batch1_moe_gemv" and result["same_leading_tokens"] == 4
        assert ("speedup" in result) == bool(result["decode_tokens_per_s"] and default["decode_tokens_per_s"])
        assert pk.moe_gemv_max_tokens() == before
    finally:
        llm.llm_engine.shutdown()


def test_the_skinny_deep_variant_measures_few_row_engines_and_puts_the_setting_back(tmp_path, monkeypatch):
    """batch1_skinny_deep: None where the batch-1 steps do not run the few-row layers and for PDL on a CPU; with them
    (the CPU's weight prepacking off, the layers set by hand) the batch-1 decode with the deep launches on, the same
    greedy tokens (the CPU runs the op's PyTorch twin either way), its step profile, the setting back after."""
    import dataclasses

    import pagedkernels as pk
    from bench import engine_gpu
    from engine import LLM
    from engine.platform import DevicePolicy
    from tests.engine.models_util import build_tiny_model_dir

    for_device = DevicePolicy.for_device.__func__   # a prepacked layer has no plain weight for the few-row path
    monkeypatch.setattr(DevicePolicy, "for_device", classmethod(
        lambda cls, device: dataclasses.replace(for_device(cls, device), prepack_linears=False)))
    llm = LLM(build_tiny_model_dir("qwen3", str(tmp_path)), device="cpu", dtype="float32", max_model_len=128,
              max_num_seqs=2)
    try:
        runner = llm.llm_engine.model_runner
        assert runner.skinny_max_rows == 0 and engine_gpu.batch1_skinny_deep(llm, {}, 8, 4, 10.0) is None
        assert runner.set_skinny_max_rows(1) == 1
        assert engine_gpu.batch1_skinny_deep(llm, {}, 8, 4, 10.0, pdl=True) is None
        default = engine_gpu.batch1_decode(llm, 8, 4, 10.0)
        before = pk.skinny_gemm_deep()
        profiled_with = []
        step_profile = engine_gpu.step_profile
        monkeypatch.setattr(engine_gpu, "step_profile", lambda *a, **k: (
            profiled_with.append(pk.skinny_gemm_deep()) or step_profile(*a, **k)))
        key, result = engine_gpu.batch1_skinny_deep(llm, default, 8, 4, 10.0,
                                                    profile=([(list(range(100, 116)), 16)], (2, 4)))
        assert key == "batch1_skinny_deep" and result["same_leading_tokens"] == 4
        assert result["profile"]["steps"] == 2 and profiled_with == [True]   # steps 2-4, with the setting on
        assert ("speedup" in result) == bool(result["decode_tokens_per_s"] and default["decode_tokens_per_s"])
        assert pk.skinny_gemm_deep() == before and runner.skinny_max_rows == 1
    finally:
        llm.llm_engine.shutdown()


def test_the_fused_reduce_variant_changes_the_engine_and_puts_it_back(tmp_path):
    """batch1_fused_reduce on an engine whose runner has split counters (on CPU given by hand: its decode ops take
    and ignore them): the other merge measured, its ratio reported, the engine's own setting back after; with PDL
    (which a CPU cannot launch) nothing measured and nothing changed; no counters at all (a CPU runner's own): None."""
    import torch

    from bench import engine_gpu
    from engine import LLM
    from tests.engine.models_util import build_tiny_model_dir

    llm = LLM(build_tiny_model_dir("qwen3", str(tmp_path)), device="cpu", dtype="float32", max_model_len=128,
              max_num_seqs=2)
    try:
        runner = llm.llm_engine.model_runner
        assert engine_gpu.batch1_fused_reduce(llm, {}, 8, 4, 10.0) is None
        runner.decode_split_counters = torch.zeros(2 * runner.attention_layers[0].num_kv_heads, dtype=torch.int32)
        default = engine_gpu.batch1_decode(llm, 8, 4, 10.0)
        key, result = engine_gpu.batch1_fused_reduce(llm, default, 8, 4, 10.0)
        assert key == "batch1_fused_reduce" and result["same_leading_tokens"] == 4
        # The ratio where both sides have a rate (a tiny model's timer noise can leave either without one)
        rates = result["decode_tokens_per_s"], default["decode_tokens_per_s"]
        assert ("fused_reduce_speedup" in result) == all(rates)
        assert all(layer.decode_split_counters is None for layer in runner.attention_layers)
        assert engine_gpu.batch1_fused_reduce(llm, default, 8, 4, 10.0, pdl=True) is None
        assert all(layer.decode_split_counters is None for layer in runner.attention_layers)
        runner.set_decode_fused_reduce(True)   # an engine that merges in the split kernel compares the reduce kernel
        key, result = engine_gpu.batch1_fused_reduce(llm, default, 8, 4, 10.0)
        assert key == "batch1_split_reduce"
        assert all(layer.decode_split_counters is runner.decode_split_counters for layer in runner.attention_layers)
    finally:
        llm.llm_engine.shutdown()


def test_the_skinny_head_variant_changes_the_engine_and_puts_it_back(tmp_path, monkeypatch):
    """batch1_skinny_head: on a CPU engine (no few-row step graphs: nothing to fold) None, the engine unchanged; on an
    engine whose runner can fold (its setting stood in for, with batch1_decode's figures: the fold itself is
    tests/engine/test_skinny_decode.py's), the other way measured, the folded head's ratio reported whichever side the
    engine starts on, and its own setting back after."""
    from types import SimpleNamespace

    from bench import engine_gpu
    from engine import LLM
    from tests.engine.models_util import build_tiny_model_dir

    model_dir = build_tiny_model_dir("qwen3", str(tmp_path))
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2)
    try:
        assert engine_gpu.batch1_skinny_head(llm, {}, 8, 4, 10.0) is None
        assert llm.llm_engine.model_runner.skinny_head is False
    finally:
        llm.llm_engine.shutdown()

    class Runner:
        skinny_head = False

        def set_skinny_lm_head(self, on):
            self.skinny_head = bool(on)
            return self.skinny_head

    runner = Runner()
    fake = SimpleNamespace(llm_engine=SimpleNamespace(model_runner=runner))
    monkeypatch.setattr(engine_gpu, "batch1_decode", lambda llm, *args: {
        "decode_tokens_per_s": 120.0 if runner.skinny_head else 100.0, "token_ids": [1, 2, 3]})
    default = {"decode_tokens_per_s": 100.0, "token_ids": [1, 2, 4]}
    key, result = engine_gpu.batch1_skinny_head(fake, default, 8, 4, 10.0)
    assert key == "batch1_skinny_head" and result["skinny_head_speedup"] == 1.2 and not runner.skinny_head
    assert result["same_leading_tokens"] == 2
    runner.skinny_head = True   # an engine that folds it compares cuBLAS's head
    key, result = engine_gpu.batch1_skinny_head(fake, {"decode_tokens_per_s": 120.0, "token_ids": [1, 2, 3]},
                                                8, 4, 10.0)
    assert key == "batch1_cublas_head" and result["skinny_head_speedup"] == 1.2 and runner.skinny_head
