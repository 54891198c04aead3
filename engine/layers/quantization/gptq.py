"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), as published: per linear ``qweight`` int32
``[K * bits / 32, N]`` (packed along K), ``qzeros`` int32 ``[groups, N * bits / 32]`` (packed along N),
``scales`` ``[groups, N]`` and ``g_idx`` int32 ``[K]`` (each input column's group).

config.json::

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
                            "sym": true, "checkpoint_format": "gptq", ...}

Supported: bits 4 and 8; group_size -1 (one group per output column) or a multiple of 32 (the GEMM's
block); ``desc_act`` (act-order) false and true; symmetric and asymmetric; checkpoint formats ``gptq``
(zero points stored minus one, AutoGPTQ's) and ``gptq_v2``. Loaded, each weight converts once into
pagedkernels' canonical layout (``gptq_to_wq``) and runs on ``wq_gemm``.

Tensor parallelism: a column-parallel layer splits N (qweight's columns, qzeros' packed columns, scales'
columns); a row-parallel layer splits K (qweight's packed rows, g_idx) and the groups with it, so
group_size must divide each rank's K. Act-order in a row-parallel layer: a rank's columns belong to any of
the layer's groups (g_idx is a permutation's grouping), so every rank keeps all the groups' scales and zero
points and regroups its own columns: sorted by group, each group's run padded with zero-weight columns to a
multiple of 32, one scale per 32 columns (its group's). The padded columns gather a zero activation, so
the product is exactly that of the rank's columns; the cost is up to 31 padding columns per group (vLLM
instead falls back to a kernel without act-order support here).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quantization import register_quantization_config
from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param
from engine.layers.quantization.weight_only import check_kernel_shape, install_wq, scale_dtype_for, wq_apply
from pagedkernels.quant_formats import WQWeight, _unpack_int32, gptq_to_wq, pack_int4


def _get(config: dict, keys: tuple[str, ...], default=None):
    for key in keys:
        if key in config:
            return config[key]
    return default


@register_quantization_config
class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq"):
        if isinstance(bits, bool) or bits not in (4, 8):
            raise ValueError(f"GPTQ bits={bits!r} is not supported (4 and 8 are)")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not (
                group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
            raise ValueError(f"GPTQ group_size={group_size!r} is not supported (-1 or a multiple of 32)")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format={checkpoint_format!r} is not supported ('gptq' and "
                             f"'gptq_v2' are; re-save a Marlin/BitBLAS checkpoint in the GPTQ format)")
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, bool(desc_act), bool(sym)
        self.checkpoint_format = checkpoint_format
        self.pack_factor = 32 // bits
        self.packed_modules_mapping: dict = {}

    @classmethod
    def from_config(cls, config: dict) -> "GPTQConfig":
        if config.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head (lm_head: true) is not supported")
        if config.get("dynamic"):
            raise ValueError("GPTQModel's per-module 'dynamic' overrides are not supported")
        if "bits" not in config or "group_size" not in config:
            raise ValueError("GPTQ quantization_config needs 'bits' and 'group_size'")
        fmt = _get(config, ("checkpoint_format", "format"), "gptq")
        return cls(config["bits"], config["group_size"], bool(config.get("desc_act", False)),
                   bool(config.get("sym", True)), str(fmt).lower())

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        # AutoGPTQ / GPTQModel quantize the linears inside the decoder layers only (not OPT's project_in/out).
        return GPTQLinearMethod(self) if ".layers." in f".{prefix}" else None


class GPTQLinearMethod(LinearMethodBase):
    def __init__(self, config: GPTQConfig):
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader) -> None:
        cfg, prefix = self.config, getattr(layer, "prefix", "")
        K, N, pf = input_size_per_partition, sum(output_partition_sizes), cfg.pack_factor
        check_kernel_shape(prefix, "GPTQ", K, cfg.group_size)
        for size in output_partition_sizes:
            if size % pf:
                raise ValueError(f"GPTQ layer {prefix}: {size} output features per rank are not a multiple of "
                                 f"{pf}, the values per packed qzeros word")
        row_sharded = K != input_size
        group = input_size if cfg.group_size == -1 else cfg.group_size
        # Groups split with K, except one group per column (every rank shares it) and act-order across ranks
        # (each rank's columns come from any group): then every rank keeps all groups.
        groups_split = row_sharded and cfg.group_size != -1 and not cfg.desc_act
        groups = K // group if groups_split else input_size // group
        group_dim = 0 if groups_split else None
        layer.qweight = new_param((K // pf, N), torch.int32, weight_loader, input_dim=0, output_dim=1,
                                  packed_dim=0, pack_factor=pf)
        layer.qzeros = new_param((groups, N // pf), torch.int32, weight_loader, input_dim=group_dim, output_dim=1,
                                 packed_dim=1, pack_factor=pf)
        layer.scales = new_param((groups, N), params_dtype, weight_loader, input_dim=group_dim, output_dim=1)
        # Each input column's group (global numbering), as the checkpoint stores it; without act-order the
        # checkpoint's (optional) copy must match k // group_size.
        first = layer.tp_rank * K if row_sharded else 0
        default = (torch.arange(first, first + K, dtype=torch.int32) // group).to(torch.int32)
        layer.g_idx = new_param((K,), torch.int32, weight_loader, input_dim=0, output_dim=None)
        layer.g_idx.data.copy_(default)
        layer.g_idx.optional_in_checkpoint = not cfg.desc_act
        layer.gptq_first_group = first // group if groups_split else 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cfg = self.config
        K = layer.g_idx.shape[0]
        scale_dtype = scale_dtype_for(layer.scales.dtype, layer.scales.dtype)
        groups = layer.scales.shape[0]
        g_idx = layer.g_idx.data.long() - layer.gptq_first_group
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"GPTQ layer {layer.prefix}: g_idx holds groups outside [0, {groups}) of this rank")
        pad_perm = None
        if groups * (K if cfg.group_size == -1 else cfg.group_size) == K:
            # This rank's K holds whole groups: the format's own conversion (act-order gives perm).
            wq = gptq_to_wq(layer.qweight.data, layer.qzeros.data, layer.scales.data, bits=cfg.bits,
                            group_size=cfg.group_size, g_idx=g_idx if cfg.desc_act else None,
                            checkpoint_format=cfg.checkpoint_format, scale_dtype=scale_dtype)
            if not cfg.desc_act and not torch.equal(g_idx, torch.arange(K, device=g_idx.device) // (
                    K if cfg.group_size == -1 else cfg.group_size)):
                raise ValueError(f"GPTQ layer {layer.prefix}: g_idx is not in order but desc_act is false")
        else:
            wq, pad_perm = _regroup_act_order_shard(layer.qweight.data, layer.qzeros.data, layer.scales.data, g_idx,
                                                    cfg.bits, cfg.checkpoint_format, scale_dtype)
        install_wq(layer, wq, drop=("qweight", "qzeros", "scales", "g_idx"), pad_perm=pad_perm)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return wq_apply(layer, x, bias)


def _regroup_act_order_shard(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                             bits: int, checkpoint_format: str, scale_dtype: torch.dtype) -> tuple[WQWeight, torch.Tensor]:
    """One rank's columns of an act-order GPTQ weight (all of the layer's groups' scales and zero points) as a
    canonical weight with 32-column groups: columns sorted by group, each group's run padded with zero
    columns to a multiple of 32. Returns it and ``pad_perm`` [K'] (the x column of each canonical column;
    K, one past the rank's columns, for padding: the caller appends a zero column there)."""
    K, N = g_idx.shape[0], scales.shape[1]
    device = qweight.device
    q = _unpack_int32(qweight, bits, dim=0)  # [K, N]
    z = _unpack_int32(qzeros, bits, dim=1)  # [groups, N]
    if checkpoint_format == "gptq":
        z = (z + 1) & (2 ** bits - 1)
    order = torch.sort(g_idx, stable=True).indices
    counts = torch.bincount(g_idx, minlength=scales.shape[0])
    padded = (counts + 31) // 32 * 32
    starts = torch.cumsum(padded, 0) - padded  # first canonical column of each group
    sorted_groups = g_idx[order]
    run_starts = torch.cumsum(counts, 0) - counts
    dest = starts[sorted_groups] + (torch.arange(K, device=device) - run_starts[sorted_groups])
    total = int(padded.sum())
    pad_perm = torch.full((total,), K, dtype=torch.int64, device=device)
    pad_perm[dest] = order
    q_pad = torch.zeros(total, N, dtype=torch.int32, device=device)
    q_pad[dest] = q[order]
    block_group = torch.repeat_interleave(torch.arange(scales.shape[0], device=device), padded // 32)
    s = scales[block_group].t().contiguous().to(scale_dtype)  # [N, total / 32]
    zeros = None if bool((z == 2 ** (bits - 1)).all()) else z[block_group].t().contiguous().to(scale_dtype)
    q_nk = q_pad.t().contiguous().to(torch.uint8)
    return WQWeight(pack_int4(q_nk) if bits == 4 else q_nk, s, zeros, bits, 32), pad_perm
