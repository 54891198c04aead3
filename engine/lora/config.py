"""``LoRAConfig``: the engine's LoRA limits (vLLM's option names)."""

from __future__ import annotations

from dataclasses import dataclass

# The largest adapter rank the engine stacks: a slot's A of a fused q/k/v layer is 3 x max_lora_rank rows, and the
# expand's rank loop runs in chunks of 64, so any rank works; this bounds the memory a typo could ask for.
MAX_LORA_RANK_LIMIT = 512


@dataclass(frozen=True)
class LoRAConfig:
    """max_lora_rank: every adapter's rank must be at most this (smaller ranks are zero-padded to it in the device
    slots). max_loras: device slots, the most distinct adapters one step can run. max_cpu_loras: adapters kept
    loaded on the host (default max_loras; at least max_loras, the device slots' adapters are among them)."""

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK_LIMIT}, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        cpu = self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}): the adapters in device "
                             f"slots stay loaded on the host; got {cpu!r}")
