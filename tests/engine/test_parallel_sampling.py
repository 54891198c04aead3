"""SamplingParams(n > 1): one prefill, then n sequences that share the prompt's blocks (block accounting shows
it), copy a shared partly filled block exactly when they first write into it, draw from their own seed streams
(reproducible, different from each other) and compute the same logprobs as transformers on their own tokens."""
import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from tests.engine.models_util import hf_log_softmax, load_hf_model, make_engine, random_token_ids

PROMPT_37 = random_token_ids(37, seed=21)   # 2 full blocks of 16 and 5 tokens in a shared, partly filled third
PROMPT_32 = random_token_ids(32, seed=22)   # exactly 2 full blocks: the first write goes to a fresh block


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256, num_kv_blocks=64)


def engine_for(model_dir, **kwargs) -> LLMEngine:
    return make_engine(model_dir, max_model_len=256, **{"num_kv_blocks": 64, **kwargs})


def used_blocks(engine: LLMEngine) -> int:
    return engine.block_manager.num_blocks - engine.block_manager.num_free_blocks


def test_forked_sequences_share_prompt_blocks_and_copy_on_first_write(llama_dir):
    engine = engine_for(llama_dir, enable_prefix_caching=False)
    bm = engine.block_manager
    engine.add_request("r", {"prompt_token_ids": PROMPT_37}, SamplingParams(n=4, seed=0, max_tokens=30))
    engine.step()   # the whole prompt, then the fork
    seqs = engine.requests["r"].seqs
    assert len(seqs) == 4 and [s.index for s in seqs] == [0, 1, 2, 3]
    assert all(s.block_table == seqs[0].block_table for s in seqs) and len(seqs[0].block_table) == 3
    assert [bm.blocks[b].ref_count for b in seqs[0].block_table] == [4, 4, 4]
    assert used_blocks(engine) == 3 and bm.num_copies == 0   # prompt blocks counted once, nothing copied yet

    engine.step()   # each writes its first token at position 37, into the shared third block
    # Three sequences copy it; the last writer finds itself its only holder and writes in place.
    assert bm.num_copies == 3 and used_blocks(engine) == 3 + 3
    assert [bm.blocks[b].ref_count for b in seqs[0].block_table[:2]] == [4, 4]
    assert len({s.block_table[2] for s in seqs}) == 4
    for _ in range(15):   # fills block 3 (positions 38..47) and opens block 4: no further copies
        engine.step()
    assert bm.num_copies == 3 and used_blocks(engine) == 2 + 4 * 2
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_block_aligned_prompt_needs_no_copy(llama_dir):
    engine = engine_for(llama_dir)
    engine.add_request("r", {"prompt_token_ids": PROMPT_32}, SamplingParams(n=3, seed=1, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_copies == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_n_is_reproducible_and_each_stream_differs(llm):
    params = SamplingParams(n=4, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": PROMPT_37}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": PROMPT_37}, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in tokens}) == 4 and all(len(t) == 12 for t in tokens)
    # Sequence 0 draws from the seed itself: it equals the n=1 request with that seed.
    single = llm.generate({"prompt_token_ids": PROMPT_37}, SamplingParams(seed=7, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert single.outputs[0].token_ids == tokens[0]
    # A different seed gives different streams.
    other = llm.generate({"prompt_token_ids": PROMPT_37}, SamplingParams(n=4, seed=8, max_tokens=12,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in other.outputs] != tokens


def test_greedy_n_gives_n_copies_of_the_greedy_output(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    single = llm.generate({"prompt_token_ids": PROMPT_37}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate({"prompt_token_ids": PROMPT_37}, SamplingParams(n=3, temperature=0.0, max_tokens=10,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3


def test_every_forked_sequence_attends_to_its_own_kv(llm, llama_dir):
    """Logprobs of each sampled token equal transformers' on that sequence's own tokens: a missed or misplaced
    copy would let one sequence read another's KV."""
    params = SamplingParams(n=4, seed=3, max_tokens=20, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": PROMPT_37}, params, use_tqdm=False)[0]
    hf = load_hf_model(llama_dir)
    for completion in out.outputs:
        tokens = PROMPT_37 + completion.token_ids
        ref = hf_log_softmax(hf, tokens)[len(PROMPT_37) - 1:-1]
        ref = ref.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)


def test_mixed_batch_with_stop_tokens_finishes_sequences_independently(llm):
    """Sequences of one request finish at different steps (stop token); the request finishes with the last one."""
    params = SamplingParams(n=6, seed=5, max_tokens=24, stop_token_ids=list(range(3, 60)))
    outs = llm.generate([{"prompt_token_ids": PROMPT_37}, {"prompt_token_ids": PROMPT_32}], params, use_tqdm=False)
    for out in outs:
        assert out.finished and len(out.outputs) == 6
        lengths = {len(c.token_ids) for c in out.outputs}
        assert len(lengths) > 1   # they did stop at different times
        for c in out.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] in range(3, 60) else "length")
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_n_above_max_num_seqs_is_rejected(llama_dir):
    engine = engine_for(llama_dir, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("r", {"prompt_token_ids": PROMPT_32}, SamplingParams(n=3))
    assert not engine.requests


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_n_request_holds_its_rows_from_admission(llama_dir, async_scheduling):
    """An n > 1 request forks only when its prompt completes, but takes its n rows when it is admitted: a request
    behind it waits for a row. (With max_num_seqs=2, an n=2 request and a one-sequence request were admitted in one
    step as two sequences; the fork made three in the next step, and that step failed both requests.)"""
    llm = LLM(llama_dir, max_model_len=256, num_kv_blocks=64, max_num_seqs=2, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": random_token_ids(50, seed=1)}, {"prompt_token_ids": random_token_ids(3, seed=2)}]
    params = [SamplingParams(n=2, seed=1, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    try:
        together = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([prompt], [p], use_tqdm=False)[0] for prompt, p in zip(prompts, params)]
    finally:
        llm.llm_engine.shutdown()
    assert [[c.finish_reason for c in o.outputs] for o in together] == [["length", "length"], ["length"]]
    assert [[c.token_ids for c in o.outputs] for o in together] == [[c.token_ids for c in o.outputs] for o in alone]
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
