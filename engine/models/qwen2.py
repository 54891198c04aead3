"""Qwen2: the Llama network with a bias on q/k/v and none on o_proj."""

from engine.config import ModelConfig, read_layer_types
from engine.models.llama import LlamaForCausalLM


def qwen_sliding_windows(text: dict, common: ModelConfig) -> tuple[int | None, tuple[int | None, ...]]:
    """Qwen2/Qwen3 slide only with ``use_sliding_window``, and only in some layers: transformers 5 lists
    them in ``layer_types``; transformers 4 slides from layer ``max_window_layers`` on."""
    num_layers = common.num_hidden_layers
    window = text.get("sliding_window")
    if not text.get("use_sliding_window", False) or not window:
        return None, (None,) * num_layers
    window = int(window)
    layer_types = read_layer_types(text, num_layers)
    if layer_types is None:
        first = int(text.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return window, tuple(window if t == "sliding_attention" else None for t in layer_types)


class Qwen2ForCausalLM(LlamaForCausalLM):
    o_bias_follows_attention_bias = False

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        """As Llama's, except that q/k/v always carry a bias, whatever attention_bias says."""
        return {**super().config_from_hf(text, common), "attention_bias": True}

    @classmethod
    def _sliding_windows(cls, text: dict, common: ModelConfig):
        return qwen_sliding_windows(text, common)
