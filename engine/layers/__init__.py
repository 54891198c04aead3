"""Model building blocks on pagedkernels ops."""

import torch

import pagedkernels as pk
from pagedkernels import torch_ops


def pk_ops():
    """pagedkernels' ops as the layers should call them: the plain functions when running eagerly
    (no dispatcher overhead), their registered torch custom ops while ``torch.compile`` traces, so
    the graph holds them as opaque nodes instead of breaking around them."""
    return torch_ops if torch.compiler.is_compiling() else pk
