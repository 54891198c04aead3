"""Multi-LoRA serving on the GPU (#38 item 5, its GPU rows): ``PYTHONPATH=. python -m bench.lora_engine_gpu
[--json FILE] [--budget S]`` (also ``bench.gpu_suite``'s phase 12, lora); ``--dry-run`` runs the code on CPU with
tiny shapes (the numbers then mean nothing).

Nothing is read or downloaded. The model is bench.engine_gpu's Qwen3-0.6B shape (a config.json, ``load_format=
"dummy"``, bf16). Four adapters are written on the spot as PEFT saves them (``adapter_config.json`` +
``adapter_model.safetensors``, ranks 8, 16, 8, 16 on q, k, v, o, gate, up and down of every layer, ``lora_alpha`` 2r,
random A and B): the engine and PEFT read the same files. The workload (``LORA_WORKLOAD``): 128 requests, seed 0,
random prompt token ids, prompt and output lengths uniform in [64, 512], greedy, ``ignore_eos``; request i runs on
adapter i mod 4. Three sides, one after another in this process:

- ``engine-lora``: ``LLM(enable_lora=True, max_loras=4, max_lora_rank=16)`` with the GPU's defaults (torch.compile,
  CUDA graphs, async scheduling), every request queued at once and stepped to the end (bench.engine_gpu's
  ``engine_throughput``, each request with its ``lora_request``);
- ``engine-base``: ``LLM(model)`` without LoRA, the same requests on the base model alone;
- ``peft``: transformers' model of the same config (built on the GPU with its own random weights: with
  ``ignore_eos`` and fixed lengths the work is the same) with the four adapters in one ``PeftModel``, batched
  ``generate`` with PEFT's mixed-adapter batches (``adapter_names``, one per row) in output-length-sorted groups of
  ``--hf-group``, left padding, each group run to its longest request and credited only the requested tokens (as
  bench.engine_gpu runs transformers).

After each engine side's throughput, its step profile (bench.engine_gpu.step_profile: steps ``PROFILE_STEPS`` of the
same workload under torch.profiler, then cProfile): where a step's time goes, its kernels and the host's ops.

Reported: output tokens/s of each side, ``engine-lora / engine-base`` (goal >= 0.8) and ``engine-lora / peft``
(goal >= 5), the issue's goals, as on the CPU (bench.lora_engine_cpu). Every side checks the budget and stops
cleanly, marking what it cut (``"complete": false``); a ratio over a cut side is "n/a".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

from bench.budget import Budget
from bench.engine_gpu import (SHAPES, TINY_SHAPES, Workload, build_parts, build_seconds, engine_throughput,
                              free_device_memory, left_padded, make_requests, step_profile, timed_groups,
                              write_config_dir)
from bench.lora_engine_cpu import GOALS, RANKS, TARGET_MODULES

MODEL = "qwen3-0.6b"
LORA_WORKLOAD = Workload(128, 64, 512, 2048, temperature=0.0)
TINY_LORA_WORKLOAD = Workload(8, 4, 16, 256, temperature=0.0)
TINY_RANKS = (4, 8, 4, 8)
# Each engine side's step profile (bench.engine_gpu.step_profile) over these steps of the workload, run again after
# its throughput when the budget has this many seconds left: the decode steady state (the prompts are in by step 6).
PROFILE_STEPS = (20, 40)
PROFILE_RESERVE_S = 45.0


def write_random_adapter(model_dir: str, out_dir: str, rank: int, seed: int, dtype: torch.dtype) -> str:
    """A PEFT LoRA adapter of ``model_dir``'s model as PEFT saves it (every projection of TARGET_MODULES, rank
    ``rank``, alpha 2 rank), random A and B sized so that the adapter moves the outputs; returns ``out_dir``. Made
    from the engine's list of the model's projections, so PEFT is not needed to write it."""
    from safetensors.torch import save_file

    from engine.lora import lora_targets
    from engine.models import load_model_config

    config = load_model_config(model_dir, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in lora_targets(config).items():
        if module.rpartition(".")[2] not in TARGET_MODULES:
            continue
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen)
                                              / math.sqrt(in_features)).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.25
                                              / math.sqrt(rank)).to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": TARGET_MODULES, "lora_dropout": 0.0, "bias": "none"}, f, indent=1)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir


def peft_throughput(model_dir: str, requests, adapters: list[str], adapter_of: list[int], device: torch.device,
                    dtype: torch.dtype, group: int, budget: Budget) -> dict:
    """transformers + PEFT serving the mix (see the module docstring): output tokens/s over the groups run."""
    import transformers
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="adapter-0")
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(path, adapter_name=f"adapter-{i}")
    model.to(device=device, dtype=dtype).eval()
    pad_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0

    def run_group(indices: list[int]) -> None:
        new_tokens = max(requests[i][1] for i in indices)
        input_ids, mask = left_padded([requests[i][0] for i in indices], pad_id, device)
        model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad_id,
                       adapter_names=[f"adapter-{adapter_of[i]}" for i in indices])

    with torch.inference_mode():
        result = timed_groups(requests, group, run_group, device, budget)
    del model, base
    free_device_memory(device)
    return dict(result, peft=__import__("peft").__version__)


def run(device: torch.device, *, tiny: bool, budget: Budget | None = None, hf_group: int = 64, log=print,
        on_progress=None, results: dict | None = None) -> dict:
    """The three sides in turn (engine-lora, engine-base, peft), ``on_progress(results)`` after each."""
    from engine import LLM, LoRARequest

    budget = budget or Budget(None)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype_name = str(dtype).replace("torch.", "")
    workload, ranks = (TINY_LORA_WORKLOAD, TINY_RANKS) if tiny else (LORA_WORKLOAD, RANKS)
    shape = (TINY_SHAPES if tiny else SHAPES)[MODEL]
    results = results or {"device": str(device), "device_name": torch.cuda.get_device_name(device)
                          if device.type == "cuda" else "cpu", "dtype": dtype_name, "model": MODEL,
                          "load_format": "dummy", "workload": workload.__dict__,
                          "adapters": {"count": len(ranks), "ranks": list(ranks), "target_modules": TARGET_MODULES,
                                       "mix": "request i on adapter i mod 4"},
                          "sides": {}, "targets": []}
    sides = results["sides"]

    def progress() -> None:
        results["ratios"], results["targets"] = ratios(sides)
        if on_progress is not None:
            on_progress(results)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_dir(os.path.join(tmp, MODEL), MODEL, tiny=tiny)
        adapters = [write_random_adapter(model_dir, os.path.join(tmp, f"adapter-{i}"), rank, seed=i, dtype=dtype)
                    for i, rank in enumerate(ranks)]
        requests = make_requests(workload, shape["vocab_size"])
        adapter_of = [i % len(adapters) for i in range(len(requests))]
        loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(adapters)]
        for side in ("engine-lora", "engine-base"):
            if side in sides:
                continue
            if not budget.allows(60):
                sides[side] = {"skipped": f"{budget.remaining():.0f} s of the budget left"}
                continue
            lora = side == "engine-lora"
            start = time.perf_counter()
            llm = LLM(model_dir, dtype=dtype_name, device=str(device), max_model_len=workload.max_model_len,
                      max_num_seqs=256 if not tiny else 8, load_format="dummy", skip_tokenizer_init=True,
                      **(dict(enable_lora=True, max_loras=len(loras), max_lora_rank=max(ranks)) if lora else {}))
            built = time.perf_counter() - start
            log(f"{side}: engine built in {built:.0f} s ({build_parts(build_seconds(llm))})")
            sides[side] = dict(engine_throughput(llm, requests, workload.temperature, budget,
                                                 lora_requests=[loras[a] for a in adapter_of] if lora else None),
                               engine_start_s=built)
            log(f"{side}: {sides[side]['output_tokens_per_s']:.0f} output tok/s (engine built in {built:.0f} s)"
                + ("" if sides[side]["complete"] else ", cut at the budget"))
            if budget.allows(PROFILE_RESERVE_S):   # where a step's time goes: the GPU's kernels or the host
                prof = sides[side]["profile"] = step_profile(
                    llm, requests, workload.temperature, steps=(2, 4) if tiny else PROFILE_STEPS,
                    lora_requests=[loras[a] for a in adapter_of] if lora else None)
                log(f"{side}: profile: {prof['step_ms']:.2f} ms a step, {prof['execute_model_ms']:.2f} ms in "
                    f"execute_model, GPU kernels {prof['kernel_ms_per_step']:.2f} ms a step")
                progress()
            llm.llm_engine.shutdown()
            del llm
            free_device_memory(device)
            progress()
        if "peft" not in sides:
            try:
                import peft  # noqa: F401
            except ImportError:
                sides["peft"] = {"skipped": "peft is not installed here"}
            else:
                sides["peft"] = peft_throughput(model_dir, requests, adapters, adapter_of, device, dtype,
                                                hf_group if not tiny else 4, budget)
                log(f"peft: {sides['peft']['output_tokens_per_s']:.0f} output tok/s"
                    + ("" if sides["peft"]["complete"] else f", {sides['peft']['requests_run']} requests in the "
                                                            "budget"))
            progress()
    return results


def ratios(sides: dict) -> tuple[dict, list[dict]]:
    """engine-lora over each other side (None where a side is missing or cut), and the goals against them."""
    values, targets = {}, []
    for key, goal in GOALS.items():
        name, _, other = key.partition(" / ")
        a, b = sides.get(name, {}), sides.get(other, {})
        value = (a["output_tokens_per_s"] / b["output_tokens_per_s"]
                 if a.get("complete") and b.get("complete") else None)
        values[key] = value
        missing = [f"{side}: " + (sides[side].get("skipped") or "cut at the budget" if side in sides else "not run")
                   for side, got in ((name, a), (other, b)) if not got.get("complete")]
        targets.append({"target": f"{key} >= {goal}", "value": value, "threshold": goal,
                        "status": "n/a" if value is None else ("pass" if value >= goal else "fail"),
                        "note": "; ".join(missing)})
    return values, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the code path only")
    parser.add_argument("--hf-group", type=int, default=64, help="transformers + PEFT: requests per generate call")
    parser.add_argument("--budget", type=float, default=None, help="seconds; sides past it are cut (default: none)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench.lora_engine_gpu: CUDA is not available here; pass --dry-run to check the code on CPU.",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    results = run(device, tiny=args.dry_run, budget=Budget(args.budget), hf_group=args.hf_group)
    for t in results["targets"]:
        print(f"{t['status']}: {t['target']}: {'-' if t['value'] is None else format(t['value'], '.2f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
