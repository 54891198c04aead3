"""SamplingParams validation: every field rejects bad values with a ValueError naming it; normalizations."""
import pytest

from engine import SamplingParams
from engine.sampling_params import GuidedDecodingParams

BAD = [
    ("n", 0), ("n", 1.0), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1),
    ("seed", 1.5), ("seed", "x"), ("max_tokens", -1), ("max_tokens", 2.0), ("min_tokens", -1),
    ("stop", 5), ("stop", [""]), ("stop", ["ok", 3]), ("stop_token_ids", 3), ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]), ("include_stop_str_in_output", 1), ("ignore_eos", "yes"), ("logprobs", -1),
    ("logprobs", 2.0), ("presence_penalty", 2.5), ("presence_penalty", float("inf")), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("skip_special_tokens", None),
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", {3: float("nan")}),
    ("logit_bias", {3: "big"}), ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 5),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", ["ok", 3]), ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", 1.5), ("guided_decoding", "json"), ("guided_decoding", {}),
    ("guided_decoding", {"regex": "a", "choice": ["a"]}), ("guided_decoding", {"json": "{not json"}),
    ("guided_decoding", {"choice": []}), ("guided_decoding", {"regex": ""}), ("guided_decoding", {"json_object": 1}),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_invalid_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_messages_start_with_the_field_name():
    """The OpenAI server reports the first word of the message as the offending parameter."""
    for field, value in BAD:
        with pytest.raises(ValueError) as info:
            SamplingParams(**{field: value})
        assert str(info.value).split()[0] == field, (field, value, str(info.value))


def test_max_tokens_zero_is_valid_but_min_tokens_still_bounded():
    assert SamplingParams(max_tokens=0).max_tokens == 0
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)


def test_logit_bias_clamped_to_openai_range_and_json_keys_accepted():
    params = SamplingParams(logit_bias={"7": 250.0, 3: -1e30, 5: 0.5})
    assert params.logit_bias == {7: 100.0, 3: -100.0, 5: 0.5}


def test_guided_decoding_needs_exactly_one_kind():
    assert SamplingParams(guided_decoding={"choice": ("a", "b")}).guided_decoding == GuidedDecodingParams(choice=["a", "b"])
    assert GuidedDecodingParams(json='{"type": "object"}').kind == "json"
    assert GuidedDecodingParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="^guided_decoding must set exactly one"):
        GuidedDecodingParams(regex="a+", grammar='root ::= "a"')


def test_n_must_be_positive():
    assert SamplingParams(n=3).n == 3
    with pytest.raises(ValueError, match=r"n must be >= 1"):
        SamplingParams(n=0)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_normalizations():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == 0
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert greedy.greedy and (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(stop=["a", "abcd"]).max_stop_str_len == 4


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens, p.logprobs) == \
        (1, 1.0, 1.0, 0, 0.0, 16, 0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
