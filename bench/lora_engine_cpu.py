"""Multi-LoRA serving on this CPU (#38 item 5): ``python -m bench.lora_engine_cpu [--out DIR] [--quick]``.

The workload is bench.engine_cpu's: ``--num-requests`` (48) requests, prompt and output lengths uniform in
[``--min-len``, ``--max-len``] (16-128; seeded; random token ids, greedy, ``ignore_eos``). Here request i runs on
adapter i mod 4 of four PEFT LoRA adapters (ranks 8, 16, 8, 16 on every projection of every decoder layer: q, k, v,
o, gate, up, down; random A and B, made with PEFT and saved as PEFT saves them, into a temporary directory unless
``--adapters`` names four). Three sides, each in a process of its own (bench.engine_cpu.PipedSide: nothing one side
sets for its process reaches another; stopped between its calls), the engine sides run ``--rounds`` times taking
turns, best time kept (PEFT's, minutes long, once); the engine sides empty their prefix cache before each call
(``LLM.reset_prefix_cache``), so every round computes its prompts, as PEFT's side does:

- ``engine-lora``: ``LLM(enable_lora=True, max_loras=4, max_lora_rank=16)``, the 48 requests in one
  ``generate`` with their ``lora_request``s;
- ``engine-base``: ``LLM(model)`` without LoRA, the same requests on the base model alone;
- ``peft``: transformers with the four adapters loaded in one ``PeftModel``, the 48 requests in one batched
  ``generate`` with PEFT's mixed-adapter batches (``adapter_names``, one per row), left padding, the batch running
  to its longest request (``min_new_tokens = max_new_tokens``), as bench.engine_cpu runs transformers; credited only
  the requested tokens.

Reported: output tokens/s of each side, ``engine-lora / engine-base`` (goal >= 0.8: serving four adapters costs
at most a fifth of the base model's throughput) and ``engine-lora / peft`` (goal >= 5), the LoRA engine's greedy
outputs against PEFT's request by request (same weights, same greedy work; near-ties, more of them in bf16, may
flip an argmax in another batch shape), and the fraction of the matmul rate in the run's dtype
(bench.engine_cpu.measure_matmul_gflops) each side reaches, its useful FLOPs counted alike:
bench.engine_cpu.FlopModel's, plus 2 r (in + out) per token and adapted projection for the LoRA sides. The load
average before and after is recorded: compare runs only on a quiet machine (the lead measures there).

``--dtype bfloat16``: every side in bf16 (vLLM-CPU's default; the engine's bf16 linears and LoRA kernels, PEFT on a
bf16 model), written as ``<date>-lora-engine-cpu-bf16-<cpu>.json``.

``--quick``: 6 requests of 4-12 tokens, rank 4 and 8 adapters, two rounds, a 256^3 matmul: it exercises the code
for its test (bench/test_lora_engine_cpu.py), the numbers then mean nothing. Give it a small model (``--model``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile

import torch

from bench.engine_cpu import (FlopModel, PipedSide, Request, cpu_simd, make_requests, measure_matmul_gflops,
                              timed)
from bench.report import write_cpu_report
from pagedkernels import _native

NUM_ADAPTERS = 4
RANKS = (8, 16, 8, 16)
QUICK_RANKS = (4, 8, 4, 8)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GOALS = {"engine-lora / engine-base": 0.8, "engine-lora / peft": 5.0}


def make_adapters(model_dir: str, out_dir: str, ranks: tuple[int, ...], seed: int = 0) -> list[str]:
    """Four PEFT LoRA adapters of ``model_dir`` (rank ranks[i], alpha 2 r, every projection), random A and B sized
    so that each moves the model's outputs (their greedy tokens differ from the base model's), saved with PEFT's
    save_pretrained into ``out_dir/adapter-i``; returns their directories."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i, rank in enumerate(ranks):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES,
                                                      init_lora_weights=False))
        gen = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_A" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
                elif "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.25 / param.shape[1] ** 0.5)
        path = os.path.join(out_dir, f"adapter-{i}")
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths


def adapter_rank(path: str) -> int:
    """The largest rank of a PEFT adapter (its adapter_config.json's r, or a rank_pattern's)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return max([config["r"], *(config.get("rank_pattern") or {}).values()])


def lora_flops_per_token(model_dir: str, ranks: tuple[int, ...]) -> list[int]:
    """Per adapter: the FLOPs its delta adds to one token, 2 r (in + out) over every adapted projection."""
    from engine.lora import lora_targets
    from engine.models import load_model_config

    config = load_model_config(model_dir, dtype=torch.float32, device="cpu")
    sizes = [(i, o) for name, (i, o) in lora_targets(config).items() if name.rpartition(".")[2] in TARGET_MODULES]
    return [sum(2 * rank * (i + o) for i, o in sizes) for rank in ranks]


# ------------------------------------------------------------------------------------------------
# the sides (each in its own process: `--serve-side KIND`)
# ------------------------------------------------------------------------------------------------


class EngineSide:
    def __init__(self, model_dir: str, adapters: list[str] | None, dtype: str = "float32"):
        from engine import LLM, LoRARequest, SamplingParams

        self.SamplingParams = SamplingParams
        self.loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(adapters or [])]
        kwargs = {}
        if adapters:   # every adapter in one step's slots
            kwargs = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=max(map(adapter_rank, adapters)))
        self.llm = LLM(model_dir, dtype=dtype, device="cpu", **kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], adapters: list[int | None]) -> list[list[int]]:
        params = [self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        loras = [None if a is None or not self.loras else self.loras[a] for a in adapters]
        # Each round computes its prompts (a later round over the same prompts would find their KV cached and
        # time the decode alone, and PEFT's side has no cache to find).
        self.llm.reset_prefix_cache()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


class PeftSide:
    """transformers + PEFT: the adapters in one PeftModel, one batched generate with mixed adapter_names."""

    def __init__(self, model_dir: str, adapters: list[str], dtype: str = "float32"):
        import transformers
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.set_verbosity_error()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model = PeftModel.from_pretrained(model, adapters[0], adapter_name="adapter-0")
        for i, path in enumerate(adapters[1:], start=1):
            self.model.load_adapter(path, adapter_name=f"adapter-{i}")
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: list[int], adapters: list[int | None]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new_tokens = max(max_tokens)
        names = ["__base__" if a is None else f"adapter-{a}" for a in adapters]
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=self.pad_id,
                                  adapter_names=names)
        return [out[row, width: width + n].tolist() for row, n in enumerate(max_tokens)]


def serve_side(side) -> None:
    """Answer LoRASide's calls on stdin/stdout (bench.engine_cpu.PipedSide's protocol, with each request's adapter
    index: {"prompts", "max_tokens", "adapters"})."""
    mark, out = PipedSide.MARK, sys.stdout
    out.write(mark + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        call = json.loads(line)
        if call.get("exit"):
            break
        outputs = side.generate(call["prompts"], call["max_tokens"], call["adapters"])
        out.write(mark + json.dumps({"outputs": outputs}) + "\n")
        out.flush()


class LoRASide(PipedSide):
    """A side of this benchmark in a process of its own (``python -m bench.lora_engine_cpu --serve-side KIND``)."""

    def __init__(self, kind: str, model_dir: str, adapters: list[str], dtype: str = "float32"):
        self.name = kind
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        super().__init__([sys.executable, "-m", "bench.lora_engine_cpu", "--model", model_dir, "--threads",
                          str(torch.get_num_threads()), "--dtype", dtype, "--serve-side", kind,
                          "--adapters", *adapters], env)

    def generate_mix(self, requests: list[Request], adapters: list[int | None]) -> list[list[int]]:
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"prompts": [r.prompt_token_ids for r in requests],
                                              "max_tokens": [r.output_len for r in requests],
                                              "adapters": adapters}) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith(self.MARK):
                    return json.loads(line[len(self.MARK):])["outputs"]
        finally:
            self._signal(signal.SIGSTOP)
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}); the end of its log:\n{self._log_tail()}")


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


def measure(sides: list[LoRASide], requests: list[Request], adapters: list[int | None], rounds: int,
            flop_model: FlopModel, lora_flops: list[int], matmul_gflops: float) -> tuple[dict, dict]:
    """Best of ``rounds`` timed runs per engine side (the sides taking turns; PEFT's side, minutes long, runs in the
    first round only), after one warm-up call each."""
    warm = make_requests(2, 8, 8, flop_model.vocab_size, 99)
    for side in sides:
        side.generate_mix(warm, [0, None] if side.name != "engine-base" else [None, None])
    best: dict[str, float] = {}
    outputs: dict[str, list] = {}
    for round_index in range(rounds):
        for side in sides:
            if side.name == "peft" and round_index > 0:
                continue
            mix = [None] * len(requests) if side.name == "engine-base" else adapters
            result, seconds = timed(side.generate_mix, requests, mix)
            if seconds < best.get(side.name, float("inf")):
                best[side.name], outputs[side.name] = seconds, result
    output_tokens = sum(r.output_len for r in requests)
    base_flops = sum(flop_model.request_flops(len(r.prompt_token_ids), r.output_len) for r in requests)
    delta_flops = sum((len(r.prompt_token_ids) + r.output_len - 1) * lora_flops[a]
                      for r, a in zip(requests, adapters) if a is not None)
    results = {}
    for side in sides:
        seconds = best[side.name]
        flops = base_flops + (0 if side.name == "engine-base" else delta_flops)
        results[side.name] = {
            "seconds": seconds, "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / seconds,
            "output_lengths_exact": all(len(o) == r.output_len for o, r in zip(outputs[side.name], requests)),
            "useful_gflops": flops / 1e9, "gflops_per_s": flops / seconds / 1e9,
            "frac_of_matmul": flops / seconds / 1e9 / matmul_gflops}
    return results, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: engine.default_model.default_model_path())")
    parser.add_argument("--adapters", nargs="+", help="four PEFT adapter directories (default: made here)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed runs per engine side, taking turns (best kept); PEFT runs once")
    parser.add_argument("--matmul-n", type=int, default=2048)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for every side (default: torch's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="every side's weights and activations (vLLM-CPU's default is bfloat16; the matmul rate "
                             "reported is then bf16's)")
    parser.add_argument("--skip-peft", action="store_true", help="the two engine sides only")
    parser.add_argument("--quick", action="store_true", help="a small run that exercises the code (its test)")
    parser.add_argument("--out", help="directory for <date>-lora-engine-cpu-<cpu>.json (e.g. bench/results)")
    parser.add_argument("--serve-side", choices=("engine-lora", "engine-base", "peft"),
                        help="be a side of another run, over stdin/stdout")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_len, args.max_len, args.rounds, args.matmul_n = 6, 4, 12, 2, 256
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.default_model import default_model_path

        args.model = default_model_path()
    if args.serve_side:
        side = PeftSide(args.model, args.adapters, args.dtype) if args.serve_side == "peft" else \
            EngineSide(args.model, args.adapters if args.serve_side == "engine-lora" else None, args.dtype)
        serve_side(side)
        return 0

    if args.adapters is not None and len(args.adapters) != NUM_ADAPTERS:
        raise SystemExit(f"--adapters: give {NUM_ADAPTERS} directories, got {len(args.adapters)}")
    with tempfile.TemporaryDirectory(prefix="lora-engine-cpu-") as scratch:
        adapters = args.adapters or make_adapters(args.model, scratch, QUICK_RANKS if args.quick else RANKS,
                                                  seed=args.seed)
        report = run(args, adapters, tuple(adapter_rank(path) for path in adapters))
    if args.out:
        kind = "lora-engine-cpu" + ("" if args.dtype == "float32" else "-bf16")
        print(f"wrote {write_cpu_report(args.out, kind, report)}")
    return 0


def run(args, adapters: list[str], ranks: tuple[int, ...]) -> dict:
    flop_model = FlopModel.from_model_dir(args.model)
    requests = make_requests(args.num_requests, args.min_len, args.max_len, flop_model.vocab_size, args.seed)
    mix = [i % NUM_ADAPTERS for i in range(len(requests))]
    load_before = os.getloadavg()
    matmul = measure_matmul_gflops(args.matmul_n, dtype=getattr(torch, args.dtype))
    matmul_gflops = max(matmul.values())
    lora_flops = lora_flops_per_token(args.model, ranks)
    print(f"model {args.model}: {len(requests)} requests on {NUM_ADAPTERS} adapters (ranks {ranks}), "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt / {sum(r.output_len for r in requests)} output "
          f"tokens; {args.dtype}; {args.dtype} matmul {matmul_gflops:.1f} GFLOP/s; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    kinds = ["engine-lora", "engine-base"] + ([] if args.skip_peft else ["peft"])
    sides = []
    try:
        for kind in kinds:
            sides.append(LoRASide(kind, args.model, adapters, args.dtype))
        results, outputs = measure(sides, requests, mix, args.rounds, flop_model, lora_flops, matmul_gflops)
    finally:   # a side's process must not outlive the run (stopped, in a session of its own)
        for side in sides:
            side.close()
    for name, r in results.items():
        print(f"{name}: {r['output_tokens']} output tokens in {r['seconds']:.2f} s = {r['output_tokens_per_s']:.1f} "
              f"tok/s, {r['frac_of_matmul']:.3f} of the {args.dtype} matmul rate (exact lengths: "
              f"{r['output_lengths_exact']})", flush=True)
    ratios, targets = {}, []
    for label, goal in GOALS.items():
        top, bottom = label.split(" / ")
        if top in results and bottom in results:
            ratios[label] = results[top]["output_tokens_per_s"] / results[bottom]["output_tokens_per_s"]
            targets.append({"target": f"{label} >= {goal}", "value": ratios[label],
                            "status": "met" if ratios[label] >= goal else "not met"})
            print(f"{label}: {ratios[label]:.2f}x (goal >= {goal})", flush=True)
    report = {
        "benchmark": "bench.lora_engine_cpu", "quick": args.quick,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"cpu": _native.cpu_name(), "cpu_count": os.cpu_count(), "cpu_simd": cpu_simd(),
                        "native_march": _native.native_march(), "torch_threads": torch.get_num_threads(),
                        "torch": torch.__version__, "python": platform.python_version(),
                        "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "model": args.model, "dtype": args.dtype,
        "adapters": {"count": NUM_ADAPTERS, "ranks": list(ranks), "target_modules": TARGET_MODULES,
                     "paths": adapters if args.adapters else "made with PEFT for the run (random A and B)",
                     "lora_flops_per_token": lora_flops},
        "requests": {"count": len(requests), "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed,
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "output_tokens": sum(r.output_len for r in requests),
                     "mix": "request i on adapter i mod 4 (engine-base: the same requests on the base model)"},
        "rounds": {"engine": args.rounds, "peft": 1}, "matmul_gflops": matmul_gflops, "matmul_gflops_by_path": matmul,
        "sides": results, "ratios": ratios, "targets": targets,
    }
    if "peft" in outputs:
        same = sum(a == b for a, b in zip(outputs["engine-lora"], outputs["peft"]))
        report["greedy_outputs_identical_engine_lora_vs_peft"] = f"{same}/{len(requests)}"
        print(f"greedy outputs identical, engine-lora vs peft: {same}/{len(requests)} requests", flush=True)
    moved = sum(a != b for a, b in zip(outputs["engine-lora"], outputs["engine-base"]))
    report["adapter_outputs_differ_from_base"] = f"{moved}/{len(requests)}"
    print(f"load average before/after: {load_before} / {report['environment']['load_average_after']}")
    return report


if __name__ == "__main__":
    sys.exit(main())
