"""The quantization seam (vLLM's shape): a :class:`QuantizationConfig` read from config.json's
``quantization_config`` (or asked for with ``quantization=...``) gives each linear layer a
:class:`LinearMethodBase`, which creates the layer's parameters, turns them into what its kernel takes once
the checkpoint is loaded, and computes the layer's product.

Parameters carry what the layer's ``weight_loader`` needs to shard them (:func:`set_weight_attrs`):

- ``output_dim`` / ``input_dim``: the parameter's dims along the layer's output (N) and input (K) features,
  or None when it has none (a bias has no input dim; GPTQ's ``g_idx`` no output dim; a per-tensor scale
  neither). Column-parallel layers split ``output_dim``, row-parallel ones ``input_dim``; a parameter
  without the dim is whole on every rank.
- ``packed_dim`` / ``pack_factor``: that dim holds ``pack_factor`` values per element (GPTQ's qweight packs
  8 int4 values of K per int32, AWQ's of N): shard offsets and sizes along it are divided by the factor.
- ``per_shard_scalar``: one value per checkpoint tensor of a fused layer (an fp8 per-tensor scale of each of
  q, k, v): the loader puts the tensor's one value at the shard's index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn


def set_weight_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    for name, value in attrs.items():
        if hasattr(param, name) and getattr(param, name) != value:
            raise AttributeError(f"parameter already has {name}={getattr(param, name)!r}")
        setattr(param, name, value)
    return param


def new_param(shape, dtype: torch.dtype, weight_loader, *, fill: int | float | None = None,
              **attrs) -> nn.Parameter:
    """A frozen parameter of ``shape`` (on the current default device), its loader and shard attributes set;
    ``fill`` initializes it (else uninitialized memory, which the loader overwrites)."""
    data = torch.empty(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    param = nn.Parameter(data, requires_grad=False)
    attrs.setdefault("output_dim", None)
    attrs.setdefault("input_dim", None)
    return set_weight_attrs(param, weight_loader=weight_loader, **attrs)


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swap a layer's parameter for ``value`` (a frozen parameter, kept on its device), or None."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is None:
        layer.register_parameter(name, None)
    else:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class LinearMethodBase(ABC):
    """How one linear layer stores and multiplies its weight."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader) -> None:
        """Register the layer's weight parameters (everything but the bias) as the checkpoint stores them,
        sized for this rank: ``input_size_per_partition`` input features, ``output_partition_sizes`` output
        features per checkpoint tensor of the layer (one for a plain layer, q/k/v or gate/up for fused ones);
        ``input_size`` / ``output_size`` are the whole layer's."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into what :meth:`apply` takes (runs once, after the checkpoint)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for ``x [..., input_size_per_partition]``."""


class QuantizationConfig(ABC):
    """A quantization format, as one checkpoint's ``quantization_config`` describes it."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict) -> "QuantizationConfig":
        """From config.json's ``quantization_config`` dict; ValueError for what the engine does not run."""

    @classmethod
    def for_unquantized_checkpoint(cls) -> "QuantizationConfig":
        """``quantization=name`` on a checkpoint with no ``quantization_config``: the methods that quantize on
        load (fp8) return their config, the others cannot."""
        raise ValueError(f"quantization={cls.name!r} needs a checkpoint quantized with it (config.json "
                         f"carries a quantization_config); this one is not quantized")

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method of the linear layer named ``prefix`` (its checkpoint name, e.g.
        ``model.layers.0.self_attn.qkv_proj``), or None for an unquantized layer."""

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Model (activation) dtypes the format runs in."""
        return (torch.float32, torch.float16, torch.bfloat16)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def fused_shard_names(prefix: str, packed_modules_mapping: dict) -> list[str]:
    """Checkpoint names of a fused layer's parts (``...qkv_proj`` -> ``...q_proj``, ``...k_proj``,
    ``...v_proj``), or ``[prefix]`` for a layer that is not fused."""
    head, _, last = prefix.rpartition(".")
    parts = [fragment for fragment, (fused, _) in packed_modules_mapping.items() if fused == last]
    if not parts:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def is_layer_skipped(prefix: str, matches, packed_modules_mapping: dict) -> bool:
    """Whether the layer named ``prefix`` stays unquantized: ``matches(name)`` says so for each checkpoint
    name; a fused layer whose parts disagree is an error (one weight cannot be half quantized)."""
    names = fused_shard_names(prefix, packed_modules_mapping)
    skipped = [bool(matches(name)) for name in names]
    if any(skipped) and not all(skipped):
        raise ValueError(f"{prefix}: its parts {names} must all be quantized or all not (got {skipped})")
    return skipped[0]
