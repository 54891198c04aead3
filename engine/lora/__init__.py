"""Multi-LoRA: many PEFT adapters served on one base model in one batch (vLLM's interface).

- :class:`LoRARequest` (request.py): which adapter a request runs with (``lora_name``, ``lora_int_id``,
  ``lora_path``).
- :class:`LoRAConfig` (config.py): ``max_lora_rank``, ``max_loras`` (device slots), ``max_cpu_loras`` (host cache).
- adapter.py: PEFT adapters (``adapter_config.json`` + ``adapter_model.safetensors``) loaded and checked against
  the base model.
- layers.py: :class:`LoRALinear`, the engine's linear layers with their adapters' slots (fused q/k/v and gate/up as
  slices, tensor-parallel shards), over ``pagedkernels.add_lora`` (shrink, then expand); :class:`LoRABatch`, each
  token's slot in device buffers the runner fills.
- cache.py / manager.py: :class:`LoRAManager`, the host cache and the device slots (LRU, the running batch's
  adapters pinned); ``lora_targets`` / ``check_lora_adapter``: an adapter checked against a model without
  building it (the server's --lora-modules).
"""

from engine.lora.adapter import LoRAAdapter, LoRAModuleWeights, load_peft_adapter
from engine.lora.cache import PinnedLRU
from engine.lora.config import LoRAConfig
from engine.lora.layers import LoRABatch, LoRALinear, LoRATarget, apply_lora
from engine.lora.manager import LoRAManager, check_lora_adapter, lora_targets, token_slots
from engine.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAConfig", "LoRALinear", "LoRAManager", "LoRAModuleWeights", "LoRARequest",
           "LoRATarget", "PinnedLRU", "apply_lora", "check_lora_adapter", "load_peft_adapter", "lora_targets",
           "token_slots"]
