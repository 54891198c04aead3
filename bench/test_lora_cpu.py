"""bench.lora_cpu --quick: every token count and method measured on its tiny projection, each LoRA method's result
checked against the float32 reference first (a mis-wired benchmark fails here), the ratios and the report written."""

from __future__ import annotations

import json

from bench import lora_cpu


def test_quick_run_writes_every_row(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert lora_cpu.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["quick"] and report["benchmark"] == "bench.lora_cpu" and report["cpu"]
    methods = ("pagedkernels", "per-adapter loop", "torch twin", "base linear")
    rows = {(r["projection"], r["tokens"], r["method"]): r for r in report["rows"]}
    assert set(rows) == {(name, n, m) for name, _, _ in lora_cpu.QUICK_PROJECTIONS for n in lora_cpu.QUICK_TOKENS
                         for m in methods}
    assert lora_cpu.TOKENS == (1, 64, 1024) and report["peaks"] is None   # the real run's token counts
    for (name, tokens, method), row in rows.items():
        assert row["us"] > 0 and row["us_min"] <= row["us"]
        if method == "base linear":
            assert row["loop_over_this"] is None and row["GFLOPs"] is None
        else:
            assert row["loop_over_this"] > 0 and row["this_over_base"] > 0 and row["GFLOPs"] > 0
    assert rows[("qkv", 64, "per-adapter loop")]["loop_over_this"] == 1.0
    assert "loop/this" in capsys.readouterr().out


def test_out_directory_gets_the_dated_report_name(tmp_path):
    """--out DIR writes DIR/<date>-lora-cpu-kernels-<cpu>.json, as bench.engine_cpu and bench.moe_cpu do (a
    directory given before made the run fail at its end, after the timing)."""
    assert lora_cpu.main(["--quick", "--out", str(tmp_path / "results")]) == 0
    (path,) = (tmp_path / "results").iterdir()
    assert path.name.endswith(".json") and "-lora-cpu-kernels-" in path.name
    assert json.loads(path.read_text())["benchmark"] == "bench.lora_cpu"


def test_quick_bf16_run_names_its_file_and_fraction(tmp_path):
    """--dtype bfloat16: every method in bf16 (each checked against the float32 reference at bf16's tolerance), the
    report saying so, its file apart from the float32 run's."""
    assert lora_cpu.main(["--quick", "--dtype", "bfloat16", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.iterdir()
    assert "-lora-cpu-kernels-bf16-" in path.name
    report = json.loads(path.read_text())
    assert report["dtype"] == "bfloat16"
    assert all("frac_of_bf16_matmul" in row and row["us"] > 0 for row in report["rows"])
