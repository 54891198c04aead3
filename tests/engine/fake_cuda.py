"""A fake CUDA device for CPU-only machines: the engine's CUDA code paths run with device placement real and
no data, so a CUDA-only fault fails a CPU test run instead of the first GPU run.

``fake_cuda()`` enters PyTorch's FakeTensorMode (tensors carry shape, dtype and device, never data; an op that
mixes a cuda and a cpu tensor raises FakeTensorDeviceMismatchError as it would on a GPU; reading a value
(``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``) raises DataDependentOutputException) and stands in for the
parts of torch.cuda a CPU-only build lacks: availability and device properties of one fake H100, the memory
counters (``FakeCudaMemory``, scripted), streams, ``synchronize``. CPU-only torch has no CUDA device guard, which
the Python bindings of many tensor methods take (``to``, ``copy_``, indexing): a small library built on first use
registers c10's FakeGuardImpl for CUDA; `torch.tensor(data, device="cuda")` is built on the CPU and moved.

A host sync is a fault inside CUDA-graph capture: ``FakeGraphRunner`` captures under ``no_host_sync()``, which
fails on torch.cuda.synchronize and on any read of a tensor value (a copy from cuda to cpu included). It also
fails on a copy to the device from pageable host memory (the driver synchronizes the stream before such a copy):
a source must come from pinned memory (``pin_memory()``, ``torch.empty(..., pin_memory=True)`` or a view of one),
which the fake device tracks itself. CUDA events, pinned memory and CUDA generators, which a CPU-only torch lacks,
have CPU stand-ins.
"""
from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

GiB = 2 ** 30


class FakeCudaMemory:
    """torch.cuda's memory counters for one fake device, scripted: `free` and `total` as mem_get_info reports
    them, and `peak_bytes` as the peak the next profile reports (max_memory_allocated after a reset)."""

    def __init__(self, total: int = 80 * GiB, free: int | None = None, peak_bytes: int = 3 * GiB,
                 non_torch_bytes: int = 0):
        self.total, self.free = total, total - GiB if free is None else free
        self.peak_bytes, self.non_torch_bytes = peak_bytes, non_torch_bytes
        self.allocated = self.reserved = 0
        self.calls: list[str] = []

    def mem_get_info(self) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, self.total

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")

    def max_memory_allocated(self) -> int:
        self.calls.append("max_memory_allocated")
        # What the profile allocated stays reserved by the caching allocator; the rest of the drop in free
        # memory is outside torch (CUDA context, library workspaces).
        self.reserved = self.peak_bytes
        self.free -= self.peak_bytes + self.non_torch_bytes
        self.non_torch_bytes = 0
        return self.peak_bytes

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.free += self.reserved
        self.reserved = 0


_GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
// A CPU-only torch has no device guard for CUDA, and the Python bindings of many tensor methods (to, copy_,
// indexing, in-place ops) take one on the tensor's device. c10's FakeGuardImpl only records the current device.
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


def _register_fake_cuda_device_guard() -> None:
    """Build (once per torch version, ~1 s with the system C++ compiler) and load a library registering c10's
    FakeGuardImpl as the CUDA device guard. A no-op where torch has CUDA."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile

    if torch.cuda.is_available() or getattr(_register_fake_cuda_device_guard, "done", False):
        return
    torch_dir = os.path.dirname(torch.__file__)
    key = hashlib.sha256(f"{torch.__version__}|{torch_dir}|{_GUARD_SOURCE}".encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "engine-tests")
    library = os.path.join(cache, f"fake_cuda_guard_{key}.so")
    if not os.path.isfile(library):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as work:
            source = os.path.join(work, "guard.cpp")
            with open(source, "w") as f:
                f.write(_GUARD_SOURCE)
            built = os.path.join(work, "guard.so")
            abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
            subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-shared", "-fPIC",
                            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir}/include", source, "-o", built,
                            f"-L{torch_dir}/lib", f"-Wl,-rpath,{torch_dir}/lib", "-lc10"],
                           check=True, capture_output=True, text=True)
            os.replace(built, library)
    ctypes.CDLL(library)
    _register_fake_cuda_device_guard.done = True


# The storages of the host tensors made pinned while a fake device is on (views share their base's storage).
_PINNED_STORAGES: set[int] = set()


def _mark_pinned(tensor: torch.Tensor) -> torch.Tensor:
    _PINNED_STORAGES.add(tensor.untyped_storage()._cdata)
    return tensor


def _is_pinned(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage()._cdata in _PINNED_STORAGES


class _TensorFromDataOnFakeCuda(TorchFunctionMode):
    """`torch.tensor(data, device="cuda")` builds the tensor on the CPU and moves it below the dispatcher's Python
    layer, where fake mode cannot see it: build it on the CPU here, then move it (which fake mode runs). Pinned
    host tensors are marked as such."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("pin_memory"):
            return _mark_pinned(func(*args, **kwargs))
        if func in (torch.tensor, torch.as_tensor):
            # No device given: the default one (a `with torch.device(...)` block below this mode sets it).
            device = torch.device(kwargs.pop("device", None) or torch.empty(0).device)
            if device.type == "cuda":
                # Copied into an empty one: `.to` of a small fake tensor would run on its real constant.
                on_cpu = func(*args, **kwargs, device="cpu")
                return torch.empty(on_cpu.shape, dtype=on_cpu.dtype, device=device).copy_(on_cpu)
            return func(*args, **kwargs, device=device)
        return func(*args, **kwargs)


class HostSyncError(AssertionError):
    """A value read back to the host (or a device synchronize) where a CUDA graph is being captured."""


class _NoHostSync(TorchFunctionMode):
    """Fails on a tensor method that makes the host wait for the device: a value read, a copy to the cpu, a copy
    to the device from pageable memory."""

    _READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__len__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in (torch.tensor, torch.as_tensor) and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            raise HostSyncError(f"host sync: torch.{name}(data, device=cuda) copies from pageable memory")
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and tensor.device.type == "cpu" and name == "to" and not _is_pinned(tensor):
            target = _to_target(args, kwargs)
            if target is not None and target.type == "cuda":
                raise HostSyncError("host sync: Tensor.to(cuda) of a pageable (not pinned) cpu tensor")
        if name == "copy_" and tensor is not None and tensor.device.type == "cuda" and len(args) > 1 \
                and isinstance(args[1], torch.Tensor) and args[1].device.type == "cpu" and not _is_pinned(args[1]):
            raise HostSyncError("host sync: copy_ into a cuda tensor from a pageable (not pinned) cpu tensor")
        if tensor is not None and name in self._READS - {"__len__"}:
            raise HostSyncError(f"host sync inside CUDA-graph capture: Tensor.{name}() reads a value")
        if tensor is not None and tensor.device.type == "cuda":
            target = None
            if name == "cpu":
                target = torch.device("cpu")
            elif name == "to":
                target = _to_target(args, kwargs)
            if target is not None and target.type == "cpu":
                raise HostSyncError(f"host sync inside CUDA-graph capture: Tensor.{name}() copies to the cpu")
        if name == "copy_" and tensor is not None and tensor.device.type == "cpu" and len(args) > 1 \
                and isinstance(args[1], torch.Tensor) and args[1].device.type == "cuda":
            # Only a non-blocking copy into pinned memory leaves the host free (the host reads it after an event).
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if not (non_blocking and _is_pinned(tensor)):
                raise HostSyncError("host sync: copy_ from a cuda tensor into a cpu one (blocking, or pageable)")
        return func(*args, **kwargs)


def _to_target(args: tuple, kwargs: dict):
    """The device a Tensor.to(*args[1:], **kwargs) call moves to (None: the same), without its copy /
    memory_format arguments, which torch's parser of .to's device and dtype does not take."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("copy", "memory_format")}
    return torch._C._nn._parse_to(*args[1:], **kwargs)[0]


@contextlib.contextmanager
def no_host_sync():
    """Inside, a host sync raises HostSyncError (what CUDA-graph capture forbids)."""
    def refuse_synchronize(*args, **kwargs):
        raise HostSyncError("torch.cuda.synchronize() inside CUDA-graph capture")

    with mock.patch("torch.cuda.synchronize", refuse_synchronize), _NoHostSync():
        yield


class FakeGraphRunner:
    """The model runner's graph-runner interface on the fake device: `capture` runs the callable once (the
    warm-up) and once more as the recorded pass, both under `no_host_sync()`; `replay` returns the recorded output
    (fake tensors hold no values: a replay has nothing to compute)."""

    captured_batch_sizes: list[int] = []

    def __init__(self, pool=None):
        self.pool = pool
        self.output: torch.Tensor | None = None

    @staticmethod
    def new_pool(device: torch.device):
        return object()

    def capture(self, fn) -> None:
        # The warm-up too: a pass that syncs cannot be the one captured next.
        with no_host_sync():
            fn()
            self.output = fn()
        first = self.output[0] if isinstance(self.output, tuple) else self.output   # a whole step: (logits, ids)
        FakeGraphRunner.captured_batch_sizes.append(first.shape[0])

    def replay(self) -> torch.Tensor:
        return self.output


class _RealCheckpoint:
    """safetensors' safe_open, reading real CPU tensors while fake mode is on (the checkpoint is on disk; its
    tensors are copied into the fake cuda parameters, as the loader copies them onto a GPU)."""

    def __init__(self, *args, **kwargs):
        from safetensors import safe_open
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        self._unset = unset_fake_temporarily
        with self._unset():
            self._file = safe_open(*args, **kwargs)

    def __enter__(self):
        with self._unset():
            self._file.__enter__()
        return self

    def __exit__(self, *exc):
        with self._unset():
            return self._file.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        with self._unset():
            return self._file.get_tensor(name)

    def get_slice(self, name: str):
        with self._unset():
            return self._file.get_slice(name)


@contextlib.contextmanager
def fake_cuda(memory: FakeCudaMemory | None = None):
    """One fake H100 (cuda:0) for the duration: fake tensors, torch.cuda's queries answered. Yields the memory
    double; the engine's runner reads memory through `engine.worker.memory` which this patches."""
    _register_fake_cuda_device_guard()
    memory = FakeCudaMemory() if memory is None else memory
    props = types.SimpleNamespace(total_memory=memory.total, name="Fake NVIDIA H100 80GB HBM3", major=9, minor=0,
                                  multi_processor_count=132)

    class _Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    class _Event:   # the device has no work to wait for: an event is always done
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    real_generator = torch.Generator

    class _Generator(real_generator):   # a CUDA generator needs ATen's CUDA library; fake cuda tensors take a CPU one
        def __new__(cls, device=None):
            return real_generator()

    with contextlib.ExitStack() as stack:
        for name, value in (("is_available", lambda: True), ("device_count", lambda: 1),
                            ("current_device", lambda: 0), ("set_device", lambda device: None),
                            ("get_device_properties", lambda device=None: props),
                            ("get_device_capability", lambda device=None: (9, 0)),
                            ("get_device_name", lambda device=None: props.name),
                            ("synchronize", lambda device=None: None), ("_lazy_init", lambda: None),
                            ("Stream", _Stream), ("current_stream", lambda device=None: _Stream()),
                            ("stream", lambda stream: contextlib.nullcontext()), ("Event", _Event)):
            stack.enter_context(mock.patch(f"torch.cuda.{name}", value))
        # pin_memory copies into pinned memory (a fresh tensor: `.to` of a small fake one would run on its constant)
        stack.enter_context(mock.patch("torch.Tensor.pin_memory", lambda self, *args, **kwargs: _mark_pinned(
            torch.empty(self.shape, dtype=self.dtype).copy_(self))))
        stack.enter_context(mock.patch("torch.Generator", _Generator))
        import torch._subclasses.fake_tensor as fake_tensor_module
        if hasattr(fake_tensor_module, "init_gpu_context"):   # would make a real cuda tensor: there is no GPU
            stack.enter_context(mock.patch.object(fake_tensor_module, "init_gpu_context", lambda device: None))
        stack.enter_context(mock.patch("engine.worker.memory.device_memory", lambda device: memory))
        stack.enter_context(mock.patch("engine.worker.loader.safe_open", _RealCheckpoint))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(_TensorFromDataOnFakeCuda())
        yield memory
