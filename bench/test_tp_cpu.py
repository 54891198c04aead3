"""bench.tp_cpu end to end on a tiny random-weight model (2 ranks): the report has both sides, identical greedy
outputs and the per-step broadcast cost."""
from __future__ import annotations

import json

from bench import tp_cpu


def test_tp_benchmark_report(tmp_path):
    from tests.engine.models_util import build_tiny_model_dir

    model_dir = build_tiny_model_dir("llama", str(tmp_path / "tiny-llama"))
    assert tp_cpu.main(["--model", model_dir, "--tensor-parallel-size", "2", "--num-requests", "4",
                        "--min-len", "4", "--max-len", "12", "--out", str(tmp_path / "out")]) == 0
    (path,) = (tmp_path / "out").iterdir()
    report = json.loads(path.read_text())
    assert report["greedy_outputs_identical"] == "4/4"
    assert report["tp2"]["broadcast_calls"] > 0 and report["tp2"]["broadcast_ms_per_call"] > 0
    assert report["throughput_ratio"] > 0 and report["tp1"]["tensor_parallel_size"] == 1
