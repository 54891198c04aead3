"""Decode graphs: a pure-decode step captured once per padded batch size and replayed (CUDA graphs on GPUs, CPU
graphs of the native kernels on CPUs), as the runner's `DecodeGraphs` half (engine/worker/model_runner.py is the
other: what a step shares on every device).

Pure-decode batches on CUDA replay CUDA graphs: a batch is padded up the ``graph_batch_sizes`` ladder (1, 2, 4, 8,
then steps of 16 up to ``max_num_seqs``), its inputs copied from pinned host memory straight into the static inputs of
the graph captured for that size (one region per size: one copy a step, padding included), and the graph replays on
them. Padded rows write no K/V (slot -1) and attend to nothing (seq_len 0); their outputs are dropped. On
one rank (not in CPU graphs) a graph runs the whole step to the sampler: the forward, the LM head over its rows and
their greedy argmax (``ModelRunner.step_graphs``). On CPU the steps replay CPU graphs of the native kernels
(``pagedkernels.cpu_graph``) on a ladder of their own (``cpu_graph_batch_sizes``), each captured by the first step
that needs it; the kernels of a CPU graph process just the batch's rows, not the padding (only the few torch
operations between them do). Batches above the ladder, mixed batches and ``enforce_eager`` run eagerly.

The capture/replay mechanics sit behind a small graph-runner interface, so a CPU double (:class:`EagerGraphRunner`)
exercises the padding, buffer reuse and replay logic in tests. With LoRA, graphs are keyed by (batch size, LoRA
active): ``graphs`` without adapters, ``lora_graphs`` with them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch.fx.experimental import _config as fx_config

from engine.layers.attention import AttentionMetadata
from engine.layers.quantization.unquantized import recording_decode_graph
from engine.worker.input_batch import INPUT_PAD_BYTES
from pagedkernels.cpu_graph import CPUGraph, GraphCaptureError

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    """One decode step captured as a CUDA graph: ``capture(fn)`` runs ``fn`` once (warm-up:
    Triton compiles, allocator settles), then records it; ``replay()`` reruns the recorded kernels on
    whatever the static buffers hold and returns the same output tensor(s) each time."""

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
        output = fn()
        self.output = tuple(t.clone() for t in output) if isinstance(output, tuple) else output.clone()

    def replay(self) -> torch.Tensor:
        self.num_replays += 1
        output = self.fn()
        if isinstance(output, tuple):
            return tuple(buffer.copy_(t) for buffer, t in zip(self.output, output))
        return self.output.copy_(output)


class StaticInputs(NamedTuple):
    """A decode graph's inputs: ``[b]`` each, ``block_tables [b, max_blocks_per_seq]``."""
    input_ids: torch.Tensor      # int64
    positions: torch.Tensor      # int64
    slot_mapping: torch.Tensor   # int64
    seq_lens: torch.Tensor       # int32
    block_tables: torch.Tensor   # int32


def padding_static_inputs(batch_size: int, max_blocks_per_seq: int, device: torch.device) -> StaticInputs:
    """A graph's inputs for ``batch_size`` rows, every row padding: id 0 at position 0, slot -1 (no K/V written),
    seq_len 0 (no key read), a table of ``max_blocks_per_seq`` zero columns."""
    return StaticInputs(torch.zeros(batch_size, dtype=torch.int64, device=device),
                        torch.zeros(batch_size, dtype=torch.int64, device=device),
                        torch.full((batch_size,), -1, dtype=torch.int64, device=device),
                        torch.zeros(batch_size, dtype=torch.int32, device=device),
                        torch.zeros(batch_size, max_blocks_per_seq, dtype=torch.int32, device=device))


# StaticInputs' dtypes, in their order in a region
_STATIC_DTYPES = (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32)


def static_region_layout(batch_size: int, max_blocks_per_seq: int) -> tuple[list[int], int]:
    """Byte offsets of StaticInputs' fields in one device buffer for a graph of ``batch_size`` rows (each field
    64-byte aligned, the first INPUT_PAD_BYTES in), and the buffer's size."""
    offsets, at = [], INPUT_PAD_BYTES
    for k, dtype in enumerate(_STATIC_DTYPES):
        offsets.append(at)
        at += -(-dtype.itemsize * batch_size * (max_blocks_per_seq if k == 4 else 1) // 64) * 64
    return offsets, at


def _region_views(region: torch.Tensor, batch_size: int, max_blocks_per_seq: int) -> StaticInputs:
    offsets, _ = static_region_layout(batch_size, max_blocks_per_seq)
    views = []
    for k, (dtype, offset) in enumerate(zip(_STATIC_DTYPES, offsets)):
        shape = (batch_size, max_blocks_per_seq) if k == 4 else (batch_size,)
        views.append(region[offset:offset + dtype.itemsize * int(np.prod(shape))].view(dtype).view(shape))
    return StaticInputs(*views)


def compile_shapes():
    """The symbolic shapes a compilation of the model (or a step's tail) traces under: no duck sizing. With it dynamo
    gives sizes that happen to be equal at the first capture one symbol and guards on the equality, so the next graph
    of the ladder compiled the model again: the decode graphs' inputs are views into one buffer per size, and at the
    largest size a field's storage offset equalled the batch size (any two sizes equal there would do the same).
    About 11 us a call of the compiled forward, which only eager steps and captures make (a decode graph's replay
    does not call it)."""
    return fx_config.patch(use_duck_shape=False)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 16 up to
    ``max_num_seqs``."""
    return [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))


def cpu_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes CPU graphs are recorded for: 1, 2, 4, 8, then 1.5x and 4/3x steps (16, 24, 32, 48, 64,
    96, 128, ...), and ``max_num_seqs``. A CPU graph replays a smaller batch over just its rows (see
    :meth:`pagedkernels.cpu_graph.CPUGraph.capture`), so a step pays only the torch operations' padding rows
    (an embedding lookup; oneDNN's linears past the 16-bit kernel's 64 rows), at most half the batch more."""
    ladder = [1, 2, 4, 8] + [base << shift for shift in range(max_num_seqs.bit_length()) for base in (16, 24)]
    return sorted({size for size in ladder if size < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """The decode-graph half of :class:`engine.worker.model_runner.ModelRunner` (a mixin: its state is the runner's
    graph_runner_class, graph_batch_sizes, graphs / lora_graphs, static buffers, step_graphs and _forward)."""

    def _allocate_static_buffers(self, per_size_regions: bool | None = None) -> None:
        """Inputs of the captured decode graphs (static_inputs). On CPU one set sized for the largest padded batch:
        a graph for batch size b reads its first b rows, and a step copies its inputs there (memcpy). On CUDA each
        graph size has its own region, one device buffer laid out as static_region_layout, which the step's inputs
        fill in a single host -> device copy (build_inputs: no device-to-device copies, no padding fills).
        ``per_size_regions``: the CUDA layout on any device (tests; default: on CUDA only)."""
        size = self.graph_batch_sizes[-1]
        device = self.device
        self._static_inputs: dict[int, StaticInputs] = {}
        self._static_regions: dict[int, torch.Tensor] = {}
        self._shared_static: StaticInputs | None = None
        self._staged_decode_inputs: torch.Tensor | None = None   # build_inputs' staging, for run_decode_graph
        # Inference tensors, as every input a step builds under inference_mode: a compiled forward guards on its
        # inputs' dispatch keys, and one normal tensor among them (cu_seqlens_q) made the decode graphs' inputs
        # fail the guards of the mixed batches' compile (the memory profile's), and the model compile again.
        with torch.inference_mode():
            if not (device.type == "cuda" if per_size_regions is None else per_size_regions):
                self._shared_static = padding_static_inputs(size, self.max_blocks_per_seq, device)
                pad = 0   # the CPU's steps take their inputs as arrays' own tensors, at offset 0
            else:
                pad = INPUT_PAD_BYTES // 4   # as the CUDA steps' staged inputs (static_region_layout)
            self.static_cu_seqlens_q = torch.arange(-pad, size + 1, dtype=torch.int32, device=device)[pad:]
        self._verify_static: dict[tuple[int, int], tuple[StaticInputs, torch.Tensor, torch.Tensor]] = {}
        self.graph_pool = None   # capture_pool() makes it with the first graph

    def static_inputs(self, batch_size: int) -> StaticInputs:
        """The inputs the decode graph of ``batch_size`` rows reads (padding rows: id 0 at position 0, slot -1,
        seq_len 0), allocated on first use (never inside a capture: the capture asks for them first)."""
        static = self._static_inputs.get(batch_size)
        if static is None:
            if self._shared_static is not None:
                static = StaticInputs(*(t[:batch_size] for t in self._shared_static))
            else:
                _, nbytes = static_region_layout(batch_size, self.max_blocks_per_seq)
                with torch.inference_mode():   # as the steps' own inputs (_allocate_static_buffers)
                    region = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                self._static_regions[batch_size] = region
                static = _region_views(region, batch_size, self.max_blocks_per_seq)
                static.slot_mapping.fill_(-1)
            self._static_inputs[batch_size] = static
        return static

    def decode_graph_size(self, num_tokens: int, num_seqs: int) -> int | None:
        """The padded batch size whose decode graph a step of ``num_seqs`` sequences and ``num_tokens`` tokens
        replays, or None (not a pure decode, eager, or above the ladder)."""
        if num_tokens != num_seqs or num_seqs == 0 or self.enforce_eager or num_seqs > self.graph_batch_sizes[-1]:
            return None
        return next(size for size in self.graph_batch_sizes if size >= num_seqs)

    def stage_decode_inputs(self, batch_size: int, input_ids: np.ndarray, positions: np.ndarray,
                            slot_mapping: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray
                            ) -> StaticInputs:
        """A pure-decode step's inputs straight into the CUDA region of its graph (``batch_size`` rows), padding rows
        included, in one host -> device copy out of the pinned staging; returns the region's inputs."""
        static = self.static_inputs(batch_size)
        n = len(input_ids)
        pad = batch_size - n
        offsets, _ = static_region_layout(batch_size, self.max_blocks_per_seq)
        m = self.max_blocks_per_seq
        ids, pos, slots, lens, tables = _STATIC_DTYPES
        self.staging.to_device_region(self._static_regions[batch_size], [
            (offsets[0], ids, (batch_size,), np.pad(input_ids, (0, pad))),
            (offsets[1], pos, (batch_size,), np.pad(positions, (0, pad))),
            (offsets[2], slots, (batch_size,), np.pad(slot_mapping, (0, pad), constant_values=-1)),
            (offsets[3], lens, (batch_size,), np.pad(seq_lens, (0, pad))),
            (offsets[4], tables, (batch_size, m), block_tables)])
        return static

    def run_decode_graph(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata, lora_slots: np.ndarray | None = None) -> torch.Tensor:
        """A pure-decode batch of n sequences through the graph of the smallest ladder size b >= n:
        inputs copied into the static buffers' first n rows, rows n..b padding (input id 0 at
        position 0, slot -1: no K/V written, seq_len 0: no key read). Returns the final hidden
        states ``[n, hidden_size]``, or with ``step_graphs`` (logits ``[n, vocab]``, greedy ids ``[n]``): views
        of the graph's output buffers, valid until the next replay. lora_slots: int32 [n], each row's LoRA slot
        (-1 or None: none): a step with adapters replays the LoRA variant of the graph (``lora_graphs``)."""
        num_seqs = input_ids.shape[0]
        batch_size = next(size for size in self.graph_batch_sizes if size >= num_seqs)
        static = self.static_inputs(batch_size)
        staged, self._staged_decode_inputs = self._staged_decode_inputs, None
        if staged is not input_ids:   # not staged in the graph's inputs by build_inputs (the CPU's steps)
            self._copy_into_static(static, input_ids, positions, meta)
        lora_active = self._prepare_lora(lora_slots, batch_size)
        graphs = self.lora_graphs if lora_active else self.graphs
        runner = graphs.get(batch_size)
        if runner is None:
            try:
                runner, output = self._capture_decode_graph(batch_size, lora_active)
                graphs[batch_size] = runner
                every_size = list(range(1, self.graph_batch_sizes[-1] + 1))
                if isinstance(runner, CPUGraph) and not runner.resizable and self.graph_batch_sizes != every_size:
                    logger.info("this model's CPU graphs cannot replay fewer rows than they recorded: one graph "
                                "per decode batch size from now on")
                    self.graph_batch_sizes = every_size
                if output is not None:   # a CPU graph's recording run was this step's forward
                    return _rows(output, num_seqs)
            except GraphCaptureError as error:
                # This model's decode step cannot be a CPU graph (it computes outside the native kernels in a
                # way a replay cannot follow): decode eagerly from now on, as enforce_eager would.
                logger.warning("decode graphs are off for this model: %s", error)
                self.enforce_eager = True
                self._prepare_lora(lora_slots, num_seqs)
                return self._forward(input_ids, positions, meta)
        if isinstance(runner, CPUGraph):
            return _rows(runner.replay(num_seqs), num_seqs)
        return _rows(runner.replay(), num_seqs)

    def verify_graph_shape(self, num_tokens: int, num_seqs: int, query_lens: np.ndarray | None
                           ) -> tuple[int, int] | None:
        """(padded batch size, tokens a sequence) of the verification graph a step replays: speculative decoding's
        graphs on (``spec_graphs``), every sequence computing the same 2 to 1 + k tokens (``query_lens``), within the
        ladder; else None (the compiled forward runs eagerly)."""
        if (not self.spec_graphs or self.enforce_eager or query_lens is None or num_seqs == 0
                or num_seqs > self.graph_batch_sizes[-1]):
            return None
        q = int(query_lens[0])
        if not 2 <= q <= 1 + self.num_spec_tokens or num_tokens != num_seqs * q or not (query_lens == q).all():
            return None
        return next(size for size in self.graph_batch_sizes if size >= num_seqs), q

    def _verify_inputs(self, batch_size: int, q: int) -> tuple[StaticInputs, torch.Tensor, torch.Tensor]:
        """A verification graph's inputs (``batch_size * q`` tokens; tables and lengths ``batch_size`` rows), its
        cu_seqlens and its padding rows' positions, allocated on first use. Padding sequences (run_verify_graph):
        ids 0 at positions 0..q-1, slots -1 (nothing written), seq_len q (the prefill op's smallest valid length)
        over the first sequence's blocks; their outputs are dropped."""
        key = (batch_size, q)
        cached = self._verify_static.get(key)
        if cached is None:
            tokens, device = batch_size * q, self.device
            static = StaticInputs(torch.zeros(tokens, dtype=torch.int64, device=device),
                                  torch.arange(q, device=device).repeat(batch_size),
                                  torch.full((tokens,), -1, dtype=torch.int64, device=device),
                                  torch.full((batch_size,), q, dtype=torch.int32, device=device),
                                  torch.zeros(batch_size, self.max_blocks_per_seq, dtype=torch.int32, device=device))
            cu_seqlens = torch.arange(0, tokens + 1, q, dtype=torch.int32, device=device)
            cached = self._verify_static[key] = (static, cu_seqlens, static.positions.clone())
        return cached

    def run_verify_graph(self, shape: tuple[int, int], input_ids: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """A verification batch of n sequences of q tokens each through the graph of (b, q), b the smallest ladder
        size >= n: the inputs copied into its static buffers' first n sequences, the rest padding. With a draft model
        the graph runs its forward over the same tokens too (its KV cache written as the step would write it after the
        graph: DraftModel.run_target_step), not a second, eager forward of its ~10 launches a layer. Returns the final
        hidden states ``[n * q, hidden_size]``, a view of the graph's output valid until its next replay."""
        batch_size, q = shape
        tokens = input_ids.shape[0]
        num_seqs = tokens // q   # (meta may hold a padding sequence past them: ModelRunner._no_dimension_of_one)
        static, cu_seqlens, pad_positions = self._verify_inputs(batch_size, q)
        static.input_ids[:tokens].copy_(input_ids)
        static.positions[:tokens].copy_(positions)
        static.slot_mapping[:tokens].copy_(meta.slot_mapping)
        static.seq_lens[:num_seqs].copy_(meta.seq_lens[:num_seqs])
        width = min(meta.block_tables.shape[1], static.block_tables.shape[1])   # (a padding column past them too)
        # Columns past a sequence's last block keep stale ids: never read (its seq_len bounds them).
        static.block_tables[:num_seqs, :width].copy_(meta.block_tables[:num_seqs, :width])
        if num_seqs < batch_size:   # padding, over what a larger batch of this graph may have left
            static.input_ids[tokens:].zero_()
            static.positions[tokens:].copy_(pad_positions[tokens:])
            static.slot_mapping[tokens:].fill_(-1)
            static.seq_lens[num_seqs:].fill_(q)
            # The padding sequences attend over the first sequence's first q positions: written, finite values (an
            # uninitialized block could hold NaN, which a per-tensor activation scale would spread to real rows).
            first_table = meta.block_tables[:1, :width]
            static.block_tables[num_seqs:, :width].copy_(first_table.expand(batch_size - num_seqs, -1))
        runner = self.verify_graphs.get(shape)
        if runner is None:
            graph_meta = AttentionMetadata(slot_mapping=static.slot_mapping, block_tables=static.block_tables,
                                           seq_lens=static.seq_lens, cu_seqlens_q=cu_seqlens, is_decode=False,
                                           skinny=batch_size * q <= self.skinny_max_rows)
            drafter = self.drafter

            def step() -> torch.Tensor:
                hidden_states = self._forward(static.input_ids, static.positions, graph_meta)
                if drafter is not None:   # the draft model's KV of the same tokens, in the same graph
                    drafter.run_target_step(static.input_ids, static.positions, graph_meta)
                return hidden_states

            runner = self.graph_runner_class(self.capture_pool())
            with torch.inference_mode():
                runner.capture(step)
            self.verify_graphs[shape] = runner
        return runner.replay()[:tokens]

    def set_spec_decode_graphs(self, on: bool) -> bool:
        """Replay verification steps in graphs (``on``), and a draft model's proposal steps, or run them eagerly, on a
        built runner with speculative decoding and graphs that are not CPU graphs; the graphs are dropped when it turns
        off. Returns the setting in force. What bench.spec_decode_cpu compares on the GPU; an engine's own setting is
        DevicePolicy.spec_decode_graphs."""
        self.spec_graphs = (bool(on) and self.num_spec_tokens > 0 and not self.enforce_eager
                            and self.graph_runner_class is not CPUGraph)
        if not self.spec_graphs:
            self.verify_graphs.clear()
        if getattr(self, "drafter", None) is not None:   # a draft model's proposal steps follow (draft_model.py)
            self.drafter.set_graphs(self.spec_graphs)
        return self.spec_graphs

    def set_skinny_max_rows(self, rows: int) -> int:
        """Turn the decoder layers' few-row path (``meta.skinny``, pagedkernels.skinny_gemm) on for steps of up to
        ``rows`` tokens, or off with 0, on a built runner: the model's layers are checked as at start-up, and the
        decode graphs whose sizes change sides are dropped, to be captured again by the next step that needs them.
        Returns the limit in force (0 where the model cannot take the path). What bench.engine_gpu's batch-1 part
        compares on one engine; an engine's own setting is DevicePolicy.skinny_gemm_max_rows."""
        from pagedkernels.skinny_gemm import MAX_ROWS

        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be an int from 0 to {MAX_ROWS}, got {rows!r}")
        before, head_before = self.skinny_max_rows, self.skinny_head
        self.skinny_max_rows = self._skinny_rows(rows)
        self.skinny_head = self._skinny_head(self._skinny_head_wanted)   # the folded LM head needs few-row graphs
        for graphs in (self.graphs, getattr(self, "lora_graphs", {})):
            for size in [s for s in graphs if (s <= before) != (s <= self.skinny_max_rows)
                         or (self.skinny_head != head_before and s <= max(before, self.skinny_max_rows))]:
                del graphs[size]
        self.verify_graphs.clear()
        return self.skinny_max_rows

    def set_decode_fused_reduce(self, on: bool) -> bool:
        """Merge the decode op's split-K partials in its split kernel (``on``: every attention layer takes the
        runner's split counters) or in a reduce kernel after it, on a built runner; the decode graphs are dropped
        when it changes, to be captured again by the next step that needs them. Returns the setting in force (False
        where the runner has no counters: not CUDA). What bench.engine_gpu's batch-1 part compares on one engine; an
        engine's own setting is DevicePolicy.decode_fused_reduce."""
        counters = getattr(self, "decode_split_counters", None)
        on = bool(on) and counters is not None
        layers = getattr(self, "attention_layers", [])
        if any((layer.decode_split_counters is not None) != on for layer in layers):
            for layer in layers:
                layer.decode_split_counters = counters if on else None
            self.drop_graphs()
        return on

    def set_decode_fused_rope(self, on: bool) -> bool:
        """Rotate q/k, write the new K/V and attend in the decode split kernel (``on``) or in two kernels
        (rotary_embedding_and_cache, paged_decode_attention) on a built runner's decode steps that rotate in the cache
        write (the few-row layers'); the decode graphs are dropped when it changes. Returns the setting in force (False
        where no layer runs the decode kernel: an eager CPU runner). What bench.engine_gpu's batch-1 part compares on
        one engine; an engine's own setting is DevicePolicy.decode_fused_rope."""
        layers = [layer for layer in getattr(self, "attention_layers", []) if layer.use_decode_kernel]
        on = bool(on) and bool(layers)
        if any(layer.decode_fused_rope != on for layer in layers):
            for layer in layers:
                layer.decode_fused_rope = on
            self.drop_graphs()
        return on

    def _greedy_tail(self, hidden_states: torch.Tensor, *, uncompiled: bool = False,
                     fold_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A step graph's tail: the LM head over its rows, then their greedy ids (logits_and_greedy). Compiled where
        the forward is, so the product's cast to float32, the NaN / inf clean-up and the argmax are one kernel after
        the product instead of three; a compiler failure falls back to the eager tail, as the forward does. The steps
        whose forward runs uncompiled (``uncompiled``: ModelRunner.uncompiled_step) run it so too: a compile of its
        own for their one-row steps would cost start-up time to save two launches. With ``fold_norm`` (the few-row
        layers' steps, so uncompiled too), ``hidden_states`` is the stream before the final norm and the head's
        few-row product norms it (the model's skinny_logits)."""
        if fold_norm:
            return logits_and_greedy(self.model.skinny_logits(hidden_states))
        eager = lambda h: logits_and_greedy(self.model.compute_logits(h))  # noqa: E731
        if uncompiled or not self.compiled or getattr(self, "_tail_compile_failed", False):
            return eager(hidden_states)
        if getattr(self, "_compiled_tail", None) is None:
            self._compiled_tail = torch.compile(eager, dynamic=True, fullgraph=True)
        try:
            with compile_shapes():
                return self._compiled_tail(hidden_states)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not take the engine down
            from engine.worker.model_runner import _is_compile_error   # the forward's test (a module above this one)

            if not _is_compile_error(exc):
                raise
            logger.warning("torch.compile of the LM head and greedy ids failed; running them eagerly (%s: %s)",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self._tail_compile_failed = True
            return eager(hidden_states)

    @staticmethod
    def _copy_into_static(static: StaticInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata) -> None:
        """A step's inputs into a graph's (its first rows), the rest padding."""
        num_seqs = input_ids.shape[0]
        static.input_ids[:num_seqs].copy_(input_ids)
        static.input_ids[num_seqs:].zero_()
        static.positions[:num_seqs].copy_(positions)
        static.positions[num_seqs:].zero_()
        static.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        static.slot_mapping[num_seqs:].fill_(-1)
        static.seq_lens[:num_seqs].copy_(meta.seq_lens)
        static.seq_lens[num_seqs:].zero_()
        # Columns past a sequence's last block keep stale ids: never read (its seq_len bounds them).
        static.block_tables[:num_seqs, :meta.block_tables.shape[1]].copy_(meta.block_tables)

    def capture_pool(self):
        """The memory pool a new graph captures into: the runner's, or a new one when none of its graphs is held any
        more. Torch keeps a pool whose graphs are all gone for as long as a tensor allocated in it lives (a step's
        output not read yet, a buffer a layer made during a capture) and refuses a capture into it
        (CUDACachingAllocator's use_count assert): on the H200, drop_graphs() left a MoE engine none, and every
        step after it failed."""
        drafter = getattr(self, "drafter", None)
        held = (self.graphs, getattr(self, "lora_graphs", None), getattr(self, "verify_graphs", None),
                drafter is not None and drafter.graphs)
        if self.graph_pool is None or not any(held):
            self.graph_pool = self.graph_runner_class.new_pool(self.device)
        return self.graph_pool

    def drop_graphs(self) -> None:
        """Drop every captured decode graph; the next step of each size captures its graph again. For a change to
        how the kernels launch that a graph keeps from its capture (pagedkernels.set_programmatic_dependent_launch:
        bench.engine_gpu's batch-1 part compares both on one engine)."""
        for graphs in (self.graphs, getattr(self, "lora_graphs", {}), getattr(self, "verify_graphs", {})):
            graphs.clear()
        if getattr(self, "drafter", None) is not None:
            self.drafter.graphs.clear()

    def set_skinny_lm_head(self, on: bool) -> bool:
        """Fold the final norm into the LM head's few-row product in the step graphs of the few-row layers (``on``)
        or run the norm and the head's product apart, on a built runner; the graphs of those sizes are dropped when it
        changes. Returns the setting in force (False where the runner has no step graphs of few-row layers or the model
        cannot fold: can_fold_final_norm). What bench.engine_gpu's batch-1 part compares on one engine; an engine's
        own setting is DevicePolicy.skinny_lm_head."""
        self._skinny_head_wanted = bool(on)
        before, self.skinny_head = self.skinny_head, self._skinny_head(on)
        if self.skinny_head != before:
            for graphs in (self.graphs, getattr(self, "lora_graphs", {})):
                for size in [s for s in graphs if s <= self.skinny_max_rows]:
                    del graphs[size]
        return self.skinny_head

    def _skinny_head(self, on: bool) -> bool:
        """``on`` if step graphs run the few-row layers and the model can fold its final norm into its LM head."""
        fold = getattr(self.model, "can_fold_final_norm", None)
        return bool(on) and self.step_graphs and self.skinny_max_rows > 0 and fold is not None and fold()

    def _skinny_rows(self, rows: int) -> int:
        """``rows`` if the model's layers can take the few-row path (they are marked so), else 0."""
        prepare = getattr(self.model, "prepare_skinny", None)
        return rows if rows and self.lora is None and prepare is not None and prepare() else 0

    def capture_all_graphs(self) -> None:
        """Capture the decode graph of every ladder size not captured yet, largest first. The static buffers hold
        padding rows (slot -1, seq_len 0) while capturing: nothing is written to or read from the KV cache."""
        start = time.perf_counter()
        variants = (False, True) if self.lora is not None else (False,)
        with torch.inference_mode():
            for lora_active in variants:   # with LoRA, each size's LoRA variant too
                graphs = self.lora_graphs if lora_active else self.graphs
                for batch_size in reversed(self.graph_batch_sizes):
                    if batch_size not in graphs:
                        if self.lora is not None:   # padding rows: the kernels run (or not) on no adapter
                            self.lora.prepare_batch(None, batch_size, active=lora_active)
                        graphs[batch_size] = self._capture_decode_graph(batch_size, lora_active)[0]
        logger.info("captured %d decode graphs (batch sizes %s%s) in %.1f s",
                    len(self.graph_batch_sizes) * len(variants), self.graph_batch_sizes,
                    ", with and without LoRA" if len(variants) > 1 else "", time.perf_counter() - start)

    def _capture_decode_graph(self, batch_size: int, lora_active: bool = False) -> tuple[object, torch.Tensor | None]:
        """The graph runner of `batch_size` (its LoRA variant with `lora_active`: the LoRA batch is prepared so),
        captured on the static buffers, and the output of its capture's forward on them when that is this step's
        result (a CPU graph's), else None."""
        static = self.static_inputs(batch_size)
        meta = AttentionMetadata(slot_mapping=static.slot_mapping, block_tables=static.block_tables,
                                 seq_lens=static.seq_lens, cu_seqlens_q=self.static_cu_seqlens_q[:batch_size + 1],
                                 is_decode=True, skinny=batch_size <= self.skinny_max_rows)
        input_ids, positions = static.input_ids, static.positions
        runner = self.graph_runner_class(self.capture_pool())
        forward = lambda: self._forward(input_ids, positions, meta)  # noqa: E731
        if self.step_graphs and meta.skinny and self.skinny_head:   # the final norm inside the LM head's product
            forward = lambda: self._greedy_tail(  # noqa: E731
                self._forward(input_ids, positions, meta, final_norm=False), fold_norm=True)
        elif self.step_graphs:
            forward = lambda: self._greedy_tail(  # noqa: E731
                self._forward(input_ids, positions, meta), uncompiled=self.uncompiled_step(meta, batch_size))
        if isinstance(runner, CPUGraph):
            # The first CPU graph warms up and checks its replay against the recorded run; the others record
            # the same forward at another size, and their recording run serves the step that needed them.
            first = not (self.lora_graphs if lora_active else self.graphs)
            with recording_decode_graph():   # its bf16 products' panel path: BF16_W16_GRAPH_MAX_ROWS
                return runner, runner.capture(forward, warm_up=first, check=first, rows=batch_size)
        runner.capture(forward)
        return runner, None


def _rows(output, num_rows: int):
    """The first `num_rows` rows of a graph's output (a tensor, or a tuple of them)."""
    if isinstance(output, tuple):
        return tuple(t[:num_rows] for t in output)
    return output[:num_rows]


def logits_and_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, their greedy ids), NaN counted as -inf and +inf as the largest float, as the sampler counts them."""
    return logits, logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max).argmax(dim=-1)
