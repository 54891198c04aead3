"""Engine benchmarks on the GPU (issue 5), each against its alternative in the same run:
``PYTHONPATH=. python -m bench.engine_gpu [--json FILE]`` (also run by ``bench.gpu_suite``).

1. Offline throughput, nano-vllm's protocol: 256 requests, seed 0, random prompt token ids, prompt
   and output lengths uniform in [100, 1024], temperature 0.6, ``ignore_eos``, max_model_len 4096;
   on a random-weight Qwen3-0.6B-shaped model (config built at run time, bf16; SmolLM2's tokenizer
   padded with extra tokens to Qwen3's 151936 ids) and on SmolLM2. Output tokens/s of
   ``LLM.generate`` against transformers on the same requests: its continuous-batching
   ``generate_batch`` where the installed version has it, else batched ``generate`` (left padding).
   Both take one ``max_new_tokens`` per call, so transformers gets the requests in output-length-
   sorted groups of ``--hf-group`` with the group's longest length, credited only the requested tokens.
2. Batch-1 decode (gpt-fast style): tokens/s = (N - 1) / (t(N) - t(1)) and achieved bandwidth =
   (weight bytes + mean KV bytes read per token) x tokens/s, against the measured copy bandwidth.
3. Decode-step time at batch 64 and 256 (context ``--context`` tokens each) through the
   ModelRunner (CUDA graphs unless ``--enforce-eager``), against its floor: (weight bytes + KV bytes
   of the batch) / copy bandwidth.

``--dry-run`` runs the same code on CPU with tiny shapes (a 2-layer Qwen3 shape, 8 requests of 4-16
tokens, batch 2/4): it checks the code path only, numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

# Qwen3-0.6B's config.json, the fields the engine reads.
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False)
TINY_QWEN3 = dict(QWEN3_0_6B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=None, max_position_embeddings=512)


@dataclass
class Workload:
    num_requests: int
    min_len: int
    max_len: int
    max_model_len: int
    temperature: float = 0.6


NANO_VLLM = Workload(256, 100, 1024, 4096)
TINY_WORKLOAD = Workload(8, 4, 16, 256)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_qwen3_dir(out_dir: str, tokenizer_dir: str, *, tiny: bool, dtype: torch.dtype, seed: int = 0) -> str:
    """A random-weight Qwen3 of the 0.6B shape (or TINY_QWEN3) saved as an HF directory with SmolLM2's
    tokenizer, padded with added tokens up to the model's vocabulary so every id detokenizes."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(TINY_QWEN3 if tiny else QWEN3_0_6B)
    if shape["vocab_size"] is None:
        shape["vocab_size"] = len(tokenizer)
    if len(tokenizer) < shape["vocab_size"]:
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(shape["vocab_size"] - len(tokenizer))])
    config = Qwen3Config(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_requests(workload: Workload, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """nano-vllm's bench.py: prompt ids uniform in [0, 10000), lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    high = min(10000, vocab_size) - 1
    return [([rng.randint(0, high) for _ in range(rng.randint(workload.min_len, workload.max_len))],
             rng.randint(workload.min_len, workload.max_len)) for _ in range(workload.num_requests)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied LM head counts once: read once per token)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


# ------------------------------------------------------------------------------------------------
# 1. offline throughput
# ------------------------------------------------------------------------------------------------


def engine_throughput(llm, requests, temperature: float) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    synchronize(llm.llm_engine.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(llm.llm_engine.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def transformers_throughput(model_dir: str, requests, temperature: float, device: torch.device,
                            dtype: torch.dtype, group: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    use_batch_api = hasattr(model, "generate_batch") and device.type == "cuda"
    order = sorted(range(len(requests)), key=lambda i: requests[i][1])
    groups = [order[i:i + group] for i in range(0, len(order), group)]

    def run_group(indices: list[int]) -> None:
        new_tokens = max(requests[i][1] for i in indices)
        config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                                  pad_token_id=pad_id)
        prompts = [requests[i][0] for i in indices]
        if use_batch_api:
            model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
            return
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)

    with torch.inference_mode():
        run_group(groups[0][:2])  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for indices in groups:
            run_group(indices)
        synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(n for _, n in requests)
    del model
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "api": "generate_batch" if use_batch_api else "generate", "group": group}


# ------------------------------------------------------------------------------------------------
# 2. batch-1 decode and 3. decode-step time
# ------------------------------------------------------------------------------------------------


def batch1_decode(llm, prompt_len: int, new_tokens: int, copy_gbps: float) -> dict:
    from engine import SamplingParams

    device = llm.llm_engine.device
    prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}

    def run(n: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        synchronize(device)
        return time.perf_counter() - start

    run(4)
    t_first = min(run(1) for _ in range(2))
    t_full = min(run(new_tokens) for _ in range(2))
    tokens_per_s = (new_tokens - 1) / max(t_full - t_first, 1e-9)
    runner = llm.llm_engine.model_runner
    mean_context = prompt_len + new_tokens / 2
    bytes_per_token = weight_bytes(runner.model) + mean_context * kv_bytes_per_token(runner.config, runner.dtype)
    achieved = bytes_per_token * tokens_per_s / 1e9
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "decode_tokens_per_s": tokens_per_s,
            "bytes_per_token": bytes_per_token, "achieved_gbps": achieved, "frac_of_copy_bandwidth": achieved / copy_gbps}


@dataclass(eq=False)
class _Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] | None = None


def decode_step_time(llm, batch_size: int, context: int, copy_gbps: float, repeats: int) -> dict:
    """Prefill ``batch_size`` sequences of ``context`` tokens straight through the runner, then time
    the decode step of token ``context`` (execute_model does not advance the sequences, so the same
    step repeats with identical work)."""
    runner = llm.llm_engine.model_runner
    block_size = runner.block_size
    blocks_per_seq = math.ceil((context + 1) / block_size)
    if batch_size * blocks_per_seq > runner.num_kv_blocks:
        return {"batch_size": batch_size, "skipped": f"needs {batch_size * blocks_per_seq} KV blocks, "
                                                     f"the cache has {runner.num_kv_blocks}"}
    gen = torch.Generator().manual_seed(batch_size)
    seqs = [_Seq(torch.randint(0, 1000, (context + 1,), generator=gen).tolist(), 0,
                 list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(batch_size)]
    chunk = max(1, runner.max_num_batched_tokens // context)
    for start in range(0, batch_size, chunk):  # prefill, a few sequences per forward
        runner.execute_model([(s, context) for s in seqs[start:start + chunk]])
    for s in seqs:
        s.num_computed_tokens = context
    step = [(s, 1) for s in seqs]
    for _ in range(3):
        runner.execute_model(step)  # warm-up (captures the graph)
    synchronize(runner.device)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.execute_model(step)
    synchronize(runner.device)
    ms = (time.perf_counter() - start) / repeats * 1e3
    floor_bytes = weight_bytes(runner.model) + batch_size * (context + 1) * kv_bytes_per_token(runner.config,
                                                                                                 runner.dtype)
    floor_ms = floor_bytes / copy_gbps / 1e6
    return {"batch_size": batch_size, "context": context, "step_ms": ms, "floor_ms": floor_ms,
            "frac_of_floor": floor_ms / ms, "cuda_graphs": not runner.enforce_eager}


# ------------------------------------------------------------------------------------------------


def run(device: torch.device, *, tiny: bool, models: list[str], hf_group: int = 64, context: int = 1024,
        enforce_eager: bool = False, skip_transformers: bool = False, copy_gbps: float | None = None,
        log=print) -> dict:
    from bench.kernels import measure_peaks, wall_timer
    from engine import LLM
    from engine.default_model import default_model_path

    if copy_gbps is None:
        timer = wall_timer
        if device.type == "cuda":
            from bench.kernels import cuda_timer as timer
        copy_gbps = measure_peaks(device, timer, tiny=tiny).copy_gbps
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    workload = TINY_WORKLOAD if tiny else NANO_VLLM
    smollm2 = default_model_path()
    results: dict = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "copy_gbps": copy_gbps,
                     "workload": workload.__dict__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            model_dir = smollm2 if name == "smollm2" else build_qwen3_dir(tmp, smollm2, tiny=tiny, dtype=dtype)
            llm = LLM(model_dir, dtype=str(dtype).replace("torch.", ""), device=str(device),
                      max_model_len=workload.max_model_len, enforce_eager=enforce_eager,
                      max_num_seqs=256 if not tiny else 8)
            requests = make_requests(workload, llm.llm_engine.model_config.vocab_size)
            row: dict = {"engine": engine_throughput(llm, requests, workload.temperature)}
            log(f"{name}: engine {row['engine']['output_tokens_per_s']:.0f} output tok/s")
            row["batch1"] = batch1_decode(llm, 16 if tiny else 128, 8 if tiny else 256, copy_gbps)
            log(f"{name}: batch-1 decode {row['batch1']['decode_tokens_per_s']:.1f} tok/s, "
                f"{row['batch1']['frac_of_copy_bandwidth']:.2f} of copy bandwidth")
            row["decode_steps"] = [decode_step_time(llm, b, 32 if tiny else context, copy_gbps, 3 if tiny else 20)
                                   for b in ((2, 4) if tiny else (64, 256))]
            for step in row["decode_steps"]:
                log(f"{name}: decode step {step}")
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not skip_transformers:
                row["transformers"] = transformers_throughput(model_dir, requests, workload.temperature, device,
                                                              dtype, hf_group if not tiny else 4)
                row["throughput_ratio"] = (row["engine"]["output_tokens_per_s"]
                                           / row["transformers"]["output_tokens_per_s"])
                log(f"{name}: transformers ({row['transformers']['api']}) "
                    f"{row['transformers']['output_tokens_per_s']:.0f} tok/s; ratio {row['throughput_ratio']:.2f}x")
            results["models"][name] = row
    targets = []
    qwen = results["models"].get("qwen3-0.6b")
    if qwen and not tiny:
        targets.append({"target": ">= 12,000 output tok/s (Qwen3-0.6B shape, nano-vllm protocol)",
                        "value": qwen["engine"]["output_tokens_per_s"],
                        "status": "pass" if qwen["engine"]["output_tokens_per_s"] >= 12000 else "fail"})
        if "throughput_ratio" in qwen:
            targets.append({"target": ">= 5x transformers", "value": qwen["throughput_ratio"],
                            "status": "pass" if qwen["throughput_ratio"] >= 5 else "fail"})
        targets.append({"target": "batch-1 decode >= 0.80 of the bandwidth floor",
                        "value": qwen["batch1"]["frac_of_copy_bandwidth"],
                        "status": "pass" if qwen["batch1"]["frac_of_copy_bandwidth"] >= 0.8 else "fail"})
    results["targets"] = targets
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the code path only")
    parser.add_argument("--models", default="qwen3-0.6b,smollm2")
    parser.add_argument("--hf-group", type=int, default=64, help="transformers: requests per call")
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence in the decode-step timing")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench.engine_gpu: CUDA is not available here; pass --dry-run to check the code on CPU.",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    results = run(device, tiny=args.dry_run, models=args.models.split(","), hf_group=args.hf_group,
                  context=args.context, enforce_eager=args.enforce_eager, skip_transformers=args.skip_transformers)
    for target in results["targets"]:
        print(f"{target['status']}: {target['target']}: {target['value']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
