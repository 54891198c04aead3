"""ModelRunner + models against transformers on the same weights (float32, CPU).

A batch is scheduled the way the core side does it: prefills cut into chunks, decodes of one token,
both mixed in one batch, blocks scattered over a NaN-poisoned KV cache. The logits the runner
returns for each entry's last new token must match transformers' at that position.
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedkernels as pk
from engine.layers.attention import Attention
from engine.worker.model_runner import ModelRunner
from tests.engine.models_util import ScheduledSeq as Seq, engine_config, hf_log_softmax, load_hf_model, random_token_ids

LOGPROB_ATOL = 1e-4
BLOCK_SIZE = 16



def make_runner(model_dir: str, *, num_kv_blocks: int = 64, max_model_len: int | None = 256,
                **kwargs) -> ModelRunner:
    config = engine_config(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len,
                           block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks, max_num_seqs=8,
                           max_num_batched_tokens=512, enforce_eager=True)
    runner = ModelRunner(config, **kwargs)
    runner.kv_cache.fill_(float("nan"))  # any read of a slot not written in this test shows
    return runner


def scatter_blocks(seqs: list[Seq], num_kv_blocks: int, seed: int) -> None:
    """Give each sequence enough blocks for all its tokens, drawn at random from the pool."""
    free = torch.randperm(num_kv_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    for seq in seqs:
        needed = math.ceil(len(seq.token_ids) / BLOCK_SIZE)
        seq.block_table, free = free[:needed], free[needed:]


def run_schedule(runner: ModelRunner, seqs: list[Seq], steps: list[list[tuple[int, int]]]) -> list[tuple[int, int, torch.Tensor]]:
    """Run each step (list of (seq index, num_new_tokens)); return (seq index, position, log-softmax)
    for every entry, advancing num_computed_tokens as the core side would."""
    results = []
    for step in steps:
        scheduled = [(seqs[i], n) for i, n in step]
        before = [seq.num_computed_tokens for seq, _ in scheduled]
        logits = runner.compute_logits_for(scheduled)
        assert logits.dtype == torch.float32 and logits.shape == (len(step), runner.config.vocab_size)
        assert [seq.num_computed_tokens for seq, _ in scheduled] == before, "runner must not advance sequences"
        for row, (index, n) in enumerate(step):
            seqs[index].num_computed_tokens += n
            position = seqs[index].num_computed_tokens - 1
            results.append((index, position, torch.log_softmax(logits[row], dim=-1)))
    return results


def assert_matches_hf(model_dir: str, seqs: list[Seq], results, atol: float = LOGPROB_ATOL) -> None:
    hf = load_hf_model(model_dir)
    references = [hf_log_softmax(hf, seq.token_ids) for seq in seqs]
    for index, position, logprobs in results:
        assert torch.isfinite(logprobs).all(), f"seq {index} position {position}: non-finite logits"
        torch.testing.assert_close(logprobs, references[index][position], atol=atol, rtol=0,
                                   msg=lambda m: f"seq {index} position {position}: {m}")


# Three sequences: A prefills in chunks (one of 5 tokens, so chunks cross block boundaries unevenly)
# then decodes; B starts later and prefills in one go while A decodes; C is short and decodes
# alongside. Steps 4-5 are pure-decode batches, the others mixed.
MIXED_SCHEDULE = [
    [(0, 5)],
    [(0, 20), (1, 30)],
    [(0, 13), (1, 1), (2, 9)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 18), (2, 1)],
    [(0, 1), (2, 1)],
]


def mixed_sequences(vocab_size: int, seed: int) -> list[Seq]:
    lengths = [0, 0, 0]
    for step in MIXED_SCHEDULE:
        for i, n in step:
            lengths[i] += n
    return [Seq(random_token_ids(length, vocab_size=vocab_size, seed=seed + i)) for i, length in enumerate(lengths)]


def test_runner_matches_transformers(tiny_model_dir, tiny_arch):
    model_dir = tiny_model_dir(tiny_arch)
    runner = make_runner(model_dir)
    seqs = mixed_sequences(runner.config.vocab_size, seed=10)
    scatter_blocks(seqs, runner.num_kv_blocks, seed=1)
    results = run_schedule(runner, seqs, MIXED_SCHEDULE)
    assert_matches_hf(model_dir, seqs, results)


def test_decode_kernel_path_matches_transformers(tiny_model_dir):
    """Pure-decode batches through paged_decode_attention (the CUDA choice), forced on CPU;
    Mistral so that the sliding window (12) is passed to the decode op as well."""
    model_dir = tiny_model_dir("mistral")
    runner = make_runner(model_dir)
    for layer in runner.model.modules():
        if isinstance(layer, Attention):
            layer.use_decode_kernel = True
    seqs = mixed_sequences(runner.config.vocab_size, seed=20)
    scatter_blocks(seqs, runner.num_kv_blocks, seed=2)
    results = run_schedule(runner, seqs, MIXED_SCHEDULE)
    assert_matches_hf(model_dir, seqs, results)


def test_prefix_shared_blocks_and_copy_blocks(tiny_model_dir):
    """Two sequences sharing their first full block (a prefix-cache hit: the second starts with
    num_computed_tokens = 16 on the first one's block), and copy_blocks moving a block's K/V."""
    model_dir = tiny_model_dir("qwen3")
    runner = make_runner(model_dir)
    prefix = random_token_ids(BLOCK_SIZE, seed=30)
    a = Seq(prefix + random_token_ids(10, seed=31), block_table=[3, 7])
    b = Seq(prefix + random_token_ids(7, seed=32), num_computed_tokens=BLOCK_SIZE, block_table=[3, 11])
    results = run_schedule(runner, [a, b], [[(0, 26)], [(1, 7)]])
    assert_matches_hf(model_dir, [a, b], results)

    # copy-on-write: block 7 -> 20 in every layer; the copy must serve a sequence like the original.
    runner.copy_blocks([(7, 20)])
    torch.testing.assert_close(runner.kv_cache[:, :, 20], runner.kv_cache[:, :, 7], equal_nan=True)
    c = Seq(a.token_ids + random_token_ids(1, seed=33), num_computed_tokens=26, block_table=[3, 20])
    results = run_schedule(runner, [c], [[(0, 1)]])
    assert_matches_hf(model_dir, [c], results)
    runner.copy_blocks([])  # no-op


def test_smollm2_matches_transformers(smollm2_dir):
    runner = make_runner(smollm2_dir, num_kv_blocks=16)
    seqs = [Seq(random_token_ids(45, vocab_size=runner.config.vocab_size, seed=40)),
            Seq(random_token_ids(21, vocab_size=runner.config.vocab_size, seed=41))]
    scatter_blocks(seqs, runner.num_kv_blocks, seed=3)
    steps = [[(0, 17)], [(0, 25), (1, 19)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1)]]
    results = run_schedule(runner, seqs, steps)
    assert_matches_hf(smollm2_dir, seqs, results)


def test_triton_kernels_in_interpreter_match_torch_path(tiny_model_dir):
    """The same mixed batch with every pagedkernels op on its Triton kernel (interpreted on CPU)."""
    model_dir = tiny_model_dir("llama")
    logprobs = {}
    for backend in ("torch", "triton"):
        runner = make_runner(model_dir)
        for layer in runner.model.modules():
            if isinstance(layer, Attention):
                layer.use_decode_kernel = True
        seqs = [Seq(random_token_ids(20, seed=50)), Seq(random_token_ids(9, seed=51))]
        scatter_blocks(seqs, runner.num_kv_blocks, seed=4)
        with pk.use_backend(backend):
            logprobs[backend] = run_schedule(runner, seqs, [[(0, 19), (1, 8)], [(0, 1), (1, 1)]])
    for (_, _, torch_lp), (_, _, triton_lp) in zip(logprobs["torch"], logprobs["triton"]):
        torch.testing.assert_close(triton_lp, torch_lp, atol=LOGPROB_ATOL, rtol=0)


def test_execute_model_empty_batch_and_bad_entries(tiny_model_dir):
    runner = make_runner(tiny_model_dir("llama"))
    assert runner.compute_logits_for([]).shape == (0, runner.config.vocab_size)
    seq = Seq(random_token_ids(20, seed=60), block_table=[0])
    with pytest.raises(ValueError, match="1 blocks of 16"):  # 20 tokens need 2 blocks
        runner.compute_logits_for([(seq, 20)])
    seq.block_table = [0, 1]
    with pytest.raises(ValueError, match="tokens"):  # past the sequence's end
        runner.compute_logits_for([(seq, 21)])
    with pytest.raises(ValueError, match="tokens"):
        runner.compute_logits_for([(seq, 0)])


def test_num_kv_blocks_from_memory_is_bounded(tiny_model_dir):
    """Without num_kv_blocks, the CPU cache takes a share of free RAM but never more blocks than
    max_num_seqs sequences of max_model_len tokens can use (here 8 * ceil(100 / 16) = 56)."""
    runner = make_runner(tiny_model_dir("llama"), num_kv_blocks=None, max_model_len=100)
    assert runner.num_kv_blocks == 8 * math.ceil(100 / BLOCK_SIZE)
    config = runner.config
    assert runner.kv_cache.shape == (2, config.num_hidden_layers, runner.num_kv_blocks, BLOCK_SIZE,
                                     config.num_key_value_heads, config.head_dim)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        make_runner(tiny_model_dir("llama"), num_kv_blocks=0)
