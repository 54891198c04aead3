"""The vLLM request fields through the engine: max_tokens=0 (prompt logprobs only), truncate_prompt_tokens,
bad_words, token ids checked against the vocabulary; sampling defaults from generation_config.json; and
max_model_len fitted to the KV cache."""
import json
import logging

import pytest

from engine import LLM, LLMEngine, SamplingParams
from tests.engine.models_util import TINY_VOCAB_SIZE, make_engine, random_token_ids


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256, num_kv_blocks=64)


def assert_all_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert not llm.llm_engine.requests and bm.num_free_blocks == bm.num_blocks


def test_max_tokens_zero_returns_prompt_logprobs_and_no_output(llm):
    prompt = {"prompt_token_ids": random_token_ids(37, seed=2)}
    zero = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2, n=2), use_tqdm=False)[0]
    one = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0), use_tqdm=False)[0]
    assert zero.finished and [c.finish_reason for c in zero.outputs] == ["length", "length"]
    assert all(c.token_ids == [] and c.text == "" for c in zero.outputs)
    assert len(zero.prompt_logprobs) == 37 and zero.prompt_logprobs[0] is None
    for got, want in zip(zero.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    assert_all_free(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    engine = llm.llm_engine
    long_prompt = random_token_ids(300, seed=3)   # longer than max_model_len=256: fine once truncated
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=20)
    engine.add_request("long", {"prompt_token_ids": long_prompt}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    out = outputs[-1]
    assert out.finished and out.prompt_token_ids == long_prompt[-20:]
    plain = llm.generate({"prompt_token_ids": long_prompt[-20:]},
                         SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    text_prompt = llm.get_tokenizer().decode(random_token_ids(60, seed=9))
    truncated = llm.generate(text_prompt, params, use_tqdm=False)[0]
    assert len(truncated.prompt_token_ids) == 20 and truncated.prompt == engine.detokenizer.decode(
        truncated.prompt_token_ids, skip_special_tokens=False)
    # Through LLM.generate too: the prompt is truncated before the length check, not rejected by it.
    through_llm = llm.generate({"prompt_token_ids": long_prompt}, params, use_tqdm=False)[0]
    assert through_llm.prompt_token_ids == long_prompt[-20:]
    assert through_llm.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams())
    assert_all_free(llm)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_never_appear_in_the_output(llm):
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    prompt = {"prompt_token_ids": random_token_ids(10, seed=6)}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # Words spelled by a run of the unconstrained output's tokens (one token, then two or three).
    words = {}
    for length in (1, 2, 3):
        for start in range(len(free) - length + 1):
            ids = free[start:start + length]
            word = tokenizer.decode(ids).strip()
            if word and ids in engine.bad_words_token_ids([word]) and word not in words:
                words[word] = ids
                break
    assert any(len(ids) == 1 for ids in words.values()) and any(len(ids) > 1 for ids in words.values()), words
    banned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=list(words))
    out = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0]
    token_seqs = engine.bad_words_token_ids(list(words))
    assert not any(contains(out.token_ids, seq) for seq in token_seqs), (out.token_ids, token_seqs)
    assert len(out.token_ids) == 24


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_rejected(llm, field):
    value = {TINY_VOCAB_SIZE: 1.0} if field == "logit_bias" else [3, TINY_VOCAB_SIZE]
    with pytest.raises(ValueError, match=f"^{field} .*{TINY_VOCAB_SIZE}"):
        llm.llm_engine.add_request("r", "hello", SamplingParams(**{field: value}))
    assert not llm.llm_engine.requests


def test_logit_bias_and_allowed_token_ids_steer_the_engine(llm):
    prompt = {"prompt_token_ids": random_token_ids(10, seed=8)}
    forced = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=1, logit_bias={77: 100.0}),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [77] * 6
    allowed = [40, 41, 99]
    restricted = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, seed=2, allowed_token_ids=allowed),
                              use_tqdm=False)[0].outputs[0]
    assert set(restricted.token_ids) <= set(allowed) and len(restricted.token_ids) == 12


def write_generation_config(directory, **fields) -> str:
    with open(directory / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 0], **fields}, f)
    return str(directory)


def test_generation_config_defaults(llama_dir, tmp_path, caplog):
    config_dir = write_generation_config(tmp_path, temperature=0.5, top_k=7, top_p=0.8, repetition_penalty=1.2,
                                         max_new_tokens=9, do_sample=True)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = make_engine(llama_dir, num_kv_blocks=16, generation_config=config_dir)
    expected = dict(temperature=0.5, top_k=7, top_p=0.8, repetition_penalty=1.2, max_tokens=9)
    assert engine.sampling_defaults == expected
    assert any("generation_config" in r.getMessage() and "top_k" in r.getMessage() for r in caplog.records)
    first, second = engine.default_sampling_params(), engine.default_sampling_params()
    assert first is not second and first == second
    assert {k: getattr(first, k) for k in expected} == expected
    engine.add_request("r", {"prompt_token_ids": random_token_ids(5, seed=1)})   # params=None: the defaults
    assert engine.requests["r"].seqs[0].params == first
    # "auto" reads the model's own file (the tiny model's has no sampling fields); "vllm" ignores any file.
    assert make_engine(llama_dir, num_kv_blocks=16).sampling_defaults == {}
    assert make_engine(llama_dir, num_kv_blocks=16, generation_config="vllm").default_sampling_params() == SamplingParams()


def test_llm_get_default_sampling_params(llama_dir, tmp_path):
    # vLLM's LLM.get_default_sampling_params: what a request without SamplingParams runs with, to adjust and pass on.
    config_dir = write_generation_config(tmp_path, temperature=0.0, repetition_penalty=1.3, max_new_tokens=3)
    llm = LLM(llama_dir, num_kv_blocks=16, generation_config=config_dir)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.0, 1.3, 3)
    assert llm.get_default_sampling_params() is not params
    prompt = {"prompt_token_ids": random_token_ids(5, seed=3)}
    implicit = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert implicit.token_ids == explicit.token_ids and len(implicit.token_ids) <= 3
    params.max_tokens = 5   # adjusted and passed on, as vLLM scripts do
    params.ignore_eos = True
    assert len(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 5
    assert LLM(llama_dir, num_kv_blocks=16, generation_config="vllm").get_default_sampling_params() == SamplingParams()


def test_override_generation_config(llama_dir, tmp_path):
    # vLLM's --override-generation-config: generation_config.json's keys over the file's (or over none with "vllm").
    config_dir = write_generation_config(tmp_path, temperature=0.5, top_k=7)
    llm = LLM(llama_dir, num_kv_blocks=16, generation_config=config_dir,
              override_generation_config={"top_k": 3, "max_new_tokens": 4})
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 3, 4)
    alone = make_engine(llama_dir, num_kv_blocks=16, generation_config="vllm",
                        override_generation_config={"repetition_penalty": 1.1})
    assert alone.sampling_defaults == {"repetition_penalty": 1.1}
    for bad, says in (({"temprature": 0.5}, "not sampling defaults"), ({"top_k": "3"}, "top_k='3' is not a valid"),
                      ([1], "must be a dict")):
        with pytest.raises(ValueError, match=f"override_generation_config.*{says}|{says}"):
            LLM(llama_dir, num_kv_blocks=16, override_generation_config=bad)


@pytest.mark.parametrize("generation_config,message", [("/no/such/dir", "generation_config must be"),
                                                       ("bad-value", "generation_config.*top_k")])
def test_generation_config_errors(llama_dir, tmp_path, generation_config, message):
    if generation_config == "bad-value":
        generation_config = write_generation_config(tmp_path, top_k=2.5)
    with pytest.raises(ValueError, match=message):
        make_engine(llama_dir, num_kv_blocks=16, generation_config=generation_config)


def test_max_model_len_capped_to_the_cache_or_refused_when_explicit(llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="engine"):
        engine = make_engine(llama_dir, num_kv_blocks=5, block_size=16)
    assert engine.max_model_len == engine.model_config.max_model_len == 80
    assert any("80" in r.getMessage() and "1024" in r.getMessage() for r in caplog.records)
    # A request as long as the capped max_model_len runs (one sequence always fits the cache).
    engine.add_request("r", {"prompt_token_ids": random_token_ids(70, seed=4)},
                       SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10
    with pytest.raises(ValueError, match="max_model_len=128 .*80 tokens"):
        make_engine(llama_dir, num_kv_blocks=5, block_size=16, max_model_len=128)
    assert make_engine(llama_dir, num_kv_blocks=5, block_size=16, max_model_len=80).max_model_len == 80


def test_max_logprobs_sets_the_limit_of_logprobs_and_prompt_logprobs(llama_dir):
    # vLLM's max_logprobs (default 20; -1: the whole vocabulary): the top-k lists past 20 are real, and the limit
    # is a ValueError naming the field.
    llm = LLM(llama_dir, num_kv_blocks=16, max_logprobs=40)
    prompt = {"prompt_token_ids": random_token_ids(6, seed=4)}
    out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=40, prompt_logprobs=33, temperature=0.0),
                       use_tqdm=False)[0]
    step = out.outputs[0].logprobs[0]
    assert len(step) in (40, 41) and sorted(lp.rank for lp in step.values())[:40] == list(range(1, 41))
    assert all(len(position) in (33, 34) for position in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="logprobs must be <= 40, got 41"):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=41), use_tqdm=False)
    everything = LLM(llama_dir, num_kv_blocks=16, max_logprobs=-1)
    whole = everything.generate(prompt, SamplingParams(max_tokens=1, logprobs=TINY_VOCAB_SIZE), use_tqdm=False)
    assert len(whole[0].outputs[0].logprobs[0]) == TINY_VOCAB_SIZE
    with pytest.raises(ValueError, match="max_logprobs must be >= -1"):
        LLM(llama_dir, num_kv_blocks=16, max_logprobs=-2)
