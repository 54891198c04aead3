"""The GPU suite in phases that each fit one 10-minute command on a lent GPU (bench/README.md):

    PYTHONPATH=. python -m bench.gpu_suite --phase 1 --out $OUT          # the headline numbers, < 8 minutes
    PYTHONPATH=. python -m bench.gpu_suite --phase kernels --out $OUT    # ... or any phase by number or name

1. headline (450 s): measured limits; the three kernel targets (paged decode vs copy BW, prefill vs
   SDPA-flash, fused add-RMSNorm vs copy BW); the Qwen3-0.6B-shape engine throughput and step profile (nano-vllm protocol;
   it leaves the tests 100 s); tests/pagedkernels on CUDA (not the slow AOT compile; cut at 150 s);
   transformers on the same requests if 150 s are left (else phase 3 gives the ratio).
2. kernels (540 s): the whole kernel matrix with every baseline (torch.compile, compiled FlexAttention), multi-LoRA
   (shrink + expand on Llama-3-8B's q/k/v at 1, 64 and 1024 tokens over 4 adapters and the base) against the
   per-adapter loop included.
3. engine (540 s): Qwen3-0.6B shape: engine throughput and transformers in the same run, batch-1 decode vs
   the bandwidth floor (with the few-row layers of pagedkernels.skinny_gemm, then with cuBLAS on the same engine),
   decode-step time at batch 64 / 256.
4. llama (540 s): Llama-3-8B shape: engine throughput, batch-1 decode, decode-step time at batch 64 / 256.
5. kernel-tests (540 s): tests/pagedkernels on CUDA, all of it.
6. engine-tests (540 s): the engine tests that run on CUDA (compiled forward, CUDA graphs, NCCL, dummy weights;
   speculative decoding, quantized checkpoints, the fp8 KV cache and MoE models against their references on the GPU).
7. other-tests (540 s): every other test module, on the GPU machine (``--shard K/N`` splits it).
8. quant (300 s): the W4A16 and FP8 GEMMs against the 16-bit GEMM at decode and prefill shapes, fp8-KV decode
   against 16-bit-KV decode, the few-row GEMM (pagedkernels.skinny_gemm) against cuBLAS at batch-1 projections.
9. tune (360 s): the prefill kernel's launch configurations on the target shape against SDPA-flash (which tiles
   launch_config should pick on this GPU), the decode kernel's split counts and its tile / stages / warps at the
   headline shape (DECODE_LAUNCH_SWEEP: the H200's 0.879 of copy bandwidth there), and the few-row GEMM's launch
   configurations at batch-1 projections against cuBLAS (what skinny_gemm_config should pick); fused_moe's launches
   at decode and prefill (MOE_LAUNCH_SWEEP: tiles, the aligned layout, the matrix-vector launches with and without
   PDL).
10. async (540 s): the sampler's draw kernel (pagedkernels.sample_from_logits) against the same draw in tensor ops
   at 256 and 8 rows of Qwen3's vocabulary; the sampler's top-k/top-p draw among candidates, and the kernel's own
   (its threshold search), against the full sort; the Qwen3-0.6B-shape throughput and step profile with async
   scheduling (and batch-1 decode) and without it, side by side, each throughput once more with the sampler's draw
   the other way (ENGINE_FUSED_SAMPLER); then host syncs per step kind under torch.cuda.set_sync_debug_mode
   (bench/sync_audit.py).
11. moe (540 s): the mixture-of-experts layer (pagedkernels.fused_moe) at Qwen3-30B-A3B's shape, 1 / 16 / 64 tokens
   against copy bandwidth (the routed experts' weights) and 4096 against the bf16 matmul rate, Mixtral-8x7B's at 1
   and 4096, each against the per-expert loop; then the engine on a Qwen3-30B-A3B-shaped dummy model (61 GB of
   bf16), nano-vllm's protocol and batch-1 decode, its output tok/s beside phase 1's dense Qwen3-0.6B figure; the
   batch-1 variants, fused_moe's matrix-vector launches (with and without PDL) among them.
12. lora (540 s): the LoRA kernels (add_lora, against the shrink and the expand called apart, at Llama-3-8B's q/k/v
   and at each LoRA layer of a Qwen3-0.6B decode step of 128 rows, in CUDA graphs up to 256 tokens), then
   multi-LoRA serving (bench.lora_engine_gpu): the Qwen3-0.6B shape with four adapters of ranks 8 / 16 mixed in
   one workload, against the base model alone and against transformers + PEFT serving the same mix, each engine's
   steps profiled.
13. batch1 (540 s): the few-row decoder layers (pagedkernels.skinny_gemm, rotary_embedding_and_cache) in one call:
   skinny_gemm's launch configurations against cuBLAS at batch-1 projections and its heuristic at 2-8 rows (timed
   as chains of calls on copies of the weights in CUDA graphs), then batch-1 decode at the Qwen3-0.6B and
   Llama-3-8B shapes with the few-row layers (the CUDA default), with cuBLAS, with programmatic dependent launch,
   with the decode op's splits merged in its split kernel (alone and with PDL), with the rotary embedding and cache
   write in that kernel too, with the final norm inside the LM head's few-row product (each alone, then all of them
   with PDL), and with skinny_gemm's deep launches (alone and with PDL) on the same engine, kernels a
   step counted (the sweep times skinny_gemm against cuBLAS at the two LM heads too); then the few-row, PDL and
   fused decode tests on CUDA.
14. spec (300 s): n-gram speculative decoding against plain decoding, single stream, on SmolLM2-135M in bf16 (real
   weights: bring its GGUF with the two calls scripts/gpu_carry_model.sh prints), grounded and free workloads
   (bench.spec_decode_cpu's): speedup, acceptance, identical greedy outputs, verification eager, in graphs, and in
   graphs with the few-row layers at its k + 1 rows; then the speculative decoding tests on CUDA; then the model as
   its own draft (k = 3), proposal and verification steps eager and in graphs.

15. decide (540 s): what decides the CUDA defaults still off, in one call for a short lease: the sampler's draw
   kernel; the Qwen3-0.6B-shape throughput with the sampler's draw both ways and its step profile (GPU busy); batch-1
   decode at the Qwen3-0.6B and Llama-3-8B shapes with every fused variant (the fused merge, the fused rope, the
   folded LM head, PDL, all of them, skinny_gemm's deep launches) against the default and cuBLAS, kernels a step
   counted.

``--phase all`` (the default) runs them one after another. Each phase writes
``OUT/<date>-<device>-phase<N>-<name>.json`` and ``.md`` after every case (``.png`` at the end, when matplotlib
is there) and ``...-<tests>.log`` per pytest run, so a phase cut short keeps what it measured. A phase checks
its budget before each step and stops cleanly before the budget ends (a SIGALRM backstop cuts a step that
overruns). Nothing is installed or downloaded: the engine's models are config.json files loaded with
``load_format="dummy"`` and ``skip_tokenizer_init=True``, the workloads are token ids. Test modules that import
a package this machine lacks (hypothesis, ...) are not run, and the report names them.

``--dry-run`` runs a phase's code on CPU with tiny shapes and a wall-clock timer, and collects its tests
(``--collect-only``) instead of running them: scripts/test_bench_tools.sh runs every phase so (bench/test_gpu_suite_dry_run.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench import kernels, report
from bench.budget import Budget, BudgetExceeded, deferred_stop

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results"
# A module that fails to import must not stop the others (pytest stops at collection errors by default).
PYTEST_OPTIONS = ["-q", "-rfE", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
KERNEL_TESTS = ["tests/pagedkernels"]
# The engine tests that run something on CUDA when it is there (device-parametrized or CUDA-only).
CUDA_ENGINE_TESTS = ["tests/engine/test_cuda_engine.py", "tests/engine/test_cuda_features.py",
                     "tests/engine/test_cuda_graph_runner.py",
                     "tests/engine/test_distributed.py", "tests/engine/test_model_runner.py",
                     "tests/engine/test_dummy_load.py", "tests/engine/test_config.py",
                     "tests/engine/test_lora_engine.py"]
OTHER_TESTS = ["tests", "bench", *(f"--ignore={p}" for p in KERNEL_TESTS + CUDA_ENGINE_TESTS)]
_LOCAL_PACKAGES = {"tests", "engine", "pagedkernels", "bench"}
# The headline phase's kernel tests: at most this long, and the engine before them leaves them at least the
# reserve; transformers (after them) runs only with this much left.
# The batch1 phase's closing tests: the few-row layers against cuBLAS's and programmatic dependent launch's bits on
# CUDA (the engine and the kernels), in what the 8B engine leaves of the budget, at least this.
BATCH1_TESTS = ["tests/pagedkernels/test_pdl.py", "tests/pagedkernels/test_decode_attention.py",
                "tests/pagedkernels/test_rotary_cache_decode.py", "tests/engine/test_cuda_features.py", "-k",
                "pdl or programmatic or few_row or split_counters or fused_decode or cuda_graph_capture "
                "or rotary_and_cache_then_decode or float8_cache or one_launch"]
BATCH1_TESTS_RESERVE_S = 90.0
SPEC_TESTS = ["tests/engine/test_cuda_features.py", "-k", "speculative or self_draft"]
HEADLINE_TESTS_CAP_S = 150.0
HEADLINE_TESTS_RESERVE_S = 100.0
HEADLINE_TRANSFORMERS_S = 150.0

_SUMMARY = re.compile(r"\b\d+ (passed|failed|error|errors|skipped)\b|no tests ran|\b\d+ tests? collected\b")


def pytest_summary(output: str) -> str:
    """pytest's closing line ('12 passed, 3 skipped in 4.5s'), without the '=' decoration."""
    for line in reversed(output.strip().splitlines()):
        if _SUMMARY.search(line):
            return line.strip().strip("=").strip()
    return "no summary line (see the log)"


def test_files(args: list[str]) -> list[Path]:
    """The test modules the paths of ``args`` name (directories expanded, ``--ignore=`` applied), sorted."""
    ignored = [str(REPO_ROOT / a.split("=", 1)[1]) for a in args if a.startswith("--ignore=")]
    files = []
    for path in (REPO_ROOT / a for a in args if not a.startswith("-")):
        files += [path] if path.is_file() else sorted(path.rglob("test_*.py"))
    return [f for f in files if not any(str(f).startswith(i) for i in ignored)]


def shard(args: list[str], index: int, count: int) -> list[str]:
    """``args`` with its paths replaced by every ``count``-th of their test modules from the ``index``-th
    (1-based): a test phase too long for one call runs as ``--shard 1/N`` ... ``--shard N/N``."""
    files = test_files(args)[index - 1::count]
    options = [a for a in args if a.startswith("-") and not a.startswith("--ignore=")]
    return [str(f.relative_to(REPO_ROOT)) for f in files] + options


def missing_imports(args: list[str]) -> dict[str, str]:
    """Test modules under the paths of ``args`` that import, at module level, a package this machine lacks:
    {module path: package}. They cannot be collected; the suite leaves them out and says why."""
    found: dict[str, str] = {}
    for file in test_files(args):
        for node in ast.parse(file.read_text(), str(file)).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in {n.split(".")[0] for n in names if n} - _LOCAL_PACKAGES:
                if not _importable(top):
                    found.setdefault(str(file.relative_to(REPO_ROOT)), top)
    return found


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_tests(args: list[str], log_path: Path, timeout_s: float | None, *, collect_only: bool = False) -> dict:
    """``python -m pytest ARGS`` in a process group of its own, output to ``log_path`` as it comes. Past
    ``timeout_s`` it gets SIGINT (pytest then prints what ran and its summary line), SIGKILL 30 s later."""
    skipped = missing_imports(args)
    command = [sys.executable, "-m", "pytest", *args, *PYTEST_OPTIONS, *(f"--ignore={p}" for p in skipped)]
    if collect_only:
        command.append("--collect-only")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")  # no network on a lent GPU: fail fast rather than wait on timeouts
    print(f"$ {shlex.join(command[1:])}" + (f"  (cut at {timeout_s:.0f} s)" if timeout_s else ""), flush=True)
    start = time.perf_counter()
    cut = False
    with open(log_path, "w") as log:
        # SIGINT back to its default in the child: the cut relies on it, and a suite started in the background
        # by a shell without job control (`... &` in a script, nohup) has it ignored, which pytest would inherit.
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_default_sigint)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            cut = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            if proc.poll() is None:  # BudgetExceeded (or Ctrl-C) while waiting: leave nothing running
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = log_path.read_text(errors="replace")
    summary = pytest_summary(output)
    if cut:
        summary = f"cut at {timeout_s:.0f} s: {summary}"
    failed = [line.strip() for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    result = {"command": "python -m pytest " + shlex.join(command[3:]), "summary": summary,
              "returncode": proc.returncode, "cut": cut, "seconds": time.perf_counter() - start,
              "log": log_path.name, "failed": failed[:50],
              "not_run": {path: f"needs {name}, not installed here" for path, name in skipped.items()}}
    print(f"tests: {summary}", flush=True)
    return result


def tests_failed(run: dict) -> bool:
    """A failing test or a collection error; a run cut at its time limit is not a failure (its summary says
    how far it got)."""
    return not run["cut"] and run["returncode"] not in (0, 5)


# ------------------------------------------------------------------------------------------------
# phases
# ------------------------------------------------------------------------------------------------


@dataclass
class Phase:
    number: int
    name: str
    budget_s: float
    run: Callable[["PhaseRun"], None]


class PhaseRun:
    """One phase: its budget, its result dict (the report) and the steps that fill it."""

    def __init__(self, phase: Phase, args: argparse.Namespace, device: torch.device, out_dir: Path):
        self.phase, self.args, self.device, self.out_dir = phase, args, device, out_dir
        self.dry_run = device.type == "cpu"
        self.budget = Budget(args.budget or phase.budget_s)
        env = report.environment(device)
        self.stem = f"{report.report_stem(env)}-phase{phase.number}-{phase.name}" + (
            f"-shard{args.shard[0]}of{args.shard[1]}" if args.shard else "")
        self.result = {
            "schema": 2,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": self.dry_run, "phase": phase.number, "phase_name": phase.name,
            "budget_s": self.budget.seconds, "environment": env,
            "tests": [], "peaks": None, "rows": [], "targets": [], "not_run": [], "cut": [], "errors": [], "notes": [],
        }

    def save(self, png: bool = False) -> list[Path]:
        self.result["seconds"] = self.budget.elapsed()
        with deferred_stop():   # a hard stop waits for the files to be whole
            return report.write_report(self.out_dir, self.result, stem=self.stem, png=png)

    def step(self, name: str, fn: Callable[[], None]) -> bool:
        """Run one step; an error is recorded and the phase goes on. Returns False when the budget ran out
        inside it (the phase then ends)."""
        try:
            fn()
            return True
        except BudgetExceeded:
            self.result["cut"].append(f"{name}: the phase's budget ran out inside it")
            print(f"{name}: cut, the budget of {self.budget.seconds:.0f} s ran out", file=sys.stderr, flush=True)
            return False
        except Exception as e:  # still write what we have, and go on to the next step
            self.result["errors"].append(f"{name}: {type(e).__name__}: {e}")
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return True
        finally:
            self.save()

    # -- the steps --------------------------------------------------------------------------------

    def peaks(self) -> None:
        timer = kernels.wall_timer if self.dry_run else kernels.cuda_timer
        self.result["peaks"] = dataclasses.asdict(kernels.measure_peaks(self.device, timer, tiny=self.dry_run))
        print(kernels.format_peaks(self.result["peaks"]), flush=True)

    def kernels(self, *, headline: bool, baselines: set[str] | None = None, compile: bool = True,
                case_s: float = 60.0, quant: bool = False, tune: bool = False, moe: bool = False,
                only: str | None = None) -> None:
        def progress(partial: dict) -> None:  # a run cut short keeps every case measured so far
            self.result.update(rows=partial["rows"], targets=partial["targets"],
                               kernel_cases_not_run=partial["not_run"])
            self.save()

        peaks = kernels.Peaks(**self.result["peaks"])
        partial = kernels.run_suite(self.device, tiny=self.dry_run, compile=compile and not self.args.no_compile,
                                    only=only or self.args.only, log=lambda line: print(line, flush=True),
                                    on_progress=progress, headline=headline, baselines=baselines,
                                    budget=self.budget, case_s=case_s, peaks=peaks, quant=quant, tune=tune,
                                    moe=moe)
        progress(partial)

    def tests(self, label: str, args: list[str], cap_s: float | None = None, reserve_s: float = 10.0) -> None:
        """One pytest run, cut at ``cap_s`` or where the budget (less ``reserve_s``) ends, whichever first."""
        if self.args.pytest_args:
            args = shlex.split(self.args.pytest_args)
        if self.args.shard:
            args = shard(args, *self.args.shard)
        timeout = min(cap_s or float("inf"), self.budget.remaining() - reserve_s)
        if timeout < 10:
            self.result["not_run"].append(f"{label}: {self.budget.remaining():.0f} s of the budget left")
            return
        log_path = self.out_dir / f"{self.stem}-{report.device_slug(label)}.log"
        run = run_tests(args, log_path, None if timeout == float("inf") else timeout, collect_only=self.dry_run)
        self.result["tests"].append({"label": label, **run})
        if tests_failed(run):
            self.result["errors"].append(f"{label}: {run['summary']}")

    def engine(self, models: list[str], parts: tuple[str, ...], transformers_min_s: float = 0.0,
               reserve_s: float = 0.0, async_scheduling: bool | None = None, key: str = "engine") -> None:
        """bench.engine_gpu's ``parts`` (added to this phase's earlier engine results under ``key``), within the
        budget less ``reserve_s`` seconds kept for the steps after it."""
        from bench import engine_gpu

        def progress(partial: dict) -> None:
            self.result[key] = partial
            self.result[f"{key}_targets"] = partial["targets"]
            self.save()

        peaks = self.result.get("peaks") or {}
        budget = Budget(max(1.0, self.budget.remaining() - reserve_s)) if reserve_s else self.budget
        engine_gpu.run(self.device, tiny=self.dry_run, models=models, parts=parts,
                       copy_gbps=peaks.get("copy_gbps"), budget=budget, transformers_min_s=transformers_min_s,
                       on_progress=progress, log=lambda line: print(line, flush=True),
                       results=self.result.get(key), async_scheduling=async_scheduling)

    def lora_engine(self) -> None:
        from bench import lora_engine_gpu

        def progress(partial: dict) -> None:
            self.result["lora_engine"] = partial
            self.result["lora_engine_targets"] = partial["targets"]
            self.save()

        lora_engine_gpu.run(self.device, tiny=self.dry_run, budget=self.budget,
                            log=lambda line: print(line, flush=True), on_progress=progress,
                            results=self.result.get("lora_engine"))

    def spec_decode(self) -> None:
        """n-gram speculative decoding against plain decoding, single stream, on the default model (SmolLM2-135M:
        real weights, which a grounded workload needs; converted from its GGUF, which scripts/gpu_carry_model.sh
        brings to the GPU machine in two calls) in bf16 on CUDA: bench.spec_decode_cpu's workloads."""
        from bench import spec_decode_cpu
        from engine import default_model

        if not default_model.is_converted() and not os.path.isfile(default_model.gguf_path()):
            raise FileNotFoundError(
                f"the default model is not on this machine ({default_model.gguf_path()}): bring its GGUF "
                f"(scripts/gpu_carry_model.sh prints the two calls that do)")
        model = default_model.default_model_path()   # converts the GGUF once (transformers, gguf)
        report = spec_decode_cpu.measure(model, device=str(self.device),
                                         dtype="float32" if self.dry_run else "bfloat16",
                                         max_tokens=16 if self.dry_run else 160, repeats=1 if self.dry_run else 2,
                                         verify_graphs=True, few_row_verify=True,
                                         log=lambda line: print(line, flush=True))
        self.result["spec_decode"] = report
        self._spec_targets(report)

    def spec_decode_draft(self) -> None:
        """Draft-model speculative decoding on the same model, its own draft (every draft accepted: what matters here
        is what a proposal's k steps cost), proposal and verification steps eager and in graphs: bench.spec_decode_cpu
        with a draft model."""
        from bench import spec_decode_cpu
        from engine import default_model

        model = default_model.default_model_path()
        self.result["spec_decode_draft"] = spec_decode_cpu.measure(
            model, device=str(self.device), dtype="float32" if self.dry_run else "bfloat16",
            max_tokens=16 if self.dry_run else 160, repeats=1, verify_graphs=True, draft_model=model,
            num_speculative_tokens=3, log=lambda line: print(line, flush=True))

    def _spec_targets(self, report: dict) -> None:
        grounded = report["workloads"]["grounded"]
        ways = {"verification eager": grounded["speedup"],
                "verification in graphs": grounded.get("graphs_speedup") or 0.0,
                "verification in graphs, few-row layers": grounded.get("few_rows_graphs_speedup") or 0.0}
        best = max(ways.values())
        self.result["spec_decode_targets"] = [
            {"target": ">= 2x single stream, grounded workload (n-gram speculative decoding)",
             "value": best, "threshold": 2.0, "status": "pass" if best >= 2.0 else "fail",
             "note": next(way for way, value in ways.items() if value == best)},
            {"target": "greedy outputs identical with and without speculative decoding",
             "value": float(all(w["identical_outputs"] for w in report["workloads"].values())), "threshold": 1.0,
             "status": "pass" if all(w["identical_outputs"] for w in report["workloads"].values()) else "fail",
             "note": ("bf16: verification's batched forward may round a near-tie apart (same_leading_tokens)"
                      if report["dtype"] == "bfloat16" else "")}]

    def sync_audit(self) -> None:
        from bench import sync_audit

        self.result["sync_audit"] = {}
        sync_audit.run(self.device, tiny=self.dry_run, log=lambda line: print(line, flush=True),
                       results=self.result["sync_audit"], on_progress=self.save)


def _headline(run: PhaseRun) -> None:
    # The engine before the tests: its start-up (torch.compile, graph capture) is the longest unknown, and its
    # throughput is the key number; it keeps HEADLINE_TESTS_RESERVE_S for the tests, which transformers follows
    # only if there is time left.
    run.step("limits", run.peaks) \
        and run.step("kernel targets", lambda: run.kernels(headline=True, baselines={"sdpa-flash", "torch eager"},
                                                           compile=False)) \
        and run.step("engine throughput", lambda: run.engine(["qwen3-0.6b"], ("throughput", "profile"),
                                                             reserve_s=HEADLINE_TESTS_RESERVE_S)) \
        and run.step("kernel tests", lambda: run.tests("kernel tests", [*KERNEL_TESTS, "-m", "not slow"],
                                                       cap_s=HEADLINE_TESTS_CAP_S)) \
        and run.step("transformers", lambda: run.engine(["qwen3-0.6b"], ("transformers",),
                                                        transformers_min_s=HEADLINE_TRANSFORMERS_S))


def _kernels(run: PhaseRun) -> None:
    run.step("limits", run.peaks) and run.step("kernel matrix", lambda: run.kernels(headline=False, case_s=75.0))


def _quant(run: PhaseRun) -> None:
    run.step("limits", run.peaks) and run.step("quantized ops", lambda: run.kernels(headline=False, quant=True))


def _tune(run: PhaseRun) -> None:
    run.step("limits", run.peaks) and run.step("launch configurations", lambda: run.kernels(headline=False, tune=True,
                                                                                     case_s=20.0))


def _moe(run: PhaseRun) -> None:
    run.step("limits", run.peaks) \
        and run.step("MoE layers", lambda: run.kernels(headline=False, moe=True, case_s=45.0)) \
        and run.step("MoE engine", lambda: run.engine(["qwen3-30b-a3b"], ("throughput", "batch1")))


def _engine(run: PhaseRun) -> None:
    run.step("limits", run.peaks) and run.step("engine", lambda: run.engine(
        ["qwen3-0.6b"], ("throughput", "profile", "batch1", "decode_steps", "transformers")))


def _llama(run: PhaseRun) -> None:
    run.step("limits", run.peaks) and run.step("engine", lambda: run.engine(
        ["llama-3-8b"], ("throughput", "profile", "batch1", "decode_steps")))


def _async(run: PhaseRun) -> None:
    # The engine's default (async scheduling on CUDA) first, with batch-1 decode on the same engine: the key numbers
    # of a short lease; then the same workload without async scheduling; the sync audit (one engine per step kind,
    # saved after each) last, since it is the longest and its kinds are independent of each other. The sampler's
    # draw kernel before them (seconds): the engine's throughput runs once more with the draw the other way.
    run.step("limits", run.peaks) \
        and run.step("the sampler's draw kernel", lambda: run.kernels(headline=False, case_s=20.0,
                                                                      only="sample_from_logits,sampler top-k")) \
        and run.step("engine with async scheduling", lambda: run.engine(
            ["qwen3-0.6b"], ("throughput", "profile", "batch1"), async_scheduling=True,
            reserve_s=run.budget.remaining() * 0.6)) \
        and run.step("engine without async scheduling", lambda: run.engine(
            ["qwen3-0.6b"], ("throughput", "profile"), async_scheduling=False, key="engine_sync",
            reserve_s=run.budget.remaining() * 0.45)) \
        and run.step("sync audit", run.sync_audit)


def _batch1(run: PhaseRun) -> None:
    # The few-row layers' whole question in one call: skinny_gemm's launch configurations against cuBLAS, then
    # batch-1 decode with the few-row layers and with cuBLAS on one engine at each shape (the 0.6B one leaving the 8B
    # one 45% of what is left).
    run.step("limits", run.peaks) \
        and run.step("skinny_gemm configurations", lambda: run.kernels(headline=False, tune=True, case_s=10.0,
                                                                       only="skinny_gemm configs")) \
        and run.step("batch-1 decode, Qwen3-0.6B shape", lambda: run.engine(
            ["qwen3-0.6b"], ("batch1", "batch1_profile"), reserve_s=run.budget.remaining() * 0.45)) \
        and run.step("batch-1 decode, Llama-3-8B shape", lambda: run.engine(
            ["llama-3-8b"], ("batch1", "batch1_profile"), reserve_s=BATCH1_TESTS_RESERVE_S)) \
        and run.step("few-row, PDL and fused decode tests",
                     lambda: run.tests("few-row, PDL and fused decode tests", BATCH1_TESTS))


def _spec(run: PhaseRun) -> None:
    # The n-gram measurement first (its model may be missing: then the tests still run), then the speculative
    # decoding tests on CUDA, then the draft-model measurement (the budget may cut it, not the tests).
    run.step("n-gram speculative decoding, single stream", run.spec_decode) \
        and run.step("speculative decoding tests", lambda: run.tests("speculative decoding tests", SPEC_TESTS)) \
        and run.step("draft-model speculative decoding, proposals eager and in graphs", run.spec_decode_draft)


def _lora(run: PhaseRun) -> None:
    # The kernels first (seconds, timed in CUDA graphs up to 256 tokens: what a decode step's adapters cost the GPU),
    # then the engine sides, each with its step profile.
    run.step("limits", run.peaks) \
        and run.step("LoRA kernels", lambda: run.kernels(headline=False, case_s=10.0, only="lora")) \
        and run.step("multi-LoRA engine", run.lora_engine)


def _decide(run: PhaseRun) -> None:
    # The measurements that decide the CUDA defaults still off (each a setting built and tested on CPU, waiting for a
    # GPU), in one call: the sampler's draw kernel, the Qwen3-0.6B shape's throughput with the draw both ways and its
    # step profile (GPU busy), then batch-1 decode with every fused variant at the Qwen3-0.6B and Llama-3-8B shapes
    # (the 8B one left 45% of what remains). No sweep and no tests: phases 13 and 10 have them.
    run.step("limits", run.peaks) \
        and run.step("the sampler's draw kernel", lambda: run.kernels(headline=False, case_s=15.0,
                                                                      only="sample_from_logits,sampler top-k")) \
        and run.step("throughput and step profile, Qwen3-0.6B shape", lambda: run.engine(
            ["qwen3-0.6b"], ("throughput", "profile"), reserve_s=run.budget.remaining() * 0.6)) \
        and run.step("batch-1 decode, Qwen3-0.6B shape", lambda: run.engine(
            ["qwen3-0.6b"], ("batch1", "batch1_profile"), reserve_s=run.budget.remaining() * 0.45)) \
        and run.step("batch-1 decode, Llama-3-8B shape", lambda: run.engine(["llama-3-8b"], ("batch1",)))


def _test_phase(label: str, args: list[str]) -> Callable[[PhaseRun], None]:
    return lambda run: run.step(label, lambda: run.tests(label, args))


PHASES = [
    Phase(1, "headline", 450.0, _headline),
    Phase(2, "kernels", 540.0, _kernels),
    Phase(3, "engine", 540.0, _engine),
    Phase(4, "llama", 540.0, _llama),
    Phase(5, "kernel-tests", 540.0, _test_phase("kernel tests", KERNEL_TESTS)),
    Phase(6, "engine-tests", 540.0, _test_phase("engine tests on CUDA", CUDA_ENGINE_TESTS)),
    Phase(7, "other-tests", 540.0, _test_phase("other tests", OTHER_TESTS)),
    Phase(8, "quant", 300.0, _quant),
    Phase(9, "tune", 360.0, _tune),
    Phase(10, "async", 540.0, _async),
    Phase(11, "moe", 540.0, _moe),
    Phase(12, "lora", 540.0, _lora),
    Phase(13, "batch1", 540.0, _batch1),
    Phase(14, "spec", 300.0, _spec),
    Phase(15, "decide", 540.0, _decide),
]


def _shard_arg(value: str) -> tuple[int, int]:
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"--shard must be K/N with 1 <= K <= N, got {value!r}")
    return int(k), int(n)


def select_phases(value: str) -> list[Phase]:
    if value == "all":
        return list(PHASES)
    for phase in PHASES:
        if value in (str(phase.number), phase.name):
            return [phase]
    raise ValueError(f"--phase must be all, 1-{len(PHASES)} or one of "
                     f"{', '.join(p.name for p in PHASES)}; got {value!r}")


def run_phase(phase: Phase, args: argparse.Namespace, device: torch.device, out_dir: Path) -> int:
    run = PhaseRun(phase, args, device, out_dir)
    env = run.result["environment"]
    print(f"== phase {phase.number} ({phase.name}), budget {run.budget.seconds:.0f} s | {env['device_name']} | "
          f"driver {env.get('driver')} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']}",
          flush=True)
    run.budget.hard_stop(margin=3.0)
    try:
        phase.run(run)
    finally:
        Budget.cancel_hard_stop()
    if run.result["rows"]:
        print(kernels.format_table(run.result["rows"]))
    if run.result["targets"]:
        print(kernels.format_targets(run.result["targets"]))
    for t in (run.result.get("engine_targets", []) + run.result.get("lora_engine_targets", [])
              + run.result.get("spec_decode_targets", [])):
        print(f"  [{t['status'].upper():4}] {t['target']}: {kernels._fmt(t['value'], '.3f')} {t['note']}".rstrip())
    paths = run.save(png=True)
    print(f"phase {phase.number} done in {run.budget.elapsed():.0f} s; wrote " + ", ".join(str(p) for p in paths),
          flush=True)
    return 1 if run.result["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", default="all", help="all (default), a number 1-14 or a name (see the module doc)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: bench/results)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (= --dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, wall-clock timer, tests collected only: checks the code paths")
    parser.add_argument("--budget", type=float, default=None, help="seconds per phase (default: the phase's own)")
    parser.add_argument("--pytest-args", default=None, help="replace the test selection of the phase's pytest runs")
    parser.add_argument("--shard", type=_shard_arg, default=None, metavar="K/N",
                        help="tests: run the K-th of N interleaved parts of the phase's test modules")
    parser.add_argument("--no-compile", action="store_true", help="kernels: skip the torch.compile baselines")
    parser.add_argument("--only", help="kernels: only ops whose name contains this")
    args = parser.parse_args(argv)
    try:
        phases = select_phases(args.phase)
    except ValueError as e:
        parser.error(str(e))
    dry_run = args.dry_run or args.device == "cpu"
    device = torch.device("cpu" if dry_run else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_suite: CUDA is not available here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}). Run it on a GPU machine, or pass "
              "--dry-run to exercise the suite's code on CPU.", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = 0
    for phase in phases:
        rc = max(rc, run_phase(phase, args, device, out_dir))
        kernels._free(device)  # the next phase (its engine's memory check) starts on a device left as found
    return rc


if __name__ == "__main__":
    sys.exit(main())
