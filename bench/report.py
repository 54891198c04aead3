"""Benchmark reports: ``<out>/<YYYY-MM-DD>-<device-slug>[-phase<N>-<name>].json``, ``.md`` and ``.png``.

The JSON holds everything (environment, test summaries, measured limits, rows, targets, engine results, what
was left out or cut); the Markdown is the same for a person; the PNG plots each op's fraction of the measured
limit next to its best baseline. matplotlib is imported only here, lazily: without it the PNG is skipped and
the report's notes say so. Schema 1 (one suite run, ``tests`` a single dict) and 2 (one phase of
bench.gpu_suite, ``tests`` a list of pytest runs) are both read.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from bench.kernels import COLUMNS, format_peaks, table_cells


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device | str) -> dict:
    """Device name, driver and library versions: what a result row needs to be compared."""
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, driver=_driver_version(),
                   memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}")
    else:
        env.update(device_name=platform.processor() or platform.machine() or "cpu", driver=None)
    return env


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def write_cpu_report(out_dir: str | os.PathLike, kind: str, report: dict, *, model: str | None = None) -> Path:
    """Write a CPU benchmark's ``<date>-<kind>[-<model>]-<cpu>.json`` into ``out_dir`` (created) and
    return its path (bench.engine_cpu, bench.tp_cpu)."""
    from pagedkernels import _native

    parts = [datetime.date.today().isoformat(), kind] + ([device_slug(model)] if model else [])
    path = Path(out_dir) / ("-".join(parts + [device_slug(_native.cpu_name())]) + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def report_stem(env: dict, date: datetime.date | None = None) -> str:
    date = date or datetime.datetime.now(datetime.timezone.utc).date()
    slug = device_slug(env["device_name"])
    if env["device_type"] == "cpu":
        slug = f"cpu-dry-run-{slug}"
    return f"{date.isoformat()}-{slug}"


def write_report(out_dir: str | os.PathLike, result: dict, *, stem: str | None = None, png: bool = True) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (with matplotlib, unless ``png=False``) ``<stem>.png``;
    returns the paths. A PNG that cannot be drawn adds its reason to ``result["notes"]``.

    result: {"environment", "tests", "peaks", "rows", "targets", ...} as built by bench.gpu_suite.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or report_stem(result["environment"])
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    png_path = out_dir / f"{stem}.png"
    drawn = False
    if png:
        drawn, why = plot(result, png_path)
        if why and why not in result.setdefault("notes", []):
            result["notes"].append(why)
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    return paths + ([png_path] if drawn else [])


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])


def markdown(result: dict) -> str:
    env = result["environment"]
    phase = f" (phase {result['phase']}: {result['phase_name']})" if result.get("phase") else ""
    lines = [f"# pagedkernels benchmarks: {env['device_name']}{phase}", ""]
    if result.get("dry_run"):
        lines += ["**Dry run on CPU** (tiny shapes, wall-clock timer): exercises the reporting code; "
                  "the numbers mean nothing.", ""]
    lines += [f"Date (UTC): {result.get('timestamp', '-')}"
              + (f"; {result['seconds']:.0f} s of a {result['budget_s']:.0f} s budget" if result.get("budget_s")
                 and "seconds" in result else ""), ""]
    keys = ["device_name", "driver", "compute_capability", "memory_gib", "multiprocessors", "torch", "triton", "cuda",
            "python", "cpu_count"]
    lines += [_md_table(["field", "value"], [[k, env.get(k)] for k in keys if k in env]), ""]
    tests = result.get("tests")
    if tests:
        lines += ["## Tests", ""]
        for run in [tests] if isinstance(tests, dict) else tests:
            lines += [f"`{run.get('command')}` -> **{run.get('summary')}** "
                      f"(exit {run.get('returncode')}, {run.get('seconds', 0):.0f} s, log `{run.get('log')}`)", ""]
            lines += [f"- {line}" for line in run.get("failed", [])]
            lines += [f"- not run: `{path}` ({why})" for path, why in run.get("not_run", {}).items()]
            lines += [""] if run.get("failed") or run.get("not_run") else []
    if result.get("peaks"):
        lines += ["## Measured limits", "", format_peaks(result["peaks"]), ""]
    if result.get("targets"):
        lines += ["## Targets", "", _md_table(
            ["target", "op", "shape", "value", "need", "status"],
            [[t["target"], t["op"], t["shape"], "-" if t["value"] is None else f"{t['value']:.3f}",
              f">= {t['threshold']}", t["status"] + (f" ({t['note']})" if t["note"] else "")]
             for t in result["targets"]]), ""]
    if result.get("rows"):
        lines += ["## Kernels", "",
                  "ms: median of triton's do_bench (L2 flushed before each call); GB/s: bytes the op must move / "
                  "time; TFLOP/s: useful attention FLOPs / time; frac_of_peak: against the limit measured in "
                  "this run; ratio = baseline_ms / ms (above 1: pagedkernels is faster).", "",
                  _md_table(list(COLUMNS) + ["note"], [table_cells(r) + [r["note"]] for r in result["rows"]]), ""]
    if result.get("engine"):
        lines += engine_markdown(result["engine"])
    if result.get("engine_sync"):
        lines += ["## Without async scheduling", ""] + engine_markdown(result["engine_sync"])[1:]
    if result.get("lora_engine"):
        lines += lora_engine_markdown(result["lora_engine"])
    for key in ("spec_decode", "spec_decode_draft"):
        if (result.get(key) or {}).get("workloads"):
            lines += spec_decode_markdown(result[key])
    if (result.get("sync_audit") or {}).get("kinds"):
        lines += ["## Host syncs per step (torch.cuda sync debug mode)", "",
                  _md_table(["kind", "async scheduling", "steps", "syncs/step", "deliberate reads/step",
                             "speculative reads/step", "draft reads/step", "origins"],
                            [[k["kind"], str(k.get("async_scheduling", "-")), str(k.get("steps", "-")),
                              num(k.get("syncs_per_step"), ".2f"), num(k.get("deliberate_reads_per_step"), ".2f"),
                              num(k.get("speculative_reads_per_step"), ".2f"), num(k.get("draft_reads_per_step"), ".2f"),
                              k.get("not_run") or k.get("error") or json.dumps(k.get("origins"))]
                             for k in result["sync_audit"]["kinds"]]), ""]
    for key, title in (("not_run", "Not run (budget)"), ("kernel_cases_not_run", "Kernel cases not run (budget)"),
                       ("cut", "Cut at the budget"), ("notes", "Notes")):
        if result.get(key):
            lines += [f"## {title}", ""] + [f"- {item}" for item in result[key]] + [""]
    if result.get("errors"):
        lines += ["## Errors", "", "```", json.dumps(result["errors"], indent=1), "```", ""]
    return "\n".join(lines)


def spec_decode_markdown(spec: dict) -> list[str]:
    """bench.spec_decode_cpu's report as a section: n-gram or draft-model proposals (``proposer``) against plain."""
    kind = spec.get("proposer", "ngram")
    label = "n-gram" if kind == "ngram" else "draft model"
    return [f"## Speculative decoding, single stream, {label} ({spec['model']}, {spec['dtype']}, "
            f"{json.dumps(spec['speculative_config'])}, greedy, {spec['max_tokens']} tokens a request, "
            f"{spec['repeats']} rounds)", "",
            _md_table(["workload", "plain tok/s", f"{label} tok/s", "speedup", f"{label}, in graphs",
                       f"{label}, in graphs, few-row layers", "acceptance", "mean accepted length",
                       f"ms a step (plain / {label})", "identical outputs",
                       "same leading tokens / lengths"],
                      [[name, num(w["plain_tokens_per_s"], ".1f"), num(w[f"{kind}_tokens_per_s"], ".1f"),
                        num(w["speedup"], ".2f"),
                        (f"{num(w[f'{kind}_graphs_tokens_per_s'], '.1f')} tok/s, {num(w['graphs_speedup'], '.2f')}x"
                         if "graphs_speedup" in w else "-"),
                        (f"{num(w[f'{kind}_graphs_few_rows_tokens_per_s'], '.1f')} tok/s, "
                         f"{num(w['few_rows_graphs_speedup'], '.2f')}x" if "few_rows_graphs_speedup" in w else "-"),
                        num(w["acceptance_rate"], ".2f"),
                        num(w["mean_accepted_length"], ".2f"),
                        f"{num(w.get('plain_step_ms'), '.2f')} / {num(w.get(f'{kind}_step_ms'), '.2f')}",
                        str(w["identical_outputs"]),
                        f"{w['same_leading_tokens']} / {w['output_lengths']}"]
                       for name, w in spec["workloads"].items()]), ""] + _per_request_lines(spec)


def _per_request_lines(spec: dict) -> list[str]:
    """Where a request's time went on each side (bench.spec_decode_cpu's ``per_request_ms``), a table a workload."""
    rows = [[name, engine_name, num(t["first_token"], ".1f"), num(t["decode"], ".1f"), num(t["rest"], ".1f")]
            for name, w in spec["workloads"].items() for engine_name, t in w.get("per_request_ms", {}).items()]
    if not rows:
        return []
    return ["A request's time (ms, the mean over the rounds' requests):", "",
            _md_table(["workload", "engine", "to the first token", "decoding", "the call's rest"], rows), ""]


def num(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def engine_markdown(engine: dict) -> list[str]:
    """The engine benchmarks (bench.engine_gpu) as tables: throughput against transformers, batch-1 decode,
    decode-step time against its floor, the targets."""
    lines = ["## Engine", "", f"{engine.get('dtype')}, {engine.get('load_format', 'checkpoint')} weights; workload "
             f"{engine.get('workload')}; copy bandwidth {num(engine.get('copy_gbps'), '.1f')} GB/s", ""]
    rows = []
    for name, row in engine.get("models", {}).items():
        eng, hf = row.get("engine") or {}, row.get("transformers") or {}
        rows.append([name, num(eng.get("output_tokens_per_s")) + ("" if eng.get("complete", True) else " (cut)"),
                     hf.get("skipped") or (num(hf.get("output_tokens_per_s")) + (f" ({hf['api']})" if hf else "")
                                           + ("" if hf.get("complete", True) else " (cut)")),
                     num(row.get("throughput_ratio"), ".2f"),
                     num((row.get("batch1") or {}).get("decode_tokens_per_s"), ".1f"),
                     num((row.get("batch1") or {}).get("frac_of_copy_bandwidth"), ".3f"),
                     "; ".join(f"b{s['batch_size']}: " + (s["skipped"] if "skipped" in s else
                                                          f"{s['step_ms']:.2f} ms ({s['frac_of_floor']:.2f} of floor)")
                               for s in row.get("decode_steps", [])) or "-"])
    lines += [_md_table(["model", "engine out tok/s", "transformers out tok/s", "ratio", "batch-1 tok/s",
                         "batch-1 frac of copy BW", "decode step"], rows), ""]
    # The same requests with the sampler's draw the other way (bench.engine_gpu.throughput_sampler).
    sampler_rows = [[name, key[7:].replace("_", " "), num(v.get("output_tokens_per_s"))
                     + ("" if v.get("complete", True) else " (cut)"), num(v.get("fused_sampler_speedup"), ".3f")]
                    for name, row in engine.get("models", {}).items()
                    for key in ("engine_fused_sampler", "engine_unfused_sampler") if (v := row.get(key))]
    if sampler_rows:
        lines += [_md_table(["model", "variant", "engine out tok/s", "fused draw / tensor ops"], sampler_rows), ""]
    lines += _compiled_in_window_lines({f"{name}, {key}": run for name, row in engine.get("models", {}).items()
                                        for key, run in row.items() if isinstance(run, dict)})
    for name, row in engine.get("models", {}).items():
        for label, prof in ((name, row.get("profile")), (f"{name}, batch 1", (row.get("batch1") or {}).get("profile"))):
            if prof:
                lines += _profile_lines(label, prof)
    if engine.get("targets"):
        lines += [_md_table(["target", "value", "status"],
                            [[t["target"], num(t["value"], ".3f"), t["status"] + (f" ({t['note']})" if t.get("note")
                                                                                  else "")]
                             for t in engine["targets"]]), ""]
    return lines


def lora_engine_markdown(lora: dict) -> list[str]:
    """bench.lora_engine_gpu's sides and ratios as tables."""
    lines = ["## Multi-LoRA engine", "", f"{lora.get('model')} shape, {lora.get('dtype')}, {lora.get('load_format')} "
             f"weights; adapters {lora.get('adapters')}; workload {lora.get('workload')}", ""]
    lines += [_md_table(["side", "output tok/s", "seconds", "note"],
                        [[name, num(side.get("output_tokens_per_s")), num(side.get("seconds"), ".1f"),
                          side.get("skipped") or ("" if side.get("complete", True) else "cut at the budget")]
                         for name, side in lora.get("sides", {}).items()]), ""]
    if lora.get("targets"):
        lines += [_md_table(["target", "value", "status"],
                            [[t["target"], num(t["value"], ".3f"), t["status"]] for t in lora["targets"]]), ""]
    lines += _compiled_in_window_lines(lora.get("sides", {}))
    for name, side in lora.get("sides", {}).items():
        if side.get("profile"):
            lines += _profile_lines(name, side["profile"])
    return lines


def _compiled_in_window_lines(runs: dict) -> list[str]:
    """Which timed windows compiled pagedkernels kernel variants (bench.engine_gpu.engine_throughput's
    ``kernel_variants_compiled_in_window``; each compile, most of a second, was timed), or nothing."""
    found = [f"{name}: " + ", ".join(f"{kernel} x{n}" for kernel, n in sorted(compiled.items()))
             for name, run in runs.items() if (compiled := run.get("kernel_variants_compiled_in_window"))]
    if not found:
        return []
    return ["Kernel variants Triton compiled inside a timed window (the engine's start-up should have): "
            + "; ".join(found) + ".", ""]


def _profile_lines(name: str, prof: dict) -> list[str]:
    """bench.engine_gpu's step profile as markdown: the torch.profiler summary, top kernels and CPU ops, and the
    cProfile pass's Python functions."""
    lines = [f"Where a step's time goes ({name}, {prof['steps']} steps of the workload under torch.profiler): "
             f"{prof['step_ms']:.2f} ms a step, {prof['execute_model_ms']:.2f} ms of it in execute_model; "
             f"GPU kernels {prof['kernel_ms_per_step']:.2f} ms a step (busy "
             f"{num(prof.get('gpu_busy_fraction_under_cpu_profiler', prof['gpu_busy_fraction']), '.2f')})."
             + (f" The next {w['steps']} steps with the device's activity alone recorded: {w['step_ms']:.2f} ms a "
                f"step, GPU kernels {w['kernel_ms_per_step']:.2f} ms (busy {num(w['gpu_busy_fraction'], '.2f')})."
                if (w := prof.get("gpu_busy_window")) else ""), ""]
    lines += _compiled_in_window_lines({"the profiled steps": prof})
    if prof.get("top_kernels"):
        lines += [_md_table(["CUDA kernel", "ms a step", "calls"],
                            [[k["name"], f"{k['ms_per_step']:.3f}", str(k["calls"])] for k in prof["top_kernels"]]),
                  ""]
    lines += [_md_table(["CPU op", "self ms a step", "calls"],
                        [[k["name"], f"{k['self_ms_per_step']:.3f}", str(k["calls"])]
                         for k in prof["top_cpu_ops"]]), ""]
    python = prof.get("python")
    if python:
        lines += [f"The next {python['steps']} steps: {python['step_ms_unprofiled']:.2f} ms a step without a profiler, "
                  f"{python['step_ms_under_cprofile']:.2f} ms under cProfile, whose functions with the most own time "
                  "are:", "",
                  _md_table(["function", "own ms a step", "cumulative ms a step", "calls a step"],
                            [[f["function"], f"{f['own_ms_per_step']:.3f}", f"{f['cumulative_ms_per_step']:.3f}",
                              f"{f['calls_per_step']:.1f}"] for f in python["top_own_time"]]), ""]
    return lines


def plot(result: dict, path: Path) -> tuple[bool, str]:
    """Horizontal bars: each case's fraction of its measured limit, with its best baseline's
    fraction as a marker and the targets as ticks. Returns (drawn, why not)."""
    if not result.get("rows"):
        return False, ""  # a phase without kernel rows has nothing to plot
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipping {path.name}")
        return False, f"matplotlib is not installed here: no {path.name} (the JSON and Markdown hold every number)"
    cases: dict[tuple[str, str], dict] = {}
    for row in result.get("rows", []):
        if row["frac_of_peak"] is None:
            continue
        entry = cases.setdefault((row["op"], row["shape"]), {"row": row, "best": None})
        if row["baseline_ms"]:
            baseline_frac = row["frac_of_peak"] * row["ms"] / row["baseline_ms"]
            if entry["best"] is None or baseline_frac > entry["best"][1]:
                entry["best"] = (row["baseline"], baseline_frac)
    if not cases:
        print(f"note: no timed rows; skipping {path.name}")
        return False, f"no timed rows: no {path.name}"
    thresholds = {(t["op"], t["shape"]): t for t in result.get("targets", []) if t["metric"] == "frac_of_peak"}
    labels = [f"{op}\n{shape}" for op, shape in cases]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(cases) + 1.8))
    y = list(range(len(cases)))[::-1]
    fracs = [c["row"]["frac_of_peak"] for c in cases.values()]
    colors = ["tab:orange" if c["row"]["peak"].endswith("matmul") else "tab:blue" for c in cases.values()]
    ax.barh(y, fracs, color=colors, height=0.6, label="pagedkernels")
    for yi, (key, entry) in zip(y, cases.items()):
        row = entry["row"]
        ax.text(row["frac_of_peak"] + 0.01, yi, f"{row['frac_of_peak']:.2f} of {row['peak']}", va="center", fontsize=7)
        if entry["best"]:
            ax.plot(entry["best"][1], yi, "k|", markersize=14, markeredgewidth=2)
        if key in thresholds:
            ax.plot(thresholds[key]["threshold"], yi, "rv", markersize=7)
    ax.plot([], [], "k|", markersize=10, markeredgewidth=2, label="best baseline (same run)")
    ax.plot([], [], "rv", label="target")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("fraction of the limit measured in the same run (blue: copy bandwidth, orange: matmul rate)")
    ax.axvline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, max(1.1, max(fracs) + 0.25))
    env = result["environment"]
    title = f"pagedkernels on {env['device_name']} (torch {env['torch']}, triton {env['triton']})"
    ax.set_title(title + (" - DRY RUN" if result.get("dry_run") else ""), fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True, ""
