"""Kernel microbenchmarks for every pagedkernels op: ``python -m bench.kernels``.

On a GPU each op is timed with ``triton.testing.do_bench`` (median; the L2 cache is flushed before
every timed call, so each op reads its operands cold, as it does inside a forward pass) next to
the torch alternative timed in the same run, and set against the device's limits measured in the
same run:

- copy bandwidth: device-to-device ``copy_`` of a 2 GiB buffer, GB/s = 2 * bytes / time;
- matmul rate: ``torch.matmul`` of 8192^3 in bf16, TFLOP/s = 2 * 8192^3 / time;
- pinned host <-> device bandwidth, the limit of ``swap_blocks``.

Every row carries: op, shape, dtype, ms, GB/s (bytes the op must move at least, over its time),
TFLOP/s (attention: useful FLOPs only, 4 * head_dim per visible query-key pair and head),
frac_of_peak (GB/s over the copy bandwidth, or TFLOP/s over the matmul rate for prefill), the
baseline's name and time, and ratio = baseline_ms / ms (above 1: pagedkernels is faster).
Baselines: SDPA with only the flash backend on the same K/V made dense and contiguous; FlexAttention
over the flat slot space of the same paged cache with a block mask built from the block tables;
eager and ``torch.compile``d torch for norms/rotary/activation; the PyTorch twin (backend "torch")
for the cache ops; for multi-LoRA the per-adapter loop (PEFT's mixed-batch forward). Each op's result is
checked once against a float32 reference before timing.

``--device cpu`` (alias ``--dry-run``) runs tiny shapes with a wall-clock timer: it exercises the
whole reporting path on a machine without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import itertools
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

import pagedkernels as pk

Timer = Callable[[Callable[[], object]], float]  # returns milliseconds per call

# Relative tolerance of an output against its float32 reference: max|out - ref| <= tol * max|ref|.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ------------------------------------------------------------------------------------------------
# timers and the measured limits
# ------------------------------------------------------------------------------------------------


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` over ~100 ms of runs after ~25 ms of warm-up; triton's do_bench clears
    the L2 cache (writes a 256 MB buffer) before every timed call and times with CUDA events."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def cuda_graph_timer(fn: Callable[[], object], calls: int = 20, replays: int = 15, flush: bool = True) -> float:
    """Median ms of one call of ``fn`` as a CUDA graph replays it: ``calls`` calls captured in one graph, each after
    a 256 MB write that flushes the L2, the replay time of a graph of the flushes alone taken off. What a decode
    step's graph gives an op of a few microseconds: do_bench launches each call from Python, and a launch that
    takes longer than the kernel runs (Triton's launcher, a patched launch configuration) is counted as its time.
    Without ``flush``: the calls back to back, the graph's replay time over ``calls`` (for a ``fn`` that cycles
    through copies of its inputs larger than the L2 together, see Case.chained): a few-microsecond op after a
    256 MB write also pays that write's dirty lines leaving the L2, which a decode step's next layer does not."""
    flusher = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warmed up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def replay_ms(body: Callable[[], None]) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return statistics.median(times)

    if not flush:
        return replay_ms(fn) / calls
    with_op = replay_ms(lambda: (flusher.zero_(), fn()))
    flushes = replay_ms(flusher.zero_)
    return max(with_op - flushes, 0.0) / calls


def launch_breakdown(fn: Callable[[], object], calls: int = 10) -> list[tuple[str, float]]:
    """(kernel name, ms) of each launch one call of ``fn`` makes on the device, in launch order, each the mean of
    ``calls`` calls recorded by torch.profiler with the device's activity alone (CUPTI's kernel records): where an
    op of several launches spends its time (fused_moe's alignment, its two grouped GEMMs, its top-k sum). The calls
    run eagerly, so the gaps between launches are not counted; their sum is the kernels' time."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled outside the window
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return per_launch(prof.events(), calls)


def per_launch(events, calls: int) -> list[tuple[str, float]]:
    """:func:`launch_breakdown` from a profile's events: the device's records (kernels, copies, memsets) in start
    order, cut into ``calls`` equal runs, position by position (the same name in every call) averaged. ValueError
    where the records do not split so (another stream's work in the window, a call that launched differently)."""
    from torch.autograd import DeviceType

    records = sorted((e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not records or len(records) % calls:
        raise ValueError(f"{len(records)} device records do not split into {calls} calls")
    per_call = len(records) // calls
    launches = []
    for i in range(per_call):
        runs = records[i::per_call]
        names = {e.name for e in runs}
        if len(names) != 1:
            raise ValueError(f"launch {i} differs between calls: {sorted(names)}")
        launches.append((runs[0].name, sum(e.time_range.elapsed_us() for e in runs) / calls / 1e3))
    return launches


def breakdown_note(launches: list[tuple[str, float]]) -> str:
    """Launches as a row's note: "launches (ms): name 0.012, name 0.531, ..." (names cut at their argument list)."""
    return "launches (ms): " + ", ".join(f"{name.split('(')[0].strip()[:40]} {ms:.4f}" for name, ms in launches)


def wall_timer(fn: Callable[[], object], repeats: int = 3) -> float:
    """Trivial CPU timer for the dry run: one warm-up call, median of ``repeats`` wall-clock runs."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@dataclass
class Peaks:
    copy_gbps: float  # device-to-device copy: 2 * bytes / time
    copy_bytes: int
    matmul_tflops: float  # dense matmul rate, matmul_dtype, n^3
    matmul_n: int
    matmul_dtype: str
    h2d_gbps: float | None = None  # pinned host -> device (CUDA only)
    d2h_gbps: float | None = None  # device -> pinned host

    def of(self, bound: str) -> float | None:
        return {"copy": self.copy_gbps, "matmul": self.matmul_tflops, "h2d": self.h2d_gbps,
                "d2h": self.d2h_gbps}[bound]


def measure_peaks(device: torch.device, timer: Timer, *, tiny: bool = False) -> Peaks:
    """Copy bandwidth and matmul rate of ``device``, measured now (tiny: small sizes for the dry run)."""
    copy_bytes = (64 << 20) if tiny else (2 << 30)
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbps = 2 * copy_bytes / timer(lambda: dst.copy_(src)) / 1e6
    del src, dst

    n = 512 if tiny else 8192
    mm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=mm_dtype, device=device)
    b = torch.randn(n, n, dtype=mm_dtype, device=device)
    c = torch.empty(n, n, dtype=mm_dtype, device=device)
    matmul_tflops = 2 * n**3 / timer(lambda: torch.matmul(a, b, out=c)) / 1e9
    del a, b, c

    h2d = d2h = None
    if device.type == "cuda":
        try:  # pinned memory can be scarce in containers: the swap rows then go without a fraction
            nbytes = 1 << 30
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            h2d = nbytes / timer(lambda: dev.copy_(host, non_blocking=True)) / 1e6
            d2h = nbytes / timer(lambda: host.copy_(dev, non_blocking=True)) / 1e6
            del host, dev
        except RuntimeError as e:
            print(f"pinned host <-> device bandwidth not measured: {_first_line(e)}")
    _free(device)
    return Peaks(copy_gbps, copy_bytes, matmul_tflops, n, DTYPE_NAMES[mm_dtype], h2d, d2h)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# cases, rows, targets
# ------------------------------------------------------------------------------------------------


@dataclass
class Baseline:
    name: str
    # Builds the timed callable (and may verify its output); raising means "not available".
    # Returns (callable, note).
    make: Callable[[], tuple[Callable[[], object], str]]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # Timed by the plain timer even in a graphed case: a baseline that syncs with the host (a loop over what the
    # values say) cannot be captured, and runs eagerly wherever it is used.
    eager: bool = False


@dataclass
class Target:
    name: str
    metric: str  # "frac_of_peak", or "ratio:<baseline name>"
    threshold: float


@dataclass
class Case:
    op: str
    shape: str
    dtype: torch.dtype
    fn: Callable[[], object]  # the pagedkernels call, inputs bound
    bytes_moved: int  # bytes the op must read + write at least
    flops: int = 0  # useful FLOPs (attention), 0 for bandwidth-bound ops
    bound: str = "copy"  # the limit frac_of_peak refers to: "copy", "matmul", "h2d", "d2h"
    baselines: list[Baseline] = field(default_factory=list)
    check: Callable[[], None] | None = None  # raises AssertionError on a wrong result
    target: Target | None = None
    graphed: bool = False  # on CUDA timed by cuda_graph_timer, baselines too (an op of a few us, as in a graph)
    # with graphed: fn (and each baseline) cycles through copies of its weights, a call on the next each time; timed
    # as this many calls back to back in one graph with no L2 flush (each call's weights cold in the L2, as in a
    # decode step's chain of layers); 0: a flush before each call
    chained: int = 0
    # on CUDA: the device time of each launch of one call in the row's note (launch_breakdown), for an op of several
    breakdown: bool = False


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    ms: float | None
    gbps: float | None
    tflops: float | None
    frac_of_peak: float | None
    peak: str  # which measured limit frac_of_peak refers to
    baseline: str | None
    baseline_ms: float | None
    ratio: float | None  # baseline_ms / ms
    check: str  # "ok", "FAILED: ...", or "not checked"
    note: str = ""


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    actual, expected = actual.float(), expected.float()
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)} != reference {list(expected.shape)}")
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    tol = TOLERANCE[dtype] * scale + 1e-6
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{what}: max |err| {err:.3g} > {TOLERANCE[dtype]:g} * max |ref| ({scale:.3g})")


class Skipped(Exception):
    """Raised by a baseline's ``make`` that was not asked for (e.g. ``--no-compile``)."""


def _first_line(e: BaseException) -> str:
    if isinstance(e, Skipped):
        return f"skipped: {e}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def run_case(case: Case, timer: Timer, peaks: Peaks) -> list[Row]:
    """Check the op once, time it and each baseline; one row per baseline (at least one row). A ``graphed`` case
    is timed with cuda_graph_timer where ``timer`` is the CUDA one (its ``eager`` baselines with ``timer``)."""
    plain_timer = timer
    if case.graphed and timer is cuda_timer:
        timer = (functools.partial(cuda_graph_timer, calls=case.chained, flush=False) if case.chained
                 else cuda_graph_timer)
    check = "not checked"
    if case.check is not None:
        try:
            case.check()
            check = "ok"
        except Exception as e:  # a wrong result is reported, not fatal: the other ops still run
            check = f"FAILED: {_first_line(e)}"
    ms = gbps = tflops = frac = None
    note = ""
    try:
        ms = timer(case.fn)
        gbps = case.bytes_moved / ms / 1e6
        tflops = case.flops / ms / 1e9 if case.flops else None
        peak = peaks.of(case.bound)
        achieved = tflops if case.bound == "matmul" else gbps
        frac = achieved / peak if peak and achieved is not None else None
    except Exception as e:
        note = f"error: {_first_line(e)}"
    launches = ""  # the op's own row only
    if case.breakdown and plain_timer is cuda_timer and not note:
        try:
            launches = breakdown_note(launch_breakdown(case.fn))
        except Exception as e:  # the timing stands without it
            launches = f"launches not broken down: {_first_line(e)}"
    peak_name = {"copy": "copy BW", "matmul": f"{peaks.matmul_dtype} matmul", "h2d": "pinned H2D",
                 "d2h": "pinned D2H"}[case.bound]
    rows = []
    for baseline in case.baselines or [None]:
        name = baseline_ms = ratio = None
        row_note = note
        if baseline is not None:
            name = baseline.name
            try:
                with baseline.context():
                    fn, extra = baseline.make()
                    baseline_ms = (plain_timer if baseline.eager else timer)(fn)
                ratio = baseline_ms / ms if ms else None
                row_note = "; ".join(x for x in (note, extra) if x)
            except Exception as e:
                why = ("" if isinstance(e, Skipped) else "wrong result, not timed: " if isinstance(e, AssertionError)
                       else "not available: ") + _first_line(e)
                row_note = "; ".join(x for x in (note, why) if x)
        if not rows and launches:
            row_note = "; ".join(x for x in (row_note, launches) if x)
        rows.append(Row(case.op, case.shape, DTYPE_NAMES[case.dtype], ms, gbps, tflops, frac, peak_name,
                        name, baseline_ms, ratio, check, row_note))
    return rows


def evaluate_target(case: Case, rows: list[Row]) -> dict:
    target = case.target
    value = None
    if target.metric == "frac_of_peak":
        value = rows[0].frac_of_peak
    else:
        wanted = target.metric.split(":", 1)[1]
        value = next((r.ratio for r in rows if r.baseline == wanted), None)
    ok = rows[0].check == "ok"
    status = "n/a" if value is None else ("pass" if value >= target.threshold and ok else "fail")
    return {"target": target.name, "op": case.op, "shape": case.shape, "metric": target.metric,
            "threshold": target.threshold, "value": value, "status": status,
            "note": "" if ok else f"result check: {rows[0].check}"}


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def _generator(device: torch.device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device, generator=gen)


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    lens: list[int]


def random_paged_kv(lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    device: torch.device, gen: torch.Generator) -> PagedKV:
    """A random KV cache holding ``lens[s]`` tokens per sequence. Blocks are handed out in order,
    as a fresh engine would: the kernels do not care, and it keeps FlexAttention's block mask
    (over the flat slot space) as sparse as it can be."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks)
    key_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, gen=gen)
    value_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, gen=gen)
    block_tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for s, nb in enumerate(blocks):
        block_tables[s, :nb] = torch.arange(start, start + nb, dtype=torch.int32, device=device)
        start += nb
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return PagedKV(key_cache, value_cache, block_tables, seq_lens, list(lens))


def dense_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_seqs, num_kv_heads, seq_len, head_dim] contiguous copy of equal-length sequences."""
    gathered = cache[block_tables.long()]  # [num_seqs, max_blocks, block_size, kv_heads, head_dim]
    return gathered.flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_chunk: int = 1024) -> torch.Tensor:
    """float32 bottom-right causal attention, one sequence and ``q_chunk`` queries at a time (so the
    score matrix of a long prompt stays small). q: [B, Hq, Lq, D]; k, v: [B, Hkv, L, D].
    Returns [B, Hq, Lq, D] float32."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        kb = k[b].float().repeat_interleave(group, 0)  # [Hq, L, D]
        vb = v[b].float().repeat_interleave(group, 0)
        lq, lk = q.shape[2], kb.shape[1]
        for start in range(0, lq, q_chunk):
            qb = q[b, :, start: start + q_chunk].float()  # [Hq, chunk, D]
            scores = qb @ kb.transpose(1, 2) * scale  # [Hq, chunk, L]
            q_pos = torch.arange(lk - lq + start, lk - lq + start + qb.shape[1], device=q.device)[:, None]
            scores.masked_fill_(torch.arange(lk, device=q.device)[None, :] > q_pos, float("-inf"))
            out[b, :, start: start + q_chunk] = torch.softmax(scores, dim=-1) @ vb
    return out


def _slot_owners(kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Per physical slot: owning sequence and logical position (-1 for unused slots)."""
    num_blocks, block_size = kv.key_cache.shape[:2]
    device = kv.key_cache.device
    slot_seq = torch.full((num_blocks * block_size,), -1, dtype=torch.int32, device=device)
    slot_pos = torch.full_like(slot_seq, -1)
    for s, n in enumerate(kv.lens):
        nb = -(-n // block_size)
        slots = (kv.block_tables[s, :nb].long()[:, None] * block_size
                 + torch.arange(block_size, device=device)).flatten()[:n]
        slot_seq[slots] = s
        slot_pos[slots] = torch.arange(n, dtype=torch.int32, device=device)
    return slot_seq, slot_pos


# ------------------------------------------------------------------------------------------------
# attention baselines
# ------------------------------------------------------------------------------------------------


def sdpa_flash_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
                        check: Callable[[torch.Tensor], None]) -> Baseline:
    """SDPA restricted to the flash backend on dense contiguous q [B, Hq, Lq, D], k/v [B, Hkv, L, D].
    GQA through ``enable_gqa=True`` when the flash backend takes it, else K/V repeated to Hq heads
    beforehand (which makes the baseline read ``group`` times more K/V; the note says so)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make():
        if q.shape[1] == k.shape[1]:
            fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)), ""
        else:
            try:
                F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
                fn, note = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                   enable_gqa=True)), "enable_gqa=True"
            except RuntimeError as e:
                group = q.shape[1] // k.shape[1]
                k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                fn = lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=is_causal)  # noqa: E731
                note = f"K/V repeated to {q.shape[1]} heads (enable_gqa refused: {_first_line(e)[:80]})"
        check(fn())
        return fn, note

    return Baseline("sdpa-flash", make, context=lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))


def flex_paged_baseline(q: torch.Tensor, kv: PagedKV, q_seq: torch.Tensor, q_pos: torch.Tensor, *,
                        compile: bool, check: Callable[[torch.Tensor], None]) -> Baseline:
    """FlexAttention over the paged cache itself: K/V viewed as one sequence of all physical slots
    [1, Hkv, num_blocks * block_size, D] (no copy), queries packed as [1, Hq, T, D], and a block mask
    from the block tables: query t sees slot j iff j belongs to t's sequence at a position <= t's."""

    def make():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        num_blocks, block_size, num_kv_heads, head_dim = kv.key_cache.shape
        num_slots = num_blocks * block_size
        slot_seq, slot_pos = _slot_owners(kv)

        def mask_mod(b, h, q_idx, kv_idx):
            return (slot_seq[kv_idx] == q_seq[q_idx]) & (slot_pos[kv_idx] <= q_pos[q_idx])

        block_mask = create_block_mask(mask_mod, None, None, q.shape[0], num_slots, device=q.device)
        q_flat = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, T, D]
        k_flat = kv.key_cache.view(1, num_slots, num_kv_heads, head_dim).transpose(1, 2)
        v_flat = kv.value_cache.view(1, num_slots, num_kv_heads, head_dim).transpose(1, 2)
        attend = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        gqa = q.shape[1] != num_kv_heads

        def fn():
            return attend(q_flat, k_flat, v_flat, block_mask=block_mask, enable_gqa=gqa)

        if not compile:
            eager = fn

            def fn():
                with warnings.catch_warnings():  # eager flex warns that it is unfused: known, asked for
                    warnings.simplefilter("ignore", UserWarning)
                    return eager()

        check(fn()[0].transpose(0, 1))  # back to [T, Hq, D]
        return fn, "" if compile else "eager (--no-compile)"

    return Baseline("flex-paged", make)


def _checker(reference: Callable[[], torch.Tensor], dtype: torch.dtype, what: str) -> Callable[[torch.Tensor], None]:
    cached = functools.cache(reference)
    return lambda out: assert_close(out, cached(), dtype, what)


# ------------------------------------------------------------------------------------------------
# the cases
# ------------------------------------------------------------------------------------------------


def _heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> str:
    return f"{num_q_heads}q/{num_kv_heads}kv heads, d{head_dim}"


def decode_case(device, dtype, *, num_seqs: int, seq_len: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int = 16, compile: bool = True, target: Target | None = None,
                num_splits: int | None = None) -> Case:
    """num_splits: the launch's split count (None: the wrapper's heuristic, as the engine launches it)."""
    gen = _generator(device)
    kv = random_paged_kv([seq_len] * num_seqs, num_kv_heads, head_dim, block_size, dtype, device, gen)
    q = _randn(num_seqs, num_q_heads, head_dim, dtype=dtype, device=device, gen=gen)
    out = torch.empty_like(q)
    # The split-K scratch comes from the caller, as in the engine: the timed call allocates nothing.
    if num_splits is None:
        workspace = pk.decode_workspace(num_seqs, num_q_heads, num_kv_heads, head_dim, device=device)
    else:
        from pagedkernels.decode_attention import decode_workspace_numel
        workspace = torch.empty(max(1, decode_workspace_numel(num_seqs, num_q_heads, head_dim, num_splits)),
                                dtype=torch.float32, device=device)
    k_dense = dense_kv(kv.key_cache, kv.block_tables, seq_len)  # [B, Hkv, L, D]
    v_dense = dense_kv(kv.value_cache, kv.block_tables, seq_len)
    q_dense = q.unsqueeze(2)  # [B, Hq, 1, D]
    reference = _checker(lambda: reference_attention(q_dense, k_dense, v_dense).squeeze(2), dtype, "decode")

    def fn():
        return pk.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, out=out,
                                         workspace=workspace, num_splits=num_splits)

    item = q.element_size()
    tokens = num_seqs * seq_len
    bytes_moved = (2 * tokens * num_kv_heads * head_dim + 2 * q.numel()) * item + kv.block_tables.numel() * 4
    q_seq = torch.arange(num_seqs, dtype=torch.int32, device=device)
    q_pos = kv.seq_lens - 1
    return Case(
        "paged_decode_attention",
        f"{num_seqs} seqs x {seq_len} tok, {_heads(num_q_heads, num_kv_heads, head_dim)}, block {block_size}",
        dtype, fn, bytes_moved, flops=4 * num_q_heads * head_dim * tokens, bound="copy",
        baselines=[
            sdpa_flash_baseline(q_dense, k_dense, v_dense, is_causal=False,
                                check=lambda o: reference(o.squeeze(2))),
            flex_paged_baseline(q, kv, q_seq, q_pos, compile=compile, check=reference),
        ],
        check=lambda: reference(fn()), target=target)


def prefill_case(device, dtype, *, num_seqs: int, new_tokens: int, context: int | None = None, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int = 16, compile: bool = True,
                 target: Target | None = None) -> Case:
    """``num_seqs`` sequences of ``new_tokens`` query tokens each over ``context`` cached tokens
    (the new ones included; default: a first prefill, context == new_tokens)."""
    context = context or new_tokens
    gen = _generator(device)
    kv = random_paged_kv([context] * num_seqs, num_kv_heads, head_dim, block_size, dtype, device, gen)
    num_tokens = num_seqs * new_tokens
    q = _randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device, gen=gen)
    out = torch.empty_like(q)
    cu_seqlens_q = torch.arange(0, num_tokens + 1, new_tokens, dtype=torch.int32, device=device)
    k_dense = dense_kv(kv.key_cache, kv.block_tables, context)  # [B, Hkv, L, D]
    v_dense = dense_kv(kv.value_cache, kv.block_tables, context)
    q_dense = q.view(num_seqs, new_tokens, num_q_heads, head_dim).transpose(1, 2).contiguous()  # [B, Hq, Lq, D]

    def to_packed(o: torch.Tensor) -> torch.Tensor:  # [B, Hq, Lq, D] -> [T, Hq, D]
        return o.transpose(1, 2).reshape(num_tokens, num_q_heads, head_dim)

    reference = _checker(lambda: to_packed(reference_attention(q_dense, k_dense, v_dense)), dtype, "prefill")

    def fn():
        return pk.paged_prefill_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, cu_seqlens_q,
                                          kv.seq_lens, out=out)

    item = q.element_size()
    pairs = num_seqs * (new_tokens * (context - new_tokens) + new_tokens * (new_tokens + 1) // 2)
    bytes_moved = (2 * q.numel() + 2 * num_seqs * context * num_kv_heads * head_dim) * item
    q_seq = torch.arange(num_seqs, dtype=torch.int32, device=device).repeat_interleave(new_tokens)
    q_pos = (torch.arange(new_tokens, dtype=torch.int32, device=device) + context - new_tokens).repeat(num_seqs)
    baselines = [flex_paged_baseline(q, kv, q_seq, q_pos, compile=compile, check=reference)]
    if context == new_tokens:  # SDPA's is_causal is top-left aligned: equal to ours only then
        baselines.insert(0, sdpa_flash_baseline(q_dense, k_dense, v_dense, is_causal=True,
                                                check=lambda o: reference(to_packed(o))))
    shape = f"{num_seqs} x {new_tokens} new tok"
    if context != new_tokens:
        shape += f" over {context} ctx"
    shape += f", {_heads(num_q_heads, num_kv_heads, head_dim)}, block {block_size}"
    return Case("paged_prefill_attention", shape, dtype, fn, bytes_moved, flops=4 * num_q_heads * head_dim * pairs,
                bound="matmul", baselines=baselines, check=lambda: reference(fn()), target=target)


def _torch_twin(name: str, call: Callable[[], object]) -> Baseline:
    def make():
        def fn():
            with pk.use_backend("torch"):
                return call()
        return fn, ""
    return Baseline(name, make)


def reshape_and_cache_case(device, dtype, *, num_tokens: int, num_kv_heads: int, head_dim: int,
                           block_size: int = 16) -> Case:
    gen = _generator(device)
    num_blocks = 2 * -(-num_tokens // block_size)
    key = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device, gen=gen)
    value = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device, gen=gen)
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    # Distinct slots scattered over the whole cache, as a batch of sequences at different offsets.
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]

    def fn():
        pk.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def check():
        key_cache.zero_()
        value_cache.zero_()
        fn()
        assert_close(key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping], key, dtype, "key_cache")
        assert_close(value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping], value, dtype, "value_cache")

    bytes_moved = 4 * key.numel() * key.element_size() + 8 * num_tokens
    return Case("reshape_and_cache", f"{num_tokens} tok, {num_kv_heads} kv heads, d{head_dim}, block {block_size}",
                dtype, fn, bytes_moved, baselines=[_torch_twin("torch twin", fn)], check=check)


def copy_blocks_case(device, dtype, *, num_layers: int, num_blocks: int, num_pairs: int, num_kv_heads: int,
                     head_dim: int, block_size: int = 16) -> Case:
    gen = _generator(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_caches = [_randn(*shape, dtype=dtype, device=device, gen=gen) for _ in range(num_layers)]
    value_caches = [_randn(*shape, dtype=dtype, device=device, gen=gen) for _ in range(num_layers)]
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_mapping = torch.stack([perm[:num_pairs], perm[num_pairs: 2 * num_pairs]], dim=1)  # (src, dst)

    def fn():
        pk.copy_blocks(key_caches, value_caches, block_mapping)

    def check():
        fn()
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        for cache in key_caches + value_caches:
            assert_close(cache[dst], cache[src], dtype, "copied blocks")

    block_bytes = block_size * num_kv_heads * head_dim * key_caches[0].element_size()
    bytes_moved = 2 * 2 * num_layers * num_pairs * block_bytes
    return Case("copy_blocks", f"{num_layers} layers x {num_pairs} pairs, block {block_size}x{num_kv_heads}x{head_dim}",
                dtype, fn, bytes_moved, baselines=[_torch_twin("torch twin", fn)], check=check)


def swap_blocks_case(device, dtype, *, direction: str, num_blocks: int, num_pairs: int, num_kv_heads: int,
                     head_dim: int, block_size: int = 16) -> Case:
    """direction "d2h" (GPU -> pinned CPU, swap-out) or "h2d" (swap-in); on a CPU run both caches
    live in host memory."""
    gen = _generator(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    on_device = _randn(*shape, dtype=dtype, device=device, gen=gen)
    host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
    host.copy_(on_device)
    src, dst = (on_device, host) if direction == "d2h" else (host, on_device)
    cpu_gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks, generator=cpu_gen)
    block_mapping = torch.stack([perm[:num_pairs], torch.randperm(num_blocks, generator=cpu_gen)[:num_pairs]], 1)
    src_ids, dst_ids = block_mapping[:, 0], block_mapping[:, 1]

    def fn():
        pk.swap_blocks(src, dst, block_mapping)

    def check():
        dst.zero_()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert_close(dst[dst_ids.to(dst.device)].cpu(), src[src_ids.to(src.device)].cpu(), dtype, "swapped blocks")

    def index_copy():
        # The obvious torch alternative: gather the blocks, move them in one transfer, scatter.
        src_idx, dst_idx = src_ids.to(src.device), dst_ids.to(dst.device)

        def call():
            dst.index_copy_(0, dst_idx, src.index_select(0, src_idx).to(dst.device, non_blocking=True))
        return call, "index_select + one transfer + index_copy_"

    block_bytes = block_size * num_kv_heads * head_dim * on_device.element_size()
    # Across PCIe each byte crosses once (measured against the pinned H2D/D2H rate); host to host it
    # is read and written (measured against the copy bandwidth, which counts both).
    if device.type == "cuda":
        bound, bytes_moved = direction, num_pairs * block_bytes
    else:
        bound, bytes_moved = "copy", 2 * num_pairs * block_bytes
    shape_text = f"{direction}: {num_pairs} of {num_blocks} blocks, block {block_size}x{num_kv_heads}x{head_dim}"
    return Case("swap_blocks", shape_text, dtype, fn, bytes_moved, bound=bound,
                baselines=[Baseline("torch index_copy", index_copy)], check=check)


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _add_rms_reference(x, residual, weight, eps):
    summed = (x.float() + residual.float()).to(residual.dtype)
    return _rms_reference(summed, weight, eps), summed


def _eager_and_compiled(fn: Callable, args: tuple, compile: bool) -> list[Baseline]:
    def eager():
        return (lambda: fn(*args)), ""

    def compiled():
        if not compile:
            raise Skipped("--no-compile")
        compiled_fn = torch.compile(fn, dynamic=False)
        compiled_fn(*args)
        return (lambda: compiled_fn(*args)), ""

    return [Baseline("torch eager", eager), Baseline("torch.compile", compiled)]


def rms_norm_case(device, dtype, *, num_tokens: int, hidden: int, compile: bool = True) -> Case:
    gen = _generator(device)
    x = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=gen)
    weight = 1 + 0.1 * _randn(hidden, dtype=dtype, device=device, gen=gen)
    out = torch.empty_like(x)
    eps = 1e-6

    def fn():
        return pk.rms_norm(x, weight, eps, out=out)

    bytes_moved = 2 * x.numel() * x.element_size() + weight.numel() * weight.element_size()
    return Case("rms_norm", f"{num_tokens} x {hidden}", dtype, fn, bytes_moved,
                baselines=_eager_and_compiled(_rms_reference, (x, weight, eps), compile),
                check=lambda: assert_close(fn(), _rms_reference(x.float(), weight, eps), dtype))


def fused_add_rms_norm_case(device, dtype, *, num_tokens: int, hidden: int, compile: bool = True,
                            target: Target | None = None) -> Case:
    gen = _generator(device)
    x = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=gen)
    residual = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=gen)
    weight = 1 + 0.1 * _randn(hidden, dtype=dtype, device=device, gen=gen)
    eps = 1e-6
    # Timed calls keep updating x and residual in place (residual grows by x each call): harmless.
    x_run, residual_run = x.clone(), residual.clone()

    def fn():
        return pk.fused_add_rms_norm(x_run, residual_run, weight, eps)

    def check():
        expected_out, expected_residual = _add_rms_reference(x, residual, weight, eps)
        x_run.copy_(x)
        residual_run.copy_(residual)
        out, new_residual = fn()
        assert_close(new_residual, expected_residual, dtype, "residual")
        assert_close(out, expected_out, dtype, "out")

    bytes_moved = 4 * x.numel() * x.element_size() + weight.numel() * weight.element_size()
    return Case("fused_add_rms_norm", f"{num_tokens} x {hidden}", dtype, fn, bytes_moved,
                baselines=_eager_and_compiled(_add_rms_reference, (x, residual, weight, eps), compile),
                check=check, target=target)


def _rotary_reference(positions, q, k, cos_sin_cache):
    """neox rotary, out of place: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), fp32."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rotary_case(device, dtype, *, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                max_position: int = 8192, compile: bool = True) -> Case:
    gen = _generator(device)
    q = _randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device, gen=gen)
    k = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device, gen=gen)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen, device=device)
    cos_sin_cache = pk.compute_cos_sin_cache(max_position, head_dim, 10000.0, dtype=torch.float32, device=device)
    q_run, k_run = q.clone(), k.clone()

    def fn():
        pk.rotary_embedding(positions, q_run, k_run, cos_sin_cache)

    def check():
        q_run.copy_(q)
        k_run.copy_(k)
        fn()
        expected_q, expected_k = _rotary_reference(positions, q, k, cos_sin_cache)
        assert_close(q_run, expected_q, dtype, "q")
        assert_close(k_run, expected_k, dtype, "k")

    bytes_moved = (2 * (q.numel() + k.numel()) * q.element_size() + num_tokens * 8
                   + num_tokens * head_dim * cos_sin_cache.element_size())
    baselines = [_torch_twin("torch twin", fn)] + _eager_and_compiled(
        _rotary_reference, (positions, q_run, k_run, cos_sin_cache), compile)[1:]
    return Case("rotary_embedding", f"{num_tokens} tok, {_heads(num_q_heads, num_kv_heads, head_dim)}, neox",
                dtype, fn, bytes_moved, baselines=baselines, check=check)


def _silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def silu_and_mul_case(device, dtype, *, num_tokens: int, intermediate: int, compile: bool = True) -> Case:
    gen = _generator(device)
    x = _randn(num_tokens, 2 * intermediate, dtype=dtype, device=device, gen=gen)
    out = torch.empty(num_tokens, intermediate, dtype=dtype, device=device)

    def fn():
        return pk.silu_and_mul(x, out=out)

    return Case("silu_and_mul", f"{num_tokens} x 2*{intermediate}", dtype, fn, 3 * out.numel() * out.element_size(),
                baselines=_eager_and_compiled(_silu_and_mul_reference, (x,), compile),
                check=lambda: assert_close(fn(), _silu_and_mul_reference(x.float()), dtype))


def _draw_reference(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The draw in tensor ops (pagedkernels.sampling's PyTorch twin, the engine sampler's own ops): the ids."""
    from pagedkernels.sampling import _sample_torch
    num_rows = logits.shape[0]
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    return _sample_torch(logits, temperature, uniform, ids, torch.empty(num_rows, device=logits.device))[0]


def sample_from_logits_case(device, dtype, *, num_rows: int, vocab: int, temperature: float = 0.6,
                            compile: bool = True) -> Case:
    """The sampler's draw over float32 logits (what the LM head gives the sampler, whatever the model's dtype):
    every row at ``temperature`` (0: greedy). Its floor is one read of the logits; a sampling row reads them
    up to three times (the maximum, the total, the search). Against the same draw in tensor ops, eager and
    compiled. Checked: each id is one the tensor ops draw, or a neighbour where the uniform lies within float32
    rounding of their boundary."""
    gen = _generator(device)
    logits = _randn(num_rows, vocab, dtype=torch.float32, device=device, gen=gen) * 3.0
    temperatures = torch.full((num_rows,), temperature, device=device)
    uniform = torch.rand(num_rows, generator=gen, device=device)

    def fn():
        return pk.sample_from_logits(logits, temperatures, uniform)

    def check():
        ids, expected = fn()[0].cpu(), _draw_reference(logits, temperatures, uniform).cpu()
        differ = (ids != expected).nonzero().flatten().tolist()
        if differ:   # within rounding of a boundary: the two ids are neighbours among the live tokens
            assert len(differ) <= max(1, num_rows // 100), f"ids: {len(differ)} of {num_rows} rows differ"
            assert all(abs(int(ids[r]) - int(expected[r])) <= 1 for r in differ), "ids: rows differ by > 1 token"

    shape = f"{num_rows} x {vocab}" + (" greedy" if temperature == 0 else f" T={temperature}")
    return Case("sample_from_logits", shape, torch.float32, fn, logits.numel() * 4,
                baselines=_eager_and_compiled(_draw_reference, (logits, temperatures, uniform), compile),
                check=check)


def sampler_top_k_top_p_case(device, dtype, *, num_rows: int, vocab: int, top_k: int = 20, top_p: float = 0.95,
                             temperature: float = 0.6, fused: bool = False) -> Case:
    """The engine sampler's sync-free draw (engine/worker/sampler.py, CUDA's path) of rows that all have top-k and
    / or top-p, as generation configs ask (Qwen3: temperature 0.6, top-k 20, top-p 0.95; Llama 3: top-p 0.9 alone).
    Without `fused`: among each row's candidates (one top-k selection) against the full sort of the batch that such
    rows took before. With `fused` (ENGINE_FUSED_SAMPLER=1): pagedkernels.sample_from_logits' threshold search
    against the full sort and, where every row has top-k, the candidates. float32 logits, read at least once.
    Checked: each way draws the same tokens as the full sort (but where a uniform lies within rounding of a
    boundary)."""
    from unittest import mock

    from engine.worker import sampler as sampler_module
    from engine.worker.sampler import Sampler, SamplingMetadata

    gen = _generator(device)
    logits = _randn(num_rows, vocab, dtype=torch.float32, device=device, gen=gen) * 3.0
    meta = SamplingMetadata(temperature=torch.full((num_rows,), temperature, device=device), greedy=[False] * num_rows,
                            top_k=[top_k] * num_rows if top_k > 0 else None,
                            top_p=[top_p] * num_rows if top_p < 1.0 else None)
    samplers = {way: Sampler(seed=0, device=device, sync_free=True, fused_draw=way) for way in (False, True)}
    work = torch.empty_like(logits)

    def draw_with(fused_draw: bool):
        def draw():
            sampler = samplers[fused_draw]
            sampler.generator.manual_seed(0)   # the same uniforms every call: every way draws from the same numbers
            return sampler.sample(work.copy_(logits), meta).sampled_token_ids
        return draw

    def full_sort():
        return mock.patch.object(sampler_module, "_candidate_top_k", lambda *args: None)

    def check():
        ids = draw_with(fused)().cpu()
        with full_sort():
            expected = draw_with(False)().cpu()
        differ = (ids != expected).nonzero().flatten().tolist()
        assert len(differ) <= max(1, num_rows // 100), f"ids: {len(differ)} of {num_rows} rows differ from the sort's"

    baselines = [Baseline("full sort", lambda: (draw_with(False), ""), context=full_sort)]
    if fused and top_k > 0:
        baselines.append(Baseline("candidates", lambda: (draw_with(False), "")))
    shape = (f"{num_rows} x {vocab} T={temperature}" + (f" k={top_k}" if top_k > 0 else "")
             + (f" p={top_p}" if top_p < 1.0 else "") + (" kernel" if fused else ""))
    if fused and torch.device(device).type == "cuda":   # what the threshold search costs on these logits
        from pagedkernels.sampling import threshold_search_passes
        passes = threshold_search_passes(logits, meta.temperature,
                                         torch.full((num_rows,), top_k, device=device),
                                         torch.full((num_rows,), top_p, device=device)).float()
        shape += f" ({passes.mean().item():.1f} search passes, max {int(passes.max().item())})"
    return Case("sampler top-k/top-p draw", shape, torch.float32, draw_with(fused), logits.numel() * 4,
                baselines=baselines, check=check)


def _gemm_check(out_fn: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor], dtype: torch.dtype,
                device: torch.device, what: str) -> Callable[[], None]:
    """On a GPU the kernel against its exact product (tolerance of x's dtype); on the CPU dry run the native
    kernels quantize the activation to int8 per block of 32 (``pagedkernels.wq_gemm``), hence 2e-2."""
    def check():
        if device.type == "cuda":
            assert_close(out_fn(), reference(), dtype, what)
        else:
            actual, expected = out_fn().float(), reference().float()
            err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
            assert err <= 2e-2 * scale, f"{what}: max |err| {err:.3g} > 2e-2 * max |ref| ({scale:.3g})"
    return check


def _dense_linear_baseline(x: torch.Tensor, weight: torch.Tensor) -> Baseline:
    """The layer the quantized one replaces: ``F.linear`` on the same weight de-quantized to x's dtype
    (cuBLAS on a GPU)."""
    dense_out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)

    def make():
        return (lambda: torch.matmul(x, weight.t(), out=dense_out)), ""

    return Baseline(f"{DTYPE_NAMES[x.dtype]} F.linear", make)


def _gemm_shape(M: int, N: int, K: int) -> str:
    return f"M={M} N={N} K={K}"


def wq_gemm_case(device, dtype, *, M: int, N: int, K: int, group_size: int = 128) -> Case:
    """W4A16: an int4 weight with group scales and zero points (GPTQ/AWQ after their conversion to the
    canonical layout) against the 16-bit dense GEMM. Decode shapes (small M) are bound by the weight's
    bytes (frac of copy bandwidth), prefill shapes by the matmul rate."""
    from pagedkernels.quant_formats import dequantize_wq, quantize_wq

    gen = _generator(device)
    weight = _randn(N, K, dtype=torch.float32, device=device, gen=gen) * 0.02
    wq = quantize_wq(weight, bits=4, group_size=group_size, scale_dtype=dtype)
    dense = dequantize_wq(wq.qweight, wq.scales, wq.zeros, bits=4, group_size=group_size).to(dtype)
    x = _randn(M, K, dtype=dtype, device=device, gen=gen)
    out = torch.empty(M, N, dtype=dtype, device=device)

    def fn():
        return pk.wq_gemm(x, wq.qweight, wq.scales, wq.zeros, bits=4, group_size=group_size, out=out)

    weight_bytes = sum(t.numel() * t.element_size() for t in (wq.qweight, wq.scales, wq.zeros))
    bytes_moved = weight_bytes + (x.numel() + out.numel()) * x.element_size()
    reference = functools.cache(lambda: x.float() @ dense.float().t())
    return Case("wq_gemm", f"{_gemm_shape(M, N, K)}, int4 g{group_size} + zeros", dtype, fn, bytes_moved,
                flops=2 * M * N * K, bound="copy" if M <= 64 else "matmul",
                baselines=[_dense_linear_baseline(x, dense)], check=_gemm_check(fn, reference, dtype, device, "wq_gemm"))


# Bytes a chained case's copies of its weights span together (Case.chained): ten times an H100's or H200's 50 MB
# L2, so each call finds its weights where a decode step's next layer finds its own, in memory.
CHAIN_BYTES = 512 * 2**20
MAX_CHAIN_COPIES = 64
# Calls a chained case's graph holds at least, cycling through the copies more than once where they are few (large
# weights: each copy is still cold when its turn comes again), so the graph's own launch is a small part of the time.
MIN_CHAIN_CALLS = 16


def chain_copies(nbytes: int, device: torch.device) -> int:
    """How many copies of ``nbytes`` of weights a chained case cycles through: CHAIN_BYTES' worth on CUDA (at least
    2, at most MAX_CHAIN_COPIES calls a graph); 2 elsewhere (the cycling exercised, the memory not spent)."""
    if device.type != "cuda":
        return 2
    return max(2, min(MAX_CHAIN_COPIES, -(-CHAIN_BYTES // max(nbytes, 1))))


def _cycling(call: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> Callable[[], object]:
    """A call on the next of ``weights`` each time, round and round (a captured graph of n calls holds each copy's
    calls in turn)."""
    turn = itertools.cycle(weights)
    return lambda: call(next(turn))


def skinny_gemm_case(device, dtype, *, M: int, N: int, K: int) -> Case:
    """The few-row GEMM (``pagedkernels.skinny_gemm``: one program per few output rows over all of K) against cuBLAS
    on the same weights, at a decode step's projection shapes: bound by the weight's bytes (frac of copy bandwidth).
    Timed on CUDA as a chain of calls in one graph, each on its own copy of the weight (chain_copies: as a decode
    step's layers, each finding its weights in memory, not in the L2, with no flush's write-back in its way)."""
    gen = _generator(device)
    weight = _randn(N, K, dtype=dtype, device=device, gen=gen) * K ** -0.5
    weights = [weight] + [weight.clone() for _ in range(chain_copies(weight.numel() * weight.element_size(),
                                                                     device) - 1)]
    x = _randn(M, K, dtype=dtype, device=device, gen=gen)
    out = torch.empty(M, N, dtype=dtype, device=device)
    fn = _cycling(lambda w: pk.skinny_gemm(x, w, out=out), weights)
    dense_out = torch.empty(M, N, dtype=dtype, device=device)
    cublas = Baseline(f"{DTYPE_NAMES[dtype]} F.linear", lambda: (
        _cycling(lambda w: torch.matmul(x, w.t(), out=dense_out), weights), ""))

    bytes_moved = (weight.numel() + x.numel() + out.numel()) * x.element_size()
    reference = functools.cache(lambda: x.float() @ weight.float().t())
    return Case("skinny_gemm", _gemm_shape(M, N, K), dtype, fn, bytes_moved, flops=2 * M * N * K, bound="copy",
                baselines=[cublas], check=_gemm_check(fn, reference, dtype, device, "skinny_gemm"), graphed=True,
                chained=max(len(weights), MIN_CHAIN_CALLS))


def fp8_gemm_case(device, dtype, *, M: int, N: int, K: int) -> Case:
    """FP8: an e4m3 weight with per-channel scales against the 16-bit dense GEMM. On fp8 GPUs (compute
    capability 8.9+) the activation is quantized per token too and torch._scaled_mm multiplies (W8A8);
    elsewhere the weight-only Triton kernel de-quantizes in registers."""
    from pagedkernels.fp8_gemm import fp8_tensor_cores, quantize_activation_fp8

    gen = _generator(device)
    weight = _randn(N, K, dtype=torch.float32, device=device, gen=gen) * 0.02
    q, scale = pk.quantize_fp8_weight(weight, per_channel=True)
    dense = (q.float() * scale.float().reshape(-1, 1)).to(dtype)
    x = _randn(M, K, dtype=dtype, device=device, gen=gen)
    out = torch.empty(M, N, dtype=dtype, device=device)
    w8a8 = fp8_tensor_cores(x.device) and K % 16 == 0 and N % 16 == 0

    def fn():
        return pk.fp8_gemm(x, q, scale, out=out)

    def reference():
        if w8a8:  # the product of what the GEMM multiplies: the per-token quantized activation
            x_q, x_scale = quantize_activation_fp8(x, None)
            return (x_q.float() * x_scale) @ dense.float().t()
        return x.float() @ dense.float().t()

    bytes_moved = q.numel() + scale.numel() * 4 + (x.numel() + out.numel()) * x.element_size()
    kind = "W8A8 per-token (torch._scaled_mm)" if w8a8 else "weight-only"
    return Case("fp8_gemm", f"{_gemm_shape(M, N, K)}, e4m3 per-channel, {kind}", dtype, fn, bytes_moved,
                flops=2 * M * N * K, bound="copy" if M <= 64 else "matmul",
                baselines=[_dense_linear_baseline(x, dense)],
                check=_gemm_check(fn, functools.cache(reference), dtype, device, "fp8_gemm"))


def fp8_kv_decode_case(device, dtype, *, num_seqs: int, seq_len: int, num_q_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int = 16) -> Case:
    """Paged decode over an e4m3 KV cache (per-layer k/v scales, de-quantized in registers) against the same
    decode over the 16-bit cache it was quantized from: half the bytes to stream."""
    gen = _generator(device)
    kv = random_paged_kv([seq_len] * num_seqs, num_kv_heads, head_dim, block_size, dtype, device, gen)
    fp8 = torch.float8_e4m3fn
    k_scale = float(kv.key_cache.abs().amax().float()) / torch.finfo(fp8).max
    v_scale = float(kv.value_cache.abs().amax().float()) / torch.finfo(fp8).max
    key_cache = (kv.key_cache.float() / k_scale).to(fp8)
    value_cache = (kv.value_cache.float() / v_scale).to(fp8)
    q = _randn(num_seqs, num_q_heads, head_dim, dtype=dtype, device=device, gen=gen)
    out = torch.empty_like(q)
    workspace = pk.decode_workspace(num_seqs, num_q_heads, num_kv_heads, head_dim, device=device)
    k_dense = dense_kv(key_cache, kv.block_tables, seq_len).float() * k_scale
    v_dense = dense_kv(value_cache, kv.block_tables, seq_len).float() * v_scale
    reference = _checker(lambda: reference_attention(q.unsqueeze(2), k_dense, v_dense).squeeze(2), dtype,
                         "fp8-KV decode")

    def fn():
        return pk.paged_decode_attention(q, key_cache, value_cache, kv.block_tables, kv.seq_lens, out=out,
                                         workspace=workspace, k_scale=k_scale, v_scale=v_scale)

    def make_16bit():
        out16 = torch.empty_like(q)
        return (lambda: pk.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                                  out=out16, workspace=workspace)), ""

    tokens = num_seqs * seq_len
    bytes_moved = 2 * tokens * num_kv_heads * head_dim + 2 * q.numel() * q.element_size() + kv.block_tables.numel() * 4
    return Case("paged_decode_attention fp8-KV",
                f"{num_seqs} seqs x {seq_len} tok, {_heads(num_q_heads, num_kv_heads, head_dim)}, block {block_size}",
                dtype, fn, bytes_moved, flops=4 * num_q_heads * head_dim * tokens, bound="copy",
                baselines=[Baseline(f"{DTYPE_NAMES[dtype]}-KV decode", make_16bit)], check=lambda: reference(fn()))


def _grouped_mm_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """A MoE layer on torch's grouped GEMM (``F.grouped_mm``, ``torch._grouped_mm`` before torch 2.10), as
    transformers' "grouped_mm" experts run it: the slots sorted by expert (a device sort, no host sync), their rows
    gathered, one grouped GEMM per projection over the experts' runs (offsets: a histogram's cumulative sum), SiLU
    and mul, the routing weights, the slots put back in order and each token's top-k summed."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        raise Skipped(f"torch {torch.__version__} has no grouped_mm")
    top_k, experts, intermediate = ids.shape[1], w13.shape[0], w2.shape[2]
    flat = ids.flatten()
    sorted_ids, order = torch.sort(flat)
    offsets = torch.cumsum(torch.histc(sorted_ids.float() if x.device.type == "cpu" else sorted_ids.int(),
                                       bins=experts, min=0, max=experts - 1), dim=0, dtype=torch.int32)
    gate_up = grouped_mm(x[order // top_k], w13.transpose(-2, -1), offs=offsets)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    down = grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
    weighted = down * weights.flatten()[order].to(down.dtype).unsqueeze(-1)
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(-1, top_k, unsorted.shape[-1]).float().sum(dim=1).to(x.dtype)


def fused_moe_case(device, dtype, *, tokens: int, experts: int, top_k: int, hidden: int, intermediate: int,
                   target: Target | None = None) -> Case:
    """One MoE layer (``pk.fused_moe``: both grouped GEMMs, the activation, the top-k sum, the alignment) on
    routing drawn from a softmax of random logits, against the per-expert loop (its PyTorch twin: a GEMM of each
    expert's tokens, transformers' eager loop). Bytes: the weights of the experts the batch routes to (each read
    once) and the activations; FLOPs: 2 x slots x 3 x H x I. Up to 64 tokens the layer is bound by those bytes
    (frac of copy bandwidth), from there by the matmul rate. Up to 64 tokens it is timed in a CUDA graph, as the
    engine's decode steps run it: launched from Python its five launches took longer than its kernels (the H200 of
    2026-11-30 timed one token at 0.29 ms and 16 tokens at 0.21 ms); the loop, which reads the routing on the host,
    runs eagerly. Past 64 tokens, where the matmul rate bounds it, against torch's grouped GEMM too (transformers'
    "grouped_mm" experts). On the CPU dry run the native kernel (bf16 panels, float32 activations) runs as the engine
    runs it."""
    gen = _generator(device)
    w13 = _randn(experts, 2 * intermediate, hidden, dtype=dtype, device=device, gen=gen) * 0.02
    w2 = _randn(experts, hidden, intermediate, dtype=dtype, device=device, gen=gen) * 0.02
    x = _randn(tokens, hidden, dtype=dtype, device=device, gen=gen)
    weights, ids = pk.moe_topk(_randn(tokens, experts, dtype=torch.float32, device=device, gen=gen), top_k,
                               renormalize=True)
    out = torch.empty(tokens, hidden, dtype=dtype, device=device)
    w13_kernel, w2_kernel = w13, w2
    if device.type == "cpu":
        w13, w2 = w13.bfloat16().to(dtype), w2.bfloat16().to(dtype)
        w13_kernel, w2_kernel = pk.pack_moe_weight(w13, torch.bfloat16), pk.pack_moe_weight(w2, torch.bfloat16)

    def fn():
        return pk.fused_moe(x, w13_kernel, w2_kernel, weights, ids, out=out)

    def reference():
        with pk.use_backend("torch"):
            return pk.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)

    def loop():
        loop_out = torch.empty_like(out)
        return (lambda: pk.fused_moe(x, w13, w2, weights, ids, out=loop_out)), ""

    def grouped():
        grouped_out = _grouped_mm_experts(x, w13, w2, weights, ids)
        assert_close(grouped_out, reference(), dtype, "grouped_mm experts")
        return (lambda: _grouped_mm_experts(x, w13, w2, weights, ids)), ""

    baselines = [Baseline("per-expert loop", loop, context=lambda: pk.use_backend("torch"), eager=True)]
    if tokens > 64:  # bound by the matmul rate: against the grouped GEMM torch has
        baselines.append(Baseline("torch grouped_mm", grouped))
    active = int(torch.unique(ids).numel())
    weight_bytes = active * 3 * hidden * intermediate * (2 if device.type == "cpu" else w13.element_size())
    bytes_moved = weight_bytes + 2 * x.numel() * x.element_size()
    return Case("fused_moe", f"{tokens} tokens, E={experts} top-{top_k}, H={hidden} I={intermediate} "
                             f"({active} experts routed to)", dtype, fn, bytes_moved,
                flops=2 * tokens * top_k * 3 * hidden * intermediate, bound="copy" if tokens <= 64 else "matmul",
                baselines=baselines, check=lambda: assert_close(fn(), reference(), dtype, "fused_moe"), target=target,
                graphed=tokens <= 64, breakdown=True)


@dataclass
class LoRAInputs:
    """A LoRA layer's step: ``x [M, K]``, slots stacked as the engine holds them (``lora_a [L, S*R, K]``,
    ``lora_b [L, N, R]``, the scaling folded in), each token's slot (``indices``, -1: the base model), the base
    layer's output ``base [M, N]``, and the grouping computed once per step (``mapping``: pagedkernels'
    lora_mapping and the slots' ranks; ``rows``: each slot's tokens, the per-adapter loop's)."""
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    indices: torch.Tensor
    base: torch.Tensor
    slice_sizes: tuple[int, ...]
    rank: int
    mapping: dict
    rows: list[torch.Tensor]


def lora_inputs(device, dtype, *, num_tokens: int, in_features: int, slice_sizes: tuple[int, ...], rank: int,
                num_adapters: int, gen: torch.Generator | None = None) -> LoRAInputs:
    """Random adapters in ``num_adapters`` slots; token t on slot ``t % (num_adapters + 1)``, the last value of the
    cycle meaning the base model (-1): every adapter and the base mixed through the batch, as a server's is."""
    gen = gen or _generator(device)
    num_slices, out_features = len(slice_sizes), sum(slice_sizes)
    x = _randn(num_tokens, in_features, dtype=dtype, device=device, gen=gen)
    lora_a = _randn(num_adapters, num_slices * rank, in_features, dtype=dtype, device=device, gen=gen) \
        * in_features ** -0.5
    lora_b = _randn(num_adapters, out_features, rank, dtype=dtype, device=device, gen=gen) * rank ** -0.5
    cycle = torch.arange(num_tokens, device=device) % (num_adapters + 1)
    indices = torch.where(cycle == num_adapters, -1, cycle).to(torch.int32)
    base = _randn(num_tokens, out_features, dtype=dtype, device=device, gen=gen)
    mapping = dict(zip(("sorted_token_ids", "lora_token_starts"), pk.lora_mapping(indices, num_adapters)))
    # every slot's rank, as the engine's LoRA layers pass them (all of them full here)
    mapping["lora_ranks"] = torch.full((num_adapters, num_slices), rank, dtype=torch.int32, device=device)
    rows = [(indices == slot).nonzero().squeeze(1) for slot in range(num_adapters)]
    return LoRAInputs(x, lora_a, lora_b, indices, base, tuple(slice_sizes), rank, mapping, rows)


def lora_grouped(inp: LoRAInputs, out: torch.Tensor) -> torch.Tensor:
    """pagedkernels: ``add_lora`` (the shrink and the expand) over the whole batch, every adapter at once, as the
    engine's LoRA layers call it."""
    return pk.add_lora(inp.x, inp.lora_a, inp.lora_b, inp.indices, out, slice_sizes=inp.slice_sizes, **inp.mapping)


def lora_apart(inp: LoRAInputs, out: torch.Tensor) -> torch.Tensor:
    """The two ops called one after the other (on CUDA the shrink's K-split planes summed by a third launch)."""
    buffer = pk.lora_shrink(inp.x, inp.lora_a, inp.indices, **inp.mapping)
    return pk.lora_expand(buffer, inp.lora_b, inp.indices, out, slice_sizes=inp.slice_sizes, **inp.mapping)


def lora_loop(inp: LoRAInputs, out: torch.Tensor) -> torch.Tensor:
    """The per-adapter loop a stack without grouped kernels runs (PEFT's mixed-batch forward): per adapter and
    slice, its tokens gathered, ``(x A^T) B^T`` in x's dtype, added back into their rows. Its row lists are
    computed once per step, as the kernels' grouping is."""
    rank = inp.rank
    for slot, rows in enumerate(inp.rows):
        if rows.numel() == 0:
            continue
        sub = inp.x.index_select(0, rows)
        offset = 0
        for s, size in enumerate(inp.slice_sizes):
            delta = (sub @ inp.lora_a[slot, s * rank:(s + 1) * rank].t()) @ inp.lora_b[slot, offset:offset + size].t()
            out[rows, offset:offset + size] += delta
            offset += size
    return out


def lora_reference(inp: LoRAInputs) -> torch.Tensor:
    """float32 base + delta, token by token's slot."""
    out = inp.base.float().clone()
    rank, a, b = inp.rank, inp.lora_a.float(), inp.lora_b.float()
    for slot, rows in enumerate(inp.rows):
        offset = 0
        for s, size in enumerate(inp.slice_sizes):
            out[rows, offset:offset + size] += (inp.x.float()[rows] @ a[slot, s * rank:(s + 1) * rank].t()) \
                @ b[slot, offset:offset + size].t()
            offset += size
    return out


def lora_case(device, dtype, *, num_tokens: int, in_features: int, slice_sizes: tuple[int, ...], rank: int = 16,
              num_adapters: int = 4) -> Case:
    """Multi-LoRA on one projection (``add_lora``: shrink + expand, the grouping shared by the step's layers
    computed before) against the per-adapter loop on the same batch, and against ``lora_shrink`` then
    ``lora_expand`` called apart (what ``add_lora`` saves: on CUDA at decode sizes, the planes' sum launch). Bytes:
    x, the weights of the adapters the batch uses, the base output read and written, the float32 buffer written and
    read; FLOPs: 2 M (K S R + N R). Up to 256 tokens (the engine's decode graphs) all are timed in a CUDA graph, as
    decode steps run them: launched from Python, the H200 of 2026-11-30 timed one token at 0.091 ms, more than the
    kernels' bytes could take."""
    inp = lora_inputs(device, dtype, num_tokens=num_tokens, in_features=in_features, slice_sizes=slice_sizes,
                      rank=rank, num_adapters=num_adapters)
    out = inp.base.clone()
    loop_out = inp.base.clone()
    width, out_features = len(slice_sizes) * rank, sum(slice_sizes)
    used = sum(int(r.numel() > 0) for r in inp.rows)
    size = inp.x.element_size()
    bytes_moved = (inp.x.numel() * size + used * (width * in_features + out_features * rank) * size
                   + 2 * num_tokens * out_features * size + 2 * num_tokens * width * 4)

    def check():
        assert_close(lora_grouped(inp, inp.base.clone()), lora_reference(inp), dtype, "lora shrink+expand")

    def loop():
        assert_close(lora_loop(inp, inp.base.clone()), lora_reference(inp), dtype, "per-adapter loop")
        return (lambda: lora_loop(inp, loop_out)), ""

    def apart():
        apart_out = inp.base.clone()
        assert_close(lora_apart(inp, inp.base.clone()), lora_reference(inp), dtype, "shrink then expand")
        return (lambda: lora_apart(inp, apart_out)), ""

    return Case("lora shrink+expand", f"{num_tokens} tok, {num_adapters} adapters + base, K={in_features} "
                f"slices={list(slice_sizes)} rank={rank}", dtype, lambda: lora_grouped(inp, out), bytes_moved,
                flops=2 * num_tokens * (in_features * width + out_features * rank),
                bound="copy" if num_tokens <= 64 else "matmul",
                baselines=[Baseline("per-adapter loop", loop), Baseline("shrink, expand apart", apart)],
                check=check, graphed=num_tokens <= 256, breakdown=True)


OP_OF_CASE = {decode_case: "paged_decode_attention", prefill_case: "paged_prefill_attention",
              reshape_and_cache_case: "reshape_and_cache", copy_blocks_case: "copy_blocks",
              swap_blocks_case: "swap_blocks", rms_norm_case: "rms_norm", fused_add_rms_norm_case: "fused_add_rms_norm",
              rotary_case: "rotary_embedding", silu_and_mul_case: "silu_and_mul", lora_case: "lora shrink+expand",
              sample_from_logits_case: "sample_from_logits", sampler_top_k_top_p_case: "sampler top-k/top-p draw"}
# The quantized ops (the GPU suite's phase "quant"), kept out of the main matrix.
QUANT_OP_OF_CASE = {wq_gemm_case: "wq_gemm", fp8_gemm_case: "fp8_gemm",
                    fp8_kv_decode_case: "paged_decode_attention fp8-KV", skinny_gemm_case: "skinny_gemm"}

# The mixture-of-experts layers (the GPU suite's phase "moe"), kept out of the main matrix.
MOE_OP_OF_CASE = {fused_moe_case: "fused_moe"}

# The issue's targets (H100, bf16).
DECODE_TARGET = Target("decode >= 0.90 of copy BW", "frac_of_peak", 0.90)
PREFILL_TARGET = Target("prefill >= 0.90 of SDPA-flash TFLOP/s", "ratio:sdpa-flash", 0.90)
ADD_RMS_TARGET = Target("fused add-RMSNorm >= 0.85 of copy BW", "frac_of_peak", 0.85)


def suite(device: torch.device, dtype: torch.dtype, *, tiny: bool = False,
          compile: bool = True) -> list[functools.partial]:
    """Case builders (partials of the ``*_case`` functions), run one at a time so only one case's
    tensors are alive. ``tiny`` keeps every shape relation (GQA groups, head sizes, targets) at sizes
    a CPU handles in seconds."""
    d, c = dict(device=device, dtype=dtype), dict(compile=compile)
    if tiny:
        attn = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
        return [
            partial(decode_case, **d, **c, num_seqs=4, seq_len=64, **attn, target=DECODE_TARGET),
            partial(decode_case, **d, **c, num_seqs=1, seq_len=256, **attn),
            partial(prefill_case, **d, **c, num_seqs=2, new_tokens=32, **attn, target=PREFILL_TARGET),
            partial(prefill_case, **d, **c, num_seqs=2, new_tokens=16, context=48, **attn),
            partial(reshape_and_cache_case, **d, num_tokens=64, num_kv_heads=2, head_dim=64),
            partial(copy_blocks_case, **d, num_layers=2, num_blocks=16, num_pairs=4, num_kv_heads=2, head_dim=64),
            partial(swap_blocks_case, **d, direction="d2h", num_blocks=16, num_pairs=4, num_kv_heads=2, head_dim=64),
            partial(rms_norm_case, **d, **c, num_tokens=16, hidden=256),
            partial(fused_add_rms_norm_case, **d, **c, num_tokens=16, hidden=256, target=ADD_RMS_TARGET),
            partial(rotary_case, **d, **c, num_tokens=16, num_q_heads=4, num_kv_heads=2, head_dim=64, max_position=64),
            partial(silu_and_mul_case, **d, **c, num_tokens=16, intermediate=128),
            partial(sample_from_logits_case, **d, **c, num_rows=4, vocab=5000),
            partial(sampler_top_k_top_p_case, **d, num_rows=4, vocab=5000),
            partial(sampler_top_k_top_p_case, **d, num_rows=4, vocab=5000, fused=True),
            partial(sampler_top_k_top_p_case, **d, num_rows=4, vocab=5000, top_k=0, top_p=0.9, fused=True),
            partial(lora_case, **d, num_tokens=1, in_features=256, slice_sizes=(128, 64, 64)),
            partial(lora_case, **d, num_tokens=64, in_features=256, slice_sizes=(128, 64, 64)),
        ]
    heads = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    cache = dict(num_kv_heads=8, head_dim=128)
    return [
        # decode: the target, batch-1 long context (split-K), GQA group 8, head 64, many short sequences
        partial(decode_case, **d, **c, num_seqs=64, seq_len=4096, **heads, target=DECODE_TARGET),
        partial(decode_case, **d, **c, num_seqs=1, seq_len=32768, **heads),
        partial(decode_case, **d, **c, num_seqs=64, seq_len=4096, num_q_heads=64, num_kv_heads=8, head_dim=128),
        partial(decode_case, **d, **c, num_seqs=64, seq_len=4096, num_q_heads=32, num_kv_heads=8, head_dim=64),
        partial(decode_case, **d, **c, num_seqs=256, seq_len=1024, **heads),
        # prefill: the target, head 64, GQA group 8, one long prompt, chunked prefill over a cached prefix
        partial(prefill_case, **d, **c, num_seqs=8, new_tokens=2048, **heads, target=PREFILL_TARGET),
        partial(prefill_case, **d, **c, num_seqs=8, new_tokens=2048, num_q_heads=32, num_kv_heads=8, head_dim=64),
        partial(prefill_case, **d, **c, num_seqs=8, new_tokens=2048, num_q_heads=64, num_kv_heads=8, head_dim=128),
        partial(prefill_case, **d, **c, num_seqs=1, new_tokens=8192, **heads),
        partial(prefill_case, **d, **c, num_seqs=4, new_tokens=512, context=4096, **heads),
        # cache ops
        partial(reshape_and_cache_case, **d, num_tokens=16384, **cache),
        partial(reshape_and_cache_case, **d, num_tokens=64, **cache),
        partial(copy_blocks_case, **d, num_layers=32, num_blocks=1024, num_pairs=256, **cache),
        partial(swap_blocks_case, **d, direction="d2h", num_blocks=2048, num_pairs=512, **cache),
        partial(swap_blocks_case, **d, direction="h2d", num_blocks=2048, num_pairs=512, **cache),
        # norms, rotary, activation
        partial(rms_norm_case, **d, **c, num_tokens=8192, hidden=4096),
        partial(fused_add_rms_norm_case, **d, **c, num_tokens=8192, hidden=4096, target=ADD_RMS_TARGET),
        partial(fused_add_rms_norm_case, **d, **c, num_tokens=64, hidden=4096),
        partial(rotary_case, **d, **c, num_tokens=8192, num_q_heads=32, num_kv_heads=8, head_dim=128),
        partial(silu_and_mul_case, **d, **c, num_tokens=8192, intermediate=14336),
        # the sampler's draw: a decode batch of 256 over Qwen3's vocabulary, sampled and greedy; a few rows
        partial(sample_from_logits_case, **d, **c, num_rows=256, vocab=151936),
        partial(sample_from_logits_case, **d, **c, num_rows=256, vocab=151936, temperature=0.0),
        partial(sample_from_logits_case, **d, **c, num_rows=8, vocab=151936),
        partial(sampler_top_k_top_p_case, **d, num_rows=256, vocab=151936),
        partial(sampler_top_k_top_p_case, **d, num_rows=8, vocab=151936),
        # ... and by the kernel's threshold search (Qwen3's top-k and top-p; Llama 3's top-p alone, which sorts)
        partial(sampler_top_k_top_p_case, **d, num_rows=256, vocab=151936, fused=True),
        partial(sampler_top_k_top_p_case, **d, num_rows=8, vocab=151936, fused=True),
        partial(sampler_top_k_top_p_case, **d, num_rows=256, vocab=128256, top_k=0, top_p=0.9, fused=True),
        partial(sampler_top_k_top_p_case, **d, num_rows=8, vocab=128256, top_k=0, top_p=0.9, fused=True),
        # multi-LoRA on Llama-3-8B's q/k/v (rank 16, 4 adapters + base mixed): decode, a decode batch, a prefill chunk
        *(partial(lora_case, **d, num_tokens=n, in_features=4096, slice_sizes=(4096, 1024, 1024))
          for n in (1, 64, 1024)),
        # ... and a decode step of phase 12's LoRA engine (Qwen3-0.6B: 128 rows, ranks 16), its four LoRA layers
        # (q/k/v, o, gate/up, down), times its 28 layers: the GPU time the adapters add to that step
        *(partial(lora_case, **d, num_tokens=128, in_features=k, slice_sizes=sizes)
          for k, sizes in ((1024, (2048, 1024, 1024)), (2048, (1024,)), (1024, (3072, 3072)), (3072, (1024,)))),
    ]


def quant_suite(device: torch.device, dtype: torch.dtype, *, tiny: bool = False) -> list[functools.partial]:
    """The quantized GEMMs against the 16-bit GEMM at decode (M = 1, 16) and prefill (M = 4096) shapes of a
    Llama-3-8B MLP projection (N = 14336, K = 4096), fp8-KV decode against 16-bit-KV decode, and the few-row GEMM
    against cuBLAS at batch-1 projection shapes."""
    d = dict(device=device, dtype=dtype)
    if tiny:
        return [partial(wq_gemm_case, **d, M=1, N=64, K=256, group_size=64),
                partial(wq_gemm_case, **d, M=80, N=64, K=256, group_size=64),
                partial(fp8_gemm_case, **d, M=1, N=64, K=256),
                partial(fp8_kv_decode_case, **d, num_seqs=4, seq_len=64, num_q_heads=4, num_kv_heads=2, head_dim=64),
                partial(skinny_gemm_case, **d, M=1, N=64, K=256)]
    mlp = dict(N=14336, K=4096)
    heads = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    return [
        *(partial(wq_gemm_case, **d, M=M, **mlp) for M in (1, 16, 4096)),
        *(partial(fp8_gemm_case, **d, M=M, **mlp) for M in (1, 16, 4096)),
        partial(fp8_kv_decode_case, **d, num_seqs=64, seq_len=4096, **heads),
        partial(fp8_kv_decode_case, **d, num_seqs=1, seq_len=32768, **heads),
        # the few-row GEMM against cuBLAS at batch-1 decode's projections: Qwen3-0.6B's qkv, o, gate_up, down, then
        # Llama-3-8B's gate_up and down, and 8 rows of the 0.6B qkv
        *(partial(skinny_gemm_case, **d, M=1, N=N, K=K)
          for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (28672, 4096), (4096, 14336))),
        partial(skinny_gemm_case, **d, M=8, N=4096, K=1024),
    ]


# Qwen3-30B-A3B's MoE layer (experts, top_k, hidden, intermediate), and Mixtral-8x7B's.
QWEN3_30B_A3B_MOE = dict(experts=128, top_k=8, hidden=2048, intermediate=768)
MIXTRAL_MOE = dict(experts=8, top_k=2, hidden=4096, intermediate=14336)
MOE_DECODE_TARGET = Target("MoE layer, 1-64 tokens >= 0.80 of copy BW (active experts' weights)", "frac_of_peak", 0.80)
MOE_PREFILL_TARGET = Target("MoE layer, 4096 tokens >= 0.60 of the bf16 matmul rate", "frac_of_peak", 0.60)


def moe_suite(device: torch.device, dtype: torch.dtype, *, tiny: bool = False) -> list[functools.partial]:
    """Qwen3-30B-A3B's layer at 1, 16, 64 tokens (each against copy bandwidth) and 4096 (against the matmul
    rate), Mixtral-8x7B's at 1 and 4096; each against the per-expert loop."""
    d = dict(device=device, dtype=dtype)
    if tiny:
        shape = dict(experts=8, top_k=2, hidden=128, intermediate=96)
        return [partial(fused_moe_case, **d, tokens=1, **shape, target=MOE_DECODE_TARGET),
                partial(fused_moe_case, **d, tokens=96, **shape, target=MOE_PREFILL_TARGET)]
    return [
        *(partial(fused_moe_case, **d, tokens=t, **QWEN3_30B_A3B_MOE, target=MOE_DECODE_TARGET) for t in (1, 16, 64)),
        partial(fused_moe_case, **d, tokens=4096, **QWEN3_30B_A3B_MOE, target=MOE_PREFILL_TARGET),
        partial(fused_moe_case, **d, tokens=1, **MIXTRAL_MOE),
        partial(fused_moe_case, **d, tokens=4096, **MIXTRAL_MOE),
    ]


# Launch configurations (BLOCK_M, TILE_N, num_warps, num_stages) of the prefill kernel tried on the target shape
# (head 128, GQA group 4, bf16) by the GPU suite's "tune" phase; the first is launch_config's own choice there.
PREFILL_SWEEP = [(128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3),
                 (64, 32, 4, 3), (64, 64, 8, 2), (128, 16, 8, 4), (256, 32, 8, 2), (128, 128, 8, 2)]
TINY_PREFILL_SWEEP = [(32, 32, 4, 1), (64, 16, 4, 1)]


def _launched_under(case: Case, context: Callable[[], contextlib.AbstractContextManager]) -> Case:
    """``case`` with its call and its check run inside ``context()`` (a launch configuration patched in)."""
    launch, check = case.fn, case.check

    def fn():
        with context():
            return launch()

    def checked():
        with context():
            check()

    case.fn, case.check = fn, checked
    return case


def prefill_launch_config(config: tuple[int, int, int, int]) -> contextlib.AbstractContextManager:
    """pagedkernels' prefill wrapper launching with ``config`` inside (its heuristic set aside)."""
    return mock.patch.object(importlib.import_module("pagedkernels.prefill_attention"), "launch_config",
                             lambda *args, **kwargs: config)


def prefill_tile_case(device, dtype, *, config: tuple[int, int, int, int], baseline: bool, **shape) -> Case:
    """The prefill case with its kernel launched at ``config``; the SDPA-flash baseline only where ``baseline``
    (once per sweep)."""
    case = _launched_under(prefill_case(device, dtype, compile=False, **shape),
                           lambda: prefill_launch_config(config))
    block_m, tile_n, warps, stages = config
    case.op = "paged_prefill_attention tiles"
    case.shape += f"; BLOCK_M {block_m} TILE_N {tile_n} warps {warps} stages {stages}"
    case.baselines = [b for b in case.baselines if baseline and b.name == "sdpa-flash"]
    return case


def tune_suite(device: torch.device, dtype: torch.dtype, *, tiny: bool = False) -> list[functools.partial]:
    """The prefill kernel's launch configurations on the target shape (8 x 2048 new tokens, 32q/8kv heads, d128),
    against SDPA-flash measured once: which tiles the heuristic should pick on this GPU. Then the decode kernel's
    split count on its target shape and smaller batches (DECODE_SPLIT_SWEEP): whether decode_num_splits follows this
    GPU (the H200 reached 0.879 of its copy bandwidth at the heuristic's one split where the H100 reached 0.976), and
    its tile, pipelining and warps on the target shape (DECODE_LAUNCH_SWEEP).
    Last the few-row GEMM's launch configurations at batch-1 projections (SKINNY_SWEEP), against cuBLAS once per
    shape: which ones skinny_gemm_config should pick; and its heuristic against cuBLAS at the LM heads
    (SKINNY_HEAD_SHAPES)."""
    d = dict(device=device, dtype=dtype)
    if tiny:
        shape = dict(num_seqs=2, new_tokens=32, num_q_heads=4, num_kv_heads=2, head_dim=64)
        configs = TINY_PREFILL_SWEEP
        decode_sweep = [(2, 64, splits) for splits in (None, 1, 2)]
        decode_heads = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
        decode_launch_shape, decode_launch_sweep = dict(num_seqs=2, seq_len=64), [(None, None, None), (64, 2, 4)]
    else:
        shape = dict(num_seqs=8, new_tokens=2048, num_q_heads=32, num_kv_heads=8, head_dim=128)
        configs = PREFILL_SWEEP
        decode_sweep = DECODE_SPLIT_SWEEP
        decode_heads = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
        decode_launch_shape, decode_launch_sweep = dict(num_seqs=64, seq_len=4096), DECODE_LAUNCH_SWEEP
    skinny_shapes, skinny_configs, skinny_rows = (([(64, 256)], ["deep", (2, 128, 4, False), (2, 64, 4, True)],
                                                   (2,)) if tiny
                                                  else (SKINNY_SWEEP_SHAPES, ["deep", *SKINNY_SWEEP],
                                                        SKINNY_SWEEP_ROWS))
    moe_sweep = ([(dict(tokens=1, experts=8, top_k=2, hidden=128, intermediate=96),
                   [None, "aligned", "gemv", "gemv+pdl", (16, 16, 32, 32, 4, 1)])] if tiny else MOE_LAUNCH_SWEEP)
    return [partial(prefill_tile_case, **d, config=c, baseline=i == 0, **shape) for i, c in enumerate(configs)] + [
        partial(decode_split_case, **d, num_seqs=n, seq_len=length, num_splits=splits, **decode_heads)
        for n, length, splits in decode_sweep] + [
        partial(decode_launch_case, **d, config=c, **decode_launch_shape, **decode_heads)
        for c in decode_launch_sweep] + [
        partial(skinny_config_case, **d, M=1, N=N, K=K, config=c, baseline=c is None)
        for N, K in skinny_shapes for c in [None, *skinny_configs]
        if isinstance(c, str) or c is None or c[1] <= 1 << (K - 1).bit_length()] + [
        partial(skinny_config_case, **d, M=M, N=N, K=K, config=None, baseline=True)
        for M in skinny_rows for N, K in skinny_shapes] + [
        partial(skinny_config_case, **d, M=1, N=N, K=K, config=None, baseline=True)
        for N, K in ([] if tiny else SKINNY_HEAD_SHAPES)] + [
        partial(moe_config_case, **d, config=c, **shape) for shape, sweep in moe_sweep for c in sweep]


# fused_moe's launches tried by the "tune" phase: (BLOCK_M, GEMM 1's BLOCK_N (gated: each of gate and up), GEMM 2's
# BLOCK_N, BLOCK_K, num_warps, num_stages) for both grouped GEMMs, None the wrapper's own (fused_moe_launch_config).
# The H200 of 2026-11-30 read 0.88-0.92 of copy bandwidth at 16 and 64 tokens of Qwen3-30B-A3B's layer with the
# wrapper's launches and 0.32 of the bf16 matmul rate at 4096 (0.41 at Mixtral's): whether wider tiles, deeper K
# tiles or more stages (vLLM's tuned H200 table: 16 x 64 x 64-128, 4-5 stages, at decode; 128 x 256 x 64, 8 warps,
# 4 stages from 1024 tokens) do better. Decode launches first (one token: the weights of 8 experts), then prefill.
# "aligned": the wrapper's launches with the alignment kernel run even where the slots are sparse enough for the
# direct layout (fused_moe.direct_layout: one token of 128 experts, four at its limit), to weigh the launch it saves
# against the weights two slots of one expert read twice. "gemv": the matrix-vector launches instead
# (fused_moe.gemv_layout: two launches, no 16-row tile of one real row, the top-k sum inside the second), "gemv+pdl"
# the same chained by programmatic dependent launch (Hopper): the H200 read 0.52 of copy bandwidth at one token of
# Qwen3-30B-A3B's layer whatever the tiles, 0.74 at four. At 4096 tokens (0.50 of the matmul rate, 0.89 ms) the
# rows note each launch's time (Case.breakdown); 128 x 256 tiles 128 deep over 2 stages (96 KB a stage) halve the K
# steps of a tile, where Qwen3-30B-A3B's GEMM 2 has twelve 64-deep ones (K = I = 768) between prologue and epilogue.
MOE_DECODE_LAUNCHES = [None, "aligned", "gemv", "gemv+pdl",
                       (16, 32, 64, 64, 4, 4), (16, 32, 64, 64, 4, 5), (16, 32, 64, 128, 4, 3),
                       (16, 64, 128, 128, 4, 3), (16, 32, 64, 256, 4, 2), (16, 16, 32, 256, 4, 2), (16, 64, 64, 64, 4, 4),
                       (16, 16, 32, 64, 4, 5)]
MOE_PREFILL_LAUNCHES = [None, (128, 128, 256, 64, 8, 4), (128, 64, 128, 64, 8, 4), (128, 64, 128, 64, 4, 3),
                        (64, 64, 128, 64, 4, 3), (128, 128, 128, 64, 8, 3), (64, 128, 256, 64, 8, 4),
                        (128, 64, 256, 64, 8, 4), (128, 128, 256, 128, 8, 2)]
MOE_LAUNCH_SWEEP = [
    (dict(tokens=1, **QWEN3_30B_A3B_MOE), MOE_DECODE_LAUNCHES),
    (dict(tokens=1, **MIXTRAL_MOE), MOE_DECODE_LAUNCHES),
    (dict(tokens=4, **QWEN3_30B_A3B_MOE), [None, "aligned", "gemv", "gemv+pdl"]),
    (dict(tokens=16, **QWEN3_30B_A3B_MOE), MOE_DECODE_LAUNCHES),
    (dict(tokens=4096, **QWEN3_30B_A3B_MOE), MOE_PREFILL_LAUNCHES),
    (dict(tokens=4096, **MIXTRAL_MOE), MOE_PREFILL_LAUNCHES),
]


def moe_launch_config(config: tuple[int, int, int, int, int, int]) -> contextlib.AbstractContextManager:
    """fused_moe launching both grouped GEMMs with ``config`` (see MOE_DECODE_LAUNCHES) inside."""
    block_m, block_n1, block_n2, block_k, warps, stages = config
    fused = importlib.import_module("pagedkernels.fused_moe")

    def launch(num_tokens, num_experts, top_k, n, k, gated, dtype, device_kind, *, capability=None):
        return fused.MoELaunchConfig(block_m, block_n1 if gated else block_n2, block_k, 1 if block_m == 16 else 8,
                                     warps, stages)
    return mock.patch.object(fused, "fused_moe_launch_config", launch)


def moe_aligned_layout() -> contextlib.AbstractContextManager:
    """fused_moe sorting and padding its slots by expert (the alignment kernel) at every size: no direct layout."""
    return mock.patch.object(importlib.import_module("pagedkernels.fused_moe"), "direct_layout",
                             lambda *args: False)


@contextlib.contextmanager
def moe_gemv_layout(pdl: bool = False) -> Iterator[None]:
    """fused_moe taking its matrix-vector launches (fused_moe.gemv_layout) up to 64 tokens; ``pdl``: with
    programmatic dependent launch on as well (where the device has it)."""
    previous = pk.set_moe_gemv_max_tokens(64)
    previous_pdl = pk.set_programmatic_dependent_launch(pdl)
    try:
        yield
    finally:
        pk.set_programmatic_dependent_launch(previous_pdl)
        pk.set_moe_gemv_max_tokens(previous)


MOE_LAYOUTS = {"aligned": (moe_aligned_layout, "heuristic, aligned layout"),
               "gemv": (moe_gemv_layout, "matrix-vector launches"),
               "gemv+pdl": (lambda: moe_gemv_layout(pdl=True), "matrix-vector launches, PDL")}


def moe_config_case(device, dtype, *, config: tuple[int, int, int, int, int, int] | str | None, **shape) -> Case:
    """One MoE layer at ``config`` (None: the wrapper's own launches, with the per-expert loop beside it; a name of
    MOE_LAYOUTS: "aligned", the alignment kernel at every size, "gemv" / "gemv+pdl", the matrix-vector launches; see
    MOE_DECODE_LAUNCHES)."""
    case = fused_moe_case(device, dtype, **shape)
    if config is not None:
        case = _launched_under(case, MOE_LAYOUTS[config][0] if isinstance(config, str) else
                               lambda: moe_launch_config(config))
        case.baselines = []
    case.op = "fused_moe configs"
    case.shape += ("; heuristic" if config is None else "; " + MOE_LAYOUTS[config][1] if isinstance(config, str) else
                   "; BLOCK_M {} BLOCK_N {}/{} BLOCK_K {} warps {} stages {}".format(*config))
    return case


# skinny_gemm's (BLOCK_N, BLOCK_K, num_warps, prefetch) tried by the "tune" phase at batch-1 projection shapes
# (SKINNY_SWEEP_SHAPES), beside the wrapper's own heuristic (skinny_gemm_config) and its deep launches
# (set_skinny_gemm_deep), each timed as a chain of calls on copies of the weights (skinny_gemm_case). A program runs
# K one tile at a time, so a program of few rows makes K / BLOCK_K memory round trips in a row: the 0.6B down
# projection (N 1024, K 3072) takes the heuristic's one row a program, six 1 KiB tiles, 1 MiB in flight over the
# grid. Whether wider tiles (whole rows in one or two round trips), two tiles in flight (prefetch), or both, serve
# the small projections better; BLOCK_K wider than K's power of two is not tried.
SKINNY_SWEEP = [(1, 1024, 4, False), (1, 2048, 4, False), (1, 4096, 4, False), (1, 4096, 8, False),
                (2, 1024, 4, False), (2, 2048, 4, False), (4, 1024, 4, False), (4, 1024, 8, False),
                (8, 512, 4, False), (16, 512, 8, False),
                (1, 512, 4, True), (1, 1024, 4, True), (2, 1024, 4, True), (4, 512, 4, True), (4, 1024, 4, True),
                (8, 512, 4, True), (16, 256, 4, True), (16, 512, 8, True)]
# (N, K) at one row: Qwen3-0.6B's qkv, o, gate_up and down, Llama-3-8B's qkv, o, gate_up and down
SKINNY_SWEEP_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                       (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
# then the heuristic's launch against cuBLAS at these row counts (the engine's few-row limit: up to how many)
SKINNY_SWEEP_ROWS = (2, 4, 8)
# and at one row, the LM heads of the two shapes (vocabulary x hidden), the heuristic against cuBLAS: the largest
# product of a 0.6B step (a quarter of its bytes) and what the engine runs on cuBLAS now; whether routing it
# through skinny_gemm (with the final norm folded into it, one kernel fewer) could pay
SKINNY_HEAD_SHAPES = [(151936, 1024), (128256, 4096)]


@contextlib.contextmanager
def _skinny_deep() -> Iterator[None]:
    previous = pk.set_skinny_gemm_deep(True)
    try:
        yield
    finally:
        pk.set_skinny_gemm_deep(previous)


def skinny_launch_config(config: tuple[int, int, int, bool] | str) -> contextlib.AbstractContextManager:
    """skinny_gemm launching with ``config`` (BLOCK_N, BLOCK_K, num_warps, prefetch) inside (its heuristic set
    aside); "deep": the heuristic with set_skinny_gemm_deep on."""
    if config == "deep":
        return _skinny_deep()
    return mock.patch.object(importlib.import_module("pagedkernels.skinny_gemm"), "skinny_gemm_config",
                             lambda M, N, K, num_multiprocessors: config)


def skinny_config_case(device, dtype, *, config: tuple[int, int, int, bool] | str | None, baseline: bool, M: int,
                       N: int, K: int) -> Case:
    """The few-row GEMM at ``config`` (None: the heuristic's; "deep": its deep launches), cuBLAS beside it only where
    ``baseline``."""
    case = skinny_gemm_case(device, dtype, M=M, N=N, K=K)
    if config is not None:
        case = _launched_under(case, lambda: skinny_launch_config(config))
    case.op = "skinny_gemm configs"
    case.shape += ("; heuristic" if config is None else "; heuristic, deep" if config == "deep" else
                   "; BLOCK_N {} BLOCK_K {} warps {}{}".format(*config[:3], ", prefetch" if config[3] else ""))
    if not baseline:
        case.baselines = []
    return case


# (sequences, context, split count) of the decode kernel tried by the "tune" phase, 32q/8kv heads, d128, bf16; None
# is the wrapper's own heuristic (decode_num_splits), measured beside the forced counts.
DECODE_SPLIT_SWEEP = [(64, 4096, s) for s in (None, 1, 2, 3, 4)] + [(16, 4096, s) for s in (None, 2, 4, 8)] + \
                     [(4, 4096, s) for s in (None, 8, 16, 32)]


# (TILE_N, num_stages, num_warps) of the decode split kernel tried by the "tune" phase at the headline shape (64 x 4096
# tokens, one split): whether a longer tile, deeper pipelining or more warps keep more bytes in flight on a GPU whose
# memory is faster than the H100's for the same SM count (the H200 read 0.879 of its copy bandwidth there with the
# wrapper's launch, 32 / Triton's default 3 / 4; the H100 0.976). None: the wrapper's own choice.
DECODE_LAUNCH_SWEEP = [(None, None, None), (32, 2, 4), (32, 4, 4), (32, 3, 8), (64, 2, 4), (64, 3, 4), (64, 3, 8)]


def decode_launch_config(tile_n: int | None, num_stages: int | None, num_warps: int | None
                         ) -> contextlib.AbstractContextManager:
    """The decode split kernel launching with TILE_N ``tile_n``, ``num_stages`` stages and ``num_warps`` warps inside
    (None: the wrapper's own for that one)."""
    module = importlib.import_module("pagedkernels.decode_attention")
    stack = contextlib.ExitStack()
    if tile_n is not None:
        stack.enter_context(mock.patch.object(module, "TILE_N", tile_n))
    if num_stages is not None:
        stack.enter_context(mock.patch.object(module, "SPLIT_NUM_STAGES", num_stages))
    if num_warps is not None:
        stack.enter_context(mock.patch.object(module, "launch_config", lambda dtype, device_kind: num_warps))
    return stack


def decode_launch_case(device, dtype, *, config: tuple[int | None, int | None, int | None], **shape) -> Case:
    """The decode case (the heuristic's splits) launched at ``config`` (TILE_N, num_stages, num_warps), without
    baselines."""
    case = _launched_under(decode_case(device, dtype, compile=False, **shape), lambda: decode_launch_config(*config))
    case.op = "paged_decode_attention launch"
    case.shape += ("; wrapper's launch" if config == (None, None, None)
                   else "; TILE_N {} stages {} warps {}".format(*("default" if v is None else v for v in config)))
    case.baselines = []
    return case


def decode_split_case(device, dtype, *, num_splits: int | None, **shape) -> Case:
    """The decode case at a forced split count (None: the heuristic's), without baselines."""
    case = decode_case(device, dtype, compile=False, num_splits=num_splits, **shape)
    case.op = "paged_decode_attention splits"
    case.shape += f"; splits {'heuristic' if num_splits is None else num_splits}"
    case.baselines = []
    return case


# ------------------------------------------------------------------------------------------------
# running and printing
# ------------------------------------------------------------------------------------------------


def run_suite(device: torch.device | str, *, tiny: bool = False, compile: bool = True, only: str | None = None,
              log: Callable[[str], None] = print, timer: Timer | None = None,
              on_progress: Callable[[dict], None] | None = None, headline: bool = False,
              baselines: set[str] | None = None, budget=None, case_s: float = 60.0, peaks: Peaks | None = None,
              quant: bool = False, tune: bool = False, moe: bool = False) -> dict:
    """Measure the limits (unless ``peaks`` are given), then every case. Returns {"peaks", "rows", "targets",
    "not_run"} (plain dicts), also handed to ``on_progress`` after each case (so a caller can save partial
    results). On CUDA: bf16 and do_bench; on CPU: fp32 and the wall-clock timer (``timer`` overrides).

    only: the cases whose op names hold one of these comma-separated strings. headline: only the cases that carry
    one of the issue's targets. baselines: keep only the baselines of these
    names. budget (a bench.budget.Budget): no case is started with less than ``case_s`` seconds left; the ones
    left out are listed in "not_run". quant: the quantized ops' cases (:func:`quant_suite`) instead of the main
    matrix; tune: the prefill launch-configuration sweep (:func:`tune_suite`); moe: the MoE layers
    (:func:`moe_suite`)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench.kernels: CUDA is not available on this machine (use --device cpu for a dry run)")
        timer, dtype = timer or cuda_timer, torch.bfloat16
    else:
        timer, dtype = timer or wall_timer, torch.float32
    if peaks is None:
        peaks = measure_peaks(device, timer, tiny=tiny)
        log(format_peaks(dataclasses.asdict(peaks)))
    rows: list[Row] = []
    targets, not_run = [], []
    if tune:
        builds, op_of = tune_suite(device, dtype, tiny=tiny), {prefill_tile_case: "paged_prefill_attention tiles",
                                                              decode_split_case: "paged_decode_attention splits",
                                                              decode_launch_case: "paged_decode_attention launch",
                                                              skinny_config_case: "skinny_gemm configs",
                                                              moe_config_case: "fused_moe configs"}
    elif quant:
        builds, op_of = quant_suite(device, dtype, tiny=tiny), QUANT_OP_OF_CASE
    elif moe:
        builds, op_of = moe_suite(device, dtype, tiny=tiny), MOE_OP_OF_CASE
    else:
        builds, op_of = suite(device, dtype, tiny=tiny, compile=compile), OP_OF_CASE
    for build in builds:
        if (only and not any(part in op_of[build.func] for part in only.split(","))) \
                or (headline and build.keywords.get("target") is None):
            continue
        if budget is not None and not budget.allows(case_s):
            not_run.append(f"{op_of[build.func]} {_case_keywords(build)}")
            log(f"  {not_run[-1]}: not run ({budget.remaining():.0f} s of the budget left)")
            continue
        try:
            case = build()
        except Exception as e:
            log(f"  {build.func.__name__}({build.keywords}) could not be built: {_first_line(e)}")
            continue
        if baselines is not None:
            case.baselines = [b for b in case.baselines if b.name in baselines]
        start = time.perf_counter()
        case_rows = run_case(case, timer, peaks)
        rows += case_rows
        if case.target is not None:
            targets.append(evaluate_target(case, case_rows))
        log(f"  {case.op} [{case.shape}]: {_fmt(case_rows[0].ms, '.4f')} ms, check {case_rows[0].check} "
            f"({time.perf_counter() - start:.1f} s)")
        del case, case_rows
        _free(device)
        if compile:
            # Every case compiles FlexAttention afresh (new shapes, new mask closures); without a reset
            # the recompiles pile up on flex_attention's code object until dynamo's recompile limit
            # (8) sends it back to eager, which materializes whole score matrices.
            torch._dynamo.reset()
        if on_progress is not None:
            on_progress(_result(peaks, rows, targets, not_run))
    return _result(peaks, rows, targets, not_run)


def _case_keywords(build: functools.partial) -> str:
    return ", ".join(f"{k}={v}" for k, v in build.keywords.items()
                     if k not in ("device", "dtype", "compile", "target", "baseline"))


def _result(peaks: Peaks, rows: list[Row], targets: list[dict], not_run: list[str]) -> dict:
    return {"peaks": dataclasses.asdict(peaks), "rows": [dataclasses.asdict(r) for r in rows],
            "targets": list(targets), "not_run": list(not_run)}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _num(value: float | None) -> str:
    """Three significant figures at most, without exponents for the usual ranges."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


COLUMNS = ("op", "shape", "dtype", "ms", "GB/s", "TFLOP/s", "frac_of_peak", "baseline", "baseline_ms", "ratio",
           "check")


def table_cells(row: dict) -> list[str]:
    frac = "-" if row["frac_of_peak"] is None else f"{row['frac_of_peak']:.3f} of {row['peak']}"
    baseline = row["baseline"] or "-"
    if row["baseline"] and row["baseline_ms"] is None:
        baseline += f" ({row['note']})"
    return [row["op"], row["shape"], row["dtype"], _fmt(row["ms"], ".4f"), _num(row["gbps"]),
            _num(row["tflops"]), frac, baseline, _fmt(row["baseline_ms"], ".4f"), _fmt(row["ratio"], ".2f"),
            row["check"]]


def format_table(rows: list[dict]) -> str:
    """Plain-text tables, one per op; ratio = baseline_ms / ms (above 1: pagedkernels is faster)."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        cells = [list(COLUMNS)] + [table_cells(r) for r in rows if r["op"] == op]
        widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
        out.append(f"== {op}")
        for i, line in enumerate(cells):
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
            if i == 0:
                out.append("  ".join("-" * w for w in widths))
        out.append("")
    return "\n".join(out)


def format_peaks(peaks: dict) -> str:
    text = (f"measured limits: copy {peaks['copy_gbps']:.1f} GB/s ({peaks['copy_bytes'] >> 20} MiB d2d), "
            f"{peaks['matmul_dtype']} matmul {_num(peaks['matmul_tflops'])} TFLOP/s ({peaks['matmul_n']}^3)")
    if peaks.get("h2d_gbps"):
        text += f", pinned H2D {peaks['h2d_gbps']:.1f} GB/s, D2H {peaks['d2h_gbps']:.1f} GB/s"
    return text


def format_targets(targets: list[dict]) -> str:
    lines = ["targets:"]
    for t in targets:
        lines.append(f"  [{t['status'].upper():4}] {t['target']}: {_fmt(t['value'], '.3f')} "
                     f"(need >= {t['threshold']}) -- {t['op']} {t['shape']} {t['note']}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (dry run: tiny shapes, wall clock)")
    parser.add_argument("--dry-run", action="store_true", help="same as --device cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines (eager FlexAttention)")
    parser.add_argument("--only", help="run only ops whose name contains this")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--quant", action="store_true",
                        help="the quantized ops (W4A16 and FP8 GEMMs, fp8-KV decode) instead of the main matrix")
    parser.add_argument("--tune", action="store_true", help="the prefill kernel's launch-configuration sweep and the decode kernel's split counts")
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts layers instead of the main matrix")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.kernels: CUDA is not available on this machine; run on a GPU, or use --dry-run "
              "(--device cpu) to exercise the reporting code on tiny CPU shapes", file=sys.stderr)
        return 2
    result = run_suite(device, tiny=device == "cpu", compile=not args.no_compile, only=args.only, quant=args.quant,
                       tune=args.tune, moe=args.moe)
    print()
    print(format_table(result["rows"]))
    print(format_targets(result["targets"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
