"""The worker's persistent batch (vLLM V1's InputBatch): every sequence's tokens, block table and sampling state
in preallocated arrays, updated in place from each step's diff (engine/step_records.py) instead of rebuilt.

Rows 0..num_rows-1 are the sequences of the current step (scheduled, or sampling from a parent's logits); a
sequence the core did not schedule this step leaves its row but keeps its `SequenceState` (a preempted one, one
the token budget left out), and gets a row again, rebuilt from that state, when it is scheduled. Removing rows
leaves holes that `condense` fills from the end, so the live rows stay contiguous.

Per row, on the host (numpy; the inputs of a step are gathered from these with vectorized indexing):
  token_ids      int32 [max_num_seqs, max_model_len + max_spec]: prompt + output (+ this step's drafts after)
  num_tokens, num_computed_tokens, num_prompt_tokens   int64 [max_num_seqs]
  block_table    int32 [max_num_seqs, max_blocks_per_seq]
  temperature, top_p, min_p, frequency/presence/repetition penalties   float32 [max_num_seqs]; top_k int32
  special        bool [max_num_seqs]: the row needs a per-row look (own generator, logit_bias, allowed_token_ids,
                 bad words, min_tokens, logprobs, prompt logprobs, penalties); the others are all arrays
  lora_int_id    int64 [max_num_seqs]: the row's LoRA adapter (0: the base model)
Penalties read each row's own tokens (token_ids) and its distinct output tokens (SequenceState, kept up to date as
tokens are appended), not vocabulary-wide counts (engine/worker/sampler.py Penalties).

`HostStaging`: the host arrays of a step's inputs (token ids, positions, slots, block tables, sampling parameters) go
to the device from pinned memory, so each copy is a true asynchronous DMA (from pageable memory the driver
synchronizes the stream before it copies). Two arenas alternate between steps: the one a step fills is not the one
the previous step's copies may still be reading. On CPU the device is the host: nothing is staged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.step_records import CachedSequenceData, NewSequenceData, SchedulerOutput
from engine.worker.sampler import BadWords, FLOAT32_MAX


@dataclass(slots=True)
class SequenceState:
    """What the worker keeps of one sequence from the step it arrives until the core says it finished."""
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_token_ids: list[int]
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    beam_candidates: int = 0
    # Distinct output tokens in order of first occurrence (presence penalty), kept for penalized sequences.
    unique_output_ids: dict[int, None] = field(default_factory=dict)
    # Made once per request, not per step: logit_bias as (ids, values) tensors, allowed_token_ids as a tensor.
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed_tensor: torch.Tensor | None = None
    # The LoRA adapter its tokens run with (engine.lora.LoRARequest), None for the base model.
    lora_request: object | None = None
    # uses_penalties, kept: appending a token asks it every step.
    penalized: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.penalized = self.uses_penalties
        if self.penalized:
            self.unique_output_ids = dict.fromkeys(self.token_ids[self.num_prompt_tokens:])
        if self.bad_words_token_ids and not isinstance(self.bad_words_token_ids, BadWords):
            self.bad_words_token_ids = BadWords(self.bad_words_token_ids)   # indexed once (see BadWords)
        p = self.params
        if p.logit_bias:
            self.logit_bias_tensors = (torch.tensor(list(p.logit_bias), dtype=torch.int64),
                                       torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
        if p.allowed_token_ids is not None:
            self.allowed_tensor = torch.tensor(p.allowed_token_ids, dtype=torch.int64)

    def append(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        if self.penalized:
            self.unique_output_ids.update(dict.fromkeys(token_ids))

    def append_one(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.penalized:
            self.unique_output_ids[token_id] = None

    @property
    def special(self) -> bool:
        """Whether sampling needs a look at this sequence beyond the batch's arrays."""
        p = self.params
        return bool(self.generator is not None or p.logit_bias or p.allowed_token_ids is not None
                    or self.bad_words_token_ids or p.min_tokens or p.logprobs is not None or self.uses_penalties
                    or p.prompt_logprobs is not None)

    @classmethod
    def from_new(cls, new: NewSequenceData, device: torch.device | str = "cpu") -> "SequenceState":
        """The state of a sequence the core sent in full (its own generator seeded from `new.seed`)."""
        generator = None
        if new.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(new.seed)
        state = cls(seq_id=new.seq_id, token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                    num_computed_tokens=new.num_computed_tokens, block_ids=list(new.block_ids), params=new.params,
                    generator=generator, stop_token_ids=list(new.stop_token_ids),
                    bad_words_token_ids=new.bad_words_token_ids, beam_candidates=new.beam_candidates,
                    lora_request=new.lora_request)
        if torch.device(device).type != "cpu":   # copied once per request (from pinned memory), not every step
            if state.logit_bias_tensors is not None:
                state.logit_bias_tensors = tuple(t.pin_memory().to(device, non_blocking=True)
                                                 for t in state.logit_bias_tensors)
            if state.allowed_tensor is not None:
                state.allowed_tensor = state.allowed_tensor.pin_memory().to(device, non_blocking=True)
        return state

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def uses_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class InputBatch:
    def __init__(self, *, max_num_seqs: int, max_model_len: int, max_num_spec_tokens: int, block_size: int,
                 vocab_size: int, device: torch.device):
        self.max_num_seqs = max_num_seqs
        self.max_len = max_model_len + max_num_spec_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks_per_seq = -(-self.max_len // block_size)
        self.states: dict[int, SequenceState] = {}
        self.row_of: dict[int, int] = {}                 # seq_id -> row
        self.seq_ids: list[int | None] = [None] * max_num_seqs
        self.num_rows = 0                                # rows in use (holes possible until condense)
        self.token_ids = np.zeros((max_num_seqs, self.max_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int32)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.special = np.zeros(max_num_seqs, dtype=bool)
        self.lora_int_id = np.zeros(max_num_seqs, dtype=np.int64)

    # -- the step's diff ------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput) -> None:
        """Apply a step's diff: forget finished sequences, drop the rows of those not in this step (and close the
        holes), append the core's tokens and block ids to the scheduled ones, give rows to the ones without."""
        for seq_id in out.finished_seq_ids:
            self._remove_row(seq_id)
            self.states.pop(seq_id, None)
        in_step = set(out.num_scheduled_tokens) | set(out.sample_from)
        for seq_id in [s for s in self.row_of if s not in in_step]:
            self._remove_row(seq_id)
        self.condense()
        for new in out.new_seqs:
            self.states[new.seq_id] = SequenceState.from_new(new, self.device)
        states, row_of = self.states, self.row_of
        rows, computed = [], []   # rows that only advance their computed count (most decode steps): set at once
        for cached in out.cached_seqs:
            state = states[cached.seq_id]
            new_token_ids = cached.new_token_ids
            if cached.token_start is not None:   # skip the tokens this worker sampled and appended itself
                held = len(state.token_ids) - cached.token_start
                if held < 0:
                    raise RuntimeError(f"sequence {cached.seq_id}: the core's tokens start at {cached.token_start}, "
                                       f"past the worker's {len(state.token_ids)}")
                new_token_ids = new_token_ids[held:]
            if new_token_ids:
                state.append(new_token_ids)
            if cached.new_block_ids or cached.block_ids_from < len(state.block_ids):
                del state.block_ids[cached.block_ids_from:]
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
            row = row_of.get(cached.seq_id)
            if row is None:
                continue
            if new_token_ids or cached.new_block_ids:
                self._append_to_row(row, cached, new_token_ids)
            else:
                rows.append(row)
                computed.append(cached.num_computed_tokens)
        if rows:
            self.num_computed_tokens[rows] = computed
        for seq_id in in_step:
            if seq_id not in self.row_of:
                self._add_row(self.states[seq_id])

    def _add_row(self, state: SequenceState) -> None:
        row = self.num_rows
        if row >= self.max_num_seqs:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} sequences in one step")
        self.num_rows += 1
        self.seq_ids[row] = state.seq_id
        self.row_of[state.seq_id] = row
        num_tokens = len(state.token_ids)
        self.token_ids[row, :num_tokens] = state.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table[row, :len(state.block_ids)] = state.block_ids
        p = state.params
        # Past float32's range a temperature or repetition penalty acts as its largest value (the sampler's
        # clamp); stored so, numpy has no overflow to warn of.
        self.temperature[row] = min(p.temperature, FLOAT32_MAX)
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k if p.top_k < self.vocab_size else 0   # top_k >= the vocabulary keeps all: off
        self.min_p[row] = p.min_p
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.repetition_penalty[row] = min(p.repetition_penalty, FLOAT32_MAX)
        self.special[row] = state.special
        self.lora_int_id[row] = 0 if state.lora_request is None else state.lora_request.lora_int_id

    def append_sampled(self, seq_id: int, token_ids: list[int], *, at: int) -> None:
        """Tokens this worker sampled for `seq_id` when it had `at` tokens, appended as the core will append them:
        not when the core's diff brought them already, nor for a sequence the core has finished since (gone)."""
        state = self.states.get(seq_id)
        if state is None or len(state.token_ids) != at:
            return
        state.append(token_ids)
        row = self.row_of.get(seq_id)
        if row is not None:
            start = self.num_tokens[row]
            self.token_ids[row, start:start + len(token_ids)] = token_ids
            self.num_tokens[row] = start + len(token_ids)

    def append_sampled_ids(self, seq_ids: list[int], token_ids: list[int], lengths: list[int]) -> None:
        """append_sampled for one token each (a plain sampling step's ids: token_ids[i] for seq_ids[i], which had
        lengths[i] tokens then), the rows' arrays written at once."""
        states, row_of = self.states, self.row_of
        rows, tokens = [], []
        for seq_id, token_id, at in zip(seq_ids, token_ids, lengths):
            state = states.get(seq_id)
            if state is None or len(state.token_ids) != at:
                continue
            state.append_one(token_id)
            row = row_of.get(seq_id)
            if row is not None:
                rows.append(row)
                tokens.append(token_id)
        if rows:
            index = np.array(rows, dtype=np.int64)
            self.token_ids[index, self.num_tokens[index]] = tokens
            self.num_tokens[index] += 1

    def _append_to_row(self, row: int, cached: CachedSequenceData, new: list[int]) -> None:
        start = self.num_tokens[row]
        if new:
            self.token_ids[row, start:start + len(new)] = new
            self.num_tokens[row] = start + len(new)
        if cached.new_block_ids:
            self.block_table[row, cached.block_ids_from:cached.block_ids_from + len(cached.new_block_ids)] = \
                cached.new_block_ids
        self.num_computed_tokens[row] = cached.num_computed_tokens

    def _remove_row(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.seq_ids[row] = None

    def condense(self) -> None:
        """Fill the holes left by removed rows with the last rows, so rows 0..num_rows-1 are all live."""
        holes = [row for row in range(self.num_rows) if self.seq_ids[row] is None]
        last = self.num_rows - 1
        for hole in holes:
            while last > hole and self.seq_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        self.num_rows = sum(1 for row in range(self.num_rows) if self.seq_ids[row] is not None)

    def _move_row(self, src: int, dst: int) -> None:
        seq_id = self.seq_ids[src]
        self.seq_ids[dst], self.seq_ids[src] = seq_id, None
        self.row_of[seq_id] = dst
        num_tokens = self.num_tokens[src]
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        num_blocks = len(self.states[seq_id].block_ids)
        self.block_table[dst, :num_blocks] = self.block_table[src, :num_blocks]
        for array in (self.num_tokens, self.num_computed_tokens, self.num_prompt_tokens, self.temperature,
                      self.top_p, self.top_k, self.min_p, self.frequency_penalty, self.presence_penalty,
                      self.repetition_penalty, self.special, self.lora_int_id):
            array[dst] = array[src]

    # -- reading ----------------------------------------------------------------------------------------------
    def state_at(self, row: int) -> SequenceState:
        return self.states[self.seq_ids[row]]


def speculation_allowed(state: SequenceState, num_new_tokens: int = 0) -> bool:
    """Whether drafts may be verified for `state` (after it takes `num_new_tokens` more): its processed
    distribution must not depend on the position within a step's drafts, so no penalties, no bad words, no
    min_tokens still ahead, not a beam. (Guided sequences are left out by the core, which holds the grammar.)"""
    p = state.params
    return (not state.uses_penalties and not state.bad_words_token_ids and not state.beam_candidates
            and state.num_output_tokens + num_new_tokens >= p.min_tokens)


# Bytes before the first of a step's inputs staged to the device (HostStaging.to_device_many) and before the first
# field of a decode graph's input region (decode_graphs.static_region_layout): no input of the compiled forward
# starts its storage, on either path. Dynamo specializes a storage offset of 0 or 1 (its 0/1 specialization), so an
# input at offset 0 on one path and past it on the other failed the guards of the first compile, and the model
# compiled again (a mixed batch after the decode graphs: the memory profile's at a CUDA engine's start-up).
INPUT_PAD_BYTES = 64


class HostStaging:
    """Pinned staging for host -> device copies on CUDA (see the module docstring); on CPU `to_device` is a view.

    Call `next_step()` before a step's first copy: it switches arenas, waiting (normally not at all) until the
    copies made from the arena two steps ago are done."""

    ALIGN = 64

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 20):
        self.device = device
        self.pinned = device.type == "cuda"
        self._arenas: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._sizes = [initial_bytes, initial_bytes]
        self._current = 0
        self._offset = 0

    def next_step(self) -> None:
        if not self.pinned:
            return
        self._events[self._current] = _record_event()
        self._current ^= 1
        event = self._events[self._current]
        if event is not None:
            event.synchronize()   # the copies of two steps ago: long done
        self._offset = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device: a view on CPU; on CUDA a non-blocking copy out of this step's pinned arena."""
        return self.to_device_many(array)[0]

    def to_device_many(self, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Several arrays on the device, as :meth:`to_device` each, in one copy: staged back to back in this step's
        arena, the range copied to the device at once, and each result a view of that device buffer (a decode step's
        six input arrays: one copy and one allocation instead of six)."""
        tensors = [torch.from_numpy(np.ascontiguousarray(array)) for array in arrays]
        if not self.pinned:
            return tuple(tensors)
        starts, end = [], self._offset + INPUT_PAD_BYTES   # none at the device buffer's start
        for tensor in tensors:
            starts.append(end)
            end += -(-tensor.nbytes // self.ALIGN) * self.ALIGN
        arena = self._arena(end)
        for tensor, start in zip(tensors, starts):
            arena[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        base = self._offset
        on_device = arena[base:end].to(self.device, non_blocking=True)
        self._offset = end
        return tuple(on_device[start - base:start - base + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
                     for tensor, start in zip(tensors, starts))

    def to_device_region(self, region: torch.Tensor,
                         parts: list[tuple[int, torch.dtype, tuple[int, ...], np.ndarray]]) -> None:
        """Fill the device buffer ``region`` (uint8, CUDA) in one copy: each (byte offset, dtype, shape, array) of
        ``parts`` is a field of that dtype and shape at that offset, whose leading ``array.shape`` block takes
        ``array`` (a table's first rows and columns; converted to the dtype). The region's bytes are laid out in this
        step's arena, then copied at once; bytes no array covers carry whatever the arena held (the caller's layout
        never reads them)."""
        base = self._offset
        end = base + -(-region.numel() // self.ALIGN) * self.ALIGN
        arena = self._arena(end)
        for offset, dtype, shape, array in parts:
            count = int(np.prod(shape)) * dtype.itemsize
            field = arena[base + offset:base + offset + count].view(dtype).view(shape)
            field[tuple(slice(0, n) for n in array.shape)].copy_(torch.from_numpy(np.ascontiguousarray(array)))
        region.copy_(arena[base:base + region.numel()], non_blocking=True)
        self._offset = end

    def _arena(self, needed: int) -> torch.Tensor:
        index = self._current
        arena = self._arenas[index]
        if arena is None or arena.numel() < needed:
            size = max(self._sizes[index], 2 * needed)
            if arena is not None:   # copies queued from the old arena must finish before it is freed
                torch.cuda.current_stream(self.device).synchronize()
            self._arenas[index] = arena = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._sizes[index] = size
        return arena


def _record_event():
    event = torch.cuda.Event()
    event.record()
    return event
