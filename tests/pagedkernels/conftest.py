import pytest


@pytest.fixture(autouse=True)
def _native_backend_is_cpu_only(request):
    """The native kernels are C for the CPU: under backend "native" a CUDA device has nothing to test
    (there the Triton kernels run, covered by the "triton" cases)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("backend") == "native" and params.get("device", "cpu") != "cpu":
        pytest.skip("native kernels run on CPU tensors only; CUDA runs the Triton kernels")
