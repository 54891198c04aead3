"""One request cannot fail its batch-mates: numeric fields are range-checked before they reach the engine, and a
failure of one request's sampling inside a step ends that request alone, its batch-mates' tokens identical to a
run without it (issue 21, item 2)."""
import pytest

from engine import SamplingParams
from engine.core.sequence import seed_for_index
from tests.engine.models_util import make_engine, random_token_ids
from tests.extras import require_xgrammar

PROMPTS = [random_token_ids(30, seed=s) for s in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run_all(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir, max_model_len=128, num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(engine):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ref{i}", {"prompt_token_ids": prompt}, GREEDY)
    return {rid[3:]: out.outputs[0].token_ids for rid, out in run_all(engine).items()}


@pytest.mark.parametrize("field, value", [
    ("top_k", 2 ** 70), ("top_k", 2 ** 63), ("seed", 2 ** 63), ("seed", -(2 ** 63) - 1), ("max_tokens", 2 ** 64),
    ("min_tokens", 2 ** 63), ("n", 2 ** 63), ("logprobs", 2 ** 63), ("prompt_logprobs", 2 ** 64),
    ("truncate_prompt_tokens", 2 ** 63), ("stop_token_ids", [2 ** 63]), ("allowed_token_ids", [2 ** 64]),
    ("logit_bias", {2 ** 63: 1.0}), ("temperature", 10 ** 400), ("top_p", float("nan")),
])
def test_out_of_int64_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field)


def test_int64_limits_are_accepted():
    SamplingParams(top_k=2 ** 63 - 1, seed=-(2 ** 63), max_tokens=2 ** 63 - 1, min_tokens=2 ** 63 - 1)
    SamplingParams(seed=2 ** 63 - 1, truncate_prompt_tokens=2 ** 63 - 1)


@pytest.mark.parametrize("field, value, message", [
    ("logprobs", 21, "logprobs must be <= 20"), ("prompt_logprobs", 10 ** 6, "prompt_logprobs must be <= 20"),
    ("stop_token_ids", [10 ** 9], "stop_token_ids has token id"), ("n", 10 ** 6, "n must be <= max_num_seqs"),
])
def test_engine_refuses_values_beyond_what_it_allows(engine, field, value, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(**{field: value}))
    assert "bad" not in engine.requests


def test_huge_top_k_runs_as_top_k_off(engine):
    """top_k at the int64 limit keeps the whole vocabulary: the same tokens as top_k=0, same seed."""
    outs = {}
    for name, top_k in (("off", 0), ("huge", 2 ** 63 - 1), ("vocab", 10 ** 9)):
        engine.add_request(name, {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(top_k=top_k, seed=5, max_tokens=5, ignore_eos=True))
    outs = run_all(engine)
    assert outs["huge"].outputs[0].token_ids == outs["off"].outputs[0].token_ids == outs["vocab"].outputs[0].token_ids
    assert all(out.error is None for out in outs.values())


def test_negative_seeds_do_not_collide_with_positive_ones():
    # torch's CPU generator keeps the low 32 bits of a seed: those must differ too.
    seeds = [-1, 2 ** 63 - 1, -(2 ** 63), 0, 1, 2 ** 62, 2 ** 32, 2 ** 32 + 1]
    assert len({seed_for_index(s, 0) % 2 ** 32 for s in seeds}) == len(seeds)
    assert all(0 <= seed_for_index(s, i) < 2 ** 64 for s in seeds for i in range(4))


def test_negative_and_positive_seed_streams_differ(engine):
    for name, seed in (("neg", -1), ("pos", 2 ** 63 - 1)):
        engine.add_request(name, {"prompt_token_ids": PROMPTS[1]},
                           SamplingParams(seed=seed, temperature=1.0, max_tokens=8, ignore_eos=True))
    outs = run_all(engine)
    assert outs["neg"].outputs[0].token_ids != outs["pos"].outputs[0].token_ids


class _FailForBias:
    """The engine's sampler, raising whenever its rows include one with a logit bias on token 7 (a stand-in for
    any parameter that breaks the sampler)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def _check(self, meta):
        if meta.logit_bias and any(7 in bias[0].tolist() for bias in meta.logit_bias.values()):
            raise RuntimeError("this request's parameters break the sampler")

    def __call__(self, logits, meta):
        self._check(meta)
        return self.sampler(logits, meta)

    def sample(self, logits, meta):   # the runner's entry (the draws stay on the device)
        self._check(meta)
        return self.sampler.sample(logits, meta)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_a_request_that_breaks_the_sampler_fails_alone(engine, reference):
    runner = engine.model_runner
    original = runner.sampler
    runner.sampler = _FailForBias(original)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"mate{i}", {"prompt_token_ids": prompt}, GREEDY)
        engine.add_request("bad", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={7: 1.0}))
        outs = run_all(engine)
    finally:
        runner.sampler = original
    assert outs["bad"].error is not None and "this request's parameters break the sampler" in outs["bad"].error
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error"]
    for i in range(len(PROMPTS)):
        assert outs[f"mate{i}"].error is None
        assert outs[f"mate{i}"].outputs[0].token_ids == reference[str(i)]
    bm = engine.block_manager
    assert not engine.requests and bm.num_free_blocks == bm.num_blocks


def test_a_grammar_that_fails_fails_its_request_alone(engine, reference):
    require_xgrammar()
    from engine.sampling_params import GuidedDecodingParams

    engine.add_request("guided", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=6,
                                      guided_decoding=GuidedDecodingParams(regex="[a-z]+")))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"mate{i}", {"prompt_token_ids": prompt}, GREEDY)
    # Break the guided request's matcher after it was added (a bug or a grammar the matcher chokes on).
    while engine.requests["guided"].seqs[0].guided is None:
        engine.step()
    state = engine.requests["guided"].seqs[0].guided

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("matcher broke")
    state.matcher = Broken()
    outs = run_all(engine)
    assert outs["guided"].error is not None and "matcher broke" in outs["guided"].error
    for i in range(len(PROMPTS)):
        assert outs[f"mate{i}"].outputs[0].token_ids == reference[str(i)]
