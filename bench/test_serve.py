"""bench.serve against an in-process server on a tiny random-weight Llama (`server`, `tiny_llama`: bench/conftest.py):
``python -m pytest bench/test_serve.py``."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from bench import serve  # noqa: E402


def test_max_concurrency_random_token_ids(server, tiny_llama, tmp_path):
    out = tmp_path / "report.json"
    full = serve.main(["--base-url", server.url, "--num-prompts", "10", "--max-concurrency", "4",
                       "--dataset", "random", "--random-input-len", "20", "--random-output-len", "6",
                       "--tokenizer", tiny_llama, "--json", str(out)])
    report = full["result"]
    assert (report["completed"], report["failed"]) == (10, 0)
    # Exact lengths: token-id prompts, ignore_eos and max_tokens = the drawn output length.
    assert report["total_input_tokens"] == 200 and report["total_output_tokens"] == 60
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < report[f"median_{name}_ms"] <= report[f"p99_{name}_ms"]
    assert report["mean_ttft_ms"] < report["mean_e2el_ms"]
    assert report["output_throughput"] == pytest.approx(60 / report["duration_s"])
    assert json.loads(out.read_text())["result"] == report
    assert full["model"] == "tiny"


def test_poisson_sharegpt_shaped_text_prompts(server):
    full = serve.main(["--base-url", server.url, "--num-prompts", "6", "--request-rate", "40",
                       "--dataset", "sharegpt-shaped", "--max-input-len", "16", "--max-output-len", "8", "--seed", "3"])
    report = full["result"]
    assert (report["completed"], report["failed"]) == (6, 0)
    lengths = [r["output_len"] for r in full["per_request"]]
    assert all(1 <= n <= 8 for n in lengths) and report["total_output_tokens"] == sum(lengths)
    assert all(r["input_len"] > 0 for r in full["per_request"])   # from the server's usage


def test_failed_requests_are_counted(server):
    # Output longer than the context: every request gets a 400, counted as failed, and the run still reports.
    report = serve.main(["--base-url", server.url, "--num-prompts", "3", "--random-input-len", "8",
                         "--random-output-len", "400", "--max-output-len", "400"])["result"]
    assert (report["completed"], report["failed"]) == (0, 3)
    assert "maximum context length" in report["errors"][0]
