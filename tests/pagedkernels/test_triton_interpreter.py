"""tests/triton_interpreter.py: the interpreter skips re-patching triton.language on nested calls and remembers its
dtype answers, computing the same."""
from __future__ import annotations

import os

import pytest
import torch

from tests import triton_interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="Triton's interpreter is off (a GPU runs the kernels compiled)")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _twice_plus_one(x):
    return x * 2.0 + 1.0


@triton.jit
def _scaled(x, scale):
    return _twice_plus_one(x) * scale   # a helper calling a helper


@triton.jit
def _nested_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(x_ptr + offsets)
    for _ in range(STEPS):   # nested calls in a loop, as the kernels' tiles do
        x = _scaled(x, 0.5)
    tl.store(out_ptr + offsets, x)
    tl.store(out_ptr + N + offsets, tl.zeros([N], dtype=tl.float32) + tl.sum(x, axis=0))   # triton.language's own


def _run(x: torch.Tensor, steps: int) -> torch.Tensor:
    out = torch.empty(2 * x.numel(), dtype=torch.float32)
    _nested_kernel[(1,)](x, out, N=x.numel(), STEPS=steps)
    return out


@pytest.fixture
def counted_patches(monkeypatch):
    """Triton's own ``_patch_lang`` counted, the wrappers uninstalled; yields the list of its calls (function
    names) and leaves the wrappers installed as it found them."""
    from triton.runtime import interpreter

    was_installed = bool(triton_interpreter._installed)
    triton_interpreter.uninstall()
    original, calls = interpreter._patch_lang, []

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    try:
        yield calls
    finally:
        triton_interpreter.uninstall()
        monkeypatch.setattr(interpreter, "_patch_lang", original)
        if was_installed:
            triton_interpreter.install()


def test_nested_calls_patch_once_and_compute_the_same(counted_patches):
    x = torch.linspace(-2, 2, 16)
    expected = x.clone()
    for _ in range(6):
        expected = (expected * 2 + 1) * 0.5
    expected = torch.cat([expected, expected.sum().expand(16)])

    plain = _run(x, 6)   # Triton's interpreter as it is: every nested call patches again
    patched_by_triton = len(counted_patches)
    assert patched_by_triton >= 1 + 2 * 6, counted_patches

    counted_patches.clear()
    assert triton_interpreter.install()
    skipping = _run(x, 6)
    again = _run(x, 6)   # a second launch: the state of the first is gone, its result the same
    torch.testing.assert_close(plain, expected)
    assert torch.equal(skipping, plain) and torch.equal(again, plain)
    # Each launch patches once, plus once for the first call into triton.language's own helpers (tl.zeros, tl.sum:
    # their module reaches triton.language.core as well).
    assert len(counted_patches) <= 2 * 2, counted_patches
    assert counted_patches.count("_nested_kernel") == 2


def test_a_failing_kernel_leaves_the_next_launch_patched(counted_patches):
    """A kernel that raises restores its scope and forgets it: the next launch patches again and runs."""
    assert triton_interpreter.install()
    with pytest.raises(Exception):
        _nested_kernel[(1,)](1.5, torch.empty(32), N=16, STEPS=1)   # loads from a number, not a pointer
    assert getattr(triton_interpreter._state, "languages", None) is None
    torch.testing.assert_close(_run(torch.ones(16), 1)[:16], torch.full((16,), 1.5))


def test_remembered_np_dtypes_are_the_interpreters(counted_patches):
    from triton.runtime import interpreter

    dtypes = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int32, tl.int64,
              tl.uint64, tl.float8e4nv, tl.float8e5, tl.pointer_type(tl.float16), tl.pointer_type(tl.int32)]
    cases = dtypes + [tl.block_type(dtype, [4, 8]) for dtype in dtypes]
    own = [interpreter._get_np_dtype(dtype) for dtype in cases]
    assert triton_interpreter.install() and interpreter._get_np_dtype is not triton_interpreter._installed[-1][2]
    assert [interpreter._get_np_dtype(dtype) for dtype in cases * 2] == own * 2
