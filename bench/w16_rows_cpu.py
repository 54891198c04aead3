"""The bf16 panel kernel against oneDNN's prepacked bf16 product, by rows: where engine/platform.py's row limit goes.

    python -m bench.w16_rows_cpu [--out DIR | --out FILE.json] [--rows 1,8,16,...] [--quick]

A bf16 model's CPU linear has two copies of its weight (engine/layers/quantization/unquantized.py): the panels of
``pagedkernels.w16_gemm`` (one pass over the weight, ``vdpbf16ps`` where the CPU has AVX512-BF16) and oneDNN's
prepacked bf16 layout (AMX tiles where the CPU has them). A product of up to ``DevicePolicy.cpu_bf16_w16_max_rows``
rows takes the panels. This times both over one decode step's linears of SmolLM2-135M (30 layers of q/k/v fused
576 -> 960, o 576 -> 576, gate/up fused 576 -> 3072, down 1536 -> 576: 212 MB of bf16, read in layer order as a step
reads them, so each weight comes from wherever a step finds it), at each row count, the two methods taking turns
(median of interleaved rounds; the minimum is recorded too). Each row reports both times, ``panels / oneDNN`` (below
1: the panels are faster) and the weights' bytes over the time (GB/s), with the CPU, its bf16 ISA and the limit the
engine uses on it. Both products are checked against a float32 reference first.

``--engine 16,4,...``: the limits themselves in the engine, the way a user meets them: one bf16 engine per limit (the
same for eager products and decode graphs) in this one process, each warmed up on the workload (its graphs recorded),
then rounds of ``bench.engine_cpu``'s 48-request workload (16-128 tokens in and out, greedy, a new prompt set each round
so no prefix is cached) with the engines taking turns; output tok/s per engine and round, medians and each limit's
ratio to the first. Taking turns in one process is what makes the ratio mean something on a shared VM, whose rate
drifts between processes (separate runs of the same limit here differed by 25%).

``--quick``: two small layers, rows 1 and 8, two rounds: exercises the code for the tests (the numbers mean nothing);
with ``--engine``, a tiny model and 6 short requests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import kernels
from bench.lora_cpu import interleaved
from bench.report import write_cpu_report
from pagedkernels import _native

# (name, in_features, out_features) of one SmolLM2-135M decoder layer's linears, as the engine fuses them
LAYER = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
NUM_LAYERS = 30
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
QUICK_LAYER, QUICK_LAYERS, QUICK_ROWS = [("qkv", 64, 96), ("down", 128, 64)], 2, (1, 8)


def _layers(layer_shapes, num_layers: int, gen: torch.Generator) -> list:
    """Engine linears (both copies built as a bf16 model's load builds them), each with its float32 weight."""
    from engine.layers.quantization.unquantized import UnquantizedLinearMethod

    layers = []
    for _ in range(num_layers):
        for name, k, n in layer_shapes:
            weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            layer.packed_weight = layer.w16_weight = None
            reference = weight.float()
            UnquantizedLinearMethod.prepack(layer, keep_weight=False)
            layers.append((name, k, layer, reference))
    return layers


def _step_fns(layers, rows: int, gen: torch.Generator):
    """(panels, oneDNN): each runs every layer's product on ``rows`` bf16 rows, in layer order."""
    from engine.layers.quantization.unquantized import _ONEDNN_LINEAR
    from pagedkernels.w16_gemm import w16_gemm

    inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {k for _, k, _, _ in layers}}

    def panels():
        for _, k, layer, _ in layers:
            w16_gemm(inputs[k], layer.w16_weight, layer.w16_rows)

    def onednn():
        for _, k, layer, _ in layers:
            _ONEDNN_LINEAR(inputs[k], layer.packed_weight, None, "none", [], "")

    return inputs, panels, onednn


def _check(layers, inputs) -> None:
    """The first layer's products near the float32 reference (a mis-wired benchmark, not a precision test)."""
    from engine.layers.quantization.unquantized import _ONEDNN_LINEAR
    from pagedkernels.w16_gemm import w16_gemm

    for _, k, layer, reference in layers[:len(LAYER)]:
        expected = inputs[k].float() @ reference.T
        for name, got in (("panels", w16_gemm(inputs[k], layer.w16_weight, layer.w16_rows)),
                          ("oneDNN", _ONEDNN_LINEAR(inputs[k], layer.packed_weight, None, "none", [], ""))):
            kernels.assert_close(got, expected, torch.bfloat16, f"{name} product at {tuple(inputs[k].shape)} x {k}")


def _ms(seconds: float) -> float:
    """Milliseconds to 4 significant digits: a fixed 3 decimals would leave a 10 us layer's time 5% off, and with it
    the ratio a reader recomputes from the two times."""
    return float(f"{seconds * 1e3:.4g}")


def run(layer_shapes, num_layers: int, rows_list, *, rounds: int, min_time: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    layers = _layers(layer_shapes, num_layers, gen)
    weight_bytes = sum(layer.w16_weight.numel() * 2 for _, _, layer, _ in layers)
    out = []
    for rows in rows_list:
        inputs, panels, onednn = _step_fns(layers, rows, gen)
        _check(layers, inputs)
        samples = interleaved([panels, onednn], rounds=rounds, min_time=min_time)
        p, o = (statistics.median(s) for s in samples)
        out.append({"rows": rows, "panels_ms": _ms(p), "onednn_ms": _ms(o),
                    "panels_min_ms": _ms(min(samples[0])), "onednn_min_ms": _ms(min(samples[1])),
                    "panels_over_onednn": round(p / o, 3), "panels_GBps": round(weight_bytes / p / 1e9, 1),
                    "onednn_GBps": round(weight_bytes / o / 1e9, 1)})
        r = out[-1]
        print(f"{rows:4d} rows  panels {r['panels_ms']:8.3f} ms ({r['panels_GBps']:6.1f} GB/s)  oneDNN "
              f"{r['onednn_ms']:8.3f} ms ({r['onednn_GBps']:6.1f} GB/s)  panels/oneDNN {r['panels_over_onednn']}",
              flush=True)
    return out


def crossover(rows: list[dict]) -> int | None:
    """The most rows up to which the panels were never slower than oneDNN (None: slower from the first)."""
    last = None
    for r in rows:
        if r["panels_over_onednn"] > 1.0:
            break
        last = r["rows"]
    return last


def engine_rounds(model_dir: str, limits: list[str], *, rounds: int, num_requests: int = 48, min_len: int = 16,
                  max_len: int = 128) -> dict:
    """Output tok/s of ``num_requests`` greedy requests per limit and round (see the module docstring)."""
    from bench.engine_cpu import make_requests
    from engine import LLM, SamplingParams
    from engine.layers.quantization import unquantized

    def use(config):
        """config: the panel path's row limit, or "limit:amx" with the rows from which its bf16 products take AMX
        tiles (``off``: never)."""
        limit, _, amx = str(config).partition(":")
        unquantized.BF16_W16_MAX_ROWS = unquantized.BF16_W16_GRAPH_MAX_ROWS = None if limit == "all" else int(limit)
        if amx:
            _native.w16_amx(sys.maxsize if amx == "off" else int(amx))

    saved = unquantized.BF16_W16_MAX_ROWS, unquantized.BF16_W16_GRAPH_MAX_ROWS, _native.w16_amx()[1]
    engines = {}
    try:
        for limit in limits:
            use(limit)
            engines[limit] = LLM(model_dir, dtype="bfloat16", device="cpu")
        vocab = engines[limits[0]].llm_engine.model_config.vocab_size

        def generate(limit, seed):
            use(limit)
            requests = make_requests(num_requests, min_len, max_len, vocab, seed)
            params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
            start = time.perf_counter()
            outs = engines[limit].generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params,
                                           use_tqdm=False)
            seconds = time.perf_counter() - start
            return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [o.outputs[0].token_ids for o in outs]

        for limit in limits:   # warm-up: each engine's graphs and oneDNN's shapes
            generate(limit, 1000)
        rates: dict[str, list[float]] = {limit: [] for limit in limits}
        agree = {limit: 0 for limit in limits}
        for r in range(rounds):
            order = limits if r % 2 == 0 else limits[::-1]
            outputs = {}
            for limit in order:
                rate, outputs[limit] = generate(limit, 2000 + r)
                rates[limit].append(round(rate, 1))
            for limit in limits:
                agree[limit] += sum(a == b for a, b in zip(outputs[limit], outputs[limits[0]]))
            print(f"round {r + 1}: " + ", ".join(f"limit {limit} {rates[limit][-1]} tok/s" for limit in limits),
                  flush=True)
    finally:
        unquantized.BF16_W16_MAX_ROWS, unquantized.BF16_W16_GRAPH_MAX_ROWS = saved[:2]
        _native.w16_amx(saved[2])
    medians = {limit: round(statistics.median(v), 1) for limit, v in rates.items()}
    return {"model": model_dir, "requests": {"count": num_requests, "min_len": min_len, "max_len": max_len},
            "rounds": rounds, "tokens_per_s": {str(k): v for k, v in rates.items()},
            "median_tokens_per_s": {str(k): v for k, v in medians.items()},
            "ratio_to_first": {str(k): round(v / medians[limits[0]], 3) for k, v in medians.items()},
            "greedy_identical_to_first": {str(k): f"{v}/{num_requests * rounds}" for k, v in agree.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.w16_rows_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="a directory (gets <date>-w16-rows-cpu-<cpu>.json) or a .json file")
    parser.add_argument("--rows", type=lambda s: tuple(int(v) for v in s.split(",")), default=ROWS)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds: checks the code paths only")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of calls per method and row count")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    parser.add_argument("--engine", type=lambda s: s.split(","),
                        help="comma-separated row limits to run the engine with, taking turns (see above); a limit "
                             "may be 'all' and may end in ':N' (its bf16 products take AMX tiles from N rows) or "
                             "':off' (never)")
    parser.add_argument("--model", help="--engine's model (default: the engine's default model)")
    args = parser.parse_args(argv)
    from engine.layers.quantization.unquantized import _onednn_bf16_available
    from engine.platform import _cpu_bf16_w16_max_rows

    if _native.library() is None or not _onednn_bf16_available():
        print(f"nothing to compare here: native kernels {'built' if _native.library() else 'unavailable'}, "
              f"oneDNN bf16 {'available' if _onednn_bf16_available() else 'unavailable (no AVX512BW/VL/DQ)'}")
        return 1
    start, load_before = time.time(), os.getloadavg()
    quick = args.quick
    if args.engine:
        from engine.default_model import default_model_path

        model = args.model or default_model_path()
        result = engine_rounds(model, args.engine, rounds=2 if quick else args.rounds,
                               **({"num_requests": 6, "min_len": 4, "max_len": 12} if quick else {}))
        print(f"medians {result['median_tokens_per_s']}; ratio to limit {args.engine[0]}: {result['ratio_to_first']}")
    rows = [] if args.engine else run(QUICK_LAYER if quick else LAYER, QUICK_LAYERS if quick else NUM_LAYERS,
               QUICK_ROWS if quick else args.rows, rounds=2 if quick else args.rounds,
               min_time=0.01 if quick else args.min_time)
    isa = _native.cpu_bf16_isa()
    report = {
        "benchmark": "bench.w16_rows_cpu", "quick": quick, "date": datetime.date.today().isoformat(),
        "cpu": _native.cpu_name(), "cpu_bf16_isa": isa, "bf16_dot_path": _native.bf16_dot_path(),
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(),
        "engine_limits": {"eager": _cpu_bf16_w16_max_rows(isa), "graphs": _cpu_bf16_w16_max_rows(isa, graphs=True)},
        "panels_never_slower_up_to_rows": crossover(rows) if rows else None, "rows": rows,
        "engine": result if args.engine else None, "seconds": round(time.time() - start, 1),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }
    if rows:
        print(f"panels never slower up to {report['panels_never_slower_up_to_rows']} rows; the engine's limits here: "
              f"{report['engine_limits']} ({isa})")
    if args.out is not None and args.out.suffix == ".json":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    elif args.out is not None:
        print(f"wrote {write_cpu_report(args.out, 'w16-rows-engine-cpu' if args.engine else 'w16-rows-cpu', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
