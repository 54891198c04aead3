"""CPU microbenchmarks of every pagedkernels op (PyTorch backend), through pytest-benchmark:

    python -m pytest bench/test_kernels_cpu.py

Each benchmark first checks the op's result once against the float32 reference of its case in
``bench.kernels`` (dense attention, plain torch norms...), so a broken op fails instead of timing.
GB/s (and TFLOP/s for attention) land in each benchmark's ``extra_info``.
"""

from __future__ import annotations

import pytest
import torch

import pagedkernels as pk
from bench import kernels as K

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install -e '.[dev]')")

CPU = torch.device("cpu")
F32 = dict(device=CPU, dtype=torch.float32)
HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
CACHE = dict(num_kv_heads=8, head_dim=128)

# Small but meaningful: real head counts and sizes, a few MB to tens of MB per call.
CASES = {
    "decode-8x512": lambda: K.decode_case(**F32, num_seqs=8, seq_len=512, **HEADS),
    "decode-1x4096-gqa8": lambda: K.decode_case(**F32, num_seqs=1, seq_len=4096, num_q_heads=64, num_kv_heads=8,
                                                head_dim=128),
    "prefill-4x256": lambda: K.prefill_case(**F32, num_seqs=4, new_tokens=256, **HEADS),
    "prefill-chunk-2x64-over-1024": lambda: K.prefill_case(**F32, num_seqs=2, new_tokens=64, context=1024, **HEADS),
    "reshape_and_cache-2048": lambda: K.reshape_and_cache_case(**F32, num_tokens=2048, **CACHE),
    "copy_blocks-8x64": lambda: K.copy_blocks_case(**F32, num_layers=8, num_blocks=256, num_pairs=64, **CACHE),
    "swap_blocks-128": lambda: K.swap_blocks_case(**F32, direction="d2h", num_blocks=512, num_pairs=128, **CACHE),
    "rms_norm-1024x4096": lambda: K.rms_norm_case(**F32, num_tokens=1024, hidden=4096, compile=False),
    "fused_add_rms_norm-1024x4096": lambda: K.fused_add_rms_norm_case(**F32, num_tokens=1024, hidden=4096,
                                                                     compile=False),
    "rotary-1024": lambda: K.rotary_case(**F32, num_tokens=1024, **HEADS, compile=False),
    "silu_and_mul-512x11008": lambda: K.silu_and_mul_case(**F32, num_tokens=512, intermediate=11008, compile=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel(benchmark, name):
    with pk.use_backend("torch"):
        case = CASES[name]()
        case.check()  # AssertionError on a wrong result
        benchmark.group = case.op
        benchmark.extra_info.update(shape=case.shape, bytes_moved=case.bytes_moved, flops=case.flops)
        benchmark(case.fn)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        seconds = stats.stats.median
        benchmark.extra_info["GB/s"] = round(case.bytes_moved / seconds / 1e9, 3)
        if case.flops:
            benchmark.extra_info["TFLOP/s"] = round(case.flops / seconds / 1e12, 4)
