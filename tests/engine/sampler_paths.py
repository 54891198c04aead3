"""The sampler's two paths as an autouse fixture: a test module that imports `sampler_path` runs every test on the
one that checks values on the host (CPU's) and on the sync-free one (CUDA's: masks and torch.where, no value read),
here on CPU tensors."""
import pytest

from engine.worker.sampler import Sampler


@pytest.fixture(autouse=True, params=["host_checks", "sync_free"])
def sampler_path(request, monkeypatch):
    if request.param == "sync_free":
        init = Sampler.__init__
        monkeypatch.setattr(Sampler, "__init__", lambda self, **kwargs: init(self, **{**kwargs, "sync_free": True}))
    return request.param
