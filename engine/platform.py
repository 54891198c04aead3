"""Device policy in one place: what the engine does differently on a GPU and on a CPU, and why.

Every place that used to branch on ``device.type`` asks ``DevicePolicy.for_device(device)`` instead, so a reader
sees the whole difference here (vLLM keeps the same kind of answers in its ``current_platform``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedkernels import _native as pk_native

# Share of the currently available RAM the KV cache may take on CPU (a GPU uses gpu_memory_utilization instead).
CPU_KV_CACHE_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class DevicePolicy:
    device: torch.device
    # Token budget of a step. Chunked prefill is always on, so the budget need not hold a whole prompt; 8192 is
    # vLLM v1's default for its offline LLM class on GPUs under 70 GiB. On CPU a smaller step is faster: the
    # activations of a 1024-token step stay in the last-level cache between the matmuls of a layer, those of a
    # few thousand tokens do not (SmolLM2-135M fp32 on a 2-core AMD EPYC with a 32 MiB L3: 48 prompts, 3148
    # tokens, prefilled in 2.5-3.7 s at 1024 against 4.6-5.6 s in one 8192 step).
    default_max_num_batched_tokens: int
    # torch.compile of the forward unless enforce_eager or ENGINE_COMPILE says otherwise. Off on CPU: the
    # engine's oneDNN linears and native kernels beat inductor's code there (SmolLM2 fp32, 48 requests, 2-core
    # EPYC: 8.8 s eager, 16.4 s compiled once warm).
    compile_by_default: bool
    # Pure-decode batches replay CUDA graphs (captured at start-up for the whole ladder).
    cuda_graphs: bool
    # Pure-decode batches replay CPU graphs of the native kernels (pagedkernels.cpu_graph, captured on first use
    # per ladder size) unless enforce_eager: a decode step's ~330 kernel calls without the Python between them.
    cpu_graphs: bool
    # Float32 linears go to oneDNN with prepacked weights (engine/layers/linear.py).
    prepack_linears: bool
    # The KV cache's memory budget comes from profiling a forward on the GPU, from free RAM on CPU.
    profile_gpu_memory: bool
    # glibc's malloc keeps what a step frees for the next (engine/worker/cpu_malloc.py) instead of handing it back
    # to the system and faulting it in again: 205,000 -> 38,000 page faults in a 3324-token prefill on CPU.
    keep_freed_host_memory: bool = False
    # The KV cache's pages are committed at start-up (engine/worker/cpu_malloc.py: prefault), as vLLM's CPU backend
    # does by allocating it with torch.zeros, instead of each being faulted in by the first step that writes it.
    # Those faults fell inside the first requests: 75,000 of them (the 48-request workload's 300 MB of K/V) took
    # 0.1-0.8 s of its 8-9 s on a 2-core AMD EPYC VM, the most where other processes held the memory the guest had
    # recycled (48 requests beside such a process: 9.0-9.2 -> 8.4-8.5 s). Start-up pays instead, on all cores: there
    # 0.8-3.5 s for 3.4-5.4 GiB. ENGINE_CPU_KV_PREFAULT=0 turns it off.
    prefault_kv_cache: bool = False
    # serve's default --max-num-seqs-per-request: the rows of a step one request (n > 1) takes while others are
    # served. On CPU each row costs step time (tiny Llama, 2 cores: a step of 1 + 32 rows 3 ms, of 1 + 16 rows
    # 2.2 ms, of 1 row 1.3 ms), and others' latency with it: an ordinary request beside an n=256 one took 2.5x its
    # unloaded latency at 32, 2.1-2.35x at 16. On a GPU a decode step's rows are nearly free (the step reads the
    # weights once): 32.
    serve_max_num_seqs_per_request: int = 32
    # Async scheduling unless asked otherwise (engine/core/engine_core.py): on a GPU the host's work of a step hides
    # under the device's. On CPU the "device" is the host's own cores: nothing to overlap, so off.
    async_scheduling_by_default: bool = False
    # The CPU's fast bf16 arithmetic, which decides what dtype="auto" runs a bf16 checkpoint in (auto_dtype):
    # "amx-bf16" (AMX tiles: Intel Xeons since Sapphire Rapids), "avx512-bf16" (vdpbf16ps without AMX: Cooper Lake,
    # AMD Zen 4 and 5), or None (bf16 only widened to float32: AVX2 and older CPUs; GPUs, where it is not asked).
    cpu_bf16_isa: str | None = None
    # Rows up to which a bf16 product on the CPU takes the layer's panel-packed copy (pagedkernels.w16_gemm: one pass
    # over the weight, vdpbf16ps where the CPU has it) instead of oneDNN's prepacked bf16 inner product
    # (ENGINE_CPU_BF16_W16_MAX_ROWS overrides it). Up to a few dozen rows a product is bound by its weight's bytes,
    # past that by arithmetic. With AVX512-BF16 alone both multiply in vdpbf16ps: 96, measured (2-core Zen 5, a
    # decode step's SmolLM2 weights streamed from memory: the panels 0.78-0.84x oneDNN's time at 16 rows, 0.87-0.91x
    # at 64, 0.90x at 96, 0.96x at 128; docs/performance.md). With AMX the panels take the tiles from 5 rows on
    # (w16_gemm_cpu.c) and stay bound by the weight's bytes where oneDNN's tiles reach ~0.55 of the bandwidth: 64,
    # measured (2-core Emerald Rapids VM, a decode step's SmolLM2 weights streamed: the panels 0.77-0.79x oneDNN's
    # time at 1-16 rows, 0.67x at 32, 0.96-0.97x at 48-64, 1.02x at 96). An AMX CPU whose build has no tile kernel
    # (an old compiler, another -march, PAGEDKERNELS_CPU_AMX=0) has the pair dot products alone, which lose to oneDNN
    # from ~9 rows (0.92-0.96x at 8, 1.13-1.17x at 10, 1.56-2.2x at 16): 8, and 8 in graphs. Without either, oneDNN has
    # no bf16 inner product (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT) and torch's fallback bf16 GEMM is far slower
    # than the packed kernel at any size (2-core EPYC, one thread, loaded: [256, 576] x [576, 1536] 109 ms against
    # 13 ms): every row. None: no limit.
    cpu_bf16_w16_max_rows: int | None = None
    # The same limit for the products of a decode step's CPU graph (engine/worker/decode_graphs.py;
    # ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS overrides it). A replay runs the panel kernel from C over just the step's
    # rows, but a oneDNN product through torch, over all the rows of the graph's batch size (up to 1.5x the step's):
    # with AVX512-BF16 every row (2-core Zen 5, SmolLM2 bf16: the 48 requests' 48-row steps 29-34 ms against 37-39
    # with the oneDNN products from 16 rows; 160 requests of 16-128 tokens in and out, alternating, two prompt sets:
    # 12.0-12.1 and 13.2-13.4 s against 12.5-12.7 and 15.5-15.8 s with the oneDNN products past 64 rows); with AMX
    # tiles in the build every row too (the 48 requests, engines taking turns in one process, medians of 6 rounds:
    # 512 tok/s against 530 with 64, both 1.25-1.29x the 409 of the pair dot products up to 16 rows).
    cpu_bf16_w16_graph_max_rows: int | None = None
    # Steps of up to this many tokens run the decoder layers that can as few-row products with the norms and residual
    # adds fused in (pagedkernels.skinny_gemm; engine/models/llama.py); 0: never (ENGINE_SKINNY_GEMM_MAX_ROWS=0..8
    # overrides it). On CUDA 1: batch-1 decode at the Qwen3-0.6B shape ran 1.51x faster than with cuBLAS on the same
    # engine (H200, bf16: 1009 against 670 tok/s, 222 kernels a step against 362), and at Llama-3-8B's gate_up and
    # down shapes the kernel alone ran 1.01x and 1.03x cuBLAS (bench/results/2026-11-29-nvidia-h200-phase13-*). The
    # 8B engine and 2-8 rows are not measured yet. On CPU 0: the layers' weights are prepacked there, which the path
    # does not read, and its PyTorch twin is no faster than the CPU's own GEMMs.
    skinny_gemm_max_rows: int = 0
    # CUDA decode steps merge the split-K partial results in the split kernel itself (paged_decode_attention with
    # split_counters: the last split of each sequence and KV head merges them), one kernel a layer instead of two
    # (ENGINE_DECODE_FUSED_REDUCE=1 turns it on, 0 off). Off: at batch 1 it takes 28 of the Qwen3-0.6B step's 222
    # kernels away, against a serial merge at each KV head's end, and the H200 ran batch-1 decode 0.88x / 0.96x /
    # 0.91x as fast with it at the Qwen3-0.6B / Llama-3-8B / Qwen3-30B-A3B shapes (bench.engine_gpu's batch-1 part on
    # one engine: bench/results/2026-11-30-nvidia-h200-session4-*). CPU decode runs no split kernel.
    decode_fused_reduce: bool = False
    # CUDA decode steps of the few-row layers (those that rotate q/k in their cache write) rotate q and k, write the
    # new K/V and attend in the decode split kernel (pagedkernels.rotary_cache_decode_attention), one kernel a layer
    # where rotary_embedding_and_cache then paged_decode_attention are two (ENGINE_DECODE_FUSED_ROPE=1 turns it on,
    # 0 off). Off: at batch 1 it takes another 28 of the Qwen3-0.6B step's kernels away, against every split program
    # rotating its group's queries itself, and the H200 measured 1.05x / 1.01x / 0.99x at the three shapes above,
    # within the runs' spread (the same bench, the same results).
    decode_fused_rope: bool = False
    # Speculative decoding's verification steps whose sequences all verify the same number of tokens (1 + k drafts:
    # single stream always) replay CUDA graphs captured per (padded batch size, tokens a sequence), as decode steps
    # do, instead of launching the compiled forward's kernels one by one, and so do a draft model's proposal steps
    # (one graph per padded batch size: its forward, LM head and argmax); ENGINE_SPEC_DECODE_GRAPHS=0 turns it off.
    # On by default on CUDA since the H200 measured it (bench/results/2026-11-30-nvidia-h200-phase14-spec): n-gram
    # decoding of SmolLM2-135M in bf16 ran 1502 tok/s with its verification in graphs against 195 without (plain
    # decoding 774), the same greedy tokens; a draft model's proposals 0.16x plain decoding in graphs against 0.04x.
    spec_decode_graphs: bool = False
    # A CUDA step graph of the few-row layers ends in one few-row product for the LM head with the final RMSNorm in
    # its prologue (LlamaForCausalLM.skinny_logits: pagedkernels.skinny_gemm), where the model's last norm and the LM
    # head's cuBLAS product are two kernels; ENGINE_SKINNY_LM_HEAD=0 turns it off. On by default on CUDA since the
    # H200 measured batch-1 decode at the Qwen3-0.6B shape 1.33x faster with it on the same engine (940.5 against
    # 708 tok/s, all 256 greedy tokens the same: bench/results/2026-11-30-nvidia-h200-phase15-decide). Since the
    # one-row step runs uncompiled (its tail with it) the two are even: 956 against 975 tok/s with the norm and
    # cuBLAS's head at Qwen3-0.6B, 203.6 against 203.6 at Llama-3-8B (...-session4-phase15-decide), one kernel fewer.
    skinny_lm_head: bool = False
    # The sync-free sampler draws every row of a batch without top-k / top-p in one kernel
    # (pagedkernels.sample_from_logits: the argmax or the inverse-CDF draw, min-p by a mask, reading the logits about
    # once and writing nothing) instead of a dozen tensor ops over [rows, vocab] float32 (ENGINE_FUSED_SAMPLER=0 turns
    # it off). On by default on CUDA since the H200 measured nano-vllm's protocol (temperature 0.6) 1.18x faster with
    # it on the same engine at the Qwen3-0.6B shape (21,975 against 18,625 output tok/s) and 1.10x at the
    # Qwen3-30B-A3B shape (6,009 against 5,480); the kernel alone 0.062 ms against 0.917 for the tensor ops at 256
    # rows (bench/results/2026-11-30-nvidia-h200-session4-phase15-decide.md, -phase11-moe.md). A batch with top-k /
    # top-p keeps the tensor ops (the kernel's threshold search ran 0.21x their candidates path there).
    fused_sampler: bool = False

    @classmethod
    def for_device(cls, device: torch.device | str) -> "DevicePolicy":
        device = torch.device(device)
        on_gpu = device.type == "cuda"
        isa = None if on_gpu else pk_native.cpu_bf16_isa()
        return cls(device=device, default_max_num_batched_tokens=8192 if on_gpu else 1024,
                   compile_by_default=on_gpu, cuda_graphs=on_gpu, cpu_graphs=not on_gpu,
                   prepack_linears=not on_gpu, profile_gpu_memory=on_gpu, keep_freed_host_memory=not on_gpu,
                   prefault_kv_cache=not on_gpu,
                   serve_max_num_seqs_per_request=32 if on_gpu else 16, async_scheduling_by_default=on_gpu,
                   cpu_bf16_isa=isa,
                   cpu_bf16_w16_max_rows=None if on_gpu else _cpu_bf16_w16_max_rows(isa),
                   cpu_bf16_w16_graph_max_rows=None if on_gpu else _cpu_bf16_w16_max_rows(isa, graphs=True),
                   skinny_gemm_max_rows=_skinny_gemm_max_rows(1 if on_gpu else 0),
                   decode_fused_reduce=on_gpu and _env_flag("ENGINE_DECODE_FUSED_REDUCE", default=False),
                   decode_fused_rope=on_gpu and _env_flag("ENGINE_DECODE_FUSED_ROPE", default=False),
                   spec_decode_graphs=on_gpu and _env_flag("ENGINE_SPEC_DECODE_GRAPHS", default=True),
                   skinny_lm_head=on_gpu and _env_flag("ENGINE_SKINNY_LM_HEAD", default=True),
                   fused_sampler=on_gpu and _env_flag("ENGINE_FUSED_SAMPLER", default=True))

    def auto_dtype(self, checkpoint: torch.dtype, *, quantized: bool = False) -> tuple[torch.dtype, str]:
        """What ``dtype="auto"`` runs a checkpoint stored in ``checkpoint`` in, and why (a line for the log).

        A GPU, and a float32 checkpoint anywhere: the checkpoint's dtype. On a CPU, a bf16 checkpoint runs in bf16
        where the CPU multiplies bf16 at its peak (AMX-BF16, AVX512-BF16: oneDNN's bf16 linears, the native kernels'
        vdpbf16ps) and the native kernels built, as vLLM's CPU backend runs it in bf16; elsewhere in float32, where
        every bf16 product would be a float32 one on widened values anyway, and the float32 path's 16-bit weight copies
        read the same bytes per decode step. float16 checkpoints run in float32 on every CPU (no kernel here has fast
        float16 arithmetic; their weights keep 16-bit copies for decode too), and so do ``quantized`` ones (GPTQ, AWQ,
        fp8, GGUF): their GEMMs read the quantized weights whatever the activations' dtype, so bf16 would speed up only
        the rest, and their CPU kernels are tuned and tested with float32 activations."""
        name = str(checkpoint).replace("torch.", "")
        if self.device.type != "cpu" or checkpoint == torch.float32:
            return checkpoint, f"the checkpoint's dtype, {name}"
        if quantized:
            return torch.float32, (f"float32, not the checkpoint's {name}: a quantized model's CPU GEMMs read its "
                                   f"quantized weights whatever the activations' dtype and take float32 ones")
        isa = {"amx-bf16": "AMX-BF16", "avx512-bf16": "AVX512-BF16 (no AMX)"}.get(self.cpu_bf16_isa)
        if checkpoint == torch.bfloat16 and isa is not None:
            if pk_native.library() is None:
                return torch.float32, (f"float32, not the checkpoint's bfloat16: this CPU has {isa} but pagedkernels' "
                                       f"native kernels did not build ({pk_native.build_error()})")
            return torch.bfloat16, f"the checkpoint's bfloat16: this CPU has {isa}"
        if checkpoint == torch.bfloat16:
            return torch.float32, ("float32, not the checkpoint's bfloat16: this CPU has neither AMX-BF16 nor "
                                   "AVX512-BF16, so each bf16 product would be a float32 one on widened values; "
                                   "float32 decodes on 16-bit weight copies, the same bytes")
        return torch.float32, (f"float32, not the checkpoint's {name}: the CPU kernels have no fast {name} "
                               f"arithmetic (decode reads 16-bit weight copies)")

    def decode_kernel_in_eager(self) -> bool:
        """Whether eager pure-decode batches take the split-K decode op. On CUDA yes; on CPU the prefill op, which
        serves 1-token rows too, is faster (per-sequence attention over exactly the cached tokens instead of a
        padded gather: ~3x at 48 sequences of 30-250 tokens). Graph replays always take the decode op, whose
        padded rows (seq_len 0) are valid decode rows but not prefill ones."""
        return self.device.type == "cuda"

    def cpu_kv_cache_bytes(self) -> float:
        return CPU_KV_CACHE_FRACTION * _available_ram_bytes()

    def threads_per_rank(self, tensor_parallel_size: int) -> int | None:
        """torch threads of each tensor-parallel rank: a share of the cores on CPU (N ranks each using every core
        would oversubscribe the machine N times over); None on GPUs (leave torch's default)."""
        if self.device.type != "cpu":
            return None
        return max(1, (os.cpu_count() or 1) // tensor_parallel_size)


def _env_flag(name: str, *, default: bool) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off (any case); unset or empty: ``default``."""
    env = os.environ.get(name, "").strip().lower()
    if not env:
        return default
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {os.environ[name]!r}")


def _skinny_gemm_max_rows(default: int) -> int:
    """DevicePolicy.skinny_gemm_max_rows: ENGINE_SKINNY_GEMM_MAX_ROWS, an int from 0 to skinny_gemm's MAX_ROWS
    (unset: ``default``)."""
    from pagedkernels.skinny_gemm import MAX_ROWS

    env = os.environ.get("ENGINE_SKINNY_GEMM_MAX_ROWS", "").strip()
    if not env:
        return default
    if not env.isdigit() or int(env) > MAX_ROWS:
        raise ValueError(f"ENGINE_SKINNY_GEMM_MAX_ROWS must be an int from 0 to {MAX_ROWS}, got {env!r}")
    return int(env)


def _cpu_bf16_w16_max_rows(isa: str | None, *, graphs: bool = False, amx_tiles: bool = True) -> int | None:
    """DevicePolicy.cpu_bf16_w16_max_rows (``graphs``: cpu_bf16_w16_graph_max_rows) for a CPU whose bf16 arithmetic is
    ``isa`` (``amx_tiles``: whether the native kernels can use AMX tiles there, assumed until they are built);
    ENGINE_CPU_BF16_W16_MAX_ROWS (ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS), a non-negative int or "all", overrides it."""
    name = "ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS" if graphs else "ENGINE_CPU_BF16_W16_MAX_ROWS"
    env = os.environ.get(name, "").strip()
    if env:
        if env == "all":
            return None
        if not env.isdigit():
            raise ValueError(f"{name} must be a non-negative int or 'all', got {env!r}")
        return int(env)
    if isa == "amx-bf16" and not amx_tiles:
        return 8
    if graphs:   # every row
        return None
    return {"amx-bf16": 64, "avx512-bf16": 96}.get(isa)


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> CUDA when available, else CPU; anything else must name a usable cpu or cuda device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return device


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
