"""The summary of bench/serve_vs_vllm.sh: ``python -m bench.serve_compare OUT_DIR [--model DIR]``.

The script leaves one bench.serve report per run in OUT_DIR, named ``<side>-<dtype>-r<round>-<load>.json`` (side
``engine`` or ``vllm``; dtype as the server was asked, ``auto`` for vLLM's default; load ``c1``, ``c8``, ``c32`` or
``issue36``). Per (side, dtype, load) this takes the median over rounds of the output throughput, of the TTFT
median and of the TPOT mean; then each engine column against each vLLM column at the same load (output tok/s
ratio, TTFT median ratio), and the machine: its CPU, its bf16 ISA, what the native kernels multiply bf16 with and
what the engine's dtype="auto" picks there (bench.engine_cpu.cpu_isa). Prints a table and writes
OUT_DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

_NAME = re.compile(r"^(engine|vllm)-([A-Za-z0-9_]+)-r(\d+)-([A-Za-z0-9_]+)\.json$")


def collect(out_dir: str) -> dict[tuple[str, str, str], list[dict]]:
    """(side, dtype, load) -> bench.serve's ``result`` of each round, in round order."""
    runs: dict[tuple[str, str, str], list[tuple[int, dict]]] = {}
    for name in sorted(os.listdir(out_dir)):
        match = _NAME.match(name)
        if match is None:
            continue
        side, dtype, round_, load = match.groups()
        with open(os.path.join(out_dir, name)) as f:
            runs.setdefault((side, dtype, load), []).append((int(round_), json.load(f)["result"]))
    return {key: [result for _, result in sorted(rounds, key=lambda r: r[0])] for key, rounds in runs.items()}


def summarize(runs: dict[tuple[str, str, str], list[dict]], machine: dict | None = None) -> dict:
    """Medians per column and the engine/vLLM ratios (see the module docstring). A run with failed requests makes
    its column's ``failed`` count non-zero; its figures are kept but say so."""
    columns = []
    for (side, dtype, load), results in sorted(runs.items()):
        def median(key: str) -> float | None:
            values = [r[key] for r in results if r.get(key) is not None]
            return statistics.median(values) if values else None

        columns.append({"side": side, "dtype": dtype, "load": load, "rounds": len(results),
                        "output_tok_s": median("output_throughput"), "ttft_median_ms": median("median_ttft_ms"),
                        "tpot_mean_ms": median("mean_tpot_ms"), "failed": sum(r.get("failed", 0) for r in results)})
    by_key = {(c["side"], c["dtype"], c["load"]): c for c in columns}
    ratios = []
    for (side, dtype, load), column in by_key.items():
        if side != "engine":
            continue
        for (other, other_dtype, other_load), theirs in by_key.items():
            if other != "vllm" or other_load != load:
                continue
            ratios.append({"load": load, "engine_dtype": dtype, "vllm_dtype": other_dtype,
                           "output_tok_s_ratio": _ratio(column["output_tok_s"], theirs["output_tok_s"]),
                           "ttft_median_ratio": _ratio(column["ttft_median_ms"], theirs["ttft_median_ms"])})
    return {"machine": machine or {}, "columns": columns, "engine_vs_vllm": ratios}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(summary: dict) -> str:
    lines = [f"{'side':<7} {'dtype':<9} {'load':<8} {'rounds':>6} {'out tok/s':>10} {'TTFT med ms':>12} "
             f"{'TPOT ms':>8} {'failed':>6}"]
    for c in summary["columns"]:
        lines.append(f"{c['side']:<7} {c['dtype']:<9} {c['load']:<8} {c['rounds']:>6} "
                     f"{_fmt(c['output_tok_s'], '.1f'):>10} {_fmt(c['ttft_median_ms'], '.0f'):>12} "
                     f"{_fmt(c['tpot_mean_ms'], '.1f'):>8} {c['failed']:>6}")
    for r in summary["engine_vs_vllm"]:
        lines.append(f"{r['load']}: engine {r['engine_dtype']} / vllm {r['vllm_dtype']}: output tok/s "
                     f"{_fmt(r['output_tok_s_ratio'], '.2f')}x, TTFT median {_fmt(r['ttft_median_ratio'], '.2f')}x")
    machine = summary["machine"]
    if machine:
        lines.append(f"machine: {machine.get('cpu')} ({machine.get('cpu_count')} CPUs); bf16 arithmetic "
                     f"{machine.get('cpu_bf16') or 'none (widened to float32)'}; native bf16 products "
                     f"{machine.get('native_bf16_path')}; engine dtype='auto' here: {machine.get('engine_auto_dtype')}")
    return "\n".join(lines)


def machine_of(model_dir: str | None) -> dict:
    """The CPU and its bf16 ISA (bench.engine_cpu.cpu_isa) for ``model_dir``'s checkpoint."""
    from bench.engine_cpu import cpu_isa, cpu_simd
    from pagedkernels import _native

    machine = {"cpu": _native.cpu_name(), "cpu_count": os.cpu_count(), "cpu_simd": cpu_simd(),
               "native_march": _native.native_march()}
    if model_dir:
        machine.update(cpu_isa(model_dir))
    return machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", help="the served model's directory (for what dtype='auto' picks for it)")
    args = parser.parse_args(argv)
    summary = summarize(collect(args.out_dir), machine_of(args.model))
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
