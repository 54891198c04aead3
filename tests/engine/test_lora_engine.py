"""Multi-LoRA through the whole engine (#38 item 4): `LLM(enable_lora=True, ...).generate(..., lora_request=...)`.

- greedy tokens equal PEFT's merged model's (transformers + peft, float32) on Llama, Qwen3 and Gemma 2 shapes, with
  four adapters and the base model in one batch, prompts chunked (chunked prefill) and decoded in CPU graphs;
- a batch mixing four adapters and the base model (prompts sharing a prefix across adapters, an n = 2 seeded
  request) equals each request run alone, with async scheduling off and on;
- the prefix cache is keyed by the adapter: a prompt cached on the base model (or another adapter) is not a hit;
- `max_loras` smaller than the adapters in flight, a host cache smaller still, and a KV cache that forces
  preemption: every step runs at most max_loras adapters, adapters are evicted and read again, and the outputs
  are still each request's alone;
- tensor parallelism (TP=2) equals TP=1; speculative decoding with a draft model drafts from the base model
  and emits the adapter's tokens;
- a bad adapter (rank over max_lora_rank, an unknown target module, shapes of another model) is a ValueError
  naming lora_request for its request alone; an adapter whose directory goes away after its request was accepted
  fails that request only (RequestOutput.error), and none of its blocks enters the prefix cache.
- on a GPU (the GPU suite), the same against PEFT in float32 and bfloat16 with the defaults there (compile, CUDA
  graphs, Triton kernels);
- on the fake CUDA device (tests/engine/fake_cuda.py), the CUDA paths: both graph variants captured without a host
  sync, the slots staged through pinned memory, the LoRA graph replayed for a decode batch with adapters only;
- the scheduler keeps a step within max_loras (a request that does not fit keeps its place), and a request's
  adapter crosses the core process's socket.

The requests run alone come from one reference engine (max_loras = 4, a cache that never preempts). Every engine here
runs on the CPU, on a GPU machine too, but the one of the CUDA test."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("peft", reason="the oracle is PEFT's merged model (pip install peft, the dev extra)")

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.core.block_manager import BlockManager  # noqa: E402
from engine.step_records import EngineCoreRequest  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.sequence import Sequence  # noqa: E402
from tests.engine.lora_util import ADAPTERS, lora_pair, peft_merged_log_probs, write_adapter  # noqa: E402
from tests.engine.models_util import random_token_ids  # noqa: E402

MAX_TOKENS = 10
SHARED = random_token_ids(20, seed=70)   # a prefix several prompts share, on different adapters


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _lora_requests(dirs: dict[str, str]) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(dirs.items())]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


# ---------------------------------------------------------------------------------------------
# against PEFT
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,names", [("llama", list(ADAPTERS)), ("qwen3", ["all-r8", "patterns-r4"]),
                                        ("gemma2", ["qv-down-rslora-r16", "mlp-o-r16"])])
def test_greedy_tokens_equal_peft_merged_models(arch, names, tiny_model_dir, peft_adapters):
    """Every adapter and the base model in one generate call (prompts chunked over steps of 16 tokens, decode
    steps in CPU graphs): each request's greedy tokens are those of PEFT's merged model for its adapter, and so are
    their logprobs (within float32 rounding), which each adapter moves well away from the base model's. (The
    logprobs matter: the tiny Gemma 2 repeats its prompt's last token whatever the adapter.)"""
    llm = _check_against_peft(tiny_model_dir(arch), arch, peft_adapters(arch, names), device="cpu", dtype="float32")
    runner = llm.llm_engine.model_runner
    if runner.graph_runner_class is not None:   # CPU graphs here (native kernels built): the LoRA variants ran
        assert runner.lora_graphs
    llm.llm_engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU suite's engine-tests phase)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_on_cuda_against_peft(dtype, llama_dir, peft_adapters):
    """The same on a GPU, the engine as it runs there by default (torch.compile, CUDA graphs, the Triton LoRA
    kernels, async scheduling): in float32 the tokens and logprobs of PEFT's merged float32 model; in bfloat16 most
    tokens PEFT's greedy ones (bf16 rounding flips near-ties; on this CPU's bf16 path 80-100% agree) and each
    request's tokens far likelier under its own adapter than under any other or none; the decode graphs' LoRA
    variants replayed."""
    llm = _check_against_peft(llama_dir, "llama", peft_adapters("llama", list(ADAPTERS)), device="cuda", dtype=dtype)
    assert llm.llm_engine.model_runner.lora_graphs, "no decode step replayed a CUDA graph with adapters"
    llm.llm_engine.shutdown()


def _check_against_peft(model_dir: str, arch: str, adapters: dict[str, str], *, device: str, dtype: str) -> LLM:
    loras = _lora_requests(adapters)
    llm = LLM(model_dir, enable_lora=True, max_loras=len(loras), max_lora_rank=16, max_model_len=128,
              num_kv_blocks=64, max_num_batched_tokens=16, device=device, dtype=dtype)
    prompts = [random_token_ids(9, seed=1), SHARED + random_token_ids(17, seed=2)]
    order = [(p, lora) for p in prompts for lora in [None, *loras]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in order], params, lora_request=[l for _, l in order],
                           use_tqdm=False)
    logprobs = {}
    for (prompt, lora), output in zip(order, outputs):
        what = f"{arch} {device} {dtype} {'base' if lora is None else lora.lora_name}"
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        # PEFT's model on the prompt and the engine's tokens, in one forward: each token must be its argmax there
        # (then PEFT's greedy generation makes exactly these tokens) with the same logprob.
        reference = peft_merged_log_probs(model_dir, None if lora is None else lora.lora_path,
                                          prompt + tokens[:-1])[len(prompt) - 1:]
        expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        if dtype == "float32":
            assert tokens == reference.argmax(-1).tolist(), f"{what}: greedy tokens differ from PEFT's"
            got = torch.tensor([entry[t].logprob for t, entry in zip(tokens, completion.logprobs)])
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=0, msg=lambda m: f"{what}: {m}")
        else:   # bf16 weights and activations: near-ties go either way, but the tokens are this adapter's
            agree = (reference.argmax(-1) == torch.tensor(tokens)).float().mean().item()
            assert agree >= 0.7, f"{what}: only {agree:.0%} of the tokens are PEFT's greedy ones"
            for other in [None, *loras]:   # ... and far likelier under it than under any other adapter (or none)
                if other is not lora:
                    theirs = peft_merged_log_probs(model_dir, None if other is None else other.lora_path,
                                                   prompt + tokens[:-1])[len(prompt) - 1:]
                    margin = (expected.sum() - theirs.gather(1, torch.tensor(tokens)[:, None]).sum()).item()
                    assert margin > 5.0, f"{what}: the tokens are as likely without this adapter ({margin:.2f})"
        logprobs[tuple(prompt), lora] = reference
    for lora in loras:   # (at the first output position both saw the same tokens)
        moved = max((logprobs[tuple(p), lora][0] - logprobs[tuple(p), None][0]).abs().max() for p in prompts)
        assert moved > 0.5, f"{arch} {lora.lora_name}: the adapter hardly changes the model"
    return llm


# ---------------------------------------------------------------------------------------------
# the engine's own consistency: alone, mixed, evicted, preempted, async, TP, speculative
# ---------------------------------------------------------------------------------------------

def _workload(loras: list[LoRARequest]) -> list[tuple[dict, SamplingParams, LoRARequest | None]]:
    """Two prompts per adapter and two on the base model (one of each pair shares SHARED with the others), and an
    n = 2 seeded sampling request on the first adapter."""
    work = []
    for i, lora in enumerate([None, *loras]):
        work.append(({"prompt_token_ids": SHARED + random_token_ids(5 + i, seed=10 + i)}, _greedy(), lora))
        work.append(({"prompt_token_ids": random_token_ids(30 + 3 * i, seed=20 + i)}, _greedy(12 + i), lora))
    work.append(({"prompt_token_ids": random_token_ids(14, seed=40)},
                 SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True), loras[0]))
    return work


def _run(llm: LLM, work) -> list:
    return _tokens(llm.generate([p for p, _, _ in work], [s for _, s, _ in work], lora_request=[l for _, _, l in work],
                                use_tqdm=False))


@pytest.fixture(scope="module")
def llama_loras(peft_adapters) -> list[LoRARequest]:
    return _lora_requests(peft_adapters("llama", list(ADAPTERS)))


@pytest.fixture(scope="module")
def reference(llama_dir, llama_loras):
    """The reference engine (4 slots, a cache that never preempts) and each workload request's tokens run alone."""
    llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=4, max_model_len=128, num_kv_blocks=96,
              max_num_batched_tokens=32)
    work = _workload(llama_loras)
    alone = [_run(llm, [entry])[0] for entry in work]
    yield llm, work, alone
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_equals_each_request_alone(reference, llama_dir, async_scheduling):
    """The workload in one batch (four adapters, the base model, a prefix shared across adapters, n = 2) gives each
    request what it gets alone, with async scheduling off (the reference engine itself) and on."""
    llm, work, alone = reference
    if async_scheduling:
        llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=4, max_model_len=128, num_kv_blocks=96,
                  max_num_batched_tokens=32, async_scheduling=True)
    assert _run(llm, work) == alone
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    if async_scheduling:
        llm.llm_engine.shutdown()


def test_prefix_cache_is_keyed_by_adapter(reference, llama_loras):
    """A prompt cached on the base model is no hit for an adapter (its KV differs), nor one adapter's for another;
    the same adapter hits its own blocks."""
    llm, _, _ = reference
    prompt = {"prompt_token_ids": random_token_ids(50, seed=77)}
    first, second = llama_loras[:2]

    def run(lora):
        (output,) = llm.generate([prompt], _greedy(), lora_request=lora, use_tqdm=False)
        return output.num_cached_tokens, list(output.outputs[0].token_ids)

    cached_base, base_tokens = run(None)
    assert cached_base == 0
    cached_first, first_tokens = run(first)
    assert cached_first == 0 and first_tokens != base_tokens
    assert run(second)[0] == 0
    assert run(first) == (48, first_tokens)   # 3 full blocks of 16 (the last token is always computed)
    assert run(None) == (48, base_tokens)


def test_eviction_under_max_loras_and_preemption_keep_outputs_right(reference, llama_dir, monkeypatch):
    """max_loras=2 slots and 2 adapters on the host for 4 adapters in flight, a KV cache of 20 blocks for ~40:
    every step runs at most 2 adapters (some run 2), adapters give their slots up to others and leave the host
    (to be read again), requests are preempted, and every request gets what it gets alone."""
    _, work, alone = reference
    llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=2, max_model_len=128,
              num_kv_blocks=20, max_num_batched_tokens=32)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    adapters_per_step = []
    execute = executor.execute_model

    def traced(scheduler_output):
        adapters_per_step.append(len(scheduler_output.lora_requests))
        return execute(scheduler_output)

    monkeypatch.setattr(executor, "execute_model", traced)
    assert _run(llm, work) == alone
    assert max(adapters_per_step) == 2
    manager = engine.model_runner.lora
    # 4 adapters through 2 slots (two gave theirs up), read from disk again after the host cache evicted them
    assert manager.num_slot_loads >= 4 and manager.num_adapter_loads > 4
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensor parallelism needs gloo, which the engine's group "
                    "picks only where CUDA is absent (engine/distributed/parallel_state.py)")
def test_tensor_parallel_equals_one_process(reference, llama_dir):
    """TP=2 (a spawned worker, gloo): each rank keeps its shard of every adapter; the workload's tokens are
    TP=1's."""
    _, work, alone = reference
    llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=2, max_model_len=128, num_kv_blocks=96,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        assert _run(llm, work[:7]) == alone[:7]   # the base model and three adapters
    finally:
        llm.llm_engine.shutdown()


def test_speculative_decoding_drafts_from_the_base_model(reference, tiny_model_dir, llama_dir):
    """A draft model runs without adapters (its drafts are the base model's guesses); the target verifies them
    with each request's adapter, so the greedy tokens are the adapter's, not the draft's."""
    _, work, alone = reference
    greedy = [i for i, (_, params, _) in enumerate(work) if params.temperature == 0.0][::2]   # one per adapter
    llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=4, max_model_len=128, num_kv_blocks=96,
              max_num_batched_tokens=32, speculative_config={"model": llama_dir, "num_speculative_tokens": 3})
    assert _run(llm, [work[i] for i in greedy]) == [alone[i] for i in greedy]
    stats = llm.llm_engine.spec_decode_stats
    # The base model's drafts: all accepted on the base model's requests, not all on the adapters'.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.llm_engine.shutdown()


# ---------------------------------------------------------------------------------------------
# bad adapters
# ---------------------------------------------------------------------------------------------

Q = "model.layers.0.self_attn.q_proj"   # the tiny Llama: hidden 128, q 256


@pytest.mark.parametrize("tensors,config,match", [
    (lambda: lora_pair(Q, 32, 128, 256), dict(r=32), r"q_proj has rank 32, over max_lora_rank=16"),
    (lambda: lora_pair(Q, 8, 128, 256), dict(target_modules=["q_proj", "lm_head"]),
     r"target module\(s\) \['lm_head'\] are not supported"),
    (lambda: lora_pair(Q, 8, 64, 256), {}, r"q_proj maps 64 -> 256 features, but the base model's"),
])
def test_a_bad_adapter_is_a_value_error_naming_lora_request(reference, llama_loras, tensors, config, match, tmp_path):
    """LLM.generate raises ValueError naming lora_request and runs nothing (the good request beside it included),
    and the bad adapter is not kept."""
    llm, _, _ = reference
    engine = llm.llm_engine
    bad = LoRARequest("bad", 99, write_adapter(tmp_path / "bad", tensors(), **config))
    with pytest.raises(ValueError, match=rf"^lora_request: LoRA adapter 'bad' .*{match}"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, _greedy(), lora_request=[llama_loras[0], bad],
                     use_tqdm=False)
    assert not engine.has_unfinished_requests() and 99 not in engine.list_loras()


def test_a_bad_adapter_leaves_the_requests_in_flight_alone(reference, tmp_path):
    """On the engine, a request on a bad adapter, or on another adapter under an id the engine knows, is refused
    when it is added; the requests already in it finish as they would have."""
    llm, work, alone = reference
    engine = llm.llm_engine
    bad = LoRARequest("bad", 98, write_adapter(tmp_path / "bad", lora_pair(Q, 32, 128, 256), r=32))
    engine.add_request("good", work[2][0], work[2][1], lora_request=work[2][2])
    engine.step()
    with pytest.raises(ValueError, match="^lora_request: .* over max_lora_rank=16"):
        engine.add_request("bad", {"prompt_token_ids": [5, 6, 7]}, _greedy(), lora_request=bad)
    clash = LoRARequest("clash", work[2][2].lora_int_id, bad.lora_path)   # another adapter under good's id
    with pytest.raises(ValueError, match=rf"^lora_request: lora_int_id 1 already names adapter 'all-r8'"):
        engine.add_request("clash", {"prompt_token_ids": [5, 6, 7]}, _greedy(), lora_request=clash)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["good"] and _tokens([finished["good"]])[0] == alone[2]


def test_lora_request_needs_enable_lora(llama_dir, llama_loras):
    llm = LLM(llama_dir, device="cpu", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"^lora_request: this engine was started without LoRA"):
        llm.generate("Hello", _greedy(), lora_request=llama_loras[0], use_tqdm=False)
    with pytest.raises(ValueError, match=r"lora_request must be an engine.LoRARequest or None, got str"):
        llm.generate("Hello", _greedy(), lora_request="all-r8", use_tqdm=False)
    llm.llm_engine.shutdown()


def test_an_adapter_gone_before_its_step_fails_that_request_only(reference, llama_dir, peft_adapters, tmp_path):
    """One slot, one adapter on the host: request X is accepted on adapter "gone", request Y on another adapter
    evicts "gone" from the host, then its directory is deleted. X's step cannot load it: X fails (error naming
    lora_request; its blocks, computed without the adapter, kept out of the prefix cache), Y and two base-model
    requests (one with X's prompt) finish as they would alone. With async scheduling, whose next step was
    launched before X's failure was read (and fails X's rows again)."""
    _, work, alone = reference
    gone = str(tmp_path / "gone")
    shutil.copytree(peft_adapters("llama", ["all-r8"])["all-r8"], gone)
    x = LoRARequest("gone", 50, gone)
    llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=1, max_model_len=128,
              num_kv_blocks=96, async_scheduling=True)
    engine = llm.llm_engine
    prompt_a = random_token_ids(40, seed=90)
    engine.add_request("a", {"prompt_token_ids": prompt_a}, _greedy())   # base model: computes A's prompt KV
    engine.add_request("x", {"prompt_token_ids": prompt_a}, _greedy(), lora_request=x)
    engine.add_request("y", work[3][0], work[3][1], lora_request=work[3][2])   # evicts X from the host
    engine.add_request("base", work[1][0], work[1][1])
    shutil.rmtree(gone)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["x"].error.startswith("lora_request: LoRA adapter 'gone'") and "not a directory" in \
        finished["x"].error
    assert _tokens([finished["y"]])[0] == alone[3] and _tokens([finished["base"]])[0] == alone[1]
    assert finished["a"].error is None
    bm = engine.block_manager
    registered = {bm.blocks[b].token_ids for b in bm.hash_to_block_id.values()}
    # A's prompt blocks are registered once, on the base model; X's (computed without its adapter) never.
    assert sum(1 for b in bm.hash_to_block_id.values() if bm.blocks[b].token_ids == tuple(prompt_a[:16])) == 1
    assert tuple(prompt_a[:16]) in registered
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# the CUDA paths (the fake device), the scheduler, the wire
# ---------------------------------------------------------------------------------------------

def test_the_cuda_paths_with_adapters(llama_dir, llama_loras, monkeypatch):
    """On the fake CUDA device (tests/engine/fake_cuda.py): the decode graphs of the whole ladder are captured with
    and without LoRA, with no host sync; a step places two adapters in the slots and runs a mixed batch (prefill
    chunks on two adapters and on the base model) on the device, the slots and their grouping staged without a
    pageable copy; a decode batch with adapters replays the LoRA graph, one without them the plain graph."""
    import numpy as np
    import safetensors.torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from engine.step_records import CachedSequenceData, NewSequenceData, SchedulerOutput
    from engine.worker.model_runner import ModelRunner, graph_batch_sizes
    from tests.engine.fake_cuda import FakeCudaMemory, FakeGraphRunner, fake_cuda, no_host_sync
    from tests.engine.models_util import engine_config

    load_file = safetensors.torch.load_file

    def real_load_file(*args, **kwargs):   # the adapter is on disk: real CPU tensors, as for the checkpoint
        with unset_fake_temporarily():
            return load_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", real_load_file)
    FakeGraphRunner.captured_batch_sizes = []
    prompts = [random_token_ids(30, seed=60 + i) for i in range(3)]   # (fake mode's tensors hold no values)
    with fake_cuda(FakeCudaMemory()):
        config = engine_config(llama_dir, device="cuda", max_model_len=128, block_size=16, num_kv_blocks=64,
                               max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=2)
        runner = ModelRunner(config, graph_runner_class=FakeGraphRunner, compile_model=False,
                             capture_graphs_at_startup=True)
        ladder = graph_batch_sizes(8)
        assert sorted(FakeGraphRunner.captured_batch_sizes) == sorted(ladder * 2)
        assert sorted(runner.graphs) == sorted(runner.lora_graphs) == ladder
        loras = llama_loras[:2]
        new = [NewSequenceData(seq_id=i, token_ids=p, num_prompt_tokens=len(p), num_computed_tokens=0,
                               block_ids=[2 * i, 2 * i + 1], params=SamplingParams(), seed=None, stop_token_ids=[],
                               lora_request=lora) for i, (p, lora) in enumerate(zip(prompts, [*loras, None]))]
        output = runner.execute_model(SchedulerOutput(
            new_seqs=new, cached_seqs=[], num_scheduled_tokens={0: 20, 1: 16, 2: 9},
            lora_requests={lora.lora_int_id: lora for lora in loras}))
        assert output.sampled_token_ids == {} and not output.failed   # mid-prompt: nothing samples
        assert runner.lora.batch.active and runner.lora.batch.token_lora_indices.device.type == "cuda"
        assert runner.lora.slots.keys() == [1, 2]
        with no_host_sync():   # the adapters in their slots already: the next chunk's step waits for nothing
            runner.execute_model(SchedulerOutput(
                new_seqs=[], cached_seqs=[CachedSequenceData(i, [], 2, [], n) for i, n in ((0, 20), (1, 16))],
                num_scheduled_tokens={0: 8, 1: 8}, lora_requests={lora.lora_int_id: lora for lora in loras}))
        replays = []
        for kind, graphs in (("lora", runner.lora_graphs), ("plain", runner.graphs)):
            graphs[4].replay = lambda kind=kind, graph=graphs[4]: replays.append(kind) or graph.output
        for lora_slots in (np.array([0, -1, 1], dtype=np.int32), None, np.array([-1, -1, -1], dtype=np.int32)):
            input_ids, positions, meta = runner.build_inputs(np.array([5, 6, 7]), np.array([3, 4, 5]),
                                                             np.ones(3, dtype=np.int64),
                                                             np.arange(3, dtype=np.int32)[:, None])
            runner.run_decode_graph(input_ids, positions, meta, lora_slots)   # 3 rows: the graph of 4
        assert replays == ["lora", "plain", "plain"]


# ---------------------------------------------------------------------------------------------
# the scheduler, the wire
# ---------------------------------------------------------------------------------------------

def test_scheduler_admits_within_max_loras_and_skipped_requests_keep_their_place():
    """max_loras=2: a waiting request on a third adapter is skipped (it keeps the head of the queue) while those
    behind it on a running adapter or the base model are admitted; it runs once an adapter's requests finish."""
    scheduler = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=256, max_loras=2)
    a, b, c = (LoRARequest(name, i + 1, f"/{name}") for i, name in enumerate("abc"))
    seqs = {}
    for name, lora in [("a1", a), ("b1", b), ("c1", c), ("base", None), ("a2", a)]:
        seqs[name] = Sequence(name, None, random_token_ids(8, seed=len(seqs)), SamplingParams(max_tokens=4),
                              arrival_time=0.0, lora_request=lora)
        scheduler.add(seqs[name])
    step = scheduler.schedule()
    assert [s.request_id for s, _ in step.scheduled] == ["a1", "b1", "base", "a2"]
    assert list(scheduler.waiting) == [seqs["c1"]]
    assert step.output.lora_requests == {1: a, 2: b}
    assert [new.lora_request for new in step.output.new_seqs] == [a, b, None, a]
    for seq in scheduler.update_from_output(step):   # each prompt computed: its first token
        seq.append_token(7)
    scheduler.finish(seqs["b1"])
    step = scheduler.schedule()
    assert [s.request_id for s, _ in step.scheduled] == ["a1", "base", "a2", "c1"] and not scheduler.waiting
    assert set(step.output.lora_requests) == {1, 3}


def test_lora_request_crosses_the_core_socket():
    """EngineCoreRequest.to_wire -> msgpack -> from_wire keeps the adapter (serve's path to the core process)."""
    msgpack = pytest.importorskip("msgpack", reason="serve's wire format (pip install msgpack, the serve extra)")
    lora = LoRARequest("sql", 7, "/adapters/sql", base_model_name="tiny")
    request = EngineCoreRequest("r", None, [1, 2, 3], SamplingParams(max_tokens=3), 0.0, lora_request=lora)
    data = msgpack.unpackb(msgpack.packb(request.to_wire(), use_bin_type=True), raw=False)
    back = EngineCoreRequest.from_wire(data)
    assert back.lora_request == lora and (back.lora_request.lora_int_id, back.lora_request.lora_path,
                                          back.lora_request.base_model_name) == (7, "/adapters/sql", "tiny")
    plain = EngineCoreRequest("r", None, [1], SamplingParams(), 0.0)
    assert EngineCoreRequest.from_wire(msgpack.unpackb(msgpack.packb(plain.to_wire()), raw=False)).lora_request is None
