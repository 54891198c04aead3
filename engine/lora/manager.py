"""The engine's adapters: loaded on the host, placed in device slots for the steps that run them.

Two bounded caches, both least-recently-used with the running batch's adapters pinned (never evicted):

- the host cache, ``max_cpu_loras`` adapters loaded from their PEFT directories (validated against the base model
  when they come in: a bad adapter is a ValueError for its request, nothing else);
- the device slots, ``max_loras`` of them: a slot holds one adapter's weights in every LoRA layer. The adapters in
  slots are among those on the host (``max_cpu_loras >= max_loras``); an adapter leaving the host leaves its slot.

Each step the model runner (engine/worker/model_runner.py) places the step's adapters, which the scheduler chose
(``SchedulerOutput.lora_requests``, at most ``max_loras`` of them), then names every token's slot:

    slot_of = manager.set_active_adapters(requests)   # the step's distinct adapters -> their slots (loads, pins)
    manager.prepare_batch(token_slots(...))           # every token's slot (-1: base model) into LoRABatch

More than ``max_loras`` distinct adapters in one step is a ValueError before anything is evicted. Requests arrive
through ``add_adapter`` (the engine core calls it when a request comes in, so a bad adapter fails that request
before it is queued); an adapter the host cache evicted since is read again when a step needs it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, load_peft_adapter
from engine.lora.cache import PinnedLRU
from engine.lora.config import LoRAConfig
from engine.lora.layers import LoRABatch, LoRALinear, LoRATarget, apply_lora
from engine.lora.request import LoRARequest


def token_slots(request_slots: Sequence[int], query_lens: Sequence[int]) -> np.ndarray:
    """int32 ``[sum(query_lens)]``: each request's slot (-1: none) repeated over its tokens of the step, requests
    in the order their tokens are laid out."""
    return np.repeat(np.asarray(request_slots, dtype=np.int32), np.asarray(query_lens, dtype=np.int64))


class LoRAManager:
    """LoRA for one model (one rank's part of it under tensor parallelism): wraps its decoder layers' linears
    (:func:`engine.lora.layers.apply_lora`), owns the host cache, the device slots and the :class:`LoRABatch`.

    Args:
        model: the model, weights loaded (its linears are wrapped in place).
        config: the LoRA limits.
        max_num_tokens: the most tokens one forward runs (the runner's ``max_num_batched_tokens``, or its largest
            graph batch if larger).
        dtype: the adapters' dtype on the device (the model's activation dtype).
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, *, max_num_tokens: int, dtype: torch.dtype):
        self.config, self.dtype = config, dtype
        device = next(model.parameters()).device
        self.batch = LoRABatch(max_num_tokens, config.max_loras, device)
        self.targets: dict[str, LoRATarget] = apply_lora(model, self.batch, max_rank=config.max_lora_rank,
                                                         dtype=dtype)
        self.layers: list[LoRALinear] = list(dict.fromkeys(t.layer for t in self.targets.values()))
        self.host: PinnedLRU[int, LoRAAdapter] = PinnedLRU(config.max_cpu_loras)
        self.slots: PinnedLRU[int, int] = PinnedLRU(config.max_loras)
        self._free_slots = list(range(config.max_loras - 1, -1, -1))
        self._requests: dict[int, LoRARequest] = {}
        self.num_adapter_loads = 0   # adapters read from disk
        self.num_slot_loads = 0      # adapters written into a device slot

    # -- the host cache --------------------------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter into the host cache unless it is there (then it becomes the most recently
        used). Returns whether it was read. ValueError for a bad adapter, or an id already naming another adapter.
        When every entry of the host cache is pinned (the running batch's adapters fill it), the adapter is read
        and checked but not kept: a step that runs it reads it again."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self._requests.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                             f"({known.lora_path}); {request.lora_name!r} ({request.lora_path}) needs another id")
        if request.lora_int_id in self.host:
            self.host.get(request.lora_int_id)
            return False
        adapter = load_peft_adapter(request.lora_path, lora_int_id=request.lora_int_id, lora_name=request.lora_name,
                                    targets={name: (t.in_features, t.out_features)
                                             for name, t in self.targets.items()},
                                    max_lora_rank=self.config.max_lora_rank, dtype=self.dtype)
        self.num_adapter_loads += 1
        if not self.host.has_room():
            return True
        for evicted_id, _ in self.host.put(request.lora_int_id, adapter):
            self._forget(evicted_id)
        self._requests[request.lora_int_id] = request
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host and its slot. Returns whether it was loaded; ValueError while the running
        batch uses it (between steps, :meth:`unpin` first)."""
        if lora_int_id in self.host.pinned:
            raise ValueError(f"adapter {lora_int_id} is in use by the running batch")
        if lora_int_id not in self.host:
            return False
        self.host.pop(lora_int_id)
        self._forget(lora_int_id)
        return True

    def unpin(self) -> None:
        """Release the last step's pins (between steps: a step that needs an adapter again places it again)."""
        self.host.pin([])
        self.slots.pin([])

    def list_adapters(self) -> list[LoRARequest]:
        """The adapters loaded on the host, least recently used first."""
        return [self._requests[i] for i in self.host.keys()]

    def _forget(self, lora_int_id: int) -> None:
        self._requests.pop(lora_int_id, None)
        if lora_int_id in self.slots:
            self._free_slots.append(self.slots.pop(lora_int_id))

    # -- the device slots ------------------------------------------------------------------------------------

    def set_active_adapters(self, requests: Sequence[LoRARequest], *,
                            on_error: Callable[[LoRARequest, ValueError], None] | None = None) -> dict[int, int]:
        """Place the step's adapters (``requests``, repeats allowed) in device slots and pin them, on the host and
        in the slots, until the next call; returns ``{lora_int_id: slot}``. An adapter not on the host is loaded
        (ValueError for a bad one); one not in a slot takes a free slot or the least recently used unpinned one's.
        ValueError, before anything changes, when the step has more distinct adapters than ``max_loras``.

        on_error(request, error): called for an adapter that fails to load (its directory changed since the
        request was accepted) instead of raising; that adapter is left out of the result (its tokens must run
        without it: the caller fails their requests) and the others are placed."""
        ids = list(dict.fromkeys(r.lora_int_id for r in requests))
        if len(ids) > self.config.max_loras:
            raise ValueError(f"a step may run at most max_loras={self.config.max_loras} distinct adapters, got "
                             f"{len(ids)}: {ids}")
        by_id = {r.lora_int_id: r for r in requests}
        # Pin what is already there first, so loading the others cannot evict it (and the last step's pins go:
        # the host may evict an adapter only the last step ran, its slot with it).
        present = [i for i in ids if i in self.host]
        self.host.pin(present)
        self.slots.pin([i for i in ids if i in self.slots])
        for i in ids:
            if i in self.host:
                self.host.get(i)
                continue
            try:
                self.add_adapter(by_id[i])
            except ValueError as error:
                if on_error is None:
                    raise
                on_error(by_id[i], error)
                continue
            # There is room: at most max_loras - 1 others are pinned, and max_cpu_loras >= max_loras.
            present.append(i)
            self.host.pin(present)
        ids = [i for i in ids if i in self.host]   # those that failed (on_error) left out
        self.slots.pin([i for i in ids if i in self.slots])
        placed = [i for i in ids if i in self.slots]
        for i in ids:
            if i in self.slots:
                self.slots.get(i)
                continue
            evicted = self.slots.put(i, -1)
            slot = evicted[0][1] if evicted else self._free_slots.pop()
            self.slots.put(i, slot)
            self._write_slot(slot, self.host.peek(i))
            placed.append(i)
            self.slots.pin(placed)
        self.slots.pin(ids)
        return {i: self.slots.peek(i) for i in ids}

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)
        for module, weights in adapter.modules.items():
            target = self.targets[module]
            target.layer.set_slice(slot, target.slice_index, weights.lora_a, weights.lora_b)
        self.num_slot_loads += 1

    def slot_of(self, lora_int_id: int) -> int | None:
        return self.slots.peek(lora_int_id)

    # -- the step's tokens -----------------------------------------------------------------------------------

    def prepare_batch(self, slots: np.ndarray | torch.Tensor | None, num_tokens: int | None = None, *,
                      active: bool | None = None) -> None:
        """Every token's slot for the next forward (see :meth:`LoRABatch.prepare`)."""
        self.batch.prepare(slots, num_tokens, active=active)


def lora_targets(model_config) -> dict[str, tuple[int, int]]:
    """The projections adapters of ``model_config``'s model may target: checkpoint module name -> its whole
    (in_features, out_features), read off the model built on the meta device (no weights, no memory)."""
    from engine.distributed.parallel_state import planned_layout
    from engine.models import get_model_class

    with planned_layout(1, 0), torch.device("meta"):
        model = get_model_class(model_config.architecture)(model_config)
        targets = apply_lora(model, LoRABatch(1, 1, "meta"), max_rank=1)
    return {name: (t.in_features, t.out_features) for name, t in targets.items()}


def check_lora_adapter(request: LoRARequest, model_config, config: LoRAConfig) -> None:
    """Load ``request``'s adapter as the engine would and drop it: ValueError naming it for anything the engine
    cannot run (a server checks its --lora-modules this way before it starts the engine)."""
    load_peft_adapter(request.lora_path, lora_int_id=request.lora_int_id, lora_name=request.lora_name,
                      targets=lora_targets(model_config), max_lora_rank=config.max_lora_rank)
