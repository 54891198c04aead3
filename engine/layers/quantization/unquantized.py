"""The unquantized linear method: a float ``[N, K]`` weight, and on the CPU oneDNN's prepacked copy of it."""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quantization.base import LinearMethodBase, new_param
from engine.platform import DevicePolicy


def _onednn_linear_op():
    """``torch.ops.mkldnn._linear_pointwise`` where this torch build has it, else None."""
    if os.environ.get("ENGINE_CPU_LINEAR", "onednn") != "onednn" or not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN_LINEAR = _onednn_linear_op()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except float32 on CPU in eager mode, which goes straight to oneDNN's inner product.

    torch's CPU float32 ``F.linear`` calls the BLAS it was built with (MKL in the PyPI wheels), which
    takes a slow code path on AMD CPUs; oneDNN's kernels are 1.5-3x faster at the engine's shapes
    (measured on a 2-core AMD EPYC with torch 2.13: [48, 576] x [576, 1536] 0.38 ms against 0.78 ms,
    the 49152-row LM head for one token 3.5 ms against 11.4 ms). bf16 ``F.linear`` already uses oneDNN.
    Under ``torch.compile`` inductor picks its own GEMM, so this stays ``F.linear`` there.
    ``ENGINE_CPU_LINEAR=torch`` turns the oneDNN path off.
    """
    if _onednn_applies(x) and weight.dtype == torch.float32:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_applies(x: torch.Tensor) -> bool:
    return (_ONEDNN_LINEAR is not None and x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling())


def _onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX512BW/VL/DQ or AVX-NE-CONVERT: its bf16 weight reorder refuses
    others) and the oneDNN path is on."""
    return _ONEDNN_LINEAR is not None and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _cpu_eager(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


# Rows up to which a float32 CPU product takes the weight's 16-bit copy (pagedkernels.w16_gemm) when the layer
# has one: a decode step's product is bound by the weight's bytes up to a few dozen rows, and the 16-bit copy
# halves them. Measured on a 2-core AMD EPYC (AVX-512, torch 2.13), weights cold as in a step: 2.5-4x faster than
# oneDNN's prepacked float32 product at 1 row, level or ahead to 48-64 rows at SmolLM2's layer shapes, behind
# beyond (compute-bound); over the 48-request workload (decode steps of up to 48 rows) thresholds 0 / 4 / 32 / 64
# gave 258 / 261 / 268 / 278 output tok/s.
W16_MAX_ROWS = 64


def _w16_enabled() -> bool:
    return os.environ.get("ENGINE_CPU_W16", "1").strip() not in ("0", "false", "False")


# Rows up to which a bf16 CPU product takes the layer's panel-packed copy instead of oneDNN's prepacked bf16 one, by
# the CPU's bf16 arithmetic (engine/platform.py, DevicePolicy.cpu_bf16_w16_max_rows); None: every row. The products
# of a decode step's CPU graph follow BF16_W16_GRAPH_MAX_ROWS (DevicePolicy.cpu_bf16_w16_graph_max_rows) instead.
_CPU_POLICY = DevicePolicy.for_device("cpu")
BF16_W16_MAX_ROWS = _CPU_POLICY.cpu_bf16_w16_max_rows
BF16_W16_GRAPH_MAX_ROWS = _CPU_POLICY.cpu_bf16_w16_graph_max_rows
_recording = threading.local()


@contextlib.contextmanager
def recording_decode_graph():
    """Within: the forward being run is a decode step's CPU graph being recorded (warm-up run included), whose bf16
    products follow :data:`BF16_W16_GRAPH_MAX_ROWS`."""
    previous = getattr(_recording, "decode_graph", False)
    _recording.decode_graph = True
    try:
        yield
    finally:
        _recording.decode_graph = previous


_amx_limits_settled = False


def _settle_amx_limits() -> None:
    """Once the native kernels are built: on an AMX CPU whose build cannot use the tiles, the limits of the pair dot
    products alone (engine/platform.py)."""
    global BF16_W16_MAX_ROWS, BF16_W16_GRAPH_MAX_ROWS, _amx_limits_settled
    from pagedkernels import _native

    if _amx_limits_settled or _native.library() is None:
        return
    _amx_limits_settled = True
    if _CPU_POLICY.cpu_bf16_isa == "amx-bf16" and not _native.w16_amx()[0]:
        from engine.platform import _cpu_bf16_w16_max_rows

        BF16_W16_MAX_ROWS = _cpu_bf16_w16_max_rows("amx-bf16", amx_tiles=False)
        BF16_W16_GRAPH_MAX_ROWS = _cpu_bf16_w16_max_rows("amx-bf16", graphs=True, amx_tiles=False)


def bf16_w16_max_rows() -> int | None:
    """The row limit of a bf16 product's panel path here and now (None: every row)."""
    return BF16_W16_GRAPH_MAX_ROWS if getattr(_recording, "decode_graph", False) else BF16_W16_MAX_ROWS


def exact_16bit_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """bfloat16 or float16 if every value of the float32 ``weight`` is one of that type's (a 16-bit
    checkpoint loaded as float32), else None."""
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(weight.to(dtype).float(), weight):
            return dtype
    return None


# Batch size oneDNN tunes a prepacked weight's layout for. It matters little (16-128 measured within a
# few percent of each other at 1-1024 rows); 32 is what vLLM's CPU backend passes.
PREPACK_BATCH_HINT = 32


class UnquantizedLinearMethod(LinearMethodBase):
    """``weight [N, K]`` in the model dtype, multiplied by :func:`linear`.

    On the CPU a float32 weight can be reordered once into oneDNN's blocked layout (:meth:`prepack`), so
    the inner product does not repack the plain weight on every call: 1.3-2.5x faster at 8-48 rows, the
    decode batches (measured on a 2-core AMD EPYC: [48, 576] x [576, 3072] 0.44 ms against 0.73 ms, the LM
    head for one token 2.6 ms against 5.1 ms), equal for single rows and long prefills. The packed weight
    lives on the layer as ``packed_weight`` (None until packed).

    A float32 weight whose values are all bf16 (or fp16) ones, as a 16-bit checkpoint's are, also gets a
    16-bit copy in ``pagedkernels.w16_gemm``'s layout (``w16_weight``): products of up to
    :data:`W16_MAX_ROWS` rows (decode steps) read it instead, half the bytes, the same values and float32
    arithmetic. ``ENGINE_CPU_W16=0`` turns it off.

    A bf16 weight on the CPU (a bf16 model) gets both as well: oneDNN's prepacked bf16 copy (AMX tiles where the CPU
    has them) for prefills and large decode batches, where oneDNN multiplies bf16 at all, and the panel-packed copy
    for products of up to :data:`BF16_W16_MAX_ROWS` rows (in a decode step's CPU graph :data:`BF16_W16_GRAPH_MAX_ROWS`;
    every product where oneDNN has no bf16): bf16 in and out, float32 accumulation. The plain weight is then freed as
    for float32."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader) -> None:
        layer.weight = new_param((sum(output_partition_sizes), input_size_per_partition), params_dtype,
                                 weight_loader, output_dim=0, input_dim=1)
        layer.packed_weight = None
        layer.w16_weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w16 = getattr(layer, "w16_weight", None)
        packed = layer.packed_weight
        if w16 is not None and x.dim() == 2 and _cpu_eager(x) and (
                (x.dtype == torch.float32 and x.shape[0] <= W16_MAX_ROWS and _onednn_applies(x))
                or (x.dtype == torch.bfloat16 and w16.dtype == torch.bfloat16
                    and (packed is None or (limit := bf16_w16_max_rows()) is None or x.shape[0] <= limit))):
            from engine.layers import pk_ops
            out = pk_ops().w16_gemm(x if x.stride(-1) == 1 else x.contiguous(), w16, layer.w16_rows)
            return out if bias is None else out.add_(bias)
        if packed is None:
            return linear(x, _plain_weight(layer), bias)
        if _onednn_applies(x) or (x.dtype == packed.dtype == torch.bfloat16 and _cpu_eager(x)):
            return _ONEDNN_LINEAR(x, packed, bias, "none", [], "")
        return linear(x, _plain_weight(layer), bias)

    @staticmethod
    def prepack(layer: nn.Module, *, keep_weight: bool) -> bool:
        """Pack ``layer.weight`` if the oneDNN path applies to it (float32, CPU, not disabled; a bf16 weight: see
        :meth:`_prepack_bf16`); without ``keep_weight`` the plain weight is then freed (as vLLM's CPU backend does)
        and rebuilt from the packed one only if a call cannot take the packed path (under torch.compile). Returns
        whether it packed."""
        weight = layer.weight
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0:
            return False
        if weight.dtype == torch.bfloat16:
            return UnquantizedLinearMethod._prepack_bf16(layer, keep_weight=keep_weight)
        if _ONEDNN_LINEAR is None or weight.dtype != torch.float32:
            return False
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_BATCH_HINT)
        UnquantizedLinearMethod.add_w16_copy(layer, weight.detach())
        if not keep_weight:
            layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        return True

    @staticmethod
    def _prepack_bf16(layer: nn.Module, *, keep_weight: bool) -> bool:
        """A bf16 CPU weight's two copies (see the class docstring): oneDNN's where it multiplies bf16, the panels
        where the native kernels built. The plain weight goes when one of them can take every product (oneDNN
        alone; the panels alone where oneDNN has no bf16), as for float32."""
        from pagedkernels import _native
        from pagedkernels.w16_gemm import pack_w16

        weight = layer.weight.detach()
        if _onednn_bf16_available():
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_BATCH_HINT)
        if _w16_enabled() and _native.library() is not None:
            layer.w16_weight, layer.w16_rows = pack_w16(weight), weight.shape[0]
            _settle_amx_limits()
        if layer.packed_weight is None and getattr(layer, "w16_weight", None) is None:
            return False
        if not keep_weight:
            layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        return True


    @staticmethod
    def add_w16_copy(layer: nn.Module, weight: torch.Tensor) -> bool:
        """Give ``layer`` the 16-bit copy of its float32 CPU ``weight`` (see the class docstring) if every value
        is a bf16 or fp16 one and the native kernels built. Returns whether it did."""
        from pagedkernels import _native
        from pagedkernels.w16_gemm import pack_w16

        if (not _w16_enabled() or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or _native.library() is None):
            return False
        dtype = exact_16bit_dtype(weight)
        if dtype is None:
            return False
        layer.w16_weight, layer.w16_rows = pack_w16(weight.to(dtype)), weight.shape[0]
        return True


def _plain_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's ``[N, K]`` weight, rebuilt from a packed copy where prepack freed it (a call no packed path takes:
    under torch.compile)."""
    if layer.weight.numel():
        return layer.weight
    if layer.packed_weight is not None:
        return layer.packed_weight.to_dense()
    from pagedkernels.w16_gemm import unpack_w16
    return unpack_w16(layer.w16_weight, layer.w16_rows)


def prepack_linears(model: nn.Module) -> int:
    """Prepack every unquantized float32 or bf16 CPU linear weight of ``model`` (see
    :meth:`UnquantizedLinearMethod.prepack`); weights that another module also uses (a tied LM head's
    embedding) are kept. Returns how many were packed."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    return sum(UnquantizedLinearMethod.prepack(module, keep_weight=users.get(id(module.weight), 0) > 1)
               for module in model.modules() if isinstance(getattr(module, "quant_method", None),
                                                            UnquantizedLinearMethod))
