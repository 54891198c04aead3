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
PEAKS = K.Peaks(copy_gbps=100.0, copy_bytes=1 << 20, matmul_tflops=1.0, matmul_n=512, matmul_dtype="float32")

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


def test_skinny_gemm_is_timed_as_a_chain_of_calls_on_cold_copies(monkeypatch):
    """skinny_gemm's case (and cuBLAS's beside it) cycles through copies of the weight, 512 MiB of them on CUDA (at
    most 64, at least 2), and run_case times it as that many calls (at least 16) back to back in one graph without
    the L2 flush; a case that is not chained keeps the flushed timing."""
    cuda = torch.device("cuda")   # (a device object only: no CUDA needed)
    assert K.chain_copies(1024 * 3072 * 2, cuda) == K.MAX_CHAIN_COPIES         # 0.6B's down projection: 6 MiB
    assert K.chain_copies(28672 * 4096 * 2, cuda) == 3                          # Llama-3-8B's gate_up: 224 MiB
    assert K.chain_copies(151936 * 1024 * 2, cuda) == 2                         # Qwen3's LM head
    assert K.chain_copies(1024, CPU) == 2

    used = []
    monkeypatch.setattr(K.pk, "skinny_gemm", lambda x, w, out: used.append(w.data_ptr()) or out)
    case = K.skinny_gemm_case(CPU, torch.float32, M=1, N=64, K=256)
    assert case.graphed and case.chained == K.MIN_CHAIN_CALLS
    for _ in range(4):
        case.fn()
    assert len(set(used)) == 2 and used[0::2] == [used[0]] * 2 and used[1::2] == [used[1]] * 2
    baseline, _ = case.baselines[0].make()
    out = [baseline().clone() for _ in range(2)]
    assert torch.equal(out[0], out[1])   # the same product from either copy

    timed = []
    monkeypatch.setattr(K, "cuda_graph_timer", lambda fn, **kwargs: timed.append(kwargs) or 0.01)
    case.check = None
    rows = K.run_case(case, K.cuda_timer, PEAKS)
    assert timed == [{"calls": K.MIN_CHAIN_CALLS, "flush": False}] * 2 and rows[0].ms == 0.01
    plain = K.skinny_gemm_case(CPU, torch.float32, M=1, N=64, K=256)
    plain.chained, plain.check, timed[:] = 0, None, []
    K.run_case(plain, K.cuda_timer, PEAKS)
    assert timed == [{}, {}]


def _record(name: str, start: float, us: float, device: str = "CUDA"):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    return SimpleNamespace(name=name, device_type=getattr(DeviceType, device), time_range=Interval(start, start + us))


def test_a_calls_launches_are_averaged_position_by_position():
    """per_launch cuts the device's records (in start order, host events left out) into the calls and averages each
    launch over them, in launch order; records that do not split into the calls, or a launch whose kernel differs
    between calls, are refused rather than averaged into a wrong breakdown."""
    calls = [[("_align", 10.0), ("_gemm", 500.0), ("_gemm", 300.0), ("_sum", 30.0)],
             [("_align", 12.0), ("_gemm", 520.0), ("_gemm", 280.0), ("_sum", 34.0)]]
    records, t = [], 0.0
    for call in calls:
        for name, us in call:
            records.append(_record(name, t, us))
            records.append(_record("aten::empty", t, 1.0, device="CPU"))
            t += us + 5.0
    records.reverse()   # the profile's own order is not relied on
    launches = K.per_launch(records, calls=2)
    assert [name for name, _ in launches] == ["_align", "_gemm", "_gemm", "_sum"]
    assert [round(ms, 6) for _, ms in launches] == [0.011, 0.51, 0.29, 0.032]
    assert K.breakdown_note(launches) == "launches (ms): _align 0.0110, _gemm 0.5100, _gemm 0.2900, _sum 0.0320"
    assert K.breakdown_note([("void at::native::kernel<float>(float*)", 0.5)]) == \
        "launches (ms): void at::native::kernel<float> 0.5000"
    with pytest.raises(ValueError, match="do not split"):
        K.per_launch([r for r in records if r.name != "_align" or r.time_range.start > 0], calls=2)
    with pytest.raises(ValueError, match="do not split"):
        K.per_launch([], calls=2)
    swapped = [_record("_a", 0, 1), _record("_b", 2, 1), _record("_b", 4, 1), _record("_a", 6, 1)]
    with pytest.raises(ValueError, match="differs between calls"):
        K.per_launch(swapped, calls=2)


def test_an_op_of_several_launches_notes_each_launchs_time(monkeypatch):
    """On CUDA a case with ``breakdown`` (fused_moe's, LoRA's) notes its launches' device times in its own row (not
    the baselines'); a breakdown that fails says so and the timing stands; other timers (the CPU dry run) and
    cases without it note nothing."""
    case = K.fused_moe_case(CPU, torch.float32, tokens=2, experts=4, top_k=2, hidden=32, intermediate=16)
    lora = K.lora_case(CPU, torch.float32, num_tokens=2, in_features=32, slice_sizes=(16, 8), rank=8,
                       num_adapters=2)
    assert case.breakdown and lora.breakdown and not K.rms_norm_case(**F32, num_tokens=2, hidden=32).breakdown
    case.check, case.graphed = None, False
    monkeypatch.setattr(K, "cuda_timer", lambda fn: 0.25)
    monkeypatch.setattr(K, "launch_breakdown", lambda fn: [("_fused_moe_kernel", 0.2), ("_moe_sum_kernel", 0.05)])
    rows = K.run_case(case, K.cuda_timer, PEAKS)
    assert rows[0].ms == 0.25 and rows[0].note == "launches (ms): _fused_moe_kernel 0.2000, _moe_sum_kernel 0.0500"
    assert len(rows) == 1 or all("launches" not in row.note for row in rows[1:])

    def broken(fn):
        raise ValueError("7 device records do not split into 10 calls")
    monkeypatch.setattr(K, "launch_breakdown", broken)
    rows = K.run_case(case, K.cuda_timer, PEAKS)
    assert rows[0].ms == 0.25 and rows[0].note == ("launches not broken down: ValueError: 7 device records do not "
                                                   "split into 10 calls")
    monkeypatch.setattr(K, "launch_breakdown", lambda fn: pytest.fail("broken down off CUDA"))
    assert "launches" not in K.run_case(case, lambda fn: 0.5, PEAKS)[0].note
