"""A step that raises fails only the requests it was working on: they finish with finish_reason "error" and
RequestOutput.error, every block comes back, the traceback is logged, nothing unwritten enters the prefix cache,
and the engine serves the other requests and later ones with the same tokens as an engine that never failed."""
import logging

import pytest
import torch

from engine import LLMEngine, SamplingParams
from tests.engine.models_util import make_engine, random_token_ids

PROMPTS = [random_token_ids(40, seed=s) for s in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def engine_for(llama_dir, **kwargs) -> LLMEngine:
    return make_engine(llama_dir, max_model_len=128, num_kv_blocks=32, **kwargs)


def run_all(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = engine_for(llama_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
    return {rid: out.outputs[0].token_ids for rid, out in run_all(engine).items()}


def fail_once(obj, name: str, on_call: int, before=None):
    """Make obj.name raise RuntimeError on its `on_call`-th call (1-based); `before(*args)` runs first then."""
    original = getattr(obj, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == on_call:
            if before is not None:
                before(*args, **kwargs)
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)
    setattr(obj, name, wrapper)
    return calls


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and not engine.requests
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("where", ["model", "detokenizer"])
def test_failed_step_fails_only_its_requests(llama_dir, reference, where, caplog):
    """A failure of the whole step (the forward) fails the step's requests; a failure while processing one
    request's output (its detokenization) fails that request alone."""
    # max_num_seqs=2: r2 waits while r0 and r1 run, so the failure leaves it untouched.
    engine = engine_for(llama_dir, max_num_seqs=2)
    if where == "model":
        fail_once(engine.model_runner, "execute_model", on_call=3)
        expected_failed, message = {"r0", "r1"}, "internal error in engine step: RuntimeError: injected failure"
    else:
        # Calls 1-4: r0, r1 (first tokens), r0, r1 (second tokens): r1's second token fails it alone.
        fail_once(engine.detokenizer, "update", on_call=4)
        expected_failed, message = {"r1"}, "RuntimeError: injected failure"
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
    failed, finished = {}, {}
    with caplog.at_level(logging.ERROR, logger="engine"):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    failed[out.request_id] = out
                elif out.finished:
                    finished[out.request_id] = out
    assert set(failed) == expected_failed and set(finished) == {"r0", "r1", "r2"} - expected_failed
    for out in failed.values():
        assert out.finished and all(c.finish_reason == "error" for c in out.outputs)
        assert out.error == message
    for rid, out in finished.items():
        assert out.outputs[0].token_ids == reference[rid]
    assert_all_free(engine)
    records = [r for r in caplog.records if r.name == "engine" and r.exc_info]
    assert records and records[0].exc_info[0] is RuntimeError
    # The engine still serves new requests, with the tokens of an engine that never failed.
    engine.add_request("again", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    assert run_all(engine)["again"].outputs[0].token_ids == reference["r0"]
    assert_all_free(engine)


def test_a_batched_sampling_failure_is_retried_row_by_row(llama_dir, reference):
    """The batched sampler call fails once (for no request's fault): each row is sampled alone then, and every
    request gets the tokens of an engine that never failed."""
    engine = engine_for(llama_dir)
    engine.model_runner.sampler = sampler = _FailOnceSampler(engine.model_runner.sampler)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
    outputs = run_all(engine)
    assert sampler.calls > 2 and all(out.error is None for out in outputs.values())
    assert {rid: out.outputs[0].token_ids for rid, out in outputs.items()} == reference
    assert_all_free(engine)


class _FailOnceSampler:
    """Stands in for the engine's sampler: raises on its second call, delegates otherwise."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.calls = 0

    def __call__(self, logits, seqs):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected failure")
        return self.sampler(logits, seqs)

    def sample(self, logits, seqs):   # the runner's entry (the draws stay on the device)
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected failure")
        return self.sampler.sample(logits, seqs)


def test_kv_of_a_failed_forward_is_not_served_from_the_prefix_cache(llama_dir, reference):
    """The forward writes its KV, the KV is then poisoned (as a forward dying half-way could leave it) and the
    step raises: the blocks must not be registered, or the next request with that prompt would reuse them."""
    engine = engine_for(llama_dir)

    def poison(scheduler_output, **kwargs):
        for group in engine.requests.values():
            for seq in group.seqs:
                engine.model_runner.kv_cache[:, :, seq.block_table] = float("nan")
    fail_once(engine.model_runner, "execute_model", on_call=1, before=poison)
    engine.add_request("first", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["first"] and outs[0].error is not None
    assert not engine.block_manager.hash_to_block_id
    engine.add_request("second", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    out = run_all(engine)["second"]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference["r0"]
    assert_all_free(engine)


def test_failed_copy_on_write_fails_the_forked_request(llama_dir):
    """n=2 forks share the prompt's last partial block; the first decode copies it (copy-on-write). A failure
    of that copy fails the request (its copied block's KV is unknown) and frees every block."""
    engine = engine_for(llama_dir)
    calls = fail_once(engine.model_runner, "copy_blocks", on_call=1)
    engine.add_request("n2", {"prompt_token_ids": PROMPTS[1][:21]},
                       SamplingParams(n=2, seed=3, max_tokens=5, ignore_eos=True))
    outputs = run_all(engine)
    assert calls["n"] == 1
    out = outputs["n2"]
    assert out.error is not None and [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert_all_free(engine)


def test_beam_search_failure_is_isolated(llama_dir):
    from engine.core.beam_search import BeamSearchParams

    engine = engine_for(llama_dir)
    fail_once(engine.model_runner, "execute_model", on_call=3)
    engine.add_beam_request("beam", {"prompt_token_ids": PROMPTS[2][:20]}, BeamSearchParams(beam_width=2, max_tokens=4))
    outputs = run_all(engine)
    assert outputs["beam"].error is not None
    assert_all_free(engine)
    assert not engine.beam_candidates
