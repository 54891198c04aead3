"""Multi-LoRA kernels on the CPU: a batch mixing 4 adapters and the base model, at 1, 64 and 1024 tokens.

    python -m bench.lora_cpu [--out DIR | --out FILE.json] [--dtype float32|bfloat16] [--quick]

For each projection of SmolLM2-135M (the engine's default model on CPU: q/k/v fused 576 -> 576 + 192 + 192, o
576 -> 576, gate/up fused 576 -> 2 x 1536, down 1536 -> 576), rank 16, tokens cycling over the 4 adapters and the
base (``bench.kernels.lora_inputs``), the time of one call (median over interleaved rounds: each round times every
method back to back, so load from elsewhere falls on all alike; the minimum is recorded too) of:

- ``pagedkernels``: ``lora_shrink`` + ``lora_expand`` on the default backend (the native kernels), every adapter
  in one pair of calls;
- ``per-adapter loop``: per adapter and slice, its tokens gathered and ``(x A^T) B^T`` added back (PEFT's
  mixed-batch forward; ``bench.kernels.lora_loop``);
- ``torch twin``: the ops' PyTorch path (float32 GEMMs per slot with tokens);
- ``base linear``: the projection itself as the engine's layer runs it (oneDNN's float32 product on a prepacked
  weight), for scale: what the LoRA delta adds to a layer.

Rows carry the ratio ``loop / pagedkernels`` (above 1: the grouped kernels are faster) and ``lora / base`` (the
delta's cost as a share of its layer's), GFLOP/s (2 M (K S R + N R)) and the fraction of the float32 matmul rate
measured in the same run. Each method's result is checked against a float32 reference first.
``--dtype bfloat16``: inputs, adapters and the base linear in bf16 (vLLM-CPU's default dtype; the base linear is then
oneDNN's prepacked bf16 product, or the native bf16 panels where oneDNN has no bf16, as on AVX2 CPUs), the fraction
taken of the bf16 matmul rate, the file named
``<date>-lora-cpu-kernels-bf16-<cpu>.json``.
``--quick``: one tiny projection at 1, 8 and 64 tokens, two rounds, no peak measured: it exercises the code for the
tests (the numbers then mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import pagedkernels as pk
from bench import kernels
from bench.report import write_cpu_report
from pagedkernels import _native

RANK, NUM_ADAPTERS = 16, 4
TOKENS = (1, 64, 1024)
# (name, in_features, slice sizes)
PROJECTIONS = [("qkv", 576, (576, 192, 192)), ("o", 576, (576,)), ("gate_up", 576, (1536, 1536)),
               ("down", 1536, (576,))]
QUICK_PROJECTIONS = [("qkv", 64, (64, 32, 32))]
QUICK_TOKENS = (1, 8, 64)


def interleaved(fns, *, rounds: int, min_time: float) -> list[list[float]]:
    """Seconds per call of each fn, one sample per round; a round times every fn back to back (a batch of calls
    filling about min_time / rounds each)."""
    reps = []
    for fn in fns:
        fn()
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-7)
        reps.append(int(max(1, min(1000, min_time / rounds / once))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(reps[i]):
                fn()
            samples[i].append((time.perf_counter() - start) / reps[i])
    return samples


def _sig(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant figures (a ratio or rate of a tiny shape stays non-zero)."""
    return float(f"{value:.{digits}g}")


def _engine_linear(weight: torch.Tensor, x: torch.Tensor):
    """``fn() -> x @ weight^T`` as the engine's unquantized CPU layer runs it: the weight prepacked for oneDNN
    (float32; bf16 where oneDNN multiplies bf16, AVX512BW/VL/DQ or AVX-NE-CONVERT) and, for bf16, the native
    kernels' panels (every product where oneDNN has no bf16: an AVX2 CPU's)."""
    from engine.layers.quantization.unquantized import UnquantizedLinearMethod

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.packed_weight = layer.w16_weight = None
    method = UnquantizedLinearMethod()
    method.prepack(layer, keep_weight=False)
    return lambda: method.apply(layer, x)


def _methods(inp: kernels.LoRAInputs):
    """(name, fn) of every method; each writes into an output of its own (the deltas pile up over the calls: only
    the first call's result is checked)."""
    outs = {name: inp.base.clone() for name in ("pagedkernels", "loop", "twin")}
    weight = (torch.randn(sum(inp.slice_sizes), inp.x.shape[1]) * inp.x.shape[1] ** -0.5).to(inp.x.dtype)
    base = _engine_linear(weight, inp.x)

    def twin():
        with pk.use_backend("torch"):
            return kernels.lora_grouped(inp, outs["twin"])

    return [("pagedkernels", lambda: kernels.lora_grouped(inp, outs["pagedkernels"])),
            ("per-adapter loop", lambda: kernels.lora_loop(inp, outs["loop"])),
            ("torch twin", twin),
            ("base linear", base)]


def _check(inp: kernels.LoRAInputs) -> None:
    """Each LoRA method's result near the float32 reference (a mis-wired benchmark, not a precision test)."""
    expected, dtype = kernels.lora_reference(inp), inp.x.dtype
    for name, fn in (("pagedkernels", kernels.lora_grouped), ("per-adapter loop", kernels.lora_loop)):
        kernels.assert_close(fn(inp, inp.base.clone()), expected, dtype, name)
    with pk.use_backend("torch"):
        kernels.assert_close(kernels.lora_grouped(inp, inp.base.clone()), expected, dtype, "torch twin")


def run(projections, tokens, *, rounds: int, min_time: float, peaks: kernels.Peaks | None,
        dtype: torch.dtype = torch.float32) -> list[dict]:
    rows = []
    frac_key = f"frac_of_{kernels.DTYPE_NAMES[dtype]}_matmul"
    for name, in_features, sizes in projections:
        for num_tokens in tokens:
            inp = kernels.lora_inputs(torch.device("cpu"), dtype, num_tokens=num_tokens,
                                      in_features=in_features, slice_sizes=sizes, rank=RANK,
                                      num_adapters=NUM_ADAPTERS, gen=torch.Generator().manual_seed(num_tokens))
            _check(inp)
            methods = _methods(inp)
            samples = interleaved([fn for _, fn in methods], rounds=rounds, min_time=min_time)
            seconds = {method: statistics.median(s) for (method, _), s in zip(methods, samples)}
            flops = 2 * num_tokens * (in_features * len(sizes) * RANK + sum(sizes) * RANK)
            for (method, _), s in zip(methods, samples):
                lora = method != "base linear"
                gflops = flops / seconds[method] / 1e9 if lora else None
                rows.append({
                    "projection": name, "K": in_features, "slices": list(sizes), "rank": RANK,
                    "adapters": NUM_ADAPTERS, "tokens": num_tokens, "method": method,
                    "us": round(seconds[method] * 1e6, 2), "us_min": round(min(s) * 1e6, 2),
                    "GFLOPs": None if gflops is None else _sig(gflops),
                    frac_key: None if gflops is None or peaks is None
                    else _sig(gflops / (peaks.matmul_tflops * 1e3)),
                    "loop_over_this": _sig(seconds["per-adapter loop"] / seconds[method]) if lora else None,
                    "this_over_base": _sig(seconds[method] / seconds["base linear"]) if lora else None,
                })
                row = rows[-1]
                print(f"{name:8s} {num_tokens:5d} tok {method:17s} {row['us']:10.1f} us (min {row['us_min']:9.1f})"
                      + (f"  loop/this x{row['loop_over_this']:<7} this/base {row['this_over_base']}" if lora else ""),
                      flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        help="a directory (gets <date>-lora-cpu-kernels-<cpu>.json, as the other CPU benchmarks "
                             "write) or a .json file to write the results to")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds: checks the code paths only")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="inputs, adapters and the base linear (default float32)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of calls per method and shape")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    args = parser.parse_args(argv)
    out_dir = args.out if args.out is not None and args.out.suffix != ".json" else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)   # checked now, not after minutes of timing
    if _native.library() is None:
        print(f"note: native kernels unavailable ({_native.build_error()}): 'pagedkernels' is the PyTorch twin")
    rounds, min_time = (2, 0.01) if args.quick else (args.rounds, args.min_time)
    start, load_before = time.time(), os.getloadavg()
    peaks, dtype = None, getattr(torch, args.dtype)
    if not args.quick:
        peaks = kernels.measure_peaks(torch.device("cpu"), kernels.wall_timer)
        if dtype != torch.float32:   # the fraction is of the rate in the run's dtype (oneDNN's prepacked bf16)
            from bench.engine_cpu import measure_matmul_gflops

            rates = measure_matmul_gflops(peaks.matmul_n, dtype=dtype)
            peaks = dataclasses.replace(peaks, matmul_tflops=max(rates.values()) / 1e3,
                                        matmul_dtype=kernels.DTYPE_NAMES[dtype])
        print(kernels.format_peaks(vars(peaks)))
    rows = run(*((QUICK_PROJECTIONS, QUICK_TOKENS) if args.quick else (PROJECTIONS, TOKENS)), rounds=rounds,
               min_time=min_time, peaks=peaks, dtype=dtype)
    report = {
        "benchmark": "bench.lora_cpu", "quick": args.quick, "date": datetime.date.today().isoformat(),
        "cpu": _native.cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype, "native": _native.library() is not None,
        "bf16_dot_path": _native.bf16_dot_path() if _native.library() is not None else None,
        "torch": torch.__version__, "python": platform.python_version(),
        "peaks": None if peaks is None else vars(peaks), "rows": rows, "seconds": round(time.time() - start, 1),
        "load_average_before": load_before,   # the machine may be shared: compare runs at a low load only
        "load_average_after": os.getloadavg(),
    }
    if out_dir is not None:
        kind = "lora-cpu-kernels" + ("" if args.dtype == "float32" else "-bf16")
        print(f"wrote {write_cpu_report(out_dir, kind, report)}")
    elif args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
