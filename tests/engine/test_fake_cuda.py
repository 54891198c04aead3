"""The CUDA code paths without a GPU (tests/engine/fake_cuda.py): every architecture builds on a fake cuda
device, the runner sizes its KV cache from the (scripted) memory counters after the profile step, prepares a
mixed batch and runs it through the ops' fake implementations, and captures the whole decode-graph ladder with
no host sync. The tier's own checks are shown to catch what they are for: a tensor on the wrong device, a host
sync inside capture, a CPU-only assumption.

Also here: the KV-cache arithmetic through the memory double on a real CPU forward (engine/worker/memory.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
try:
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError   # torch >= 2.12
except ImportError:   # torch 2.11 (the GPU image): a plain RuntimeError naming the two devices
    FakeTensorDeviceMismatchError = RuntimeError

from engine.sampling_params import SamplingParams
from engine.step_records import CachedSequenceData, NewSequenceData, SchedulerOutput
from engine.worker import memory as gpu_memory
from engine.worker.model_runner import ModelRunner, graph_batch_sizes
from tests.engine.fake_cuda import GiB, FakeCudaMemory, FakeGraphRunner, HostSyncError, fake_cuda
from tests.engine.models_util import ScheduledSeq as Entry, TINY_ARCHITECTURES, engine_config, random_token_ids

BLOCK_SIZE = 16
MAX_NUM_SEQS = 20
MAX_NUM_BATCHED_TOKENS = 96
MAX_MODEL_LEN = 128



def _assert_cuda_only_switch(monkeypatch, variable: str, field: str, default: bool = False) -> None:
    """A DevicePolicy switch of a CUDA path: ``default`` on CUDA when the variable is unset (off for a path not yet
    measured on a GPU); on for CUDA alone with 1/true/ON/yes, off with 0; any other value a ValueError naming the
    variable. Leaves the variable at 1."""
    from engine.platform import DevicePolicy

    monkeypatch.delenv(variable, raising=False)
    assert getattr(DevicePolicy.for_device("cuda"), field) == default
    assert not getattr(DevicePolicy.for_device("cpu"), field)
    for on in ("1", "true", "ON", "yes"):
        monkeypatch.setenv(variable, on)
        assert getattr(DevicePolicy.for_device("cuda"), field)
        assert not getattr(DevicePolicy.for_device("cpu"), field)
    monkeypatch.setenv(variable, "0")
    assert not getattr(DevicePolicy.for_device("cuda"), field)
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=variable):
        DevicePolicy.for_device("cuda")
    monkeypatch.setenv(variable, "1")


@pytest.fixture(autouse=True)
def _batched_sampling_calls_succeed(caplog):
    """A batched sampling call that raises is retried row by row (ModelRunner._isolated) and the step goes on: here
    that would hide a fault of the CUDA path (or of this tier's double) behind the fallback, so it fails the test."""
    yield
    retried = [r.getMessage() for r in caplog.records if "a batched sampling call failed" in r.getMessage()]
    assert not retried, retried


def _runner(model_dir: str, *, num_kv_blocks=None, gpu_memory_utilization=0.9, async_scheduling=None,
            speculative_config=None, **kwargs) -> ModelRunner:
    """A runner as the engine builds one on CUDA (graphs captured at start-up; eager, as inductor cannot compile
    for a fake device), on the fake cuda device."""
    config = engine_config(model_dir, device="cuda", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                           num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
                           max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                           async_scheduling=async_scheduling, speculative_config=speculative_config)
    kwargs = {"capture_graphs_at_startup": True, **kwargs}
    return ModelRunner(config, graph_runner_class=FakeGraphRunner, compile_model=False, **kwargs)


def _mixed_batch() -> list[tuple[Entry, int]]:
    """A prefill chunk, a later chunk of a long prompt, and two decodes, on scattered blocks."""
    prefill = Entry(random_token_ids(37, seed=1), 0, [5, 9, 2])
    chunk = Entry(random_token_ids(70, seed=2), 32, [7, 1, 3, 11, 4])
    decode_a = Entry(random_token_ids(20, seed=3), 19, [8, 6])
    decode_b = Entry(random_token_ids(1, seed=4), 0, [10])
    return [(prefill, 37), (chunk, 38), (decode_a, 1), (decode_b, 1)]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_architecture_runs_the_cuda_paths(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    FakeGraphRunner.captured_batch_sizes = []
    # A budget small enough to show in the block count: 1 GiB for the engine, 0.25 GiB peak, 0.25 GiB outside.
    memory = FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)
    batch = _mixed_batch()
    prompts = [random_token_ids(60, seed=10 + i) for i in range(3)]
    decodes = [(Entry(random_token_ids(n + 1, seed=n), n, list(range(n // BLOCK_SIZE + 1))), 1) for n in (3, 40, 90)]
    with fake_cuda(memory):
        runner = _runner(model_dir, gpu_memory_utilization=1.5 / 80)
        config = runner.config
        budget = 1.5 * GiB - GiB // 4 - GiB // 4
        useful = MAX_NUM_SEQS * math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
        assert runner.num_kv_blocks == min(useful, int(budget // runner._block_bytes()))
        assert runner.kv_cache.device.type == "cuda" and runner.kv_cache.shape[2] == runner.num_kv_blocks
        assert all(p.device.type == "cuda" for p in runner.model.parameters())
        assert sorted(FakeGraphRunner.captured_batch_sizes) == graph_batch_sizes(MAX_NUM_SEQS)

        # The persistent batch's step: three long prompts arrive, prefilled in chunks over two steps (no row
        # reaches its end, so nothing samples: sampling reads the sampled ids back, which a fake device cannot).
        new = [NewSequenceData(seq_id=i, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                               block_ids=[4 * i + j for j in range(4)], params=SamplingParams(), seed=None,
                               stop_token_ids=[]) for i, prompt in enumerate(prompts)]
        first = runner.execute_model(SchedulerOutput(new_seqs=new, cached_seqs=[],
                                                     num_scheduled_tokens={0: 20, 1: 30, 2: 9}))
        second = runner.execute_model(SchedulerOutput(
            new_seqs=[], cached_seqs=[CachedSequenceData(i, [], 4, [], n) for i, n in ((0, 20), (2, 9))],
            num_scheduled_tokens={0: 25, 2: 40}, finished_seq_ids=[1]))
        assert first.sampled_token_ids == second.sampled_token_ids == {}
        assert runner.input_batch.num_rows == 2 and set(runner.input_batch.states) == {0, 2}

        logits = runner.compute_logits_for(batch)
        assert logits.shape == (4, config.vocab_size) and logits.device.type == "cuda"
        logits, extra = runner.compute_logits_for(batch, all_logits_for=[1])
        assert extra[0].shape == (38, config.vocab_size)
        logits = runner.compute_logits_for(decodes)   # a pure decode batch: pads to the graph of 4
        assert logits.shape == (3, config.vocab_size) and logits.device.type == "cuda"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_few_row_layers_run_the_cuda_paths(tiny_model_dir, arch, monkeypatch):
    """ENGINE_SKINNY_GEMM_MAX_ROWS on CUDA: the decode graphs of up to its rows capture the few-row layers
    (pagedkernels.skinny_gemm's fake implementation checks every argument's device, dtype and shape) with no host
    sync; decode batches on them, and a mixed batch on the ordinary layers."""
    model_dir = tiny_model_dir(arch)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    calls = []
    from pagedkernels import torch_ops
    real = torch_ops._skinny_gemm_residual_op
    monkeypatch.setattr(torch_ops, "_skinny_gemm_residual_op",
                        lambda *args: (calls.append(args[0].shape[0]), real(*args))[1])
    FakeGraphRunner.captured_batch_sizes = []
    decodes = [(Entry(random_token_ids(n + 1, seed=n), n, [n // BLOCK_SIZE]), 1) for n in (3, 9, 14)]
    mixed = _mixed_batch()
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        runner = _runner(model_dir, num_kv_blocks=64)
        assert runner.skinny_max_rows == 8 and all(layer.skinny for layer in runner.model.model.layers)
        assert sorted(FakeGraphRunner.captured_batch_sizes) == graph_batch_sizes(MAX_NUM_SEQS)
        # the residual products of the captures of 8, 4, 2 and 1 rows (warm-up and recording), two a layer, and of
        # the kernel warm-up's prompts of 4 and 8 tokens (ModelRunner.warm_up_kernels); the graphs of 16 rows and the
        # longer prompts the ordinary layers
        layers = runner.config.num_hidden_layers
        assert sorted(set(calls)) == [1, 2, 4, 8] and runner.warm_up_sizes()[:3] == [4, 8, 16]
        assert [calls.count(n) for n in (1, 2, 4, 8)] == [2 * 2 * layers] * 2 + [3 * 2 * layers] * 2
        assert runner.compute_logits_for(decodes).shape == (3, runner.config.vocab_size)
        logits = runner.compute_logits_for(mixed)
        assert logits.shape == (4, runner.config.vocab_size) and logits.device.type == "cuda"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_fused_decode_reduce_runs_the_cuda_paths(tiny_model_dir, arch, monkeypatch):
    """ENGINE_DECODE_FUSED_REDUCE=1 on CUDA: every attention layer holds the runner's split counters (int32 zeros on
    the device, a row per sequence and KV head), the decode graphs capture the decode op with them (the few-row graph
    of one token too), with no host sync; set_decode_fused_reduce(False) on the built runner takes them back and drops
    the graphs, and the next decode step captures again without them."""
    model_dir = tiny_model_dir(arch)
    monkeypatch.setenv("ENGINE_DECODE_FUSED_REDUCE", "1")
    from pagedkernels import torch_ops
    fused, plain = [], []
    for name, calls in (("_paged_decode_attention_fused_reduce_op", fused),
                        ("_paged_decode_attention_workspace_op", plain)):
        real = getattr(torch_ops, name)
        monkeypatch.setattr(torch_ops, name, lambda *args, real=real, calls=calls: (calls.append(args[0].shape[0]),
                                                                                     real(*args))[1])
    decodes = [(Entry(random_token_ids(n + 1, seed=n), n, [n // BLOCK_SIZE]), 1) for n in (3, 9, 14)]
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        runner = _runner(model_dir, num_kv_blocks=64)
        counters = runner.decode_split_counters
        assert counters.device.type == "cuda" and counters.dtype == torch.int32
        assert counters.numel() == MAX_NUM_SEQS * runner.attention_layers[0].num_kv_heads
        assert all(layer.decode_split_counters is counters for layer in runner.attention_layers)
        layers = len(runner.attention_layers)
        # every ladder size captured (warm-up and recording) on the fused op, none on the other
        assert sorted(set(fused)) == graph_batch_sizes(MAX_NUM_SEQS) and plain == []
        assert all(fused.count(n) == 2 * layers for n in graph_batch_sizes(MAX_NUM_SEQS))
        assert runner.compute_logits_for(decodes).shape == (3, runner.config.vocab_size)
        assert runner.set_decode_fused_reduce(True) and len(runner.graphs) == len(graph_batch_sizes(MAX_NUM_SEQS))
        fused.clear()
        assert runner.set_decode_fused_reduce(False) is False
        assert runner.graphs == {} and all(layer.decode_split_counters is None for layer in runner.attention_layers)
        assert runner.compute_logits_for(decodes).shape == (3, runner.config.vocab_size)
        assert fused == [] and plain.count(4) == 2 * layers   # the graph of 4, captured again on first use
        assert runner.set_decode_fused_reduce(True) and runner.graphs == {}


def test_the_fused_decode_reduce_setting(tiny_model_dir, monkeypatch):
    """Off by default (unmeasured on a GPU); ENGINE_DECODE_FUSED_REDUCE turns it on for CUDA only (a CPU decode runs
    no split kernel, and its runner has no counters to take); a bad value names the variable."""
    _assert_cuda_only_switch(monkeypatch, "ENGINE_DECODE_FUSED_REDUCE", "decode_fused_reduce")
    from tests.engine.test_cuda_graph_runner import make_runner
    runner = make_runner(tiny_model_dir("llama"), enforce_eager=True)
    assert runner.set_decode_fused_reduce(True) is False
    assert all(layer.decode_split_counters is None for layer in runner.attention_layers)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_fused_decode_rope_runs_the_cuda_paths(tiny_model_dir, arch, monkeypatch):
    """ENGINE_DECODE_FUSED_ROPE=1 on CUDA with the few-row layers up to 2 rows: their decode graphs (1 and 2 rows)
    capture pagedkernels.rotary_cache_decode_attention (its fake path checks every argument's device, dtype and
    shape), with the norms' weights for Qwen3, and no rotary_embedding_and_cache; the larger graphs rotate as
    before. set_decode_fused_rope(False) drops the graphs and the next captures run the two ops."""
    model_dir = tiny_model_dir(arch)
    monkeypatch.setenv("ENGINE_DECODE_FUSED_ROPE", "1")
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "2")
    import pagedkernels
    fused, two_ops = [], []
    real_fused, real_two = pagedkernels.rotary_cache_decode_attention, pagedkernels.rotary_embedding_and_cache

    def fused_op(*args, **kwargs):
        fused.append((args[1].shape[0], kwargs["q_weight"] is not None))
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(pagedkernels, "rotary_cache_decode_attention", fused_op)
    monkeypatch.setattr(pagedkernels, "rotary_embedding_and_cache",
                        lambda *args, **kwargs: (two_ops.append(args[1].shape[0]), real_two(*args, **kwargs))[1])
    decodes = [(Entry(random_token_ids(n + 1, seed=n), n, [n // BLOCK_SIZE]), 1) for n in (3, 9)]
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        runner = _runner(model_dir, num_kv_blocks=64)
        layers = len(runner.attention_layers)
        assert all(layer.decode_fused_rope for layer in runner.attention_layers)
        # the captures of 1 and 2 rows (warm-up and recording), one call a layer
        assert sorted({n for n, _ in fused}) == [1, 2] and two_ops == []
        assert all([n for n, _ in fused].count(rows) == 2 * layers for rows in (1, 2))
        assert all(norms == (arch == "qwen3") for _, norms in fused)
        assert runner.compute_logits_for(decodes).shape == (2, runner.config.vocab_size)
        fused.clear()
        assert runner.set_decode_fused_rope(False) is False and runner.graphs == {}
        assert runner.compute_logits_for(decodes).shape == (2, runner.config.vocab_size)
        assert fused == [] and two_ops.count(2) == 2 * layers   # the graph of 2, captured again without it
        assert runner.set_decode_fused_rope(True) and runner.graphs == {}


def test_the_fused_decode_rope_setting(tiny_model_dir, monkeypatch):
    """Off by default (unmeasured on a GPU); ENGINE_DECODE_FUSED_ROPE turns it on for CUDA only; a bad value names
    the variable; a CPU runner (no decode kernel in its steps) keeps it off."""
    _assert_cuda_only_switch(monkeypatch, "ENGINE_DECODE_FUSED_ROPE", "decode_fused_rope")
    from tests.engine.test_cuda_graph_runner import make_runner
    runner = make_runner(tiny_model_dir("llama"), enforce_eager=True)
    assert runner.set_decode_fused_rope(True) is False
    assert not any(layer.decode_fused_rope for layer in runner.attention_layers)


def test_verification_graphs_run_the_cuda_paths(tiny_model_dir, monkeypatch):
    """ENGINE_SPEC_DECODE_GRAPHS=1 with n-gram speculation on CUDA: a verification-shaped step (every sequence 1 + 3
    tokens) captures the graph of (padded batch size, 4) on the fake device with no host sync, its static inputs on
    the device, and replays it; a step of other lengths runs eagerly; on by default, ENGINE_SPEC_DECODE_GRAPHS=0
    off."""
    model_dir = tiny_model_dir("qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    monkeypatch.setenv("ENGINE_SPEC_DECODE_GRAPHS", "0")
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        assert _runner(model_dir, num_kv_blocks=64, speculative_config=spec).spec_graphs is False
    monkeypatch.delenv("ENGINE_SPEC_DECODE_GRAPHS", raising=False)
    FakeGraphRunner.captured_batch_sizes = []
    verify = [(Entry(random_token_ids(n + 4, seed=n), n, [0 if n < BLOCK_SIZE else 2, 3]), 4) for n in (5, 9, 12)]
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        runner = _runner(model_dir, num_kv_blocks=64, speculative_config=spec)
        assert runner.spec_graphs
        decode_graphs = len(FakeGraphRunner.captured_batch_sizes)
        logits = runner.compute_logits_for(verify)
        assert logits.shape == (3, runner.config.vocab_size) and logits.device.type == "cuda"
        assert list(runner.verify_graphs) == [(4, 4)]
        assert FakeGraphRunner.captured_batch_sizes[decode_graphs:] == [16]   # 4 sequences x 4 tokens
        static, cu_seqlens, _ = runner._verify_static[(4, 4)]
        assert static.input_ids.device.type == "cuda" and static.input_ids.shape == (16,)
        assert cu_seqlens.device.type == "cuda" and cu_seqlens.shape == (5,)
        assert runner.compute_logits_for(verify[:2]).shape == (2, runner.config.vocab_size)   # the (2, 4) graph
        mixed = [(verify[0][0], 4), (verify[1][0], 3)]
        assert runner.compute_logits_for(mixed).shape == (2, runner.config.vocab_size)
        assert sorted(runner.verify_graphs) == [(2, 4), (4, 4)]


def test_kv_sizing_refuses_more_than_is_free(tiny_model_dir):
    model_dir = tiny_model_dir("llama")   # made before fake mode (the directory is written for real)
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=40 * GiB)):
        with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 asks for 72.00 GiB.*only 40.00 GiB is free"):
            _runner(model_dir)


def test_the_tier_catches_a_tensor_on_the_wrong_device(tiny_model_dir, monkeypatch):
    """The rotary table as it was first written (its angles mixed a CPU operand with a tensor made under
    `with torch.device(cuda)`): every model with rotary failed to build on CUDA."""
    import pagedkernels.rotary

    def table_mixing_devices(max_position, rot_dim, base, *, dtype=torch.float32, inv_freq=None, device=None):
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq.double().cpu())
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)

    model_dir = tiny_model_dir("llama")
    monkeypatch.setattr(pagedkernels.rotary, "compute_cos_sin_cache", table_mixing_devices)
    monkeypatch.setattr("pagedkernels.compute_cos_sin_cache", table_mixing_devices)
    with fake_cuda(), pytest.raises(FakeTensorDeviceMismatchError):
        _runner(model_dir, num_kv_blocks=32)


def test_the_tier_catches_a_cpu_tensor_in_the_forward(tiny_model_dir, monkeypatch):
    """A tensor made without a device inside the forward lands on the CPU on a real GPU too."""
    from engine.layers.layernorm import RMSNorm

    forward = RMSNorm.forward

    def forward_with_cpu_tensor(self, x, residual=None):
        out = forward(self, x, residual)
        scale = torch.ones(x.shape[-1])   # no device: the CPU
        return (out[0] * scale, out[1]) if isinstance(out, tuple) else out * scale

    model_dir = tiny_model_dir("llama")
    monkeypatch.setattr(RMSNorm, "forward", forward_with_cpu_tensor)
    with fake_cuda(), pytest.raises(FakeTensorDeviceMismatchError):
        _runner(model_dir, num_kv_blocks=32)


@pytest.mark.parametrize("sync", ["item", "tolist", "to_cpu", "synchronize"])
def test_the_tier_catches_a_host_sync_inside_capture(tiny_model_dir, monkeypatch, sync):
    from engine.layers.layernorm import RMSNorm

    forward = RMSNorm.forward

    def forward_with_sync(self, x, residual=None):
        if sync == "item":
            x[0, 0].item()
        elif sync == "tolist":
            x[0].tolist()
        elif sync == "to_cpu":
            x.cpu()
        else:
            torch.cuda.synchronize()
        return forward(self, x, residual)

    model_dir = tiny_model_dir("llama")
    with fake_cuda():
        runner = _runner(model_dir, num_kv_blocks=32, capture_graphs_at_startup=False)
        monkeypatch.setattr(RMSNorm, "forward", forward_with_sync)
        with pytest.raises(HostSyncError):
            runner.capture_all_graphs()


def test_kv_budget_arithmetic():
    start = gpu_memory.MemorySnapshot(free=70 * GiB, total=80 * GiB, allocated=GiB, reserved=2 * GiB)
    # Torch allocated up to 9 GiB (1 GiB was there before), reserved 6 GiB more, free fell by 8 GiB: 2 GiB
    # went outside torch.
    after = gpu_memory.MemorySnapshot(free=62 * GiB, total=80 * GiB, allocated=GiB, reserved=8 * GiB)
    budget = gpu_memory.kv_cache_budget(start, after, peak_allocated=9 * GiB, gpu_memory_utilization=0.5)
    assert (budget.requested, budget.torch_peak, budget.non_torch) == (40 * GiB, 8 * GiB, 2 * GiB)
    assert budget.kv_cache == 30 * GiB
    gpu_memory.check_free_memory(start, 0.875)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9"):
        gpu_memory.check_free_memory(start, 0.9)


def test_profile_step_through_the_cpu_double(tiny_model_dir, monkeypatch):
    """On a real CPU forward with scripted counters: the profile step runs max_num_batched_tokens tokens over
    min(max_num_seqs, tokens) sequences, the logits of every token (the most prompt logprobs a step can ask
    for) and the sampler over the sequences' last tokens; the block count follows the arithmetic."""
    import engine.worker.model_runner as model_runner_module

    model_dir = tiny_model_dir("qwen3")
    logits_rows, sampled_rows = [], []
    dummy_run = model_runner_module.sampler_dummy_run
    monkeypatch.setattr(model_runner_module, "sampler_dummy_run",
                        lambda logits: sampled_rows.append(tuple(logits.shape)) or dummy_run(logits))
    memory = FakeCudaMemory(total=16 * GiB, free=15 * GiB, peak_bytes=GiB, non_torch_bytes=GiB // 2)
    config = engine_config(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                           gpu_memory_utilization=0.125, max_num_seqs=4, max_num_batched_tokens=200, enforce_eager=True)
    runner = ModelRunner(config, memory=memory)
    config = runner.config
    compute_logits = runner.model.compute_logits
    # Free memory read and peak reset before the weights load; the peak read after the profile step.
    reset = memory.calls.index("reset_peak_memory_stats")
    assert "mem_get_info" in memory.calls[:reset] and memory.calls.index("max_memory_allocated") > reset
    # The profile ran inside the constructor; run it again with the spy on to see its shapes.
    monkeypatch.setattr(runner.model, "compute_logits",
                        lambda hidden: logits_rows.append(hidden.shape[0]) or compute_logits(hidden))
    runner._profile_run()
    assert sorted(logits_rows) == [4, 200] and sampled_rows[-1] == (4, config.vocab_size)
    budget = 0.125 * 16 * GiB - GiB - GiB // 2
    useful = 4 * math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
    assert runner.num_kv_blocks == min(useful, int(budget // runner._block_bytes()))


def test_memory_cached_by_torch_counts_as_free_at_start(tiny_model_dir):
    """An engine started in a process where an earlier one was shut down: the blocks torch's allocator still holds
    (reserved, no tensor in them) go back to the device before the free memory is checked, so the second engine
    may take what the first one had."""
    memory = FakeCudaMemory(total=16 * GiB, free=12 * GiB, peak_bytes=GiB)
    memory.reserved = 3 * GiB   # cached by torch after the earlier engine's tensors were freed
    config = engine_config(tiny_model_dir("llama"), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                           gpu_memory_utilization=0.9, enforce_eager=True)
    runner = ModelRunner(config, memory=memory)   # 14.4 GiB asked: 12 GiB free before the cache is emptied
    assert memory.calls.index("empty_cache") < memory.calls.index("mem_get_info")
    assert runner.num_kv_blocks > 0


def test_async_steps_queue_without_waiting_for_the_device(tiny_model_dir, monkeypatch):
    """Async scheduling on the CUDA paths: a step that samples (greedy, temperature with top-k/top-p/min-p,
    penalties, logit_bias, bad words, min_tokens, logprobs) and the decode step after it, fed the previous step's
    ids from the device, queue everything without one host sync or pageable copy (no_host_sync); the only read is
    the deliberate one of the previous step's ids, one step late (SampledIds.resolve, stood in for here: a fake
    device holds no values)."""
    from engine.worker.sampler import AsyncModelRunnerOutput, SampledIds
    from tests.engine.fake_cuda import no_host_sync

    model_dir = tiny_model_dir("llama")
    resolved = []

    def resolve_without_reading(self):   # the one allowed read, one step late: stood in for with zeros
        resolved.append(list(self.seq_ids))
        self.values = [0] * len(self.seq_ids)

    monkeypatch.setattr(SampledIds, "resolve", resolve_without_reading)
    kinds = [SamplingParams(temperature=0),
             SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
             SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.1),
             SamplingParams(temperature=0, logit_bias={3: 2.0}, bad_words=["x"], min_tokens=4, logprobs=2)]
    prompts = [random_token_ids(9 + i, seed=30 + i) for i in range(len(kinds))]
    with fake_cuda():
        runner = _runner(model_dir, num_kv_blocks=64, async_scheduling=True)
        new = [NewSequenceData(seq_id=i, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                               block_ids=[i], params=params, seed=None, stop_token_ids=[2],
                               bad_words_token_ids=[[7]] if params.bad_words else [])
               for i, (prompt, params) in enumerate(zip(prompts, kinds))]
        with no_host_sync():
            first = runner.execute_model(SchedulerOutput(
                new_seqs=new, cached_seqs=[], num_scheduled_tokens={i: len(p) for i, p in enumerate(prompts)}))
        assert isinstance(first, AsyncModelRunnerOutput) and not resolved
        decode = [CachedSequenceData(i, [], 1, [], len(p), token_start=len(p)) for i, p in enumerate(prompts)]
        with no_host_sync():
            second = runner.execute_model(SchedulerOutput(new_seqs=[], cached_seqs=decode,
                                                          num_scheduled_tokens={i: 1 for i in range(len(kinds))}))
        assert isinstance(second, AsyncModelRunnerOutput)
        assert resolved == [[0, 1, 2, 3]]   # the first step's ids, read during the second
        # ... and appended to the worker's own batch, so the second step's penalties and bad words saw them.
        assert all(len(runner.input_batch.states[i].token_ids) == len(p) + 1 for i, p in enumerate(prompts))


def _sample_two_steps(model_dir: str, kinds: list[SamplingParams], monkeypatch) -> ModelRunner:
    """A prompt step and a decode step (async scheduling) of one request per kind of sampling on the fake CUDA
    device, each queued with no host sync (the one-step-late read of the ids stood in for)."""
    from engine.worker.sampler import SampledIds
    from tests.engine.fake_cuda import no_host_sync

    monkeypatch.setattr(SampledIds, "resolve", lambda self: setattr(self, "values", [0] * len(self.seq_ids)))
    prompts = [random_token_ids(9 + i, seed=40 + i) for i in range(len(kinds))]
    with fake_cuda():
        runner = _runner(model_dir, num_kv_blocks=64, async_scheduling=True)
        new = [NewSequenceData(seq_id=i, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                               block_ids=[i], params=params, seed=params.seed, stop_token_ids=[2],
                               bad_words_token_ids=[[7]] if params.bad_words else [])
               for i, (prompt, params) in enumerate(zip(prompts, kinds))]
        with no_host_sync():
            runner.execute_model(SchedulerOutput(
                new_seqs=new, cached_seqs=[], num_scheduled_tokens={i: len(p) for i, p in enumerate(prompts)}))
        decode = [CachedSequenceData(i, [], 1, [], len(p), token_start=len(p)) for i, p in enumerate(prompts)]
        with no_host_sync():
            runner.execute_model(SchedulerOutput(new_seqs=[], cached_seqs=decode,
                                                 num_scheduled_tokens={i: 1 for i in range(len(kinds))}))
    return runner


@pytest.mark.parametrize("filters", ["none", "min_p", "top_k_top_p"])
def test_the_fused_draw_runs_the_cuda_paths(tiny_model_dir, monkeypatch, filters):
    """The fused draw, CUDA's default: a sampling step's draw goes through pagedkernels.sample_from_logits (its fake
    implementation checks every argument's device, dtype and shape) with no host sync and no sort of the batch, in a
    batch without min-p / top-k / top-p (the kernel alone: greedy, seeded, penalties, logit_bias and bad words
    beside it) and in one with min-p too (the kernel's mask, its values on the device). A batch with top-k / top-p
    rows keeps the tensor ops (the kernel's threshold search measured 0.21x their candidates path on the H200)."""
    from engine.worker import sampler as sampler_module

    monkeypatch.delenv("ENGINE_FUSED_SAMPLER", raising=False)
    sorted_calls = []
    real_sorted = sampler_module._top_k_top_p_sorted
    monkeypatch.setattr(sampler_module, "_top_k_top_p_sorted",
                        lambda *args: (sorted_calls.append(1), real_sorted(*args))[1])
    draws = []
    real = sampler_module.pk_sample_from_logits
    monkeypatch.setattr(sampler_module, "pk_sample_from_logits", lambda logits, *args: (
        draws.append((logits.device.type, logits.shape, *(None if a is None else a.device.type for a in args))),
        real(logits, *args))[1])
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3),
             SamplingParams(temperature=0.7, repetition_penalty=1.2, logit_bias={3: 2.0}, bad_words=["x"])]
    if filters == "min_p":
        kinds.append(SamplingParams(temperature=0.9, min_p=0.05))
    if filters == "top_k_top_p":
        kinds += [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5), SamplingParams(top_p=0.8)]
    runner = _sample_two_steps(tiny_model_dir("llama"), kinds, monkeypatch)
    assert runner.sampler.fused_draw
    shape = (len(kinds), runner.config.vocab_size)
    # first the start-up's kernel warm-up: the draw without and with min-p on its prompts' two rows
    warm_up = [("cuda", (2, runner.config.vocab_size), "cuda", "cuda", None, None, min_p) for min_p in (None, "cuda")]
    if filters == "top_k_top_p":
        assert draws == warm_up and sorted_calls == [1, 1]
    else:
        min_p = "cuda" if filters == "min_p" else None
        assert draws == warm_up + [("cuda", shape, "cuda", "cuda", None, None, min_p)] * 2 and not sorted_calls


def test_a_top_k_batch_draws_among_candidates_on_the_cuda_paths(tiny_model_dir, monkeypatch):
    """Every sampling row with top-k (a greedy one beside them): the sync-free draw takes each row's candidates
    (one top-k selection, then top-p and min-p among them) instead of sorting the batch, with no host sync."""
    from engine.worker import sampler as sampler_module

    calls = {"candidates": 0, "sorted": 0}
    for name, key in (("top_k_top_p_candidates", "candidates"), ("_top_k_top_p_sorted", "sorted")):
        real = getattr(sampler_module, name)
        monkeypatch.setattr(sampler_module, name, lambda *args, real=real, key=key: (
            calls.__setitem__(key, calls[key] + 1), real(*args))[1])
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
             SamplingParams(temperature=0.7, top_k=50, min_p=0.05, repetition_penalty=1.2)]
    _sample_two_steps(tiny_model_dir("llama"), kinds, monkeypatch)
    assert calls == {"candidates": 2, "sorted": 0}


def test_the_fused_sampler_setting(monkeypatch):
    """DevicePolicy.fused_sampler: on by default on CUDA (the H200 measured it: 1.18x on nano-vllm's protocol),
    ENGINE_FUSED_SAMPLER=0 turns it off; never on the CPU (its sampler checks values on the host instead); a bad
    value names the variable."""
    _assert_cuda_only_switch(monkeypatch, "ENGINE_FUSED_SAMPLER", "fused_sampler", default=True)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_a_greedy_decode_step_copies_to_the_device_once(tiny_model_dir, monkeypatch, num_seqs):
    """Async scheduling, greedy requests in steady decoding (every row's input the id it sampled last step, the step
    graph's own argmax the draw): one host -> device copy a step, the step's inputs, straight into its graph's inputs
    (padding rows included). The ids in flight go onto the inputs in one device copy, the logits and greedy ids are
    the graph's rows as they are, and the temperatures a kept tensor of zeros. A step that adds a sequence beside
    them gathers and scatters as before."""
    from engine.worker.input_batch import HostStaging
    from engine.worker.sampler import SampledIds

    model_dir = tiny_model_dir("llama")
    monkeypatch.setattr(SampledIds, "resolve", lambda self: setattr(self, "values", [5] * len(self.seq_ids)))
    copies = []
    real, real_region = HostStaging.to_device_many, HostStaging.to_device_region
    monkeypatch.setattr(HostStaging, "to_device_many",
                        lambda self, *arrays: (copies.append([a.shape for a in arrays]), real(self, *arrays))[1])
    monkeypatch.setattr(HostStaging, "to_device_region", lambda self, region, parts: (
        copies.append(("graph inputs", len(parts))), real_region(self, region, parts))[1])
    prompts = [random_token_ids(9 + i, seed=40 + i) for i in range(num_seqs + 1)]
    greedy = SamplingParams(temperature=0)

    def new(i):
        return NewSequenceData(seq_id=i, token_ids=prompts[i], num_prompt_tokens=len(prompts[i]),
                               num_computed_tokens=0, block_ids=[i], params=greedy, seed=None, stop_token_ids=[2],
                               bad_words_token_ids=[])

    with fake_cuda():
        runner = _runner(model_dir, num_kv_blocks=64, async_scheduling=True)
        runner.execute_model(SchedulerOutput(new_seqs=[new(i) for i in range(num_seqs)], cached_seqs=[],
                                             num_scheduled_tokens={i: len(prompts[i]) for i in range(num_seqs)}))
        for step in range(3):
            copies.clear()
            decode = [CachedSequenceData(i, [], 1, [], len(prompts[i]) + step, token_start=len(prompts[i]) + step)
                      for i in range(num_seqs)]
            runner.execute_model(SchedulerOutput(new_seqs=[], cached_seqs=decode,
                                                 num_scheduled_tokens={i: 1 for i in range(num_seqs)}))
            # build_inputs' five arrays straight into the graph's inputs, nothing else
            assert copies == [("graph inputs", 5)], copies
        copies.clear()
        decode = [CachedSequenceData(i, [], 1, [], len(prompts[i]) + 3, token_start=len(prompts[i]) + 3)
                  for i in range(num_seqs)]
        runner.execute_model(SchedulerOutput(new_seqs=[new(num_seqs)], cached_seqs=decode,
                                             num_scheduled_tokens={**{i: 1 for i in range(num_seqs)},
                                                                   num_seqs: len(prompts[num_seqs])}))
        assert [len(c) for c in copies][:2] == [6, 2]   # a mixed step's inputs, then the in-flight ids' positions


@pytest.mark.parametrize("batch", ["mixed", "greedy"])
def test_a_speculative_step_reads_the_device_once(tiny_model_dir, monkeypatch, batch):
    """An n-gram speculative step on the CUDA paths (greedy and sampled rows verifying drafts, seeded and not; or
    greedy rows alone, two with logprobs: the drafts checked against the plain draw's picks, the logprobs read with
    the tokens) queues its
    verification and rejection sampling without a host sync or pageable copy; its one read is the accepted tokens
    (ModelRunner._read_speculative, stood in for here: a fake device holds no values). The H200's sync audit
    counted 8 a step before (2026-11-28)."""
    from engine.worker.sampler import SampledIds
    from tests.engine.fake_cuda import no_host_sync

    model_dir = tiny_model_dir("llama")
    reads = []

    def read_without_values(result, packed=None):   # the one read: every draft rejected, token 5 sampled after it
        reads.append(tuple(result.output_token_ids.shape))
        num_reqs, width = result.output_token_ids.shape
        rows = None if packed is None else [[[5.0, -1.0, 1.0] + [-1.0] * (packed.shape[1] - 3)] * width] * num_reqs
        return [[5] + [-1] * (width - 1) + [0] for _ in range(num_reqs)], rows

    monkeypatch.setattr(ModelRunner, "_read_speculative", staticmethod(read_without_values))
    kinds = ([SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0.7, seed=3)] if batch == "mixed" else
             [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0, logprobs=0)])
    prompts = [random_token_ids(9 + i, seed=50 + i) for i in range(len(kinds))]
    with fake_cuda():
        config = engine_config(model_dir, device="cuda", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                               num_kv_blocks=64, max_num_seqs=MAX_NUM_SEQS,
                               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        runner = ModelRunner(config, graph_runner_class=FakeGraphRunner, compile_model=False,
                             capture_graphs_at_startup=True)
        monkeypatch.setattr(runner, "_propose", lambda output, scheduler_output: None)   # reads tokens: not here
        new = [NewSequenceData(seq_id=i, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                               block_ids=[i], params=params, seed=params.seed, stop_token_ids=[2],
                               bad_words_token_ids=[])
               for i, (prompt, params) in enumerate(zip(prompts, kinds))]
        # The prompt step samples plain rows, read as they are (no async scheduling beside speculation): zeros.
        monkeypatch.setattr(SampledIds, "resolve", lambda self: setattr(self, "values", [0] * len(self.seq_ids)))
        runner.execute_model(SchedulerOutput(
            new_seqs=new, cached_seqs=[], num_scheduled_tokens={i: len(p) for i, p in enumerate(prompts)}))
        assert not reads
        decode = [CachedSequenceData(i, [7], 1, [], len(p), token_start=len(p)) for i, p in enumerate(prompts)]
        drafts = {0: [3, 4, 5], 1: [6, 7], 2: [8]}
        with no_host_sync():
            output = runner.execute_model(SchedulerOutput(
                new_seqs=[], cached_seqs=decode, num_scheduled_tokens={i: 1 + len(drafts[i]) for i in drafts},
                spec_token_ids=drafts))
        assert not output.failed, output.failed   # (a sync raised inside sampling fails the rows instead)
        assert reads == [(3, 4)]
        assert output.sampled_token_ids == {0: [5], 1: [5], 2: [5]} and output.num_accepted_tokens == {0: 0, 1: 0, 2: 0}
        if batch == "greedy":
            assert sorted(output.logprobs) == [1, 2] and output.logprobs[1].ranks == [1]
            assert len(output.logprobs[1].topk_token_ids[0]) == 2 and output.logprobs[2].topk_token_ids == [[]]


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_draft_model_proposals_run_the_cuda_paths(tiny_model_dir, monkeypatch, graphs):
    """A draft model's proposal on the CUDA paths, three sequences (greedy, sampled with top-k/top-p, seeded): its
    block copies, k steps and draws queue without a host sync or pageable copy, each step's ids taken from the last
    step's draws on the device; its one read is the drafts at the end (DraftModel._read, stood in for: a fake device
    holds no values). With ENGINE_SPEC_DECODE_GRAPHS=1 the steps replay the draft's graph of 4 rows, captured on the
    first step with its static inputs on the device; without, they run eagerly."""
    from engine.worker.draft_model import DraftModel
    from engine.worker.sampler import SampledIds
    from tests.engine.fake_cuda import no_host_sync

    model_dir, draft_dir = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    monkeypatch.setenv("ENGINE_SPEC_DECODE_GRAPHS", graphs)
    reads = []

    def read_without_values(drafts):
        reads.append((tuple(drafts.shape), drafts.device.type))
        return np.full(tuple(drafts.shape), 7)

    monkeypatch.setattr(DraftModel, "_read", staticmethod(read_without_values))
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
             SamplingParams(temperature=0.7, seed=3)]
    prompts = [random_token_ids(14 + i, seed=60 + i) for i in range(len(kinds))]
    FakeGraphRunner.captured_batch_sizes = []
    with fake_cuda():
        runner = _runner(model_dir, num_kv_blocks=64, speculative_config={"model": draft_dir,
                                                                           "num_speculative_tokens": 3})
        drafter = runner.drafter
        assert runner.spec_graphs == drafter.graphs_on == (graphs == "1")
        assert all(layer.use_decode_kernel and layer.decode_workspace.device.type == "cuda"
                   for layer in drafter.layers)
        monkeypatch.setattr(runner, "_propose", lambda output, scheduler_output: None)   # proposed by hand below
        monkeypatch.setattr(SampledIds, "resolve", lambda self: setattr(self, "values", [0] * len(self.seq_ids)))
        new = [NewSequenceData(seq_id=i, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                               block_ids=[2 * i, 2 * i + 1], params=params, seed=params.seed, stop_token_ids=[2],
                               bad_words_token_ids=[])
               for i, (prompt, params) in enumerate(zip(prompts, kinds))]
        runner.execute_model(SchedulerOutput(new_seqs=new, cached_seqs=[],
                                             num_scheduled_tokens={i: len(p) for i, p in enumerate(prompts)}))
        decode_graphs = len(FakeGraphRunner.captured_batch_sizes)
        with no_host_sync():   # the capture on the first step included
            drafts = drafter.propose([(i, [5]) for i in range(len(prompts))])
        assert reads == [((3, 3), "cuda")] and drafts == {i: [7, 7, 7] for i in range(3)}
        # q for the rejection sampler (the greedy row's: zeros, unused), on the device
        assert set(drafter.draft_probs) == {0, 1, 2}
        assert all(q.device.type == "cuda" and q.shape == (3, drafter.config.vocab_size)
                   for q in drafter.draft_probs.values())
        if graphs == "1":
            assert list(drafter.graphs) == [4] and FakeGraphRunner.captured_batch_sizes[decode_graphs:] == [4]
            static, cu_seqlens = drafter._graph_inputs[4]
            assert static.block_tables.shape == (4, drafter.graph_width) and cu_seqlens.device.type == "cuda"
            assert all(t.device.type == "cuda" for t in static)
        else:
            assert drafter.graphs == {} and FakeGraphRunner.captured_batch_sizes[decode_graphs:] == []


@pytest.mark.parametrize("draft", [False, True])
def test_copy_on_write_queues_without_a_host_sync(tiny_model_dir, draft):
    """A step's copy-on-write block copies (ModelRunner.copy_blocks: forks, n > 1, beams), a draft model's cache
    copied alongside, go to the device through the pinned staging: no pageable copy (which waits for the device's
    queued work), no read."""
    from tests.engine.fake_cuda import no_host_sync

    model_dir, draft_dir = tiny_model_dir("llama"), tiny_model_dir("qwen3")   # written before fake mode
    spec = {"model": draft_dir, "num_speculative_tokens": 2} if draft else None
    with fake_cuda():
        runner = _runner(model_dir, num_kv_blocks=64, speculative_config=spec)
        assert (runner.drafter is not None) == draft
        with no_host_sync():
            runner.copy_blocks([(1, 5), (2, 6), (3, 7)])


def test_the_folded_lm_head_runs_the_cuda_paths(tiny_model_dir, monkeypatch):
    """ENGINE_SKINNY_LM_HEAD=1 with the few-row layers on CUDA: the step graphs of up to their rows end in the LM
    head's few-row product with the final norm in its prologue (pagedkernels.skinny_gemm's fake implementation checks
    every argument's device, dtype and shape), captured with no host sync; the larger graphs keep the norm and the
    head apart; a decode batch replays."""
    from pagedkernels import torch_ops

    model_dir = tiny_model_dir("qwen3")
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "4")
    monkeypatch.setenv("ENGINE_SKINNY_LM_HEAD", "1")
    heads, head = [], None   # (the start-up's kernel warm-up runs the few-row layers before the head is known)
    real = torch_ops._skinny_gemm_op
    monkeypatch.setattr(torch_ops, "_skinny_gemm_op", lambda x, weight, *args: (
        heads.append(x.shape[0]) if weight is head else None, real(x, weight, *args))[1])
    FakeGraphRunner.captured_batch_sizes = []
    decodes = [(Entry(random_token_ids(n + 1, seed=n), n, [n // BLOCK_SIZE]), 1) for n in (3, 9, 14)]
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        runner = _runner(model_dir, num_kv_blocks=64, capture_graphs_at_startup=False)
        assert runner.skinny_max_rows == 4 and runner.skinny_head
        head = runner.model.lm_head.weight
        runner.capture_all_graphs()
        assert sorted(FakeGraphRunner.captured_batch_sizes) == graph_batch_sizes(MAX_NUM_SEQS)
        # the graphs of 4, 2 and 1 rows: the warm-up and the recorded pass each
        assert sorted(heads) == [1, 1, 2, 2, 4, 4]
        logits = runner.compute_logits_for(decodes)
        assert logits.shape == (3, runner.config.vocab_size) and logits.device.type == "cuda"


def test_the_kernel_warm_up_runs_each_prompt_size_through_every_model(tiny_model_dir, monkeypatch):
    """A CUDA runner's start-up warms its Triton kernels (ModelRunner.warm_up_kernels; the variants themselves are
    checked in tests/engine/test_kernel_variants.py): prompts of two sequences of 4, 8, ... tokens below
    max_num_batched_tokens through the model, a draft model's forward beside it, with the LoRA kernels on, queued
    with no host sync or pageable copy; its start-up records the time it took."""
    from engine.worker.draft_model import DraftModel
    from engine.lora.layers import LoRABatch
    from tests.engine.fake_cuda import no_host_sync

    forwards, drafts, lora = [], [], []
    real_forward, real_draft, real_prepare = ModelRunner._forward, DraftModel.run_target_step, LoRABatch.prepare
    monkeypatch.setattr(ModelRunner, "_forward", lambda self, ids, positions, meta, **kwargs: (
        forwards.append((ids.shape[0], meta.cu_seqlens_q.shape[0] - 1)),
        real_forward(self, ids, positions, meta, **kwargs))[1])
    monkeypatch.setattr(DraftModel, "run_target_step", lambda self, ids, positions, meta: (
        drafts.append(ids.shape[0]), real_draft(self, ids, positions, meta))[1])
    monkeypatch.setattr(LoRABatch, "prepare", lambda self, slots, num_tokens=None, **kwargs: (
        lora.append((num_tokens, kwargs.get("active"))), real_prepare(self, slots, num_tokens, **kwargs))[1])
    model_dir, draft_dir = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    with fake_cuda():
        config = engine_config(model_dir, device="cuda", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                               num_kv_blocks=64, max_num_seqs=MAX_NUM_SEQS,
                               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_lora=True, max_loras=2,
                               max_lora_rank=8, speculative_config={"model": draft_dir, "num_speculative_tokens": 2})
        runner = ModelRunner(config, graph_runner_class=FakeGraphRunner, compile_model=False,
                             capture_graphs_at_startup=False)
        sizes = runner.warm_up_sizes()
        assert sizes == [4, 8, 16, 32, 64] and MAX_NUM_BATCHED_TOKENS == 96
        assert forwards == [(n, 2) for n in sizes] and drafts == sizes
        assert lora == [(n, True) for n in sizes] + [(None, None)]
        assert runner.build_seconds["kernel warm-up"] >= 0
        forwards.clear()
        with no_host_sync():
            runner.warm_up_kernels()
        assert forwards == [(n, 2) for n in sizes]
