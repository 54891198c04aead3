"""pagedkernels.cpu_graph: native kernel calls recorded once, replayed from C on whatever the inputs hold then; the
torch operations between them replayed through torch; intermediates laid out in a shared arena by lifetime;
captures that a replay could not follow refused."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native
from pagedkernels.cpu_graph import CPUGraph, CPUGraphPool, GraphCaptureError, _assign_offsets

pytestmark = pytest.mark.skipif(_native.library() is None, reason="native CPU kernels unavailable (no C compiler)")

HIDDEN, INTER = 64, 96


def _block(gen):
    """A decoder-like chain: norm -> gate/up product -> SiLU-and-mul -> down product + bias (a torch op) ->
    residual norm, over the static input ``x``; returns (static inputs, callable)."""
    weights = {
        "norm": torch.rand(HIDDEN, generator=gen) + 0.5,
        "up": pk.pack_w16((torch.randn(2 * INTER, HIDDEN, generator=gen) / 8).to(torch.bfloat16)),
        "down": pk.pack_w16((torch.randn(HIDDEN, INTER, generator=gen) / 8).to(torch.bfloat16)),
        "bias": torch.randn(HIDDEN, generator=gen),
    }
    x = torch.randn(3, HIDDEN, generator=gen)
    residual = torch.randn(3, HIDDEN, generator=gen)

    def fn():
        h = pk.rms_norm(x, weights["norm"], 1e-6)
        up = pk.w16_gemm(h, weights["up"], 2 * INTER)
        act = pk.silu_and_mul(up)
        down = pk.w16_gemm(act, weights["down"], HIDDEN) + weights["bias"]
        res = residual.clone()
        out = pk.fused_add_rms_norm(down, res, weights["norm"], 1e-6)
        return out[0] * 2.0

    return x, residual, fn


def test_replay_follows_the_inputs_and_equals_eager():
    gen = torch.Generator().manual_seed(0)
    x, residual, fn = _block(gen)
    graph = CPUGraph()
    recorded = graph.capture(fn)
    torch.testing.assert_close(recorded, fn(), rtol=0, atol=0)
    # norm, two products, SiLU-and-mul, the residual norm: kernels; the bias add, the clone, the scaling: torch
    assert graph.num_kernel_calls == 5 and graph.num_torch_calls == 3
    for step in range(3):
        x.copy_(torch.randn(x.shape, generator=gen))
        residual.copy_(torch.randn(residual.shape, generator=gen))
        out = graph.replay()
        assert out.data_ptr() == graph.output.data_ptr(), "a replay rewrites the same output tensor"
        torch.testing.assert_close(out, fn(), rtol=0, atol=0, msg=lambda m: f"replay {step}: {m}")


def test_intermediates_share_the_arena_by_lifetime():
    """Twenty chained norms: each intermediate dies after the next norm reads it, so the arena holds about two
    of them at a time, not twenty; the replay still equals the eager chain."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=gen)
    weight = torch.rand(256, generator=gen) + 0.5

    def chain():
        h = x
        for _ in range(20):
            h = pk.rms_norm(h, weight, 1e-6)
        return h

    graph = CPUGraph()
    graph.capture(chain)
    one = x.numel() * x.element_size()
    assert graph.num_kernel_calls == 20 and graph.num_torch_calls == 0
    assert graph.arena_bytes <= 3 * one, graph.arena_bytes
    x.copy_(torch.randn(x.shape, generator=gen))
    torch.testing.assert_close(graph.replay(), chain(), rtol=0, atol=0)


def test_assign_offsets_never_overlaps_live_buffers():
    rng = random.Random(0)
    for _ in range(200):
        lifetimes = {}
        for key in range(rng.randint(1, 30)):
            first = rng.randint(0, 40)
            lifetimes[key] = (rng.randint(1, 5000), first, first + rng.randint(0, 10))
        offsets, total = _assign_offsets(lifetimes)
        for a, (na, fa, la) in lifetimes.items():
            assert offsets[a] % 64 == 0 and offsets[a] + na <= total
            for b, (nb, fb, lb) in lifetimes.items():
                if a < b and fa <= lb and fb <= la:   # both live at some step
                    assert offsets[a] + na <= offsets[b] or offsets[b] + nb <= offsets[a], (a, b)


def test_graphs_of_one_pool_replay_in_turn_after_the_arena_grows():
    """A small graph, then a larger one that grows the shared arena (moving it): both replay correctly, in any
    order."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.rand(HIDDEN, generator=gen) + 0.5
    up = pk.pack_w16((torch.randn(2 * INTER, HIDDEN, generator=gen) / 8).to(torch.bfloat16))
    pool = CPUGraphPool()
    inputs, graphs = [], []
    for rows in (1, 16):
        x = torch.randn(rows, HIDDEN, generator=gen)
        fn = (lambda x=x: pk.silu_and_mul(pk.w16_gemm(pk.rms_norm(x, weight, 1e-6), up, 2 * INTER)))
        graph = CPUGraph(pool)
        graph.capture(fn)
        inputs.append((x, fn))
        graphs.append(graph)
    assert pool.version == 2, "the second graph must have grown the arena"
    for i in (0, 1, 1, 0):
        x, fn = inputs[i]
        x.copy_(torch.randn(x.shape, generator=gen))
        torch.testing.assert_close(graphs[i].replay(), fn(), rtol=0, atol=0)


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_a_reshape_that_copies_is_replayed(inference):
    """reshape is a view when it can be and a copy when not (a transposed input): the copy is computation, so
    the replay redoes it on the inputs of the time; views of the same tensors stay memory only."""
    x = torch.randn(6, HIDDEN)
    weight = torch.rand(HIDDEN) + 0.5

    def fn():
        h = pk.rms_norm(x, weight, 1e-6)
        flat = h.t().reshape(-1)              # copies: h.t() is not contiguous
        again = flat.view(HIDDEN, 6).reshape(6, HIDDEN)   # views
        return pk.rms_norm(again, weight, 1e-6)

    with torch.inference_mode(inference):
        graph = CPUGraph()
        graph.capture(fn)
        assert graph.num_kernel_calls == 2 and graph.num_torch_calls == 1
        x.copy_(torch.randn(x.shape))
        torch.testing.assert_close(graph.replay(), fn(), rtol=0, atol=0)


def test_host_reads_of_values_are_refused():
    x = torch.randn(4, HIDDEN)
    weight = torch.ones(HIDDEN)

    def reads_a_value():
        h = pk.rms_norm(x, weight, 1e-6)
        return h * float(h.sum())

    with pytest.raises(GraphCaptureError, match="host"):
        CPUGraph().capture(reads_a_value)


def test_work_outside_the_kernels_and_the_dispatcher_is_caught():
    """numpy changing an intermediate in place (as a torch.distributed collective would) is invisible to both
    recorders: the capture's check replay differs from the recording run."""
    x = torch.randn(4, HIDDEN)
    weight = torch.ones(HIDDEN)

    def numpy_side_effect():
        h = pk.rms_norm(x, weight, 1e-6)
        h.numpy()[:] += 1.0
        return pk.rms_norm(h, weight, 1e-6)

    with pytest.raises(GraphCaptureError, match="differs"):
        CPUGraph().capture(numpy_side_effect)


def test_a_kernel_refusing_its_inputs_at_replay_raises_naming_it():
    """Replays skip the Python argument checks; the kernels' own value checks still hold: a slot past the cache
    written into the static slot mapping after capture makes reshape_and_cache refuse, and the replay raise."""
    key_cache = torch.zeros(4, 8, 2, 32)
    value_cache = torch.zeros_like(key_cache)
    k = torch.randn(3, 2, 32)
    slots = torch.tensor([0, 5, 9])

    def write():
        pk.reshape_and_cache(k, k, key_cache, value_cache, slots)
        return key_cache.view(-1)[:10] * 1.0

    graph = CPUGraph()
    graph.capture(write)
    slots[1] = 4 * 8   # one past the last slot
    with pytest.raises(RuntimeError, match="pk_reshape_and_cache failed"):
        graph.replay()


def test_tensors_off_the_cpu_are_refused():
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(GraphCaptureError, match="CPU graphs record CPU work only"):
        CPUGraph().capture(lambda: x * 2)


def test_only_the_capturing_thread_is_recorded():
    """Another thread's kernel calls during a capture run as usual and stay out of the graph."""
    import threading

    x, y = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    weight = torch.ones(HIDDEN)
    other = torch.empty_like(y)

    def fn():
        thread = threading.Thread(target=lambda: pk.rms_norm(y, weight, 1e-6, out=other))
        thread.start()
        thread.join()
        return pk.rms_norm(x, weight, 1e-6)

    graph = CPUGraph()
    graph.capture(fn)
    assert graph.num_kernel_calls == 1
    torch.testing.assert_close(other, pk.rms_norm(y, weight, 1e-6), rtol=0, atol=0)


def test_replay_before_capture_raises():
    with pytest.raises(RuntimeError, match="before capture"):
        CPUGraph().replay()


def _rows_block(gen, rows):
    """A decoder-like chain over ``rows`` rows, every row on its own and every step a native kernel (norm -> gate/up
    product -> SiLU-and-mul -> down product -> norm); returns (static input, callable returning [rows, HIDDEN])."""
    norm = torch.rand(HIDDEN, generator=gen) + 0.5
    up = pk.pack_w16((torch.randn(2 * INTER, HIDDEN, generator=gen) / 8).to(torch.bfloat16))
    down = pk.pack_w16((torch.randn(HIDDEN, INTER, generator=gen) / 8).to(torch.bfloat16))
    x = torch.randn(rows, HIDDEN, generator=gen)

    def fn():
        act = pk.silu_and_mul(pk.w16_gemm(pk.rms_norm(x, norm, 1e-6), up, 2 * INTER))
        return pk.rms_norm(pk.w16_gemm(act, down, HIDDEN), norm, 1e-6)

    return x, fn


def test_a_graph_replays_fewer_rows_over_just_those():
    """Recorded for 8 rows, a replay of 3 gives eager's first 3 rows and leaves the kernels' other rows alone (the
    output's rows 3..8 still hold the previous replay's); a replay of all 8 after it is whole again."""
    gen = torch.Generator().manual_seed(7)
    x, fn = _rows_block(gen, 8)
    graph = CPUGraph()
    graph.capture(fn, rows=8)
    assert graph.rows == 8 and graph.resizable and graph.num_torch_calls == 0
    before = graph.replay().clone()
    torch.testing.assert_close(before, fn(), rtol=0, atol=0)
    x.copy_(torch.randn(x.shape, generator=gen))
    eager = fn()
    out = graph.replay(3)
    torch.testing.assert_close(out[:3], eager[:3], rtol=0, atol=0)
    torch.testing.assert_close(out[3:], before[3:], rtol=0, atol=0)
    assert not torch.equal(before[3:], eager[3:])
    torch.testing.assert_close(graph.replay(8), eager, rtol=0, atol=0)
    torch.testing.assert_close(graph.replay(1)[:1], eager[:1], rtol=0, atol=0)


def test_a_graph_whose_rows_are_not_outermost_replays_them_all():
    """A kernel run over the transposed rows ([features, rows]: its row count a multiple of the graph's rows) would
    compute the wrong half at fewer rows: the capture's check sees it, and every replay then runs all the rows,
    giving eager's result for the rows asked for."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(8, HIDDEN, generator=gen)
    weight = torch.rand(8, generator=gen) + 0.5

    def transposed():
        return pk.rms_norm(x.t().contiguous(), weight, 1e-6).t().contiguous()

    graph = CPUGraph()
    recorded = graph.capture(transposed, rows=8)
    assert not graph.resizable
    torch.testing.assert_close(graph.replay(), recorded, rtol=0, atol=0)
    x.copy_(torch.randn(x.shape, generator=gen))
    torch.testing.assert_close(graph.replay(4)[:4], transposed()[:4], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_one_row_replay_that_rounds_differently_is_still_fewer_rows(dtype, monkeypatch):
    """Kernels may take another path for one row than for the batch (decode attention splits one sequence's keys
    between the threads): a 16-bit model's first row then differs from the batch's by an ulp or two wherever the
    float32 sums straddle a rounding (bf16 SmolLM2's hidden states: 0.25 at 32 through its 30 layers). The capture's
    check takes two ulps of the output's dtype everywhere as a match, and NaN (a row the replay did not compute) or
    another row's values as a wrong sliver. The one-row replay is perturbed here as those kernels would round it."""
    gen = torch.Generator().manual_seed(13)
    norm = torch.rand(HIDDEN, generator=gen) + 0.5
    x = (torch.randn(8, HIDDEN, generator=gen) * 8).to(dtype)
    fn = lambda: pk.rms_norm(x, norm.to(dtype), 1e-6)   # noqa: E731
    real_run = CPUGraph._run
    for perturb, resizable in (("two ulps", True), ("nan", False), ("row 1", False)):
        def run(self, rows, perturb=perturb):
            out = real_run(self, rows)
            if rows == 1:
                first = out[:1]
                if perturb == "two ulps":
                    up = first.float().abs() * 2 * torch.finfo(dtype).eps * torch.where(first > 0, 1, -1)
                    first.copy_((first.float() + up).to(dtype))
                elif perturb == "nan":
                    first[0, 5] = float("nan")
                else:
                    first.copy_(fn()[1:2])
            return out
        monkeypatch.setattr(CPUGraph, "_run", run)
        graph = CPUGraph()
        recorded = graph.capture(fn, rows=8)
        assert graph.resizable == resizable, perturb
        monkeypatch.setattr(CPUGraph, "_run", real_run)
        torch.testing.assert_close(graph.replay(), recorded, rtol=0, atol=0)


def test_replays_of_rows_a_graph_was_not_recorded_for_are_refused():
    gen = torch.Generator().manual_seed(9)
    _, fn = _rows_block(gen, 4)
    graph = CPUGraph()
    graph.capture(fn, rows=4)
    for rows in (0, 5):
        with pytest.raises(ValueError, match="recorded for 4 rows"):
            graph.replay(rows)
    unsized = CPUGraph()
    unsized.capture(fn)
    assert not unsized.resizable
    with pytest.raises(ValueError, match="unstated number"):
        unsized.replay(2)


def test_row_arguments_are_integer_arguments_of_graph_kernels():
    """ROW_ARGS names integer (not pointer or float) arguments of kernels a graph records, at most
    GRAPH_MAX_ROW_ARGS per kernel."""
    for name, positions in _native.ROW_ARGS.items():
        assert name in _native.GRAPH_KERNELS and len(positions) <= _native.GRAPH_MAX_ROW_ARGS
        for position in positions:
            assert _native.SIGNATURES[name][position] in (ctypes.c_int64, ctypes.c_int), (name, position)
