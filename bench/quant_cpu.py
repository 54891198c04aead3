"""Quantized-weight GEMMs on the CPU at SmolLM2-135M's shapes, against float32 (oneDNN, as the engine runs).

    python -m bench.quant_cpu [--out bench/results/DATE-quant-cpu-CPU.json] [--quick]

For each linear of the model (q/k/v fused 960 x 576, o 576 x 576, gate/up fused 3072 x 576, down
576 x 1536, LM head 49152 x 576) and each row count M (1 = single-stream decode, then small batches
and a prefill chunk), the time of one call (median over interleaved rounds, each timing every method
back to back, so load from elsewhere falls on all alike; the minimum is recorded too) of:

- ``fp32 onednn``: the engine's float32 path (oneDNN inner product on a prepacked weight);
- ``gguf Q8_0/Q4_0/Q4_1/Q4_K/Q6_K`` and ``wq int4/int8`` (group 32): ``pagedkernels.gguf_gemm`` /
  ``wq_gemm`` on the native backend (int8 activation and integer dots up to NATIVE_MAX_ROWS rows,
  de-quantize + torch GEMM above), plus both of those paths forced at every M so the cut-over is measured;
- torch's own CPU int kernels: ``_weight_int8pack_mm`` (int8, per-channel) and
  ``_weight_int4pack_mm_for_cpu`` (int4, group 32);
- fp8 (e4m3, per-channel): ``pagedkernels.fp8_gemm`` (de-quantize + GEMM) and ``torch._scaled_mm``.

Rows carry the weight bytes streamed and GB/s (weight bytes / time), and the speedup over fp32 oneDNN
measured in the same run. The summary adds the model's matmuls per decoded token (30 layers + LM head
at M = 1) per format: the time of one token's GEMMs, its tokens/s bound and the ratio to float32.
Weights are random (quantized by the formats' own rules where pagedkernels has one: gguf's quantizer for
Q8_0/Q4_0/Q4_1, random blocks for the K-quants, whose speed does not depend on the values). The K-quants
need K % 256 == 0, which only the down projection (K = 1536) has at these shapes (llama.cpp stores the
576-wide rows of a Q4_K_M file in a fallback type), so they have no per-token total.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

import pagedkernels as pk
from pagedkernels import _native, quant_formats
from pagedkernels.fp8_gemm import quantize_activation_fp8
from pagedkernels.wq_gemm import NATIVE_MAX_ROWS

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
# (name, N, K, how many per token)
LINEARS = [
    ("qkv", (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN, LAYERS),
    ("o", HIDDEN, NUM_HEADS * HEAD_DIM, LAYERS),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN, LAYERS),
    ("down", HIDDEN, INTERMEDIATE, LAYERS),
    ("lm_head", VOCAB, HIDDEN, 1),
]
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _interleaved(fns, *, rounds: int, min_time: float) -> list[list[float]]:
    """Seconds per call of each fn, one sample per round: a round times every fn back to back (a batch
    of calls filling about min_time / rounds each), so load from elsewhere on the machine falls on all
    of them alike; the caller takes the median over rounds."""
    reps = []
    for fn in fns:
        for _ in range(3):
            fn()
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-7)
        reps.append(int(max(1, min(1000, min_time / rounds / once))))
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(reps[i]):
                fn()
            samples[i].append((time.perf_counter() - start) / reps[i])
    return samples


def _gguf_weight(quant_type: str, weight: torch.Tensor) -> torch.Tensor:
    import gguf
    from gguf import quants

    if quant_type in ("Q8_0", "Q4_0", "Q4_1"):
        return torch.from_numpy(quants.quantize(weight.numpy(), getattr(gguf.GGMLQuantizationType, quant_type)))
    values, nbytes = pk.GGUF_BLOCKS[quant_type]
    N, K = weight.shape
    raw = torch.randint(0, 256, (N, K // values, nbytes), dtype=torch.uint8)
    d_offset = 208 if quant_type == "Q6_K" else 0
    raw[..., d_offset:d_offset + 2] = torch.full((N, K // values), 1e-3, dtype=torch.float16).view(torch.uint8) \
        .view(N, K // values, 2)
    return raw.view(N, -1)


def _methods(weight: torch.Tensor):
    """(name, weight bytes streamed per call, fn(x) -> out) for every method that applies to this shape."""
    N, K = weight.shape
    methods = []
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    methods.append(("fp32 onednn", weight.numel() * 4,
                    lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")))
    for quant_type in GGUF_TYPES:
        if K % pk.GGUF_BLOCKS[quant_type][0]:
            continue  # K-quants need K % 256 == 0 (576 is not: llama.cpp stores such rows in a fallback type)
        raw = _gguf_weight(quant_type, weight)
        methods.append((f"gguf {quant_type}", raw.numel(), lambda x, raw=raw, t=quant_type: pk.gguf_gemm(x, raw, t)))
        methods.append((f"gguf {quant_type} int8-dot", raw.numel(),
                        lambda x, raw=raw, t=quant_type: _native_dot(x, raw, t, 0, None, None)))
        methods.append((f"gguf {quant_type} dequant+gemm", raw.numel(),
                        lambda x, raw=raw, t=quant_type: _dequant_gemm(x, raw, t, 0, None, None)))
    for bits in (4, 8):
        w = quant_formats.quantize_wq(weight, bits=bits, group_size=32)
        nbytes = w.qweight.numel() + 2 * w.scales.numel() * w.scales.element_size()
        methods.append((f"wq int{bits} g32", nbytes, lambda x, w=w, bits=bits: pk.wq_gemm(
            x, w.qweight, w.scales, w.zeros, bits=bits, group_size=32)))
        fmt = f"wq{bits}"
        methods.append((f"wq int{bits} g32 int8-dot", nbytes,
                        lambda x, w=w, fmt=fmt: _native_dot(x, w.qweight, fmt, 32, w.scales, w.zeros)))
    # torch's CPU kernels
    int8 = weight.abs().amax(1) / 127
    q8 = torch.round(weight / int8[:, None]).to(torch.int8)
    methods.append(("torch int8pack_mm", q8.numel() + 4 * N,
                    lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, int8)))
    w4 = quant_formats.quantize_wq(weight, bits=4, group_size=32, scale_dtype=torch.float32)
    q4 = quant_formats.unpack_int4(w4.qweight).to(torch.int32)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    # torchao's convention: w = (q - 8) * scale + zero, so zero = (8 - z) * scale; [K / 32, N, 2]
    scale_zeros = torch.stack([w4.scales.t(), ((8 - w4.zeros.float()) * w4.scales).t()], dim=-1).contiguous()
    methods.append(("torch int4pack_mm g32", packed4.numel() * packed4.element_size() + scale_zeros.numel() * 4,
                    lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, 32, scale_zeros)))
    fp8_weight, fp8_scale = pk.quantize_fp8_weight(weight)
    methods.append(("fp8 fp8_gemm", fp8_weight.numel() + 4 * N, lambda x: pk.fp8_gemm(x, fp8_weight, fp8_scale)))
    scale_b = fp8_scale.view(1, -1).contiguous()

    def scaled_mm(x):  # the GPU path's recipe: per-token fp8 activations, row-wise scales
        x_q, scale_a = quantize_activation_fp8(x, None)
        return torch._scaled_mm(x_q, fp8_weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)

    methods.append(("fp8 torch._scaled_mm", fp8_weight.numel() + 4 * N, scaled_mm))
    return methods


def _native_dot(x, weight, fmt, group, scales, zeros):
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _native.quant_gemm(x, weight, fmt, group, scales, zeros, out)
    return out


def _dequant_gemm(x, weight, fmt, group, scales, zeros):
    K = x.shape[1]
    w = torch.empty(weight.shape[0], K)
    _native.quant_dequantize(weight, weight.shape[0], K, fmt, group, scales, zeros, w)
    return x @ w.t()


def _check(methods, weight):
    """Each method's result near x @ W^T (catches a mis-wired benchmark, not a precision test)."""
    x = torch.randn(3, weight.shape[1])
    ref = x @ weight.t()
    for name, _, fn in methods:
        if "_K" in name:
            continue  # random blocks (see the module docstring), not the float weight
        err = ((fn(x).float() - ref).norm() / ref.norm()).item()
        if err > 0.25:  # 4-bit weights of random normal data land near 0.1
            raise RuntimeError(f"{name}: relative error {err:.3f} against float32; the benchmark is mis-wired")


def run(rows_list: list[int], min_time: float, rounds: int) -> dict:
    if _native.library() is None:
        raise SystemExit(f"native kernels unavailable: {_native.build_error()}")
    torch.manual_seed(0)
    results = []
    for name, N, K, count in LINEARS:
        weight = torch.randn(N, K) * 0.05
        methods = _methods(weight)
        _check(methods, weight)
        for M in rows_list:
            x = torch.randn(M, K)
            timings = _interleaved([lambda fn=fn: fn(x) for _, _, fn in methods], rounds=rounds, min_time=min_time)
            base = statistics.median(timings[0])  # fp32 onednn, first
            for (method, nbytes, _), samples in zip(methods, timings):
                seconds = statistics.median(samples)
                results.append({"linear": name, "N": N, "K": K, "M": M, "per_token": count, "method": method,
                                "us": round(seconds * 1e6, 2), "us_min": round(min(samples) * 1e6, 2),
                                "weight_bytes": nbytes, "weight_GBps": round(nbytes / seconds / 1e9, 2),
                                "speedup_vs_fp32": round(base / seconds, 2)})
                print(f"{name:8s} M={M:<4d} {method:28s} {seconds * 1e6:10.1f} us (min {min(samples) * 1e6:9.1f}) "
                      f"{nbytes / seconds / 1e9:7.2f} GB/s x{base / seconds:5.2f}", flush=True)
    return {"rows": results, "per_token_decode": _per_token(results)}


def _per_token(results: list[dict]) -> list[dict]:
    """The model's GEMMs for one decoded token (M = 1) per method: sum of count x time over the linears."""
    summary = []
    methods = list(dict.fromkeys(r["method"] for r in results if r["M"] == 1))  # first-seen order
    fp32 = None
    for method in methods:
        rows = [r for r in results if r["M"] == 1 and r["method"] == method]
        if len(rows) != len(LINEARS):
            continue
        seconds = sum(r["us"] * r["per_token"] for r in rows) / 1e6
        nbytes = sum(r["weight_bytes"] * r["per_token"] for r in rows)
        fp32 = seconds if method == "fp32 onednn" else fp32
        summary.append({"method": method, "ms_per_token": round(seconds * 1e3, 3),
                        "gemm_tokens_per_s": round(1 / seconds, 1), "weight_MB_per_token": round(nbytes / 1e6, 1),
                        "weight_GBps": round(nbytes / seconds / 1e9, 2),
                        "speedup_vs_fp32": round(fp32 / seconds, 2) if fp32 else None})
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON results here")
    parser.add_argument("--rows", default="1,2,4,8,16,64,128,512", help="row counts M, comma-separated")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of calls per method and shape")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    args = parser.parse_args(argv)
    rows_list = [int(m) for m in args.rows.split(",")]
    start = time.time()
    load_before = os.getloadavg()
    report = run(rows_list, args.min_time, args.rounds)
    report.update({
        "benchmark": "bench.quant_cpu",
        "date": datetime.date.today().isoformat(),
        "cpu": _native.cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "simd": _native.quant_simd_level(),
        "native_max_rows": NATIVE_MAX_ROWS,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seconds": round(time.time() - start, 1),
        "load_average_before": load_before,   # the machine may be shared: compare runs at a low load only
        "load_average_after": os.getloadavg(),
    })
    print("\nper decoded token (30 layers + LM head, M = 1):")
    for row in report["per_token_decode"]:
        print(f"  {row['method']:28s} {row['ms_per_token']:8.2f} ms  {row['gemm_tokens_per_s']:7.1f} tok/s  "
              f"{row['weight_MB_per_token']:7.1f} MB  {row['weight_GBps']:6.2f} GB/s  x{row['speedup_vs_fp32']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def default_out() -> Path:
    cpu = re.sub(r"[^a-z0-9]+", "-", _native.cpu_name().lower()).strip("-")
    return Path("bench/results") / f"{datetime.date.today().isoformat()}-quant-cpu-{cpu}.json"


if __name__ == "__main__":
    raise SystemExit(main())
