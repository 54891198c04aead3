"""The sampler's two paths as an autouse fixture: a test module that imports `sampler_path` runs every test on the
one that checks values on the host (CPU's) and on the sync-free one (CUDA's: masks and torch.where, no value read),
here on CPU tensors."""
import pytest

from engine.worker.sampler import Sampler


def _use(path: str, monkeypatch) -> str:
    if path == "sync_free":
        init = Sampler.__init__
        monkeypatch.setattr(Sampler, "__init__", lambda self, **kwargs: init(self, **{**kwargs, "sync_free": True}))
    return path


@pytest.fixture(autouse=True, params=["host_checks", "sync_free"])
def sampler_path(request, monkeypatch):
    return _use(request.param, monkeypatch)


@pytest.fixture(params=["host_checks", "sync_free"])
def both_sampler_paths(request, monkeypatch):
    """sampler_path for the tests that name it (`@pytest.mark.usefixtures("both_sampler_paths")`), where a module
    also holds tests that take no fixtures (a hypothesis state machine)."""
    return _use(request.param, monkeypatch)
