"""The sampler's paths as an autouse fixture: a test module that imports `sampler_path` runs every test on the one
that checks values on the host (CPU's), on the sync-free one (CUDA's: masks and torch.where, no value read) and on
the sync-free one with the fused draw (DevicePolicy.fused_sampler: pagedkernels.sample_from_logits, its Triton kernel
in the interpreter where that is on), here on CPU tensors."""
import warnings

import pytest

import pagedkernels as pk
from engine.worker import sampler as sampler_module
from engine.worker.sampler import Sampler
from pagedkernels._backend import interpreter_active

PATHS = ["host_checks", "sync_free", "fused"]


# Calls of more rows take the kernel's PyTorch twin: the interpreter runs a program per row, seconds for the
# thousands of rows of the distribution tests (tests/pagedkernels/test_sampling.py tests the kernel's frequencies).
INTERPRETED_MAX_ROWS = 64


def _draw_in_the_kernel(logits, *args):
    """pagedkernels.sample_from_logits on CPU tensors through its Triton kernel (interpreted; where the interpreter
    is off, on a GPU machine, the PyTorch twin)."""
    kernel = interpreter_active() and logits.shape[0] <= INTERPRETED_MAX_ROWS
    with pk.use_backend("triton" if kernel else "torch"), warnings.catch_warnings():
        # numpy's overflow warnings where the interpreter divides by a tiny temperature: float32's inf, as on a GPU.
        warnings.simplefilter("ignore", RuntimeWarning)
        return pk.sample_from_logits(logits, *args)


def _use(path: str, monkeypatch) -> str:
    if path in ("sync_free", "fused"):
        init = Sampler.__init__
        extra = {"sync_free": True, "fused_draw": path == "fused"}
        monkeypatch.setattr(Sampler, "__init__", lambda self, **kwargs: init(self, **{**kwargs, **extra}))
    if path == "fused":
        monkeypatch.setattr(sampler_module, "pk_sample_from_logits", _draw_in_the_kernel)
    return path


@pytest.fixture(autouse=True, params=PATHS)
def sampler_path(request, monkeypatch):
    return _use(request.param, monkeypatch)


@pytest.fixture(params=PATHS)
def both_sampler_paths(request, monkeypatch):
    """sampler_path for the tests that name it (`@pytest.mark.usefixtures("both_sampler_paths")`), where a module
    also holds tests that take no fixtures (a hypothesis state machine)."""
    return _use(request.param, monkeypatch)
