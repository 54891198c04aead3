"""Engine benchmarks on the GPU (issue 5), each against its alternative in the same run:
``PYTHONPATH=. python -m bench.engine_gpu [--models qwen3-0.6b,llama-3-8b] [--json FILE]`` (also run by
``bench.gpu_suite``, phases headline, engine and llama).

The models are made on the spot, nothing is read or downloaded: a directory holding only the config.json of
the Qwen3-0.6B, Llama-3-8B or Qwen3-30B-A3B (mixture of experts) shape (bf16), loaded with ``load_format="dummy"`` (random weights drawn on the
GPU) and ``skip_tokenizer_init=True`` (the workloads are token ids).

1. Offline throughput, nano-vllm's protocol: 256 requests, seed 0, random prompt token ids, prompt and output
   lengths uniform in [100, 1024], temperature 0.6, ``ignore_eos``, max_model_len 4096. Output tokens/s of the
   engine against transformers on the same requests (a model of the same shape built from the same config on
   the GPU, its own random weights: with ``ignore_eos`` and fixed lengths the work is the same): its
   continuous-batching ``generate_batch`` where the installed version has it (batched ``generate``, left
   padding, if it fails), in output-length-sorted groups of ``--hf-group`` run to the group's longest length
   and credited only the requested tokens.
2. Batch-1 decode (gpt-fast style): tokens/s = (N - 1) / (t(N) - t(1)) and achieved bandwidth =
   (weight bytes + mean KV bytes read per token) x tokens/s, against the measured copy bandwidth (a MoE model's
   experts counted at the share one token reads: top_k of E).
3. Decode-step time at batch 64 and 256 (context ``--context`` tokens each) through the ModelRunner (CUDA
   graphs unless ``--enforce-eager``), against its floor: (weight bytes + KV bytes of the batch) / copy
   bandwidth.
4. Where a step's time goes (``profile``): the throughput workload's first ``PROFILE_REQUESTS`` requests, stepped,
   with ``torch.profiler`` (CPU and CUDA) over steps ``PROFILE_STEPS``: wall time per step and the part of it the
   host spends inside ``execute_model``, the GPU's kernel time per step, and the top CUDA kernels and CPU ops; then
   the next as many steps with the device's activity alone (``gpu_busy_window``: recording the host's ops slows a
   host-bound step), whose kernel time / wall is the busy fraction reported (``gpu_busy_fraction``; the first
   window's is ``gpu_busy_fraction_under_cpu_profiler``). A busy fraction well under 1 says the engine waits on the
   host (scheduling, input preparation, sampling), not on kernels.

Every part checks a ``bench.budget.Budget`` and stops cleanly, marking what it cut (``"complete": false``).
``--dry-run`` runs the same code on CPU with tiny shapes (2-layer models, 8 requests of 4-16 tokens, batch
2/4): it checks the code path only, numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from bench.budget import Budget

# config.json of each shape, the fields the engine and transformers read (values of the published configs).
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, attention_bias=False, hidden_act="silu", initializer_range=0.02,
                  bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, attention_bias=False, hidden_act="silu", initializer_range=0.02,
                 bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
# Qwen3-30B-A3B: 48 layers of 128 experts (768 each), top-8; 30.5 B parameters (61 GB in bf16), 3.3 B active.
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     attention_bias=False, hidden_act="silu", initializer_range=0.02, bos_token_id=151643,
                     eos_token_id=151645, torch_dtype="bfloat16")
_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=512, bos_token_id=1,
             eos_token_id=2)
_TINY_MOE = dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "llama-3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
TINY_SHAPES = {name: dict(shape, **_TINY, **(_TINY_MOE if "num_experts" in shape else {}))
               for name, shape in SHAPES.items()}
# "profile": the step profile of the throughput workload, and of batch-1 decode when "batch1" runs too;
# "batch1_profile": the batch-1 one alone (where a batch-1 step's time goes: the GPU's kernels or the host).
PARTS = ("throughput", "transformers", "batch1", "decode_steps", "profile", "batch1_profile")


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


def compiled_kernel_variants() -> dict[str, int]:
    """How many variants of each pagedkernels Triton kernel this process has compiled (or loaded from Triton's
    disk cache) so far, by kernel: the JIT caches' sizes (empty under the interpreter, which compiles nothing). A
    timed window should add none: the engine compiles what its steps launch at start-up
    (ModelRunner.warm_up_kernels), and a compile in the window (most of a second) would be timed."""
    from pagedkernels._aot import launched_kernels

    counts = {}
    for name, (kernel, _) in launched_kernels().items():
        caches = getattr(kernel, "device_caches", None)   # Triton 3.6 and 3.9: (kernels, keys, target, ...)
        total = sum(len(cache[0]) for cache in caches.values()) if caches else 0
        if total:
            counts[name] = total
    return counts


def new_kernel_variants(before: dict[str, int]) -> dict[str, int]:
    """The variants compiled since ``before`` (compiled_kernel_variants), by kernel."""
    return {name: n - before.get(name, 0) for name, n in compiled_kernel_variants().items() if n > before.get(name, 0)}


def write_config_dir(out_dir: str, name: str, *, tiny: bool) -> str:
    """A model directory holding only the config.json of shape ``name`` (``SHAPES``; tiny: ``TINY_SHAPES``)."""
    shapes = TINY_SHAPES if tiny else SHAPES
    if name not in shapes:
        raise ValueError(f"model must be one of {sorted(shapes)}, got {name!r}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(shapes[name], f, indent=1)
    return out_dir


def make_requests(workload: Workload, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """nano-vllm's bench.py: prompt ids uniform in [0, 10000), lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    high = min(10000, vocab_size) - 1
    return [([rng.randint(0, high) for _ in range(rng.randint(workload.min_len, workload.max_len))],
             rng.randint(workload.min_len, workload.max_len)) for _ in range(workload.num_requests)]


def weight_bytes(model: torch.nn.Module, tokens: int | None = None) -> int:
    """Bytes of every distinct parameter (a tied LM head counts once: read once per token). With ``tokens``, a
    mixture-of-experts layer's experts count at the share a step of that many tokens reads: each token takes top_k
    of E experts, so under uniform routing an expert is read with probability 1 - (1 - top_k / E) ** tokens (one
    token of Qwen3-30B-A3B: 8 of 128 experts; 64 tokens: 98% of them)."""
    from engine.layers.fused_moe import FusedMoE

    share, experts = {}, []
    for module in model.modules():
        if isinstance(module, FusedMoE):
            # on the CPU the experts live in their packed panels (buffers), the parameters emptied
            tensors = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
                       if t is not None and t.numel() and t.is_floating_point()]
            experts += tensors
            read = 1.0 if tokens is None else 1.0 - (1.0 - module.top_k / module.num_experts) ** tokens
            share.update((t.data_ptr(), read) for t in tensors)
    seen, total = set(), 0
    for p in [*model.parameters(), *experts]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size() * share.get(p.data_ptr(), 1.0)
    return int(total)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


def build_seconds(llm) -> dict:
    """Where an engine's start-up went (ModelRunner.build_seconds: the model, the memory profile's forward and the
    KV cache, the graphs), rounded."""
    return {part: round(seconds, 1) for part, seconds in llm.llm_engine.model_runner.build_seconds.items()}


def build_parts(parts: dict) -> str:
    return ", ".join(f"{part} {seconds:.0f} s" for part, seconds in parts.items() if part != "total")


def free_device_memory(device: torch.device) -> None:
    """Release what a dropped engine or model held (compiled graphs keep their module alive until reset)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# 1. offline throughput
# ------------------------------------------------------------------------------------------------


def engine_throughput(llm, requests, temperature: float, budget: Budget, lora_requests: list | None = None) -> dict:
    """All requests queued at once, stepped until done; past the budget the rest is aborted and the result
    says so (``complete`` False, tokens/s over what ran). ``lora_requests``: each request's adapter (an engine
    with LoRA enabled; the warm-up runs every adapter once, so the timing reads none from disk)."""
    from engine import SamplingParams
    from engine.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    warm_loras = list(dict.fromkeys(lora_requests)) if lora_requests else [None, None]
    warm_up = [{"prompt_token_ids": list(range(1, 17))}] * len(warm_loras)
    llm.generate(warm_up, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                 **({"lora_request": warm_loras} if lora_requests else {}))
    synchronize(engine.device)
    variants = compiled_kernel_variants()
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):  # FINAL_ONLY, as LLM.generate (nano-vllm's protocol calls generate)
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY),
                           lora_request=lora_requests[i] if lora_requests else None)
    outputs, complete = {}, True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if budget.expired(margin=5.0):
            complete = False
            for request_id in list(engine.requests):
                outputs[request_id] = engine.abort_request(request_id)
            break
    synchronize(engine.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    exact = complete and all(len(outputs[f"bench-{i}"].outputs[0].token_ids) == n for i, (_, n) in enumerate(requests))
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "complete": complete, "output_lengths_exact": exact,
            "kernel_variants_compiled_in_window": new_kernel_variants(variants)}


PROFILE_REQUESTS = 256
PROFILE_STEPS = (40, 60)   # [start, stop): past the first prefills, into the mixed prefill/decode steady state


def step_profile(llm, requests, temperature: float, steps: tuple[int, int] = PROFILE_STEPS, top: int = 12,
                 lora_requests: list | None = None) -> dict:
    """Steps ``steps`` of the workload ``requests`` under torch.profiler (see the module docstring, part 4); the
    requests are aborted afterwards. ``lora_requests``: each request's adapter (an engine with LoRA enabled)."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams
    from engine.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY),
                           **({"lora_request": lora_requests[i]} if lora_requests else {}))
    run_steps(engine, steps[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    variants = compiled_kernel_variants()
    try:
        with timed_execute_model(engine) as inside, profile(activities=activities) as prof:
            ran, wall = run_steps(engine, steps[1] - steps[0])
        compiled = new_kernel_variants(variants)
        busy = gpu_busy_window(engine, steps[1] - steps[0])
        python = python_profile(engine, steps[1] - steps[0], top)   # (the engine as it is, untimed)
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
    events = prof.key_averages()
    kernels = sorted(kernel_events(events), key=device_us, reverse=True)
    kernel_s = sum(device_us(e) for e in kernels) / 1e6
    cpu_ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    ran = max(ran, 1)
    busy_under_cpu_profiler = kernel_s / wall if kernels else None
    return {"steps": ran, "step_ms": wall / ran * 1e3, "execute_model_ms": inside[0] / ran * 1e3,
            "kernel_ms_per_step": kernel_s / ran * 1e3,
            "gpu_busy_fraction": busy["gpu_busy_fraction"] if busy else busy_under_cpu_profiler,
            "gpu_busy_fraction_under_cpu_profiler": busy_under_cpu_profiler, "gpu_busy_window": busy,
            "top_kernels": [{"name": e.key[:120], "ms_per_step": device_us(e) / 1e3 / ran, "calls": e.count}
                            for e in kernels[:top]],
            "top_cpu_ops": [{"name": e.key[:120], "self_ms_per_step": e.self_cpu_time_total / 1e3 / ran,
                             "calls": e.count} for e in cpu_ops[:top]],
            "python": python, "kernel_variants_compiled_in_window": compiled}


@contextlib.contextmanager
def timed_execute_model(engine):
    """Inside, the engine's ``executor.execute_model`` adds its wall time (seconds) to the yielded list's one entry
    (the runner's share of a step: the batch's update, inputs, forward, sampling); restored on exit."""
    executor = engine.executor
    real_execute = executor.execute_model
    inside = [0.0]

    def timed_execute(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real_execute(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    executor.execute_model = timed_execute
    try:
        yield inside
    finally:
        executor.execute_model = real_execute


def gpu_busy_window(engine, steps: int) -> dict | None:
    """The next ``steps`` steps under torch.profiler with the device's activity alone (CUPTI's kernel records, no host
    op recorded): wall time and kernel time a step, and the GPU-busy fraction. Recording every host op (the CPU
    activity) slows the host, and a step the host bounds (async scheduling overlaps the two) then reads less busy
    than it runs: on the H200 of 2026-11-30 the window with the CPU activity took 9.6 ms a step against 8.3 ms
    unprofiled, busy 0.80 of the slower step. None off CUDA."""
    from torch.profiler import ProfilerActivity, profile

    if engine.device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ran, wall = run_steps(engine, steps)
    kernel_s = sum(device_us(e) for e in kernel_events(prof.key_averages())) / 1e6
    ran = max(ran, 1)
    return {"steps": ran, "step_ms": wall / ran * 1e3, "kernel_ms_per_step": kernel_s / ran * 1e3,
            "gpu_busy_fraction": kernel_s / wall if kernel_s else None}


def run_steps(engine, steps: int) -> tuple[int, float]:
    """Up to ``steps`` engine steps (fewer when the requests run out), the device synchronized after them: (steps
    run, seconds)."""
    done, start = 0, time.perf_counter()
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        done += 1
    synchronize(engine.device)
    return done, time.perf_counter() - start


def device_us(event) -> float:
    """An event's own device time in us (torch >= 2.4 names it self_device_time_total)."""
    return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))


def kernel_events(events) -> list:
    """The device's own events (kernels, copies, memsets) of a profile's key_averages(): each device interval once.
    An aten op's row carries the device time of the kernels it launched too, so summing every row that has device
    time counted each eager op twice (the GPU-busy fractions of the first H100/H200 runs, 0.59/0.69, were really
    about 0.53-0.55/0.61-0.63)."""
    from torch.autograd import DeviceType

    return [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA and device_us(e) > 0]


def python_profile(engine, steps: int, top: int) -> dict:
    """The next ``steps`` steps under cProfile (after torch.profiler's window, not inside it): wall time a step
    without any profiler and with cProfile, and the Python functions with the most own time (which part of the
    host's time is the engine's Python: the GPU waits on it unless it overlaps)."""
    import cProfile
    import pstats

    plain_steps, plain_s = run_steps(engine, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    ran, wall = run_steps(engine, steps)
    profiler.disable()
    ran = max(ran, 1)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top * 2]
    short = lambda key: f"{os.path.basename(key[0])}:{key[1]}({key[2]})"[:120]  # noqa: E731
    return {"steps": ran, "step_ms_unprofiled": plain_s / max(plain_steps, 1) * 1e3,
            "step_ms_under_cprofile": wall / ran * 1e3,
            "top_own_time": [{"function": short(k), "own_ms_per_step": v[2] / ran * 1e3,
                              "cumulative_ms_per_step": v[3] / ran * 1e3, "calls_per_step": v[0] / ran}
                             for k, v in rows]}


def check_generate_batch(outputs: dict, wanted: list[int]) -> None:
    """generate_batch logs a request that failed and returns it with ``error`` set (no exception): a result
    is counted only when every request came back, without an error, with at least the tokens it asked for."""
    results = list(outputs.values())
    if len(results) != len(wanted):
        raise RuntimeError(f"{len(wanted) - len(results)} of {len(wanted)} requests missing from the results")
    errors = [r.error for r in results if getattr(r, "error", None)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(wanted)} requests failed: {errors[0]}")
    short = [(len(r.generated_tokens), n) for r, n in zip(results, wanted) if len(r.generated_tokens) < n]
    if short:
        raise RuntimeError(f"{len(short)} requests came back short (generated, asked): {short[:3]}")


def transformers_throughput(model_dir: str, requests, temperature: float, device: torch.device,
                            dtype: torch.dtype, group: int, budget: Budget) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):  # built on the device with transformers' own random init: no checkpoint
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    pad_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    api = "generate_batch" if hasattr(model, "generate_batch") and device.type == "cuda" else "generate"
    notes = []

    def run_group(indices: list[int]) -> None:
        nonlocal api
        new_tokens = max(requests[i][1] for i in indices)
        gen_config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                                      pad_token_id=pad_id)
        prompts = [requests[i][0] for i in indices]
        if api == "generate_batch":
            try:
                outputs = model.generate_batch(inputs=prompts, generation_config=gen_config, progress_bar=False)
                check_generate_batch(outputs, [requests[i][1] for i in indices])
                return
            except Exception as e:  # an API still settling across versions: fall back, and say so
                api = "generate"
                notes.append(f"generate_batch failed ({type(e).__name__}: {str(e)[:200]}); batched generate used")
        input_ids, mask = left_padded(prompts, pad_id, device)
        model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen_config)

    # no_grad, not inference_mode: generate_batch steps on its own thread, outside an inference-mode context,
    # and updates in place tensors made on this one (RuntimeError "Inplace update to inference tensor").
    with torch.no_grad():
        result = timed_groups(requests, group, run_group, device, budget)
    del model
    free_device_memory(device)
    return dict(result, api=api, notes=notes)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of ``prompts`` padded on the left to the longest (for ``generate``)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, mask


def timed_groups(requests, group: int, run_group, device: torch.device, budget: Budget) -> dict:
    """A batched-generate side's timing: ``requests`` in output-length-sorted groups of ``group``, ``run_group(
    indices)`` warmed up on two of them, then timed over the groups until the budget (a group started always
    ends); credited the requested tokens of the groups run. Call it inside the grad mode the side needs."""
    order = sorted(range(len(requests)), key=lambda i: requests[i][1])
    groups = [order[i:i + group] for i in range(0, len(order), group)]
    run_group(groups[0][:2])  # warm-up
    synchronize(device)
    done = []
    start = time.perf_counter()
    for indices in groups:
        if done and budget.expired(margin=5.0):
            break
        run_group(indices)
        done += indices
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(requests[i][1] for i in done)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "complete": len(done) == len(requests), "requests_run": len(done), "group": group}


# ------------------------------------------------------------------------------------------------
# 2. batch-1 decode and 3. decode-step time
# ------------------------------------------------------------------------------------------------


def batch1_decode(llm, prompt_len: int, new_tokens: int, copy_gbps: float) -> dict:
    from engine import SamplingParams

    device = llm.llm_engine.device
    prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}

    token_ids: list[int] = []

    def run(n: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        synchronize(device)
        elapsed = time.perf_counter() - start
        completion = out[0].outputs[0]
        if len(completion.token_ids) != n:   # a failed step fails its request (finish_reason "error"): no figure
            raise RuntimeError(f"batch-1 decode gave {len(completion.token_ids)} of {n} tokens (finish reason "
                               f"{completion.finish_reason!r}): the engine's log says why")
        token_ids[:] = completion.token_ids
        return elapsed

    run(4)
    t_first = min(run(1) for _ in range(2))
    t_full = min(run(new_tokens) for _ in range(2))
    runner = llm.llm_engine.model_runner
    mean_context = prompt_len + new_tokens / 2
    bytes_per_token = weight_bytes(runner.model, tokens=1) + mean_context * kv_bytes_per_token(runner.config,
                                                                                                runner.dtype)
    result = {"prompt_len": prompt_len, "new_tokens": new_tokens, "t1_s": t_first, "tN_s": t_full,
              "decode_tokens_per_s": None, "bytes_per_token": bytes_per_token, "achieved_gbps": None,
              "frac_of_copy_bandwidth": None, "token_ids": list(token_ids)}
    if t_full > t_first:  # else the timer's noise exceeds the decode time (tiny models): no number
        tokens_per_s = (new_tokens - 1) / (t_full - t_first)
        achieved = bytes_per_token * tokens_per_s / 1e9
        result.update(decode_tokens_per_s=tokens_per_s, achieved_gbps=achieved,
                      frac_of_copy_bandwidth=achieved / copy_gbps)
    result.update(launches_per_decode_step(llm, prompt))
    return result


def batch1_other_layers(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float
                        ) -> tuple[str, dict] | None:
    """batch1_decode on ``llm`` with the other decoder layers for one row than its own (``default``, its
    batch1_decode): cuBLAS where the engine runs the few-row layers (pagedkernels.skinny_gemm, its CUDA default),
    else the few-row layers; then back. Returns ("batch1_cublas" or "batch1_skinny", the result with the few-row
    layers' speedup over cuBLAS), or None where the model cannot take the few-row path. (A function of its own: a
    runner held in the caller's frame would keep the engine's memory after it is shut down.)"""
    runner = llm.llm_engine.model_runner
    own = runner.skinny_max_rows
    if runner.set_skinny_max_rows(0 if own else 1) == own:
        return None
    other = _batch1_changed(llm, default, prompt_len, new_tokens, copy_gbps,
                            undo=lambda: runner.set_skinny_max_rows(own))
    skinny, cublas = (default, other) if own else (other, default)
    if skinny["decode_tokens_per_s"] and cublas["decode_tokens_per_s"]:
        other["skinny_speedup"] = skinny["decode_tokens_per_s"] / cublas["decode_tokens_per_s"]
    return ("batch1_cublas" if own else "batch1_skinny"), other


def batch1_pdl(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float) -> dict | None:
    """batch1_decode on ``llm`` with its decode-path kernels launched with programmatic dependent launch
    (pagedkernels.set_programmatic_dependent_launch), the graphs captured again, then back; against ``default``,
    its batch1_decode without. None where PDL does not apply (not CUDA, or before compute capability 9.0)."""
    undo = _pdl_on(llm)
    if undo is None:
        return None
    result = _batch1_changed(llm, default, prompt_len, new_tokens, copy_gbps, undo=undo)
    if result["decode_tokens_per_s"] and default["decode_tokens_per_s"]:
        result["speedup"] = result["decode_tokens_per_s"] / default["decode_tokens_per_s"]
    return result


def _pdl_on(llm):
    """Programmatic dependent launch on for ``llm``'s kernels, its decode graphs dropped to be captured so; returns
    what undoes both, or None (nothing changed) where PDL does not apply."""
    import pagedkernels

    runner = llm.llm_engine.model_runner
    previous = pagedkernels.set_programmatic_dependent_launch(True)
    if not pagedkernels.programmatic_dependent_launch(llm.llm_engine.device):
        pagedkernels.set_programmatic_dependent_launch(previous)
        return None
    runner.drop_graphs()

    def undo() -> None:
        pagedkernels.set_programmatic_dependent_launch(previous)
        runner.drop_graphs()
    return undo


def batch1_fused_reduce(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float,
                        *, pdl: bool = False) -> tuple[str, dict] | None:
    """batch1_decode on ``llm`` with the decode op's splits merged the other way than its own (``default``, its
    batch1_decode): in the split kernel (ModelRunner.set_decode_fused_reduce: split counters, one kernel a layer)
    where the engine runs a reduce kernel after it (DevicePolicy.decode_fused_reduce off, the default), else with the
    reduce kernel; then back. ``pdl``: with programmatic dependent launch as well (both changes together). Returns
    ("batch1_fused_reduce" / "batch1_split_reduce", with "_pdl" after it for ``pdl``; the result with the fused
    merge's speedup over the two kernels, or both changes' over the default for ``pdl``), or None where it does not
    apply (not CUDA; ``pdl`` before compute capability 9.0)."""
    runner = llm.llm_engine.model_runner
    own = any(layer.decode_split_counters is not None for layer in getattr(runner, "attention_layers", []))
    if runner.set_decode_fused_reduce(not own) == own:   # changed: the decode graphs are dropped
        return None
    undo_pdl = _pdl_on(llm) if pdl else (lambda: None)
    if undo_pdl is None:
        runner.set_decode_fused_reduce(own)
        return None

    def undo() -> None:
        undo_pdl()
        runner.set_decode_fused_reduce(own)

    other = _batch1_changed(llm, default, prompt_len, new_tokens, copy_gbps, undo=undo)
    fused, split = (default, other) if own else (other, default)
    if other["decode_tokens_per_s"] and default["decode_tokens_per_s"]:
        if pdl:
            other["speedup"] = other["decode_tokens_per_s"] / default["decode_tokens_per_s"]
        else:
            other["fused_reduce_speedup"] = fused["decode_tokens_per_s"] / split["decode_tokens_per_s"]
    return ("batch1_split_reduce" if own else "batch1_fused_reduce") + ("_pdl" if pdl else ""), other


def batch1_fused_rope(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float,
                      *, everything: bool = False) -> tuple[str, dict] | None:
    """batch1_decode on ``llm`` with the few-row layers' rotary embedding and KV-cache write the other way than its
    own (``default``, its batch1_decode): in the decode split kernel (ModelRunner.set_decode_fused_rope,
    pagedkernels.rotary_cache_decode_attention: one kernel a layer for the three) where the engine runs
    rotary_embedding_and_cache before the decode op (DevicePolicy.decode_fused_rope off, the default), else in their
    own kernel; then back. ``everything``: the rotation, the split merge (set_decode_fused_reduce), the final norm in
    the LM head's product (set_skinny_lm_head) and programmatic dependent launch all on, the fewest launches a step. Returns ("batch1_fused_rope" / "batch1_unfused_rope", the
    result with the fused rotation's speedup; or "batch1_all_fused", the result with its speedup over the default),
    or None where nothing changes (no layer runs the decode kernel; ``everything`` already the default)."""
    runner = llm.llm_engine.model_runner
    layers = getattr(runner, "attention_layers", [])
    own_rope = any(layer.decode_fused_rope for layer in layers)
    own_reduce = any(layer.decode_split_counters is not None for layer in layers)
    rope = True if everything else not own_rope
    if runner.set_decode_fused_rope(rope) != rope:
        return None
    undos = [lambda: runner.set_decode_fused_rope(own_rope)]
    changed = rope != own_rope
    if everything:
        changed |= runner.set_decode_fused_reduce(True) != own_reduce
        undos.append(lambda: runner.set_decode_fused_reduce(own_reduce))
        own_head = runner.skinny_head
        changed |= runner.set_skinny_lm_head(True) != own_head
        undos.append(lambda: runner.set_skinny_lm_head(own_head))
        undo_pdl = _pdl_on(llm)
        if undo_pdl is not None:
            changed = True
            undos.append(undo_pdl)

    def undo() -> None:
        for step in reversed(undos):
            step()

    if not changed:
        undo()
        return None
    other = _batch1_changed(llm, default, prompt_len, new_tokens, copy_gbps, undo=undo)
    if other["decode_tokens_per_s"] and default["decode_tokens_per_s"]:
        if everything:
            other["speedup"] = other["decode_tokens_per_s"] / default["decode_tokens_per_s"]
        else:
            fused, two = (default, other) if own_rope else (other, default)
            other["fused_rope_speedup"] = fused["decode_tokens_per_s"] / two["decode_tokens_per_s"]
    if everything:
        return "batch1_all_fused", other
    return ("batch1_unfused_rope" if own_rope else "batch1_fused_rope"), other


def batch1_skinny_head(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float
                       ) -> tuple[str, dict] | None:
    """batch1_decode on ``llm`` with the step graph's final norm and LM head the other way than its own (``default``):
    one few-row product with the norm in its prologue (ModelRunner.set_skinny_lm_head) where the engine runs the norm
    kernel and cuBLAS's product (DevicePolicy.skinny_lm_head off, the default), else apart; then back. Returns
    ("batch1_skinny_head" / "batch1_cublas_head", the result with the folded head's speedup), or None where the
    runner cannot fold (no few-row step graphs)."""
    runner = llm.llm_engine.model_runner
    own = runner.skinny_head
    if runner.set_skinny_lm_head(not own) == own:
        return None
    other = _batch1_changed(llm, default, prompt_len, new_tokens, copy_gbps,
                            undo=lambda: runner.set_skinny_lm_head(own))
    if other["decode_tokens_per_s"] and default["decode_tokens_per_s"]:
        folded, apart = (default, other) if own else (other, default)
        other["skinny_head_speedup"] = folded["decode_tokens_per_s"] / apart["decode_tokens_per_s"]
    return ("batch1_cublas_head" if own else "batch1_skinny_head"), other


def batch1_moe_gemv(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float, *, pdl: bool = False
                    ) -> tuple[str, dict] | None:
    """batch1_decode on ``llm`` with fused_moe's matrix-vector launches (pagedkernels.set_moe_gemv_max_tokens: two
    launches a layer instead of three) and, with ``pdl``, programmatic dependent launch as well; the decode graphs
    captured again, then both back. Returns ("batch1_moe_gemv" / "batch1_moe_gemv_pdl", the result with its speedup
    over ``default``), or None for a model with no MoE layer (or ``pdl`` where PDL does not apply)."""
    import pagedkernels

    from engine.layers.fused_moe import FusedMoE

    if not any(isinstance(m, FusedMoE) for m in llm.llm_engine.model_runner.model.modules()):
        return None
    result = _batch1_setting(llm, default, prompt_len, new_tokens, copy_gbps, pagedkernels.set_moe_gemv_max_tokens, 8,
                             pdl=pdl)
    return None if result is None else ("batch1_moe_gemv_pdl" if pdl else "batch1_moe_gemv", result)


def batch1_skinny_deep(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float, *,
                       pdl: bool = False, profile: tuple | None = None) -> tuple[str, dict] | None:
    """batch1_decode on ``llm`` with skinny_gemm's deep launches (pagedkernels.set_skinny_gemm_deep: K tiles widened
    so a small projection's grid asks for its whole weight at once, two tiles in flight where K takes several) and,
    with ``pdl``, programmatic dependent launch as well; the decode graphs captured again, then both back. With
    ``profile`` (step_profile's requests and steps) its batch-1 step profile too: each kernel's time a step beside
    the default's. Returns ("batch1_skinny_deep" / "batch1_skinny_deep_pdl", the result with its speedup over
    ``default``), or None where the engine's batch-1 steps do not run the few-row layers (or ``pdl`` where PDL does
    not apply)."""
    import pagedkernels

    if not llm.llm_engine.model_runner.skinny_max_rows:
        return None
    result = _batch1_setting(llm, default, prompt_len, new_tokens, copy_gbps, pagedkernels.set_skinny_gemm_deep, True,
                             pdl=pdl, profile=profile)
    return None if result is None else ("batch1_skinny_deep_pdl" if pdl else "batch1_skinny_deep", result)


def _batch1_setting(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float, setter, value, *,
                    pdl: bool, profile: tuple | None = None) -> dict | None:
    """batch1_decode on ``llm`` with a pagedkernels launch setting at ``value`` (``setter`` returns the previous one)
    and, with ``pdl``, programmatic dependent launch as well, the decode graphs captured again (with ``profile``, its
    step profile too: _batch1_changed); then both back. The result with its speedup over ``default``, or None where
    ``pdl`` does not apply (nothing changed)."""
    runner = llm.llm_engine.model_runner
    undo_pdl = _pdl_on(llm) if pdl else runner.drop_graphs   # either way the graphs are captured again, after too
    if undo_pdl is None:
        return None
    previous = setter(value)
    runner.drop_graphs()

    def undo() -> None:
        setter(previous)
        undo_pdl()
    result = _batch1_changed(llm, default, prompt_len, new_tokens, copy_gbps, undo=undo, profile=profile)
    if result["decode_tokens_per_s"] and default["decode_tokens_per_s"]:
        result["speedup"] = result["decode_tokens_per_s"] / default["decode_tokens_per_s"]
    return result


def throughput_sampler(llm, requests, temperature: float, budget: Budget, default: dict) -> tuple[str, dict]:
    """engine_throughput on ``llm`` with the sampler's draw the other way than its own (``default``): the rows
    without min-p / top-k / top-p in one kernel (pagedkernels.sample_from_logits; DevicePolicy.fused_sampler,
    ENGINE_FUSED_SAMPLER) or in the tensor ops, then back. Returns ("engine_fused_sampler" /
    "engine_unfused_sampler", the result with the fused draw's speedup)."""
    sampler = llm.llm_engine.model_runner.sampler
    own = sampler.fused_draw
    sampler.fused_draw = not own
    try:
        other = engine_throughput(llm, requests, temperature, budget)
    finally:
        sampler.fused_draw = own
    if other["complete"] and default["complete"]:
        fused, unfused = (default, other) if own else (other, default)
        other["fused_sampler_speedup"] = fused["output_tokens_per_s"] / unfused["output_tokens_per_s"]
    return ("engine_unfused_sampler" if own else "engine_fused_sampler"), other


def _batch1_changed(llm, default: dict, prompt_len: int, new_tokens: int, copy_gbps: float, *, undo,
                    profile: tuple | None = None) -> dict:
    """batch1_decode on ``llm`` as its caller changed it (and with ``profile``, step_profile's requests and steps,
    its step profile too), then ``undo()`` whatever happens; with how many of ``default``'s leading greedy tokens it
    gave again (bf16 rounds two paths' products differently, so a near-tie may flip one and the rest follow it)."""
    try:
        result = batch1_decode(llm, prompt_len, new_tokens, copy_gbps)
        if profile is not None:
            result["profile"] = step_profile(llm, profile[0], 0.0, profile[1])
    finally:
        undo()
    result["same_leading_tokens"] = _same_prefix(result.pop("token_ids"), default["token_ids"])
    return result


def _variant(row: dict, key: str, log, name: str, measure):
    """``measure()``, or None with ``row[key]`` saying why where it raised: a variant of the engine's batch-1 decode
    that fails (a launch mode this GPU or driver refuses) leaves the engine's own figures and the parts after it."""
    try:
        return measure()
    except Exception as error:
        row[key] = {"error": f"{type(error).__name__}: {error}"[:500]}
        log(f"{name}: {key} failed: {row[key]['error']}")
        return None


def _log_variant(log, name: str, row: dict, key: str, result: dict, ratio_key: str, against: str) -> None:
    """A batch-1 variant's result into ``row[key]`` and its line: tok/s, kernels a step, its ratio (``ratio_key``)
    over what it is ``against``, and how many greedy tokens agree with the engine's own."""
    row[key] = result
    log(f"{name}: batch-1 decode, {key[7:].replace('_', ' ')}: {_fmt(result['decode_tokens_per_s'], '.1f')} tok/s, "
        f"{_fmt(result.get('kernels_per_step'), '.0f')} kernels a step; {_fmt(result.get(ratio_key), '.2f')}x "
        f"{against}; the first {result['same_leading_tokens']} of {len(row['batch1']['token_ids'])} greedy tokens the "
        f"same")


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def launches_per_decode_step(llm, prompt: dict, steps: int = 8) -> dict:
    """Device kernels (and copies) a batch-1 decode step runs, inside and outside its graph, counted by the profiler
    over `steps` steps of one request in steady decoding (on CPU: None)."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    engine = llm.llm_engine
    if engine.device.type != "cuda":
        return {"kernels_per_step": None}
    engine.add_request("launch-count", prompt, SamplingParams(temperature=0.0, max_tokens=4 * steps,
                                                               ignore_eos=True))
    try:
        for _ in range(4):   # the prefill and the pipeline's first steps
            engine.step()
        synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            synchronize(engine.device)
    finally:
        engine.abort_request("launch-count")
    kernels = kernel_events(prof.key_averages())
    return {"kernels_per_step": sum(e.count for e in kernels) / steps,
            "top_kernels_by_count": [{"name": e.key[:100], "per_step": e.count / steps}
                                     for e in sorted(kernels, key=lambda e: -e.count)[:10]]}


@dataclass(eq=False)
class _Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] | None = None


def decode_step_time(llm, batch_size: int, context: int, copy_gbps: float, repeats: int) -> dict:
    """Prefill ``batch_size`` sequences of ``context`` tokens straight through the runner, then time
    the decode step of token ``context`` (compute_logits_for does not advance the sequences, so the same
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
        runner.compute_logits_for([(s, context) for s in seqs[start:start + chunk]])
    for s in seqs:
        s.num_computed_tokens = context
    step = [(s, 1) for s in seqs]
    for _ in range(3):
        runner.compute_logits_for(step)  # warm-up (captures the graph)
    synchronize(runner.device)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.compute_logits_for(step)
    synchronize(runner.device)
    ms = (time.perf_counter() - start) / repeats * 1e3
    floor_bytes = weight_bytes(runner.model, tokens=batch_size) + batch_size * (context + 1) * kv_bytes_per_token(
        runner.config, runner.dtype)
    floor_ms = floor_bytes / copy_gbps / 1e6
    return {"batch_size": batch_size, "context": context, "step_ms": ms, "floor_ms": floor_ms,
            "frac_of_floor": floor_ms / ms, "cuda_graphs": not runner.enforce_eager}


# ------------------------------------------------------------------------------------------------


def run(device: torch.device, *, tiny: bool, models: list[str], parts: tuple[str, ...] = PARTS,
        hf_group: int = 64, context: int = 1024, enforce_eager: bool = False, copy_gbps: float | None = None,
        budget: Budget | None = None, transformers_min_s: float = 0.0, on_progress=None, log=print,
        results: dict | None = None, async_scheduling: bool | None = None) -> dict:
    """Run ``parts`` (of ``PARTS``) for each model of ``models`` (names in ``SHAPES``), in that order per model:
    throughput, batch1, decode_steps on one engine, then transformers once the engine is gone (only when the
    budget still has ``transformers_min_s`` seconds; else the row says it was left out). ``on_progress(results)``
    after every part, so a caller can save partial results. ``results``: an earlier run's, to add parts to (the
    requests are the same, seeded: transformers later in a phase still gives the ratio). ``async_scheduling``: the
    engine's option (None: its default, on with CUDA)."""
    from bench.kernels import measure_peaks, wall_timer
    from engine import LLM

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(unknown)}")
    budget = budget or Budget(None)
    if copy_gbps is None:
        timer = wall_timer
        if device.type == "cuda":
            from bench.kernels import cuda_timer as timer
        copy_gbps = measure_peaks(device, timer, tiny=tiny).copy_gbps
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    workload = TINY_WORKLOAD if tiny else NANO_VLLM
    results = results or {"device": str(device), "device_name": torch.cuda.get_device_name(device)
                          if device.type == "cuda" else "cpu", "dtype": str(dtype).replace("torch.", ""), "copy_gbps": copy_gbps,
                          "workload": workload.__dict__, "load_format": "dummy", "models": {}, "targets": []}

    def progress() -> None:
        results["targets"] = targets(results)
        if on_progress is not None:
            on_progress(results)

    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            model_dir = write_config_dir(os.path.join(tmp, name), name, tiny=tiny)
            shape = {k: v for k, v in (TINY_SHAPES if tiny else SHAPES)[name].items() if k != "architectures"}
            row = results["models"].setdefault(name, {"shape": shape})
            requests = make_requests(workload, row["shape"]["vocab_size"])
            engine_parts = [p for p in parts if p != "transformers"]
            if engine_parts:
                start = time.perf_counter()
                llm = LLM(model_dir, dtype=str(dtype).replace("torch.", ""), device=str(device),
                          max_model_len=workload.max_model_len, enforce_eager=enforce_eager,
                          max_num_seqs=256 if not tiny else 8, load_format="dummy", skip_tokenizer_init=True,
                          async_scheduling=async_scheduling)
                try:
                    row["engine_start_s"] = time.perf_counter() - start
                    row["engine_build_s"] = build_seconds(llm)
                    row["async_scheduling"] = llm.llm_engine.config.scheduler_config.async_scheduling
                    log(f"{name}: engine built in {row['engine_start_s']:.0f} s (dummy weights; "
                        f"{build_parts(row['engine_build_s'])})")
                    if "throughput" in parts:
                        row["engine"] = engine_throughput(llm, requests, workload.temperature, budget)
                        log(f"{name}: engine {row['engine']['output_tokens_per_s']:.0f} output tok/s"
                            + ("" if row["engine"]["complete"] else " (cut at the budget)"))
                        progress()
                        if not budget.expired(margin=60.0):
                            variant = _variant(row, "engine_sampler_variant", log, name, lambda: throughput_sampler(
                                llm, requests, workload.temperature, budget, row["engine"]))
                            if variant is not None:
                                key, other = variant
                                row[key] = other
                                log(f"{name}: engine, {key[7:].replace('_', ' ')}: {other['output_tokens_per_s']:.0f} "
                                    f"output tok/s, {_fmt(other.get('fused_sampler_speedup'), '.3f')}x with the "
                                    f"fused draw")
                                progress()
                    if "profile" in parts:
                        row["profile"] = step_profile(llm, requests[:PROFILE_REQUESTS] if not tiny else requests,
                                                      workload.temperature, PROFILE_STEPS if not tiny else (2, 4))
                        prof = row["profile"]
                        log(f"{name}: profile: {prof['step_ms']:.1f} ms a step, "
                            f"{prof['execute_model_ms']:.1f} ms in execute_model, GPU busy "
                            f"{_fmt(prof['gpu_busy_fraction_under_cpu_profiler'], '.2f')}; with the device's "
                            f"activity alone recorded GPU busy {_fmt(prof['gpu_busy_fraction'], '.2f')}")
                        progress()
                    if "batch1" in parts:
                        row["batch1"] = batch1_decode(llm, 16 if tiny else 128, 8 if tiny else 256, copy_gbps)
                        log(f"{name}: batch-1 decode {_fmt(row['batch1']['decode_tokens_per_s'], '.1f')} tok/s, "
                            f"{_fmt(row['batch1']['frac_of_copy_bandwidth'], '.2f')} of copy bandwidth")
                        progress()
                        profile = None
                        if {"profile", "batch1_profile"} & set(parts):  # where a batch-1 step's time goes (greedy)
                            profile = ([(list(range(100, 116 if tiny else 228)), 64 if tiny else 400)],
                                       (2, 4) if tiny else (20, 60))
                            row["batch1"]["profile"] = step_profile(llm, profile[0], 0.0, profile[1])
                            log(f"{name}: batch-1 profile: {row['batch1']['profile']['step_ms']:.2f} ms a step, GPU "
                                f"busy {_fmt(row['batch1']['profile']['gpu_busy_fraction'], '.2f')}")
                            progress()
                        # The same on this engine with the other decoder layers for one row (cuBLAS, or the few-row
                        # layers of pagedkernels.skinny_gemm with the norms and residual adds fused in): the batch-1
                        # graph captured again.
                        other = _variant(row, "batch1_other_layers", log, name, lambda: batch1_other_layers(
                            llm, row["batch1"], 16 if tiny else 128, 8 if tiny else 256, copy_gbps))
                        if other is not None:
                            key, result = other
                            row[key] = result
                            own = "few-row layers" if key == "batch1_cublas" else "cuBLAS"
                            log(f"{name}: batch-1 decode with {'cuBLAS' if key == 'batch1_cublas' else 'skinny_gemm'} "
                                f"{_fmt(result['decode_tokens_per_s'], '.1f')} tok/s, "
                                f"{_fmt(result['frac_of_copy_bandwidth'], '.2f')} of copy bandwidth, "
                                f"{_fmt(result.get('kernels_per_step'), '.0f')} kernels a step; the few-row layers "
                                f"{_fmt(result.get('skinny_speedup'), '.2f')}x cuBLAS; the first "
                                f"{result['same_leading_tokens']} of {len(row['batch1']['token_ids'])} greedy tokens "
                                f"as with the engine's own ({own})")
                            progress()
                        # And with programmatic dependent launch (Hopper): each decode-path kernel launched while
                        # the one ahead of it finishes.
                        pdl = _variant(row, "batch1_pdl", log, name, lambda: batch1_pdl(
                            llm, row["batch1"], 16 if tiny else 128, 8 if tiny else 256, copy_gbps))
                        if pdl is not None:
                            row["batch1_pdl"] = pdl
                            log(f"{name}: batch-1 decode with programmatic dependent launch "
                                f"{_fmt(pdl['decode_tokens_per_s'], '.1f')} tok/s, {_fmt(pdl.get('speedup'), '.2f')}x "
                                f"without; the first {pdl['same_leading_tokens']} of {len(row['batch1']['token_ids'])} "
                                f"greedy tokens the same")
                            progress()
                        # And with the decode op's splits merged in its split kernel (one kernel a layer, not
                        # two), alone and with programmatic dependent launch; with the few-row layers' rotation and
                        # cache write in that kernel too (one kernel a layer for the three), alone, then with the
                        # fused merge and PDL as well.
                        args = (llm, row["batch1"], 16 if tiny else 128, 8 if tiny else 256, copy_gbps)
                        for key, measure, ratio_key, against in (
                                ("batch1_fused_reduce", lambda: batch1_fused_reduce(*args), "fused_reduce_speedup",
                                 "split + reduce"),
                                ("batch1_fused_reduce_pdl", lambda: batch1_fused_reduce(*args, pdl=True), "speedup",
                                 "the default"),
                                ("batch1_fused_rope", lambda: batch1_fused_rope(*args), "fused_rope_speedup",
                                 "two kernels"),
                                ("batch1_skinny_head", lambda: batch1_skinny_head(*args), "skinny_head_speedup",
                                 "the norm and cuBLAS's LM head"),
                                ("batch1_all_fused", lambda: batch1_fused_rope(*args, everything=True), "speedup",
                                 "the default"),
                                ("batch1_skinny_deep", lambda: batch1_skinny_deep(*args, profile=profile), "speedup",
                                 "the default"),
                                ("batch1_skinny_deep_pdl", lambda: batch1_skinny_deep(*args, pdl=True), "speedup",
                                 "the default"),
                                ("batch1_moe_gemv", lambda: batch1_moe_gemv(*args), "speedup", "the default"),
                                ("batch1_moe_gemv_pdl", lambda: batch1_moe_gemv(*args, pdl=True), "speedup",
                                 "the default")):
                            fused = _variant(row, key, log, name, measure)
                            if fused is not None:
                                _log_variant(log, name, row, *fused, ratio_key, against)
                                progress()
                    if "decode_steps" in parts:
                        row["decode_steps"] = []
                        for b in ((2, 4) if tiny else (64, 256)):
                            if not budget.allows(30):
                                row["decode_steps"].append({"batch_size": b, "skipped": "budget"})
                                continue
                            row["decode_steps"].append(
                                decode_step_time(llm, b, 32 if tiny else context, copy_gbps, 3 if tiny else 20))
                            log(f"{name}: decode step {row['decode_steps'][-1]}")
                            progress()
                finally:   # an error in a part still frees the engine for the next model (the phase goes on)
                    llm.llm_engine.shutdown()
                    del llm
                    free_device_memory(device)
                if device.type == "cuda":  # what transformers (next) finds taken, should the engine not be freed
                    row["device_memory_after_engine_gib"] = torch.cuda.memory_allocated(device) / 2**30
            if "transformers" in parts:
                if not budget.allows(transformers_min_s):
                    row["transformers"] = {"skipped": f"{budget.remaining():.0f} s of the budget left, "
                                                      f"{transformers_min_s:.0f} s needed"}
                    log(f"{name}: transformers left out ({row['transformers']['skipped']})")
                else:
                    row["transformers"] = transformers_throughput(model_dir, requests, workload.temperature, device,
                                                                  dtype, hf_group if not tiny else 4, budget)
                    if "engine" in row:
                        row["throughput_ratio"] = (row["engine"]["output_tokens_per_s"]
                                                   / row["transformers"]["output_tokens_per_s"])
                    log(f"{name}: transformers ({row['transformers']['api']}) "
                        f"{row['transformers']['output_tokens_per_s']:.0f} tok/s"
                        + (f"; ratio {row['throughput_ratio']:.2f}x" if "throughput_ratio" in row else ""))
            progress()
    return results


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def targets(results: dict) -> list[dict]:
    """Issue 33's engine targets, from what was measured (a cut measurement is "n/a"; a dry run evaluates its
    meaningless numbers the same way): nano-vllm's protocol at >= 14,000 output tok/s on an H200 (13,000 on other
    GPUs, the H100's goal), the GPU busy >= 0.9 of a step, >= 5x transformers, batch-1 decode >= 0.40 of the
    bandwidth floor at the Qwen3-0.6B shape and >= 0.85 at the Llama-3-8B shape."""
    out = []

    def target(name: str, value, threshold: float, complete: bool = True) -> None:
        status = "n/a" if value is None or not complete else ("pass" if value >= threshold else "fail")
        out.append({"target": name, "value": value, "threshold": threshold, "status": status,
                    "note": "" if complete else "measurement cut at the budget"})

    qwen = results["models"].get("qwen3-0.6b")
    if qwen:
        engine, hf = qwen.get("engine"), qwen.get("transformers", {})
        goal = 14000 if "H200" in (results.get("device_name") or "") else 13000
        if engine:
            target(f">= {goal:,} output tok/s (Qwen3-0.6B shape, nano-vllm protocol)", engine["output_tokens_per_s"],
                   goal, engine["complete"])
        if (qwen.get("profile") or {}).get("gpu_busy_fraction") is not None:
            target("GPU busy >= 0.9 of a step (Qwen3-0.6B shape, nano-vllm protocol, under torch.profiler)",
                   qwen["profile"]["gpu_busy_fraction"], 0.9)
        if "throughput_ratio" in qwen:
            target(">= 5x transformers", qwen["throughput_ratio"], 5,
                   engine["complete"] and hf.get("complete", False))
        if "batch1" in qwen:
            target("batch-1 decode >= 0.40 of the bandwidth floor (Qwen3-0.6B shape)",
                   qwen["batch1"]["frac_of_copy_bandwidth"], 0.4)
    llama = results["models"].get("llama-3-8b")
    if llama and "batch1" in llama:
        target("batch-1 decode >= 0.85 of the bandwidth floor (Llama-3-8B shape)",
               llama["batch1"]["frac_of_copy_bandwidth"], 0.85)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the code path only")
    parser.add_argument("--models", default="qwen3-0.6b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--hf-group", type=int, default=64, help="transformers: requests per call")
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence in the decode-step timing")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--budget", type=float, default=None, help="seconds; parts past it are cut (default: none)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench.engine_gpu: CUDA is not available here; pass --dry-run to check the code on CPU.",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    results = run(device, tiny=args.dry_run, models=args.models.split(","), parts=tuple(args.parts.split(",")),
                  hf_group=args.hf_group, context=args.context, enforce_eager=args.enforce_eager,
                  budget=Budget(args.budget))
    for t in results["targets"]:
        print(f"{t['status']}: {t['target']}: {_fmt(t['value'], '.2f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
