"""Backend selection for pagedkernels ops.

Every public op has two implementations with one signature: a Triton kernel and a PyTorch twin.
``auto`` (the default) runs Triton on CUDA tensors and PyTorch on CPU tensors; ``triton`` forces
the kernels, which on CPU tensors run in Triton's interpreter; ``torch`` forces the PyTorch path.
The choice also comes from the ``PAGEDKERNELS_BACKEND`` environment variable.

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

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ("auto", "triton", "torch")


def _parse_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


_backend = _parse_backend(os.environ.get("PAGEDKERNELS_BACKEND", "auto").strip().lower() or "auto")


def set_backend(name: str) -> None:
    """Select the implementation used by every op: ``"auto"``, ``"triton"`` or ``"torch"``."""
    global _backend
    _backend = _parse_backend(name)


def get_backend() -> str:
    """The backend currently selected (``"auto"``, ``"triton"`` or ``"torch"``)."""
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
    if _backend == "torch":
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


def value_checks_enabled(tensor: torch.Tensor) -> bool:
    """Checks that read tensor values (and so would sync a GPU) run always on CPU and on CUDA
    only with ``PAGEDKERNELS_DEBUG=1``, keeping the hot path free of host syncs."""
    if tensor.device.type == "cpu":
        return True
    return os.environ.get("PAGEDKERNELS_DEBUG", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def num_multiprocessors(device: torch.device) -> int:
    """Streaming-multiprocessor count of a CUDA device. For CPU tensors (interpreter) we return a
    small fixed number so heuristics still exercise their split logic deterministically."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
