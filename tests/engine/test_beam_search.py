"""Beam search equals transformers' generate(num_beams, do_sample=False, length_penalty, early_stopping): every
returned beam and its score, on a random-weight Llama and on SmolLM2 (where EOS ends beams early, so the
early-stopping rules differ); beams share blocks (forks copy only on a shared write) and free them all."""
import pytest
import torch

from engine import LLM
from engine.core.beam_search import BeamSearchParams
from tests.engine.models_util import load_hf_model, make_engine, random_token_ids


def hf_beams(model, prompt_ids, params: BeamSearchParams, eos_token_id="default"):
    kwargs = {} if eos_token_id == "default" else {"eos_token_id": eos_token_id}
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), num_beams=params.beam_width, do_sample=False,
                             max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                             early_stopping=params.early_stopping, num_return_sequences=params.beam_width,
                             return_dict_in_generate=True, output_scores=True, pad_token_id=2, **kwargs)
    return out.sequences[:, len(prompt_ids):].tolist(), out.sequences_scores.tolist()


def strip_padding(tokens: list[int], length: int) -> list[int]:
    return tokens[:length]


def assert_same_beams(ours, prompt_len, ref_tokens, ref_scores):
    assert len(ours.sequences) == len(ref_tokens)
    for seq, tokens, score in zip(ours.sequences, ref_tokens, ref_scores):
        generated = seq.tokens[prompt_len:]
        assert generated == strip_padding(tokens, len(generated))
        assert seq.score == pytest.approx(score, abs=2e-3)


@pytest.mark.parametrize("early_stopping,length_penalty", [(False, 1.0), (True, 0.5), ("never", 2.0)])
def test_tiny_llama_matches_transformers(tiny_model_dir, early_stopping, length_penalty):
    model_dir = tiny_model_dir("llama")
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64)
    hf = load_hf_model(model_dir)
    prompts = [random_token_ids(20, seed=51), random_token_ids(37, seed=52)]
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        assert_same_beams(out, len(prompt), *hf_beams(hf, prompt, params))
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_copies > 0


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LLM(smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=64), load_hf_model(smollm2_dir)


@pytest.mark.parametrize("early_stopping", [False, True])
def test_smollm2_with_eos_matches_transformers(smollm2, early_stopping):
    llm, hf = smollm2
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt)
    params = BeamSearchParams(beam_width=3, max_tokens=12, early_stopping=early_stopping)
    out = llm.beam_search({"prompt_token_ids": prompt_ids}, params)[0]
    ref_tokens, ref_scores = hf_beams(hf, prompt_ids, params)
    assert any(seq.finish_reason == "stop" for seq in out.sequences)   # EOS did end beams
    assert_same_beams(out, len(prompt_ids), ref_tokens, ref_scores)
    assert "Paris" in out.sequences[0].text


def test_forked_beams_share_blocks(tiny_model_dir):
    """After the first beam step the beams share every prompt block; only their private last-block copies and
    new blocks add to the usage."""
    from engine import LLMEngine

    engine = make_engine(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=64)
    bm = engine.block_manager
    prompt = random_token_ids(40, seed=53)   # 2 full blocks + 8 tokens
    engine.add_beam_request("r", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=6,
                                                                                ignore_eos=True))
    engine.step()   # prompt, then 4 beams forked from it
    beams = engine.requests["r"].seqs
    assert len(beams) == 4 and all(b.block_table == beams[0].block_table for b in beams)
    assert bm.num_blocks - bm.num_free_blocks == 3 and bm.num_copies == 0
    engine.step()
    assert bm.num_copies == 3   # each fork copied the partly filled block once, when writing into it
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_beams_give_identical_results(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": random_token_ids(37, seed=s)} for s in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=14)
    reference = LLM(model_dir, max_model_len=256, num_kv_blocks=128).beam_search(prompts, params)
    llm = LLM(model_dir, max_model_len=192, num_kv_blocks=12, preemption_mode=mode, swap_space=1 / 64)
    outs = llm.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in outs] == [[s.tokens for s in o.sequences] for o in reference]
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions >= 2
    assert scheduler.num_swap_preemptions == (scheduler.num_preemptions if mode == "swap" else 0)
    assert llm.llm_engine.block_manager.num_free_blocks == 12
