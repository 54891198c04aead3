"""A draft model for speculative decoding: a small model with the target's tokenizer proposes k tokens per step.

It lives on rank 0 only, unsharded (proposing is the driver's job; the other ranks never see it). Its KV cache is
its own (its layers and heads), paged with the TARGET's block tables: block b of the draft cache
holds the draft's KV of the same tokens as block b of the target's. Every step the draft runs on exactly the
tokens the target runs (`run_target_step`: prompt chunks, decodes, the drafts being verified), so both caches
hold the KV of the same positions; copy-on-write copies go to both (ModelRunner.copy_blocks), and so do swaps
(CacheEngine).

Proposing (`propose`), after the target's step: a sequence now has L tokens, the last one (just sampled) without
KV anywhere. The draft feeds it at position L - 1, takes its next token, feeds that, ... k times, one decode batch
per token. Those k positions lie past the sequence's allocated blocks (and its last block may be shared with
forks), so they are written to scratch blocks: the block holding position L - 1 is first copied into a private
scratch block of the draft cache, and the proposal steps use a table of the sequence's blocks before it followed
by its scratch blocks. The next step's verification rewrites those positions in the real blocks anyway.

Drafts are drawn from the draft's distribution processed like the target's (temperature, top-k/top-p, min-p,
logit bias, allowed tokens), greedy rows take the argmax; a seeded request draws from its own generator. The
distributions q are kept per sequence for the rejection sampler (engine/worker/rejection_sampler.py).

Everything a proposal's k steps take but their input ids (positions, slots, lengths, tables) is known on the host
before the first: it goes to the device in one copy, each step's ids are the last step's draws, on the device, and
the k drafts come back to the host in one read at the end (not one a step). With the runner's speculative graphs
(``ModelRunner.spec_graphs``: DevicePolicy.spec_decode_graphs, ``set_spec_decode_graphs``) each step replays the
draft's graph of its padded batch size (the runner's ladder), captured on first use: the draft's forward, its LM
head and the greedy argmax, over static inputs whose padding rows write nothing (slot -1) and read nothing
(seq_len 0); an all-greedy batch with nothing acting on its logits takes the graph's argmax as its draws, any other
is sampled after the replay from the graph's logits.
"""
from __future__ import annotations

import numpy as np
import torch

import pagedkernels as pk
from engine.config import SpeculativeConfig
from engine.distributed.parallel_state import planned_layout
from engine.layers.attention import Attention, AttentionMetadata
from engine.worker.decode_graphs import StaticInputs, logits_and_greedy, padding_static_inputs
from engine.worker.sampler import plain_greedy


class DraftModel:
    def __init__(self, runner, spec: SpeculativeConfig):
        self.runner = runner
        self.k = spec.num_speculative_tokens
        self.config = spec.draft_model_config
        # Whole on rank 0, whatever the tensor parallelism of the target: proposing is rank 0's alone, and an
        # unsharded draft runs no collective the other ranks would have to join.
        with planned_layout(1, 0):
            self.model = runner._build_model(self.config)
        runner._report_kv_scales(self.model, self.config.model_dir)
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = self.config.num_key_value_heads
        block_size = runner.block_size
        # Scratch blocks per proposing sequence: the copied block holding L - 1, and those k more positions reach.
        self.scratch_per_seq = 1 + -(-self.k // block_size)
        self.draft_probs: dict[int, torch.Tensor] = {}   # seq_id -> float32 [k_i, vocab] q of its pending drafts
        # Proposal steps in graphs (set_graphs): padded batch size -> captured graph runner, and its static inputs.
        self.graphs: dict[int, object] = {}
        self._graph_inputs: dict[int, tuple[StaticInputs, torch.Tensor]] = {}
        # A graph's table columns: a sequence at max_model_len with its drafts (the target's), and the scratch.
        self.graph_width = runner.max_blocks_per_seq + self.scratch_per_seq

    def block_bytes(self) -> int:
        c = self.config
        element_size = torch.empty((), dtype=self.runner.kv_cache_dtype).element_size()
        return 2 * c.num_hidden_layers * self.runner.block_size * self.num_kv_heads * c.head_dim * element_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft cache: the target's `num_blocks` block ids, then the scratch blocks of max_num_seqs sequences."""
        c, runner = self.config, self.runner
        self.scratch_base = num_blocks
        total = num_blocks + runner.max_num_seqs * self.scratch_per_seq
        self.kv_cache = torch.empty(2, c.num_hidden_layers, total, runner.block_size, self.num_kv_heads, c.head_dim,
                                    dtype=runner.kv_cache_dtype, device=runner.device)
        runner.commit_kv_cache(self.kv_cache, "draft model's KV cache")
        self.key_caches, self.value_caches = list(self.kv_cache[0]), list(self.kv_cache[1])
        workspace = None
        if runner.device.type == "cuda" and self.layers:
            # The decode op's split-K scratch, shared by the layers as the model's is: no launch allocates (a graph
            # capture included). Sized for the widest table a proposal step gives it.
            first = self.layers[0]
            workspace = pk.decode_workspace(runner.max_num_seqs, first.num_heads, first.num_kv_heads, first.head_dim,
                                            device=runner.device, max_context=self.graph_width * runner.block_size)
        for i, layer in enumerate(self.layers):
            layer.layer_index = i
            layer.decode_workspace = workspace
            layer.key_cache, layer.value_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.set_graphs(False)   # until the runner decides (ModelRunner.spec_graphs)

    def set_graphs(self, on: bool) -> None:
        """Proposal steps in graphs (``on``: the runner's ``spec_graphs``) or eager; the graphs are dropped when
        off. A graph's padding rows are valid decode rows, not prefill ones: the layers take the decode op with
        graphs (as the model's do wherever its decode graphs run), else where the device policy has it in eager."""
        self.graphs_on = bool(on)
        if not self.graphs_on:
            self.graphs.clear()
        decode_kernel = self.graphs_on or self.runner.policy.decode_kernel_in_eager()
        for layer in self.layers:
            layer.use_decode_kernel = decode_kernel

    def forget(self, seq_ids: list[int]) -> None:
        """Drop the q of these sequences' pending drafts (finished, or verified without them: every one greedy)."""
        for seq_id in seq_ids:
            self.draft_probs.pop(seq_id, None)

    @torch.inference_mode()
    def run_target_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """The draft's KV of the tokens the target computes this step, in the same slots."""
        self.model(input_ids, positions, meta)

    def draft_probs_for(self, seq_ids: list[int], max_k: int, vocab_size: int) -> torch.Tensor:
        """q of the drafts being verified, [len(seq_ids), max_k, vocab] (rows past a sequence's drafts: zeros)."""
        probs = torch.zeros(len(seq_ids), max_k, vocab_size, dtype=torch.float32, device=self.runner.device)
        for j, seq_id in enumerate(seq_ids):
            q = self.draft_probs.pop(seq_id, None)
            if q is not None:
                rows = min(q.shape[0], max_k)
                probs[j, :rows] = q[:rows, :vocab_size]
        return probs

    @torch.inference_mode()
    def propose(self, eligible: list[tuple[int, list[int]]]) -> dict[int, list[int]]:
        """k drafts for each (seq_id, tokens it emitted this step) in `eligible` (see the module docstring)."""
        if not eligible:
            return {}
        runner = self.runner
        batch = runner.input_batch
        block_size, device, k = runner.block_size, runner.device, self.k
        num_seqs = len(eligible)
        rows = [batch.row_of[seq_id] for seq_id, _ in eligible]
        lengths = np.array([batch.num_tokens[row] + len(emitted) for row, (_, emitted) in zip(rows, eligible)])
        firsts = (lengths - 1) // block_size
        width = int(firsts.max()) + self.scratch_per_seq
        tables = np.zeros((num_seqs, width), dtype=np.int32)
        copies = []
        for j, (row, (seq_id, _)) in enumerate(zip(rows, eligible)):
            blocks = batch.states[seq_id].block_ids
            first = int(firsts[j])
            scratch = self.scratch_base + j * self.scratch_per_seq
            tables[j, :first] = blocks[:first]
            tables[j, first:first + self.scratch_per_seq] = np.arange(scratch, scratch + self.scratch_per_seq)
            if first < len(blocks):   # the tokens of the block holding L - 1, before it
                copies.append((blocks[first], scratch))
        meta = runner.sampling_metadata(rows)
        random_rows = [j for j, greedy in enumerate(meta.greedy) if not greedy]
        # Every step's inputs but its ids, [k, num_seqs] each (step i feeds position L - 1 + i), the first step's ids,
        # the block copies and the random rows: one copy to the device.
        positions = lengths[None, :] - 1 + np.arange(k)[:, None]
        slots = (tables[np.arange(num_seqs)[None, :], positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        ids, positions_t, slots_t, seq_lens_t, tables_t, cu_seqlens_t, copies_t, random_index = \
            runner.staging.to_device_many(
                np.array([emitted[-1] for _, emitted in eligible], dtype=np.int64), positions, slots,
                (positions + 1).astype(np.int32), tables, np.arange(num_seqs + 1, dtype=np.int32),
                np.array(copies, dtype=np.int64).reshape(-1, 2), np.array(random_rows, dtype=np.int64))
        if copies:
            pk.copy_blocks(self.key_caches, self.value_caches, copies_t)
        graph_size = self._graph_size(num_seqs)
        greedy_draws = plain_greedy(meta)   # the graph's argmax is the draw
        drafts = torch.empty(num_seqs, k, dtype=torch.int64, device=device)
        probs = torch.zeros(num_seqs, k, self.config.vocab_size, device=device) if random_rows else None
        for i in range(k):
            if graph_size is not None:
                logits, greedy = self._replay(graph_size, ids, positions_t[i], slots_t[i], seq_lens_t[i], tables_t,
                                              first_step=i == 0)
            else:
                attention = AttentionMetadata(slot_mapping=slots_t[i], block_tables=tables_t, seq_lens=seq_lens_t[i],
                                              cu_seqlens_q=cu_seqlens_t, is_decode=True)
                logits, greedy = self.model.compute_logits(self.model(ids, positions_t[i], attention)).float(), None
            if greedy is not None and greedy_draws:
                ids = greedy
            else:
                ids, q = runner.sampler.draw_with_probs(logits, meta, random_rows, random_index)
                if q is not None:
                    probs[random_index, i] = q
            drafts[:, i] = ids
        drafts_host = self._read(drafts)
        result = {}
        for j, (seq_id, _) in enumerate(eligible):
            result[seq_id] = drafts_host[j].tolist()
            if probs is not None:
                self.draft_probs[seq_id] = probs[j]
        return result

    @staticmethod
    def _read(drafts: torch.Tensor) -> np.ndarray:
        """The proposal's one read from the device: its drafts [num_seqs, k]."""
        return drafts.cpu().numpy()

    def _graph_size(self, num_seqs: int) -> int | None:
        """The padded batch size whose graph a proposal step of ``num_seqs`` sequences replays, or None (graphs off,
        or the batch above the runner's ladder). (A proposal's table is never wider than ``graph_width``: its
        sequences are at most max_model_len + k tokens long.)"""
        sizes = self.runner.graph_batch_sizes
        if not self.graphs_on or num_seqs > sizes[-1]:
            return None
        return next(size for size in sizes if size >= num_seqs)

    def _replay(self, size: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                seq_lens: torch.Tensor, tables: torch.Tensor, *, first_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One proposal step of n sequences through the graph of ``size`` >= n rows, captured on first use: the
        step's inputs into the graph's first n rows (the tables and the padding rows on a proposal's first step only:
        they hold for its k steps), then the replay. Returns (logits float32 [n, vocab], greedy ids [n]), views of the
        graph's outputs valid until its next replay."""
        runner = self.runner
        n = ids.shape[0]
        cached = self._graph_inputs.get(size)
        if cached is None:
            cached = self._graph_inputs[size] = (padding_static_inputs(size, self.graph_width, runner.device),
                                                 torch.arange(size + 1, dtype=torch.int32, device=runner.device))
        static, cu_seqlens = cached
        if first_step:   # the tables too, and the padding over what a larger proposal may have left
            runner._copy_into_static(static, ids, positions, AttentionMetadata(
                slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens, is_decode=True))
        else:
            static.input_ids[:n].copy_(ids)
            static.positions[:n].copy_(positions)
            static.slot_mapping[:n].copy_(slots)
            static.seq_lens[:n].copy_(seq_lens)
        graph = self.graphs.get(size)
        if graph is None:
            meta = AttentionMetadata(slot_mapping=static.slot_mapping, block_tables=static.block_tables,
                                     seq_lens=static.seq_lens, cu_seqlens_q=cu_seqlens, is_decode=True)
            model = self.model
            graph = runner.graph_runner_class(runner.capture_pool())
            graph.capture(lambda: logits_and_greedy(
                model.compute_logits(model(static.input_ids, static.positions, meta)).float()))
            self.graphs[size] = graph
        logits, greedy = graph.replay()
        return logits[:n], greedy[:n]
