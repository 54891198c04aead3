"""Model registry: HF ``architectures`` name -> engine model class (imported on first use)."""

from __future__ import annotations

import importlib

# architecture -> (module, class). Mistral is Llama plus a sliding window, which the config carries.
_MODELS = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)


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
