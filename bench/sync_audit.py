"""How often a step makes the host wait for the GPU, per kind of step (issue: the GPU engine's host never waits).

    PYTHONPATH=. python -m bench.sync_audit [--model qwen3-0.6b] [--json FILE]     (also bench.gpu_suite phase 10)

For each kind of step, an engine (dummy weights, token-id prompts, async scheduling where it applies) is brought to
steady decoding, then a few steps run under ``torch.cuda.set_sync_debug_mode("warn")`` and every synchronizing CUDA
call they make is counted, with where it came from (the innermost engine frame). The one deliberate wait, the read
of the previous step's sampled ids one step late (engine/worker/sampler.py SampledIds.resolve), runs with the
mode off and is counted apart. Kinds:

- ``decode_greedy``: greedy rows (the nano-vllm workload's);
- ``decode_sampled``: temperature with top-k, top-p, min-p and repetition/presence penalties, some rows seeded;
- ``decode_sampled_fused``: the sampler's fused draw (DevicePolicy.fused_sampler: pagedkernels.sample_from_logits, which
  draws batches without top-k / top-p), half the rows at temperature alone (with penalties, some seeded), half with
  min-p (the kernel's mask);
- ``speculative``: n-gram speculative decoding (which runs without async scheduling: its rejection sampling reads
  the accepted counts on the host, ModelRunner._read_speculative, counted apart as ``speculative_reads_per_step``);
- ``speculative_draft``: a draft model's speculative decoding (the model as its own draft, k = 3): the same read, and
  the proposal's one read of its drafts (DraftModel._read), counted apart as ``draft_reads_per_step``;
- ``guided``: a regex grammar (xgrammar; not on the GPU image, reported as not run there).

On CPU (``--dry-run``, CI) the same code runs with tiny shapes and no counting (there is no device to wait for).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import warnings

import torch

KINDS = ("decode_greedy", "decode_sampled", "decode_sampled_fused", "speculative", "speculative_draft", "guided")
WARMUP_STEPS = 4
MEASURED_STEPS = 6


def _params(kind: str, index: int):
    from engine import SamplingParams
    from engine.sampling_params import GuidedDecodingParams

    if kind == "decode_sampled":
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                              presence_penalty=0.2, seed=index if index % 2 else None, max_tokens=64,
                              ignore_eos=True)
    if kind == "decode_sampled_fused":
        if index % 2:
            return SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.2,
                                  seed=index if index % 4 == 1 else None, max_tokens=64, ignore_eos=True)
        return SamplingParams(temperature=0.8, min_p=0.02, max_tokens=64, ignore_eos=True)
    if kind == "guided":
        return SamplingParams(temperature=0, max_tokens=64,
                              guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{20,60}"))
    return SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def audit_kind(kind: str, model_dir: str, device: torch.device, *, num_requests: int, prompt_len: int) -> dict:
    """Steady-state steps of one kind (see the module docstring): syncs per step and where they come from."""
    from engine import LLM
    from engine.worker import sampler as sampler_module

    if kind == "guided":
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            return {"kind": kind, "not_run": "xgrammar is not installed"}
    speculative = {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
                   "speculative_draft": {"model": model_dir, "num_speculative_tokens": 3}}.get(kind)
    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=kind != "guided", device=str(device),
              max_model_len=512, max_num_seqs=max(num_requests, 8), gpu_memory_utilization=0.5,
              speculative_config=speculative, enforce_eager=device.type != "cuda")
    engine = llm.llm_engine
    if kind == "decode_sampled_fused":
        engine.model_runner.sampler.fused_draw = True
    try:
        vocab = engine.model_config.vocab_size
        for i in range(num_requests):
            # A repeated span so that n-gram speculation finds drafts.
            span = [(7 * i + 3 * j) % min(vocab, 1000) + 1 for j in range(16)]
            prompt = (span * (prompt_len // 16 + 1))[:prompt_len]
            engine.add_request(f"{kind}-{i}", {"prompt_token_ids": prompt}, _params(kind, i))
        for _ in range(WARMUP_STEPS):
            engine.step()
        counting = device.type == "cuda"
        deliberate = [0]
        resolve = sampler_module.SampledIds.resolve

        def unwatched(read, *args):   # a deliberate read: with the mode off, counted apart by its caller
            if not counting:
                return read(*args)
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return read(*args)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        def resolve_counted(self):   # the one allowed wait
            if self.values is None:
                deliberate[0] += 1
            return unwatched(resolve, self)

        sampler_module.SampledIds.resolve = resolve_counted
        restores = [lambda: setattr(sampler_module.SampledIds, "resolve", resolve)]
        from engine.worker.draft_model import DraftModel
        from engine.worker.model_runner import ModelRunner

        def count_apart(cls, name: str, counter: list[int]) -> None:   # a deliberate static read, counted apart
            original = cls.__dict__[name]
            restores.append(lambda: setattr(cls, name, original))

            def counted(*args):
                counter[0] += 1
                return unwatched(original.__func__, *args)

            setattr(cls, name, staticmethod(counted))

        # A speculative step's read of its tokens and accepted counts (ModelRunner._read_speculative: the next
        # schedule needs them, so these steps run without async scheduling), and a draft model's proposal's one read
        # of its drafts (DraftModel._read): counted apart too, and reported.
        speculative_reads, draft_reads = [0], [0]
        count_apart(ModelRunner, "_read_speculative", speculative_reads)
        count_apart(DraftModel, "_read", draft_reads)
        per_step, origins = [], collections.Counter()
        try:
            for _ in range(MEASURED_STEPS):
                if not engine.has_unfinished_requests():
                    break
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if counting:
                        torch.cuda.set_sync_debug_mode("warn")
                    try:
                        engine.step()
                    finally:
                        if counting:
                            torch.cuda.set_sync_debug_mode(0)
                syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
                per_step.append(len(syncs))
                for w in syncs:
                    origins[f"{os.path.basename(w.filename)}:{w.lineno}"] += 1
        finally:
            for restore in restores:
                restore()
        steps = max(len(per_step), 1)
        return {"kind": kind, "steps": len(per_step), "async_scheduling": engine.config.scheduler_config.async_scheduling,
                "syncs_per_step": sum(per_step) / steps if counting else None, "syncs_each_step": per_step if counting
                else None, "deliberate_reads_per_step": deliberate[0] / steps,
                "speculative_reads_per_step": speculative_reads[0] / steps, "draft_reads_per_step": draft_reads[0] / steps,
                "origins": dict(origins.most_common(8))}
    finally:
        engine.shutdown()
        del llm, engine
        torch.cuda.empty_cache() if device.type == "cuda" else None


def run(device: torch.device, *, tiny: bool, model: str = "qwen3-0.6b", kinds=KINDS, log=print,
        results: dict | None = None, on_progress=None) -> dict:
    """Audit each of ``kinds``; ``results`` (a dict to fill in place, so a caller cut at its budget keeps the kinds
    done) gets a row per kind, and ``on_progress()`` runs after each."""
    from bench import engine_gpu

    results = {} if results is None else results
    results.update(model=model, kinds=[])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = engine_gpu.write_config_dir(os.path.join(tmp, model), model, tiny=tiny)
        for kind in kinds:
            try:
                row = audit_kind(kind, model_dir, device, num_requests=4 if tiny else 64,
                                 prompt_len=32 if tiny else 256)
            except Exception as e:   # one kind failing must not hide the others
                row = {"kind": kind, "error": f"{type(e).__name__}: {e}"}
            results["kinds"].append(row)
            log(f"sync audit {kind}: " + (row.get("not_run") or row.get("error") or
                                         f"{row['syncs_per_step']} syncs/step, "
                                         f"{row['deliberate_reads_per_step']:.2f} deliberate reads/step, "
                                         f"{row['speculative_reads_per_step']:.2f} speculative reads/step, "
                                         f"{row['draft_reads_per_step']:.2f} draft reads/step, "
                                         f"origins {row['origins']}"))
            if on_progress is not None:
                on_progress()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no counting")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    results = run(device, tiny=device.type == "cpu", model=args.model, kinds=args.kinds.split(","))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
