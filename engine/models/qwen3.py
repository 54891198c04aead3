"""Qwen3: the Llama network with a per-head RMSNorm on q and k before the rotary embedding."""

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import qwen_sliding_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @classmethod
    def _sliding_windows(cls, text: dict, common: ModelConfig):
        return qwen_sliding_windows(text, common)
