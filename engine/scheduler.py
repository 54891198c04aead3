"""Iteration-level scheduling: which sequences run this step, and how many of their tokens.

Every step has a token budget (`max_num_batched_tokens`). Running sequences come first: decodes (one token
each), then partially prefilled sequences continue their prompt. Waiting sequences are then admitted in
arrival order (FCFS) while the budget, `max_num_seqs` and the free blocks allow; a prompt longer than what is
left of the budget is cut into chunks (chunked prefill), so one batch mixes decodes and prefill chunks.

When a running sequence needs a block and none is free, the latest-arrived running sequence not yet scheduled
this step is preempted by recomputation: its blocks are freed, its computed-token count reset, its generated
tokens kept, and it goes back to the FRONT of the waiting queue. Resumed, it recomputes prompt + output (often
from the prefix cache) and continues exactly where it stopped.
"""
import bisect
import time
from collections import deque

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # sorted by arrival (seq_id): the last one is the preemption victim
        self.num_preemptions = 0
        # Prompt tokens at first admission, and how many of them the prefix cache served (for the hit rate).
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's batch: a list of (sequence, number of its tokens to compute now). Blocks covering
        those tokens are allocated on return."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        scheduled_ids: set[int] = set()
        preempted = False

        # Running sequences: decodes first, then continuing prefill chunks.
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop
                continue
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_new_tokens):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.may_append(seq, num_new_tokens)
            scheduled.append((seq, num_new_tokens))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new_tokens

        # Waiting sequences, FCFS; none while this step had to preempt (memory is short: let the running finish).
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.block_manager.allocate(seq)   # prefix-cache hits
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_append(seq, num_new_tokens):
                self.block_manager.deallocate(seq)   # give the hits back; wait for blocks to free up
                break
            self.waiting.popleft()
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.num_cached_prompt_tokens += seq.num_cached_tokens
            self.block_manager.may_append(seq, num_new_tokens)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            scheduled.append((seq, num_new_tokens))
            budget -= num_new_tokens
        return scheduled

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled_ids:
                return seq
        raise AssertionError("unreachable: the sequence being scheduled is itself a candidate")

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The model computed the scheduled tokens: advance the counts and register newly full blocks."""
        for seq, num_new_tokens in scheduled:
            seq.num_computed_tokens += num_new_tokens
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence (running or waiting) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
