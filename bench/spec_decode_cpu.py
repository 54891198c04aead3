"""Speculative decoding on this CPU, single stream: ``python -m bench.spec_decode_cpu [--out bench/results]``.

SmolLM2-135M-Instruct, float32, greedy, one request at a time, with and without n-gram proposals
(``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``), the two
engines taking turns per prompt in the same run. Two workloads of chat prompts:

- grounded: the answer repeats spans of the prompt (copy a passage, fix its typos, turn it into a list, quote
  it back with small edits): n-gram lookups find the continuation in the prompt;
- free: open generation (a story, an explanation), where the prompt rarely predicts the output.

Reported per workload: output tokens/s of each engine (total output tokens over total wall time, prefill
included), the speedup, the acceptance rate and mean accepted length, and whether every greedy output is
identical (it must be: verification keeps the target's tokens).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

PASSAGE = ("The paged attention kernel reads keys and values from fixed-size blocks of a cache. Each sequence "
           "owns a block table that maps its logical blocks to physical ones, so memory is allocated on demand "
           "and shared between sequences that start with the same prompt. Continuous batching schedules new "
           "requests while others are still decoding, and chunked prefill splits long prompts across steps.")
TYPOS = PASSAGE.replace("kernel", "kernal").replace("sequence", "sequense").replace("memory", "memroy")
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Fix the spelling mistakes in this text and output the corrected text only:\n\n{TYPOS}",
    f"Rewrite the following text as a bulleted list, one sentence per bullet, keeping the wording:\n\n{PASSAGE}",
    f"Copy this paragraph, then write 'END':\n\n{PASSAGE}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip and say why each is fun.",
    "Describe how a bicycle works.",
]


def run(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    """Each prompt alone (single stream); returns the outputs' token ids and the total wall time."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        outputs.append(list(out.outputs[0].token_ids))
    return outputs, seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: the default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the engines taking turns in each")
    parser.add_argument("--out", default=None, help="write <date>-spec-decode-cpu-<cpu>.json here")
    args = parser.parse_args(argv)
    from engine import LLM
    from engine.default_model import default_model_path

    model = args.model or default_model_path()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    engines = {"plain": LLM(model, dtype="float32", device="cpu", max_model_len=1024),
               "ngram": LLM(model, dtype="float32", device="cpu", max_model_len=1024, speculative_config=spec)}
    report = {"model": model, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_average_before": os.getloadavg(), "speculative_config": spec, "max_tokens": args.max_tokens,
              "workloads": {}}
    for name, prompts in (("grounded", GROUNDED), ("free", FREE)):
        stats = engines["ngram"].llm_engine.spec_decode_stats
        drafts_before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        seconds = {"plain": 0.0, "ngram": 0.0}
        outputs = {}
        for _ in range(args.repeats):
            for engine_name, llm in engines.items():
                outputs[engine_name], took = run(llm, prompts, args.max_tokens)
                seconds[engine_name] += took
        num_tokens = sum(len(o) for o in outputs["plain"]) * args.repeats
        drafts = stats.num_drafts - drafts_before[0]
        draft_tokens = stats.num_draft_tokens - drafts_before[1]
        accepted = stats.num_accepted_tokens - drafts_before[2]
        row = {"prompts": len(prompts), "output_tokens": num_tokens,
               "plain_tokens_per_s": num_tokens / seconds["plain"],
               "ngram_tokens_per_s": num_tokens / seconds["ngram"],
               "speedup": seconds["plain"] / seconds["ngram"],
               "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
               "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
               "identical_outputs": outputs["plain"] == outputs["ngram"]}
        report["workloads"][name] = row
        print(f"{name:8s}: plain {row['plain_tokens_per_s']:6.1f} tok/s, n-gram {row['ngram_tokens_per_s']:6.1f} "
              f"tok/s, speedup {row['speedup']:.2f}x, acceptance {row['acceptance_rate']:.2f}, mean accepted "
              f"length {row['mean_accepted_length']:.2f}, identical {row['identical_outputs']}", flush=True)
    report["load_average_after"] = os.getloadavg()
    if args.out:
        from bench.report import write_cpu_report
        print(f"wrote {write_cpu_report(args.out, 'spec-decode-cpu', report)}")
    return report


if __name__ == "__main__":
    main()
