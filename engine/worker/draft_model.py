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
"""
from __future__ import annotations

import numpy as np
import torch

import pagedkernels as pk
from engine.config import SpeculativeConfig
from engine.distributed.parallel_state import planned_layout
from engine.layers.attention import Attention
from engine.worker.sampler import process_logits, random_probs


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
        decode_kernel = runner.policy.decode_kernel_in_eager()
        for i, layer in enumerate(self.layers):
            layer.layer_index = i
            layer.use_decode_kernel = decode_kernel
            layer.key_cache, layer.value_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def forget(self, seq_ids: list[int]) -> None:
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
        block_size, device = runner.block_size, runner.device
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
        if copies:
            pk.copy_blocks(self.key_caches, self.value_caches, torch.tensor(copies, dtype=torch.int64, device=device))
        meta = runner.sampling_metadata(rows)
        random_rows = [j for j, greedy in enumerate(meta.greedy) if not greedy]
        tokens = np.array([emitted[-1] for _, emitted in eligible], dtype=np.int64)
        drafts = np.zeros((num_seqs, self.k), dtype=np.int64)
        probs = torch.zeros(num_seqs, self.k, self.config.vocab_size, device=device) if random_rows else None
        ones = np.ones(num_seqs, dtype=np.int64)
        for i in range(self.k):
            positions = lengths - 1 + i
            input_ids, positions_t, attention = runner.build_inputs(tokens, positions, ones, tables)
            logits = self.model.compute_logits(self.model(input_ids, positions_t, attention)).float()
            logits, row_max, argmax, _ = process_logits(logits, meta)
            if random_rows:
                index = torch.tensor(random_rows, device=device)
                q = random_probs(logits[index], row_max[index], meta, random_rows)
                probs[index, i] = q
                uniform = runner.sampler.uniform(len(random_rows), device, meta, random_rows)
                from engine.worker.sampler import sample_inverse_cdf
                argmax[index] = sample_inverse_cdf(q.clone(), uniform)
            tokens = argmax.cpu().numpy()
            drafts[:, i] = tokens
        result = {}
        for j, (seq_id, _) in enumerate(eligible):
            result[seq_id] = drafts[j].tolist()
            if probs is not None:
                self.draft_probs[seq_id] = probs[j]
        return result
