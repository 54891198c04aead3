"""Async scheduling (engine/core/engine_core.py, vLLM's async_scheduling) with the same scheduler, core and runner code
the CUDA engine runs, here on the CPU: the core schedules and launches step N+1 before it reads step N's sampled
ids, each sampling sequence holding a placeholder (engine/core/scheduler.py), and the runner feeds a token still in
flight to the next forward from the device tensor it sampled into (engine/worker/sampler.py SampledIds). What must hold:

- the pipeline really runs one step ahead (the order of launches and reads is checked, not assumed);
- the outputs are those of the engine without it (greedy, and seeded sampling), whatever the request asks for:
  n > 1, stop strings, stop tokens, min/max tokens, penalties, logit_bias, bad words, logprobs and prompt
  logprobs, guided decoding, beam search, prefix caching, both preemption modes, abort;
- what a step computed for a request that had finished meanwhile is dropped, and every block comes back;
- speculative decoding refuses it clearly when asked for both, and runs without it by default.
"""
from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.core.beam_search import BeamSearchParams
from engine.sampling_params import GuidedDecodingParams
from engine.worker.sampler import AsyncModelRunnerOutput
from tests.engine.models_util import random_token_ids
from tests.extras import require_xgrammar


def _llm(model_dir: str, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(model_dir, max_model_len=160, async_scheduling=async_scheduling, **{"num_kv_blocks": 96, **kwargs})


def _prompts() -> list:
    shared = random_token_ids(40, seed=3)   # a prefix several prompts share (prefix caching)
    return ["The cat sat on the mat.", "Hello, world", {"prompt_token_ids": shared + random_token_ids(7, seed=4)},
            {"prompt_token_ids": shared + random_token_ids(3, seed=5)}, {"prompt_token_ids": random_token_ids(90, seed=6)},
            "def main():\n    print("]


def _completions(outputs) -> list:
    return [[(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
              None if c.logprobs is None else [{t: dataclasses.astuple(lp) for t, lp in e.items()} for e in c.logprobs])
             for c in o.outputs] + [None if o.prompt_logprobs is None else
                                    [None if e is None else sorted(e) for e in o.prompt_logprobs]]
            for o in outputs]


@pytest.fixture(scope="module")
def engines(llama_dir):
    sync, async_ = _llm(llama_dir, False), _llm(llama_dir, True)
    yield sync, async_
    sync.llm_engine.shutdown()
    async_.llm_engine.shutdown()


def test_the_core_reads_each_step_one_step_late(engines, monkeypatch):
    """With async scheduling step N+1 is launched before step N's sampled ids are read; without it each step is
    read before the next is launched."""
    events = []
    for llm in engines:
        runner = llm.llm_engine.model_runner
        execute = runner.execute_model

        def traced_execute(scheduler_output, execute=execute):
            result = execute(scheduler_output)
            events.append(("launch", id(result)))
            if isinstance(result, AsyncModelRunnerOutput):
                get_output = result.get_output
                result.get_output = lambda get_output=get_output, key=id(result): (
                    events.append(("read", key)) or get_output())
            return result

        monkeypatch.setattr(runner, "execute_model", traced_execute)
        events.clear()
        llm.generate(_prompts()[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        kinds = [kind for kind, _ in events]
        if llm.llm_engine.config.scheduler_config.async_scheduling:
            launches = [key for kind, key in events if kind == "launch"]
            reads = [key for kind, key in events if kind == "read"]
            assert len(launches) >= 6 and reads, events
            # Each read comes after the launch of the step that follows it.
            for key in reads[:-1]:
                at = events.index(("read", key))
                assert launches.index(key) + 1 < len(launches) and \
                    events.index(("launch", launches[launches.index(key) + 1])) < at
        else:
            assert kinds == ["launch"] * len(kinds)   # sync results: nothing to read later


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    "eos": SamplingParams(temperature=0, max_tokens=30),
    "seeded_n": SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=40, seed=7, max_tokens=16, logprobs=2),
    "min_max_tokens": SamplingParams(temperature=0.8, seed=3, min_tokens=6, max_tokens=9),
    "penalties_bias": SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.4,
                                     frequency_penalty=0.2, logit_bias={5: 3.0, 9: -100.0}, ignore_eos=True),
    "bad_words_prompt_logprobs": SamplingParams(temperature=0.7, seed=11, max_tokens=12, bad_words=["the", " cat"],
                                                prompt_logprobs=2, logprobs=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_equal_without_async_scheduling(engines, name):
    sync, async_ = engines
    params = CASES[name]
    expected = sync.generate(_prompts(), params, use_tqdm=False)
    assert _completions(async_.generate(_prompts(), params, use_tqdm=False)) == _completions(expected)
    for llm in engines:
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_stop_strings_and_stop_tokens_equal(engines):
    sync, async_ = engines
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in sync.generate(_prompts(), base, use_tqdm=False)]
    long = [t for t in texts if len(t) >= 12]
    tokens = sync.generate(_prompts()[:1], base, use_tqdm=False)[0].outputs[0].token_ids
    params = dataclasses.replace(base, stop=[long[0][6:9], long[1][9:11]], stop_token_ids=[tokens[7]])
    expected = sync.generate(_prompts(), params, use_tqdm=False)
    assert {c.finish_reason for o in expected for c in o.outputs} == {"stop", "length"}
    assert _completions(async_.generate(_prompts(), params, use_tqdm=False)) == _completions(expected)


def test_guided_decoding_equal(engines):
    require_xgrammar()   # the GPU image has no xgrammar: there this test stopped the module's run (2026-11-28)
    sync, async_ = engines
    params = [SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(regex=r"[a-z]{3,8}")),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                             guided_decoding=GuidedDecodingParams(choice=["yes", "no", "maybe"]))]
    prompts = _prompts()[:2]
    expected = sync.generate(prompts, params, use_tqdm=False)
    assert _completions(async_.generate(prompts, params, use_tqdm=False)) == _completions(expected)
    assert expected[1].outputs[0].text in ("yes", "no", "maybe")


def test_beam_search_equal(engines):
    sync, async_ = engines
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    expected = sync.beam_search(_prompts()[:2], params)
    got = async_.beam_search(_prompts()[:2], params)
    assert [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in expected]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_equal(llama_dir, preemption_mode):
    """A cache too small for the batch: requests are preempted (their tokens in flight on the way) and resumed."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": random_token_ids(30, seed=20 + i)} for i in range(6)]
    results = []
    for async_scheduling in (False, True):
        llm = _llm(llama_dir, async_scheduling, num_kv_blocks=24, preemption_mode=preemption_mode, swap_space=0.01)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False))
            assert llm.llm_engine.scheduler.num_preemptions > 0
            bm = llm.llm_engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks and bm.num_free_swap_blocks == bm.num_swap_blocks
        finally:
            llm.llm_engine.shutdown()
    assert _completions(results[1]) == _completions(results[0])


def test_abort_and_finish_in_flight_free_everything(engines):
    """Requests that end while a step of theirs is in flight (an abort, EOS found one step late): the step's
    tokens for them are dropped, their blocks come back, and the others run on unchanged."""
    sync, async_ = engines
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = sync.generate(_prompts()[1:2], params, use_tqdm=False)[0]
    engine = async_.llm_engine
    engine.add_request("keep", _prompts()[1], params)
    engine.add_request("gone", _prompts()[0], params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
        if steps == 3:
            assert engine.engine_core.has_steps_in_flight()
            aborted = engine.abort_request("gone")
            assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert "gone" not in finished
    assert _completions([finished["keep"]]) == _completions([expected])
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.requests and not engine.output_processor.requests


def test_speculative_decoding_runs_without_it(llama_dir):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match="async_scheduling=True does not work with speculative_config"):
        LLM(llama_dir, max_model_len=160, num_kv_blocks=64, speculative_config=ngram, async_scheduling=True)
    from engine.engine_args import EngineArgs
    config = EngineArgs(model=llama_dir, speculative_config=ngram, device="cpu").create_engine_config()
    assert config.scheduler_config.async_scheduling is False


def test_cpu_default_is_off_and_the_flag_parses(llama_dir):
    import argparse

    from engine.engine_args import EngineArgs
    assert EngineArgs(model=llama_dir).create_engine_config().scheduler_config.async_scheduling is False
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is None
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineArgs(model=llama_dir, async_scheduling=1).create_engine_config()
