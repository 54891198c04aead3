import os

import pytest
import torch

# Triton decides at decoration time whether a kernel is interpreted. pagedkernels switches the
# interpreter on by itself on CUDA-less machines; doing it here as well keeps any test module that
# imports triton first on the same footing.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A CPU engine commits its KV cache at start-up (engine/platform.py, prefault_kv_cache): a quarter of the free RAM,
# seconds to fault in, held while the engine lives. The suite builds hundreds of engines and keeps some alive in
# fixtures, so it leaves the caches to their first writes; tests/engine/test_cpu_malloc.py turns it back on.
os.environ.setdefault("ENGINE_CPU_KV_PREFAULT", "0")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Where a test that forces the Triton backend runs it: the GPU when there is one (the interpreter is then off,
# and Triton cannot take CPU tensors), else CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def triton_device() -> str:
    return TRITON_DEVICE
