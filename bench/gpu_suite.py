"""The whole GPU suite in one command: the test suite on CUDA, then the kernel benchmarks, then a report.

    PYTHONPATH=. python -m bench.gpu_suite [--out DIR]        # default DIR: bench/results

writes ``DIR/<YYYY-MM-DD>-<device-slug>.json``, ``.md`` and ``.png`` (device name, driver, torch,
triton and CUDA versions, the test summary line, the measured limits, every benchmark row and the
issue's targets marked pass/fail), plus ``...-tests.log`` with pytest's full output. JSON and
Markdown are rewritten after the tests and after every benchmark case, so a run cut short (the
device tool's 10-minute limit) still leaves what it measured; the PNG comes at the end.
On a time-limited machine split the work: ``--skip-tests`` for the benchmarks alone, ``--only OP``
for one op, ``--no-compile`` to skip the torch.compile / compiled-FlexAttention baselines,
``--skip-engine`` / ``--engine-only`` for the engine benchmarks (``bench.engine_gpu``, kept under the
JSON's ``engine`` key).

Without CUDA it stops with a clear message, unless ``--dry-run`` (``--device cpu``): tiny shapes, a
wall-clock timer and no tests by default, to exercise the reporting code on any machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import kernels, report

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results"
DEFAULT_PYTEST_ARGS = "tests -q -x -p no:cacheprovider"

_SUMMARY = re.compile(r"\b\d+ (passed|failed|error|errors|skipped)\b|no tests ran")


def pytest_summary(output: str) -> str:
    """pytest's closing line ('12 passed, 3 skipped in 4.5s'), without the '=' decoration."""
    for line in reversed(output.strip().splitlines()):
        if _SUMMARY.search(line):
            return line.strip().strip("=").strip()
    return "no summary line (see the log)"


def run_tests(pytest_args: str, log_path: Path, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "pytest", *shlex.split(pytest_args)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    print(f"$ {' '.join(command)}", flush=True)
    try:
        proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, returncode = proc.stdout + proc.stderr, proc.returncode
        summary = pytest_summary(proc.stdout)
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        returncode, summary = None, f"timed out after {timeout_s:.0f} s"
    log_path.write_text(output)
    result = {"command": "python -m pytest " + pytest_args, "summary": summary, "returncode": returncode,
              "seconds": time.perf_counter() - start, "log": log_path.name}
    print(f"tests: {summary}", flush=True)
    return result


class _SkipKernels(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: bench/results)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (= --dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, wall-clock timer, no tests unless --tests: checks the reporting code")
    parser.add_argument("--tests", action="store_true", help="run the tests in a dry run too")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--pytest-args", default=DEFAULT_PYTEST_ARGS, help=f"default: {DEFAULT_PYTEST_ARGS!r}")
    parser.add_argument("--tests-timeout", type=float, default=420.0, help="seconds before the test run is cut")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    parser.add_argument("--only", help="benchmark only ops whose name contains this")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine benchmarks (bench.engine_gpu)")
    parser.add_argument("--engine-only", action="store_true", help="the engine benchmarks alone")
    parser.add_argument("--engine", action="store_true", help="run the engine benchmarks in a dry run too")
    args = parser.parse_args(argv)

    dry_run = args.dry_run or args.device == "cpu"
    device = torch.device("cpu" if dry_run else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_suite: CUDA is not available here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}). Run it on a GPU machine, or pass "
              "--dry-run to exercise the reporting code on CPU.", file=sys.stderr)
        return 2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = report.environment(device)
    stem = report.report_stem(env)
    result = {
        "schema": 1,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": dry_run,
        "environment": env,
        "tests": None,
        "peaks": None,
        "rows": [],
        "targets": [],
        "errors": [],
    }
    print(f"device: {env['device_name']} | driver {env.get('driver')} | torch {env['torch']} | "
          f"triton {env['triton']} | CUDA {env['cuda']}", flush=True)

    if not args.skip_tests and (not dry_run or args.tests):
        result["tests"] = run_tests(args.pytest_args, out_dir / f"{stem}-tests.log", args.tests_timeout)
        report.write_report(out_dir, result, stem=stem, png=False)

    def save_partial(partial: dict) -> None:  # a run cut short keeps every case measured so far
        result.update(partial)
        report.write_report(out_dir, result, stem=stem, png=False)

    try:
        if args.engine_only:
            raise _SkipKernels
        bench = kernels.run_suite(device, tiny=dry_run, compile=not args.no_compile, only=args.only,
                                  log=lambda line: print(line, flush=True), on_progress=save_partial)
        result.update(bench)
    except _SkipKernels:
        pass
    except Exception as e:  # still write what we have
        result["errors"].append(f"kernel benchmarks: {type(e).__name__}: {e}")
        print(f"kernel benchmarks failed: {type(e).__name__}: {e}", file=sys.stderr)

    if not args.skip_engine and (not dry_run or args.engine or args.engine_only):
        from bench import engine_gpu

        try:
            copy_gbps = (result.get("peaks") or {}).get("copy_gbps")
            result["engine"] = engine_gpu.run(device, tiny=dry_run, models=["qwen3-0.6b", "smollm2"],
                                              copy_gbps=copy_gbps, log=lambda line: print(line, flush=True))
            result["engine_targets"] = result["engine"]["targets"]
        except Exception as e:
            result["errors"].append(f"engine benchmarks: {type(e).__name__}: {e}")
            print(f"engine benchmarks failed: {type(e).__name__}: {e}", file=sys.stderr)
        report.write_report(out_dir, result, stem=stem, png=False)

    print()
    print(kernels.format_table(result["rows"]))
    print(kernels.format_targets(result["targets"]))
    paths = report.write_report(out_dir, result, stem=stem)
    print("wrote " + ", ".join(str(p) for p in paths))
    tests_failed = result["tests"] is not None and result["tests"]["returncode"] not in (0, None)
    return 1 if result["errors"] or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
