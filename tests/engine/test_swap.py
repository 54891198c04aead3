"""Preemption by swapping: under a KV cache far too small for the batch, greedy and seeded outputs (n = 1 and
n > 1) are identical with preemption_mode "recompute" and "swap" and to an unconstrained run; swapping really
happens (counted), falls back to recompute when the swap space is full, and leaves no block behind."""
import pytest

from engine import LLM, SamplingParams
from tests.engine.models_util import make_engine, random_token_ids

PROMPTS = [{"prompt_token_ids": random_token_ids(length, seed=30 + i)} for i, length in enumerate([20, 45, 33, 60, 17, 50])]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True),
    SamplingParams(seed=1, max_tokens=48, ignore_eos=True),
    SamplingParams(n=2, seed=2, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
    SamplingParams(n=3, temperature=0.8, top_k=50, seed=3, max_tokens=28, ignore_eos=True),
    SamplingParams(seed=4, max_tokens=56, ignore_eos=True),
]
SMALL_CACHE = 12   # blocks of 16 slots; the batch at full length needs ~45


def block_bytes(llm: LLM) -> int:
    kv_cache = llm.llm_engine.model_runner.kv_cache
    return kv_cache[:, :, 0].numel() * kv_cache.element_size()


def run(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_swap_blocks == bm.num_swap_blocks and not any(bm.swap_ref_counts)
    return [[c.token_ids for c in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return run(LLM(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=128))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_identical_under_many_preemptions(tiny_model_dir, reference, mode):
    llm = LLM(tiny_model_dir("llama"), max_model_len=SMALL_CACHE * 16, num_kv_blocks=SMALL_CACHE, max_num_batched_tokens=64,
              preemption_mode=mode, swap_space=1 / 64)
    assert run(llm) == reference
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions >= 6, scheduler.num_preemptions
    if mode == "swap":
        assert scheduler.num_swap_preemptions == scheduler.num_preemptions   # 16 MiB holds everything
    else:
        assert scheduler.num_swap_preemptions == 0 and llm.llm_engine.block_manager.num_swap_blocks == 0


def test_full_swap_space_falls_back_to_recompute(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir("llama"), max_model_len=SMALL_CACHE * 16, num_kv_blocks=SMALL_CACHE, max_num_batched_tokens=64,
              preemption_mode="swap", swap_space=0)
    llm = LLM(tiny_model_dir("llama"), max_model_len=SMALL_CACHE * 16, num_kv_blocks=SMALL_CACHE, max_num_batched_tokens=64,
              preemption_mode="swap", swap_space=5 * block_bytes(llm) / (1 << 30))   # room for 5 blocks
    assert llm.llm_engine.block_manager.num_swap_blocks == 5
    assert run(llm) == reference
    scheduler = llm.llm_engine.scheduler
    assert 0 < scheduler.num_swap_preemptions < scheduler.num_preemptions


def test_swapped_request_keeps_its_tokens_and_n_group_swaps_whole(tiny_model_dir):
    from engine import LLMEngine
    from engine.core.sequence import SequenceStatus

    engine = make_engine(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=18,
                       preemption_mode="swap", swap_space=1 / 64)
    engine.add_request("a", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(n=3, seed=0, max_tokens=40, ignore_eos=True))
    seen_swapped = False
    while engine.has_unfinished_requests() and not seen_swapped:
        engine.step()
        if engine.scheduler.swapped:
            group = engine.scheduler.swapped[0]
            assert group.request_id == "b" and len(group.seqs) == 3
            assert all(s.status is SequenceStatus.SWAPPED and s.num_output_tokens > 0 for s in group.seqs)
            assert engine.get_metrics().num_swapped == 1
            seen_swapped = True
    assert seen_swapped
    for request_id in ("a", "b"):
        engine.abort_request(request_id)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_swap_blocks == bm.num_swap_blocks


def test_bad_preemption_settings_are_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(tiny_model_dir("llama"), preemption_mode="evict", num_kv_blocks=8)
    with pytest.raises(ValueError, match="swap_space"):
        LLM(tiny_model_dir("llama"), swap_space=-1, num_kv_blocks=8)
