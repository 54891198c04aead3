"""Tensor parallelism on this CPU: the engine with ``--tensor-parallel-size N`` (N processes, the cores split
between them) against the same engine in one process (all cores), same run, same 48-request workload as
``bench.engine_cpu`` (prompt and output lengths uniform in 16-128, greedy, ignore_eos):
``python -m bench.tp_cpu [--model DIR] [--tensor-parallel-size N]``.

Reports output tokens/s of both and their ratio, whether the greedy outputs are identical, and the driver's
per-step overhead of sending the step records to the workers (mean broadcast time per call). The default model is
SmolLM2-135M, whose 9 query heads / 3 KV heads divide by 3, not 2; ``--model`` takes any local HF directory, and
``--heads 12:4`` measures a random-weight model of the same shape and size with its 576 hidden units split into
other head counts (12 heads of 48, 4 KV heads: divisible by 2). On a machine with fewer cores than ranks the
ranks share cores (the report records both numbers).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

from bench.engine_cpu import make_requests
from bench.report import write_cpu_report
from pagedkernels import _native


def run(model_dir: str, requests, tensor_parallel_size: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=tensor_parallel_size)
    try:
        warm = make_requests(2, 8, 8, llm.llm_engine.model_config.vocab_size, 99)
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm],
                     SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        executor = llm.llm_engine.executor
        broadcasts_before = getattr(executor, "num_broadcasts", 0), getattr(executor, "broadcast_seconds", 0.0)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result = {"tensor_parallel_size": tensor_parallel_size, "seconds": seconds,
                  "output_tokens_per_s": sum(r.output_len for r in requests) / seconds,
                  "torch_threads_per_rank": torch.get_num_threads(),
                  "outputs": [list(o.outputs[0].token_ids) for o in outputs]}
        if tensor_parallel_size > 1:
            calls = executor.num_broadcasts - broadcasts_before[0]
            result["broadcast_calls"] = calls
            result["broadcast_ms_per_call"] = 1e3 * (executor.broadcast_seconds - broadcasts_before[1]) / max(calls, 1)
        return result
    finally:
        llm.llm_engine.shutdown()


def _all_reduce_worker(rank: int, world_size: int, init_method: str, rows: list[int], hidden: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        for n in rows:
            x = torch.randn(n, hidden)
            for _ in range(20):
                dist.all_reduce(x)
            start = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(x)
            if rank == 0:
                results.put((n, 1e6 * (time.perf_counter() - start) / 200))
    finally:
        dist.destroy_process_group()


def all_reduce_latency_us(world_size: int, hidden: int, rows=(1, 48, 512)) -> dict[str, float]:
    """Mean gloo all-reduce time of an fp32 [rows, hidden] tensor between ``world_size`` spawned processes
    (one thread each), the collective a tensor-parallel layer runs twice per decoder layer."""
    import torch.multiprocessing as mp

    from engine.distributed.parallel_state import free_port

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_all_reduce_worker, args=(world_size, f"tcp://127.0.0.1:{free_port()}", list(rows), hidden,
                                                 results), nprocs=world_size, start_method="spawn")
    return {f"{n}x{hidden}": us for n, us in (results.get() for _ in rows)}


def random_model_like(model_dir: str, num_heads: int, num_kv_heads: int, out_dir: str) -> str:
    """A random-weight float32 copy of ``model_dir``'s architecture and size with its hidden units split into
    ``num_heads`` query heads (``num_kv_heads`` KV heads); tokenizer files are copied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if config.hidden_size % num_heads or num_heads % num_kv_heads or (config.hidden_size // num_heads) % 16:
        raise SystemExit(f"--heads {num_heads}:{num_kv_heads}: hidden size {config.hidden_size} must split into "
                         f"heads of a multiple of 16, and the KV heads must divide the query heads")
    config.num_attention_heads, config.num_key_value_heads = num_heads, num_kv_heads
    config.head_dim = config.hidden_size // num_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tensor-parallel-size", type=int, default=3)
    parser.add_argument("--heads", metavar="Q:KV",
                        help="measure a random-weight model of --model's shape with Q query / KV key-value heads")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="directory for <date>-tp-cpu-<cpu>.json (e.g. bench/results)")
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.default_model import default_model_path

        args.model = default_model_path()
    from engine.config import ModelConfig
    from engine.models import load_model_config

    model_name, scratch = os.path.basename(os.path.normpath(args.model)), None
    if args.heads:
        num_heads, num_kv_heads = (int(n) for n in args.heads.split(":"))
        scratch = tempfile.mkdtemp(prefix="tp-bench-")
        args.model = random_model_like(args.model, num_heads, num_kv_heads, scratch)
        model_name += f"-random-{num_heads}h{num_kv_heads}kv"
    config = load_model_config(args.model)
    requests = make_requests(args.num_requests, args.min_len, args.max_len, config.vocab_size, args.seed)
    load_before = os.getloadavg()
    try:
        single = run(args.model, requests, 1)
        sharded = run(args.model, requests, args.tensor_parallel_size)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    identical = sum(a == b for a, b in zip(single.pop("outputs"), sharded.pop("outputs")))
    ratio = sharded["output_tokens_per_s"] / single["output_tokens_per_s"]
    collective = all_reduce_latency_us(args.tensor_parallel_size, config.hidden_size)
    report = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"cpu": _native.cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                        "python": platform.python_version(), "load_average_before": load_before,
                        "load_average_after": os.getloadavg()},
        "model": model_name, "random_weights": bool(args.heads), "dtype": "float32",
        "requests": {"count": len(requests), "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed},
        "tp1": single, f"tp{args.tensor_parallel_size}": sharded, "throughput_ratio": ratio,
        "greedy_outputs_identical": f"{identical}/{len(requests)}",
        "gloo_all_reduce_us": collective,
        "all_reduces_per_step": 2 * config.num_hidden_layers,
    }
    print(f"TP=1: {single['output_tokens_per_s']:.1f} tok/s ({single['seconds']:.2f} s); "
          f"TP={args.tensor_parallel_size}: {sharded['output_tokens_per_s']:.1f} tok/s ({sharded['seconds']:.2f} s), "
          f"{sharded['torch_threads_per_rank']} thread(s) per rank on {os.cpu_count()} cores; ratio {ratio:.2f}x; "
          f"step records {sharded.get('broadcast_ms_per_call', 0):.2f} ms per broadcast; "
          f"greedy outputs identical {report['greedy_outputs_identical']}; gloo all-reduce "
          + ", ".join(f"{shape}: {us:.0f} us" for shape, us in collective.items())
          + f" ({report['all_reduces_per_step']} per step)")
    if args.out:
        print(f"wrote {write_cpu_report(args.out, f'tp{args.tensor_parallel_size}-cpu', report, model=model_name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
