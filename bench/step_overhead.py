"""The engine's own cost per step, the model excluded: ``python -m bench.step_overhead [--out bench/results]``.

A step is scheduling, input preparation, sampling and output processing (detokenization is off: token-id
prompts, no tokenizer) around the model's forward. Here the forward is a no-op (the runner's ``_forward``
returns a preallocated hidden-state buffer, ``compute_logits`` a copy of fixed random logits of the real
vocabulary size, whose time is subtracted), so what is timed is everything else. B requests (B in ``--batch-sizes``, default 1, 32, 256) with
``--prompt-len`` token prompts decode ``--steps`` tokens each (``ignore_eos``), in two sampling mixes:
greedy, and sampled (temperature 0.8, top-p 0.95, top-k 50, repetition penalty 1.1, a seed on every other
request). Reported: milliseconds per decode step (the steps after every prompt is in), the median of
``--repeats`` runs, and per sequence.

The model is a Llama shape with SmolLM2's 49152-token vocabulary built from a config.json alone
(``load_format="dummy"``); its size does not matter, since the forward never runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

VOCAB_SIZE = 49152


def _model_dir(out_dir: str) -> str:
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  vocab_size=VOCAB_SIZE, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


MODEL_SECONDS = [0.0]   # time spent in the stand-in forward and LM head (the copy of the fixed logits)


def _no_model(llm, max_tokens: int, hidden_size: int) -> None:
    """Replace the forward by a no-op and the LM head by fixed logits (a fresh copy per call, as the sampler
    modifies its input); the copy's time is kept in MODEL_SECONDS and left out of the engine's."""
    runner = llm.llm_engine.model_runner
    hidden = torch.zeros(max_tokens, hidden_size)
    logits = torch.randn(max_tokens, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 4

    def compute_logits(states):
        start = time.perf_counter()
        out = logits[:states.shape[0]].clone()
        MODEL_SECONDS[0] += time.perf_counter() - start
        return out
    runner._forward = lambda input_ids, positions, meta: hidden[:input_ids.shape[0]]
    runner.model.compute_logits = compute_logits


def measure(llm, batch_size: int, prompt_len: int, steps: int, sampled: bool) -> float:
    """Seconds per decode step for `batch_size` requests (the steps after every prompt was computed)."""
    from engine import SamplingParams

    engine = llm.llm_engine
    rng = torch.Generator().manual_seed(batch_size)
    for i in range(batch_size):
        prompt = torch.randint(1000, VOCAB_SIZE, (prompt_len,), generator=rng).tolist()
        params = (SamplingParams(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1,
                                 seed=i if i % 2 else None, max_tokens=steps, ignore_eos=True) if sampled
                  else SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
        engine.add_request(f"r{batch_size}-{sampled}-{i}", {"prompt_token_ids": prompt}, params)
    # Prompts first (the budget admits them all in one or a few steps), then the timed decode steps.
    num_prefill_steps = 0
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in _live(engine)):
        engine.step()
        num_prefill_steps += 1
    start, num_steps, model_before = time.perf_counter(), 0, MODEL_SECONDS[0]
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return (time.perf_counter() - start - (MODEL_SECONDS[0] - model_before)) / max(num_steps, 1)


def _live(engine):
    """The engine's live sequences (waiting or running)."""
    return [seq for group in engine.requests.values() for seq in group.seqs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default=None, help="a name for this run in the report (e.g. the commit)")
    parser.add_argument("--out", default=None, help="write <date>-step-overhead-<cpu>.json here")
    args = parser.parse_args(argv)
    from engine import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(_model_dir(tmp), load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
                  max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(batch_sizes) * args.prompt_len,
                  max_model_len=args.prompt_len + args.steps + 8, num_kv_blocks=max(batch_sizes) * 8,
                  enable_prefix_caching=False)
        _no_model(llm, max(batch_sizes) * args.prompt_len, 64)
        rows = []
        for sampled in (False, True):
            for batch_size in batch_sizes:
                measure(llm, batch_size, args.prompt_len, 4, sampled)   # warm-up
                seconds = statistics.median(measure(llm, batch_size, args.prompt_len, args.steps, sampled)
                                            for _ in range(args.repeats))
                rows.append({"sampling": "sampled" if sampled else "greedy", "batch_size": batch_size,
                             "ms_per_step": seconds * 1e3, "us_per_seq_per_step": seconds * 1e6 / batch_size})
                print(f"{rows[-1]['sampling']:8s} batch {batch_size:4d}: {rows[-1]['ms_per_step']:8.3f} ms/step "
                      f"({rows[-1]['us_per_seq_per_step']:7.1f} us per sequence)", flush=True)
    report = {"label": args.label, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_average": os.getloadavg(), "prompt_len": args.prompt_len, "steps": args.steps,
              "vocab_size": VOCAB_SIZE, "rows": rows,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() or None}
    if args.out:
        from bench.report import write_cpu_report
        kind = "step-overhead" + (f"-{args.label}" if args.label else "")
        print(f"wrote {write_cpu_report(args.out, kind, report)}")
    return report


if __name__ == "__main__":
    main()
