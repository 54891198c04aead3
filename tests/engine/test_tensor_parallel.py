"""Tensor-parallel model forward on 2 gloo ranks (CPU): sharded q/k/v (KV heads split, or replicated when
fewer than ranks), gate/up and fc1 column-parallel, o/down/fc2 row-parallel with one all-reduce each,
vocab-parallel embedding and LM head (logits gathered on rank 0). Rank 0's logits over a mixed chunked-prefill
/ decode schedule on a NaN-poisoned paged cache equal the single-process runner's, for every architecture
whose heads divide by 2."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from engine import distributed as engine_dist
from engine.distributed.parallel_state import free_port
# The same tolerance as the runner against transformers: the row-parallel sums add in another order.
from tests.engine.test_model_runner import (LOGPROB_ATOL, MIXED_SCHEDULE, make_runner, mixed_sequences,
                                           scatter_blocks)

# (arch, what its sharding exercises)
TP_ARCHITECTURES = ["llama", "qwen3", "phi3", "opt", "gemma2"]


def _run_schedule(model_dir: str, num_kv_blocks: int = 64) -> list[torch.Tensor | None]:
    runner = make_runner(model_dir, num_kv_blocks=num_kv_blocks)
    seqs = mixed_sequences(runner.config.vocab_size, seed=3)
    scatter_blocks(seqs, num_kv_blocks, seed=4)
    outputs = []
    for step in MIXED_SCHEDULE:
        scheduled = [(seqs[i], n) for i, n in step]
        logits = runner.compute_logits_for(scheduled)
        outputs.append(None if logits is None else torch.log_softmax(logits, dim=-1))
        for seq, n in scheduled:
            seq.num_computed_tokens += n
    return outputs, runner


def _worker(rank: int, world_size: int, init_method: str, model_dirs: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    engine_dist.init_distributed_environment(world_size, rank, init_method=init_method, backend="gloo")
    try:
        for arch, model_dir in model_dirs:
            outputs, runner = _run_schedule(model_dir)
            assert runner.kv_cache.shape[-2] == max(runner.config.num_key_value_heads // world_size, 1)
            if rank == 0:
                torch.save(outputs, os.path.join(out_dir, f"{arch}.pt"))
            else:
                assert all(out is None for out in outputs)
    finally:
        engine_dist.destroy_distributed_environment()


def test_tp2_logits_equal_tp1(tiny_model_dir, tmp_path):
    model_dirs = [(arch, tiny_model_dir(arch)) for arch in TP_ARCHITECTURES]
    mp.spawn(_worker, args=(2, f"tcp://127.0.0.1:{free_port()}", model_dirs, str(tmp_path)), nprocs=2, join=True)
    for arch, model_dir in model_dirs:
        reference, _ = _run_schedule(model_dir)
        sharded = torch.load(tmp_path / f"{arch}.pt")
        for step, (expected, actual) in enumerate(zip(reference, sharded)):
            assert torch.isfinite(actual).all(), f"{arch} step {step}: non-finite logprobs"
            torch.testing.assert_close(actual, expected, atol=LOGPROB_ATOL, rtol=0, msg=lambda m: f"{arch} step {step}: {m}")


def test_heads_that_do_not_divide_are_rejected(monkeypatch):
    from engine.layers import linear

    monkeypatch.setattr(linear, "get_tp_world_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tp_rank", lambda: 0)
    with pytest.raises(ValueError, match="num_heads=9 is not divisible by tensor_parallel_size=2"):
        linear.QKVLinear(64, 16, 9, 3)
    with pytest.raises(ValueError, match="output_size=7 is not divisible"):
        linear.Linear(8, 7, parallel="column")
    qkv = linear.QKVLinear(64, 16, 4, 1)   # one KV head for two ranks: replicated
    assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1) and qkv.weight.shape == ((2 + 2 * 1) * 16, 64)
