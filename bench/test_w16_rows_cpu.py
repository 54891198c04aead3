"""bench.w16_rows_cpu --quick: both bf16 products checked against the float32 reference, timed at each row count,
the crossover and the engine's limits reported; the crossover read off the rows as the engine's limit means it."""

from __future__ import annotations

import json

import pytest

from bench import w16_rows_cpu
from pagedkernels import _native


def _comparable() -> bool:
    from engine.layers.quantization.unquantized import _onednn_bf16_available

    return _native.library() is not None and _onednn_bf16_available()


def test_crossover_is_the_last_row_count_before_the_panels_lose():
    rows = [{"rows": r, "panels_over_onednn": v} for r, v in ((1, 0.5), (16, 0.99), (32, 1.0), (48, 1.02), (64, 0.9))]
    assert w16_rows_cpu.crossover(rows) == 32   # a later win after a loss does not count
    assert w16_rows_cpu.crossover([{"rows": 1, "panels_over_onednn": 1.2}]) is None


@pytest.mark.skipif(not _comparable(), reason="needs the native kernels and oneDNN's bf16 product (AVX512BW/VL/DQ "
                                              "or AVX-NE-CONVERT); other CPUs take the panels for every row")
def test_quick_run_reports_both_products_at_each_row_count(tmp_path, capsys):
    out = tmp_path / "w16.json"
    assert w16_rows_cpu.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "bench.w16_rows_cpu" and report["quick"] and report["cpu"]
    assert [r["rows"] for r in report["rows"]] == list(w16_rows_cpu.QUICK_ROWS)
    for row in report["rows"]:
        assert row["panels_ms"] > 0 and row["onednn_ms"] > 0 and row["panels_min_ms"] <= row["panels_ms"]
        assert row["panels_over_onednn"] == pytest.approx(row["panels_ms"] / row["onednn_ms"], rel=0.01, abs=0.002)
    assert report["panels_never_slower_up_to_rows"] == w16_rows_cpu.crossover(report["rows"])
    assert set(report["engine_limits"]) == {"eager", "graphs"}
    assert report["cpu_bf16_isa"] == _native.cpu_bf16_isa()
    assert "panels/oneDNN" in capsys.readouterr().out


@pytest.mark.skipif(not _comparable(), reason="needs the native kernels and oneDNN's bf16 product")
def test_a_wrong_product_fails_the_run(monkeypatch):
    """The reference check catches a mis-wired product before any timing."""
    import importlib

    w16 = importlib.import_module("pagedkernels.w16_gemm")   # the package's w16_gemm attribute is the function

    real = w16.w16_gemm
    monkeypatch.setattr(w16, "w16_gemm", lambda x, packed, n, **kw: real(x, packed, n, **kw) * 2)
    with pytest.raises(AssertionError, match="panels product at .* max .err."):
        w16_rows_cpu.main(["--quick"])


@pytest.mark.bench_e2e   # engines built and run: scripts/test_bench_tools.sh
@pytest.mark.skipif(not _comparable(), reason="needs the native kernels and oneDNN's bf16 product")
def test_quick_engine_rounds_take_turns_and_restore_the_limits(tiny_llama, tmp_path):
    """--engine: one bf16 engine per configuration, rounds taking turns, medians and ratios to the first; the module's
    limits and the tile switch are as before afterwards."""
    from engine.layers.quantization import unquantized

    before = unquantized.BF16_W16_MAX_ROWS, unquantized.BF16_W16_GRAPH_MAX_ROWS, _native.w16_amx()
    out = tmp_path / "engine.json"
    assert w16_rows_cpu.main(["--quick", "--engine", "16:off,all:5", "--model", tiny_llama, "--out", str(out)]) == 0
    engine = json.loads(out.read_text())["engine"]
    assert set(engine["median_tokens_per_s"]) == {"16:off", "all:5"} and engine["rounds"] == 2
    assert engine["ratio_to_first"]["16:off"] == 1.0 and all(v > 0 for v in engine["median_tokens_per_s"].values())
    assert all(len(v) == 2 for v in engine["tokens_per_s"].values())
    assert engine["greedy_identical_to_first"]["16:off"] == "12/12"
    assert (unquantized.BF16_W16_MAX_ROWS, unquantized.BF16_W16_GRAPH_MAX_ROWS, _native.w16_amx()) == before
