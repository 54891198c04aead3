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


def test_the_tune_phases_decode_launch_reaches_the_kernel(monkeypatch):
    """DECODE_LAUNCH_SWEEP's configurations are what the decode split kernel launches with (TILE_N, num_stages,
    num_warps), and only inside the context: after it, the wrapper's own launch again."""
    from pagedkernels import decode_attention

    launched = []
    kernel = decode_attention._decode_split_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append({k: kwargs.get(k) for k in ("TILE_N", "num_stages", "num_warps")})
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode_attention, "_decode_split_kernel", Recorder())
    case = K.decode_launch_case(CPU, torch.float32, config=(64, 2, 8), num_seqs=2, seq_len=64, num_q_heads=4,
                                num_kv_heads=2, head_dim=64)
    with pk.use_backend("triton"):
        case.check()
        K.decode_case(CPU, torch.float32, compile=False, num_seqs=2, seq_len=64, num_q_heads=4, num_kv_heads=2,
                      head_dim=64).check()
    assert launched == [{"TILE_N": 64, "num_stages": 2, "num_warps": 8},
                        {"TILE_N": decode_attention.TILE_N, "num_stages": None, "num_warps": 4}]
    assert case.shape.endswith("TILE_N 64 stages 2 warps 8") and case.op == "paged_decode_attention launch"
