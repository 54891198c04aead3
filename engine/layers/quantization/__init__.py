"""Quantized linear layers: one :class:`QuantizationConfig` per format, chosen by config.json's
``quantization_config`` (its ``quant_method``) or ``LLM(quantization=...)`` / ``--quantization``.

Formats (each in its own module, registered by name below): ``gptq`` (4/8-bit, any group size, act-order,
symmetric or not), ``awq`` (4-bit GEMM packing), ``fp8`` (vLLM's fp8 checkpoints, and fp8 applied on load
to a float checkpoint), ``compressed-tensors`` (its fp8 schemes). Other formats register themselves with
:func:`register_quantization_config`.
"""

from __future__ import annotations

from torch import nn

from engine.layers.quantization.base import (LinearMethodBase, QuantizationConfig, fused_shard_names,
                                             is_layer_skipped, new_param, replace_param, set_weight_attrs)
from engine.layers.quantization.unquantized import UnquantizedLinearMethod, prepack_linears

__all__ = ["QuantizationConfig", "LinearMethodBase", "UnquantizedLinearMethod", "register_quantization_config",
           "get_quantization_config", "resolve_quant_config", "process_weights_after_loading", "prepack_linears",
           "QUANTIZATION_METHODS", "new_param", "replace_param", "set_weight_attrs", "fused_shard_names",
           "is_layer_skipped"]

_REGISTRY: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    """Class decorator: make ``cls`` the config of ``quant_method == cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"quantization method {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    from engine.layers.quantization import awq, fp8, gguf, gptq  # noqa: F401  (they register themselves)


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    _load_builtin()
    key = str(name).lower()
    if key not in _REGISTRY:
        raise ValueError(f"quantization method {name!r} is not supported (supported: "
                         f"{', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[key]


def quantization_methods() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_REGISTRY))


QUANTIZATION_METHODS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq")  # the built-in ones (the CLI's help)


def resolve_quant_config(hf_config: dict, quantization: str | None, *,
                         packed_modules_mapping: dict | None = None,
                         model_dir: str = "the model directory") -> QuantizationConfig | None:
    """The model's quantization: config.json's ``quantization_config`` (its ``quant_method``), or
    ``quantization`` asked for by the user. Both given must agree (vLLM's rule); ``quantization`` alone
    quantizes a float checkpoint on load where the method can (fp8). None: unquantized."""
    if quantization is not None and not isinstance(quantization, str):
        raise ValueError(f"quantization must be a method name or None, got {quantization!r}")
    text = hf_config.get("text_config", {}) if isinstance(hf_config.get("text_config"), dict) else {}
    hf_quant = hf_config.get("quantization_config", text.get("quantization_config"))
    if hf_quant is not None and not isinstance(hf_quant, dict):
        raise ValueError(f"{model_dir}/config.json: quantization_config must be an object, got {hf_quant!r}")
    if hf_quant is not None and "quant_method" not in hf_quant and set(hf_quant) <= {"kv_cache_scheme"}:
        hf_quant = None   # only an fp8 KV-cache scheme (the cache config checks it): no linear is quantized
    if hf_quant is None and quantization is None:
        return None
    if hf_quant is not None:
        method = hf_quant.get("quant_method")
        if not isinstance(method, str):
            raise ValueError(f"{model_dir}/config.json: quantization_config has no quant_method")
        method = method.lower()
        if quantization is not None and quantization.lower() != method:
            raise ValueError(f"quantization={quantization!r} was asked for, but {model_dir} is quantized with "
                             f"{method!r} (config.json's quantization_config); leave quantization unset or "
                             f"pass {method!r}")
        try:
            config = get_quantization_config(method).from_config(hf_quant)
        except ValueError as e:
            raise ValueError(f"{model_dir}/config.json: quantization_config: {e}") from e
    else:
        config = get_quantization_config(quantization).for_unquantized_checkpoint()
    config.packed_modules_mapping = dict(packed_modules_mapping or {})
    return config


def process_weights_after_loading(model: nn.Module, *, prepack: bool = False) -> None:
    """Run every layer's ``quant_method.process_weights_after_loading`` once the checkpoint is in (and that of
    the layers that carry their own, the MoE experts: engine/layers/fused_moe.py); then, with ``prepack``,
    reorder the unquantized float32 CPU weights for oneDNN (:func:`prepack_linears`)."""
    from engine.layers.fused_moe import FusedMoE

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethodBase):
            method.process_weights_after_loading(module)
        elif isinstance(module, FusedMoE):
            module.process_weights_after_loading()
    if prepack:
        prepack_linears(model)
