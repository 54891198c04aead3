import pytest

from pagedkernels._backend import interpreter_active


@pytest.fixture(autouse=True)
def _native_backend_is_cpu_only(request):
    """The native kernels are C for the CPU: under backend "native" a CUDA device has nothing to test
    (there the Triton kernels run, covered by the "triton" cases)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("backend") == "native" and params.get("device", "cpu") != "cpu":
        pytest.skip("native kernels run on CPU tensors only; CUDA runs the Triton kernels")


@pytest.fixture(autouse=True)
def _triton_on_cpu_needs_the_interpreter(request):
    """Triton runs CPU tensors only under its interpreter, which is off where a GPU is (it is process-wide and
    would interpret the CUDA launches too): there a CPU case of the Triton backend has nothing to run, and the
    CUDA case of the same test runs the compiled kernel. Cases say so by a ``backend`` parameter of "triton" or
    the ``triton`` marker (tests that force the backend inside)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    forces_triton = params.get("backend") == "triton" or request.node.get_closest_marker("triton") is not None
    if forces_triton and params.get("device", "cpu") == "cpu" and not interpreter_active():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1, off on a CUDA machine (the cuda case runs "
                    "the compiled kernel)")


@pytest.fixture(scope="session")
def portable_cache_dir(tmp_path_factory):
    """One library cache for the tests that build the native kernels for other -march values in subprocesses
    (the attention's, the block GEMM's and the 16-bit GEMM's portable builds): each march is built afresh once
    in the session (the library's cache key holds its flags) and then shared."""
    return tmp_path_factory.mktemp("portable_native_cache")
