"""GGUF-quantized linear layers: the weights of a GGUF model file kept in their blocks.

A GGUF model (``LLM(model="x.gguf")``, engine/gguf_file.py) gets this config whenever its linear tensors are
block-quantized. Each linear's weight arrives from the loader as a :class:`~engine.gguf_file.GGUFTensor`: the
uint8 blocks of one checkpoint tensor (``[N, K / block_values * block_bytes]``) and its block type, one of
``pagedkernels.GGUF_BLOCKS`` (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), or a float tensor (a GGUF may store some linears
as F32/F16/BF16). A file chooses the type per tensor (llama.cpp's Q4_K_M mixes Q4_K and Q6_K within a layer),
so the weight parameter (``qweight``) is sized only when its tensors are in:

- one block type across the layer's checkpoint tensors (q/k/v, gate/up): their rows stacked into one
  ``qweight`` and one GEMM;
- mixed block types: one ``qweight_<i>`` per checkpoint tensor, one GEMM each, outputs concatenated;
- float: a float ``weight`` of the layer's dtype, the unquantized product.

The product is ``pagedkernels.gguf_gemm`` on the blocks: on the CPU llama.cpp's scheme (activations quantized
to int8 per 32 values, integer dot products per block) up to ``NATIVE_MAX_ROWS`` rows, de-quantize + float
GEMM above; on CUDA, Q8_0/Q4_0/Q4_1/Q4_K weights are converted once into pagedkernels' int4/int8 layout
(``quant_formats.gguf_to_wq``, exact) for ``wq_gemm``'s Triton kernels (``gguf_gemm`` there de-quantizes the
whole weight on every call), Q6_K stays on ``gguf_gemm``.

Tensor parallelism: a column-parallel layer keeps its rank's rows of blocks (whole rows: nothing is
de-quantized), a row-parallel layer its rank's part of K in whole blocks; a K per rank that is not a multiple
of the block's values (32, or 256 for the K-quants) is a load-time error naming the layer.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.gguf_file import GGUFTensor
from engine.layers.quantization import register_quantization_config
from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param, replace_param
from pagedkernels import GGUF_BLOCKS, GGUF_INTERLEAVED

# Block types wq_gemm can take exactly (quant_formats.gguf_to_wq); used on CUDA.
WQ_CONVERTIBLE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
# The CPU product: "gguf" (gguf_gemm on the file's blocks, Q4_0/Q4_1 weights of whole groups of 8 rows in
# their 8-row interleaved layout when the native kernels are built: pagedkernels.gguf_interleave), "gguf-rows"
# (the same on the blocks in the file's row layout) or "wq" (converted to the int4/int8 layout for wq_gemm).
# ENGINE_GGUF_CPU_KERNEL chooses; bench/quant_engine_cpu.py measures them.
CPU_KERNELS = ("gguf", "gguf-rows", "wq")
CPU_KERNEL = os.environ.get("ENGINE_GGUF_CPU_KERNEL", "gguf")
if CPU_KERNEL not in CPU_KERNELS:
    raise ValueError(f"ENGINE_GGUF_CPU_KERNEL must be one of {CPU_KERNELS}, got {CPU_KERNEL!r}")


@register_quantization_config
class GGUFConfig(QuantizationConfig):
    """The quantization of a GGUF model file (set by engine/gguf_file.py's config reader, not by config.json)."""

    name = "gguf"

    @classmethod
    def from_config(cls, config: dict) -> "GGUFConfig":
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return GGUFLinearMethod(prefix)


class GGUFLinearMethod(LinearMethodBase):
    """See the module docstring."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    # -- weights ----------------------------------------------------------------------------------------

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader) -> None:
        # A placeholder until the tensors arrive (their block types size it); the loader hands this method's
        # loader GGUFTensors (gguf_blocks=True) instead of float values.
        layer.qweight = new_param((0,), torch.uint8, self._loader(layer), output_dim=0, input_dim=1,
                                  gguf_blocks=True)
        layer.gguf_parts = {}
        layer.gguf_params_dtype = params_dtype

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: GGUFTensor, shard_id=None) -> None:
            if not isinstance(loaded, GGUFTensor):
                raise ValueError(f"GGUF layer {self.prefix or '(unnamed)'} takes a GGUF tensor, got "
                                 f"{type(loaded).__name__}")
            shards = layer.shards
            if shards and shard_id is None:   # a fused tensor in the file: cut it into the layer's shards
                start = 0
                for sid in shards:
                    full = layer.source[sid][0]
                    part = GGUFTensor(loaded.data.narrow(0, start, full), loaded.quant_type,
                                      (full, *loaded.shape[1:]))
                    self._load_part(layer, part, sid)
                    start += full
                if start != loaded.shape[0]:
                    raise ValueError(f"{loaded.shape[0]} rows do not match the fused layer's {start}")
                return
            self._load_part(layer, loaded, shard_id)
        return load

    def _load_part(self, layer: nn.Module, loaded: GGUFTensor, shard_id) -> None:
        """This rank's rows (column-parallel) or K blocks (row-parallel) of one checkpoint tensor."""
        data, quant_type = loaded.data, loaded.quant_type
        rows, cols = loaded.shape
        if layer.shards:
            full, start = layer.source[shard_id]
            size = layer.shards[shard_id][1]
        else:
            full = layer.full_output_size
            size = layer.output_size
            start = layer.tp_rank * size if layer.parallel == "column" else 0
        if rows != full or cols != layer.full_input_size:
            raise ValueError(f"shape {loaded.shape} does not match the layer's [{full}, {layer.full_input_size}]")
        data = data.narrow(0, start, size)
        if layer.parallel == "row" and layer.tp_size > 1:
            k_local = layer.input_size
            if quant_type is None:
                data = data.narrow(1, layer.tp_rank * k_local, k_local)
            else:
                values, nbytes = GGUF_BLOCKS[quant_type]
                if k_local % values:
                    raise ValueError(f"GGUF layer {self.prefix or '(unnamed)'}: {k_local} input features per rank "
                                     f"(tensor_parallel_size={layer.tp_size}) are not whole {quant_type} blocks of "
                                     f"{values} values; a row-parallel split must keep blocks whole")
                local_bytes = k_local // values * nbytes
                data = data.narrow(1, layer.tp_rank * local_bytes, local_bytes)
        if quant_type is None:
            data = data.to(layer.gguf_params_dtype)
        layer.gguf_parts[shard_id] = (quant_type, data.to(layer.qweight.device).contiguous())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        order = list(layer.shards) if layer.shards else [None]
        missing = [sid for sid in order if sid not in layer.gguf_parts]
        if missing:
            raise ValueError(f"GGUF layer {self.prefix or '(unnamed)'}: shards {missing} were never loaded")
        parts = [layer.gguf_parts[sid] for sid in order]
        del layer.gguf_parts
        types = {quant_type for quant_type, _ in parts}
        replace_param(layer, "qweight", None)
        layer.gguf_mode, layer.gguf_types, layer.gguf_split = None, [], 0
        device = parts[0][1].device
        if types == {None}:   # every tensor float: the unquantized product
            replace_param(layer, "weight", torch.cat([data for _, data in parts]))
            layer.gguf_mode = "float"
            return
        if len(types) == 1:
            (quant_type,) = types
            qweight = torch.cat([data for _, data in parts])
            if quant_type in WQ_CONVERTIBLE and (device.type == "cuda" or CPU_KERNEL == "wq"):
                self._install_wq(layer, qweight, quant_type)
                return
            qweight, quant_type = _cpu_layout(qweight, quant_type)
            replace_param(layer, "qweight", qweight)
            layer.gguf_mode, layer.gguf_types = "gguf", [quant_type]
            return
        # Mixed block types (or some float tensors): one product per checkpoint tensor.
        layer.gguf_mode, layer.gguf_split = "split", len(parts)
        for i, (quant_type, data) in enumerate(parts):
            if quant_type is not None:
                data, quant_type = _cpu_layout(data, quant_type)
            replace_param(layer, f"qweight_{i}", data)
            layer.gguf_types.append(quant_type)

    @staticmethod
    def _install_wq(layer: nn.Module, qweight: torch.Tensor, quant_type: str) -> None:
        from engine.layers.quantization.weight_only import install_wq
        from pagedkernels.quant_formats import gguf_to_wq

        wq = gguf_to_wq(qweight, quant_type)   # float32 scales and zero points: exact
        if layer.gguf_params_dtype != torch.float32:
            wq.scales = wq.scales.to(layer.gguf_params_dtype)
            wq.zeros = None if wq.zeros is None else wq.zeros.to(layer.gguf_params_dtype)
        install_wq(layer, wq, drop=())
        layer.gguf_mode, layer.gguf_types = "wq", [quant_type]

    # -- product ------------------------------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from engine.layers import pk_ops

        mode = layer.gguf_mode
        if mode == "float":
            from engine.layers.quantization.unquantized import linear
            return linear(x, layer.weight, bias)
        if mode == "wq":
            from engine.layers.quantization.weight_only import wq_apply
            return wq_apply(layer, x, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        ops = pk_ops()
        if mode == "gguf":
            out = ops.gguf_gemm(x2, layer.qweight, layer.gguf_types[0])
        else:
            outs = []
            for i, quant_type in enumerate(layer.gguf_types):
                weight = getattr(layer, f"qweight_{i}")
                if quant_type is None:
                    from engine.layers.quantization.unquantized import linear
                    outs.append(linear(x2, weight))
                else:
                    outs.append(ops.gguf_gemm(x2, weight, quant_type))
            out = torch.cat(outs, dim=-1)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])



def _cpu_layout(qweight: torch.Tensor, quant_type: str) -> tuple[torch.Tensor, str]:
    """The layout gguf_gemm runs fastest on for this weight: on the CPU with the native kernels, Q4_0/Q4_1/Q8_0
    weights of whole groups of 8 rows interleaved (``"Q4_0x8"``/``"Q4_1x8"``/``"Q8_0x8"``: Q4 1.7-2.2x the row
    layout's GEMM at one activation row, 2.3-4x at four, measured on the 2-core EPYC); everything else as the file
    has it."""
    from pagedkernels import gguf_interleave
    from pagedkernels._backend import _native_library_built

    if (CPU_KERNEL == "gguf" and quant_type in GGUF_INTERLEAVED.values() and qweight.device.type == "cpu"
            and qweight.shape[0] % 8 == 0 and _native_library_built()):
        return gguf_interleave(qweight, quant_type), quant_type + "x8"
    return qweight, quant_type


class GGUFLMHeadMethod(LinearMethodBase):
    """The LM head of a GGUF model on the file's blocks (``output.weight``, or ``token_embd.weight`` when the
    embeddings are tied: the embedding itself keeps de-quantized float rows for its lookups). At one row per
    sequence the head is the largest product of a small model's decode step (SmolLM2-135M: 49152 x 576), and
    its blocks are a quarter (Q8_0) of the float32 weight's bytes. Installed by :func:`install_gguf_lm_head`."""

    def __init__(self, quant_type: str):
        self.quant_type = quant_type

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader) -> None:
        raise TypeError("the GGUF LM head is installed on a loaded LMHead (install_gguf_lm_head), not created")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from engine.layers import pk_ops

        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = pk_ops().gguf_gemm(x2, layer.gguf_qweight, self.quant_type)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _rank_rows(module: nn.Module, tensor: GGUFTensor) -> torch.Tensor:
    """This vocab-parallel rank's rows of blocks (``num_rows`` from ``vocab_start``), zero rows past the
    vocabulary (zero scales: zero values)."""
    rows = tensor.data.narrow(0, module.vocab_start, min(module.num_rows, tensor.shape[0] - module.vocab_start))
    blocks = torch.zeros(module.num_rows, rows.shape[1], dtype=torch.uint8, device=module.weight.device)
    blocks[:rows.shape[0]] = rows.to(blocks.device)
    return blocks


def install_gguf_embedding(embedding: nn.Module, tensor: GGUFTensor, shared: torch.Tensor | None = None,
                           shared_type: str | None = None) -> bool:
    """Make a VocabEmbedding look its rows up in ``tensor``'s blocks (de-quantizing only the rows it gathers);
    ``shared``: the same blocks already installed on the tied LM head, in its layout ``shared_type`` (an
    interleaved one gathers whole groups of 8 rows: ``pagedkernels.gguf_take_rows``). Returns False for a float
    tensor or a block type pagedkernels does not de-quantize. The caller frees the float weight."""
    if tensor.quant_type not in GGUF_BLOCKS:
        return False
    embedding.gguf_qweight = shared if shared is not None else _rank_rows(embedding, tensor)
    embedding.gguf_type = shared_type if shared is not None and shared_type else tensor.quant_type
    embedding.gguf_dtype = embedding.weight.dtype
    return True


def install_gguf_lm_head(head: nn.Module, tensor: GGUFTensor) -> bool:
    """Make ``head`` (an LMHead, vocab-parallel: this rank's ``num_rows`` rows from ``vocab_start``, zero rows
    past the vocabulary) multiply ``tensor``'s blocks. Returns False (the head stays float) for a float tensor
    or a block type gguf_gemm does not take. An untied head's float weight is freed."""
    if tensor.quant_type not in GGUF_BLOCKS:
        return False
    # a buffer; padding rows give zero logits, cut after the gather
    head.gguf_qweight, quant_type = _cpu_layout(_rank_rows(head, tensor), tensor.quant_type)
    head.quant_method = GGUFLMHeadMethod(quant_type)
    return True
