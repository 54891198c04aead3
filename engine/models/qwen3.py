"""Qwen3: the Llama network with a per-head RMSNorm on q and k before the rotary embedding."""

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
