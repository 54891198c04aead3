"""Model registry: HF ``architectures`` name -> engine model class (imported on first use).

Each model class owns its config mapping: ``config_from_hf(hf_text_config, common) -> dict`` (a classmethod)
turns its config.json keys into ModelConfig fields, so ModelConfig.from_pretrained asks the model's module
what a key means instead of knowing every architecture itself.
"""

from __future__ import annotations

import importlib

# architecture -> (module, class). Mistral is Llama plus a sliding window, which the config carries.
_MODELS = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("engine.models.opt", "OPTForCausalLM"),
    "Gemma2ForCausalLM": ("engine.models.gemma2", "Gemma2ForCausalLM"),
    "Phi3ForCausalLM": ("engine.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("engine.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("engine.models.olmoe", "OlmoeForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)
# model_type -> architecture, for configs that lack an "architectures" list.
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "opt": "OPTForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def architecture_of_model_type(model_type: str | None) -> str:
    """The architecture a config.json without "architectures" means by its ``model_type`` (an unsupported
    placeholder naming the model_type when there is none)."""
    return _MODEL_TYPE_ARCHITECTURES.get(model_type, f"<model_type {model_type!r}>")


def check_architecture(architecture: str) -> None:
    """ValueError listing the supported architectures when ``architecture`` is not one of them."""
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model_class(architecture: str) -> type:
    """The engine's model class for an HF architecture name; ValueError listing the supported ones."""
    check_architecture(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
