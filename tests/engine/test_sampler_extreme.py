"""The sampler never emits an id outside [0, vocab_size), whatever the parameters and the logits (NaN, inf,
huge values, everything masked), and the token constraints (logit_bias, allowed_token_ids, bad_words, min_tokens)
hold whenever they can be met. The original reproducer: repetition_penalty=1e-45 used to yield id == vocab_size,
which killed the engine."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM
from engine.worker.sampler import Sampler, _fallback_tokens
from engine.sampling_params import SamplingParams
from engine.core.scheduler import new_sequence_data
from engine.core.sequence import Sequence
from engine.worker.input_batch import SequenceState
from tests.engine.models_util import random_token_ids
from tests.engine.sampler_paths import sampler_path  # noqa: F401 (autouse: every test on both paths)

VOCAB = 40
EOS = 7
FLOAT32_MAX = torch.finfo(torch.float32).max

extreme_floats = st.sampled_from([0.0, 1e-45, 1e-30, 1e-6, 0.5, 1.0, 2.0, 1e6, 1e30, 1e38, 1e300])


@st.composite
def sampling_params(draw):
    temperature = draw(st.sampled_from([0.0, 1e-5, 1e-4, 0.7, 1.0, 50.0, 1e30, 1e300]))
    top_p = draw(st.sampled_from([1e-300, 1e-9, 0.01, 0.5, 0.99, 1.0]))
    top_k = draw(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, 10 ** 9]))
    min_p = draw(st.sampled_from([0.0, 1e-9, 0.3, 0.999999, 1.0]))
    repetition_penalty = draw(st.sampled_from([1e-45, 1e-38, 1e-6, 0.5, 1.0, 2.0, 1e6, 1e38, 1e300]))
    presence_penalty = draw(st.sampled_from([-2.0, 0.0, 2.0]))
    frequency_penalty = draw(st.sampled_from([-2.0, 0.0, 2.0]))
    logit_bias = draw(st.one_of(
        st.none(),
        st.just({t: 100.0 for t in range(VOCAB)}),
        st.just({t: -100.0 for t in range(VOCAB)}),
        st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-1e300, 1e300), max_size=6)))
    allowed = draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)))
    min_tokens = draw(st.sampled_from([0, 0, 5]))
    stop_token_ids = draw(st.sampled_from([None, [3], list(range(VOCAB))]))
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, logit_bias=logit_bias, allowed_token_ids=allowed,
                          min_tokens=min_tokens, max_tokens=None, stop_token_ids=stop_token_ids,
                          seed=draw(st.one_of(st.none(), st.integers(0, 2 ** 32))),
                          logprobs=draw(st.sampled_from([None, 0, 3])))


@st.composite
def logits_rows(draw):
    """One adversarial logits row: random values at a random scale, with NaN / +inf / -inf sprinkled in, or a
    whole row of one special value."""
    kind = draw(st.sampled_from(["random", "random", "nan", "posinf", "neginf", "max", "mixed_inf"]))
    seed = draw(st.integers(0, 2 ** 31))
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    row *= draw(st.sampled_from([1e-30, 1.0, 30.0, 1e30, 3e38]))
    specials = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf, "max": FLOAT32_MAX}
    if kind in specials:
        row.fill_(specials[kind])
    elif kind == "mixed_inf":
        row[seed % VOCAB] = math.inf
        row[(seed // 7) % VOCAB] = math.inf
        row[(seed // 11) % VOCAB] = -math.inf
    for index in draw(st.lists(st.integers(0, VOCAB - 1), max_size=4)):
        row[index] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return row


def make_seq(params: SamplingParams, output: list[int], bad_words: list[list[int]] = ()) -> SequenceState:
    """A sequence as the worker's sampler sees it: the core's Sequence, sent in full."""
    seq = Sequence("r", None, [1, 2, 3, 1], params, arrival_time=0.0, eos_token_ids=frozenset({EOS}))
    for t in output:
        seq.append_token(t)
    seq.bad_words_token_ids = [list(w) for w in bad_words]
    return SequenceState.from_new(new_sequence_data(seq, 0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(sampling_params(), logits_rows(), st.lists(st.integers(0, VOCAB - 1), max_size=6),
                          st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=3)),
                min_size=1, max_size=6),
       st.integers(0, 2 ** 31))
def test_every_sampled_id_is_valid_and_constraints_hold_when_possible(rows, sampler_seed):
    seqs = [make_seq(params, output, bad_words) for params, _, output, bad_words in rows]
    logits = torch.stack([row for _, row, _, _ in rows])
    out = Sampler(seed=sampler_seed)(logits.clone(), seqs)
    assert len(out.sampled_token_ids) == len(seqs)
    for (params, raw, output, bad_words), seq, token in zip(rows, seqs, out.sampled_token_ids):
        assert isinstance(token, int) and 0 <= token < VOCAB, (params, raw, token)
        # The constraints are met whenever some token satisfies all of them and has a logit above -inf.
        banned = set()
        if params.allowed_token_ids is not None:
            banned |= set(range(VOCAB)) - set(params.allowed_token_ids)
        if len(output) < params.min_tokens:
            banned |= set(seq.stop_token_ids)
        for word in bad_words:
            if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1] and len(output) >= len(word) - 1:
                banned.add(word[-1])
        biased = raw.clone()
        for t, b in (params.logit_bias or {}).items():
            biased[t] += b
        possible = [t for t in range(VOCAB) if t not in banned and not (biased[t].isnan() or biased[t] == -math.inf)]
        if possible:
            assert token not in banned, (params, raw, token, banned)
            assert token in possible
        if out.sampled_logprobs is not None and params.logprobs is not None:
            assert not math.isnan(out.sampled_logprobs[seqs.index(seq)])


def test_nan_row_falls_back_to_token_zero_and_nan_tokens_are_never_chosen():
    logits = torch.randn(3, VOCAB)
    logits[0] = math.nan
    logits[1, :] = math.nan
    logits[1, 17] = 2.0                       # the only real number: must be chosen, greedy or not
    logits[2, 5] = math.nan                   # NaN would win argmax if left in place
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    out = Sampler()(logits.clone(), [make_seq(p, []) for p in params])
    expected_row2 = logits[2].nan_to_num(nan=-math.inf).argmax().item()
    assert out.sampled_token_ids == [0, 17, expected_row2]


def test_positive_infinity_is_the_largest_finite_logit():
    logits = torch.randn(2, VOCAB)
    logits[:, 9] = math.inf
    out = Sampler()(logits.clone(), [make_seq(SamplingParams(temperature=t, seed=3), []) for t in (0.0, 1.0)])
    assert out.sampled_token_ids == [9, 9]   # all the mass is on the +inf token, not NaN


def test_fully_masked_row_falls_back_to_the_argmax_before_the_masks():
    """allowed_token_ids = [EOS] with min_tokens masking EOS leaves nothing: the fallback is the unmasked argmax."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(allowed_token_ids=[EOS], min_tokens=3, temperature=0.9, seed=2)
    bias = SamplingParams(logit_bias={11: 50.0}, allowed_token_ids=[EOS], min_tokens=3, temperature=0.0)
    out = Sampler()(logits.clone(), [make_seq(params, []), make_seq(bias, [])])
    assert out.sampled_token_ids == [logits[0].argmax().item(), 11]


def test_fallback_for_guided_row_is_the_first_token_the_grammar_allows():
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[1, 1] = 1 << 3                       # only token 32 + 3 allowed in row 1
    bitmask[0, 0] = -(1 << 31)                   # only token 31 (the sign bit) allowed in row 0
    tokens = _fallback_tokens([0, 1], mask_rows=[], unmasked=None, guided_rows=[0, 1], grammar_bitmask=bitmask,
                              vocab_size=VOCAB)
    assert tokens == [31, 35]


def test_logit_bias_is_added_to_raw_logits_before_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.0] + [-5.0] * (VOCAB - 3)])
    # Token 0 is in the prompt (repetition_penalty 2). Bias first (vLLM): (1 + 2.6) / 2 = 1.8 < 3, token 1 wins;
    # bias after the penalty would give 1 / 2 + 2.6 = 3.1 > 3.
    params = SamplingParams(temperature=0.0, logit_bias={0: 2.6}, repetition_penalty=2.0)
    seq = SequenceState.from_new(new_sequence_data(Sequence("r", None, [0], params, arrival_time=0.0), 0))
    assert Sampler()(logits.clone(), [seq]).sampled_token_ids == [1]
    seq = SequenceState.from_new(new_sequence_data(Sequence("r", None, [5], params, arrival_time=0.0), 0))
    # token 0 unpenalized: 3.6 wins
    assert Sampler()(logits.clone(), [seq]).sampled_token_ids == [0]


def test_allowed_token_ids_distribution():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(8))
    allowed = [2, 19, 33]
    n = 3000
    out = Sampler(seed=1)(logits.expand(n, VOCAB).clone(),
                          [make_seq(SamplingParams(allowed_token_ids=allowed), [])] * n)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=VOCAB).float() / n
    expected = torch.zeros(VOCAB)
    expected[allowed] = torch.softmax(logits[0, allowed], -1)
    assert (counts - expected).abs().sum() < 0.08


def test_bad_words_mask_last_token_only_after_prefix():
    logits = torch.zeros(3, VOCAB)
    logits[:, 12] = 10.0                        # the favourite, banned as the end of the word [4, 12]
    logits[:, 13] = 9.0                         # banned outright (one-token word)
    words = [[4, 12], [13]]
    params = SamplingParams(temperature=0.0)
    seqs = [make_seq(params, [1, 4], words), make_seq(params, [4, 1], words), make_seq(params, [], words)]
    out = Sampler()(logits.clone(), seqs)
    assert out.sampled_token_ids == [0, 12, 12]   # row 0: 12 and 13 banned -> first of the zeros


def test_repetition_penalty_1e45_then_normal_request(tiny_model_dir):
    """The original crash: 1 / 1e-45 overflowed to inf, the sampler returned id == vocab_size and the next
    embedding lookup killed the engine. Now the extreme requests run and a normal request afterwards gives the
    same tokens as before them."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, num_kv_blocks=32)
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": random_token_ids(12, seed=5)}
    normal = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompt, normal, use_tqdm=False)[0].outputs[0].token_ids
    for params in (SamplingParams(repetition_penalty=1e-45, max_tokens=8, ignore_eos=True, seed=0),
                   SamplingParams(repetition_penalty=1e-45, temperature=0.0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1e30, top_p=1e-300, min_p=1.0, max_tokens=4, ignore_eos=True),
                   SamplingParams(logit_bias={t: 100.0 for t in range(vocab_size)}, max_tokens=4, ignore_eos=True)):
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and all(0 <= t < vocab_size for t in out.token_ids)
    assert llm.generate(prompt, normal, use_tqdm=False)[0].outputs[0].token_ids == before
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
