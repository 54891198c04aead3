"""Model building blocks on pagedkernels ops."""

import torch

import pagedkernels as pk
from pagedkernels import torch_ops


def pk_ops():
    """pagedkernels' ops as the layers should call them: the plain functions when running eagerly
    (no dispatcher overhead), their registered torch custom ops while ``torch.compile`` traces, so
    the graph holds them as opaque nodes instead of breaking around them, and under a FakeTensorMode
    (shape propagation without data: the fake-CUDA test tier runs the forward so), where only the
    custom ops' fake implementations can run."""
    if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return torch_ops
    return pk
