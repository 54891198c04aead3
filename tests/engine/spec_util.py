"""Speculative decoding's test workload and runner, shared by tests/engine/test_spec_decode.py (CPU) and
tests/engine/test_cuda_features.py (the GPU suite; this module imports nothing the GPU image lacks)."""

from engine import LLM, SamplingParams
from tests.engine.models_util import random_token_ids

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def spec_prompts() -> list[dict]:
    """Token-id prompts: two that repeat a span (n-gram matches), two random ones, of several lengths."""
    span = random_token_ids(12, seed=7)
    return [{"prompt_token_ids": span * 3 + random_token_ids(5, seed=8)},
            {"prompt_token_ids": random_token_ids(9, seed=9) + span + span[:6]},
            {"prompt_token_ids": random_token_ids(37, seed=10)},
            {"prompt_token_ids": random_token_ids(3, seed=11)}]


def generate_checked(model_dir: str, params=GREEDY, prompts=None, **kwargs):
    """``LLM(model_dir, **kwargs).generate`` of ``prompts`` (default spec_prompts()): (outputs, the spec-decode
    stats), every block free and unreferenced afterwards; ``must_preempt``: the run had to preempt."""
    must_preempt = kwargs.pop("must_preempt", False)
    llm = LLM(model_dir, max_model_len=160, num_kv_blocks=kwargs.pop("num_kv_blocks", 64), **kwargs)
    try:
        outputs = llm.generate(prompts or spec_prompts(), params, use_tqdm=False)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        metrics = llm.llm_engine.get_metrics()
        assert metrics.num_preemptions > 0 or not must_preempt
        return outputs, metrics.spec_decode
    finally:
        llm.llm_engine.shutdown()


def completion_tokens(outputs) -> list[list[list[int]]]:
    """Each request's completions' token ids."""
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]
