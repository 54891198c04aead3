"""What the sampler kernel's top-k / top-p threshold search costs on a real model's logits:
``python -m bench.sampling_passes --model DIR [--out DIR]``.

``pagedkernels.sample_from_logits`` finds the threshold top-k and top-p keep by passes over the row (eight pivots a
pass; see pagedkernels/sampling.py) instead of sorting it, so its cost beyond the unfiltered draw's three passes is
the number of search passes, which depends on how the logits are spread. This counts them with the kernel itself
(``pagedkernels.sampling.threshold_search_passes``: on a GPU, or on CPU tensors through the Triton interpreter,
which this module turns on when no GPU is present) on the logits a model gives at each position of a greedy
continuation of a few prompts, for the generation configs users run: Llama 3's (temperature 0.6, top-p 0.9),
Qwen3's (0.6, top-k 20, top-p 0.95), and two more. The model is read with transformers (any Hugging Face
directory). Prints, per config, the mean, the largest and the histogram of passes; ``--out DIR`` writes
``DIR/<date>-sampling-passes-<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():   # the kernel's passes counted by the interpreter (before pagedkernels loads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "def fibonacci(n):",
           "Once upon a time, in a small village,", "List three primary colors:"]
# (name, temperature, top_k, top_p)
CONFIGS = [("llama3 T=0.6 p=0.9", 0.6, 0, 0.9), ("qwen3 T=0.6 k=20 p=0.95", 0.6, 20, 0.95),
           ("T=1.0 p=0.95", 1.0, 0, 0.95), ("T=0.7 k=50 p=0.8", 0.7, 50, 0.8)]


def model_logits(model_dir: str, prompts: list[str], new_tokens: int, device: str) -> torch.Tensor:
    """float32 [rows, vocab]: the logits at the last prompt position and each position of a greedy continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            sequence = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            logits = model(sequence).logits[0, ids.shape[1] - 1:-1]
            rows.append(logits.float())
    return torch.cat(rows)


def count(logits: torch.Tensor, configs=CONFIGS) -> dict[str, dict]:
    from pagedkernels.sampling import threshold_search_passes

    num_rows = logits.shape[0]
    out = {}
    for name, temperature, top_k, top_p in configs:
        passes = threshold_search_passes(logits, torch.full((num_rows,), temperature, device=logits.device),
                                         torch.full((num_rows,), top_k, device=logits.device),
                                         torch.full((num_rows,), top_p, device=logits.device)).cpu()
        out[name] = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                     "mean_passes": round(passes.float().mean().item(), 3), "max_passes": int(passes.max()),
                     "histogram": torch.bincount(passes.long()).tolist()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per prompt (default 12)")
    parser.add_argument("--out", help="write the results as JSON into this directory")
    args = parser.parse_args(argv)
    from pagedkernels import _native
    from bench.report import device_slug

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = model_logits(args.model, PROMPTS, args.new_tokens, device)
    results = count(logits)
    where = torch.cuda.get_device_name() if device == "cuda" else f"{_native.cpu_name()} (Triton interpreter)"
    report = {"model": os.path.basename(os.path.normpath(args.model)), "rows": logits.shape[0],
              "vocab": logits.shape[1], "device": where, "torch": torch.__version__,
              "triton": __import__("triton").__version__, "configs": results}
    print(f"{report['model']}: {report['rows']} rows of {report['vocab']} logits, on {where}")
    for name, row in results.items():
        print(f"  {name:26s} search passes: mean {row['mean_passes']:.2f}, max {row['max_passes']}, "
              f"histogram {row['histogram']}")
    if args.out:
        path = Path(args.out) / f"{datetime.date.today()}-sampling-passes-{device_slug(where)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
