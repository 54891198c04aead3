"""ModelRunner: owns the model and the KV cache, flattens a scheduled batch and runs one forward pass.

A batch is a list of ``(sequence, num_new_tokens)``: prefill chunks and single-token decodes mixed.
The runner packs all new tokens back to back (input ids, positions, cache slots) with per-sequence
``cu_seqlens_q`` / ``seq_lens`` / block tables, runs the model (whose attention layers call
pagedkernels), and computes logits only for the last new token of each sequence.

Pure-decode batches replay decode graphs (CUDA graphs, or CPU graphs of the native kernels):
engine/worker/decode_graphs.py, the runner's other half.

The forward runs under ``torch.compile`` (inductor, dynamic token count, fullgraph) by default on CUDA
unless ``enforce_eager``, eagerly on CPU, where the engine's own oneDNN linears and native kernels beat
inductor's code (SmolLM2 fp32, 48 requests, 2-core EPYC: 8.8 s eager, 16.4 s compiled once warm);
``compile_model=`` or ``ENGINE_COMPILE=1/0`` overrides either. pagedkernels' ops are registered custom
ops and each attention layer is one (``engine::unified_attention``), so the graph holds them as opaque
nodes; the decode graphs capture the compiled forward. A compilation that fails is logged and the
runner goes on eagerly.

Multi-LoRA (``enable_lora``, engine/lora): the model's decoder linears are wrapped in LoRA layers with
``max_loras`` device slots (:class:`engine.lora.LoRAManager`). Each step the runner places the adapters the
scheduler chose for it (``SchedulerOutput.lora_requests``) in the slots and writes every token's slot into the
layers' :class:`~engine.lora.LoRABatch` buffers; an adapter that no longer loads fails its requests alone (their
rows run without it, their outputs are dropped). A step none of whose tokens has an adapter skips the LoRA
kernels. Decode graphs are keyed by (batch size, LoRA active): ``graphs`` without adapters, ``lora_graphs`` with
them (the layers decide in Python, at capture, whether to launch the kernels); the slot buffers are static, so a
replay reads the step's slots.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

import pagedkernels as pk
from pagedkernels import _native as pk_native
from pagedkernels.cpu_graph import CPUGraph
from engine.config import EngineConfig, ModelConfig, kv_cache_torch_dtype
from engine.worker import cpu_malloc
from engine.distributed.communication import broadcast_tensor, min_over_ranks
from engine.distributed.parallel_state import get_tp_world_size, num_kv_heads_per_rank
from engine.layers.attention import Attention, AttentionMetadata, forward_context
from engine.layers.quantization import process_weights_after_loading
from engine.lora import LoRAManager, token_slots
from engine.worker.loader import load_dummy_weights, load_model
from engine.worker import memory as gpu_memory
from engine.worker.memory import MemorySnapshot, check_free_memory, kv_cache_budget
from engine.step_records import ModelRunnerOutput, PromptLogprobs, SampleLogprobs, SchedulerOutput
from engine.worker.decode_graphs import (CUDAGraphRunner, DecodeGraphs, EagerGraphRunner,  # noqa: F401 (re-exported)
                                         compile_shapes, cpu_graph_batch_sizes, graph_batch_sizes)
from engine.worker.input_batch import HostStaging, InputBatch, speculation_allowed
from engine.worker.ngram_proposer import propose_ngram
from engine.worker.rejection_sampler import rejection_sample, rejection_sample_greedy
from engine.worker.sampler import (AsyncModelRunnerOutput, Penalties, SampledIds, SampledTensors, Sampler,
                                   SamplingMetadata, banned_token_ids, pack_logprobs, plain_greedy,
                                   process_logits, random_probs, sampler_dummy_run, unpack_logprobs)
from engine.platform import DevicePolicy
from engine.models import get_model_class

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class ForwardResult:
    """A step's forward: the final hidden states [num_tokens, hidden]; or, when a decode graph ran the whole step
    (``step_graphs``), the logits of every token [num_tokens, vocab] float32 and their greedy ids [num_tokens]
    (NaN counted as -inf, as the sampler counts it), computed inside the graph. ``draft_ran``: a verification graph
    ran a draft model's forward over the same tokens too (DraftModel.run_target_step), so the step runs it no more."""
    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    greedy_ids: torch.Tensor | None = None
    draft_ran: bool = False


def _env_flag(name: str, default: bool) -> bool:
    """An engine switch from the environment: ``0`` / ``false`` turn it off, any other value on, unset or empty
    leaves ``default``."""
    env = os.environ.get(name, "").strip()
    return env not in ("0", "false", "False") if env else default


def _halves(num_tokens: int) -> list[int]:
    """The two prompts of a kernel warm-up step of ``num_tokens`` tokens (ModelRunner.warm_up_kernels)."""
    return [num_tokens // 2, num_tokens - num_tokens // 2]


class ModelRunner(DecodeGraphs):
    """One rank's model, KV cache, persistent batch and sampler (see the module docstring).

    Test knobs: `graph_runner_class` (a CPU double of CUDA graphs), `compile_model` (None: the device policy),
    `capture_graphs_at_startup` (None: on CUDA), `memory` (scripted memory counters: engine/worker/memory.py)."""

    def __init__(self, engine_config: EngineConfig, *, graph_runner_class: type | None = None,
                 compile_model: bool | None = None, capture_graphs_at_startup: bool | None = None, memory=None):
        self.engine_config = engine_config
        model_config = self.config = engine_config.model_config
        cache_config, scheduler_config = engine_config.cache_config, engine_config.scheduler_config
        self.load_format = engine_config.load_config.load_format
        self.device = torch.device(engine_config.device)
        # Host -> device copies of a step's inputs (pinned and double-buffered on CUDA).
        self.staging = HostStaging(self.device)
        self.dtype = model_config.dtype
        # The KV cache's dtype: the model's, or float8 e4m3 (kv_cache_dtype="fp8"; the layers' k/v scales come from
        # the checkpoint, engine/worker/loader.py).
        self.kv_cache_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, self.dtype)
        self.block_size = block_size = cache_config.block_size
        self.max_num_seqs = max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.policy = DevicePolicy.for_device(self.device)
        if self.policy.keep_freed_host_memory:
            cpu_malloc.keep_freed_memory()
            cpu_malloc.bound_onednn_caches()
        enforce_eager = engine_config.enforce_eager
        if compile_model is None:
            # as in vLLM, enforce_eager means no torch.compile either
            compile_model = _env_flag("ENGINE_COMPILE", self.policy.compile_by_default and not enforce_eager)
        self.compiled = bool(compile_model)
        self.prefault_kv_cache = _env_flag("ENGINE_CPU_KV_PREFAULT", self.policy.prefault_kv_cache)
        # CUDA graphs on CUDA; CPU graphs of the native kernels on CPU (pagedkernels.cpu_graph) for an eager forward
        # (inductor's own kernels are not recorded) on one rank (nor are collectives); a given graph-runner class
        # (tests' CPU double) anywhere.
        if graph_runner_class is None and self.policy.cuda_graphs:
            graph_runner_class = CUDAGraphRunner
        elif (graph_runner_class is None and self.policy.cpu_graphs and not enforce_eager and not self.compiled
              and get_tp_world_size() == 1 and pk_native.library() is not None):
            graph_runner_class = CPUGraph
        self.graph_runner_class = graph_runner_class
        self.enforce_eager = enforce_eager or graph_runner_class is None
        # A decode graph runs the whole step up to the sampler: the forward, the LM head over its rows and their
        # greedy argmax, so an all-greedy batch launches nothing outside the graph but the argmax's gather (on one
        # rank: the LM head's vocab-parallel gather is not captured; not in CPU graphs, whose replay over fewer rows
        # than they recorded would run oneDNN's LM head over the padding rows too).
        self.step_graphs = graph_runner_class is not CPUGraph and get_tp_world_size() == 1
        spec = engine_config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # Table columns for a sequence at max_model_len plus this step's drafts.
        self.max_blocks_per_seq = math.ceil((model_config.max_model_len + self.num_spec_tokens) / block_size)
        # KV heads of this rank's cache (all of them without tensor parallelism).
        self.num_kv_heads = num_kv_heads_per_rank(model_config.num_key_value_heads)
        torch.manual_seed(engine_config.seed)

        started = time.perf_counter()
        num_kv_blocks, gpu_memory_utilization = cache_config.num_gpu_blocks_override, cache_config.gpu_memory_utilization
        # The KV cache's budget on a GPU is measured (engine/worker/memory.py): counters from before the weights.
        # `memory`: the counters to use instead of the device's (a test double; it turns profiling on anywhere).
        self.memory = None
        if num_kv_blocks is None and (self.policy.profile_gpu_memory or memory is not None):
            self.memory = gpu_memory.device_memory(self.device) if memory is None else memory
            # blocks torch's allocator holds with no tensor in them (an engine shut down earlier in this process)
            # are the device's to give: back to the driver before the free memory is read
            self.memory.empty_cache()
            self._memory_at_start = MemorySnapshot.take(self.memory)
            check_free_memory(self._memory_at_start, gpu_memory_utilization)
            self.memory.reset_peak_memory_stats()
        self.model = self._build_model()
        self._report_kv_scales(self.model, model_config.model_dir)
        # Multi-LoRA: the decoder linears wrapped with their adapters' slots, before torch.compile sees the model.
        self.lora = None
        if engine_config.lora_config is not None:
            self.lora = LoRAManager(self.model, engine_config.lora_config, dtype=self.dtype,
                                    max_num_tokens=max(self.max_num_batched_tokens, max_num_seqs))
        # Steps of up to this many tokens take the few-row path of the layers that have one (meta.skinny); 0: none.
        self.skinny_max_rows = self._skinny_rows(self.policy.skinny_gemm_max_rows)
        # Whether a step graph of the few-row layers folds the final norm into its LM head's few-row product
        # (DevicePolicy.skinny_lm_head; set_skinny_lm_head).
        self._skinny_head_wanted = self.policy.skinny_lm_head
        self.skinny_head = self._skinny_head(self._skinny_head_wanted)
        # The forward every path calls: the module itself, or its torch.compile wrapper (compiled lazily per
        # input signature: mixed and decode batches, dynamic in the token count).
        self.forward = self.model
        if self.compiled:
            # One model compiles to a graph per batch kind (mixed / pure decode, one token / more); engines of
            # other shapes or architectures in the same process add theirs to the same code's cache, past
            # dynamo's default of 8 entries, after which it would refuse to compile.
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
            setattr(config, limit, max(getattr(config, limit), 64))
            self.forward = torch.compile(self.model, dynamic=True, fullgraph=True)
        # Speculative decoding's proposer: n-gram lookups here, or a draft model with its own KV cache.
        self.drafter = None
        if spec is not None and spec.method == "draft_model" and self._is_driver():
            from engine.worker.draft_model import DraftModel
            self.drafter = DraftModel(self, spec)
        built = time.perf_counter()
        self.num_kv_blocks = self._decide_num_kv_blocks(num_kv_blocks, gpu_memory_utilization)
        self._allocate_kv_cache()
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(self.num_kv_blocks)
        # Where the start-up went (logged when ready; benchmarks record it): the model built and loaded, the memory
        # profile's forward (the first compilation, on a GPU) and the KV cache, then the graphs captured at start.
        self.build_seconds = {"model": built - started, "memory profile and KV cache": time.perf_counter() - built}
        self.input_batch = InputBatch(max_num_seqs=max_num_seqs, max_model_len=model_config.max_model_len,
                                      max_num_spec_tokens=self.num_spec_tokens, block_size=block_size,
                                      vocab_size=model_config.vocab_size, device=self.device)
        self.sampler = Sampler(seed=engine_config.seed, device=self.device, fused_draw=self.policy.fused_sampler)
        # Async scheduling (engine/core/engine_core.py): the last step's plain-sampled ids while they are not on the
        # host yet; the next step's forward takes them from the device.
        self.async_scheduling = scheduler_config.async_scheduling
        self._pending: SampledIds | None = None
        # Decode batch sizes a graph is captured for (a batch pads up to the next one). A CPU graph after the
        # first is captured by the step that first needs it, for ~20 ms more than a replay, and replays smaller
        # batches over just their rows: a padding row would cost its share of every product there (not so on a
        # GPU, where a decode step's rows are nearly free). If the model's CPU graphs cannot replay fewer rows than
        # they recorded (CPUGraph.resizable), every batch size gets its own.
        self.graph_batch_sizes = (cpu_graph_batch_sizes(max_num_seqs) if graph_runner_class is CPUGraph
                                  else graph_batch_sizes(max_num_seqs))
        self.graphs: dict[int, object] = {}  # padded batch size -> captured graph runner
        self.lora_graphs: dict[int, object] = {}  # the same, for steps whose tokens run LoRA adapters
        # Speculative verification steps of q tokens a sequence: (padded batch size, q) -> captured graph runner
        # (DevicePolicy.spec_decode_graphs; not CPU graphs, which record the native kernels of one-token steps).
        self.verify_graphs: dict[tuple[int, int], object] = {}
        self.spec_graphs = (self.policy.spec_decode_graphs and self.num_spec_tokens > 0
                            and graph_runner_class not in (None, CPUGraph))
        if self.drafter is not None:
            self.drafter.set_graphs(self.spec_graphs)
        if self.device.type == "cuda":   # Triton compiles on first use: every variant now, not in the first steps
            warming = time.perf_counter()
            self.warm_up_kernels()
            self.build_seconds["kernel warm-up"] = time.perf_counter() - warming
        if not self.enforce_eager:
            self._allocate_static_buffers()
            # On CUDA every graph of the ladder is captured now (largest first, so the smaller ones reuse its
            # memory pool), as vLLM does: the first decode steps then do not pay for compilation and capture,
            # and the memory the graphs take is known before serving. The CPU double captures on first use
            # unless asked.
            if capture_graphs_at_startup is None:
                capture_graphs_at_startup = graph_runner_class is CUDAGraphRunner
            if capture_graphs_at_startup:
                cached = time.perf_counter()
                self.capture_all_graphs()
                self.build_seconds["graphs"] = time.perf_counter() - cached
        self.build_seconds["total"] = time.perf_counter() - started
        logger.info("model runner ready in %.1f s (%s)", self.build_seconds["total"], ", ".join(
            f"{part} {seconds:.1f} s" for part, seconds in self.build_seconds.items() if part != "total"))

    # -- setup ------------------------------------------------------------------------------------

    def _build_model(self, model_config: ModelConfig | None = None) -> torch.nn.Module:
        """The model of `model_config` (default: the runner's), its weights loaded, on the runner's device. A
        draft model for speculative decoding is built here too."""
        model_config = model_config or self.config
        model_class = get_model_class(model_config.architecture)
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(model_config)
        finally:
            torch.set_default_dtype(previous_dtype)
        (load_dummy_weights if self.load_format == "dummy" else load_model)(model, model_config.model_dir)
        # Built under `torch.device(self.device)`: a parameter or buffer elsewhere is a tensor made on an explicit
        # other device (a CPU-only assumption), which would fail in the first forward.
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.device != self.device and not (self.device.index is None
                                                      and tensor.device.type == self.device.type):
                raise RuntimeError(f"{type(model).__name__}.{name} is on {tensor.device}, not on {self.device}")
        model.eval()
        # Each layer's quantization method turns the checkpoint's tensors into its kernel's layout (GPTQ/AWQ to
        # pagedkernels' int4/int8 layout, fp8 on load). Then float32 CPU linears run oneDNN's inner product:
        # reorder their weights into its layout once instead of on every call (the unquantized method). A
        # no-op for other dtypes. Not under torch.compile: inductor cannot trace oneDNN's opaque weight
        # tensors and brings its own GEMMs.
        with torch.no_grad():
            process_weights_after_loading(model, prepack=self.policy.prepack_linears and not self.compiled)
        return model

    def _report_kv_scales(self, model: torch.nn.Module, model_dir: str) -> None:
        """Log which k/v scales an fp8 cache uses (the checkpoint's, or 1.0), or that a checkpoint's scales go
        unused by a cache in the model's dtype."""
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        loaded = [layer for layer in layers if layer.kv_scales_loaded]
        if self.kv_cache_dtype != torch.float8_e4m3fn:
            if loaded:
                logger.info("%s has k/v scales for an fp8 KV cache; unused by this %s cache (kv_cache_dtype='fp8' "
                            "uses them)", model_dir, str(self.kv_cache_dtype).replace("torch.", ""))
            return
        if not loaded:
            logger.warning("fp8 KV cache with k_scale = v_scale = 1.0: %s has no k/v scales, so K/V beyond +-448 "
                           "are clipped and small values lose precision (checkpoints calibrated with llm-compressor "
                           "carry them)", model_dir)
        elif len(loaded) < len(layers):
            logger.warning("fp8 KV cache: %s has k/v scales for %d of %d attention layers; the others use 1.0",
                           model_dir, len(loaded), len(layers))
        else:
            logger.info("fp8 KV cache with the checkpoint's k/v scales (k_scale %.4g..%.4g, v_scale %.4g..%.4g)",
                        min(layer.k_scale for layer in layers), max(layer.k_scale for layer in layers),
                        min(layer.v_scale for layer in layers), max(layer.v_scale for layer in layers))

    def _block_bytes(self) -> int:
        """Bytes of one KV block in every cache it has a copy in (the model's, and a draft model's): 1 byte per
        value in an fp8 cache, the model dtype's size otherwise."""
        c = self.config
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        target = 2 * c.num_hidden_layers * self.block_size * self.num_kv_heads * c.head_dim * element_size
        return target + (self.drafter.block_bytes() if self.drafter is not None else 0)

    def _decide_num_kv_blocks(self, num_kv_blocks: int | None, gpu_memory_utilization: float) -> int:
        if num_kv_blocks is not None:
            if not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be a positive int, got {num_kv_blocks!r}")
            return num_kv_blocks
        # More blocks than every sequence at full length could use would be wasted memory.
        useful = self.max_num_seqs * self.max_blocks_per_seq
        if self.memory is not None:
            free = self._profile_kv_cache_bytes(gpu_memory_utilization)
        else:
            free = self.policy.cpu_kv_cache_bytes()
        num_blocks = min(useful, max(0, int(free // self._block_bytes())))
        if get_tp_world_size() > 1:   # every rank holds the same block ids: the smallest budget decides
            num_blocks = min_over_ranks(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"not enough memory for a single KV-cache block of {self._block_bytes()} bytes")
        logger.info("KV cache: %d blocks of %d bytes (%.2f GiB); budget %.2f GiB free for it, %d blocks would "
                    "hold every sequence at full length", num_blocks, self._block_bytes(),
                    num_blocks * self._block_bytes() / 2**30, free / 2**30, useful)
        return num_blocks

    def _profile_kv_cache_bytes(self, gpu_memory_utilization: float) -> float:
        """The KV cache's budget in bytes (engine/worker/memory.py): run the profile step, then
        gpu_memory_utilization * total - torch's peak since the start - memory taken outside torch."""
        self._profile_run()
        peak = self.memory.max_memory_allocated()
        after = MemorySnapshot.take(self.memory)
        budget = kv_cache_budget(self._memory_at_start, after, peak, gpu_memory_utilization)
        self.memory.empty_cache()
        logger.info("memory profile: %.2f GiB of %.2f GiB for the engine (gpu_memory_utilization=%s); weights and "
                    "the largest step peak at %.2f GiB in torch, %.2f GiB more used outside torch; KV-cache budget "
                    "%.2f GiB", budget.requested / 2**30, self._memory_at_start.total / 2**30,
                    gpu_memory_utilization, budget.torch_peak / 2**30, budget.non_torch / 2**30,
                    budget.kv_cache / 2**30)
        return budget.kv_cache

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step the engine runs, on a temporary KV cache of just its blocks: max_num_batched_tokens
        tokens over min(max_num_seqs, tokens) sequences (each within max_model_len), the logits of every token
        (a step whose whole chunk asks for prompt logprobs) with their log-softmax, and the sampler with every
        stage on over the sequences' last tokens."""
        max_len = self.config.max_model_len
        num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)
        num_tokens = min(self.max_num_batched_tokens, num_seqs * max_len)
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        input_ids_t, positions_t, meta, num_blocks = self._prompt_inputs(lens)
        self._bind_kv_cache(torch.empty(2, self.config.num_hidden_layers, num_blocks, self.block_size,
                                        self.num_kv_heads, self.config.head_dim, dtype=self.kv_cache_dtype,
                                        device=self.device))
        if self.lora is not None:   # the LoRA kernels' buffers count in the peak too
            self.lora.prepare_batch(None, num_tokens, active=True)
        hidden_states = self._forward(input_ids_t, positions_t, meta)
        logits = self.model.compute_logits(hidden_states[self._to_device(np.cumsum(lens) - 1)])
        prompt_logits = self.model.compute_logits(hidden_states)
        del hidden_states
        prompt_logprobs = torch.log_softmax(prompt_logits, dim=-1)
        sampler_dummy_run(logits)
        del logits, prompt_logits, prompt_logprobs
        self._bind_kv_cache(None)
        if self.lora is not None:
            self.lora.prepare_batch(None)

    def warm_up_sizes(self) -> list[int]:
        """The token counts of :meth:`warm_up_kernels`' forwards: 4, 8, 16, ... below max_num_batched_tokens (the
        memory profile's step), each within the KV cache's blocks."""
        sizes, n = [], 4
        while n < self.max_num_batched_tokens and self._blocks_of(_halves(n)) <= self.num_kv_blocks:
            sizes.append(n)
            n *= 2
        return sizes

    def _blocks_of(self, lens: list[int]) -> int:
        """KV blocks that sequences of ``lens`` tokens take, each on blocks of its own."""
        return sum(-(-n // self.block_size) for n in lens)

    def _prompt_inputs(self, lens: list[int]) -> tuple:
        """A start-up step's inputs: prompts of ``lens`` tokens (token id 0), all new, each on blocks of its own from
        block 0. Returns (input_ids, positions, metadata, the blocks they take)."""
        blocks = [-(-n // self.block_size) for n in lens]
        first = np.cumsum([0] + blocks)
        block_tables = np.zeros((len(lens), max(blocks)), dtype=np.int32)
        for i, count in enumerate(blocks):
            block_tables[i, :count] = np.arange(first[i], first[i] + count)
        positions = np.concatenate([np.arange(n) for n in lens])
        inputs = self.build_inputs(np.zeros(len(positions), dtype=np.int64), positions,
                                   np.asarray(lens, dtype=np.int64), block_tables)
        return (*inputs, int(first[-1]))

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Launch before serving every kernel variant a step of another shape would otherwise compile on first use.

        Triton compiles a kernel per variant (tests/engine/test_kernel_variants.py), most of a second each
        (docs/gpu.md): the first prompt of a new size would stall the step, and every request in it. The kernels take
        no count of the step's as a specialized argument (``do_not_specialize``), so what is left are the launch
        configs that follow the token count (LoRA's and fused_moe's tiles, fused_moe's layouts, the quantized GEMM's
        split): prompts of two sequences of 4, 8, 16, ... tokens between them (each config spans at least a doubling),
        on the KV cache's first blocks (nothing is cached yet), the LoRA kernels on when the engine has adapters, a
        draft model's forward beside the target's; and the sampler's fused draw (Sampler.warm_up_kernels). The memory
        profile ran the largest step; the decode graphs' captures launch the decode steps' kernels."""
        sizes = self.warm_up_sizes()
        for num_tokens in sizes:
            lens = _halves(num_tokens)
            input_ids_t, positions_t, meta, _ = self._prompt_inputs(lens)
            if self.lora is not None:
                self.lora.prepare_batch(None, num_tokens, active=True)
            hidden_states = self._forward(input_ids_t, positions_t, meta)
            if self.drafter is not None:   # a draft model computes the KV of every step's tokens too
                self.drafter.run_target_step(input_ids_t, positions_t, meta)
            if num_tokens == sizes[0]:   # the sampler's kernels on the two sequences' logits
                last = self._to_device(np.cumsum(lens) - 1)
                self.sampler.warm_up_kernels(self.model.compute_logits(hidden_states[last]))
            self.staging.next_step()
        if self.lora is not None:
            self.lora.prepare_batch(None)

    def _allocate_kv_cache(self) -> None:
        c = self.config
        # One allocation for all layers: [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_cache = torch.empty(2, c.num_hidden_layers, self.num_kv_blocks, self.block_size,
                                    self.num_kv_heads, c.head_dim, dtype=self.kv_cache_dtype, device=self.device)
        self.commit_kv_cache(self.kv_cache, "KV cache")
        self._bind_kv_cache(self.kv_cache)
        self.key_caches = list(self.kv_cache[0])
        self.value_caches = list(self.kv_cache[1])

    def commit_kv_cache(self, kv_cache: torch.Tensor, what: str) -> None:
        """Commit a freshly allocated KV cache's host memory now (``DevicePolicy.prefault_kv_cache``, on CPU, unless
        ``ENGINE_CPU_KV_PREFAULT=0``), so that no step waits on its page faults."""
        if kv_cache.device.type != "cpu" or not self.prefault_kv_cache:
            return
        start = time.perf_counter()
        try:
            how = cpu_malloc.prefault(kv_cache)
        except MemoryError as error:
            raise MemoryError(f"{what}: {error}. Give it fewer blocks (num_kv_blocks=), or leave its pages to their "
                              f"first writes with ENGINE_CPU_KV_PREFAULT=0") from error
        logger.info("%s: %.2f GiB committed in %.1f s (%s; ENGINE_CPU_KV_PREFAULT=0 leaves it to first writes)", what,
                    kv_cache.numel() * kv_cache.element_size() / 2**30, time.perf_counter() - start, how)

    def _bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        layers = self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for i, layer in enumerate(layers):
            layer.layer_index = i
            # The decode op on CUDA, and wherever decode graphs run: padded rows (seq_len 0) are
            # valid decode rows but not prefill ones (a query needs its token in the cache).
            layer.use_decode_kernel = self.policy.decode_kernel_in_eager() or not self.enforce_eager
            layer.key_cache = None if kv_cache is None else kv_cache[0, i]
            layer.value_cache = None if kv_cache is None else kv_cache[1, i]
        if layers and self.device.type == "cuda":
            # The split-K scratch of the decode op, allocated once and shared by every layer (they run one
            # after another on one stream): a decode launch, captured in a graph or not, allocates nothing.
            first = layers[0]
            self.decode_workspace = pk.decode_workspace(
                self.max_num_seqs, first.num_heads, first.num_kv_heads, first.head_dim, device=self.device,
                max_context=self.config.max_model_len)
            # The decode op's split counters (pagedkernels.decode_split_counters), shared the same way; the layers
            # take them where the splits are merged in the split kernel (DevicePolicy.decode_fused_reduce).
            self.decode_split_counters = pk.decode_split_counters(
                self.max_num_seqs, max(layer.num_kv_heads for layer in layers), device=self.device)
            for layer in layers:
                layer.decode_workspace = self.decode_workspace
                layer.decode_split_counters = self.decode_split_counters if self.policy.decode_fused_reduce else None
                layer.decode_fused_rope = self.policy.decode_fused_rope

    # -- per step ---------------------------------------------------------------------------------

    def build_inputs(self, input_ids: np.ndarray, positions: np.ndarray, query_lens: np.ndarray,
                     block_tables: np.ndarray, *, graph: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The forward's inputs on the device from the host arrays of a batch of sequences: input_ids and
        positions int64 [num_tokens] (sequence after sequence), query_lens int64 [num_seqs] (their new tokens),
        block_tables int32 [num_seqs, width] (width: the columns the batch touches). Slots come from the tables;
        seq_lens = the last position + 1 of each sequence. ``graph``: the inputs go to ``_forward_hidden``, so a
        pure-decode step on CUDA lands them in its decode graph's own inputs (views of them are returned, valid
        until the next such step)."""
        num_seqs = len(query_lens)
        cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        seq_lens = (positions[cu_seqlens_q[1:] - 1] + 1).astype(np.int32)
        slot_mapping = (block_tables[seq_index, positions // self.block_size].astype(np.int64) * self.block_size
                        + positions % self.block_size)
        graph_size = (self.decode_graph_size(len(positions), num_seqs)
                      if graph and self.staging.pinned and block_tables.shape[1] <= self.max_blocks_per_seq else None)
        if graph_size is not None:   # on CUDA a graph's step: one copy into the graph's own inputs, padding and all
            static = self.stage_decode_inputs(graph_size, input_ids, positions, slot_mapping, seq_lens, block_tables)
            meta = AttentionMetadata(slot_mapping=static.slot_mapping[:num_seqs],
                                     block_tables=static.block_tables[:num_seqs, :block_tables.shape[1]],
                                     seq_lens=static.seq_lens[:num_seqs],
                                     cu_seqlens_q=self.static_cu_seqlens_q[:num_seqs + 1], is_decode=True,
                                     skinny=num_seqs <= self.skinny_max_rows)
            input_ids_t = static.input_ids[:num_seqs]
            self._staged_decode_inputs = input_ids_t   # run_decode_graph finds them in place
            return input_ids_t, static.positions[:num_seqs], meta
        is_decode = len(positions) == num_seqs
        if self.forward is not self.model:
            seq_lens, block_tables, cu_seqlens_q = _no_dimension_of_one(seq_lens, block_tables, cu_seqlens_q,
                                                                        is_decode)
        # One copy to the device for the six (on CUDA; views on CPU).
        input_ids_t, positions_t, slot_mapping_t, block_tables_t, seq_lens_t, cu_seqlens_q_t = \
            self.staging.to_device_many(input_ids, positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q)
        meta = AttentionMetadata(slot_mapping=slot_mapping_t, block_tables=block_tables_t, seq_lens=seq_lens_t,
                                 cu_seqlens_q=cu_seqlens_q_t, is_decode=is_decode,
                                 skinny=len(positions) <= self.skinny_max_rows)
        return input_ids_t, positions_t, meta

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the runner's device: a view on CPU; on CUDA an asynchronous copy out of
        pinned memory (engine/worker/input_batch.py HostStaging), which neither waits for the device nor lets the
        driver stage a pageable source first (the step profile on an H100 counted 11 cudaStreamSynchronize a
        decode step when these copies were plain)."""
        return self.staging.to_device(array)

    def _forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        num_seqs: int, lora_slots: np.ndarray | None = None,
                        query_lens: np.ndarray | None = None) -> ForwardResult:
        """The forward (see ForwardResult): a pure-decode batch within the ladder replays its graph, and so does a
        batch of speculative verification (``query_lens``, its sequences' tokens, all the same: verify_graph_shape).
        lora_slots: int32 [num_tokens], each token's LoRA slot (-1: none), or None: no adapter in the step."""
        if meta.is_decode and self.decode_graph_size(input_ids.shape[0], num_seqs) is not None:
            output = self.run_decode_graph(input_ids, positions, meta, lora_slots)
            if isinstance(output, tuple):
                return ForwardResult(logits=output[0], greedy_ids=output[1])
            return ForwardResult(hidden_states=output)
        shape = self.verify_graph_shape(input_ids.shape[0], num_seqs, query_lens) if lora_slots is None else None
        if shape is not None:
            return ForwardResult(hidden_states=self.run_verify_graph(shape, input_ids, positions, meta),
                                 draft_ran=self.drafter is not None)
        self._prepare_lora(lora_slots, input_ids.shape[0])
        return ForwardResult(hidden_states=self._forward(input_ids, positions, meta))

    def _prepare_lora(self, lora_slots: np.ndarray | None, num_tokens: int) -> bool:
        """The LoRA layers' slots for a forward of `num_tokens` rows (those past lora_slots padding); returns
        whether the layers run their kernels (some token has an adapter). False without LoRA. On CUDA the slots
        go through the pinned staging (a pageable copy would wait for the device)."""
        if self.lora is None:
            return False
        active = lora_slots is not None and bool((lora_slots >= 0).any())
        self.lora.prepare_batch(self._to_device(lora_slots) if active else None, num_tokens, active=active)
        return active

    def _logits(self, forward: ForwardResult, index: np.ndarray | slice) -> torch.Tensor:
        """Logits [len(index), vocab] float32 of the step's tokens `index` (positions in the flattened batch). Every
        row in order (a decode step's) is a view, no gather: the step graph's output rows are valid until its next
        replay, past this step's sampling."""
        rows = forward.logits if forward.logits is not None else forward.hidden_states
        where = self._rows_index(index, rows.shape[0])
        if forward.logits is not None:
            return forward.logits[where]
        return self.model.compute_logits(forward.hidden_states[where])

    def _rows_index(self, index: np.ndarray | slice, num_rows: int) -> torch.Tensor | slice:
        """`index` (positions among `num_rows` rows) as a tensor indexer: a slice as it is, every row in order as the
        slice of all of them (no copy to the device, no gather kernel), else the positions on the device."""
        if isinstance(index, slice):
            return index
        index = np.asarray(index, dtype=np.int64)
        if len(index) == num_rows and (num_rows == 0 or (index[0] == 0 and (np.diff(index) == 1).all())):
            return slice(None)
        return self._to_device(index)

    # -- the step on the persistent batch ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """Apply the step's diff to the persistent batch, run the scheduled tokens (drafts included), and
        sample: every sequence whose scheduled tokens reach its end gets its next token(s), a fork named in
        `sample_from` samples from its parent's logits. Returns what was sampled (rank 0; None on the other
        ranks, which only run the forward). The worker appends what it sampled to its own batch.

        With async scheduling the sampled ids stay on the device: the return value is an AsyncModelRunnerOutput
        whose get_output() reads them (one step later), and a sequence's next step, scheduled before the core
        has the id, takes its input token from the device (SampledIds.scatter_into)."""
        batch = self.input_batch
        batch.update(scheduler_output)
        self.staging.next_step()
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_seq_ids)
        pending = self._pending   # the previous step's ids, when they are not on the host yet (async scheduling)
        if pending is not None and get_tp_world_size() > 1:
            broadcast_tensor(pending.ids)   # every rank feeds the same ids to its forward
        num_rows = batch.num_rows
        if num_rows == 0:
            self._resolve_pending()
            return ModelRunnerOutput()
        seq_ids = batch.seq_ids[:num_rows]
        scheduled = scheduler_output.num_scheduled_tokens
        query_lens_all = np.array([scheduled.get(seq_id, 0) for seq_id in seq_ids], dtype=np.int64)
        # Each row's tokens: a row scheduled past the tokens the core has computes the one in flight (sampled
        # last step, its id still on the device); the host may or may not have it yet.
        num_tokens_all = batch.num_tokens[:num_rows].copy()
        in_flight = None   # (rows, the position of each one's token in flight)
        if pending is not None:
            in_flight = self._rows_in_flight(pending, scheduler_output, query_lens_all)
            rows, known = in_flight
            num_tokens_all[rows] = np.maximum(num_tokens_all[rows], known + 1)
        num_drafts = np.zeros(num_rows, dtype=np.int64)
        for seq_id, drafts in scheduler_output.spec_token_ids.items():
            row = batch.row_of[seq_id]
            start = batch.num_tokens[row]
            batch.token_ids[row, start:start + len(drafts)] = drafts   # after the tokens: scratch, not counted
            num_drafts[row] = len(drafts)
        model_rows = np.flatnonzero(query_lens_all > 0)
        query_lens = query_lens_all[model_rows]
        num_seqs, num_tokens = len(model_rows), int(query_lens.sum())
        starts = batch.num_computed_tokens[model_rows]
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = starts[seq_index] + np.arange(num_tokens) - cu[:-1][seq_index]
        input_ids = batch.token_ids[model_rows[seq_index], positions].astype(np.int64)
        width = max(1, -(-int((starts + query_lens).max()) // self.block_size))
        input_ids_t, positions_t, meta = self.build_inputs(input_ids, positions, query_lens,
                                                           batch.block_table[model_rows, :width], graph=True)
        if in_flight is not None and len(in_flight[0]):   # their input at that position: the id in flight
            self._feed_in_flight(pending, *in_flight, model_rows, starts, cu, input_ids_t)
        lora_failed: dict[int, str] = {}   # seq_id -> why its adapter is missing (its request fails)
        lora_slots = None
        if self.lora is not None and scheduler_output.lora_requests:
            lora_slots = self._lora_token_slots(scheduler_output, model_rows, query_lens, lora_failed)
        forward = self._forward_hidden(input_ids_t, positions_t, meta, num_seqs, lora_slots, query_lens)
        if self.drafter is not None and not forward.draft_ran:
            self.drafter.run_target_step(input_ids_t, positions_t, meta)
        # The forward is queued: now the previous step's ids may come to the host (penalties, bad words, min_tokens
        # and the n-gram proposer read the rows' tokens there).
        self._resolve_pending()

        # Logits rows: the last 1 + drafts positions of each sequence that reaches its end this step.
        ends = starts + query_lens
        samples = ends >= num_tokens_all[model_rows] + num_drafts[model_rows]
        sample_rows = model_rows[samples]
        num_logits = 1 + num_drafts[sample_rows]
        last = cu[1:][samples]
        if not num_drafts.any():
            logits_index = last - 1   # each sampling sequence's last token
        else:
            logits_index = np.concatenate([np.arange(end - n, end) for end, n in zip(last, num_logits)]) \
                if len(sample_rows) else np.zeros(0, dtype=np.int64)
        prompt_rows = [(i, row) for i, row in zip(np.flatnonzero(batch.special[model_rows]).tolist(),
                                                  model_rows[batch.special[model_rows]].tolist())
                       if batch.state_at(row).params.prompt_logprobs is not None
                       and starts[i] < batch.num_prompt_tokens[row] - 1]
        first_logit = dict(zip(sample_rows.tolist(), np.cumsum(num_logits) - num_logits))
        if not self._is_driver():
            # Every rank takes part in the vocab-parallel gathers, in rank 0's order: the prompt rows, then the
            # sampling rows (gathers of different sizes crossed in gloo abort the process).
            for i, _ in prompt_rows:
                self._logits(forward, slice(int(cu[i]), int(cu[i + 1])))
            if len(logits_index):
                self._logits(forward, logits_index)
            if self.async_scheduling:   # rank 0 broadcasts these rows' ids with the next step
                plain, _, _ = self._split_sampling(scheduler_output, first_logit, num_drafts)
                self._pending = SampledIds([batch.seq_ids[row] for row, _ in plain], self.device) if plain else None
            return None
        output = ModelRunnerOutput(failed=dict(lora_failed))
        for i, row in prompt_rows:
            try:
                output.prompt_logprobs[batch.seq_ids[row]] = self._prompt_logprobs(
                    row, int(starts[i]), self._logits(forward, slice(int(cu[i]), int(cu[i + 1]))))
            except Exception as error:   # this request's own failure: it alone ends (see _isolated)
                self._fail_entries([(row, None)], error, output)
        if len(sample_rows) == 0 and not scheduler_output.sample_from:
            return output
        if len(logits_index):
            logits = self._logits(forward, logits_index)
        else:
            logits = torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        greedy_ids = None
        if forward.greedy_ids is not None and len(logits_index):
            greedy_ids = forward.greedy_ids[self._rows_index(logits_index, forward.greedy_ids.shape[0])]
        sampled = self._sample(scheduler_output, logits, first_logit, num_drafts, output, greedy_ids)
        for seq_id in lora_failed:   # sampled from rows computed without their adapter: dropped
            for results in (output.sampled_token_ids, output.logprobs, output.beam_candidates,
                            output.num_accepted_tokens, output.prompt_logprobs, output.spec_token_ids):
                results.pop(seq_id, None)
        if sampled is not None and self.async_scheduling:
            sampled.start_copy()
            self._pending = sampled
            return AsyncModelRunnerOutput(output, sampled)
        for seq_id, token_ids in output.sampled_token_ids.items():   # the worker's own tokens, as the core's
            batch.append_sampled(seq_id, token_ids, at=len(batch.states[seq_id].token_ids))
        return output

    def _lora_token_slots(self, scheduler_output: SchedulerOutput, model_rows: np.ndarray, query_lens: np.ndarray,
                          failed: dict[int, str]) -> np.ndarray:
        """int32 [num_tokens]: the LoRA slot of each token of the step (-1: the base model), after placing the
        step's adapters (scheduler_output.lora_requests) in the device slots. An adapter that fails to load (its
        directory changed since its requests were accepted) leaves its rows on the base model and their sequences
        in `failed` (seq_id -> message naming lora_request): the core fails those requests alone."""
        missing: dict[int, str] = {}
        slot_of = self.lora.set_active_adapters(
            list(scheduler_output.lora_requests.values()),
            on_error=lambda request, error: missing.__setitem__(request.lora_int_id, f"lora_request: {error}"))
        batch = self.input_batch
        lora_ids = batch.lora_int_id[model_rows]
        row_slots = np.full(len(model_rows), -1, dtype=np.int32)
        for lora_int_id, slot in slot_of.items():
            row_slots[lora_ids == lora_int_id] = slot
        for lora_int_id, message in missing.items():
            for row in model_rows[lora_ids == lora_int_id].tolist():
                failed[batch.seq_ids[row]] = message
        return token_slots(row_slots, query_lens)

    # -- adapters (the executor's add_lora / remove_lora, between steps) ----------------------------------------

    def add_lora(self, lora_request) -> bool:
        """Load an adapter into the host cache (ValueError for a bad one); returns whether it was read."""
        if self.lora is None:
            raise ValueError("this engine was started without LoRA (enable_lora=True)")
        return self.lora.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache and its device slot (between steps: no batch holds it now; a step
        that needs it again loads it again). Returns whether it was loaded."""
        if self.lora is None:
            return False
        self.lora.unpin()
        return self.lora.remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters in the host cache, least recently used first."""
        return [] if self.lora is None else [r.lora_int_id for r in self.lora.list_adapters()]

    def _rows_in_flight(self, pending: SampledIds, scheduler_output: SchedulerOutput,
                        query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, known) int64: the rows whose scheduled tokens reach past the `known` tokens the core has of their
        sequence (this step's diff tells: all of a new sequence's, a known one's up to the end of the tokens it sent)
        and whose token at position `known` is in flight (sampled last step, in `pending`)."""
        batch = self.input_batch
        row_of, position = batch.row_of, pending.position
        rows, known = [], []
        for new in scheduler_output.new_seqs:
            row = row_of.get(new.seq_id)
            if row is not None and new.seq_id in position:
                rows.append(row)
                known.append(len(new.token_ids))
        for cached in scheduler_output.cached_seqs:
            if cached.token_start is not None and cached.seq_id in position:
                row = row_of.get(cached.seq_id)
                if row is not None:
                    rows.append(row)
                    known.append(cached.token_start + len(cached.new_token_ids))
        rows, known = np.array(rows, dtype=np.int64), np.array(known, dtype=np.int64)
        ahead = batch.num_computed_tokens[rows] + query_lens[rows] > known
        return rows[ahead], known[ahead]

    def _zero_temperatures(self, n: int) -> torch.Tensor:
        """float32 zeros [n] on the device, kept between steps: an all-greedy step's temperatures without a copy to
        the device (the sampler reads them, never writes them)."""
        zeros = getattr(self, "_zeros_f32", None)
        if zeros is None or zeros.numel() < n:
            zeros = self._zeros_f32 = torch.zeros(max(n, self.max_num_seqs), dtype=torch.float32, device=self.device)
        return zeros[:n]

    def _feed_in_flight(self, pending: SampledIds, rows: np.ndarray, positions: np.ndarray, model_rows: np.ndarray,
                        starts: np.ndarray, cu: np.ndarray, input_ids: torch.Tensor) -> None:
        """Write the ids in flight into the forward's input ids, on the device (no value read): row rows[j]'s token at
        position positions[j] is the one it sampled last step (every such row is in the step: model_rows, sorted)."""
        i = np.searchsorted(model_rows, rows)
        token_index = cu[i] + positions - starts[i]
        seq_ids = self.input_batch.seq_ids
        pending.scatter_into(input_ids, token_index, [seq_ids[row] for row in rows.tolist()],
                             self.staging.to_device_many)

    def _resolve_pending(self) -> None:
        """The previous step's sampled ids on the host (waiting for their copy, normally long landed): appended to
        the batch, as the core will append them."""
        pending, self._pending = self._pending, None
        if pending is None or not self._is_driver():
            return
        pending.resolve()
        seq_ids, values, lengths = pending.seq_ids, pending.values, pending.host_lengths
        if pending.failed:
            kept = [j for j, seq_id in enumerate(seq_ids) if seq_id not in pending.failed]
            seq_ids, values, lengths = ([items[j] for j in kept] for items in (seq_ids, values, lengths))
        self.input_batch.append_sampled_ids(seq_ids, values, lengths)

    def _is_driver(self) -> bool:
        from engine.distributed.parallel_state import get_tp_rank
        return get_tp_rank() == 0

    def _prompt_logprobs(self, row: int, start: int, logits: torch.Tensor) -> PromptLogprobs:
        """logits [num_new_tokens, vocab] at positions start.. of the sequence in `row`: position p scores prompt
        token p + 1."""
        batch = self.input_batch
        state = batch.state_at(row)
        num_rows = min(logits.shape[0], state.num_prompt_tokens - 1 - start)
        logprobs = torch.log_softmax(logits[:num_rows].float(), dim=-1)
        targets = state.token_ids[start + 1:start + 1 + num_rows]
        target_t = torch.tensor(targets, device=logprobs.device)
        target_lp = logprobs.gather(1, target_t[:, None])
        ranks = (logprobs > target_lp).sum(dim=-1) + 1
        k = state.params.prompt_logprobs
        if k > 0:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        else:
            top_lp, top_ids = [[] for _ in targets], [[] for _ in targets]
        return PromptLogprobs(start=start + 1, token_ids=list(targets), logprobs=target_lp.squeeze(1).tolist(),
                              ranks=ranks.tolist(), topk_token_ids=top_ids, topk_logprobs=top_lp)

    def _split_sampling(self, scheduler_output: SchedulerOutput, first_logit: dict[int, int],
                        num_drafts: np.ndarray) -> tuple[list, list, list]:
        """The sampling rows as (plain, beams, speculative) lists of (row, logits index): beams get their top
        candidates, sequences with drafts go through rejection sampling, the rest (forks sampling from their parent's
        row included) take one token each."""
        batch = self.input_batch
        plain, beams, speculative = [], [], []   # (row, logits index)
        for row, index in first_logit.items():
            state = batch.state_at(row)
            if state.beam_candidates:
                beams.append((row, index))
            elif num_drafts[row]:
                speculative.append((row, index))
            else:
                plain.append((row, index))
        for child, parent in scheduler_output.sample_from.items():
            plain.append((batch.row_of[child], first_logit[batch.row_of[parent]]))
        return plain, beams, speculative

    def _sample(self, scheduler_output: SchedulerOutput, logits: torch.Tensor, first_logit: dict[int, int],
                num_drafts: np.ndarray, output: ModelRunnerOutput,
                greedy_ids: torch.Tensor | None = None) -> SampledIds | None:
        """Sample the rows that reached their end (and the forks sampling from their parent's row) into
        `output`: beams and speculative rows at once; the plain rows' ids stay on the device in the returned
        SampledIds, put into `output` here unless async scheduling reads them a step later. greedy_ids: the
        logits rows' greedy ids, computed inside a decode graph (an all-greedy plain batch takes them as they are)."""
        batch = self.input_batch
        plain, beams, speculative = self._split_sampling(scheduler_output, first_logit, num_drafts)
        sampled = None
        if beams:
            self._isolated(beams, lambda part: self._beam_candidates(part, logits, output), output)
        if plain:
            sampled = SampledIds([batch.seq_ids[row] for row, _ in plain], self.device,
                                 [len(batch.state_at(row).token_ids) for row, _ in plain])
            self._isolated(plain, lambda part: self._sample_plain(scheduler_output, plain, part, logits, sampled,
                                                                  greedy_ids), output)
            sampled.failed = {seq_id for seq_id in sampled.seq_ids if seq_id in output.failed}
            if not self.async_scheduling:
                sampled.fill(output)
        if speculative:
            self._isolated(speculative, lambda part: self._sample_speculative(part, logits, num_drafts, output),
                           output)
        if self.num_spec_tokens:
            self._propose(output, scheduler_output)
        return sampled

    def _isolated(self, entries: list[tuple[int, int]], run: Callable[[list], None],
                  output: ModelRunnerOutput) -> None:
        """run(entries) (a batched sampling call); when it raises, run each entry alone, so that a request whose
        parameters break the call (or a bug its rows alone reach) fails by itself: its sequences are named in
        output.failed and the others get exactly what the batched call gives them (greedy rows, seeded rows;
        the rows drawing from the shared generator draw again)."""
        try:
            run(entries)
            return
        except Exception as error:
            if len(entries) == 1:
                self._fail_entries(entries, error, output)
                return
            logger.warning("a batched sampling call failed (%s: %s); sampling its %d rows one by one",
                           type(error).__name__, error, len(entries))
        for entry in entries:
            try:
                run([entry])
            except Exception as error:
                self._fail_entries([entry], error, output)

    def _fail_entries(self, entries: list[tuple[int, int | None]], error: Exception,
                      output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        for row, _ in entries:
            seq_id = batch.seq_ids[row]
            logger.error("sampling failed for sequence %d; failing its request", seq_id, exc_info=error)
            output.failed[seq_id] = f"{type(error).__name__}: {error}"
            for results in (output.sampled_token_ids, output.logprobs, output.beam_candidates,
                            output.num_accepted_tokens, output.prompt_logprobs):
                results.pop(seq_id, None)

    def _beam_candidates(self, beams: list[tuple[int, int]], logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        index = torch.tensor([i for _, i in beams], device=logits.device)
        width = max(batch.state_at(row).beam_candidates for row, _ in beams)
        values, ids = torch.log_softmax(logits[index].float(), dim=-1).topk(width, dim=-1)
        for (row, _), row_ids, row_values in zip(beams, ids.tolist(), values.tolist()):
            k = batch.state_at(row).beam_candidates
            output.beam_candidates[batch.seq_ids[row]] = (row_ids[:k], row_values[:k])

    def _sample_plain(self, scheduler_output: SchedulerOutput, plain: list[tuple[int, int]],
                      part: list[tuple[int, int]], logits: torch.Tensor, sampled: SampledIds,
                      greedy_ids: torch.Tensor | None = None) -> None:
        """One token for each (row, logits index) of `part` (all of `plain`, or one entry of it), into `sampled`."""
        grammar = self._grammar_rows(scheduler_output, part)
        rows = [row for row, _ in part]
        indices = [i for _, i in part]
        meta = self.sampling_metadata(rows, grammar)
        identity = len(indices) == logits.shape[0] and indices == list(range(len(indices)))
        index = None if identity else self._to_device(np.asarray(indices, dtype=np.int64))
        if greedy_ids is not None and plain_greedy(meta):   # the decode graph's own argmax is the draw
            sampled.add(plain.index(part[0]), SampledTensors(greedy_ids if identity else greedy_ids[index]))
            return
        sampled.add(plain.index(part[0]), self.sampler.sample(logits if identity else logits[index], meta))

    def _grammar_rows(self, scheduler_output: SchedulerOutput, plain: list[tuple[int, int]]):
        """The grammar bitmask rows of the plain sampling rows, in their order: (positions in `plain`, bitmask)."""
        if scheduler_output.grammar_bitmask is None:
            return None
        seq_ids, bitmask = scheduler_output.grammar_bitmask
        where = {seq_id: j for j, seq_id in enumerate(seq_ids)}
        batch = self.input_batch
        positions = [k for k, (row, _) in enumerate(plain) if batch.seq_ids[row] in where]
        if not positions:
            return None
        return positions, bitmask[[where[batch.seq_ids[plain[k][0]]] for k in positions]]

    def sampling_metadata(self, rows: list[int], grammar=None) -> SamplingMetadata:
        """The sampling state of batch rows `rows` (repeats allowed), from the persistent arrays; only the rows
        flagged `special` (own generator, logit bias, allowed or banned tokens, logprobs, penalties) are looked
        at one by one."""
        batch = self.input_batch
        index = np.asarray(rows, dtype=np.int64)
        temperature = batch.temperature[index]
        greedy = temperature == 0.0
        meta = SamplingMetadata(temperature=self._zero_temperatures(len(rows)) if greedy.all()
                                else self._to_device(temperature), greedy=greedy.tolist())
        top_k, top_p, min_p = batch.top_k[index], batch.top_p[index], batch.min_p[index]
        if top_k.any():
            meta.top_k = top_k.tolist()
        if (top_p < 1.0).any():
            meta.top_p = top_p.tolist()
        if (min_p > 0.0).any():
            meta.min_p = self._to_device(min_p)
        special = np.flatnonzero(batch.special[index])
        if len(special) == 0:
            return self._with_grammar(meta, grammar)
        generators, bias, allowed, banned, num_logprobs, penalized = {}, {}, {}, {}, [None] * len(rows), []
        for j in special.tolist():
            state = batch.state_at(rows[j])
            p = state.params
            if state.generator is not None:
                generators[j] = state.generator
            if state.logit_bias_tensors is not None:
                bias[j] = state.logit_bias_tensors
            if state.allowed_tensor is not None:
                allowed[j] = state.allowed_tensor
            if state.bad_words_token_ids or (p.min_tokens and state.num_output_tokens < p.min_tokens):
                ids = banned_token_ids(state.output_token_ids, p.min_tokens, state.stop_token_ids,
                                       state.bad_words_token_ids)
                if ids:
                    banned[j] = ids
            num_logprobs[j] = p.logprobs
            if state.uses_penalties:
                penalized.append(j)
        meta.generators, meta.logit_bias = generators or None, bias or None
        meta.allowed_token_ids, meta.banned_token_ids = allowed or None, banned or None
        if any(k is not None for k in num_logprobs):
            meta.num_logprobs = num_logprobs
        if penalized:
            meta.penalties = self._penalties(penalized, index[penalized])
        return self._with_grammar(meta, grammar)

    @staticmethod
    def _with_grammar(meta: SamplingMetadata, grammar) -> SamplingMetadata:
        if grammar is not None:
            meta.grammar_bitmask = grammar
        return meta

    def _penalties(self, positions: list[int], rows: np.ndarray) -> Penalties:
        """The penalties of batch rows `rows` (at `positions` of the logits), from their tokens in the batch."""
        batch = self.input_batch
        num_tokens, num_prompt = batch.num_tokens[rows], batch.num_prompt_tokens[rows]
        width = int(num_tokens.max())
        seen = batch.token_ids[rows, :width].astype(np.int64)
        seen = np.where(np.arange(width)[None, :] < num_tokens[:, None], seen, seen[:, :1])   # pad: a token it has
        out_width = max(1, int((num_tokens - num_prompt).max()))
        columns = num_prompt[:, None] + np.arange(out_width)[None, :]
        real = columns < num_tokens[:, None]
        outputs = np.where(real, batch.token_ids[rows[:, None], np.minimum(columns, batch.max_len - 1)], 0)
        states = [batch.state_at(row) for row in rows.tolist()]
        unique = [list(state.unique_output_ids) for state in states]
        unique_width = max(1, max(len(u) for u in unique))
        unique_ids = np.array([u + [u[0] if u else 0] * (unique_width - len(u)) for u in unique], dtype=np.int64)
        to = self._to_device
        return Penalties(rows=to(np.asarray(positions, dtype=np.int64)),
                         repetition=to(batch.repetition_penalty[rows]), frequency=to(batch.frequency_penalty[rows]),
                         presence=to(batch.presence_penalty[rows]), seen_ids=to(seen),
                         output_ids=to(outputs.astype(np.int64)), output_weight=to(real.astype(np.float32)),
                         unique_output_ids=to(unique_ids),
                         unique_weight=to(np.array([[1.0 if u else 0.0] for u in unique], dtype=np.float32)))

    def _sample_speculative(self, entries: list[tuple[int, int]], logits: torch.Tensor, num_drafts: np.ndarray,
                            output: ModelRunnerOutput) -> None:
        """Rejection sampling (engine/worker/rejection_sampler.py) of the sequences that verify drafts: their
        k + 1 logits rows processed as the sampler processes one row (bias, masks, temperature, top-k/p...),
        the drafts accepted against them. Their requests have no position-dependent stage (penalties,
        bad words, min_tokens ahead, a grammar): the core proposes for no other."""
        batch = self.input_batch
        ks = [int(num_drafts[row]) for row, _ in entries]
        max_k = max(ks)
        rows = [row for row, _ in entries for _ in range(max_k + 1)]
        index = np.array([min(first + j, first + k) for (_, first), k in zip(entries, ks) for j in range(max_k + 1)],
                         dtype=np.int64)
        drafts = np.full((len(entries), max_k), -1, dtype=np.int64)
        for j, ((row, _), k) in enumerate(zip(entries, ks)):
            start = batch.num_tokens[row]
            drafts[j, :k] = batch.token_ids[row, start:start + k]
        index_t, drafts_t, ks_t = self.staging.to_device_many(index, drafts, np.array(ks, dtype=np.int64))
        row_logits = logits[index_t].float()
        num_logprobs = [batch.state_at(row).params.logprobs for row, _ in entries]
        want_logprobs = any(k is not None for k in num_logprobs)
        raw_logprobs = torch.log_softmax(row_logits, dim=-1) if want_logprobs else None
        meta = self.sampling_metadata(rows)
        if all(meta.greedy):   # the target's picks drawn as a plain step draws them; the drafts checked against them
            if self.drafter is not None:
                self.drafter.forget([batch.seq_ids[row] for row, _ in entries])
            picks = self.sampler.draw(row_logits, meta).view(len(entries), max_k + 1)
            result = rejection_sample_greedy(drafts_t, ks_t, picks)
        else:
            result = self._rejection_sample(entries, row_logits, meta, drafts_t, ks_t, ks)
        packed = None
        if want_logprobs:   # every row's logprobs of the token at its position, packed into the step's one read
            packed = pack_logprobs(raw_logprobs, result.output_token_ids.reshape(-1).clamp(min=0),
                                   [k for k in num_logprobs for _ in range(max_k + 1)])
        read, packed_rows = self._read_speculative(result, packed)
        for j, (row, _) in enumerate(entries):
            seq_id = batch.seq_ids[row]
            accepted = read[j][-1]
            emitted = read[j][:accepted + 1]
            output.sampled_token_ids[seq_id] = emitted
            output.num_accepted_tokens[seq_id] = accepted
            k = num_logprobs[j]
            if k is not None:
                sampled = unpack_logprobs(packed_rows[j][:len(emitted)], [k] * len(emitted))
                output.logprobs[seq_id] = SampleLogprobs(sampled.sampled_logprobs, sampled.sampled_ranks,
                                                         sampled.topk_token_ids, sampled.topk_logprobs)

    def _rejection_sample(self, entries: list[tuple[int, int]], row_logits: torch.Tensor, meta,
                          drafts: torch.Tensor, num_drafts: torch.Tensor, ks: list[int]):
        """Speculative sampling of a verification batch with random requests (rejection_sample): the target's
        probabilities of the k + 1 rows of each, its drafts (``drafts`` [n, max_k], ``num_drafts`` [n] on the
        device; ``ks`` the counts on the host) accepted against them."""
        batch = self.input_batch
        max_k = drafts.shape[1]
        if self.sampler.sync_free:   # on CUDA: nothing read back but the result, once (below)
            probs = self.sampler.target_probs(row_logits.clone(), meta)
        else:
            processed, row_max, argmax, _ = process_logits(row_logits.clone(), meta)
            random = [i for i, greedy in enumerate(meta.greedy) if not greedy]
            probs = processed
            if random:
                probs = processed.clone()
                random_t = torch.tensor(random, device=row_logits.device)
                probs[random_t] = random_probs(processed[random_t], row_max[random_t], meta, random)
        vocab = probs.shape[-1]
        generators = [batch.state_at(row).generator for row, _ in entries]
        draft_probs = None if self.drafter is None else \
            self.drafter.draft_probs_for([batch.seq_ids[row] for row, _ in entries], max_k, vocab)
        return rejection_sample(drafts, num_drafts, probs.view(len(entries), max_k + 1, vocab), draft_probs,
                                self._to_device(np.array(meta.greedy[::max_k + 1], dtype=np.bool_)),
                                generators=generators, default_generator=self.sampler.generator,
                                num_draft_tokens_host=ks)

    @staticmethod
    def _read_speculative(result, packed: torch.Tensor | None = None
                          ) -> tuple[list[list[int]], list[list[list[float]]] | None]:
        """A speculative step's one read from the device: per request, its output row (drafts then the sampled
        token, -1 after) and, last, how many drafts it accepted. The next schedule needs them now (speculative
        steps run without async scheduling). ``packed``: pack_logprobs' rows of every request's k + 1 positions
        (float64 [num_reqs * (k + 1), width]), read in the same transfer and returned per request (else None)."""
        ids = torch.cat([result.output_token_ids, result.num_accepted.unsqueeze(1)], dim=1)
        if packed is None:
            return ids.tolist(), None
        num_reqs, positions = result.output_token_ids.shape
        width = packed.shape[1]
        both = torch.cat([ids.double(), packed.view(num_reqs, positions * width)], dim=1).tolist()
        ids_width = positions + 1   # (ids are exact in float64)
        return ([[int(v) for v in row[:ids_width]] for row in both],
                [[row[ids_width + p * width:ids_width + (p + 1) * width] for p in range(positions)] for row in both])

    def _propose(self, output: ModelRunnerOutput, scheduler_output: SchedulerOutput) -> None:
        """Drafts for each sequence's next step, from its tokens and what it emitted now: n-gram lookups, or the
        draft model. Not for a sequence forking this step (its last block is shared with its forks)."""
        batch = self.input_batch
        forking = set(scheduler_output.sample_from) | set(scheduler_output.sample_from.values())
        eligible = [(seq_id, emitted) for seq_id, emitted in output.sampled_token_ids.items()
                    if seq_id not in forking and speculation_allowed(batch.states[seq_id], len(emitted))]
        if self.drafter is not None:
            output.spec_token_ids.update(self.drafter.propose(eligible))
            return
        spec = self.engine_config.speculative_config
        for seq_id, emitted in eligible:
            row = batch.row_of[seq_id]
            tokens = np.concatenate([batch.token_ids[row, :batch.num_tokens[row]], np.asarray(emitted, dtype=np.int32)])
            drafts = propose_ngram(tokens, num_speculative_tokens=spec.num_speculative_tokens,
                                   prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
            if drafts:
                output.spec_token_ids[seq_id] = drafts

    # -- entries (tests, the profile step) ------------------------------------------------------------------

    @torch.inference_mode()
    def compute_logits_for(self, scheduled: list[tuple[object, int]], *, all_logits_for: list[int] | None = None):
        """Run ``seq.token_ids[seq.num_computed_tokens : + num_new_tokens]`` for each (seq, num_new_tokens) entry
        (objects with token_ids, num_computed_tokens, block_table), writing their K/V into the slots of their
        block tables, outside the persistent batch. Returns float32 logits ``[len(scheduled), vocab_size]`` of
        each entry's last new token; with ``all_logits_for`` (indices into ``scheduled``) also the logits at every
        new token of those entries: ``(logits, [float32 [num_new_tokens, vocab_size], ...])``."""
        if not scheduled:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        input_ids, positions, query_lens, tables = [], [], [], []
        for seq, num_new_tokens in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new_tokens
            if num_new_tokens < 1 or end > len(seq.token_ids) or end > len(seq.block_table) * self.block_size:
                raise ValueError(f"cannot run tokens [{start}, {end}) of a sequence with {len(seq.token_ids)} "
                                 f"tokens and {len(seq.block_table)} blocks of {self.block_size}")
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            query_lens.append(num_new_tokens)
            tables.append(seq.block_table)
        width = max(1, -(-max(p + 1 for p in positions) // self.block_size))
        block_tables = np.zeros((len(scheduled), width), dtype=np.int32)
        for i, table in enumerate(tables):
            block_tables[i, :min(width, len(table))] = table[:width]
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        input_ids_t, positions_t, meta = self.build_inputs(np.asarray(input_ids, dtype=np.int64),
                                                           np.asarray(positions, dtype=np.int64), query_lens_np,
                                                           block_tables, graph=True)
        forward = self._forward_hidden(input_ids_t, positions_t, meta, len(scheduled), query_lens=query_lens_np)
        logits = self._logits(forward, np.cumsum(query_lens_np) - 1)
        if not all_logits_for:
            return logits
        starts = np.concatenate([[0], np.cumsum(query_lens_np)])
        extra = [self._logits(forward, slice(int(starts[i]), int(starts[i + 1]))) for i in all_logits_for]
        return logits, extra

    def uncompiled_step(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step runs the model itself even where the forward is compiled: the few-row layers', and a
        step of one token of a model whose layers are linears and pagedkernels calls only
        (``one_token_uncompiled``): nothing for the compiler to fuse, and a compile of its own (dynamo specializes
        a dimension of 1) at a CUDA engine's start-up."""
        return meta.skinny or (num_tokens == 1 and getattr(self.model, "one_token_uncompiled", False))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *,
                 final_norm: bool = True) -> torch.Tensor:
        """The model's forward (compiled where it is); without ``final_norm`` the stream before the final norm (a
        step graph whose LM head folds it in: skinny_head). The few-row layers (``meta.skinny``) run uncompiled:
        they are pagedkernels calls and nothing else, so the compiler has nothing to fuse in them, and compiling
        the whole model once more for them (dynamo specializes a one-row step) was a third of the forward's compiles
        at a CUDA engine's start-up; captured in a graph, the same kernels replay."""
        kwargs = {} if final_norm else {"final_norm": False}
        if self.forward is self.model or self.uncompiled_step(meta, input_ids.shape[0]):
            return self.model(input_ids, positions, meta, **kwargs)
        try:
            with forward_context(self.attention_layers, meta.is_decode), compile_shapes():
                return self.forward(input_ids, positions, meta, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not take the engine down
            if not _is_compile_error(exc):
                raise
            logger.warning("torch.compile of the model failed; running eagerly from now on (%s: %s)",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.forward, self.compiled = self.model, False
            return self.model(input_ids, positions, meta, **kwargs)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not mapping:
            return
        # Through the pinned staging: a copy from pageable memory would wait for the device's queued work.
        block_mapping = self._to_device(np.asarray(mapping, dtype=np.int64).reshape(-1, 2))
        pk.copy_blocks(self.key_caches, self.value_caches, block_mapping)
        if self.drafter is not None:   # the draft model's cache mirrors the blocks of the model's
            pk.copy_blocks(self.drafter.key_caches, self.drafter.value_caches, block_mapping)

    def release(self) -> None:
        """Drop all the runner holds (the model, its KV cache, the drafter, LoRA slots, step graphs, compiled
        tails, staging buffers) for an engine that is shut down, so its device memory returns to the allocator even
        while something outside still holds the engine (a closure, a traceback, a benchmark's argument tuple). The
        compiled tails and graphs close over the runner itself, so only emptying it breaks those cycles. The runner
        runs no more steps after it; its block count stays readable."""
        if getattr(self, "released", False):
            return
        kept = {"num_kv_blocks": self.num_kv_blocks, "device": self.device, "released": True}
        self.__dict__.clear()
        self.__dict__.update(kept)


def _no_dimension_of_one(seq_lens: np.ndarray, block_tables: np.ndarray, cu_seqlens_q: np.ndarray,
                         is_decode: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A compiled forward's per-sequence inputs with no dimension of 1: dynamo specializes a size of 1 (its 0/1
    specialization), so the first single-sequence prefill after start-up compiled the whole model again (a user's
    first request waited tens of seconds on a GPU), and one whose block table was one column wide once more. A batch
    of one sequence (not a pure decode, whose kernels take a token a sequence) gets a padding sequence with no new
    token and nothing cached (seq_len 0: it computes and reads nothing); a one-column table a second column, never
    read (each sequence's seq_len bounds its columns)."""
    pad_rows = 1 if len(seq_lens) == 1 and not is_decode else 0
    pad_cols = 1 if block_tables.shape[1] == 1 else 0
    if pad_rows:
        seq_lens = np.append(seq_lens, np.int32(0))
        cu_seqlens_q = np.append(cu_seqlens_q, cu_seqlens_q[-1])
    if pad_rows or pad_cols:
        block_tables = np.pad(block_tables, ((0, pad_rows), (0, pad_cols)))
    return seq_lens, block_tables, cu_seqlens_q


def _is_compile_error(exc: BaseException) -> bool:
    """Whether an exception comes from dynamo/inductor (not from the model's own checks)."""
    return type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))
