"""SmolLM2-135M-Instruct from its GGUF, weights kept quantized, against the float32 engine and llama.cpp, on
this CPU, in one run: ``python -m bench.quant_engine_cpu``.

Sides (all engine sides run float32 activations on the CPU):

- ``fp32``: the engine on the converted directory (engine.default_model.default_model_path(): the GGUF's
  Q4_1 weights de-quantized by transformers, stored bf16, run in float32): the engine's default model.
- ``gguf-Q4_1``: the engine on the GGUF file as published (Q4_1 linears, Q8_0 embeddings / tied LM head).
- ``gguf-Q8_0`` / ``gguf-Q4_0``: the same file with its linears re-quantized from their float values with the
  ``gguf`` package's quantizer (no such files are published offline; token embeddings stay Q8_0).
- ``gguf-Q4_1-wq`` (``--wq``): the published file with its blocks converted once into pagedkernels'
  int4/int8 layout (``quant_formats.gguf_to_wq``) and multiplied by ``wq_gemm`` instead of ``gguf_gemm``.
- ``llama.cpp-<type>``: llama-cpp-python on the same GGUF files (its own greedy sampler, ``--threads``).

Measurements:

1. Single stream, as bench/engine_cpu.py: one request, a ``--single-prompt-len`` prompt and
   ``--single-new-tokens`` greedy tokens, best of ``--repeats`` runs, the sides taking turns (each round runs
   every side once), decode tokens/s = (N - 1) / (t(N) - t(1)).
2. Greedy agreement on text: 16 chat prompts (chat template), ``--chat-new-tokens`` greedy tokens each, every
   side against fp32: the share of identical outputs, and the mean share of each output's tokens before the
   first difference.
3. The 48-request workload of bench/engine_cpu.py (``make_requests``: lengths 16-128, seeded, greedy,
   ``ignore_eos``) on the engine sides (``--llama-cpp-workload``: llama.cpp too, one request after another):
   output tokens/s, and the same greedy agreement with fp32.

Run it on a quiet machine: ``uptime`` (load averages) before and after is recorded in the JSON
(``--out``, e.g. bench/results/2026-11-25-quant-engine-cpu.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

from bench.engine_cpu import Request, make_requests, single_stream, timed


CHAT_PROMPTS = [
    "What is the capital of France?", "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.", "What is 12 times 7?", "Explain photosynthesis in one paragraph.",
    "Translate 'good morning' into Spanish and German.", "Write a haiku about the sea.",
    "What are the main differences between a list and a tuple in Python?", "Who wrote Pride and Prejudice?",
    "Suggest a name for a bakery.", "How do I boil an egg?", "Summarize the plot of Romeo and Juliet.",
    "What is the boiling point of water in Fahrenheit?", "List three prime numbers greater than 50.",
    "Why is the sky blue?", "Write a short email declining a meeting invitation.",
]


def requantize_gguf(src: str, dst: str, quant_type: str) -> str:
    """Copy GGUF file ``src`` to ``dst`` with its layer linears (``blk.*.weight``, 2-D) re-quantized to
    ``quant_type`` from their float values (``gguf.quants``; Q8_0, Q4_0, Q4_1, F32, F16); metadata, norms and the
    token embeddings stay as they are. The q/k rows stay in the file's (llama.cpp's permuted) order."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    target = T[quant_type]
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.name.startswith("blk.") and len(shape) == 2:
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            if quant_type == "F32":
                writer.add_tensor(t.name, values)
            elif quant_type == "F16":
                writer.add_tensor(t.name, values.astype(np.float16))
            else:
                writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


class EngineSide:
    """The engine on a model directory or GGUF file, float32 on the CPU. ``gguf_kernel``: "gguf" (gguf_gemm
    on the blocks) or "wq" (converted to the int4/int8 layout for wq_gemm)."""

    def __init__(self, name: str, model: str, *, gguf_kernel: str = "gguf", num_kv_blocks: int = 800):
        from engine import LLM, SamplingParams
        from engine.layers.quantization import gguf as gguf_method

        self.name, self.model = name, model
        self.SamplingParams = SamplingParams
        previous, gguf_method.CPU_KERNEL = gguf_method.CPU_KERNEL, gguf_kernel
        try:
            start = time.perf_counter()
            self.llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks, max_model_len=512)
            self.load_seconds = time.perf_counter() - start
        finally:
            gguf_method.CPU_KERNEL = previous

    def generate(self, requests: list[Request]) -> list[list[int]]:
        params = [self.SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


class LlamaCppSide:
    """llama-cpp-python on a GGUF file: one sequence at a time, greedy (top_k=1), ``threads`` threads."""

    def __init__(self, name: str, model: str, threads: int):
        from llama_cpp import Llama

        self.name, self.model = name, model
        start = time.perf_counter()
        self.llm = Llama(model_path=model, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.load_seconds = time.perf_counter() - start

    def generate(self, requests: list[Request]) -> list[list[int]]:
        outputs = []
        for r in requests:
            tokens: list[int] = []
            for token in self.llm.generate(r.prompt_token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                           reset=True):
                tokens.append(token)
                if len(tokens) == r.output_len:
                    break
            outputs.append(tokens)
        return outputs


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of identical outputs, and the mean share of each output's tokens before its first difference."""
    identical = sum(a == b for a, b in zip(outputs, reference))
    prefix = []
    for a, b in zip(outputs, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(b), 1))
    return {"identical": identical, "requests": len(reference), "identical_share": identical / len(reference),
            "mean_common_prefix_share": sum(prefix) / len(prefix)}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_engine_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_1,Q8_0,Q4_0", help="GGUF weight types (Q4_1: the published file)")
    parser.add_argument("--wq", action="store_true", help="also the Q4_1 file through gguf_to_wq + wq_gemm")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    parser.add_argument("--single-prompt-len", type=int, default=32)
    parser.add_argument("--single-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-workload", action="store_true", help="single stream only")
    parser.add_argument("--llama-cpp-workload", action="store_true",
                        help="llama.cpp runs the workload too (one request after another: no batching)")
    parser.add_argument("--chat-new-tokens", type=int, default=64)
    parser.add_argument("--work-dir", default=None, help="where the re-quantized GGUFs go (default: the cache dir)")
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args(argv)

    from engine.default_model import cache_dir, default_model_gguf_path, default_model_path

    uptime_before = _uptime()
    print(f"uptime before: {uptime_before}", flush=True)
    published = default_model_gguf_path()
    work = args.work_dir or cache_dir()
    files = {}
    for quant_type in args.types.split(","):
        if quant_type == "Q4_1":
            files[quant_type] = published
            continue
        path = os.path.join(work, f"SmolLM2-135M-Instruct.{quant_type}.from-Q4_1.gguf")
        if not os.path.isfile(path):
            print(f"writing {path}", flush=True)
            requantize_gguf(published, path + ".partial", quant_type)
            os.replace(path + ".partial", path)
        files[quant_type] = path

    sides = [EngineSide("fp32", default_model_path())]
    sides += [EngineSide(f"gguf-{t}", p) for t, p in files.items()]
    if args.wq:
        sides.append(EngineSide("gguf-Q4_1-wq", published, gguf_kernel="wq"))
    llama_cpp_error = None
    if not args.no_llama_cpp:
        try:
            sides += [LlamaCppSide(f"llama.cpp-{t}", p, args.threads) for t, p in files.items()]
        except ImportError as e:
            llama_cpp_error = f"llama-cpp-python is not installed: {e}"
            print(llama_cpp_error, flush=True)
    for side in sides:
        print(f"{side.name}: loaded in {side.load_seconds:.1f} s", flush=True)

    vocab = 49152
    prompt = make_requests(1, args.single_prompt_len, args.single_prompt_len, vocab, args.seed + 1)[0].prompt_token_ids
    stream = single_stream(sides, prompt, args.single_new_tokens, repeats=args.repeats)
    for name, row in stream.items():
        print(f"single stream {name:>18}: {row['decode_tokens_per_s']:6.1f} decode tok/s", flush=True)
    reference = sides[0].generate([Request(prompt, args.single_new_tokens)])[0]
    stream_outputs = {s.name: s.generate([Request(prompt, args.single_new_tokens)]) for s in sides[1:]}
    stream_agreement = {name: agreement(out, [reference]) for name, out in stream_outputs.items()}
    # The engine against llama.cpp on the same file (both quantize activations to int8 per 32 values).
    for name, out in stream_outputs.items():
        if name.startswith("llama.cpp-") and f"gguf-{name.removeprefix('llama.cpp-')}" in stream_outputs:
            stream_agreement[f"gguf-{name.removeprefix('llama.cpp-')} vs {name}"] = agreement(
                stream_outputs[f"gguf-{name.removeprefix('llama.cpp-')}"], out)

    # Greedy agreement on text: chat prompts through the chat template (random-token prompts, as the workload's,
    # give flat next-token distributions where any rounding flips the greedy choice).
    tokenizer = sides[0].llm.get_tokenizer()
    chat = [Request(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                   add_generation_prompt=True),
                                     add_special_tokens=False), args.chat_new_tokens) for q in CHAT_PROMPTS]
    chat_outputs = {s.name: s.generate(chat) for s in sides}
    chat_agreement = {s.name: agreement(chat_outputs[s.name], chat_outputs["fp32"]) for s in sides[1:]}
    for name in list(chat_outputs):   # the engine against llama.cpp on the same file
        twin = f"gguf-{name.removeprefix('llama.cpp-')}"
        if name.startswith("llama.cpp-") and twin in chat_outputs:
            chat_agreement[f"{twin} vs {name}"] = agreement(chat_outputs[twin], chat_outputs[name])
    for name, row in chat_agreement.items():
        print(f"chat agreement {name:>32}: {row['identical']}/{row['requests']} identical, "
              f"{row['mean_common_prefix_share']:.2f} common prefix", flush=True)

    workload = {}
    if not args.skip_workload:
        requests = make_requests(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
        engine_sides = [s for s in sides if isinstance(s, EngineSide) or args.llama_cpp_workload]
        fp32_outputs = None
        for side in engine_sides:
            outputs, seconds = timed(side.generate, requests)
            tokens = sum(len(o) for o in outputs)
            row = {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}
            if fp32_outputs is None:
                fp32_outputs = outputs
            else:
                row["greedy_agreement_with_fp32"] = agreement(outputs, fp32_outputs)
            workload[side.name] = row
            print(f"workload {side.name:>18}: {row['output_tokens_per_s']:6.1f} output tok/s "
                  f"{row.get('greedy_agreement_with_fp32', '')}", flush=True)

    uptime_after = _uptime()
    print(f"uptime after: {uptime_after}", flush=True)
    result = {
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m bench.quant_engine_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "uptime_before": uptime_before, "uptime_after": uptime_after},
        "files": {t: os.path.basename(p) for t, p in files.items()},
        "load_seconds": {s.name: s.load_seconds for s in sides},
        "single_stream": stream,
        "single_stream_agreement_with_fp32": stream_agreement,
        "chat_new_tokens": args.chat_new_tokens,
        "chat_agreement_with_fp32": chat_agreement,
        "workload": workload,
        "llama_cpp_error": llama_cpp_error,
    }
    for side in sides:   # llama-cpp-python frees its model at exit badly (an ignored TypeError); close it here
        if isinstance(side, LlamaCppSide):
            side.llm.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
