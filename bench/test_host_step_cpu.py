"""bench.host_step_cpu on a few requests: every repeat timed, the split into execute_model and the rest adds up to
the step, the profile lists functions, and the JSON is written."""
from __future__ import annotations

import json

from bench import host_step_cpu


def test_small_run_splits_the_step_and_writes_the_report(tmp_path):
    out = tmp_path / "host.json"
    assert host_step_cpu.main(["--num-seqs", "6", "--steps", "3", "--reps", "2", "--profile", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_seqs"] == 6 and report["async_scheduling"] is True and len(report["runs"]) == 2
    for row in report["runs"]:
        assert row["step_ms"] > 0 and row["execute_model_ms"] > 0
        assert abs(row["execute_model_ms"] + row["outside_ms"] - row["step_ms"]) < 1e-6
    assert report["step_ms"]["min"] <= report["step_ms"]["median"]
    profile = report["python"]["top_own_time"]
    assert profile and all(0 <= row["own_ms_per_step"] <= row["cumulative_ms_per_step"] + 1e-9 for row in profile)
