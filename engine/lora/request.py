"""``LoRARequest``: which adapter a request runs with, under vLLM's names and semantics.

``LoRARequest(lora_name, lora_int_id, lora_path)``: ``lora_name`` is what the adapter is known by (the server's
``model`` field picks it), ``lora_int_id`` a positive integer naming the adapter inside the engine (its key in the
host and device caches; vLLM requires ``> 0``, 0 being "no adapter"), ``lora_path`` the directory PEFT saved it to
(``adapter_config.json`` + ``adapter_model.safetensors``). As in vLLM, two requests are equal (and hash alike)
when their ``lora_name`` is, so an adapter can be recognized across engines whatever its id there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int > 0 (0 means no adapter), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a str (the adapter's directory), got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a str or None, got {self.base_model_name!r}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def to_wire(self) -> list:
        """As plain msgpack-able data (the core's socket, engine/step_records.py)."""
        return [self.lora_name, self.lora_int_id, self.lora_path, self.base_model_name]

    @classmethod
    def from_wire(cls, data: list | None) -> "LoRARequest | None":
        return None if data is None else cls(*data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
