"""bench.moe_cpu end to end in its --quick mode (a tiny random-weight MoE, a few requests): both sides run, the
greedy outputs agree, the kernel rows check out, the report carries the device and versions."""

from __future__ import annotations

import json

import pytest

from bench import moe_cpu

# The benchmark run end to end: its own tier (scripts/test_bench_tools.sh), not the default run.
pytestmark = pytest.mark.bench_e2e

pytest.importorskip("transformers")


def test_quick_run_writes_the_report(tmp_path):
    assert moe_cpu.main(["--quick", "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path),
                         "--dtypes", "float32,bfloat16"]) == 0
    [path] = tmp_path.glob("*-moe-cpu-*.json")
    report = json.loads(path.read_text())
    assert [row["tokens"] for row in report["kernel_vs_loop"]] == list(moe_cpu.QUICK_KERNEL_TOKENS)
    assert all(row["check"] == "ok" and row["kernel_ms"] > 0 and row["ratio_vs_loop"] > 0
               for row in report["kernel_vs_loop"])
    assert all(row["bf16_check"] == "ok" and row["kernel_bf16_ms"] > 0 for row in report["kernel_vs_loop"])
    assert report["engine-bfloat16"]["dtype"] == "bfloat16"   # the bf16 side ran the model in bf16
    for side in ("engine", "engine-bfloat16", "transformers"):
        assert report[side]["throughput"]["output_lengths_exact"] is True
        assert report[side]["single_stream"]["decode_tokens_per_s"] > 0
    # the same weights and greedy work on both sides, or the ratio would compare two computations
    assert report["greedy_outputs_identical"] == "4/4"
    assert [t["target"] for t in report["targets"]] == ["throughput >= 5x transformers",
                                                        "single-stream decode >= 3x transformers"]
    assert report["environment"]["torch"] and report["model"]["quick"]
    # useful FLOPs count each token's active experts only: 2 of the 4 experts' matrices, attention and head whole
    from bench import engine_cpu

    shape = moe_cpu.QUICK_SHAPE
    experts = shape["num_hidden_layers"] * shape["num_experts"] * 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
    every_matrix = engine_cpu.FlopModel.from_model_dir(str(tmp_path / "model")).matrix_params
    assert report["model"]["active_matrix_params"] == report["matrix_params"] == every_matrix - experts // 2
