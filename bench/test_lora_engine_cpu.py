"""bench.lora_engine_cpu --quick on a tiny random-weight Llama: the three sides (the engine with four adapters,
the engine on the base model, transformers + PEFT's mixed-adapter batches) each in its own process, their figures,
the two ratios and their goals, and the LoRA engine's greedy outputs equal to PEFT's (a benchmark of two different
computations would be meaningless)."""

from __future__ import annotations

import json

import pytest

from bench import lora_engine_cpu

# The benchmark run end to end: its own tier (scripts/test_bench_tools.sh), not the default run.
pytestmark = pytest.mark.bench_e2e

pytest.importorskip("peft", reason="the benchmark's baseline and its adapters are PEFT's")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from tests.engine.models_util import build_tiny_model_dir

    return build_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny-llama")))


def test_quick_run_measures_every_side_and_writes_json(tiny_llama, tmp_path):
    assert lora_engine_cpu.main(["--quick", "--model", tiny_llama, "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-lora-engine-cpu-*.json")
    report = json.loads(path.read_text())
    assert report["quick"] and report["benchmark"] == "bench.lora_engine_cpu"
    assert report["adapters"]["ranks"] == list(lora_engine_cpu.QUICK_RANKS)
    assert lora_engine_cpu.RANKS == (8, 16, 8, 16) and report["requests"]["count"] == 6
    assert report["rounds"] == {"engine": 2, "peft": 1}
    assert set(report["sides"]) == {"engine-lora", "engine-base", "peft"}
    for side in report["sides"].values():
        assert side["output_lengths_exact"] is True and side["output_tokens"] == report["requests"]["output_tokens"]
        assert side["output_tokens_per_s"] > 0 and 0 < side["frac_of_matmul"]
    # the LoRA sides count the adapters' products too
    assert report["sides"]["peft"]["useful_gflops"] > report["sides"]["engine-base"]["useful_gflops"]
    assert set(report["ratios"]) == {"engine-lora / engine-base", "engine-lora / peft"}
    assert [t["target"] for t in report["targets"]] == ["engine-lora / engine-base >= 0.8", "engine-lora / peft >= 5.0"]
    assert all(t["status"] in ("met", "not met") for t in report["targets"])
    assert report["greedy_outputs_identical_engine_lora_vs_peft"] == "6/6"
    assert report["adapter_outputs_differ_from_base"] != "0/6"   # the adapters are live in the engine


def test_quick_bf16_run_writes_its_own_file(tiny_llama, tmp_path):
    """``--dtype bfloat16`` runs the engine sides in bf16 and names its file apart from the float32 run's."""
    assert lora_engine_cpu.main(["--quick", "--dtype", "bfloat16", "--skip-peft", "--model", tiny_llama,
                                 "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-lora-engine-cpu-bf16-*.json")
    report = json.loads(path.read_text())
    assert report["dtype"] == "bfloat16" and set(report["sides"]) == {"engine-lora", "engine-base"}
    assert all(side["output_lengths_exact"] is True for side in report["sides"].values())
    assert report["adapter_outputs_differ_from_base"] != "0/6"
