"""Mixture-of-experts on this CPU, float32, each figure a ratio measured in the same run:
``python -m bench.moe_cpu [--quick] [--out DIR]``.

The model is made here, not downloaded: a Qwen3-MoE of random weights (``SHAPE``: 16 layers, hidden 1024, 8
experts of intermediate 1024, top-2 renormalized, 16 query heads on 4 KV heads of 64, a 32768-token vocabulary;
510 M parameters, 180 M active per token), written once into ``--model-dir`` (default a temporary directory) as a
checkpoint both sides load. Its values are rounded to bf16, as a bf16 checkpoint's are (the engine's CPU path then
keeps the experts in 16-bit panels, as for a published MoE model); its tokenizer is a word-level one with a token
per id (the workloads are token ids).

1. Engine vs transformers, bench.engine_cpu's protocol and sides (transformers in a process of its own, its
   default MoE implementation, recorded in the report): ``--num-requests`` (48) greedy requests of 16-128 prompt and
   output tokens, all at once, and a single stream (decode tokens/s from t(N) - t(1)). Useful FLOPs count each
   token's active experts only. Goals: >= 5x transformers' output tokens/s over the 48 requests, >= 3x its
   single-stream decode.
2. The kernel alone: ``pagedkernels.fused_moe`` as the engine runs it on the CPU (native kernel, bf16 panels)
   against the per-expert loop (its PyTorch twin, transformers' eager loop over the experts: a float32 GEMM of each
   expert's tokens) and against transformers' own experts module in its default implementation, at 1, 16 and 256
   tokens of the model's layer shape (routing drawn from a softmax of random logits); best of ``--repeats``.

``--dtypes float32,bfloat16`` adds an engine side running the model in bf16 (what ``dtype="auto"`` picks for a bf16
checkpoint on a CPU with AMX or AVX512-BF16; the report's comparisons give its figures against the float32 side's
and their greedy agreement) and to each kernel row the bf16 model's call (hidden states in bf16).

``--quick`` runs the same code on a tiny model (2 layers, hidden 128, 4 experts) and a few requests: it checks the
code path; its numbers mean nothing. Figures are printed; ``--out DIR`` writes ``DIR/<date>-moe-cpu-<cpu>.json``.
As bench.engine_cpu: compare runs at a low load average only (it is recorded before and after).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

import pagedkernels as pk
from bench import engine_cpu
from bench.report import write_cpu_report
from pagedkernels import _native

# config.json of the benchmark model (Qwen3-MoE layout).
SHAPE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=3072,
             moe_intermediate_size=1024, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[], vocab_size=32768, max_position_embeddings=4096,
             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
             initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
QUICK_SHAPE = dict(SHAPE, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, moe_intermediate_size=96, num_experts=4, vocab_size=1024)
KERNEL_TOKENS = (1, 16, 256)
QUICK_KERNEL_TOKENS = (1, 4, 16)


def write_model_dir(out_dir: str, shape: dict, seed: int = 0) -> str:
    """A random-weight checkpoint of ``shape`` (values rounded to bf16, stored as float32) with a word-level
    tokenizer of one token per id, in ``out_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(shape, f, indent=1)
    config = AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(out_dir)
    return out_dir


def active_flop_model(model_dir: str) -> engine_cpu.FlopModel:
    """bench.engine_cpu's FlopModel with each expert's matrices counted at the share of tokens that route to it
    (top_k of num_experts): the FLOPs a token needs, not the model's total."""
    from safetensors import safe_open

    flops = engine_cpu.FlopModel.from_model_dir(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    experts = 0
    for path in sorted(os.listdir(model_dir)):
        if path.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, path), framework="pt") as f:
                for name in f.keys():
                    if ".experts." in name:
                        shape = f.get_slice(name).get_shape()
                        experts += shape[0] * shape[1]
    share = config["num_experts_per_tok"] / config.get("num_experts", config.get("num_local_experts"))
    flops.matrix_params = flops.matrix_params - experts + round(experts * share)
    return flops


def _bf16_row(x, packed, w13, w2, weights, ids, repeats: int, float32_ms: float, flops: int) -> dict:
    """The bf16 model's call of one kernel row: hidden states and routing weights in bf16, its time and check."""
    xb, wb = x.bfloat16(), weights.bfloat16()
    with torch.inference_mode():
        with pk.use_backend("native" if _native.library() is not None else "torch"):
            out = pk.fused_moe(xb, *packed, wb, ids)
            ms = best_ms(lambda: pk.fused_moe(xb, *packed, wb, ids), repeats)
        with pk.use_backend("torch"):
            loop = pk.fused_moe(xb.float(), w13, w2, wb.float(), ids)
    error, scale = (out.float() - loop).abs().max().item(), loop.abs().max().item()
    # bf16 rounds the output, and on the pair-dot path the activated rows, each to 2^-8 of the value
    bound = 2 * 2.0 ** -8 * max(scale, 1e-3) + 1e-5
    return {"kernel_bf16_ms": ms, "kernel_bf16_gflops": flops / ms / 1e6, "bf16_over_float32": ms / float32_ms,
            "bf16_path": _native.bf16_dot_path() if _native.library() is not None else "torch",
            "bf16_max_abs_diff": error,
            "bf16_check": "ok" if error <= bound else f"FAILED: {error:.3g} off the loop (max |out| {scale:.3g})"}


# ------------------------------------------------------------------------------------------------
# the kernel alone
# ------------------------------------------------------------------------------------------------


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def kernel_vs_loop(shape: dict, tokens_list, repeats: int, seed: int = 0, bf16: bool = False) -> list[dict]:
    """fused_moe (native, bf16 panels) against the per-expert loop and transformers' experts module, at each
    token count of ``tokens_list``, on one layer of ``shape`` with random bf16-valued weights. ``bf16``: also the
    kernel as a bf16 model runs it (the same rows rounded to bf16 in and out; pair dot products where the build has
    AVX512-BF16), checked against the float32 loop on the rounded rows at bf16's precision."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, experts, top_k = (shape[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                                                        "num_experts_per_tok"))
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).bfloat16().float()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).bfloat16().float()
    packed = (pk.pack_moe_weight(w13, torch.bfloat16), pk.pack_moe_weight(w2, torch.bfloat16))
    # One layer of the model as transformers builds it: its experts module in the implementation it picks.
    config = AutoConfig.for_model("qwen3_moe", **{k: v for k, v in shape.items() if k not in ("architectures",
                                                                                              "model_type")})
    config.num_hidden_layers = 1
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf_experts = hf_model.model.layers[0].mlp.experts
    implementation = hf_model.config._experts_implementation
    with torch.no_grad():
        hf_experts.gate_up_proj.copy_(w13)
        hf_experts.down_proj.copy_(w2)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, generator=gen)
        weights, ids = pk.moe_topk(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
        with torch.inference_mode():
            with pk.use_backend("native" if _native.library() is not None else "torch"):
                kernel = pk.fused_moe(x, *packed, weights, ids)
                kernel_ms = best_ms(lambda: pk.fused_moe(x, *packed, weights, ids), repeats)
            with pk.use_backend("torch"):
                loop = pk.fused_moe(x, w13, w2, weights, ids)
                loop_ms = best_ms(lambda: pk.fused_moe(x, w13, w2, weights, ids), repeats)
            hf = hf_experts(x, ids.long(), weights)
            hf_ms = best_ms(lambda: hf_experts(x, ids.long(), weights), repeats)
        error = max((kernel - loop).abs().max().item(), (hf - loop).abs().max().item())
        scale = loop.abs().max().item()
        active = int(torch.unique(ids).numel())
        weight_bytes = active * 3 * hidden * inter * 2   # the bf16 panels the kernel streams
        rows.append({"tokens": tokens, "active_experts": active, "transformers_experts_implementation": implementation, "kernel_ms": kernel_ms, "per_expert_loop_ms": loop_ms,
                     "transformers_experts_ms": hf_ms, "ratio_vs_loop": loop_ms / kernel_ms,
                     "ratio_vs_transformers": hf_ms / kernel_ms,
                     "kernel_weight_gbps": weight_bytes / kernel_ms / 1e6,
                     "kernel_gflops": 2 * tokens * top_k * 3 * hidden * inter / kernel_ms / 1e6,
                     "max_abs_diff": error, "check": "ok" if error <= 1e-4 * max(scale, 1e-3) + 1e-6 else
                     f"FAILED: {error:.3g} off the loop (max |out| {scale:.3g})"})
        print(f"fused_moe {tokens} tokens ({active} experts): kernel {kernel_ms:.3f} ms, per-expert loop "
              f"{loop_ms:.3f} ms ({rows[-1]['ratio_vs_loop']:.2f}x), transformers' experts "
              f"({implementation}) {hf_ms:.3f} ms "
              f"({rows[-1]['ratio_vs_transformers']:.2f}x); check {rows[-1]['check']}", flush=True)
        if bf16:
            rows[-1].update(_bf16_row(x, packed, w13, w2, weights, ids, repeats, kernel_ms,
                                      2 * tokens * top_k * 3 * hidden * inter))
            print(f"  bf16 hidden states ({rows[-1]['bf16_path']}): kernel {rows[-1]['kernel_bf16_ms']:.3f} ms "
                  f"({rows[-1]['kernel_bf16_gflops']:.0f} GFLOP/s, {rows[-1]['bf16_over_float32']:.2f}x the float32 "
                  f"hidden states' time); check {rows[-1]['bf16_check']}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload: checks the code path only")
    parser.add_argument("--model-dir", help="where the random-weight model is (written there when missing)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 48 (quick: 4)")
    parser.add_argument("--repeats", type=int, default=None, help="kernel timings: best of this many (quick: 2)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for both sides (default: torch's)")
    parser.add_argument("--skip-transformers", action="store_true", help="engine figures only")
    parser.add_argument("--dtypes", default="float32",
                        help="the engine sides' dtypes, comma-separated (float32, bfloat16): bfloat16 adds an engine "
                             "side running the model in bf16 (as dtype='auto' does on a CPU with AMX or AVX512-BF16) "
                             "and the kernel's bf16 rows; the ratios against transformers are the float32 side's")
    parser.add_argument("--out", help="directory for <date>-moe-cpu-<cpu>.json (e.g. bench/results)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else SHAPE
    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="moe-cpu-")
        model_dir = tmp.name
    try:
        if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
            print(f"writing the random-weight model to {model_dir}", flush=True)
            write_model_dir(model_dir, shape)
        report = run(args, shape, model_dir)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.out:
        print(f"wrote {write_cpu_report(args.out, 'moe-cpu', report)}")
    return 0


def run(args, shape: dict, model_dir: str) -> dict:
    quick = args.quick
    num_requests = args.num_requests or (4 if quick else 48)
    measure = SimpleNamespace(model=model_dir, seed=0, min_len=4 if quick else 16, max_len=12 if quick else 128,
                              single_new_tokens=8 if quick else 128, hf_batch_size=None,
                              matmul_n=256 if quick else 2048)
    flop_model = active_flop_model(model_dir)
    requests = engine_cpu.make_requests(num_requests, measure.min_len, measure.max_len, flop_model.vocab_size,
                                        measure.seed)
    single_prompt = engine_cpu.make_requests(1, 32 if not quick else 6, 32 if not quick else 6, flop_model.vocab_size,
                                             measure.seed + 1)[0].prompt_token_ids
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "float32" or any(d not in ("float32", "bfloat16") for d in dtypes):
        raise SystemExit(f"--dtypes {args.dtypes!r}: float32 first (the side compared with transformers), then "
                         "optionally bfloat16")
    load_before = os.getloadavg()
    matmul_rates = {"float32": engine_cpu.measure_matmul_gflops(measure.matmul_n)}
    if "bfloat16" in dtypes:
        matmul_rates["bfloat16"] = engine_cpu.measure_matmul_gflops(measure.matmul_n, dtype=torch.bfloat16)
    kernels = kernel_vs_loop(shape, QUICK_KERNEL_TOKENS if quick else KERNEL_TOKENS, args.repeats or (2 if quick else 10),
                             bf16="bfloat16" in dtypes)
    sides = [engine_cpu.EngineSide(model_dir, dtype) for dtype in dtypes]
    try:
        if not args.skip_transformers:
            sides.append(engine_cpu.TransformersProcessSide(model_dir, len(requests)))
        report = engine_cpu._measure(measure, sides, requests, single_prompt, flop_model, matmul_rates, load_before,
                                     throughput_goal=5.0, decode_goal=3.0)
    finally:
        for side in sides:
            if isinstance(side, engine_cpu.PipedSide):
                side.close()
    report["model"] = {"shape": {k: v for k, v in shape.items() if k != "architectures"},
                       "weights": "random, bf16-valued (a bf16 checkpoint's values), stored float32",
                       "active_matrix_params": flop_model.matrix_params, "quick": quick}
    report["kernel_vs_loop"] = kernels
    report["environment"].update(python=platform.python_version(), pagedkernels_native=_native.library() is not None)
    report["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return report


if __name__ == "__main__":
    sys.exit(main())
