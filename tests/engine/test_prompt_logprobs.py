"""SamplingParams(prompt_logprobs=k): the logprob of every prompt token (None for the first) equals transformers'
log-softmax within 2e-3, under chunked prefill and when an earlier request put the prompt's prefix in the prefix
cache (such a request computes its whole prompt: num_cached_tokens is 0; the next plain request still hits)."""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.models_util import hf_log_softmax, load_hf_model, random_token_ids


def check_against_reference(prompt_logprobs, prompt_ids, reference, k):
    """reference: transformers' log-softmax [len, vocab]; row p scores token p + 1."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    for pos in range(1, len(prompt_ids)):
        entry, row, token = prompt_logprobs[pos], reference[pos - 1], prompt_ids[pos]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=2e-3)
        # Rank: 1 + tokens strictly more likely (allowing for ties within the tolerance).
        assert int((row > row[token] + 2e-3).sum()) + 1 <= entry[token].rank <= int((row > row[token] - 2e-3).sum()) + 1
        top = [(t, e) for t, e in entry.items() if e.rank <= k]
        assert len(top) == k and len(entry) in (k, k + 1)
        for tid, e in top:
            assert e.logprob == pytest.approx(float(row[tid]), abs=2e-3)
            assert e.logprob >= float(row.topk(k).values[-1]) - 2e-3


def test_tiny_llama_chunked_and_with_cached_prefix(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=24)
    hf = load_hf_model(model_dir)
    prompt = random_token_ids(70, seed=61)
    llm.generate({"prompt_token_ids": prompt[:50]}, SamplingParams(max_tokens=1), use_tqdm=False)   # caches 48
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_against_reference(out.prompt_logprobs, prompt, hf_log_softmax(hf, prompt), k=3)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 64 and plain.prompt_logprobs is None


def test_smollm2(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=32)
    hf = load_hf_model(smollm2_dir)
    prompt = llm.get_tokenizer().encode("The paged attention kernel reads keys and values from blocks.")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2,
                                                                    n=2, seed=0), use_tqdm=False)[0]
    check_against_reference(out.prompt_logprobs, prompt, hf_log_softmax(hf, prompt), k=2)


def test_prompt_logprobs_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
