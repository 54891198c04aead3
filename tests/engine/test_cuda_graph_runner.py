"""Decode-graph logic of the ModelRunner on CPU, through the graph-runner test double, and the CPU graphs.

The double (EagerGraphRunner) captures by recording the forward on the static buffers and replays by
calling it again, so everything but the CUDA graph itself runs here: the padding ladder, the copy
into static buffers, padded rows that must neither write K/V nor change real rows, capture once per
size, fallback to eager above the ladder, for mixed batches and with enforce_eager.
"""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from engine.worker.input_batch import HostStaging
from engine.worker.model_runner import EagerGraphRunner, ModelRunner, graph_batch_sizes
from pagedkernels.cpu_graph import CPUGraph
from tests.engine.models_util import TINY_ARCHITECTURES, TINY_MOE_ARCHITECTURES, engine_config, random_token_ids
from tests.engine.test_model_runner import BLOCK_SIZE, Seq, scatter_blocks

NUM_KV_BLOCKS = 64


def graph_rows(output) -> int:
    """Rows of a captured graph's output: hidden states, or a whole step's (logits, greedy ids)."""
    return (output[0] if isinstance(output, tuple) else output).shape[0]


class RecordingGraphRunner(EagerGraphRunner):
    """Records, at every replay, the padded batch size and what the static buffers held. (With graphs
    on, decode batches take the decode op, the eager runner the prefill op on CPU: rounding differs.)"""
    replays: list[dict] = []

    def capture(self, fn):
        super().capture(fn)
        self.batch_size = graph_rows(self.output)

    def replay(self):
        static = self.model_runner.static_inputs(self.batch_size)
        RecordingGraphRunner.replays.append({
            "batch_size": self.batch_size, "graph": self,
            "input_ids_ptr": static.input_ids.data_ptr(),
            "slot_mapping": static.slot_mapping.clone(),
            "seq_lens": static.seq_lens.clone(),
            "positions": static.positions.clone(),
        })
        return super().replay()


def make_runner(model_dir: str, *, enforce_eager: bool, graph_runner_class=None, max_num_seqs: int = 10,
                compile_model: bool | None = None, capture_graphs_at_startup: bool | None = None):
    config = engine_config(model_dir, device="cpu", max_model_len=256, block_size=BLOCK_SIZE,
                           num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                           enforce_eager=enforce_eager)
    runner = ModelRunner(config, graph_runner_class=graph_runner_class, compile_model=compile_model,
                         capture_graphs_at_startup=capture_graphs_at_startup)
    runner.kv_cache.fill_(float("nan"))  # a padded row writing K/V, or any stray read, shows
    return runner


def test_ladder():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(3) == [1, 2]


# Step 0 prefills all ten sequences (mixed lengths: eager); then pure-decode batches of 3 (pads to 4),
# 1, 5 (pads to 8), 10 (above the ladder of max_num_seqs=10: eager), 3 again (replays the size-4 graph).
PROMPT_LENS = [5, 17, 30, 9, 16, 2, 33, 12, 1, 20]
DECODE_STEPS = [[0, 1, 2], [3], [4, 5, 6, 7, 8], list(range(10)), [2, 0, 9]]


def _run(runner, seqs):
    logits_per_step = []
    steps = [[(i, n) for i, n in enumerate(PROMPT_LENS)]] + [[(i, 1) for i in step] for step in DECODE_STEPS]
    for step in steps:
        scheduled = [(seqs[i], n) for i, n in step]
        logits_per_step.append(runner.compute_logits_for(scheduled).clone())
        for seq, n in scheduled:
            seq.num_computed_tokens += n
    return logits_per_step


def _sequences(vocab_size):
    decodes = [sum(i in step for step in DECODE_STEPS) for i in range(len(PROMPT_LENS))]
    seqs = [Seq(random_token_ids(p + d, vocab_size=vocab_size, seed=30 + i))
            for i, (p, d) in enumerate(zip(PROMPT_LENS, decodes))]
    scatter_blocks(seqs, NUM_KV_BLOCKS, seed=3)
    return seqs


@pytest.mark.parametrize("arch,compiled", [("llama", False), ("mistral", False), ("qwen3", True),
                                           ("mistral", True), ("llama", True), ("opt", False), ("gemma2", False),
                                           ("phi3", False)])
def test_padded_replay_equals_eager(tiny_model_dir, arch, compiled, monkeypatch):
    """mistral: a sliding window; qwen3: q/k norms; opt: learned positions (padded rows read position 0),
    LayerNorm; gemma2: softcaps, scaled embeddings; phi3: LongRoPE, partial rotary. compiled: the graphs
    capture the torch.compile'd forward, as on CUDA (inductor, fullgraph: a graph break fails), and the
    mixed batches run it too. The three newer architectures pass compiled as well, but inductor takes 20-110 s
    apiece for them on a 2-core CPU, so CI runs them eagerly here (the GPU suite compiles them)."""
    model_dir = tiny_model_dir(arch)
    eager = make_runner(model_dir, enforce_eager=True, compile_model=False)
    graphed = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner,
                          compile_model=compiled)
    assert graphed.compiled == compiled and not eager.compiled
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    assert eager.enforce_eager and not hasattr(eager, "_static_inputs")
    static_ptr = graphed.static_inputs(1).input_ids.data_ptr()   # on CPU one set of buffers serves every size

    replays = _replays_equal_eager(graphed, eager)
    assert graphed.compiled == compiled, "compilation fell back to eager"
    # compiled, the graphs' tail too (the LM head's float cast, NaN clean-up and argmax fused after the product)
    assert (getattr(graphed, "_compiled_tail", None) is not None) == compiled
    assert not getattr(graphed, "_tail_compile_failed", False)
    assert sorted(graphed.graphs) == [1, 4, 8]
    assert replays[0]["graph"] is replays[3]["graph"], "the size-4 graph must be captured once and reused"
    assert all(r["input_ids_ptr"] == static_ptr for r in replays), "static buffers must never be reallocated"


def _replays_equal_eager(graphed, eager) -> list[dict]:
    """_sequences through both runners: every step's logits and the KV caches alike (padded rows wrote nothing), the
    decode steps of 3, 1, 5, 3 sequences replayed on graphs of 4, 1, 8, 4 (the step of 10 ran eagerly), and what each
    replay read past its real rows padding (slot -1, seq_len 0, position 0). Returns the replays' records."""
    expected = _run(eager, _sequences(eager.config.vocab_size))
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        # Padding changes the matmul shapes, hence summation order: float32 rounding differs slightly.
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    # Padded rows wrote nothing: the caches agree slot for slot, NaN poison included.
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-4, rtol=1e-4, equal_nan=True)
    replays = RecordingGraphRunner.replays
    assert [r["batch_size"] for r in replays] == [4, 1, 8, 4]
    for record, num_real in zip(replays, [3, 1, 5, 3]):
        assert (record["slot_mapping"][num_real:] == -1).all() and (record["slot_mapping"][:num_real] >= 0).all()
        assert (record["seq_lens"][num_real:] == 0).all() and (record["seq_lens"][:num_real] > 0).all()
        assert (record["positions"][num_real:] == 0).all()
    return replays


def test_graphs_captured_at_startup_for_the_whole_ladder(tiny_model_dir, monkeypatch):
    """What CUDA does by default: every ladder size captured in the constructor (largest first), so decode steps
    only replay, with the eager runner's results."""
    model_dir = tiny_model_dir("llama")
    captured = []
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "capture",
                        lambda self, fn: (captured.append(self), EagerGraphRunner.capture(self, fn),
                                          setattr(self, "batch_size", graph_rows(self.output)))[-1])
    graphed = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner,
                          capture_graphs_at_startup=True)
    assert sorted(graphed.graphs) == graph_batch_sizes(10) == [1, 2, 4, 8]
    assert [g.batch_size for g in captured] == [8, 4, 2, 1]
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    eager = make_runner(model_dir, enforce_eager=True)
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, _run(eager, _sequences(eager.config.vocab_size)))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert len(captured) == 4, "decode steps must replay the start-up graphs, not capture new ones"
    assert [r["batch_size"] for r in RecordingGraphRunner.replays] == [4, 1, 8, 4]


class PoolCountingGraphRunner(EagerGraphRunner):
    """Torch's rule for a graph pool (CUDACachingAllocator): each capture into it counts, each graph gone uncounts,
    and a capture into a pool whose graphs are all gone fails for as long as the pool lives (one of its tensors held:
    always, here)."""
    use_counts: dict[int, int] = {}
    pools = itertools.count(1)

    def __init__(self, pool=None):
        super().__init__(pool)
        self.pool, self.counted = pool, False

    @staticmethod
    def new_pool(device):
        return next(PoolCountingGraphRunner.pools)

    def capture(self, fn):
        if self.use_counts.get(self.pool) == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        self.use_counts[self.pool] = self.use_counts.get(self.pool, 0) + 1
        self.counted = self.use_counts   # the test's dict, which a graph outliving it still counts in
        super().capture(fn)

    def __del__(self):
        if self.counted:
            self.counted[self.pool] -= 1


def test_graphs_dropped_then_captured_again_in_a_new_pool(tiny_model_dir, monkeypatch):
    """drop_graphs() (and every setting that drops graphs) leaves the runner no graph: the next capture must not go
    into the old pool, which torch refuses while a tensor of it lives (the H200's MoE engine after its batch-1 PDL
    switch: every step failed). Partial drops keep the pool its graphs still hold."""
    monkeypatch.setattr(PoolCountingGraphRunner, "use_counts", {})
    runner = make_runner(tiny_model_dir("llama"), enforce_eager=False, graph_runner_class=PoolCountingGraphRunner,
                         capture_graphs_at_startup=True)
    eager = make_runner(tiny_model_dir("llama"), enforce_eager=True)
    expected = _run(eager, _sequences(eager.config.vocab_size))
    first_pool = runner.graph_pool
    assert PoolCountingGraphRunner.use_counts == {first_pool: len(graph_batch_sizes(10))}
    runner.drop_graphs()
    gc.collect()
    assert PoolCountingGraphRunner.use_counts[first_pool] == 0
    for step, (a, b) in enumerate(zip(_run(runner, _sequences(runner.config.vocab_size)), expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    second_pool = runner.graph_pool
    assert second_pool != first_pool and PoolCountingGraphRunner.use_counts[second_pool] == len(runner.graphs) == 3
    del runner.graphs[1]   # a partial drop (as set_skinny_max_rows makes): the graphs left keep their pool
    gc.collect()
    _run(runner, _sequences(runner.config.vocab_size))
    assert runner.graph_pool == second_pool and PoolCountingGraphRunner.use_counts[second_pool] == 3


def test_no_graphs_with_enforce_eager(tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama")
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    for runner in (make_runner(model_dir, enforce_eager=True, graph_runner_class=RecordingGraphRunner),
                   make_runner(model_dir, enforce_eager=True)):
        assert runner.enforce_eager
        _run(runner, _sequences(runner.config.vocab_size))
        assert runner.graphs == {}
    assert RecordingGraphRunner.replays == []


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "opt", "gemma2", "phi3"])
def test_cpu_graphs_by_default_on_cpu_equal_eager(tiny_model_dir, arch, monkeypatch):
    """CPU graphs of the native kernels (pagedkernels.cpu_graph) are the CPU's default: a graph per size of the CPU
    ladder, captured by the first step that needs it, replayed by the next; a smaller batch replays a larger graph
    over just its rows. Results as eager's. The tiny models' random float32 weights take oneDNN's linears, which
    replay as torch operations between the recorded kernels (over the padding rows too); every architecture's
    forward records, and keeps its rows outermost so that its graphs replay fewer rows."""
    model_dir = tiny_model_dir(arch)
    captures = []
    capture = CPUGraph.capture
    monkeypatch.setattr(CPUGraph, "capture", lambda self, fn, **kw: (captures.append(kw), capture(self, fn, **kw))[1])
    eager = make_runner(model_dir, enforce_eager=True)
    graphed = make_runner(model_dir, enforce_eager=False)
    assert graphed.graph_runner_class is CPUGraph and graphed.graph_batch_sizes == [1, 2, 4, 8, 10]
    expected = _run(eager, _sequences(eager.config.vocab_size))
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-4, rtol=1e-4, equal_nan=True)
    assert not graphed.enforce_eager, "the capture fell back to eager"
    # decode steps of 3, 1, 5, 10 and 3 sequences: four captures (the first warms up and checks), one replay of
    # the graph of 4 over 3 rows
    assert sorted(graphed.graphs) == [1, 4, 8, 10]
    assert captures == [{"warm_up": True, "check": True, "rows": 4}] + [
        {"warm_up": False, "check": False, "rows": rows} for rows in (1, 8, 10)]
    assert all(g.num_kernel_calls > 0 and g.resizable for g in graphed.graphs.values())


def test_cpu_graphs_that_cannot_replay_fewer_rows_get_one_per_batch_size(tiny_model_dir, monkeypatch, caplog):
    """Should a model's graph fail the check that it replays fewer rows than it recorded, the runner says so once and
    records a graph per batch size from then on (the failed one still serves its own size); results as eager's."""
    model_dir = tiny_model_dir("llama")
    monkeypatch.setattr(CPUGraph, "_replays_fewer_rows", lambda self, output: False)
    eager = make_runner(model_dir, enforce_eager=True)
    graphed = make_runner(model_dir, enforce_eager=False)
    with caplog.at_level("INFO", logger="engine.worker.decode_graphs"):
        got = _run(graphed, _sequences(graphed.config.vocab_size))
    for a, b in zip(got, _run(eager, _sequences(eager.config.vocab_size))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-4, rtol=1e-4, equal_nan=True)
    # decode steps of 3 (the graph of 4, padded), then 1, 5, 10 and 3 sequences at their own sizes
    assert sorted(graphed.graphs) == [1, 3, 4, 5, 10] and graphed.graph_batch_sizes == list(range(1, 11))
    assert sum("cannot replay fewer rows" in r.getMessage() for r in caplog.records) == 1


def test_a_forward_a_cpu_graph_cannot_follow_runs_eagerly(tiny_model_dir, caplog):
    """A forward that reads a tensor value on the host (here: a wrapper around the model) cannot be replayed: the
    capture is refused, logged once, and the runner decodes eagerly from then on with eager's results."""
    model_dir = tiny_model_dir("llama")
    eager = make_runner(model_dir, enforce_eager=True)
    graphed = make_runner(model_dir, enforce_eager=False)
    model_forward = graphed.model.forward

    def reads_a_value(input_ids, positions, meta):
        if int(input_ids.sum()) < 0:
            raise AssertionError("unreachable")
        return model_forward(input_ids, positions, meta)

    graphed.model.forward = reads_a_value
    with caplog.at_level("WARNING", logger="engine.worker.decode_graphs"):
        got = _run(graphed, _sequences(graphed.config.vocab_size))
    assert graphed.enforce_eager and graphed.graphs == {}
    assert sum("decode graphs are off" in r.getMessage() for r in caplog.records) == 1
    for a, b in zip(got, _run(eager, _sequences(eager.config.vocab_size))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_compile_choice(tiny_model_dir, monkeypatch):
    """Eager by default on CPU (compiled by default on CUDA); ENGINE_COMPILE=1/0 or compile_model decide."""
    model_dir = tiny_model_dir("llama")
    monkeypatch.delenv("ENGINE_COMPILE", raising=False)
    runner = make_runner(model_dir, enforce_eager=True)
    assert not runner.compiled and runner.forward is runner.model
    monkeypatch.setenv("ENGINE_COMPILE", "1")
    runner = make_runner(model_dir, enforce_eager=True)
    assert runner.compiled and runner.forward is not runner.model
    monkeypatch.setenv("ENGINE_COMPILE", "0")
    assert not make_runner(model_dir, enforce_eager=True).compiled
    assert make_runner(model_dir, enforce_eager=True, compile_model=True).compiled


def test_failed_compile_falls_back_to_eager(tiny_model_dir, caplog):
    """A dynamo/inductor failure is logged once and the runner goes on eagerly with the same results."""
    from torch._dynamo.exc import Unsupported

    model_dir = tiny_model_dir("llama")
    eager = make_runner(model_dir, enforce_eager=True, compile_model=False)
    runner = make_runner(model_dir, enforce_eager=True, compile_model=True)

    def broken(*args):
        raise Unsupported("simulated graph break")

    runner.forward = broken
    with caplog.at_level("WARNING", logger="engine.worker.model_runner"):
        got = _run(runner, _sequences(runner.config.vocab_size))
    assert not runner.compiled and runner.forward is runner.model
    assert sum("torch.compile of the model failed" in r.getMessage() for r in caplog.records) == 1
    # (the eager runner's weights are prepacked for oneDNN, the fallen-back one's not: rounding differs)
    for a, b in zip(got, _run(eager, _sequences(eager.config.vocab_size))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_decode_graph_runs_the_whole_step_to_the_sampler(tiny_model_dir, monkeypatch):
    """With graphs on one rank, a decode graph computes the LM head and the greedy argmax too: an all-greedy
    plain batch takes the graph's ids without calling the sampler, a batch with any other row samples from the
    graph's logits; both draw what a runner whose graphs stop at the hidden states draws."""
    from engine.sampling_params import SamplingParams
    from engine.step_records import CachedSequenceData, NewSequenceData, SchedulerOutput

    model_dir = tiny_model_dir("llama")
    kinds = {"greedy": [SamplingParams(temperature=0)] * 3,
             "mixed": [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=4, top_k=20),
                       SamplingParams(temperature=0, logprobs=2)]}
    for name, params in kinds.items():
        tokens = {}
        calls = {}
        for step_graphs in (True, False):
            runner = make_runner(model_dir, enforce_eager=False, graph_runner_class=EagerGraphRunner)
            runner.kv_cache.zero_()   # (make_runner poisons it with NaN; these sequences write what they read)
            assert runner.step_graphs
            runner.step_graphs = step_graphs
            sample = runner.sampler.sample
            calls[step_graphs] = []
            monkeypatch.setattr(runner.sampler, "sample", lambda logits, meta, sample=sample, calls=calls[step_graphs]:
                                calls.append(logits.shape[0]) or sample(logits, meta))
            prompts = [random_token_ids(6 + 5 * i, vocab_size=runner.config.vocab_size, seed=50 + i) for i in range(3)]
            new = [NewSequenceData(seq_id=i, token_ids=p, num_prompt_tokens=len(p), num_computed_tokens=0,
                                   block_ids=[2 * i, 2 * i + 1], params=sp, seed=sp.seed, stop_token_ids=[])
                   for i, (p, sp) in enumerate(zip(prompts, params))]
            out = runner.execute_model(SchedulerOutput(new_seqs=new, cached_seqs=[],
                                                       num_scheduled_tokens={i: len(p) for i, p in enumerate(prompts)}))
            got = [out.sampled_token_ids[i] for i in range(3)]
            for step in range(4):   # pure decode: the graph of 4 replays
                num_tokens = [len(p) + step + 1 for p in prompts]
                cached = [CachedSequenceData(i, [], 2, [], n - 1, token_start=n) for i, n in enumerate(num_tokens)]
                out = runner.execute_model(SchedulerOutput(new_seqs=[], cached_seqs=cached,
                                                           num_scheduled_tokens={0: 1, 1: 1, 2: 1}))
                for i in range(3):
                    got[i] += out.sampled_token_ids[i]
            tokens[step_graphs] = got
        assert tokens[True] == tokens[False], name
        if name == "greedy":   # the prefill sampled once; the graph's argmax served the four decode steps
            assert calls[True] == [3] and calls[False] == [3] * 5
        else:
            assert calls[True] == calls[False] == [3] * 5


def test_inputs_staged_in_each_graphs_region_equal_eager(tiny_model_dir, monkeypatch):
    """The CUDA layout on the CPU: each graph size its own input region, which a pure-decode step fills in one copy
    from the (here unpinned) staging, padding rows included (id 0 at position 0, slot -1, seq_len 0), with no copies
    into the graph's inputs at replay. The steps' results are the eager runner's, and what each replay read is the
    step's inputs and its padding."""
    import numpy as np

    from engine.worker.input_batch import HostStaging

    model_dir = tiny_model_dir("qwen3")
    eager = make_runner(model_dir, enforce_eager=True, compile_model=False)
    graphed = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner,
                          compile_model=False)
    graphed._allocate_static_buffers(per_size_regions=True)
    graphed.staging.pinned = True
    monkeypatch.setattr(HostStaging, "_arena", lambda self, needed: torch.empty(max(needed, 1 << 16),
                                                                                  dtype=torch.uint8))
    regions = []
    real = HostStaging.to_device_region
    monkeypatch.setattr(HostStaging, "to_device_region",
                        lambda self, region, parts: (regions.append(region.numel()), real(self, region, parts))[1])
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    copied = []
    monkeypatch.setattr(type(graphed), "_copy_into_static", staticmethod(lambda *args: copied.append(args)))
    replays = _replays_equal_eager(graphed, eager)
    assert len(regions) == 4 and copied == []
    assert len({r["input_ids_ptr"] for r in replays}) == 3   # a region per size
    assert np.array_equal(regions, [graphed._static_regions[b].numel() for b in (4, 1, 8, 4)])


def test_a_failing_compile_of_the_graph_tail_falls_back_to_eager(tiny_model_dir):
    """A compiler failure in the step graph's tail (LM head and greedy ids) is logged and the tail runs eagerly from
    then on, as for the forward; an error of the model's own still raises."""
    runner = make_runner(tiny_model_dir("llama"), enforce_eager=True, compile_model=False)
    runner.compiled = True   # as if the forward compiled: the tail compiles too
    hidden = torch.randn(3, runner.config.hidden_size)
    expected = runner.model.compute_logits(hidden)

    def unsupported(h):
        raise torch._dynamo.exc.Unsupported("no")

    runner._compiled_tail = unsupported
    logits, ids = runner._greedy_tail(hidden)
    torch.testing.assert_close(logits, expected)
    assert torch.equal(ids, expected.argmax(dim=-1)) and runner._tail_compile_failed
    runner._tail_compile_failed = False
    runner._compiled_tail = lambda h: (_ for _ in ()).throw(ValueError("the model's own"))
    with pytest.raises(ValueError, match="the model's own"):
        runner._greedy_tail(hidden)


# -- speculative verification steps in graphs -------------------------------------------------------------------------

# After the prefill of ten sequences, verification-shaped steps: (sequences, tokens each). 3 x 3 pads to the graph of
# (4, 3); 1 x 2 is (1, 2); 5 x 5 pads to (8, 5); 10 x 3 is above the ladder (eager); 3 x 3 replays (4, 3); a step of
# 2 and 3 tokens is not uniform (eager); 2 x 6 exceeds 1 + k = 5 (eager); 2 x 1 is a decode step (its own graph).
VERIFY_STEPS = [([0, 1, 2], 3), ([3], 2), ([4, 5, 6, 7, 8], 5), (list(range(10)), 3), ([2, 0, 9], 3),
                ([1, 3], [2, 3]), ([5, 6], 6), ([7, 8], 1)]


def _spec_runner(model_dir, *, enforce_eager: bool, compile_model: bool | None = None):
    config = engine_config(model_dir, device="cpu", max_model_len=256, block_size=BLOCK_SIZE,
                           num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=10, max_num_batched_tokens=512,
                           enforce_eager=enforce_eager,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    runner = ModelRunner(config, graph_runner_class=None if enforce_eager else RecordingGraphRunner,
                         compile_model=compile_model)
    runner.kv_cache.fill_(float("nan"))   # a padding row writing K/V, or any stray read, shows
    return runner


def _run_verify_steps(runner, seqs):
    """Every token's logits of each step (the verification's rows)."""
    steps = [[(i, n) for i, n in enumerate(PROMPT_LENS)]]
    for rows, q in VERIFY_STEPS:
        steps.append([(i, q[k] if isinstance(q, list) else q) for k, i in enumerate(rows)])
    per_step = []
    for step in steps:
        scheduled = [(seqs[i], n) for i, n in step]
        _, every = runner.compute_logits_for(scheduled, all_logits_for=range(len(scheduled)))
        per_step.append([logits.clone() for logits in every])
        for seq, n in scheduled:
            seq.num_computed_tokens += n
    return per_step


@pytest.mark.parametrize("compiled", [False, True])
def test_verification_steps_replay_graphs(tiny_model_dir, monkeypatch, compiled):
    """With speculative decoding's graphs on, steps whose sequences all compute the same 2 to 1 + k tokens replay a
    graph of (padded batch size, tokens a sequence), captured once each; every token's logits and the KV cache are
    the eager runner's (padding sequences write nothing); other shapes run eagerly. compiled: as on CUDA, where a
    step of one sequence comes with a padding sequence in its metadata (_no_dimension_of_one), which the graph of
    (1, q) does not take."""
    model_dir = tiny_model_dir("qwen3")
    eager = _spec_runner(model_dir, enforce_eager=True)
    graphed = _spec_runner(model_dir, enforce_eager=False, compile_model=compiled)
    assert graphed.compiled is compiled
    assert graphed.spec_graphs is False   # DevicePolicy.spec_decode_graphs: off on CPU
    assert graphed.set_spec_decode_graphs(True) and not eager.set_spec_decode_graphs(True)
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    lens = [p + sum(q if isinstance(q, int) else q[rows.index(i)] for rows, q in VERIFY_STEPS if i in rows)
            for i, p in enumerate(PROMPT_LENS)]

    def sequences():
        seqs = [Seq(random_token_ids(n, vocab_size=eager.config.vocab_size, seed=40 + i)) for i, n in enumerate(lens)]
        scatter_blocks(seqs, NUM_KV_BLOCKS, seed=4)
        return seqs

    expected = _run_verify_steps(eager, sequences())
    got = _run_verify_steps(graphed, sequences())
    assert sorted(graphed.verify_graphs) == [(1, 2), (4, 3), (8, 5)]
    # Compiled, the graphs run inductor's code for the padded shapes: its own summation order, so float32 rounds
    # differently, as the decode graphs' comparisons above allow (an AVX-512 Xeon: 1.4e-5 on 1 of 1024 logits).
    tol = 1e-4 if compiled else 1e-5
    for step, (a, b) in enumerate(zip(got, expected)):
        for seq, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=lambda m: f"step {step} seq {seq}: {m}")
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=tol, rtol=tol, equal_nan=True)
    # the graphs' rows (tokens) at each replay: (4, 3), (1, 2), (8, 5), (4, 3) again, then the decode graph of 2
    assert [r["batch_size"] for r in RecordingGraphRunner.replays] == [12, 2, 40, 12, 2]
    # the padding sequences read written positions (the first sequence's), not the NaN-filled unused blocks: their
    # rows are finite too (a per-tensor activation scale would spread a NaN to the real rows)
    assert all(torch.isfinite(graph.output).all() for graph in graphed.verify_graphs.values())
    assert graphed.set_spec_decode_graphs(False) is False and graphed.verify_graphs == {}


class ArenaStaging(HostStaging):
    """HostStaging's CUDA path on the CPU: a step's inputs staged back to back in an arena, each a view of the copy
    (the CPU's own staging returns the arrays' tensors instead)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.pinned = True

    def next_step(self) -> None:   # no events to wait on: the "copies" are done when made
        self._current ^= 1
        self._offset = 0

    def _arena(self, needed: int) -> torch.Tensor:
        arena = self._arenas[self._current]
        if arena is None or arena.numel() < needed:
            self._arenas[self._current] = arena = torch.empty(max(needed, 1 << 16), dtype=torch.uint8)
        return arena


def test_the_graph_ladder_compiles_the_model_once(tiny_model_dir, monkeypatch):
    """Capturing a ladder of decode graphs with the CUDA layout (each size's inputs views into its own buffer)
    compiles the forward once, for steps of several rows (and mixed batches), and the step's tail likewise; the
    one-row graph, whose few-row layers are pagedkernels calls only, captures them uncompiled, with its LM head
    folded or not (each compile of a real model is many seconds of a GPU engine's start-up: the one-row step was a
    compile of the whole model of its own, dynamo specializing a dimension of 1). Nor once more because sizes
    happened to be equal at the largest graph: duck sizing made the storage offset of a field of the largest graph's
    buffer and its batch size one symbol (and its cu_seqlens_q slice's size and its base's); the next graph failed
    those guards and the model compiled again."""
    from torch._dynamo.utils import counters

    from engine.worker.decode_graphs import DecodeGraphs

    allocate = DecodeGraphs._allocate_static_buffers
    monkeypatch.setattr(DecodeGraphs, "_allocate_static_buffers",
                        lambda self, per_size_regions=None: allocate(self, per_size_regions=True))
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "1")
    torch._dynamo.reset()
    counters.clear()
    runner = make_runner(tiny_model_dir("qwen3"), enforce_eager=False, graph_runner_class=EagerGraphRunner,
                         max_num_seqs=64, compile_model=True, capture_graphs_at_startup=True)
    assert runner.compiled and sorted(runner.graphs) == [1, 2, 4, 8, 16, 32, 48, 64] and runner.skinny_max_rows == 1
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert runner.set_skinny_lm_head(True) and 1 not in runner.graphs   # the one-row graph with the folded head
    runner.capture_all_graphs()
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # A mixed batch (prefill chunks) runs the same compiled forward: its attention reads the batch's kind from the
    # forward context, not from the graph, its inputs are inference tensors as the graphs' are, and none of either
    # starts its buffer (a compile of its own at start-up before: the memory profile's batch). Its inputs staged as
    # on CUDA: views of one buffer (HostStaging's pinned path, here without pinned memory or events).
    runner.staging = ArenaStaging(runner.device)
    seqs = _sequences(runner.config.vocab_size)
    logits = runner.compute_logits_for([(seqs[i], n) for i, n in enumerate(PROMPT_LENS[:4])])
    assert logits.shape[0] == 4 and torch.isfinite(logits).all()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # Nor the kernel warm-up's prompts of 4 to 256 tokens (a CUDA runner's start-up: ModelRunner.warm_up_kernels).
    assert runner.warm_up_sizes() == [4, 8, 16, 32, 64, 128, 256]
    runner.warm_up_kernels()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # Nor a prefill of one sequence (a padding sequence joins it), one block wide (a padding column) or three, nor a
    # chunk of one: each as an eager runner computes it. Dynamo specializes a dimension of 1, so the first single
    # request after start-up compiled the model again, and one of another block-table width once more.
    eager = make_runner(tiny_model_dir("qwen3"), enforce_eager=True, compile_model=False)
    eager_seqs = _sequences(eager.config.vocab_size)
    for index, chunk in ((4, PROMPT_LENS[4]), (6, PROMPT_LENS[6]), (5, 2)):
        got = runner.compute_logits_for([(seqs[index], chunk)])
        expected = eager.compute_logits_for([(eager_seqs[index], chunk)])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        seqs[index].num_computed_tokens += chunk
        eager_seqs[index].num_computed_tokens += chunk
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()


# What a model's compiled graph may hold for its one-token steps to run uncompiled at no cost: linears, the
# embedding, pagedkernels and engine ops, and views (nothing the compiler fuses).
_NOTHING_TO_FUSE = {"torch._C._nn.linear", "torch.nn.functional.embedding", "_operator.getitem"}
_NOTHING_TO_FUSE_METHODS = {"view", "split", "new_empty", "item", "size", "reshape", "contiguous"}


def _ops_to_fuse(arch: str, tiny_model_dir) -> tuple[type, list[str]]:
    """``arch``'s model class and the nodes of its compiled forward (a mixed batch, traced by dynamo) that a compiler
    could fuse: any call but a linear, the embedding, a pagedkernels or engine op, or a view."""
    runner = make_runner(tiny_model_dir(arch), enforce_eager=True, compile_model=True)
    graphs = []
    runner.forward = torch.compile(runner.model, backend=lambda gm, inputs: graphs.append(gm) or gm.forward,
                                   dynamic=True, fullgraph=True)
    seqs = _sequences(runner.config.vocab_size)
    runner.compute_logits_for([(seqs[i], n) for i, n in enumerate(PROMPT_LENS[:3])])
    found = []
    for node in graphs[0].graph.nodes:
        if node.op == "call_function":
            name = f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__name__', node.target)}"
            if name not in _NOTHING_TO_FUSE and not name.startswith(("torch._ops.pagedkernels.",
                                                                        "torch._ops.engine.")):
                found.append(name)
        elif node.op == "call_method" and node.target not in _NOTHING_TO_FUSE_METHODS:
            found.append(f"method.{node.target}")
    torch._dynamo.reset()
    return type(runner.model), found


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES)
def test_one_token_steps_run_uncompiled_where_nothing_would_fuse(tiny_model_dir, arch):
    """LlamaForCausalLM.one_token_uncompiled holds exactly where the model's compiled graph is linears, the embedding,
    pagedkernels and engine ops and views: the Llama family, Qwen3-MoE and Mixtral (their one-token steps then spare
    a compile of the whole model at start-up, and launch the same kernels); Qwen2-MoE's shared-expert gate (sigmoid,
    mul, add), OLMoE's q/k/v clamps, Gemma 2's GeGLU and softcaps and OPT's residual adds and ReLU are ops the
    compiler fuses, so those keep the compile."""
    model_class, found = _ops_to_fuse(arch, tiny_model_dir)
    assert getattr(model_class, "one_token_uncompiled", False) is (not found), found
    assert bool(found) is (arch in ("qwen2_moe", "olmoe", "gemma2", "opt"))


def test_a_moe_model_compiles_once_for_its_ladder_and_one_token_steps(tiny_model_dir, monkeypatch):
    """Qwen3-MoE (one_token_uncompiled): the ladder's one-row graph and a one-token chunk run the model uncompiled,
    so the ladder, a mixed batch and those compile the forward once (and the greedy tail once); the one-row graph's
    logits are an eager runner's."""
    from torch._dynamo.utils import counters

    from engine.worker.decode_graphs import DecodeGraphs

    allocate = DecodeGraphs._allocate_static_buffers
    monkeypatch.setattr(DecodeGraphs, "_allocate_static_buffers",
                        lambda self, per_size_regions=None: allocate(self, per_size_regions=True))
    torch._dynamo.reset()
    counters.clear()
    model_dir = tiny_model_dir("qwen3_moe")
    runner = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner,
                         max_num_seqs=16, compile_model=True, capture_graphs_at_startup=True)
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", runner, raising=False)
    assert runner.compiled and runner.skinny_max_rows == 0 and sorted(runner.graphs) == [1, 2, 4, 8, 16]
    runner.staging = ArenaStaging(runner.device)
    eager = make_runner(model_dir, enforce_eager=True, compile_model=False)
    seqs, eager_seqs = _sequences(runner.config.vocab_size), _sequences(eager.config.vocab_size)
    # A mixed batch, a one-token chunk of a prompt (one token for one sequence: a decode step's shape, so its graph
    # replays) and a decode step of one row.
    for step in ([(0, 5), (1, 17)], [(2, 1)], [(0, 1)]):
        got = runner.compute_logits_for([(seqs[i], n) for i, n in step])
        expected = eager.compute_logits_for([(eager_seqs[i], n) for i, n in step])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for i, n in step:
            seqs[i].num_computed_tokens += n
            eager_seqs[i].num_computed_tokens += n
    assert [r["batch_size"] for r in RecordingGraphRunner.replays] == [1, 1]
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()
