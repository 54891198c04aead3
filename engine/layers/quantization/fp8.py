"""FP8 (e4m3) weights: checkpoints that store them, and ``quantization="fp8"`` applied on load.

Checkpoints (per linear ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32, with a static
activation scheme ``input_scale``):

- vLLM's / AutoFP8's ``"quant_method": "fp8"`` (``activation_scheme`` "static" or "dynamic",
  ``ignored_layers``): one weight scale per tensor. Block-wise scales (``weight_block_size``) are not
  supported.
- compressed-tensors (llm-compressor) ``"quant_method": "compressed-tensors"`` with fp8 schemes: every
  ``config_groups`` entry's weights ``{"num_bits": 8, "type": "float", "strategy": "tensor" | "channel"}``
  (``weight_scale`` ``[1]`` or ``[N, 1]``), input activations None (weight only), dynamic per token, or
  static per tensor; targets "Linear" or layer names / ``re:`` patterns; ``ignore`` the same. Other schemes
  (int4/int8 packed, block or group fp8) are a ValueError naming what the scheme is.

``quantization="fp8"`` on a float checkpoint: each linear weight is loaded in the model dtype, then
quantized to e4m3 with one scale per output channel (``quantize_fp8_weight``).

The product is ``pagedkernels.fp8_gemm``: on GPUs with fp8 tensor cores (compute capability 8.9+) the
activation is quantized too, dynamically per token (or with the checkpoint's static input scale), on
``torch._scaled_mm``; elsewhere (the CPU, Ampere) it is weight-only. Fused layers (q/k/v, gate/up) whose
checkpoint tensors each have their own per-tensor scale keep them as a per-output-channel scale (exact); a
static input scale per shard becomes their maximum, as vLLM does.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.layers.quantization import register_quantization_config
from engine.layers.quantization.base import (LinearMethodBase, QuantizationConfig, is_layer_skipped, new_param,
                                             replace_param)
from pagedkernels.fp8_gemm import quantize_fp8_weight

FP8 = torch.float8_e4m3fn


class Fp8LinearMethod(LinearMethodBase):
    """``weight`` e4m3 ``[N, K]`` times ``weight_scale`` (float32, ``[1]`` per tensor or ``[N]`` per channel
    once processed); ``input_scale`` ``[1]`` for a static activation scheme, else None."""

    def __init__(self, *, serialized: bool, per_channel: bool, static_input: bool):
        self.serialized, self.per_channel, self.static_input = serialized, per_channel, static_input

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader) -> None:
        N, K = sum(output_partition_sizes), input_size_per_partition
        layer.fp8_partition_sizes = list(output_partition_sizes)
        if not self.serialized:   # quantized after loading
            layer.weight = new_param((N, K), params_dtype, weight_loader, output_dim=0, input_dim=1)
            return
        layer.weight = new_param((N, K), FP8, weight_loader, output_dim=0, input_dim=1)
        if self.per_channel:
            layer.weight_scale = new_param((N, 1), torch.float32, _column_loader(weight_loader), output_dim=0)
        else:
            layer.weight_scale = new_param((len(output_partition_sizes),), torch.float32, weight_loader,
                                           per_shard_scalar=True)
        if self.static_input:
            layer.input_scale = new_param((len(output_partition_sizes),), torch.float32, weight_loader,
                                          per_shard_scalar=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            weight, scale = quantize_fp8_weight(layer.weight.data, per_channel=True)
            replace_param(layer, "weight", weight)
            replace_param(layer, "weight_scale", scale)
            replace_param(layer, "input_scale", None)
            return
        scale = layer.weight_scale.data
        if self.per_channel:
            scale = scale.reshape(-1)
        elif scale.numel() > 1:   # one scale per fused checkpoint tensor: per output channel (exact)
            sizes = torch.tensor(layer.fp8_partition_sizes, device=scale.device)
            scale = torch.repeat_interleave(scale, sizes)
        replace_param(layer, "weight_scale", scale.float().contiguous())
        input_scale = getattr(layer, "input_scale", None)
        replace_param(layer, "input_scale", None if input_scale is None else input_scale.data.max().reshape(1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from engine.layers import pk_ops

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = pk_ops().fp8_gemm(x2, layer.weight, layer.weight_scale, act_scale=layer.input_scale)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


def _column_loader(weight_loader):
    """A per-channel scale stored ``[N, 1]`` (compressed-tensors) or ``[N]``: loaded as ``[N, 1]``."""
    def load(param, loaded, shard_id=None):
        weight_loader(param, loaded.reshape(-1, 1) if loaded.dim() == 1 else loaded, shard_id)
    return load


@register_quantization_config
class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, *, serialized: bool, activation_scheme: str = "dynamic", ignored_layers=None):
        if activation_scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 activation_scheme={activation_scheme!r} is not supported ('static', 'dynamic')")
        if not serialized and activation_scheme != "dynamic":
            raise ValueError("fp8 quantization on load has no activation scales to use: activation_scheme "
                             "must be 'dynamic'")
        self.serialized, self.activation_scheme = serialized, activation_scheme
        self.ignored_layers = list(ignored_layers or [])
        self.packed_modules_mapping: dict = {}

    @classmethod
    def from_config(cls, config: dict) -> "Fp8Config":
        if config.get("weight_block_size") is not None:
            raise ValueError(f"fp8 with block-wise weight scales (weight_block_size="
                             f"{config['weight_block_size']}) is not supported (per-tensor and per-channel are)")
        return cls(serialized="fp8" in str(config.get("quant_method", "fp8")).lower(),
                   activation_scheme=str(config.get("activation_scheme", "dynamic")),
                   ignored_layers=config.get("ignored_layers"))

    @classmethod
    def for_unquantized_checkpoint(cls) -> "Fp8Config":
        return cls(serialized=False)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if is_layer_skipped(prefix, lambda name: name in self.ignored_layers, self.packed_modules_mapping):
            return None
        return Fp8LinearMethod(serialized=self.serialized, per_channel=False,
                               static_input=self.serialized and self.activation_scheme == "static")


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@register_quantization_config
class CompressedTensorsConfig(QuantizationConfig):
    """compressed-tensors' fp8 schemes (see the module docstring)."""

    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], bool, bool]], ignore: list[str]):
        self.groups = groups  # (targets, per_channel weight scales, static input scale)
        self.ignore = ignore
        self.packed_modules_mapping: dict = {}

    @classmethod
    def from_config(cls, config: dict) -> "CompressedTensorsConfig":
        fmt = config.get("format")
        if fmt not in ("float-quantized", "naive-quantized", None):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (fp8 checkpoints: "
                             f"'float-quantized' / 'naive-quantized')")
        # kv_cache_scheme (fp8 KV-cache scales) is the cache's (engine/config.py's check_kv_cache_scheme, the
        # loader's k/v scales): a checkpoint with only that quantizes no linear.
        groups_cfg = config.get("config_groups")
        if groups_cfg is None and config.get("kv_cache_scheme") is not None:
            return cls([], list(config.get("ignore") or []))
        if not isinstance(groups_cfg, dict) or not groups_cfg:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        groups = []
        for name, group in groups_cfg.items():
            weights, acts = group.get("weights") or {}, group.get("input_activations")
            if not (weights.get("num_bits") == 8 and weights.get("type") == "float"):
                raise ValueError(f"config_groups.{name}: weights {weights.get('type')} with "
                                 f"{weights.get('num_bits')} bits are not supported (fp8: 8-bit float is)")
            strategy = weights.get("strategy")
            if strategy not in ("tensor", "channel") or weights.get("dynamic"):
                raise ValueError(f"config_groups.{name}: fp8 weight strategy {strategy!r} is not supported "
                                 f"('tensor' and 'channel' are)")
            if weights.get("symmetric") is False:
                raise ValueError(f"config_groups.{name}: asymmetric fp8 weights are not supported")
            static = False
            if acts is not None:
                if not (acts.get("num_bits") == 8 and acts.get("type") == "float"):
                    raise ValueError(f"config_groups.{name}: input activations {acts.get('type')} with "
                                     f"{acts.get('num_bits')} bits are not supported (fp8 is)")
                a_strategy = acts.get("strategy")
                if acts.get("dynamic") and a_strategy == "token":
                    static = False
                elif not acts.get("dynamic") and a_strategy == "tensor":
                    static = True
                else:
                    raise ValueError(f"config_groups.{name}: fp8 activations with strategy {a_strategy!r}, "
                                     f"dynamic={acts.get('dynamic')!r} are not supported (dynamic per token, "
                                     f"static per tensor)")
            targets = group.get("targets") or []
            if not isinstance(targets, list) or not targets:
                raise ValueError(f"config_groups.{name} has no targets")
            groups.append((list(targets), strategy == "channel", static))
        return cls(groups, list(config.get("ignore") or []))

    def _group_of(self, name: str):
        if any(_matches(t, name) for t in self.ignore):
            return None
        for targets, per_channel, static in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets):
                return per_channel, static
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        from engine.layers.quantization.base import fused_shard_names

        if is_layer_skipped(prefix, lambda name: self._group_of(name) is None, self.packed_modules_mapping):
            return None
        schemes = {self._group_of(name) for name in fused_shard_names(prefix, self.packed_modules_mapping)}
        if len(schemes) != 1:
            raise ValueError(f"{prefix}: its parts are in different config_groups schemes {sorted(schemes)}; "
                             f"a fused layer needs one")
        per_channel, static = schemes.pop()
        return Fp8LinearMethod(serialized=True, per_channel=per_channel, static_input=static)
