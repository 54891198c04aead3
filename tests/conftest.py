import os
import sys

import pytest
import torch

# Triton decides at decoration time whether a kernel is interpreted. pagedkernels switches the
# interpreter on by itself on CUDA-less machines; doing it here as well keeps any test module that
# imports triton first on the same footing.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter re-patches triton.language on every nested @triton.jit call; tests/triton_interpreter.py skips the
# calls that would patch nothing new (about a third of an interpreted kernel's time).
_interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if _interpreted and os.environ.get("TESTS_TRITON_REPATCH", "0") in ("", "0"):
    from tests import triton_interpreter

    triton_interpreter.install()

# Under pytest-xdist (`-n 2`) the workers share the cores: each takes its share of torch's threads (and passes it to
# the processes it starts), where every worker's OpenMP pool the size of the machine would make the threads of one
# wait on those of the other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)

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


# The run's exit status, kept for pytest_unconfigure below.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End a ``pytest`` run without the interpreter's teardown, once its results are out: the teardown of a process
    that ran thousands of tests (engines, compiles, the Triton interpreter, libraries' daemon threads: tqdm's
    monitor, loguru's writer, xgrammar's compiles) crashed once, with a segmentation fault after every test had
    passed (fresh-clone CI of 2026-11-30, exit 139 after "4008 passed"), and a crash there fails CI without any
    test failing. ``TESTS_FULL_TEARDOWN=1`` keeps the teardown (to look into one); a pytest run inside another
    program (``pytest.main()``) keeps it too."""
    main = sys.modules.get("__main__")
    is_pytest = (getattr(getattr(main, "__spec__", None), "name", "") in ("pytest", "pytest.__main__")
                 or os.path.basename(sys.argv[0]) in ("pytest", "py.test"))
    if not _EXIT_STATUS or not is_pytest or os.environ.get("TESTS_FULL_TEARDOWN", "0") not in ("", "0"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
