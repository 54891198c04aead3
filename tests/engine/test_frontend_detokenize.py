"""Detokenization behind the engine core (vLLM V1's OutputProcessor): the core sends token-id deltas; the output
processor makes the text, finds stop strings (telling the core which completions they ended:
EngineCore.stop_sequences) and decodes logprob tokens. `LLM.generate` runs the two in one process; under `serve` the
deltas cross a ZMQ socket as msgpack (EngineCoreOutput.to_wire) to the API server process's output processor. What
reaches a stream must be what LLM.generate gives: text, tokens, finish and stop reasons, logprobs with their decoded
tokens, cumulative logprobs; and a completion a stop string ended stops taking the core's steps and blocks.

The first tests drive the two halves in this process through the wire format (core step -> to_wire -> msgpack ->
from_wire -> OutputProcessor -> stops back to the core), so every case is cheap and exact; the last runs a real
engine core process behind MPAsyncLLMEngine."""
import asyncio
import dataclasses

import pytest

# The core's deltas cross to the API server as msgpack: the serve extra's (the torch 2.11 tier's venv has none).
msgpack = pytest.importorskip("msgpack", reason="the engine core's wire format is msgpack (the serve extra): "
                                                "pip install -c .ci/constraints.txt -e \".[serve]\"")

from engine import LLM, SamplingParams  # noqa: E402
from engine.step_records import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from engine.core.output_processor import Detokenizer  # noqa: E402
from engine.core.output_processor import OutputProcessor  # noqa: E402
from tests.engine.models_util import random_token_ids  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _prompts() -> list:
    span = random_token_ids(12, seed=7)
    return ["The cat sat on the mat.", "Hello, world", {"prompt_token_ids": span * 3 + random_token_ids(5, seed=8)},
            {"prompt_token_ids": random_token_ids(9, seed=9) + span + span[:6]}]


def _over_the_wire(message):
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False, strict_map_key=False)


def _split_generate(llm: LLM, prompts: list, params: SamplingParams, deltas: dict | None = None) -> tuple[list, int]:
    """The prompts through llm's engine core with the process split of `serve`, in this process: requests and outputs
    cross msgpack, a separate OutputProcessor makes the text. Returns the final outputs (in prompt order) and how many
    steps ran after the output processor had every request finished. `deltas` (request id -> list) gets the number of
    tokens each core output brought completion 0."""
    engine = llm.llm_engine
    core = engine.engine_core
    processor = OutputProcessor(engine.tokenizer)
    finals = {}
    for i, prompt in enumerate(prompts):
        request = engine.input_processor.process(str(i), prompt, params)
        core.add_request(EngineCoreRequest.from_wire(_over_the_wire(request.to_wire())))
        processor.add_request(request.request_id, request.prompt, request.prompt_token_ids, params)
    steps_after = 0
    while core.has_unfinished_requests():
        steps_after += not processor.requests
        wire = [_over_the_wire(out.to_wire()) for out in core.step()]
        if deltas is not None:
            for data in wire:
                if data[-1]:
                    deltas.setdefault(data[0], []).append(len(data[-1][0][1]))
        processed = processor.process_outputs([EngineCoreOutput.from_wire(data) for data in wire])
        for output in processed.request_outputs:
            if output.finished:
                finals[output.request_id] = output
        for request_id, indices in processed.stops:   # the "stop" message, handled between steps as the core does
            core.stop_sequences(request_id, indices)
    assert not processor.requests
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    return [finals[str(i)] for i in range(len(prompts))], steps_after


def _completions(outputs) -> list:
    return [[(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
              None if c.logprobs is None else [{t: dataclasses.astuple(lp) for t, lp in e.items()} for e in c.logprobs])
             for c in o.outputs] for o in outputs]


def _prompt_logprobs(outputs) -> list:
    return [None if o.prompt_logprobs is None else
            [None if e is None else {t: dataclasses.astuple(lp) for t, lp in e.items()} for e in o.prompt_logprobs]
            for o in outputs]


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(llama_dir, max_model_len=160, num_kv_blocks=96)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def spec_llm(llama_dir):
    llm = LLM(llama_dir, max_model_len=160, num_kv_blocks=96, speculative_config=NGRAM)
    yield llm
    llm.llm_engine.shutdown()


def _stop_strings(llm: LLM, params: SamplingParams) -> list[str]:
    """Stop strings that occur inside the outputs `params` gives without them (a few characters from the middle
    of two of the texts), so the stops really cut."""
    texts = [c.text for o in llm.generate(_prompts(), params, use_tqdm=False) for c in o.outputs]
    long = [t for t in texts if len(t) >= 12]
    assert len(long) >= 2, texts
    return [long[0][6:9], long[1][9:11]]


def _check_equal(llm, params):
    expected = llm.generate(_prompts(), params, use_tqdm=False)
    got, _ = _split_generate(llm, _prompts(), params)
    assert _completions(got) == _completions(expected)
    assert _prompt_logprobs(got) == _prompt_logprobs(expected)
    return expected


@pytest.mark.parametrize("extra", [{}, {"include_stop_str_in_output": True}, {"min_tokens": 8},
                                   {"logprobs": 3, "prompt_logprobs": 2},
                                   {"skip_special_tokens": False}],
                         ids=["plain", "include_stop_str", "min_tokens", "logprobs", "special_tokens"])
def test_greedy_stop_strings_equal_in_process(llm, extra):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **extra)
    params = dataclasses.replace(base, stop=_stop_strings(llm, base))
    expected = _check_equal(llm, params)
    if "min_tokens" not in extra:
        assert sum(c.stop_reason in params.stop for o in expected for c in o.outputs) >= 2   # the stops did cut


def test_stop_strings_free_the_core_at_once(llm):
    """A stop string found by the output processor stops its completion in the core before the next step: the
    core runs no step past the last request's stop."""
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = dataclasses.replace(base, stop=_stop_strings(llm, dataclasses.replace(base, max_tokens=24)))
    outputs, steps_after = _split_generate(llm, _prompts()[:2], params)
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop", "stop"]
    assert steps_after == 0


def test_n_sampled_with_stop_strings_and_stop_tokens(llm):
    base = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, logprobs=1)
    stops = _stop_strings(llm, base)
    token = llm.generate(_prompts()[:1], base, use_tqdm=False)[0].outputs[1].token_ids[4]
    for include in (False, True):
        params = dataclasses.replace(base, stop=stops, stop_token_ids=[token], include_stop_str_in_output=include)
        expected = _check_equal(llm, params)
        reasons = {c.stop_reason for o in expected for c in o.outputs}
        assert token in reasons and reasons & set(stops)


def test_eos_and_length_endings(llm):
    eos = sorted(llm.llm_engine.model_config.eos_token_ids)[0]
    greedy = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    # A stop token the core ends on (its id as stop_token_ids stands for EOS), with and without its text.
    token = greedy[0].outputs[0].token_ids[5]
    for include in (False, True):
        _check_equal(llm, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token, eos],
                                         include_stop_str_in_output=include))
    _check_equal(llm, SamplingParams(temperature=0, max_tokens=12, stop=["\u2603 never"]))


def _stops_inside_drafts(llm: LLM, params: SamplingParams) -> list[str]:
    """Stop strings that end on the first token of a step that brought several (accepted drafts): for each
    request with such a step, the shortest tail of the text up to that token that does not occur before it."""
    deltas = {}
    outputs, _ = _split_generate(llm, _prompts(), params, deltas)
    detokenizer = Detokenizer(llm.llm_engine.tokenizer)
    stops = []
    for i, output in enumerate(outputs):
        token_ids = output.outputs[0].token_ids
        starts = [sum(deltas[str(i)][:k]) for k, size in enumerate(deltas[str(i)]) if size > 1]
        for p in starts:
            text = detokenizer.decode(token_ids[:p + 1])
            if len(text) > len(detokenizer.decode(token_ids[:p])):
                stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
                stops.append(stop)
                break
    return stops


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}], ids=["plain", "logprobs"])
def test_speculative_stop_inside_a_draft(spec_llm, extra):
    """Under n-gram speculation a step brings several tokens: a stop string on the first of them drops the rest
    (and their logprobs, out of the cumulative sum)."""
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **extra)
    stops = _stops_inside_drafts(spec_llm, base)
    assert stops, "the workload must accept drafts"
    for stop in stops:
        expected = _check_equal(spec_llm, dataclasses.replace(base, stop=[stop]))
        assert any(o.outputs[0].stop_reason == stop for o in expected)


def test_engine_core_process_streams_equal_llm(llama_dir, llm):
    """A real engine core process behind MPAsyncLLMEngine: streamed, the final outputs equal LLM.generate's, and
    each stream's text only grows."""
    from engine.engine_args import EngineArgs
    from engine.mp_engine import MPAsyncLLMEngine, start_engine_core

    pytest.importorskip("zmq", reason="the engine core process needs pyzmq (the serve extra)")
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    cases = [dataclasses.replace(base, stop=_stop_strings(llm, base)),
             SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, stop=[" t", "e"], logprobs=0)]
    expected = [llm.generate(_prompts(), params, use_tqdm=False) for params in cases]
    core = start_engine_core(EngineArgs(model=llama_dir, max_model_len=160, num_kv_blocks=96))

    async def run():
        engine = MPAsyncLLMEngine(core.address, core.info)
        try:
            async def one(i, prompt, params):
                text_seen, last = [], None
                async for output in engine.generate(prompt, params, request_id=f"r{i}-{id(params)}"):
                    text_seen.append([c.text for c in output.outputs])
                    last = output
                for before, after in zip(text_seen, text_seen[1:]):
                    assert all(a.startswith(b) for a, b in zip(after, before))
                return last
            results = []
            for params in cases:
                results.append(await asyncio.gather(*(one(i, p, params) for i, p in enumerate(_prompts()))))
            metrics = await engine.get_metrics()
            assert await engine.reset_prefix_cache()   # every request finished: the core empties its cache
            return results, metrics
        finally:
            await engine.shutdown()

    try:
        results, metrics = asyncio.run(run())
    finally:
        core.shutdown()
    for got, want in zip(results, expected):
        assert _completions(got) == _completions(want)
    assert metrics.num_running == metrics.num_waiting == 0
