"""bench.serve_compare, the summary of bench/serve_vs_vllm.sh, on reports written here; the script's syntax. (The
script's small mode, SMALL=1, starts real servers: run by hand, see its header.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench import serve_compare


def _report(path: Path, throughput: float, ttft: float, tpot: float, failed: int = 0) -> None:
    path.write_text(json.dumps({"args": {}, "result": {"output_throughput": throughput, "median_ttft_ms": ttft,
                                                       "mean_ttft_ms": ttft * 2, "mean_tpot_ms": tpot,
                                                       "failed": failed}}))


def test_columns_are_medians_over_rounds_and_engine_meets_each_vllm_column(tmp_path):
    figures = {  # (side, dtype, load): per round (output tok/s, TTFT median ms, TPOT ms)
        ("engine", "float32", "c8"): [(200, 800, 24), (220, 900, 23), (210, 700, 25)],
        ("engine", "bfloat16", "c8"): [(300, 260, 20), (280, 280, 21), (290, 250, 22)],
        ("vllm", "float32", "c8"): [(140, 720, 30), (130, 730, 31), (150, 740, 29)],
        ("vllm", "auto", "c8"): [(240, 270, 29), (250, 265, 30), (245, 275, 28)],
        ("engine", "float32", "c1"): [(50, 100, 19), (52, 90, 18), (51, 95, 20)],
    }
    for (side, dtype, load), rounds in figures.items():
        for number, (throughput, ttft, tpot) in enumerate(rounds, 1):
            _report(tmp_path / f"{side}-{dtype}-r{number}-{load}.json", throughput, ttft, tpot, failed=number == 2)
    (tmp_path / "engine-float32-r1.srv.log").write_text("not a report")
    (tmp_path / "summary.json").write_text("{}")
    summary = serve_compare.summarize(serve_compare.collect(str(tmp_path)), {"cpu": "test CPU"})
    columns = {(c["side"], c["dtype"], c["load"]): c for c in summary["columns"]}
    assert set(columns) == set(figures)
    engine_bf16 = columns[("engine", "bfloat16", "c8")]
    assert (engine_bf16["output_tok_s"], engine_bf16["ttft_median_ms"], engine_bf16["tpot_mean_ms"]) == (290, 260, 21)
    assert engine_bf16["rounds"] == 3 and engine_bf16["failed"] == 1
    ratios = {(r["load"], r["engine_dtype"], r["vllm_dtype"]): r for r in summary["engine_vs_vllm"]}
    assert set(ratios) == {("c8", e, v) for e in ("float32", "bfloat16") for v in ("float32", "auto")}
    assert ratios[("c8", "bfloat16", "auto")]["output_tok_s_ratio"] == 290 / 245
    assert ratios[("c8", "bfloat16", "auto")]["ttft_median_ratio"] == 260 / 270
    assert ratios[("c8", "float32", "float32")]["output_tok_s_ratio"] == 210 / 140
    text = serve_compare.table(summary)
    assert "c8: engine bfloat16 / vllm auto: output tok/s 1.18x, TTFT median 0.96x" in text and "test CPU" in text


def test_script_parses():
    script = Path(__file__).with_name("serve_vs_vllm.sh")
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
