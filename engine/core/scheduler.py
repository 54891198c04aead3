"""Iteration-level scheduling: which sequences run this step, and how many of their tokens.

Uniform: every sequence has tokens with KV in the cache (`num_computed_tokens`) and tokens to compute (the rest of
its tokens, plus under speculative decoding the drafts proposed for it); a step gives each scheduled sequence a
count, whatever that count means (a prefill chunk, one decode token, 1 + k to verify k drafts). There is no prefill
or decode phase here.

Every step has a token budget (`max_num_batched_tokens`). Running sequences come first, those decoding before
those computing a prompt (a decode row costs one token of the budget, and a long prompt computed in chunks, or a
preempted request recomputing its tokens, must not take a step's whole budget from the requests already
streaming), each group in arrival order, each taking what it has to compute or what is left of the budget (a
prompt longer than that is cut into chunks: chunked prefill; drafts are verified only whole); swapped-out
requests come back next; waiting sequences are then admitted in arrival order (FCFS) while the budget,
`max_num_seqs` and the free blocks allow.

When a running sequence needs a block and none is free, the latest-arrived running request not yet scheduled
this step is preempted, all its sequences together (an n > 1 request or a beam search is one unit; members
already scheduled this step are taken back out of the batch):
- "recompute": its blocks are freed, its computed-token counts reset, its generated tokens kept, and its
  sequences go back to the FRONT of the waiting queue. Resumed, they recompute prompt + output (often from the
  prefix cache) and continue exactly where they stopped.
- "swap": its blocks move to the CPU swap space (shared blocks once) and the request waits in `swapped`; it is
  swapped back in, before any waiting request is admitted, as soon as its blocks (plus one per sequence for the
  next token) are free. When the swap space cannot hold it, it is preempted by recomputation instead.

An n > 1 request forks when its prompt completes: in the step that computes the prompt's last token, sequences
1..n-1 are made sharing all its blocks, and they sample from its logits row with their own parameters.

A step's decisions are final once the core launches it (`commit`): the scheduled tokens count as computed at once
(`num_computed_tokens` runs ahead), and each sequence that samples holds a placeholder for the token it will get
(`num_output_placeholders`) until `update_from_output` brings the step's output. So the next step can be scheduled
before this one's output is back (async scheduling, engine/core/engine_core.py): a sequence's next token to compute
is its placeholder, whose id the worker keeps on the device. What cannot be known without the token waits for it:
a guided sequence (its grammar must accept the token before the next mask), a beam (the core picks its next token),
a sequence that may have reached max_tokens, a preempted one. Without async scheduling, outputs come back before
the next `schedule` and the placeholders are always 0 by then.

Multi-LoRA (`max_loras`): a step runs at most `max_loras` distinct adapters (the workers' device slots; the base
model counts for none). A waiting request is admitted when its adapter is one the running requests use, or they
use fewer than `max_loras`; one that does not fit is skipped (it keeps its place) and the requests behind it go on
being admitted, as vLLM's scheduler does. So the running requests never need more adapters than there are slots;
should a step still meet one more (a swapped request coming back), that sequence sits the step out.

The workers keep their own copy of every sequence (engine/worker/input_batch.py); `schedule` also writes the
step's diff for them (engine/step_records.py): a sequence they have not seen in full, then per step only the
tokens the core appended, the block-table entries from the first one that changed, and the computed count.
"""
import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager, group_block_moves
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.step_records import CachedSequenceData, NewSequenceData, SchedulerOutput


@dataclass(slots=True)
class ScheduledStep:
    """One step's decisions, as the core keeps them (sequences), and the diff the workers get (`output`)."""
    # (sequence, number of its tokens to compute now, drafts included); blocks for them are allocated.
    scheduled: list[tuple[Sequence, int]]
    output: SchedulerOutput
    # Forks made as a parent's prompt completes this step: (child, parent).
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    # The sequences that take their next token(s) from this step: every entry that reaches its end (mid-prompt
    # chunks do not) and the forks, which sample from their parent's row.
    samples: list[Sequence] = field(default_factory=list)
    # seq_id -> placeholders this step gave it (1 + its drafts; 0 for a beam, whose token the core picks).
    num_placeholders: dict[int, int] = field(default_factory=dict)
    # seq_id -> (its kv_epoch, its num_computed_tokens) once this step is computed: what update_from_output
    # registers, unless the sequence was preempted since.
    computed: dict[int, tuple[int, int]] = field(default_factory=dict)
    committed: bool = False

    @property
    def block_moves(self) -> list[tuple[str, list[tuple[int, int]]]]:
        return self.output.block_moves


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", max_num_seqs_per_request: int | None = None,
                 max_loras: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if max_num_seqs_per_request is not None and max_num_seqs_per_request < 1:
            raise ValueError(f"max_num_seqs_per_request must be >= 1, got {max_num_seqs_per_request}")
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        # Fairness: while other requests run or wait, one request's sequences take at most this many rows of a
        # step (its others wait their turn, least recently run first) and count this many against max_num_seqs
        # when requests are admitted. None: no limit.
        self.max_num_seqs_per_request = max_num_seqs_per_request
        self._step_index = 0
        self._last_run: dict[int, int] = {}   # seq_id -> the last step that ran it (fair share rotation)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        # Most distinct LoRA adapters in one step (None: LoRA is off, no request has one).
        self.max_loras = max_loras
        self._step_loras: set[int] = set()   # the adapters of the sequences scheduled so far this step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # sorted by seq.order: the last one is the preemption victim
        self.swapped: deque[SequenceGroup] = deque()   # FCFS among swapped-out requests
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        # Prompt tokens at first admission, and how many of them the prefix cache served (for the hit rate).
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        # Sequences the workers know that finished since the last step: they forget them with the next one.
        self.finished_seq_ids: list[int] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, grammar_bitmask=None) -> ScheduledStep:
        """Pick this step's batch: (sequence, number of its tokens to compute now) entries, with blocks covering
        those tokens allocated, the block moves this needs (copy-on-write, swap) in the order decided, and the
        workers' diff. `grammar_bitmask(seqs)`: the guided-decoding bitmask of the sequences that sample."""
        self._budget = self.max_num_batched_tokens
        self._moves: list[tuple[str, int, int]] = []
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        self._step_index += 1
        self._step_loras = set()
        waiting_turn = self._over_fair_share()

        # Running sequences, those decoding (one token to compute, and drafts) before those computing a prompt or
        # recomputing after a preemption, each group in arrival order: each what it has to compute (drafts only
        # whole), within the budget.
        decoding, computing = [], []
        for seq in self.running:
            if len(seq.token_ids) + seq.num_output_placeholders - seq.num_computed_tokens <= 1:
                decoding.append(seq)
            else:
                computing.append(seq)
        running, allocate_slots, moves = SequenceStatus.RUNNING, self.block_manager.allocate_slots, self._moves
        for seq in decoding + computing:
            if self._budget == 0 or len(scheduled) == self.max_num_seqs:
                break   # (rows: admission keeps the running within them, but a step past them fails every request)
            if seq.status is not running:   # preempted earlier in this loop
                continue
            if seq.seq_id in waiting_turn:   # its request has its share of this step
                continue
            num_new_tokens = len(seq.token_ids) + seq.num_output_placeholders - seq.num_computed_tokens
            if num_new_tokens == 0:   # a beam waiting for the rest of its group's step
                continue
            if seq.num_output_placeholders and not self._can_run_ahead(seq):
                continue   # it needs its token in flight before its next step
            if seq.lora_request is not None and not self._lora_fits(seq, self._step_loras):
                continue   # its adapter would be one more than the step's slots
            spec = seq.spec_token_ids
            if spec and num_new_tokens + len(spec) <= self._budget:
                num_new_tokens += len(spec)
            else:
                if spec:
                    seq.spec_token_ids = []
                num_new_tokens = min(num_new_tokens, self._budget)
            while seq.status is running and not allocate_slots(seq, num_new_tokens, moves=moves):
                self._preempt(self._pick_victim(scheduled), scheduled)
                preempted = True
            if seq.status is running:
                self._schedule_seq(seq, num_new_tokens, scheduled)

        # Swapped-out requests come back first (they arrived before anything still waiting), as wholes.
        slots = self._running_slots() if self.swapped or self.waiting else 0
        while self.swapped and not preempted and self._budget > 0:
            group = self.swapped[0]
            members = [s for s in group.seqs if s.status is SequenceStatus.SWAPPED]
            if slots + self._share(group.seqs[0], len(members)) > self.max_num_seqs:
                break
            if not self.block_manager.can_swap_in(members, num_headroom_blocks=len(members)):
                break
            if not self._lora_fits(members[0], self._step_loras):
                break
            self.swapped.popleft()
            slots += self._share(group.seqs[0], len(members))
            self.block_manager.swap_in(members, self._moves)
            for seq in members:
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=lambda s: s.order)
            # Back as a whole, but computing in this step only within the request's share and the rows the
            # running left (a step of more than max_num_seqs rows fails every request in it); the other members
            # take their turns from the next step.
            room = min(self._share(members[0], len(members)), self.max_num_seqs - len(scheduled))
            for seq in members[:max(room, 0)]:
                num_new_tokens = min(seq.num_tokens + seq.num_output_placeholders - seq.num_computed_tokens,
                                     self._budget)
                if num_new_tokens > 0 and self.block_manager.allocate_slots(seq, num_new_tokens, moves=self._moves):
                    self._schedule_seq(seq, num_new_tokens, scheduled)

        # Waiting sequences, FCFS; none while this step had to preempt (memory is short: let the running finish).
        # One whose adapter does not fit is skipped and keeps its place.
        loras_in_use = self._loras_in_use() if self.max_loras is not None and self.waiting else set()
        skipped: list[Sequence] = []
        while (self.waiting and not preempted and not self.swapped and self._budget > 0
               and slots + self._share(self.waiting[0], self._num_seqs_after_fork(self.waiting[0]))
               <= self.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_output_placeholders:   # preempted with a token in flight: it resumes once the token is here
                break
            if not self._lora_fits(seq, loras_in_use):
                skipped.append(self.waiting.popleft())
                continue
            cached_block_ids = self.block_manager.lookup_prefix(seq)
            num_new_tokens = min(seq.num_tokens - len(cached_block_ids) * self.block_manager.block_size, self._budget)
            if not self.block_manager.allocate_slots(seq, num_new_tokens, cached_block_ids, moves=self._moves):
                break   # nothing was taken; wait for blocks to free up
            self.waiting.popleft()
            slots += self._share(seq, self._num_seqs_after_fork(seq))
            seq.spec_token_ids = []
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.num_cached_prompt_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            self._schedule_seq(seq, num_new_tokens, scheduled)
            if seq.lora_request is not None:
                loras_in_use.add(seq.lora_request.lora_int_id)
        self.waiting.extendleft(reversed(skipped))

        forks = self._fork_completing_prompts(scheduled)
        if self.max_num_seqs_per_request is not None:
            for seq, _ in scheduled:
                self._last_run[seq.seq_id] = self._step_index
        return ScheduledStep(scheduled, self._worker_output(scheduled, forks, grammar_bitmask), forks)

    def _lora_fits(self, seq: Sequence, loras: set[int]) -> bool:
        """Whether `seq`'s adapter can join `loras` (adapters already taken): it is one of them, or there is room
        for one more under max_loras. Always for the base model."""
        lora = seq.lora_request
        return (lora is None or self.max_loras is None or lora.lora_int_id in loras
                or len(loras) < self.max_loras)

    def _loras_in_use(self) -> set[int]:
        """The adapters of the running and swapped-out requests, and of this step's (admission keeps these within
        max_loras, so that every running request fits in a step's slots)."""
        seqs = [*self.running, *(seq for group in self.swapped for seq in group.seqs)]
        return {seq.lora_request.lora_int_id for seq in seqs if seq.lora_request is not None} | self._step_loras

    @staticmethod
    def _can_run_ahead(seq: Sequence) -> bool:
        """Whether `seq`, with a token still in flight, can be scheduled on its placeholder: not when its next step
        depends on that token's value on the host (a grammar's mask, a beam's choice) or may not be needed at all
        (the token in flight may be its last: max_tokens)."""
        if seq.guided is not None or seq.group.beam is not None:
            return False
        return seq.max_tokens is None or seq.num_output_tokens + seq.num_output_placeholders < seq.max_tokens

    @staticmethod
    def commit(step: ScheduledStep) -> None:
        """The step is launched: its tokens count as computed from now on, and each sequence that samples holds a
        placeholder for each token it will get (see the module docstring). Before the next `schedule`."""
        if step.committed:
            return
        step.committed = True
        computed, samples, placeholders = step.computed, step.samples, step.num_placeholders
        for seq, num_new_tokens in step.scheduled:
            num_drafts = len(seq.spec_token_ids)
            num_computed = seq.num_computed_tokens + num_new_tokens
            seq.num_computed_tokens = num_computed
            computed[seq.seq_id] = (seq.kv_epoch, num_computed)
            if num_computed >= len(seq.token_ids) + seq.num_output_placeholders + num_drafts:   # it samples
                samples.append(seq)
                num = placeholders[seq.seq_id] = 0 if seq.group.beam is not None else 1 + num_drafts
                seq.num_output_placeholders += num
        for child, parent in step.forks:
            child.num_computed_tokens = parent.num_computed_tokens
            step.computed[child.seq_id] = (child.kv_epoch, child.num_computed_tokens)
            step.samples.append(child)
            step.num_placeholders[child.seq_id] = 1
            child.num_output_placeholders += 1

    def _share(self, seq: Sequence, num_seqs: int) -> int:
        """The rows `num_seqs` sequences of `seq`'s request can take in a step shared with other requests: at most
        max_num_seqs_per_request, but every one of a beam search's (its beams step together: _over_fair_share
        exempts them). Counted as its share, a beam search of width 2 under a limit of 1 let admission take one
        row too many, and the step of max_num_seqs + 1 rows failed every request in it."""
        limit = self.max_num_seqs_per_request
        return num_seqs if limit is None or seq.group.beam is not None else min(num_seqs, limit)

    def _running_slots(self) -> int:
        """Rows the running requests may take in one step (each at most its share): what admission counts. A request
        still at its prompt counts the sequences it forks into when the prompt completes (_num_seqs_after_fork):
        counted as one, an n = 2 request admitted beside another took three rows of two at its fork."""
        per_request: dict[str, list] = {}   # request id -> [its running sequences, one of them]
        for seq in self.running:
            entry = per_request.get(seq.request_id)
            if entry is None:
                per_request[seq.request_id] = [1, seq]
            else:
                entry[0] += 1
        return sum(self._share(seq, max(count, self._num_seqs_after_fork(seq)))
                   for count, seq in per_request.values())

    def _over_fair_share(self) -> set[int]:
        """The running sequences that sit this step out: while other requests run or wait, each request beyond
        max_num_seqs_per_request runs that many of its sequences, those run least recently (a beam search, whose
        beams step together, is exempt). A request alone runs all of its sequences."""
        limit = self.max_num_seqs_per_request
        if limit is None or len(self.running) <= limit:
            return set()
        groups: dict[str, list[Sequence]] = {}
        for seq in self.running:
            if seq.num_tokens + seq.num_output_placeholders > seq.num_computed_tokens:
                groups.setdefault(seq.request_id, []).append(seq)
        if len(groups) <= 1 and not self.waiting and not self.swapped:
            return set()
        sitting_out = set()
        for seqs in groups.values():
            if len(seqs) <= limit or seqs[0].group.beam is not None:
                continue
            seqs = sorted(seqs, key=lambda s: (self._last_run.get(s.seq_id, -1), s.order))
            sitting_out.update(s.seq_id for s in seqs[limit:])
        return sitting_out

    def _fork_completing_prompts(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Sequence]]:
        """An n > 1 request whose prompt completes this step forks now: sequences 1..n-1 share every block of
        the parent (a beam search forks in its own step: engine/core/beam_search.py)."""
        forks = []
        for seq, num_new_tokens in scheduled:
            group = seq.group
            if group.forked or group.beam is not None or seq.num_computed_tokens + num_new_tokens < seq.num_tokens:
                continue
            group.forked = True
            # A fork sampling now takes a row of this step. Admission counts a request's fair share, not its n,
            # so an n = max_num_seqs request admitted beside another had more forks than rows (the step failed,
            # and both requests with it): the forks past the rows left wait their turn, their prompt computed
            # but for its last token, which they compute themselves (a copy of the shared last block) to sample.
            room = max(self.max_num_seqs - len(scheduled) - len(forks), 0)
            for index in range(1, group.n):
                child = self.fork(seq, index)
                if index <= room:
                    forks.append((child, seq))
                else:
                    child.num_computed_tokens = seq.num_tokens - 1
        return forks

    def _worker_output(self, scheduled: list[tuple[Sequence, int]], forks: list[tuple[Sequence, Sequence]],
                       grammar_bitmask) -> SchedulerOutput:
        """The workers' diff of this step (engine/step_records.py)."""
        new_seqs, cached_seqs = [], []
        num_scheduled, spec = {}, {}
        for seq, num_new_tokens in scheduled:
            seq_id = seq.seq_id
            num_scheduled[seq_id] = num_new_tokens
            if seq.spec_token_ids:
                spec[seq_id] = list(seq.spec_token_ids)
            if not seq.known_to_workers:
                new_seqs.append(new_sequence_data(seq, seq.num_computed_tokens))
            else:
                token_ids, sent = seq.token_ids, seq.num_tokens_sent
                block_table, synced = seq.block_table, seq.block_table_synced
                # Positional, in the fields' order: seq_id, new_token_ids, block_ids_from, new_block_ids,
                # num_computed_tokens, token_start (one record per scheduled sequence per step).
                cached_seqs.append(CachedSequenceData(seq_id, token_ids[sent:], synced, block_table[synced:],
                                                      seq.num_computed_tokens, sent))
                seq.num_tokens_sent = len(token_ids)
                seq.block_table_synced = len(block_table)
        sample_from = {}
        for child, parent in forks:
            # Computed as far as its parent will be after this step.
            new_seqs.append(new_sequence_data(child, parent.num_computed_tokens + num_scheduled[parent.seq_id]))
            sample_from[child.seq_id] = parent.seq_id
        bitmask = None
        if grammar_bitmask is not None:
            samplers = [seq for seq, n in scheduled if seq.guided is not None
                        and seq.num_computed_tokens + n >= seq.num_tokens] + \
                       [child for child, _ in forks if child.guided is not None]
            if samplers:
                bitmask = ([seq.seq_id for seq in samplers], grammar_bitmask(samplers))
        finished, self.finished_seq_ids = self.finished_seq_ids, []
        loras = {seq.lora_request.lora_int_id: seq.lora_request for seq, _ in scheduled if seq.lora_request is not None}
        assert self.max_loras is None or len(loras) <= self.max_loras, f"{len(loras)} adapters in one step"
        return SchedulerOutput(new_seqs=new_seqs, cached_seqs=cached_seqs, num_scheduled_tokens=num_scheduled,
                               spec_token_ids=spec, sample_from=sample_from, finished_seq_ids=finished,
                               block_moves=group_block_moves(self._moves), grammar_bitmask=bitmask,
                               lora_requests=loras)

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
        if seq.lora_request is not None:
            self._step_loras.add(seq.lora_request.lora_int_id)

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
            seq.spec_token_ids = []
            seq.kv_epoch += 1
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

    def update_from_output(self, step: ScheduledStep, num_accepted_tokens: dict[int, int] | None = None,
                           failed=()) -> list[Sequence]:
        """The model computed `step`: a sequence that verified k drafts and had a of them accepted computed k - a
        tokens too many (their KV is dropped); register the blocks the step filled (not for a sequence preempted
        or finished since: its blocks are gone; nor for one the worker failed, `failed`: its KV may be wrong, e.g.
        computed without its adapter); release the step's placeholders. Returns the sequences that take their
        next token(s) now (ScheduledStep.samples): the caller appends them."""
        num_accepted_tokens = num_accepted_tokens or {}
        self.commit(step)
        computed, spec = step.computed, step.output.spec_token_ids
        finished = SequenceStatus.FINISHED
        cache_full_blocks = self.block_manager.cache_full_blocks
        for seq, _ in step.scheduled:
            epoch, num_computed = computed[seq.seq_id]
            if seq.status is finished or seq.kv_epoch != epoch or seq.seq_id in failed:
                continue
            if spec:
                num_drafts = len(spec.get(seq.seq_id, ()))
                if num_drafts:
                    num_rejected = num_drafts - num_accepted_tokens.get(seq.seq_id, 0)
                    seq.num_computed_tokens -= num_rejected
                    num_computed -= num_rejected
            cache_full_blocks(seq, num_computed)
        placeholders = step.num_placeholders
        for seq in step.samples:
            seq.num_output_placeholders -= placeholders[seq.seq_id]
        return step.samples

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
        seq.spec_token_ids = []
        seq.num_output_placeholders = 0
        self._last_run.pop(seq.seq_id, None)
        if seq.known_to_workers:
            self.finished_seq_ids.append(seq.seq_id)
            seq.known_to_workers = False


def new_sequence_data(seq: Sequence, num_computed_tokens: int) -> NewSequenceData:
    """`seq` in full for the workers (from now on they know it: later steps send only what changed)."""
    seq.known_to_workers = True
    seq.num_tokens_sent = seq.num_tokens
    seq.block_table_synced = len(seq.block_table)
    beam = seq.group.beam
    return NewSequenceData(seq_id=seq.seq_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                           num_computed_tokens=num_computed_tokens, block_ids=list(seq.block_table), params=seq.params,
                           seed=seq.seed, stop_token_ids=sorted(seq.stop_token_ids),
                           bad_words_token_ids=seq.bad_words_token_ids,
                           beam_candidates=beam.num_candidates if beam is not None else 0,
                           lora_request=seq.lora_request)
