"""bench.tp_cpu end to end on a tiny random-weight model (2 ranks): the report has both sides, identical greedy
outputs and the per-step broadcast cost."""
from __future__ import annotations

import json

import pytest

from bench import tp_cpu


@pytest.mark.bench_e2e   # the benchmark run end to end: scripts/test_bench_tools.sh
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
    assert set(report["gloo_all_reduce_us"]) == {"1x128", "48x128", "512x128"}
    assert all(us > 0 for us in report["gloo_all_reduce_us"].values()) and report["all_reduces_per_step"] == 4


def test_random_model_like_splits_heads(tmp_path):
    from tests.engine.models_util import build_tiny_model_dir
    from engine.config import ModelConfig
    from engine.models import load_model_config

    model_dir = build_tiny_model_dir("llama", str(tmp_path / "tiny-llama"))
    source = load_model_config(model_dir)
    copy = load_model_config(tp_cpu.random_model_like(model_dir, 2, 1, str(tmp_path / "copy")))
    assert (copy.num_attention_heads, copy.num_key_value_heads) == (2, 1)
    assert copy.head_dim * 2 == copy.hidden_size == source.hidden_size
    assert copy.num_hidden_layers == source.num_hidden_layers and copy.vocab_size == source.vocab_size
