"""Qwen2: the Llama network with a bias on q/k/v (ModelConfig sets attention_bias) and none on o_proj."""

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    o_bias_follows_attention_bias = False
