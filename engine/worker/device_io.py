"""A step's traffic between the host and the device, without making the host wait.

- `HostStaging`: the host arrays of a step's inputs (token ids, positions, slots, block tables, sampling
  parameters) go to the device from pinned memory, so each copy is a true asynchronous DMA (from pageable memory the
  driver stages the source through a bounce buffer first). Two arenas alternate between steps: the one a step
  fills is not the one the previous step's copies may still be reading.
- `SampledIds`: a step's sampled token ids (and packed logprobs) stay on the device; a copy to pinned host memory
  is queued behind the sampler and the host reads it when it needs the values: at once without async scheduling,
  one step later with it (then the next step's inputs take the ids from the device: `scatter_into`).
- `AsyncModelRunnerOutput`: a step's ModelRunnerOutput whose sampled ids are filled in when `get_output()` is
  called (the engine core's one deliberate wait, one step late).

On CPU the device is the host: nothing is staged, and the ids are read where they are.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.step_records import ModelRunnerOutput, SampleLogprobs
from engine.worker.sampler import SampledTensors


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
        array = np.ascontiguousarray(array)
        tensor = torch.from_numpy(array)
        if not self.pinned:
            return tensor
        nbytes = array.nbytes
        arena = self._arena(self._offset + nbytes)
        staged = arena[self._offset:self._offset + nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        self._offset += -(-nbytes // self.ALIGN) * self.ALIGN
        return staged.to(self.device, non_blocking=True)

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


class SampledIds:
    """The plain-sampled rows of one step, in order: `seq_ids` and their ids on the device (`ids`, int64), with the
    packed logprobs of the rows that asked (SampledTensors). `start_copy()` queues the copy to the host;
    `resolve()` waits for it (if it has not landed) and returns {seq_id: SampleLogprobs or None} after filling
    `values`. Failed rows (sampling raised for them alone) are named in `failed`: their ids are 0 and unused."""

    def __init__(self, seq_ids: list[int], device: torch.device, host_lengths: list[int] | None = None):
        self.seq_ids = seq_ids
        self.position = {seq_id: j for j, seq_id in enumerate(seq_ids)}
        # seq_id -> its token count on the host when it sampled (where its id goes; rank 0, which samples).
        self.host_lengths = dict(zip(seq_ids, host_lengths or ()))
        self.ids = torch.zeros(len(seq_ids), dtype=torch.int64, device=device)
        self.parts: list[tuple[int, SampledTensors]] = []   # (first position, what one sampling call drew)
        self.failed: set[int] = set()
        self.values: list[int] | None = None
        self.logprobs: dict[int, SampleLogprobs] = {}
        self._host = None
        self._event = None

    def add(self, start: int, drawn: SampledTensors) -> None:
        """What one sampling call drew for positions start.. (the whole batch, or one row after a failure)."""
        self.ids[start:start + drawn.sampled_token_ids.shape[0]] = drawn.sampled_token_ids
        self.parts.append((start, drawn))

    def start_copy(self) -> None:
        """Queue the copy of the ids (and logprobs) to pinned host memory behind the sampler (CUDA); on CPU the
        values are where they are."""
        if self.ids.device.type != "cuda":
            return
        tensors = [self.ids] + [drawn.packed_logprobs for _, drawn in self.parts if drawn.packed_logprobs is not None]
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = _record_event()

    def resolve(self) -> None:
        """The values on the host (waiting for the copy if it has not landed yet: the one deliberate wait)."""
        if self.values is not None:
            return
        if self._event is not None:
            self._event.synchronize()
            ids, packed = self._host[0], iter(self._host[1:])
        else:
            ids, packed = self.ids, iter(drawn.packed_logprobs for _, drawn in self.parts
                                         if drawn.packed_logprobs is not None)
        self.values = ids.tolist()
        for start, drawn in self.parts:
            if drawn.packed_logprobs is None:
                continue
            rows = drawn.to_lists(self.values[start:start + drawn.sampled_token_ids.shape[0]], next(packed).tolist())
            for j, lp in enumerate(rows.sampled_logprobs):
                if lp is not None:
                    self.logprobs[self.seq_ids[start + j]] = SampleLogprobs(
                        [lp], [rows.sampled_ranks[j]], [rows.topk_token_ids[j]], [rows.topk_logprobs[j]])

    def tokens(self) -> dict[int, list[int]]:
        """{seq_id: [its sampled id]} of the rows that did not fail (after resolve())."""
        return {seq_id: [self.values[j]] for j, seq_id in enumerate(self.seq_ids) if seq_id not in self.failed}

    def fill(self, output: ModelRunnerOutput) -> None:
        """Put the resolved values into `output` (sampled ids and logprobs)."""
        self.resolve()
        output.sampled_token_ids.update(self.tokens())
        for seq_id, logprobs in self.logprobs.items():
            if seq_id not in self.failed:
                output.logprobs[seq_id] = logprobs

    def scatter_into(self, input_ids: torch.Tensor, token_index: list[int], seq_ids: list[int],
                     to_device) -> None:
        """input_ids[token_index[i]] = the id sampled for seq_ids[i], on the device (no value read)."""
        if not token_index:
            return
        src = to_device(np.asarray([self.position[s] for s in seq_ids], dtype=np.int64))
        dst = to_device(np.asarray(token_index, dtype=np.int64))
        input_ids.index_copy_(0, dst, self.ids.index_select(0, src))


class AsyncModelRunnerOutput:
    """A step's output whose plain-sampled ids are still on their way to the host (async scheduling)."""

    def __init__(self, output: ModelRunnerOutput, sampled: SampledIds):
        self._output = output
        self._sampled = sampled

    def get_output(self) -> ModelRunnerOutput:
        """The complete ModelRunnerOutput (waits for the ids' copy if it has not landed)."""
        self._sampled.fill(self._output)
        return self._output
