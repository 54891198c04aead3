"""ModelRunner: owns the model and the KV cache, flattens a scheduled batch and runs one forward pass.

A batch is a list of ``(sequence, num_new_tokens)``: prefill chunks and single-token decodes mixed.
The runner packs all new tokens back to back (input ids, positions, cache slots) with per-sequence
``cu_seqlens_q`` / ``seq_lens`` / block tables, runs the model (whose attention layers call
pagedkernels), and computes logits only for the last new token of each sequence.

Pure-decode batches on CUDA replay CUDA graphs: a batch is padded up the ``graph_batch_sizes``
ladder (1, 2, 4, 8, then steps of 16 up to ``max_num_seqs``), copied into static input buffers,
and the graph captured for that size (on first use) replays on them. Padded rows write no K/V
(slot -1) and attend to nothing (seq_len 0); their outputs are dropped. Batches above the ladder,
mixed batches, CPU and ``enforce_eager`` run eagerly. The capture/replay mechanics sit behind a
small graph-runner interface, so a CPU double (:class:`EagerGraphRunner`) exercises the padding,
buffer reuse and replay logic in tests.

The forward runs under ``torch.compile`` (inductor, dynamic token count, fullgraph) by default on CUDA
unless ``enforce_eager``, eagerly on CPU, where the engine's own oneDNN linears and native kernels beat
inductor's code (SmolLM2 fp32, 48 requests, 2-core EPYC: 8.8 s eager, 16.4 s compiled once warm);
``compile_model=`` or ``ENGINE_COMPILE=1/0`` overrides either. pagedkernels' ops are registered custom
ops and each attention layer is one (``engine::unified_attention``), so the graph holds them as opaque
nodes; the decode graphs capture the compiled forward. A compilation that fails is logged and the
runner goes on eagerly.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable
from typing import TYPE_CHECKING

import torch

import pagedkernels as pk
from engine.config import ModelConfig
from engine.distributed.communication import min_over_ranks
from engine.distributed.parallel_state import get_tp_world_size, num_kv_heads_per_rank
from engine.layers.attention import Attention, AttentionMetadata, forward_context
from engine.layers.linear import prepack_linears
from engine.worker.loader import load_dummy_weights, load_model
from engine.worker import memory as gpu_memory
from engine.worker.memory import MemorySnapshot, check_free_memory, kv_cache_budget
from engine.worker.sampler import sampler_dummy_run
from engine.platform import DevicePolicy
from engine.models import get_model_class

if TYPE_CHECKING:
    from engine.core.sequence import Sequence

logger = logging.getLogger(__name__)



class CUDAGraphRunner:
    """One decode forward captured as a CUDA graph: ``capture(fn)`` runs ``fn`` once (warm-up:
    Triton compiles, allocator settles), then records it; ``replay()`` reruns the recorded kernels on
    whatever the static buffers hold and returns the same output tensor each time."""

    def __init__(self, pool=None):
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    @staticmethod
    def new_pool(device: torch.device):
        """A memory pool the graphs of one runner share (the smaller ones reuse the largest's memory)."""
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        fn()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = fn()
        torch.cuda.synchronize()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class EagerGraphRunner:
    """CPU stand-in for :class:`CUDAGraphRunner` with the same contract: ``capture`` records the
    callable and its output buffer; ``replay`` calls it again on the static buffers and writes the
    result into that same buffer."""

    def __init__(self, pool=None):
        self.fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None
        self.num_replays = 0

    @staticmethod
    def new_pool(device: torch.device):
        return None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn().clone()

    def replay(self) -> torch.Tensor:
        self.num_replays += 1
        return self.output.copy_(self.fn())


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 16 up to
    ``max_num_seqs``."""
    return [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))


@dataclass(slots=True)
class _ProfileEntry:
    """A scheduled entry of the profile step: all its tokens new, in its own blocks."""
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0


class ModelRunner:
    def __init__(self, model_config: ModelConfig, *, device: torch.device, block_size: int,
                 num_kv_blocks: int | None, gpu_memory_utilization: float, max_num_seqs: int,
                 max_num_batched_tokens: int, enforce_eager: bool, seed: int,
                 graph_runner_class: type | None = None, compile_model: bool | None = None,
                 capture_graphs_at_startup: bool | None = None, memory=None, load_format: str = "auto"):
        self.config = model_config
        self.load_format = load_format  # "auto": the checkpoint's weights; "dummy": random ones (worker/loader.py)
        self.device = torch.device(device)
        self.dtype = model_config.dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = DevicePolicy.for_device(self.device)
        # CUDA graphs on CUDA; elsewhere only when a graph-runner class is given (tests' CPU double).
        if graph_runner_class is None and self.policy.cuda_graphs:
            graph_runner_class = CUDAGraphRunner
        self.graph_runner_class = graph_runner_class
        self.enforce_eager = enforce_eager or graph_runner_class is None
        self.max_blocks_per_seq = math.ceil(model_config.max_model_len / block_size)
        # KV heads of this rank's cache (all of them without tensor parallelism).
        self.num_kv_heads = num_kv_heads_per_rank(model_config.num_key_value_heads)
        torch.manual_seed(seed)

        if compile_model is None:
            env = os.environ.get("ENGINE_COMPILE", "").strip()
            # as in vLLM, enforce_eager means no torch.compile either
            compile_model = (env not in ("0", "false", "False") if env
                             else self.policy.compile_by_default and not enforce_eager)
        self.compiled = bool(compile_model)
        # The KV cache's budget on a GPU is measured (engine/worker/memory.py): counters from before the weights.
        # `memory`: the counters to use instead of the device's (a test double; it turns profiling on anywhere).
        self.memory = None
        if num_kv_blocks is None and (self.policy.profile_gpu_memory or memory is not None):
            self.memory = gpu_memory.device_memory(self.device) if memory is None else memory
            self._memory_at_start = MemorySnapshot.take(self.memory)
            check_free_memory(self._memory_at_start, gpu_memory_utilization)
            self.memory.reset_peak_memory_stats()
        self.model = self._build_model()
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
        self.num_kv_blocks = self._decide_num_kv_blocks(num_kv_blocks, gpu_memory_utilization)
        self._allocate_kv_cache()
        # Decode batch sizes a CUDA graph is captured for (a batch pads up to the next one).
        self.graph_batch_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, object] = {}  # padded batch size -> captured graph runner
        if not self.enforce_eager:
            self._allocate_static_buffers()
            # On CUDA every graph of the ladder is captured now (largest first, so the smaller ones reuse its
            # memory pool), as vLLM does: the first decode steps then do not pay for compilation and capture,
            # and the memory the graphs take is known before serving. The CPU double captures on first use
            # unless asked.
            if capture_graphs_at_startup is None:
                capture_graphs_at_startup = graph_runner_class is CUDAGraphRunner
            if capture_graphs_at_startup:
                self.capture_all_graphs()

    # -- setup ------------------------------------------------------------------------------------

    def _build_model(self) -> torch.nn.Module:
        model_class = get_model_class(self.config.architecture)
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(self.config)
        finally:
            torch.set_default_dtype(previous_dtype)
        (load_dummy_weights if self.load_format == "dummy" else load_model)(model, self.config.model_dir)
        # Built under `torch.device(self.device)`: a parameter or buffer elsewhere is a tensor made on an explicit
        # other device (a CPU-only assumption), which would fail in the first forward.
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.device != self.device and not (self.device.index is None
                                                      and tensor.device.type == self.device.type):
                raise RuntimeError(f"{type(model).__name__}.{name} is on {tensor.device}, not on {self.device}")
        model.eval()
        if self.policy.prepack_linears and not self.compiled:
            # float32 CPU linears run oneDNN's inner product; reorder their weights into its layout once
            # instead of on every call (engine/layers/linear.py). A no-op for other dtypes. Not under
            # torch.compile: inductor cannot trace oneDNN's opaque weight tensors and brings its own GEMMs.
            prepack_linears(model)
        return model

    def _block_bytes(self) -> int:
        c = self.config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * self.num_kv_heads * c.head_dim * element_size

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
        entries, next_block = [], 0
        for length in lens:
            num_blocks = -(-length // self.block_size)
            entries.append((_ProfileEntry([0] * length, list(range(next_block, next_block + num_blocks))), length))
            next_block += num_blocks
        self._bind_kv_cache(torch.empty(2, self.config.num_hidden_layers, next_block, self.block_size,
                                        self.num_kv_heads, self.config.head_dim, dtype=self.dtype, device=self.device))
        input_ids, positions, meta, last_token_indices = self.prepare_inputs(entries)
        hidden_states = self._forward(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden_states.index_select(0, last_token_indices))
        prompt_logprobs = torch.log_softmax(self.model.compute_logits(hidden_states), dim=-1)
        sampler_dummy_run(logits)
        del hidden_states, logits, prompt_logprobs
        self._bind_kv_cache(None)

    def _allocate_kv_cache(self) -> None:
        c = self.config
        # One allocation for all layers: [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_cache = torch.empty(2, c.num_hidden_layers, self.num_kv_blocks, self.block_size,
                                    self.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
        self._bind_kv_cache(self.kv_cache)
        self.key_caches = list(self.kv_cache[0])
        self.value_caches = list(self.kv_cache[1])

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
            for layer in layers:
                layer.decode_workspace = self.decode_workspace

    def _allocate_static_buffers(self) -> None:
        """Inputs of the captured decode graphs, sized for the largest padded batch; a graph for
        batch size b reads the first b rows."""
        size = self.graph_batch_sizes[-1]
        device = self.device
        self.static_input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.static_positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.static_slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.static_seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.static_block_tables = torch.zeros(size, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.static_cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graph_pool = self.graph_runner_class.new_pool(device)

    # -- per step ---------------------------------------------------------------------------------

    def prepare_inputs(self, scheduled: list[tuple["Sequence", int]]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten a batch: (input_ids int64 [num_tokens], positions int64 [num_tokens], metadata,
        last_token_indices int64 [num_seqs]) on the runner's device."""
        input_ids: list[int] = []
        starts, query_lens, tables = [], [], []
        for seq, num_new_tokens in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new_tokens
            if num_new_tokens < 1 or end > len(seq.token_ids) or end > len(seq.block_table) * self.block_size:
                raise ValueError(f"cannot run tokens [{start}, {end}) of a sequence with {len(seq.token_ids)} "
                                 f"tokens and {len(seq.block_table)} blocks of {self.block_size}")
            input_ids += seq.token_ids[start:start + num_new_tokens]
            starts.append(start)
            query_lens.append(num_new_tokens)
            tables.append(seq.block_table)
        num_seqs = len(scheduled)
        # Sizes from the Python lists, not read back from tensors (no value read anywhere: a fake device has none).
        num_tokens = len(input_ids)
        # Only the table columns this batch can touch; the rest of each row is padding, never read.
        width = max(1, -(-max(s + q for s, q in zip(starts, query_lens)) // self.block_size))
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(starts, dtype=torch.int64) + query_lens_t
        cu_seqlens_q = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=cu_seqlens_q[1:])
        block_tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.int32)
        # positions: token i of sequence s sits at starts[s] + (i - cu_seqlens_q[s]).
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t, output_size=num_tokens)
        positions = torch.arange(num_tokens) + (seq_lens_t - query_lens_t - cu_seqlens_q[:-1])[seq_index]
        block_ids = block_tables[seq_index, positions // self.block_size].long()
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        to_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            block_tables=to_device(block_tables),
            seq_lens=to_device(seq_lens_t.to(torch.int32)),
            cu_seqlens_q=to_device(cu_seqlens_q.to(torch.int32)),
            is_decode=num_tokens == num_seqs,
        )
        return (to_device(torch.tensor(input_ids, dtype=torch.int64)), to_device(positions), meta,
                to_device(cu_seqlens_q[1:] - 1))

    @torch.inference_mode()
    def execute_model(self, scheduled: list[tuple["Sequence", int]], *,
                      all_logits_for: list[int] | None = None):
        """Run ``seq.token_ids[seq.num_computed_tokens : + num_new_tokens]`` for each scheduled entry,
        writing their K/V into the slots of ``seq.block_table``. Returns float32 logits
        ``[len(scheduled), vocab_size]`` of each entry's last new token. Does not advance
        ``seq.num_computed_tokens``.

        With ``all_logits_for`` (indices into ``scheduled``; prompt logprobs), returns ``(logits, extra)``
        where ``extra[j]`` is float32 ``[num_new_tokens, vocab_size]``: the logits at every new token of
        entry ``all_logits_for[j]``. Under tensor parallelism every rank runs the forward and only rank 0, which
        samples, gets logits: the others get None (and a list of None for ``extra``)."""
        if not scheduled:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        input_ids, positions, meta, last_token_indices = self.prepare_inputs(scheduled)
        if meta.is_decode and not self.enforce_eager and len(scheduled) <= self.graph_batch_sizes[-1]:
            hidden_states = self.run_decode_graph(input_ids, positions, meta)
        else:
            hidden_states = self._forward(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden_states.index_select(0, last_token_indices))
        if not all_logits_for:
            return logits
        starts = [0]
        for _, num_new_tokens in scheduled:
            starts.append(starts[-1] + num_new_tokens)
        extra = [self.model.compute_logits(hidden_states[starts[i]:starts[i + 1]]) for i in all_logits_for]
        return logits, extra

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.forward is self.model:
            return self.model(input_ids, positions, meta)
        try:
            with forward_context(self.attention_layers):
                return self.forward(input_ids, positions, meta)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not take the engine down
            if not _is_compile_error(exc):
                raise
            logger.warning("torch.compile of the model failed; running eagerly from now on (%s: %s)",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.forward, self.compiled = self.model, False
            return self.model(input_ids, positions, meta)

    def run_decode_graph(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """A pure-decode batch of n sequences through the graph of the smallest ladder size b >= n:
        inputs copied into the static buffers' first n rows, rows n..b padding (input id 0 at
        position 0, slot -1: no K/V written, seq_len 0: no key read). Returns the final hidden
        states ``[n, hidden_size]`` (a view of the graph's output buffer, valid until the next replay)."""
        num_seqs = input_ids.shape[0]
        batch_size = next(size for size in self.graph_batch_sizes if size >= num_seqs)
        self.static_input_ids[:num_seqs].copy_(input_ids)
        self.static_input_ids[num_seqs:batch_size].zero_()
        self.static_positions[:num_seqs].copy_(positions)
        self.static_positions[num_seqs:batch_size].zero_()
        self.static_slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.static_slot_mapping[num_seqs:batch_size].fill_(-1)
        self.static_seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.static_seq_lens[num_seqs:batch_size].zero_()
        # Columns past a sequence's last block keep stale ids: never read (its seq_len bounds them).
        self.static_block_tables[:num_seqs, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        runner = self.graphs.get(batch_size)
        if runner is None:
            runner = self.graphs[batch_size] = self._capture_decode_graph(batch_size)
        return runner.replay()[:num_seqs]

    def capture_all_graphs(self) -> None:
        """Capture the decode graph of every ladder size not captured yet, largest first. The static buffers hold
        padding rows (slot -1, seq_len 0) while capturing: nothing is written to or read from the KV cache."""
        start = time.perf_counter()
        with torch.inference_mode():
            for batch_size in reversed(self.graph_batch_sizes):
                if batch_size not in self.graphs:
                    self.graphs[batch_size] = self._capture_decode_graph(batch_size)
        logger.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(self.graph_batch_sizes),
                    self.graph_batch_sizes, time.perf_counter() - start)

    def _capture_decode_graph(self, batch_size: int):
        meta = AttentionMetadata(slot_mapping=self.static_slot_mapping[:batch_size],
                                 block_tables=self.static_block_tables[:batch_size],
                                 seq_lens=self.static_seq_lens[:batch_size],
                                 cu_seqlens_q=self.static_cu_seqlens_q[:batch_size + 1], is_decode=True)
        input_ids, positions = self.static_input_ids[:batch_size], self.static_positions[:batch_size]
        runner = self.graph_runner_class(self.graph_pool)
        runner.capture(lambda: self._forward(input_ids, positions, meta))
        return runner

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not mapping:
            return
        block_mapping = torch.tensor(mapping, dtype=torch.int64, device=self.device)
        pk.copy_blocks(self.key_caches, self.value_caches, block_mapping)


def _is_compile_error(exc: BaseException) -> bool:
    """Whether an exception comes from dynamo/inductor (not from the model's own checks)."""
    return type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))
