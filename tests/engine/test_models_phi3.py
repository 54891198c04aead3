"""Phi-3 past its original context: LongRoPE's long factors, against transformers.

The shared parity tests (test_model_runner, test_llm) run the tiny Phi-3 with max_model_len 256, its original
context (PHI3_ORIGINAL_MAX_POSITIONS): the short factors, as transformers uses for sequences that short. Here
the engine's max_model_len reaches past it, so the engine rotates by the long factors, and the sequences are
longer than the original context, where transformers rotates every token of them by the long factors too
(its generate recomputes a sequence that crosses the original context while decoding). Tokens a sequence
generates before it crosses the original context are where the two differ (transformers: short factors
until then), by design: see engine/layers/rotary_embedding.py.
"""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from tests.engine.models_util import PHI3_ORIGINAL_MAX_POSITIONS, hf_log_softmax, load_hf_model, random_token_ids
from tests.engine.test_model_runner import Seq, make_runner, run_schedule, scatter_blocks

MAX_MODEL_LEN = 2 * PHI3_ORIGINAL_MAX_POSITIONS
LONG_PROMPT_LEN = PHI3_ORIGINAL_MAX_POSITIONS + 30  # past the original context from the prefill on
CROSSING_PROMPT_LEN = PHI3_ORIGINAL_MAX_POSITIONS - 4  # crosses it while decoding
MAX_TOKENS = 10
# Against transformers in float64: its own float32 forwards of these sequences are 1.1e-4 to 1.7e-4 away from
# it (measured; long sequences and the tiny model's large weights amplify rounding), the engine's 2.0e-4 to
# 2.1e-4; the short factors instead of the long ones move log-probabilities by more than 0.5.
FLOAT64_ATOL = 5e-4


def test_long_prefill_matches_transformers_at_every_position(tiny_model_dir):
    """A prompt past the original context, in one step: log-probabilities at every position equal
    transformers' forward (long factors); the same tokens' forward cut to the original context (short
    factors) differs, so this test notices which set is used."""
    model_dir = tiny_model_dir("phi3")
    hf = load_hf_model(model_dir, torch.float64)
    prompt = random_token_ids(LONG_PROMPT_LEN, seed=70)
    reference = hf_log_softmax(hf, prompt).double()
    short_reference = hf_log_softmax(hf, prompt[:PHI3_ORIGINAL_MAX_POSITIONS])
    assert (reference[:PHI3_ORIGINAL_MAX_POSITIONS] - short_reference).abs().max() > 0.5

    runner = make_runner(model_dir, max_model_len=MAX_MODEL_LEN)
    seq = Seq(prompt)
    scatter_blocks([seq], runner.num_kv_blocks, seed=5)
    _, (all_logits,) = runner.compute_logits_for([(seq, LONG_PROMPT_LEN)], all_logits_for=[0])
    torch.testing.assert_close(torch.log_softmax(all_logits.double(), dim=-1), reference, atol=FLOAT64_ATOL, rtol=0)


def test_chunked_prefill_and_decode_across_the_original_context(tiny_model_dir):
    """A sequence prefilled in chunks that stop short of the original context, then decoded across it: at
    every step the log-probabilities equal transformers' forward of the whole sequence (long factors
    throughout, as its generate has after recomputing at the crossing)."""
    model_dir = tiny_model_dir("phi3")
    hf = load_hf_model(model_dir, torch.float64)
    seq = Seq(random_token_ids(CROSSING_PROMPT_LEN + MAX_TOKENS, seed=73))
    reference = hf_log_softmax(hf, seq.token_ids).double()
    runner = make_runner(model_dir, max_model_len=MAX_MODEL_LEN)
    scatter_blocks([seq], runner.num_kv_blocks, seed=6)
    steps = [[(0, 100)], [(0, 100)], [(0, CROSSING_PROMPT_LEN - 200)]] + [[(0, 1)]] * MAX_TOKENS
    for index, position, logprobs in run_schedule(runner, [seq], steps):
        torch.testing.assert_close(logprobs.double(), reference[position], atol=FLOAT64_ATOL, rtol=0,
                                   msg=lambda m: f"position {position}: {m}")


def test_greedy_past_the_original_context_matches_transformers(tiny_model_dir):
    """Two prompts past the original context, prefilled in chunks of a shared 128-token budget and decoded
    in one batch: greedy tokens equal transformers' generate."""
    model_dir = tiny_model_dir("phi3")
    hf = load_hf_model(model_dir)
    hf.generation_config.eos_token_id = None
    prompts = [random_token_ids(LONG_PROMPT_LEN, seed=71), random_token_ids(LONG_PROMPT_LEN - 13, seed=72)]
    llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128, num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                   pad_token_id=2)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
