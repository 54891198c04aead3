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
    """(The architectures' own parametrization; test_tp2_with_async_scheduling_equals_tp1 adds the async steps.)"""
    model_dir = tiny_model_dir(arch)
    expected, preemptions_1, hit_rate_1 = _generate(model_dir, 1, **kwargs)
    actual, preemptions_2, hit_rate_2 = _generate(model_dir, 2, **kwargs)
    assert actual == expected
    assert hit_rate_2 == hit_rate_1 > 0
    assert preemptions_2 == preemptions_1
    if kwargs["num_kv_blocks"] == 12:
        assert preemptions_2 > 0, "the small cache should have forced preemption"


def test_tp2_with_async_scheduling_equals_tp1(tiny_model_dir):
    """Async scheduling under tensor parallelism: rank 0 samples and the worker feeds the ids in flight to its
    forward from a device-side broadcast (the core has not got them yet): tokens equal one process without it,
    preemption and prefix hits included."""
    model_dir = tiny_model_dir("qwen3")
    kwargs = dict(num_kv_blocks=12, max_model_len=192, preemption_mode="recompute")
    expected, preemptions_1, hit_rate_1 = _generate(model_dir, 1, **kwargs)
    actual, preemptions_2, hit_rate_2 = _generate(model_dir, 2, async_scheduling=True, **kwargs)
    assert actual == expected
    assert hit_rate_2 > 0 and preemptions_2 > 0


def test_tp2_prompt_logprobs_equal_tp1(tiny_model_dir):
    """Prompt logprobs take the logits of every prompt position through the vocab-parallel gather, beside the
    sampling rows' gather: every rank must make the two in the same order. (The worker gathered the sampling rows
    first and rank 0 the prompt rows: gloo aborted the process on the size mismatch.) A prompt in chunks, one
    request without prompt logprobs beside it; values equal one process to rounding."""
    prompts = [{"prompt_token_ids": random_token_ids(53, seed=1)}, {"prompt_token_ids": random_token_ids(8, seed=2)},
               {"prompt_token_ids": random_token_ids(20, seed=3)}]
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=4)]
    results = []
    for tensor_parallel_size in (1, 2):
        llm = LLM(tiny_model_dir("llama"), max_model_len=160, max_num_batched_tokens=32,
                  tensor_parallel_size=tensor_parallel_size)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.llm_engine.shutdown()
    expected, actual = results
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in expected]
    for e, a in zip(expected, actual):
        assert (e.prompt_logprobs is None) == (a.prompt_logprobs is None)
        for pe, pa in zip(e.prompt_logprobs or (), a.prompt_logprobs or ()):
            assert (pe is None) == (pa is None)
            if pe is not None:
                assert set(pe) == set(pa) and all(abs(pe[t].logprob - pa[t].logprob) < 1e-4 for t in pe)
    assert len(actual[0].prompt_logprobs) == 53 and actual[2].prompt_logprobs is None


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
        llm = LLM(smollm2_dir, dtype="float32", max_model_len=512, tensor_parallel_size=tensor_parallel_size)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1]


_TORCHRUN_SCRIPT = '''
import json, sys
from engine import LLM, SamplingParams
from tests.engine.test_tp_engine import _requests

model_dir, out_path, marker = sys.argv[1:4]
llm = LLM(model_dir, max_num_batched_tokens=32, tensor_parallel_size=2, num_kv_blocks=64, max_model_len=256)
# Only rank 0 gets here: on rank 1, LLM(...) served as the worker and ended the process.
prompts, params = _requests()
outputs = llm.generate(prompts, params, use_tqdm=False)
with open(marker, "a") as f:
    f.write("continued\\n")
with open(out_path, "w") as f:
    json.dump([[list(c.token_ids) for c in o.outputs] for o in outputs], f)
'''


def test_torchrun_launch_equals_tp1(tiny_model_dir, tmp_path):
    """Launched by torchrun (env:// rendezvous, nothing spawned): every rank runs the same script, rank 1's
    LLM(...) serves as its worker and exits 0 when rank 0 is done, and the outputs equal TP=1's."""
    import json
    import subprocess
    import sys

    from engine.distributed.parallel_state import free_port

    model_dir = tiny_model_dir("llama")
    script, out_path, marker = tmp_path / "generate.py", tmp_path / "out.json", tmp_path / "continued"
    script.write_text(_TORCHRUN_SCRIPT)
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(script), model_dir, str(out_path), str(marker)],
                          cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker.read_text() == "continued\n", "exactly one rank (0) goes on past LLM(...)"
    llm = LLM(model_dir, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=256)
    prompts, params = _requests()
    expected = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert json.loads(out_path.read_text()) == expected


def test_launcher_world_must_match_tensor_parallel_size(monkeypatch):
    from engine.executor.executor import launched_rank

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4.*tensor_parallel_size=2"):
        launched_rank(2)
    assert launched_rank(4) == 0
    monkeypatch.delenv("RANK")
    assert launched_rank(2) is None


def _process_state():
    """What an engine may change in its process: the engine's group, the default group, worker processes, threads."""
    import multiprocessing

    import torch

    from engine.distributed import is_distributed_initialized
    return (is_distributed_initialized(), torch.distributed.is_initialized(), multiprocessing.active_children(),
            torch.get_num_threads())


_NO_GUARD_SCRIPT = '''
from engine import LLM
LLM({model_dir!r}, tensor_parallel_size=2, num_kv_blocks=32, max_model_len=128)
'''


def test_worker_dying_on_start_fails_the_engine_within_seconds(tiny_model_dir, tmp_path):
    """A script without the __main__ guard: the spawned worker dies importing it; rank 0 must not wait out the
    rendezvous (600 s) but fail at once, saying why."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(_NO_GUARD_SCRIPT.format(model_dir=tiny_model_dir("llama")))
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "WorkerDiedError" in proc.stderr and '__name__ == "__main__"' in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_refused_engine_leaves_the_process_as_it_found_it(tiny_model_dir):
    """OPT's 2 heads do not split over 3 ranks: refused before any worker starts; a refusal after the workers
    started (max_model_len past the cache) leaves nothing either; the next engine (TP=1 or TP=2) works."""
    before = _process_state()
    with pytest.raises(ValueError, match="num_heads=2 is not divisible by tensor_parallel_size=3"):
        LLM(tiny_model_dir("opt"), tensor_parallel_size=3, num_kv_blocks=32, max_model_len=128)
    assert _process_state() == before
    with pytest.raises(ValueError, match="max_model_len=256 does not fit in the KV cache"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=2, num_kv_blocks=4, max_model_len=256)
    assert _process_state() == before
    llm = LLM(tiny_model_dir("opt"), num_kv_blocks=32, max_model_len=128)
    out = llm.generate({"prompt_token_ids": random_token_ids(8, seed=1)},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_dropped_engine_releases_its_group(tiny_model_dir):
    """A TP engine dropped without shutdown() (del) releases its workers and group: a second TP engine in the
    same process generates what the first did. While one holds the group, another engine is refused clearly."""
    import gc

    model_dir = tiny_model_dir("llama")
    before = _process_state()
    prompt = {"prompt_token_ids": random_token_ids(12, seed=4)}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = LLM(model_dir, tensor_parallel_size=2, num_kv_blocks=32, max_model_len=128)
    expected = first.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(expected) == 6
    with pytest.raises(ValueError, match="another engine in this process holds a tensor-parallel group"):
        LLM(model_dir, num_kv_blocks=32, max_model_len=128)
    worker = first.llm_engine.executor.workers[0]
    del first
    gc.collect()
    assert not worker.is_alive() and _process_state() == before
    second = LLM(model_dir, tensor_parallel_size=2, num_kv_blocks=32, max_model_len=128)
    try:
        assert second.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    finally:
        second.llm_engine.shutdown()
    assert _process_state() == before
