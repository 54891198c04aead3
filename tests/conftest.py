import os

import pytest
import torch

# Triton decides at decoration time whether a kernel is interpreted. pagedkernels switches the
# interpreter on by itself on CUDA-less machines; doing it here as well keeps any test module that
# imports triton first on the same footing.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
