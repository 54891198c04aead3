"""Model configuration read from a Hugging Face model directory (config.json + generation_config.json).

Reads both key styles transformers has written: version 4 (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and version 5 (``rope_parameters`` holding ``rope_theta`` and the scaling keys,
``dtype``). Nothing from transformers is imported: the engine runs on its own modules.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from engine.models import check_architecture

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# model_type -> architecture, for configs that lack an "architectures" list.
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    model_dir: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    max_model_len: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "linear" | "llama3", ...its parameters}
    sliding_window: int | None
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2 always; Llama/Qwen3 when the config says so)
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    # Per layer: the sliding window of that layer (None = full attention). Mistral slides in every
    # layer; Qwen2/Qwen3 only in the layers their config marks "sliding_attention".
    layer_sliding_windows: tuple[int | None, ...] = ()
    mlp_bias: bool = False
    hf_config: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_pretrained(cls, model_dir: str, *, dtype: str | torch.dtype = "auto",
                        max_model_len: int | None = None,
                        device: str | torch.device | None = None) -> "ModelConfig":
        """Read ``model_dir/config.json`` (and ``generation_config.json`` when present).

        ``dtype="auto"`` follows the checkpoint, except that bf16/fp16 checkpoints run in float32 on
        CPU (``device`` None means CUDA when available, else CPU), where half-precision matmuls are
        slow and inexact. ``max_model_len`` defaults to ``max_position_embeddings`` and may not
        exceed it.
        """
        model_dir = os.fspath(model_dir)
        hf = _read_json(os.path.join(model_dir, "config.json"), required=True)
        gen = _read_json(os.path.join(model_dir, "generation_config.json"), required=False) or {}
        # Multimodal wrappers keep the language model in text_config; the keys we need live there.
        text = hf.get("text_config", hf)

        architecture = _architecture(hf)
        check_architecture(architecture)

        def need(key):
            if text.get(key) is None:
                raise ValueError(f"config.json in {model_dir} has no {key!r}")
            return text[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads} in {model_dir}/config.json")
        head_dim = int(text.get("head_dim") or hidden_size // num_heads)
        num_layers = int(need("num_hidden_layers"))
        hidden_act = text.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")

        rope_theta, rope_scaling = _rope(text)
        max_pos = int(text.get("max_position_embeddings") or 2048)
        if max_model_len is None:
            max_model_len = max_pos
        elif not isinstance(max_model_len, int) or max_model_len < 1 or max_model_len > max_pos:
            raise ValueError(f"max_model_len must be an int in [1, {max_pos}] "
                             f"(max_position_embeddings of {model_dir}), got {max_model_len!r}")

        sliding_window, layer_windows = _sliding_windows(architecture, text, num_layers)
        # Qwen2's q/k/v always carry a bias (and o_proj never); the others follow attention_bias.
        attention_bias = True if architecture == "Qwen2ForCausalLM" else bool(text.get("attention_bias", False))

        return cls(
            model_dir=model_dir,
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=attention_bias,
            dtype=resolve_dtype(dtype, hf.get("dtype", hf.get("torch_dtype", text.get("dtype", text.get("torch_dtype")))),
                                device),
            eos_token_ids=frozenset(_ids(text.get("eos_token_id", hf.get("eos_token_id"))) | _ids(gen.get("eos_token_id"))),
            bos_token_id=_first(gen.get("bos_token_id", text.get("bos_token_id"))),
            pad_token_id=_first(gen.get("pad_token_id", text.get("pad_token_id"))),
            layer_sliding_windows=layer_windows,
            mlp_bias=bool(text.get("mlp_bias", False)),
            hf_config=hf,
        )


def resolve_dtype(requested: str | torch.dtype, checkpoint: str | None,
                  device: str | torch.device | None) -> torch.dtype:
    """The dtype to run in: an explicit request wins; "auto" takes the checkpoint's dtype
    (float32 when unnamed) but runs half-precision checkpoints in float32 on CPU."""
    if isinstance(requested, torch.dtype):
        if requested not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {requested}")
        return requested
    if not isinstance(requested, str) or (requested != "auto" and requested.lower() not in _DTYPES):
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {requested!r}")
    if requested != "auto":
        return _DTYPES[requested.lower()]
    dtype = _DTYPES.get(str(checkpoint).replace("torch.", "").lower(), torch.float32)
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    return torch.float32 if device_type == "cpu" else dtype


def _read_json(path: str, *, required: bool) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"{path} not found: the model directory needs a config.json")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    if architectures:
        return architectures[0]
    return _MODEL_TYPE_ARCHITECTURES.get(hf.get("model_type"), f"<model_type {hf.get('model_type')!r}>")


def _rope(text: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either key style. transformers 5 puts rope_theta and the
    scaling keys together in rope_parameters; transformers 4 has rope_theta plus rope_scaling
    (whose type key is "rope_type", or "type" in older files)."""
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    theta = params.pop("rope_theta", text.get("rope_theta", 10000.0))
    scaling = {**scaling, **params}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope scaling needs {missing} in config.json")
    elif "factor" not in scaling:
        raise ValueError(f"{rope_type} rope scaling needs 'factor' in config.json")
    return float(theta), {"rope_type": rope_type, **scaling}


def _sliding_windows(architecture: str, text: dict, num_layers: int) -> tuple[int | None, tuple[int | None, ...]]:
    window = text.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not text.get("use_sliding_window", False):
        window = None
    if architecture == "LlamaForCausalLM" or not window:
        return None, (None,) * num_layers
    window = int(window)
    layer_types = text.get("layer_types")
    if layer_types is None and architecture != "MistralForCausalLM":
        # transformers 4 Qwen2/Qwen3: layers from max_window_layers on slide.
        first = int(text.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        return window, (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers")
    return window, tuple(window if t == "sliding_attention" else None for t in layer_types)


def _ids(value) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)


def _first(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)
