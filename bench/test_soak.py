"""bench.soak's small-count mode against an in-process server on a tiny random-weight Llama (the real soak, with
`--launch` on SmolLM2, is not run in CI): ``python -m pytest bench/test_soak.py`` (`server`: bench/conftest.py)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from bench import soak  # noqa: E402


def test_small_soak_reports_every_window(server, tmp_path):
    pytest.importorskip("xgrammar")   # the mix has structured outputs
    out = tmp_path / "soak.json"
    report = soak.main(["--base-url", server.url, "--server-pid", str(os.getpid()), "--num-requests", "48",
                        "--window", "16", "--concurrency", "8", "--max-tokens", "24", "--max-prompt-words", "16",
                        "--seed", "1",
                        "--json", str(out)])
    summary = report["summary"]
    assert summary["requests"] == 48 and [w["requests"] for w in summary["windows"]] == [16, 16, 16]
    assert (summary["errors"], summary["5xx"]) == (0, 0), [w["error_examples"] for w in summary["windows"]]
    # The mix reached every kind of request, aborts included.
    mix = report["mix"]
    assert all(mix[kind] > 0 for kind in ("streamed", "chat", "n_gt_1", "guided", "stop", "logprobs")), mix
    assert mix["abort_planned"] > 0 and summary["aborted"] > 0
    for window in summary["windows"]:
        assert 0 < window["p50_ttft_ms"] <= window["p99_ttft_ms"]
        assert 0 < window["p50_tpot_ms"] <= window["p99_tpot_ms"]
        assert window["rss"][str(os.getpid())]["rss_mb"] > 0   # this process serves: its RSS is sampled
    drift = summary["rss_drift"][str(os.getpid())]
    assert drift["from_mb"] > 0 and drift["drift"] is not None
    assert summary["idle_after"]["idle"], summary["idle_after"]   # nothing left running, every KV block free
    assert json.loads(out.read_text())["summary"]["windows"] == json.loads(json.dumps(summary["windows"]))


def test_a_failing_server_is_counted_not_crashed():
    # Nothing listens there: every request is an error, and the run still reports.
    requests = soak.make_requests(6, "tiny", seed=0, max_tokens=(4, 8))
    import asyncio
    outcomes, samples = asyncio.run(soak.run_soak("http://127.0.0.1:9", requests, concurrency=2, window=3,
                                                  api_key=None, timeout_s=5, server_pid=None, core_pid=None))
    summary = soak.summarize(outcomes, samples, window=3)
    assert summary["errors"] == 6 and summary["5xx"] == 0 and len(summary["windows"]) == 2
    assert all(w["error_examples"] for w in summary["windows"])
