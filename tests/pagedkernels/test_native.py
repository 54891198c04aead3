"""The native CPU kernels' build and backend selection (their numerics are checked by the attention
and cache-op suites under backend "native")."""

import shutil
import subprocess
import sys

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_library_builds_where_a_compiler_exists():
    assert _native.library() is not None, _native.build_error()


def test_auto_backend_uses_native_on_cpu(monkeypatch):
    if _native.library() is None:
        pytest.skip(f"native kernels unavailable here: {_native.build_error()}")
    calls = []
    real = _native.paged_attention
    monkeypatch.setattr(_native, "paged_attention", lambda *a: calls.append(real(*a)))
    q = torch.randn(2, 4, 64)
    cache = torch.randn(4, 16, 2, 64)
    with pk.use_backend("auto"):
        pk.paged_decode_attention(q, cache, cache, torch.tensor([[0], [1]], dtype=torch.int32),
                                  torch.tensor([3, 16], dtype=torch.int32))
    assert len(calls) == 1


def test_disabled_native_falls_back_under_auto_and_explains_under_native(tmp_path):
    script = (
        "import torch, pagedkernels as pk\n"
        "q = torch.randn(1, 2, 64); c = torch.randn(2, 16, 1, 64)\n"
        "t = torch.zeros(1, 1, dtype=torch.int32); n = torch.tensor([5], dtype=torch.int32)\n"
        "pk.paged_decode_attention(q, c, c, t, n)\n"
        "pk.set_backend('native')\n"
        "try:\n"
        "    pk.paged_decode_attention(q, c, c, t, n)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "PAGEDKERNELS_NATIVE": "0",
                               "PAGEDKERNELS_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "ERR pagedkernels native CPU kernels are unavailable: disabled by PAGEDKERNELS_NATIVE=0" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing was built


def test_broken_compiler_reports_its_output(tmp_path):
    script = (
        "from pagedkernels import _native\n"
        "assert _native.library() is None\n"
        "print(_native.build_error())\n"
    )
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'fatal: no compiler today' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "CC": str(fake_cc),
                               "PAGEDKERNELS_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "fatal: no compiler today" in proc.stdout
