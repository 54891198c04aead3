"""The host's own time per engine step at many running requests, on CPU:
``python -m bench.host_step_cpu [--num-seqs 256] [--steps 40] [--reps 5] [--profile] [--json FILE]``.

With async scheduling on a GPU the device no longer waits for the host's sync, so a step takes the longer of the
GPU's kernels and the host's Python (scheduling, the workers' diff, the batch's update, output building). On the
H200 (2026-11-28, nano-vllm's protocol, 256 running) the host took 10.6 ms a step against 8.3 ms of kernels: the
host bounds the step. That Python is the same on CPU, so this measures it here: a one-layer random-weight model
(hidden 64, vocabulary 2048) whose forward costs little, ``--num-seqs`` requests decoding at temperature 0.6 with
LLM.generate's FINAL_ONLY outputs (async scheduling on by default, as on CUDA), ``--steps`` steps timed ``--reps``
times. Reported: the whole step, the time inside the executor's ``execute_model`` (the runner: the batch's update,
inputs, the forward, sampling) and the rest (the core and the output path), min and median over the repeats.
``--profile``: the functions with the most own time under cProfile (bench.engine_gpu's python_profile). Numbers
mean something only side by side (the commit before and after, alternating, on a quiet machine)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time


def run(num_seqs: int = 256, steps: int = 40, reps: int = 5, async_scheduling: bool = True, profile: bool = False,
        top: int = 25, log=print) -> dict:
    from bench.engine_gpu import python_profile, timed_execute_model
    from engine import LLM, SamplingParams
    from engine.sampling_params import RequestOutputKind

    with tempfile.TemporaryDirectory() as tmp:
        config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                  "torch_dtype": "float32"}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        llm = LLM(tmp, dtype="float32", device="cpu", max_model_len=2048, max_num_seqs=num_seqs,
                  load_format="dummy", skip_tokenizer_init=True, async_scheduling=async_scheduling,
                  enforce_eager=True)
        engine = llm.llm_engine
        try:
            rng = random.Random(0)
            warmup = 20
            max_tokens = warmup + steps * (reps + (2 if profile else 1)) + 8   # every request runs throughout
            for i in range(num_seqs):
                prompt = [rng.randint(1, 2000) for _ in range(rng.randint(16, 64))]
                engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True,
                                                  output_kind=RequestOutputKind.FINAL_ONLY))
            for _ in range(warmup):   # prefills done, every request decoding
                engine.step()
            rows = []
            with timed_execute_model(engine) as inside:
                for _ in range(reps):
                    inside[0] = 0.0
                    start = time.perf_counter()
                    for _ in range(steps):
                        engine.step()
                    wall = time.perf_counter() - start
                    rows.append({"step_ms": wall / steps * 1e3, "execute_model_ms": inside[0] / steps * 1e3,
                                 "outside_ms": (wall - inside[0]) / steps * 1e3})
            result = {"num_seqs": num_seqs, "steps": steps, "reps": reps, "async_scheduling": async_scheduling,
                      "cpu": platform.processor() or platform.machine(), "runs": rows}
            for key in ("step_ms", "execute_model_ms", "outside_ms"):
                values = [r[key] for r in rows]
                result[key] = {"min": min(values), "median": statistics.median(values)}
            log(f"{num_seqs} running, async scheduling {'on' if async_scheduling else 'off'}: step "
                f"{result['step_ms']['min']:.2f} ms (median {result['step_ms']['median']:.2f}), execute_model "
                f"{result['execute_model_ms']['min']:.2f} ms, the rest {result['outside_ms']['min']:.2f} ms")
            if profile:   # bench.engine_gpu's: `steps` plain steps, then `steps` under cProfile
                result["python"] = python_profile(engine, steps, top)
                for row in result["python"]["top_own_time"]:
                    log(f"  {row['own_ms_per_step']:7.3f} ms own {row['cumulative_ms_per_step']:7.3f} ms cum "
                        f"{row['calls_per_step']:8.1f} calls  {row['function']}")
            return result
        finally:
            engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    result = run(args.num_seqs, args.steps, args.reps, args.async_scheduling, args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
