"""Backend selection for pagedkernels ops.

Every public op has two implementations with one signature: a Triton kernel and a PyTorch twin.
The attention ops, ``reshape_and_cache``, the norms, ``rotary_embedding``, ``silu_and_mul``, ``moe_topk``,
``fused_moe`` (with packed weights) and the multi-LoRA pair (``lora_shrink``, ``lora_expand``) also have a native
CPU kernel (C, built on first use with the system compiler: ``pagedkernels/_native.py``);
``copy_blocks`` and ``swap_blocks`` are single tensor copies and have none. ``auto`` (the default) runs Triton on CUDA
tensors and, on CPU tensors, the native kernel where it built (else the PyTorch twin); ``triton``
forces the kernels, which on CPU tensors run in Triton's interpreter; ``torch`` forces the PyTorch
path; ``native`` forces the native kernels (CPU tensors only; ops without one take the PyTorch
path). The choice also comes from the ``PAGEDKERNELS_BACKEND`` environment variable.

Triton decides at *decoration* time whether a ``@triton.jit`` function is interpreted, so on a
machine without CUDA we switch the interpreter on before any kernel module of this package is
imported: there it is the only way a Triton kernel can run at all. An explicit
``TRITON_INTERPRET`` in the environment is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ("auto", "triton", "torch", "native")


def _parse_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


_backend = _parse_backend(os.environ.get("PAGEDKERNELS_BACKEND", "auto").strip().lower() or "auto")

# SM count of the CUDA device whose launches are being simulated, or None. Set only inside
# simulate_cuda_launches (pagedkernels._aot records launches that way on any machine): the wrappers
# then take their Triton path for CPU tensors and choose every launch config as on that device.
_simulated_cuda_sms: int | None = None
_simulated_cuda_capability: tuple[int, int] = (9, 0)


@contextlib.contextmanager
def simulate_cuda_launches(num_multiprocessors: int = 132, capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """For its body, ops on CPU tensors choose Triton launches as on a CUDA device of compute capability
    ``capability`` with ``num_multiprocessors`` SMs (132 and 9.0: an H100 SXM). Only for recording launches through a
    hook that stands in for the kernels (see ``pagedkernels._aot``): nothing here can run a CUDA kernel."""
    global _simulated_cuda_sms, _simulated_cuda_capability
    previous = _simulated_cuda_sms, _simulated_cuda_capability
    _simulated_cuda_sms, _simulated_cuda_capability = num_multiprocessors, tuple(capability)
    try:
        yield
    finally:
        _simulated_cuda_sms, _simulated_cuda_capability = previous


def launch_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability a launch config is chosen for: the simulated device's inside
    :func:`simulate_cuda_launches`, a CUDA device's own, None elsewhere (the interpreter)."""
    if _simulated_cuda_sms is not None:
        return _simulated_cuda_capability
    return device_capability(device) if device.type == "cuda" else None


def launch_device_kind(device: torch.device) -> str:
    """``"cuda"`` when launch configs must suit a GPU (CUDA tensors, or a simulated CUDA device),
    else the device type (``"cpu"``: the interpreter). The launch heuristics take this, not the
    device, so their CUDA choice can be asked for on any machine."""
    return "cuda" if device.type == "cuda" or _simulated_cuda_sms is not None else device.type


# Programmatic dependent launch (PDL, Hopper and later): the decode path's kernels (skinny_gemm,
# rotary_embedding_and_cache, paged_decode_attention's split and reduce) launch before the kernel ahead of them has
# finished, start what does not depend on it (skinny_gemm's first weight tile), then wait for it in the kernel
# (griddepcontrol.wait). Off unless PAGEDKERNELS_PDL=1 or set_programmatic_dependent_launch(True).
_pdl = os.environ.get("PAGEDKERNELS_PDL", "").strip() == "1"


def set_programmatic_dependent_launch(enabled: bool) -> bool:
    """Turn programmatic dependent launch of the decode path's kernels on or off (it applies on devices of compute
    capability 9.0 and later; elsewhere nothing changes). Returns the previous setting. A CUDA graph keeps the
    launches it captured: capture again after changing it."""
    global _pdl
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    previous, _pdl = _pdl, enabled
    return previous


def programmatic_dependent_launch(device: torch.device) -> bool:
    """Whether a decode-path kernel on ``device`` launches with PDL: the setting is on and the device is a CUDA one
    of compute capability 9.0 or later (a simulated one, of its simulated capability)."""
    capability = launch_capability(device) if _pdl else None
    return capability is not None and capability >= (9, 0)


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a decode-path kernel (one with a ``USE_PDL`` constexpr): ``USE_PDL`` and Triton's
    ``launch_pdl`` option, both on where :func:`programmatic_dependent_launch` says so."""
    on = programmatic_dependent_launch(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (major, minor), looked up once per device."""
    return torch.cuda.get_device_capability(device)


def set_backend(name: str) -> None:
    """Select the implementation used by every op: ``"auto"``, ``"triton"``, ``"torch"`` or ``"native"``."""
    global _backend
    _backend = _parse_backend(name)


def get_backend() -> str:
    """The backend currently selected (``"auto"``, ``"triton"``, ``"torch"`` or ``"native"``)."""
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager that selects a backend for its body and restores the previous one."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op whose main operand is ``tensor`` should launch its Triton kernel."""
    if _simulated_cuda_sms is not None:
        return True
    if _backend in ("torch", "native"):
        return False
    if _backend == "auto":
        return tensor.is_cuda
    # backend == "triton"
    if tensor.device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            "pagedkernels backend 'triton' on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing pagedkernels (it is set automatically when no "
            "CUDA device is present)"
        )
    return True


def use_native(tensor: torch.Tensor) -> bool:
    """Whether an op with a native CPU kernel should run it for ``tensor`` (its main operand)."""
    if _simulated_cuda_sms is not None:
        return False
    if _backend in ("torch", "triton"):
        return False
    if _backend == "auto":
        return tensor.is_cpu and _native_library_built()
    # backend == "native"
    if tensor.device.type != "cpu":
        raise RuntimeError(f"pagedkernels backend 'native' runs on CPU tensors only, got a {tensor.device} tensor")
    from . import _native
    if _native.library() is None:
        raise RuntimeError(f"pagedkernels native CPU kernels are unavailable: {_native.build_error()}")
    return True


_native_module = None


def _native_library_built() -> bool:
    """``_native.library() is not None``, the module looked up once (an import statement per op call cost
    about a microsecond, hundreds of times a decode step)."""
    global _native_module
    if _native_module is None:
        from . import _native

        _native_module = _native
    return _native_module.library() is not None


def has_no_data(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` (None entries ignored) holds no data: a meta tensor, or a fake one
    (``FakeTensorMode``, which ``torch.compile`` traces with and which makes CUDA tensors even on a
    CPU-only torch). The public ops check their arguments, then, on such tensors, only allocate
    their outputs: that is their fake implementation (``pagedkernels.torch_ops`` registers it), and
    it keeps a meta or fake call from reaching a kernel."""
    for t in tensors:
        if t is not None and (t.is_meta or isinstance(t, FakeTensor)):
            return True
    return False


def value_checks_enabled(tensor: torch.Tensor) -> bool:
    """Checks that read tensor values (and so would sync a GPU) run always on CPU and on CUDA
    only with ``PAGEDKERNELS_DEBUG=1``, keeping the hot path free of host syncs."""
    if tensor.device.type == "cpu":
        return True
    return os.environ.get("PAGEDKERNELS_DEBUG", "0") not in ("", "0")


def num_multiprocessors(device: torch.device) -> int:
    """Streaming-multiprocessor count of a CUDA device (of the simulated one inside
    :func:`simulate_cuda_launches`). For CPU tensors (interpreter) we return a small fixed number so
    heuristics still exercise their split logic deterministically."""
    if _simulated_cuda_sms is not None:
        return _simulated_cuda_sms
    return _device_multiprocessors(device)


@functools.lru_cache(maxsize=None)
def _device_multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
