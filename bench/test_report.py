"""The benchmark reporting path, run on CPU with tiny shapes: ``python -m pytest bench/test_report.py``.

The GPU suite cannot run here; this checks everything around the timing: every case builds and its
result check passes, rows and targets are complete, and the JSON, Markdown and PNG are written.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench import gpu_suite, report
from bench import kernels as K


def _one_shot(fn):
    """A timer that calls ``fn`` once: the numbers do not matter here, only the plumbing."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.fixture
def fast_timer(monkeypatch):
    monkeypatch.setattr(K, "wall_timer", _one_shot)


@pytest.mark.bench_e2e   # the benchmark run end to end: scripts/test_bench_tools.sh
def test_dry_run_writes_complete_report(tmp_path, fast_timer, capsys):
    rc = gpu_suite.main(["--dry-run", "--phase", "kernels", "--no-compile", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    [json_path] = tmp_path.glob("*-cpu-dry-run-*-phase2-kernels.json")
    stem = json_path.name[: -len(".json")]
    result = json.loads(json_path.read_text())

    assert result["dry_run"] is True and result["schema"] == 2 and result["phase"] == 2
    assert result["environment"]["torch"] == torch.__version__
    assert result["peaks"]["copy_gbps"] > 0 and result["peaks"]["matmul_tflops"] > 0
    assert 0 < result["seconds"] < result["budget_s"] and not result["errors"] and not result["cut"]

    rows = result["rows"]
    ops = {r["op"] for r in rows}
    assert ops == {"reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "copy_blocks",
                   "swap_blocks", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                   "lora shrink+expand", "sample_from_logits", "sampler top-k/top-p draw"}
    for row in rows:
        assert row["check"] == "ok", row
        assert row["ms"] > 0 and row["gbps"] > 0 and row["frac_of_peak"] > 0, row
        assert row["baseline"], row
    # Attention rows carry TFLOP/s; SDPA-flash runs on CPU too and must agree with the reference.
    attention = [r for r in rows if "attention" in r["op"]]
    assert all(r["tflops"] > 0 for r in attention)
    assert any(r["baseline"] == "sdpa-flash" and r["baseline_ms"] for r in attention)
    compiled = [r for r in rows if r["baseline"] == "torch.compile"]
    assert compiled and all(r["note"] == "skipped: --no-compile" for r in compiled)

    targets = {t["target"]: t for t in result["targets"]}
    assert set(targets) == {K.DECODE_TARGET.name, K.PREFILL_TARGET.name, K.ADD_RMS_TARGET.name}
    assert all(t["status"] in ("pass", "fail") and t["value"] is not None for t in targets.values())

    md = (tmp_path / f"{stem}.md").read_text()
    assert "Dry run on CPU" in md and "| paged_decode_attention |" in md and "## Targets" in md
    assert "(phase 2: kernels)" in md
    png = tmp_path / f"{stem}.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and any("matplotlib" in note for note in result["notes"])
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.bench_e2e   # the benchmark run end to end: scripts/test_bench_tools.sh
def test_tests_phase_reports_each_pytest_run(tmp_path, capsys):
    """A tests phase in a dry run collects its selection (here replaced by --pytest-args) and reports it."""
    rc = gpu_suite.main(["--dry-run", "--phase", "kernel-tests", "--pytest-args",
                         "bench/test_report.py -k test_pytest_summary", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    [json_path] = tmp_path.glob("*-phase5-kernel-tests.json")
    [run] = json.loads(json_path.read_text())["tests"]
    assert run["summary"].startswith("1/") and "collected" in run["summary"] and run["returncode"] == 0
    assert "--collect-only" in run["command"] and (tmp_path / run["log"]).exists()
    assert "## Tests" in json_path.with_suffix(".md").read_text()


@pytest.mark.bench_e2e   # the benchmark run end to end: scripts/test_bench_tools.sh
def test_a_cut_test_run_keeps_its_summary(tmp_path):
    """Past its time limit pytest gets SIGINT and still prints what ran: the run is marked cut, not failed."""
    test_file = tmp_path / "test_slow.py"
    test_file.write_text("import time\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n")
    run = gpu_suite.run_tests([str(test_file)], tmp_path / "slow.log", timeout_s=8)
    assert run["cut"] and not gpu_suite.tests_failed(run) and run["seconds"] < 40
    assert run["summary"].startswith("cut at 8 s: ") and "1 passed" in run["summary"], run


def test_modules_needing_an_absent_package_are_left_out(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_needs.py").write_text(
        "import json\nimport not_a_package_here.sub\nfrom engine import LLM\n")
    (tmp_path / "tests" / "test_fine.py").write_text("import json\nimport torch\n")
    monkeypatch.setattr(gpu_suite, "REPO_ROOT", tmp_path)
    assert gpu_suite.missing_imports(["tests"]) == {"tests/test_needs.py": "not_a_package_here"}
    assert gpu_suite.missing_imports(["tests", "--ignore=tests/test_needs.py"]) == {}


def test_target_evaluation_pass_fail_and_missing_baseline():
    case = K.Case("paged_prefill_attention", "s", torch.bfloat16, fn=lambda: None, bytes_moved=1,
                  target=K.PREFILL_TARGET)

    def row(baseline, ratio, check="ok"):
        return K.Row("paged_prefill_attention", "s", "bf16", 1.0, 1.0, 1.0, 0.5, "bf16 matmul", baseline,
                     None if ratio is None else 1.0, ratio, check)

    assert K.evaluate_target(case, [row("sdpa-flash", 0.95), row("flex-paged", 0.1)])["status"] == "pass"
    assert K.evaluate_target(case, [row("sdpa-flash", 0.80)])["status"] == "fail"
    assert K.evaluate_target(case, [row("sdpa-flash", 0.95, check="FAILED: x")])["status"] == "fail"
    assert K.evaluate_target(case, [row("sdpa-flash", None)])["status"] == "n/a"


def test_wrong_result_is_reported_not_timed_silently():
    case = K.rms_norm_case(torch.device("cpu"), torch.float32, num_tokens=4, hidden=64, compile=False)
    case.fn = lambda: torch.zeros(4, 64)  # a broken op
    case.check = lambda: K.assert_close(case.fn(), torch.ones(4, 64), torch.float32)
    peaks = K.Peaks(1.0, 1, 1.0, 1, "fp32")
    rows = K.run_case(case, _one_shot, peaks)
    assert rows[0].check.startswith("FAILED: AssertionError")


def test_pytest_summary():
    out = "....\n=========== 3 passed, 1 skipped in 2.01s ===========\n"
    assert gpu_suite.pytest_summary(out) == "3 passed, 1 skipped in 2.01s"
    assert gpu_suite.pytest_summary("a\n\n12 tests collected in 0.5s\n") == "12 tests collected in 0.5s"
    assert gpu_suite.pytest_summary("1 failed, 2 passed in 1s") == "1 failed, 2 passed in 1s"
    assert gpu_suite.pytest_summary("collected 0 items\n\nno tests ran in 0.01s") == "no tests ran in 0.01s"


def test_device_slug():
    assert report.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_gpu_suite_without_cuda_fails_loudly(tmp_path, capsys):
    assert gpu_suite.main(["--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert K.main([]) == 2


def test_hard_stop_waits_for_an_import_to_finish(tmp_path, monkeypatch):
    """A hard stop that comes while a module is being imported raises after the import, not inside it: raised there,
    it leaves the module's own imports half set up for the rest of the process."""
    import sys

    from bench.budget import Budget, BudgetExceeded

    (tmp_path / "slow_module_for_budget_test.py").write_text("import time\ntime.sleep(1.6)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    start = time.perf_counter()
    Budget(1.0).hard_stop()
    try:
        import slow_module_for_budget_test   # the alarm comes 1 s in, inside the module's body

        assert slow_module_for_budget_test.DONE and time.perf_counter() - start >= 1.6
        with pytest.raises(BudgetExceeded):
            time.sleep(10)
    finally:
        Budget.cancel_hard_stop()
        sys.modules.pop("slow_module_for_budget_test", None)
    assert time.perf_counter() - start < 5


def test_a_hard_stop_during_a_report_write_waits_for_it(tmp_path, monkeypatch):
    """A hard stop that comes while a phase writes its report (after a step, outside the step that records a cut)
    is raised a second after the write, inside what runs next: the step's report whole and the step returned."""
    from bench import gpu_suite
    from bench.budget import Budget, BudgetExceeded

    written = []

    def slow_write(out_dir, result, *, stem=None, png=True):
        time.sleep(1.6)   # the alarm comes 1 s in
        written.append(dict(result))
        return []

    monkeypatch.setattr(gpu_suite.report, "write_report", slow_write)
    run = gpu_suite.PhaseRun.__new__(gpu_suite.PhaseRun)
    run.budget, run.result, run.out_dir, run.stem = Budget(30), {"cut": [], "errors": []}, tmp_path, "x"
    start = time.perf_counter()
    Budget(1.0).hard_stop()
    try:
        assert run.step("a step", lambda: None) is True   # its save() outlived the budget
        assert len(written) == 1 and time.perf_counter() - start >= 1.6
        with pytest.raises(BudgetExceeded):
            time.sleep(10)
    finally:
        Budget.cancel_hard_stop()
    assert time.perf_counter() - start < 5


def test_hard_stop_raises_in_the_main_thread():
    from bench.budget import Budget, BudgetExceeded

    assert Budget(None).allows(1e9) and Budget(5).allows(1) and not Budget(5).allows(10)
    start = time.perf_counter()
    Budget(1.0).hard_stop()
    try:
        with pytest.raises(BudgetExceeded):
            time.sleep(10)
    finally:
        Budget.cancel_hard_stop()
    assert time.perf_counter() - start < 5


def test_a_phase_past_its_budget_stops_cleanly_and_keeps_its_report(tmp_path, fast_timer):
    """With 2 s the headline phase cannot fit: what does not fit is left out or cut, the report is written, the
    phase returns at once and no alarm is left set."""
    import signal

    start = time.perf_counter()
    assert gpu_suite.main(["--dry-run", "--phase", "headline", "--budget", "2", "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - start < 30
    [json_path] = tmp_path.glob("*-phase1-headline.json")
    result = json.loads(json_path.read_text())
    assert result["cut"] or result["not_run"], result
    assert signal.alarm(0) == 0


def test_spec_decode_section_and_target_name_the_fastest_verification():
    """The n-gram section shows each way the verification ran (eager, in graphs, in graphs with the few-row layers) and
    the 2x target takes the fastest, naming it; a report without the few-row engine (a model that cannot take those
    layers) shows "-" there."""
    def workload(speedup, graphs, few_rows=None):
        row = {"plain_tokens_per_s": 800.0, "ngram_tokens_per_s": 800.0 * speedup, "speedup": speedup,
               "ngram_graphs_tokens_per_s": 800.0 * graphs, "graphs_speedup": graphs, "acceptance_rate": 0.9,
               "mean_accepted_length": 5.5, "plain_step_ms": 1.25, "ngram_step_ms": 3.1, "identical_outputs": True,
               "same_leading_tokens": [10, 12], "output_lengths": [10, 12],
               "per_request_ms": {"plain": {"first_token": 1.0, "decode": 2.0, "rest": 0.5}}}
        if few_rows is not None:
            row.update(ngram_graphs_few_rows_tokens_per_s=800.0 * few_rows, few_rows_graphs_speedup=few_rows)
        return row

    spec = {"model": "m", "dtype": "bfloat16", "speculative_config": {"method": "ngram"}, "max_tokens": 160,
            "repeats": 2, "proposer": "ngram",
            "workloads": {"grounded": workload(0.25, 1.94, 2.31), "free": workload(0.2, 0.7)}}
    text = "\n".join(report.spec_decode_markdown(spec))
    assert "n-gram, in graphs, few-row layers" in text
    assert "| grounded | 800.0 | 200.0 | 0.25 | 1552.0 tok/s, 1.94x | 1848.0 tok/s, 2.31x |" in text
    assert "| free | 800.0 | 160.0 | 0.20 | 560.0 tok/s, 0.70x | - |" in text
    run = type("Run", (), {"result": {}})()
    gpu_suite.PhaseRun._spec_targets(run, spec)
    speedup = run.result["spec_decode_targets"][0]
    assert (speedup["value"], speedup["status"], speedup["note"]) == (2.31, "pass",
                                                                      "verification in graphs, few-row layers")
    spec["workloads"]["grounded"] = workload(0.25, 1.94)
    gpu_suite.PhaseRun._spec_targets(run, spec)
    speedup = run.result["spec_decode_targets"][0]
    assert (speedup["value"], speedup["status"], speedup["note"]) == (1.94, "fail", "verification in graphs")
