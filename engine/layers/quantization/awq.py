"""AWQ checkpoints (AutoAWQ's GEMM packing, as transformers and vLLM load them): per linear ``qweight``
int32 ``[K, N / 8]`` (8 int4 values of N per word in AWQ's interleaved order 0, 2, 4, 6, 1, 3, 5, 7),
``qzeros`` int32 ``[groups, N / 8]`` packed the same way, ``scales`` ``[groups, N]``.

config.json::

    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
                            "version": "gemm", "modules_to_not_convert": null}

(``w_bit`` / ``q_group_size`` are read too, AutoAWQ's own names.) Supported: 4 bits, zero points, the GEMM
version, group_size -1 or a multiple of 32; layers named in ``modules_to_not_convert`` stay float. Loaded,
each weight converts once into pagedkernels' canonical layout (``awq_to_wq``) and runs on ``wq_gemm``.
Tensor parallelism splits N (packed by 8: each rank's output features must be a multiple of 8) or K
(with its groups: group_size must divide each rank's K).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quantization import register_quantization_config
from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, is_layer_skipped, new_param
from engine.layers.quantization.weight_only import check_kernel_shape, install_wq, scale_dtype_for, wq_apply
from pagedkernels.quant_formats import awq_to_wq

PACK_FACTOR = 8


@register_quantization_config
class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool, modules_to_not_convert: list[str] | None = None):
        if bits != 4:
            raise ValueError(f"AWQ bits={bits!r} is not supported (4 is)")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not (
                group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
            raise ValueError(f"AWQ group_size={group_size!r} is not supported (-1 or a multiple of 32)")
        if not zero_point:
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        self.bits, self.group_size, self.zero_point = bits, group_size, True
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.packed_modules_mapping: dict = {}

    @classmethod
    def from_config(cls, config: dict) -> "AWQConfig":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (the GEMM packing, 'gemm', is)")
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size"))
        if bits is None or group_size is None:
            raise ValueError("AWQ quantization_config needs 'bits' (or 'w_bit') and 'group_size' (or 'q_group_size')")
        return cls(bits, group_size, bool(config.get("zero_point", True)), config.get("modules_to_not_convert"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if ".layers." not in f".{prefix}":   # AutoAWQ quantizes the decoder layers' linears only
            return None
        skip = is_layer_skipped(prefix, lambda name: any(m in name for m in self.modules_to_not_convert),
                                self.packed_modules_mapping)
        return None if skip else AWQLinearMethod(self)


class AWQLinearMethod(LinearMethodBase):
    def __init__(self, config: AWQConfig):
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader) -> None:
        cfg, prefix = self.config, getattr(layer, "prefix", "")
        K, N = input_size_per_partition, sum(output_partition_sizes)
        check_kernel_shape(prefix, "AWQ", K, cfg.group_size)
        for size in output_partition_sizes:
            if size % PACK_FACTOR:
                raise ValueError(f"AWQ layer {prefix}: {size} output features per rank are not a multiple of "
                                 f"{PACK_FACTOR}, the values per packed word")
        groups_split = K != input_size and cfg.group_size != -1
        groups = K // cfg.group_size if groups_split else (1 if cfg.group_size == -1 else input_size // cfg.group_size)
        group_dim = 0 if groups_split else None
        layer.qweight = new_param((K, N // PACK_FACTOR), torch.int32, weight_loader, input_dim=0, output_dim=1,
                                  packed_dim=1, pack_factor=PACK_FACTOR)
        layer.qzeros = new_param((groups, N // PACK_FACTOR), torch.int32, weight_loader, input_dim=group_dim,
                                 output_dim=1, packed_dim=1, pack_factor=PACK_FACTOR)
        layer.scales = new_param((groups, N), params_dtype, weight_loader, input_dim=group_dim, output_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        wq = awq_to_wq(layer.qweight.data, layer.qzeros.data, layer.scales.data, group_size=self.config.group_size,
                       scale_dtype=scale_dtype_for(layer.scales.dtype, layer.scales.dtype))
        install_wq(layer, wq, drop=("qweight", "qzeros", "scales"))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return wq_apply(layer, x, bias)
