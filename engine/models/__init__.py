"""Model registry: HF ``architectures`` name -> engine model class (imported on first use), and the reading of a
model directory into a ModelConfig (``load_model_config``).

Each model class owns its config mapping: ``config_from_hf(hf_text_config, common) -> dict`` (a classmethod)
turns its config.json keys into ModelConfig fields, so load_model_config asks the model's module what a key means
instead of knowing every architecture itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from engine.config import ModelConfig, _first, _ids, _read_json, need, resolve_dtype
from engine.gguf_file import is_gguf_path, read_gguf_config

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


def _override(hf: dict, overrides: dict) -> dict:
    """config.json's dict with `overrides` set over it (and over its text_config, where it has one)."""
    if not isinstance(overrides, dict) or not all(isinstance(key, str) for key in overrides):
        raise ValueError(f"hf_overrides must be a dict of config.json keys, got {overrides!r}")
    hf = {**hf, **overrides}
    if isinstance(hf.get("text_config"), dict) and "text_config" not in overrides:
        hf["text_config"] = {**hf["text_config"], **overrides}
    return hf


def load_model_config(model_dir: str, *, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                      device: str | torch.device | None = None, quantization: str | None = None,
                      hf_overrides: dict | None = None) -> ModelConfig:
    """Read ``model_dir/config.json`` (and ``generation_config.json`` when present); ``model_dir`` may
    also be a GGUF file, whose metadata gives both (engine/gguf_file.py).

    ``quantization``: a method name (``"fp8"``, ``"gptq"``, ...) the checkpoint's quantization_config
    must agree with, or that quantizes a float checkpoint on load (fp8); None follows the checkpoint.

    ``dtype="auto"`` follows the checkpoint, except on CPUs without fast arithmetic for it (``device``
    None means CUDA when available, else CPU): bf16 checkpoints run in bf16 on CPUs with AMX-BF16 or
    AVX512-BF16 and in float32 on others, float16 and quantized ones in float32 (see ``resolve_dtype``).
    ``max_model_len`` defaults to ``max_position_embeddings`` and may not exceed it.

    ``hf_overrides`` (vLLM's): config.json keys and values set over the file's, before anything is read from it
    (e.g. ``{"max_position_embeddings": 8192, "rope_scaling": {...}}``); a model that keeps its language model's
    keys in ``text_config`` gets them there too.
    """
    model_dir = os.fspath(model_dir)
    if is_gguf_path(model_dir):   # a GGUF file: config and special tokens from its metadata
        hf, gen = read_gguf_config(model_dir)
    else:
        hf = _read_json(os.path.join(model_dir, "config.json"), required=True)
        gen = _read_json(os.path.join(model_dir, "generation_config.json"), required=False) or {}
    if hf_overrides is not None:
        hf = _override(hf, hf_overrides)
    # Multimodal wrappers keep the language model in text_config; the keys we need live there.
    text = hf.get("text_config", hf)

    architecture = _architecture(hf)
    model_class = get_model_class(architecture)

    hidden_size = int(need(text, "hidden_size", model_dir))
    num_heads = int(need(text, "num_attention_heads", model_dir))
    num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                         f"num_key_value_heads={num_kv_heads} in {model_dir}/config.json")
    num_layers = int(need(text, "num_hidden_layers", model_dir))
    max_pos = int(text.get("max_position_embeddings") or 2048)
    set_by_user = max_model_len is not None
    if max_model_len is None:
        max_model_len = max_pos
    elif not isinstance(max_model_len, int) or max_model_len < 1 or max_model_len > max_pos:
        raise ValueError(f"max_model_len must be an int in [1, {max_pos}] "
                         f"(max_position_embeddings of {model_dir}), got {max_model_len!r}")
    # Each architecture's default for tied embeddings differs (transformers' config classes); the
    # model class names its own.
    tie_default = getattr(model_class, "tie_word_embeddings_default", False)

    config = ModelConfig(
        model_dir=model_dir,
        architecture=architecture,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=int(text.get("head_dim") or hidden_size // num_heads),
        vocab_size=int(need(text, "vocab_size", model_dir)),
        max_position_embeddings=max_pos,
        max_model_len=max_model_len,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", tie_default))),
        dtype=resolve_dtype(dtype, hf.get("dtype", hf.get("torch_dtype", text.get("dtype", text.get("torch_dtype")))),
                            device, quantized=bool(quantization or hf.get("quantization_config")
                                                   or text.get("quantization_config") or is_gguf_path(model_dir))),
        eos_token_ids=frozenset(_ids(text.get("eos_token_id", hf.get("eos_token_id"))) | _ids(gen.get("eos_token_id"))),
        bos_token_id=_first(gen.get("bos_token_id", text.get("bos_token_id"))),
        pad_token_id=_first(gen.get("pad_token_id", text.get("pad_token_id"))),
        hf_config=hf,
        max_model_len_set_by_user=set_by_user,
    )
    from engine.layers.quantization import resolve_quant_config   # the layers import this registry's package

    try:
        fields = model_class.config_from_hf(text, config)
    except ValueError as e:
        raise ValueError(f"{model_dir}/config.json: {e}") from e
    unknown = set(fields) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:  # a model mapping a key to a field that does not exist is a bug, not a config problem
        raise TypeError(f"{model_class.__name__}.config_from_hf returned unknown fields {sorted(unknown)}")
    fields["quant_config"] = resolve_quant_config(
        hf, quantization, packed_modules_mapping=getattr(model_class, "packed_modules_mapping", {}),
        model_dir=model_dir)
    return dataclasses.replace(config, **fields)


def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    if architectures:
        return architectures[0]
    return architecture_of_model_type(hf.get("model_type"))
