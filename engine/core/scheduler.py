"""Iteration-level scheduling: which sequences run this step, and how many of their tokens.

Every step has a token budget (`max_num_batched_tokens`). Running sequences come first: decodes (one token
each), then partially prefilled sequences continue their prompt. Waiting sequences are then admitted in
arrival order (FCFS) while the budget, `max_num_seqs` and the free blocks allow; a prompt longer than what is
left of the budget is cut into chunks (chunked prefill), so one batch mixes decodes and prefill chunks.

When a running sequence needs a block and none is free, the latest-arrived running request not yet scheduled
this step is preempted, all its sequences together (an n > 1 request or a beam search is one unit; members
already scheduled this step are taken back out of the batch):
- "recompute": its blocks are freed, its computed-token counts reset, its generated tokens kept, and its
  sequences go back to the FRONT of the waiting queue. Resumed, they recompute prompt + output (often from the
  prefix cache) and continue exactly where they stopped.
- "swap": its blocks move to the CPU swap space (shared blocks once) and the request waits in `swapped`; it is
  swapped back in, before any waiting request is admitted, as soon as its blocks (plus one per sequence for the
  next token) are free. When the swap space cannot hold it, it is preempted by recomputation instead.
"""
import bisect
import time
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager, group_block_moves
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions, everything the executor needs to run it."""
    # (sequence, number of its tokens to compute now); blocks for them are allocated.
    scheduled: list[tuple[Sequence, int]]
    # Block moves to issue before the forward, in order: [("swap_out" | "swap_in" | "copy", [(src, dst), ...])].
    block_moves: list[tuple[str, list[tuple[int, int]]]]

    @property
    def prompt_logits_rows(self) -> list[int]:
        """Entries still inside a prompt whose logprobs were asked for: they need the logits of every position."""
        return [i for i, (seq, _) in enumerate(self.scheduled)
                if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens]


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute"):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # sorted by seq.order: the last one is the preemption victim
        self.swapped: deque[SequenceGroup] = deque()   # FCFS among swapped-out requests
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        # Prompt tokens at first admission, and how many of them the prefix cache served (for the hit rate).
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: (sequence, number of its tokens to compute now) entries, with blocks covering
        those tokens allocated, and the block moves this needs (copy-on-write, swap) in the order decided."""
        self._budget = self.max_num_batched_tokens
        self._moves: list[tuple[str, int, int]] = []
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False

        # Running sequences: decodes first, then continuing prefill chunks.
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if self._budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop
                continue
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, self._budget)
            while (seq.status is SequenceStatus.RUNNING
                   and not self.block_manager.allocate_slots(seq, num_new_tokens, moves=self._moves)):
                self._preempt(self._pick_victim(scheduled), scheduled)
                preempted = True
            if seq.status is SequenceStatus.RUNNING:
                self._schedule_seq(seq, num_new_tokens, scheduled)

        # Swapped-out requests come back first (they arrived before anything still waiting), as wholes.
        while self.swapped and not preempted and self._budget > 0:
            group = self.swapped[0]
            members = [s for s in group.seqs if s.status is SequenceStatus.SWAPPED]
            if len(self.running) + len(members) > self.max_num_seqs:
                break
            if not self.block_manager.can_swap_in(members, num_headroom_blocks=len(members)):
                break
            self.swapped.popleft()
            self.block_manager.swap_in(members, self._moves)
            for seq in members:
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=lambda s: s.order)
            for seq in members:
                num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, self._budget)
                if num_new_tokens > 0 and self.block_manager.allocate_slots(seq, num_new_tokens, moves=self._moves):
                    self._schedule_seq(seq, num_new_tokens, scheduled)

        # Waiting sequences, FCFS; none while this step had to preempt (memory is short: let the running finish).
        while (self.waiting and not preempted and not self.swapped and self._budget > 0
               and len(self.running) + self._num_seqs_after_fork(self.waiting[0]) <= self.max_num_seqs):
            seq = self.waiting[0]
            cached_block_ids = self.block_manager.lookup_prefix(seq)
            num_new_tokens = min(seq.num_tokens - len(cached_block_ids) * self.block_manager.block_size, self._budget)
            if not self.block_manager.allocate_slots(seq, num_new_tokens, cached_block_ids, moves=self._moves):
                break   # nothing was taken; wait for blocks to free up
            self.waiting.popleft()
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.num_cached_prompt_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            self._schedule_seq(seq, num_new_tokens, scheduled)
        return SchedulerOutput(scheduled, group_block_moves(self._moves))

    @staticmethod
    def _num_seqs_after_fork(seq: Sequence) -> int:
        """Running slots that admitting `seq` takes: n for a request that will fork, beam_width for a beam search
        still at its prompt, 1 otherwise."""
        group = seq.group
        if group.beam is not None and len(group.seqs) == 1:
            return group.beam.params.beam_width
        return 1 if group.forked else group.n

    def _schedule_seq(self, seq: Sequence, num_new_tokens: int, scheduled: list[tuple[Sequence, int]]) -> None:
        """`seq` has its slots (allocate_slots returned True): put it in the batch."""
        scheduled.append((seq, num_new_tokens))
        self._budget -= num_new_tokens

    def _pick_victim(self, scheduled: list[tuple[Sequence, int]]) -> SequenceGroup:
        scheduled_ids = {s.seq_id for s, _ in scheduled}
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled_ids:
                return seq.group
        raise AssertionError("unreachable: the sequence being scheduled is itself a candidate")

    def _preempt(self, group: SequenceGroup, scheduled: list[tuple[Sequence, int]]) -> None:
        """Preempt the running sequences of `group`, taking any of them already scheduled this step back out."""
        members = [s for s in group.seqs if s.status is SequenceStatus.RUNNING]
        for entry in [e for e in scheduled if e[0].group is group]:
            scheduled.remove(entry)
            self._budget += entry[1]
        for seq in members:
            self.running.remove(seq)
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(members):
            self.block_manager.swap_out(members, self._moves)
            for seq in members:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.num_swap_preemptions += 1
        else:
            for seq in reversed(members):
                self.block_manager.deallocate(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
        group.seqs[0].metrics.num_preemptions += 1
        self.num_preemptions += 1

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A running copy of `parent` as sequence `index` of its request, sharing all of its blocks."""
        child = parent.fork(index)
        self.block_manager.fork(parent, child)
        bisect.insort(self.running, child, key=lambda s: s.order)
        return child

    def _forks_on_prompt_done(self, seq: Sequence) -> list[Sequence]:
        """``seq``, whose prompt is computed, and, the first time for an n > 1 request, its n - 1 forks
        (sequences 1..n-1, sharing every block): the sequences that sample from its logits row this step."""
        if seq.group.forked:
            return [seq]
        seq.group.forked = True
        return [seq] + [self.fork(seq, index) for index in range(1, seq.group.n)]

    def update_from_output(self, output: SchedulerOutput) -> list[tuple[int, Sequence]]:
        """The model computed the scheduled tokens: advance the counts, register newly full blocks, and return the
        sequences that take a next token from this step's logits, as (row of `output.scheduled`, sequence) pairs:
        every entry that reached its end (mid-prompt chunks do not), and, the first time for an n > 1 request,
        its n - 1 forks (sequences 1..n-1, sharing every block), on their parent's row. A beam search forks in
        its own step (engine/core/beam_search.py), so its entries are returned unforked."""
        for seq, num_new_tokens in output.scheduled:
            seq.num_computed_tokens += num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        sampling = []
        for row, (seq, _) in enumerate(output.scheduled):
            if seq.num_computed_tokens != seq.num_tokens:
                continue
            for member in ([seq] if seq.group.beam is not None else self._forks_on_prompt_done(seq)):
                sampling.append((row, member))
        return sampling

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence (running, waiting or swapped) and free its blocks."""
        if seq.status is SequenceStatus.SWAPPED:
            self.block_manager.free_swapped(seq)
            if not any(s.status is SequenceStatus.SWAPPED for s in seq.group.seqs if s is not seq):
                self.swapped.remove(seq.group)
        else:
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
