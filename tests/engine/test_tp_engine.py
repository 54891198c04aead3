"""The engine with tensor_parallel_size=2 (rank 0 here, one spawned worker, gloo on CPU) against the same engine
in one process: greedy tokens equal token for token with chunked prefill, prefix-cache hits, n > 1 and both
preemption modes, on every architecture; abort frees every block; a dead worker stops the engine with a clear
error."""
import os
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.executor import MultiprocExecutor, WorkerDiedError
from tests.engine.models_util import random_token_ids

SHARED_PREFIX = random_token_ids(40, seed=11)


def _requests():
    prompts = [{"prompt_token_ids": SHARED_PREFIX + random_token_ids(n, seed=20 + i)} for i, n in enumerate((7, 30, 3))]
    prompts.append({"prompt_token_ids": random_token_ids(60, seed=5)})
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)]
    return prompts, params


def _generate(model_dir: str, tensor_parallel_size: int, **kwargs):
    kwargs = {"max_model_len": 256, **kwargs}
    llm = LLM(model_dir, max_num_batched_tokens=32, tensor_parallel_size=tensor_parallel_size, **kwargs)
    try:
        prompts, params = _requests()
        first = llm.generate(prompts[:1], params[:1], use_tqdm=False)   # cached: the others hit its prefix blocks
        outputs = first + llm.generate(prompts[1:], params[1:], use_tqdm=False)
        engine = llm.llm_engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [[c.token_ids for c in o.outputs] for o in outputs], engine.scheduler.num_preemptions, \
            engine.get_metrics().prefix_cache_hit_rate
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch, kwargs", [
    ("llama", dict(num_kv_blocks=64)),
    ("mistral", dict(num_kv_blocks=64)),
    ("qwen2", dict(num_kv_blocks=64)),
    ("qwen3", dict(num_kv_blocks=64)),
    ("phi3", dict(num_kv_blocks=64)),
    ("opt", dict(num_kv_blocks=12, max_model_len=192, preemption_mode="recompute")),
    ("gemma2", dict(num_kv_blocks=12, max_model_len=192, preemption_mode="swap", swap_space=0.01)),
])
def test_tp2_equals_tp1(tiny_model_dir, arch, kwargs):
    model_dir = tiny_model_dir(arch)
    expected, preemptions_1, hit_rate_1 = _generate(model_dir, 1, **kwargs)
    actual, preemptions_2, hit_rate_2 = _generate(model_dir, 2, **kwargs)
    assert actual == expected
    assert hit_rate_2 == hit_rate_1 > 0
    assert preemptions_2 == preemptions_1
    if kwargs["num_kv_blocks"] == 12:
        assert preemptions_2 > 0, "the small cache should have forced preemption"


def test_abort_frees_every_block_and_dead_worker_stops_the_engine(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=32, tensor_parallel_size=2)
    engine = llm.llm_engine
    try:
        assert isinstance(engine.executor, MultiprocExecutor)
        engine.add_request("a", {"prompt_token_ids": random_token_ids(50, seed=1)},
                           SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.add_request("b", {"prompt_token_ids": random_token_ids(20, seed=2)},
                           SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
        engine.abort_request("a")
        engine.abort_request("b")
        # The driver's block manager is the only bookkeeping: the ranks hold KV in the blocks it hands out.
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.executor.num_broadcasts > 0

        worker = engine.executor.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        engine.add_request("c", {"prompt_token_ids": random_token_ids(10, seed=3)}, SamplingParams(max_tokens=4))
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="engine-tp-worker-1 died"):
            engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerDiedError):
            engine.step()
    finally:
        engine.shutdown()


def test_smollm2_tp3_equals_tp1(smollm2_dir):
    """SmolLM2-135M has 9 query heads and 3 KV heads: 3 ranks (one KV head each) is its smallest split."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn"]
    params = SamplingParams(temperature=0, max_tokens=16)
    results = []
    for tensor_parallel_size in (3, 1):
        llm = LLM(smollm2_dir, max_model_len=512, tensor_parallel_size=tensor_parallel_size)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1]
