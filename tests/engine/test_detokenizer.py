"""Incremental detokenizer: equals a full decode, emits multi-byte characters whole, decodes bounded windows,
honours skip_special_tokens; stop strings found across token boundaries and cut."""
import pytest

from engine.core.output_processor import Detokenizer, check_stop_strings
from engine.sampling_params import SamplingParams
from engine.core.output_processor import _Completion
from tests.engine.models_util import make_tokenizer

TEXTS = [
    "Hello 東京は日本の首都です。 Emoji: 🙂🚀 done.",
    "Die Katze schläft auf dem Sofa. Le café est très chaud.",
    "def main():\n    print(\"hello, world\")\n",
]


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def tokenizer(request):
    if request.param == "tiny":
        return make_tokenizer()
    from engine.tokenizer import get_tokenizer
    return get_tokenizer(request.getfixturevalue("smollm2_dir"))


def completion(prompt_ids, params: SamplingParams) -> _Completion:
    """A completion as the output processor detokenizes it."""
    return _Completion(params, prompt_ids)


def append(seq: _Completion, token_id: int) -> None:
    seq.token_ids.append(token_id)
    seq.output_token_ids.append(token_id)


def stream(detok: Detokenizer, prompt_ids, output_ids, params=None):
    seq = completion(prompt_ids, params or SamplingParams())
    deltas = []
    for t in output_ids:
        append(seq, t)
        before = seq.output_text
        detok.update(seq)
        deltas.append(seq.output_text[len(before):])
    return seq, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_chars_come_out_whole(tokenizer, text):
    detok = Detokenizer(tokenizer)
    prompt_ids = tokenizer.encode("Translate: ", add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    seq, deltas = stream(detok, prompt_ids, output_ids)
    assert seq.output_text == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)
    if any("\ufffd" in tokenizer.decode([t]) for t in output_ids):
        # Some character really was split across tokens: it was held back for at least one step.
        assert "" in deltas


def test_split_characters_occur(tokenizer):
    # Guards the test above: the emoji and CJK text really are split across tokens by both tokenizers.
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokenizer.encode(TEXTS[0], add_special_tokens=False))


def test_decodes_bounded_windows_not_the_whole_output(tokenizer):
    detok = Detokenizer(tokenizer)
    lengths = []
    decode = detok.decode
    detok.decode = lambda ids, skip=True: lengths.append(len(ids)) or decode(ids, skip)
    output_ids = tokenizer.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    assert len(output_ids) > 100
    stream(detok, [5, 6, 7], output_ids)
    assert max(lengths) <= 12


def test_skip_special_tokens(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = encode("Hi there") + [special] + encode(" more")
    skipped, _ = stream(Detokenizer(tokenizer), [5], ids, SamplingParams(skip_special_tokens=True))
    kept, _ = stream(Detokenizer(tokenizer), [5], ids, SamplingParams(skip_special_tokens=False))
    assert skipped.output_text == "Hi there more"
    assert kept.output_text == "Hi there<|im_end|> more"


def seq_with_text(text, **params):
    seq = completion([1], SamplingParams(**params))
    seq.output_text = text
    return seq


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include):
    detok = Detokenizer(tokenizer)
    text = "The answer is 42. ###END### ignored tail"
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    seq = completion([5], SamplingParams(stop=["###END###", "never"], include_stop_str_in_output=include))
    matched_at = None
    for i, t in enumerate(output_ids):
        append(seq, t)
        if check_stop_strings(seq, detok.update(seq)):
            matched_at = i
            break
    assert matched_at is not None and matched_at < len(output_ids) - 1
    # The stop string spans more than one token here, so the tail window was needed to see it.
    assert len(tokenizer.encode("###END###", add_special_tokens=False)) > 1
    assert seq.output_text == ("The answer is 42. ###END###" if include else "The answer is 42. ")


def test_stop_string_only_searched_in_new_text_plus_tail():
    seq = seq_with_text("abcSTOPxyz", stop="STOP")
    assert check_stop_strings(seq, 2) is None   # "yz" new: the old match is not re-found
    seq = seq_with_text("abcSTOP", stop="STOP")
    assert check_stop_strings(seq, 1) == "STOP" and seq.output_text == "abc"


def test_earliest_of_several_stop_strings_wins():
    seq = seq_with_text("one two three", stop=["three", "two"])
    assert check_stop_strings(seq, 13) == "two" and seq.output_text == "one "
