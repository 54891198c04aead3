"""Speculative decoding on this CPU, single stream: ``python -m bench.spec_decode_cpu [--out bench/results]``.

SmolLM2-135M-Instruct, float32, greedy, one request at a time, with and without n-gram proposals
(``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``), the two
engines taking turns per prompt in the same run. Two workloads of chat prompts:

- grounded: the answer repeats spans of the prompt (copy a passage, fix its typos, turn it into a list, quote
  it back with small edits): n-gram lookups find the continuation in the prompt;
- free: open generation (a story, an explanation), where the prompt rarely predicts the output.

``--draft-model DIR`` proposes with a draft model instead (``{"model": DIR, "num_speculative_tokens": k}``; the model
itself as its own draft has every draft accepted, and measures what the proposal steps cost).

Reported per workload: output tokens/s of each engine (total output tokens over total wall time, prefill
included), the speedup, the acceptance rate and mean accepted length, whether every greedy output is identical (it
must be: verification keeps the target's tokens), where a request's time goes on each side (``per_request_ms``:
to the first token, decoding, the call's rest), and where a step's host time goes (``step_parts_ms``: the runner's
parts, wall time a step, STEP_PARTS; a part that reads from the device includes the wait for it).
"""
from __future__ import annotations

import argparse
import contextlib
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


# Where a request's time goes: "first_token" (arrival to the first token: the prefill and its step), "decode" (first
# token to last), "rest" (the call's wall time outside those: the chat template, tokenizing, queueing, the output).
REQUEST_PARTS = ("first_token", "decode", "rest")

# Where a step goes on the host: the runner's methods timed (wall time, the device's work inside what waits for it:
# the verification's read in "verify_sample", a draft model's in "propose"), by the names reported. "execute_model" is
# the runner's whole share; "step" the engine's whole step, so "step" - "execute_model" is the core's and the output
# path's. Parts nest: "draft_target_step" and "forward" are inside "execute_model", "verify_sample" and "propose"
# inside it too, after "logits". A verification graph runs the draft model's forward itself: then it is in "forward"
# (on the device), and "draft_target_step" counts the other steps' eager ones.
STEP_PARTS = {"execute_model": "execute_model", "_forward_hidden": "forward", "_logits": "logits",
              "_sample_speculative": "verify_sample", "_propose": "propose"}


@contextlib.contextmanager
def step_parts(llm):
    """Inside, each STEP_PARTS method of the engine's model runner (and a draft model's ``run_target_step``, as
    "draft_target_step") adds its wall time to the yielded dict (seconds by part), and every engine step to "step"
    (with "steps" counting them); restored on exit. Yields an empty dict where the runner is not in this process."""
    engine = llm.llm_engine
    runner = getattr(engine, "model_runner", None)
    spent: dict[str, float] = {}
    if runner is None:
        yield spent
        return
    patched = [(runner, name, part) for name, part in STEP_PARTS.items() if hasattr(runner, name)]
    if getattr(runner, "drafter", None) is not None:
        patched.append((runner.drafter, "run_target_step", "draft_target_step"))
    if hasattr(engine, "step"):
        patched.append((engine, "step", "step"))

    def timed(fn, part):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start
                if part == "step":
                    spent["steps"] = spent.get("steps", 0) + 1
        return wrapper

    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patched]
    for owner, name, part in patched:
        setattr(owner, name, timed(getattr(owner, name), part))
    try:
        yield spent
    finally:
        for owner, name, before in saved:
            if before is None:
                delattr(owner, name)   # the instance attribute goes: the class's method again
            else:
                setattr(owner, name, before)


def run(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float, dict[str, float]]:
    """Each prompt alone (single stream); returns the outputs' token ids, the total wall time and where it went,
    summed over the requests (seconds, from each request's metrics, by REQUEST_PARTS)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs, seconds = [], 0.0
    parts = dict.fromkeys(REQUEST_PARTS, 0.0)
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        took = time.perf_counter() - start
        seconds += took
        outputs.append(list(out.outputs[0].token_ids))
        m = out.metrics
        if m is not None and m.first_token_time is not None and m.last_token_time is not None:
            first, decode = m.first_token_time - m.arrival_time, m.last_token_time - m.first_token_time
            parts["first_token"] += first
            parts["decode"] += decode
            parts["rest"] += took - first - decode
    return outputs, seconds, parts


def measure(model: str, *, device: str = "cpu", dtype: str = "float32", num_speculative_tokens: int = 5,
            max_tokens: int = 160, repeats: int = 2, verify_graphs: bool = False, draft_model: str | None = None,
            few_row_verify: bool = False, log=print) -> dict:
    """The engines (plain, n-gram, or with ``draft_model`` a draft model's proposals; with ``verify_graphs`` also the
    speculative engine with its verification (and proposal) steps in graphs, where the runner has graphs that are
    not CPU graphs: ModelRunner.set_spec_decode_graphs) on ``model`` taking turns over both workloads, single stream,
    after one untimed request each (compilation, graph captures); returns the report (per workload: tok/s of each,
    speedup, acceptance, mean accepted length, identical outputs). On CUDA the engines run as the engine does by
    default there (compiled, CUDA graphs for plain decode steps). The speculative engine's keys are named by its
    proposer (``report["proposer"]``: "ngram" or "draft"). ``few_row_verify`` (with ``verify_graphs``): one more
    speculative engine in graphs whose verification steps of k + 1 tokens run the few-row decoder layers
    (ModelRunner.set_skinny_max_rows; the CUDA default takes them for one-token steps only, so a verification
    runs cuBLAS's layers, about 11 launches a layer against 7), where the model can take them."""
    from bench.engine_gpu import _same_prefix
    from engine import LLM

    kind = "draft" if draft_model else "ngram"
    if draft_model:
        spec = {"model": draft_model, "num_speculative_tokens": num_speculative_tokens}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    # One request at a time: a short graph ladder (8 sequences) keeps the engines' start-up short on a GPU.
    options = dict(dtype=dtype, device=device, max_model_len=1024, max_num_seqs=8)
    engines = {"plain": LLM(model, **options), kind: LLM(model, **options, speculative_config=spec)}
    if verify_graphs:   # the speculative engine itself eager (graphs are the CUDA default), then one in graphs
        engines[kind].llm_engine.model_runner.set_spec_decode_graphs(False)
        graphed = LLM(model, **options, speculative_config=spec)
        if graphed.llm_engine.model_runner.set_spec_decode_graphs(True):
            engines[f"{kind}_graphs"] = graphed
        else:
            graphed.llm_engine.shutdown()
        from pagedkernels.skinny_gemm import MAX_ROWS

        if few_row_verify and f"{kind}_graphs" in engines and num_speculative_tokens + 1 <= MAX_ROWS:
            few = LLM(model, **options, speculative_config=spec)
            runner = few.llm_engine.model_runner
            if runner.set_spec_decode_graphs(True) and runner.set_skinny_max_rows(num_speculative_tokens + 1):
                engines[f"{kind}_graphs_few_rows"] = few
            else:
                few.llm_engine.shutdown()
    report = {"model": model, "device": device, "dtype": dtype, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "load_average_before": os.getloadavg(), "speculative_config": spec,
              "proposer": kind, "max_tokens": max_tokens, "repeats": repeats, "engines": list(engines),
              "workloads": {}}
    try:
        for llm in engines.values():   # warm-up, untimed: a request of each workload
            run(llm, [GROUNDED[0], FREE[0]], max_tokens)   # (its timings dropped)
        for name, prompts in (("grounded", GROUNDED), ("free", FREE)):
            before = {engine_name: _spec_counts(llm) for engine_name, llm in engines.items()}
            seconds = dict.fromkeys(engines, 0.0)
            parts = {engine_name: dict.fromkeys(REQUEST_PARTS, 0.0) for engine_name in engines}
            outputs = {}
            host = {engine_name: {} for engine_name in engines}
            for _ in range(repeats):
                for engine_name, llm in engines.items():
                    with step_parts(llm) as in_steps:
                        outputs[engine_name], took, spent = run(llm, prompts, max_tokens)
                    seconds[engine_name] += took
                    for key, value in spent.items():
                        parts[engine_name][key] += value
                    for key, value in in_steps.items():
                        host[engine_name][key] = host[engine_name].get(key, 0.0) + value
            num_tokens = sum(len(o) for o in outputs["plain"]) * repeats
            drafts, draft_tokens, accepted = (now - then for now, then in zip(_spec_counts(engines[kind]),
                                                                               before[kind]))
            row = {"prompts": len(prompts), "output_tokens": num_tokens,
                   "plain_tokens_per_s": num_tokens / seconds["plain"],
                   f"{kind}_tokens_per_s": num_tokens / seconds[kind],
                   "speedup": seconds["plain"] / seconds[kind],
                   "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                   "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
                   "identical_outputs": all(outputs[e] == outputs["plain"] for e in engines),
                   # where the outputs part (bf16: verification's batched forward may round a near-tie apart)
                   "same_leading_tokens": [_same_prefix(a, b) for a, b in zip(outputs["plain"], outputs[kind])],
                   "output_lengths": [len(o) for o in outputs["plain"]]}
            for variant, prefix in (("graphs", "graphs"), ("graphs_few_rows", "few_rows_graphs")):
                if f"{kind}_{variant}" in engines:
                    row[f"{kind}_{variant}_tokens_per_s"] = num_tokens / seconds[f"{kind}_{variant}"]
                    row[f"{prefix}_speedup"] = seconds["plain"] / seconds[f"{kind}_{variant}"]
                    row[f"{prefix}_same_leading_tokens"] = [_same_prefix(a, b) for a, b in
                                                            zip(outputs["plain"], outputs[f"{kind}_{variant}"])]
            # Where a request's time goes on each side, ms a request (REQUEST_PARTS).
            row["per_request_ms"] = {engine_name: {key: 1000.0 * value / (len(prompts) * repeats)
                                                   for key, value in spent.items()}
                                     for engine_name, spent in parts.items()}
            # Where a step's host time goes on each side, ms a step (STEP_PARTS), prefill steps included.
            row["step_parts_ms"] = {engine_name: {key: 1000.0 * value / timed["steps"] for key, value in timed.items()
                                                  if key != "steps"}
                                    for engine_name, timed in host.items() if timed.get("steps")}
            # A step's time on each side, prefill included (about: tokens per step are 1 plain, the mean accepted
            # length with drafts): what a verification step costs against a decode step.
            row["plain_step_ms"] = 1000.0 / row["plain_tokens_per_s"]
            row[f"{kind}_step_ms"] = (1000.0 * row["mean_accepted_length"] / row[f"{kind}_tokens_per_s"]
                                      if row["mean_accepted_length"] else None)
            report["workloads"][name] = row
            label = "n-gram" if kind == "ngram" else "draft model"
            log(f"{name:8s}: plain {row['plain_tokens_per_s']:6.1f} tok/s, {label} {row[f'{kind}_tokens_per_s']:6.1f} "
                f"tok/s, speedup {row['speedup']:.2f}x"
                + (f", in graphs {row[f'{kind}_graphs_tokens_per_s']:6.1f} tok/s "
                   f"({row['graphs_speedup']:.2f}x)" if "graphs_speedup" in row else "")
                + (f", in graphs with the few-row layers {row[f'{kind}_graphs_few_rows_tokens_per_s']:6.1f} tok/s "
                   f"({row['few_rows_graphs_speedup']:.2f}x)" if "few_rows_graphs_speedup" in row else "")
                + f", acceptance {row['acceptance_rate']:.2f}, mean accepted length "
                f"{row['mean_accepted_length']:.2f}, identical {row['identical_outputs']}")
            log(f"{name:8s}: a request's ms (to the first token / decoding / the rest): " + "; ".join(
                f"{engine_name} {t['first_token']:.1f} / {t['decode']:.1f} / {t['rest']:.1f}"
                for engine_name, t in row["per_request_ms"].items()))
            log(f"{name:8s}: a step's host ms: " + "; ".join(
                f"{engine_name} " + ", ".join(f"{part} {ms:.2f}" for part, ms in t.items())
                for engine_name, t in row["step_parts_ms"].items()))
    finally:
        for llm in engines.values():
            llm.llm_engine.shutdown()
    report["load_average_after"] = os.getloadavg()
    return report


def _spec_counts(llm) -> tuple[int, int, int]:
    stats = llm.llm_engine.spec_decode_stats
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: the default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--draft-model", help="propose with this draft model (a HF directory; the model itself works: "
                                              "every draft accepted) instead of n-gram lookups")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the engines taking turns in each")
    parser.add_argument("--out", default=None, help="write <date>-spec-decode-cpu-<cpu>.json here")
    args = parser.parse_args(argv)
    from engine.default_model import default_model_path

    report = measure(args.model or default_model_path(), num_speculative_tokens=args.num_speculative_tokens,
                     max_tokens=args.max_tokens, repeats=args.repeats, draft_model=args.draft_model,
                     log=lambda line: print(line, flush=True))
    if args.out:
        from bench.report import write_cpu_report
        print(f"wrote {write_cpu_report(args.out, 'spec-decode-cpu', report)}")
    return report


if __name__ == "__main__":
    main()
