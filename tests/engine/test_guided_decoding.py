"""Structured outputs with xgrammar on SmolLM2: JSON schema, json_object, regex, choice and EBNF outputs obey
their grammar, batched next to unguided requests, with n=2, under preemption (recompute and swap: the same
tokens as without it), with constraints that conflict with the grammar, and bad specs are rejected up front."""
import json
import re

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.sampling_params import GuidedDecodingParams

from tests.extras import require, require_xgrammar  # noqa: E402

require_xgrammar()
jsonschema = require("jsonschema", "schema validation of the outputs")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pets": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
PHONE = r"\d{3}-\d{3}-\d{4}"
CHOICES = ["yes", "no", "it depends"]
NUMBER_LIST = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'


def chat(llm: LLM, text: str) -> dict:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return {"prompt_token_ids": tokenizer.encode(prompt, add_special_tokens=False)}


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=96)


def guided_requests(llm: LLM) -> list[tuple[dict, SamplingParams]]:
    return [
        (chat(llm, "Describe Alice, 31, who has a cat, as JSON."),
         SamplingParams(temperature=0.0, max_tokens=64, guided_decoding=GuidedDecodingParams(json=PERSON))),
        (chat(llm, "Give me any JSON object about the weather."),
         SamplingParams(temperature=0.0, max_tokens=64, guided_decoding=GuidedDecodingParams(json_object=True))),
        (chat(llm, "What is the phone number of the office?"),
         SamplingParams(temperature=0.7, seed=1, max_tokens=24, guided_decoding=GuidedDecodingParams(regex=PHONE))),
        (chat(llm, "Is the sky green?"),
         SamplingParams(temperature=0.0, max_tokens=16, guided_decoding=GuidedDecodingParams(choice=CHOICES))),
        (chat(llm, "List some small numbers."),
         SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=32,
                        guided_decoding=GuidedDecodingParams(grammar=NUMBER_LIST))),
        (chat(llm, "Tell me a story."), SamplingParams(temperature=0.0, max_tokens=12)),
    ]


def check_guided_outputs(outputs) -> None:
    person, any_object, phone, choice, numbers, unguided = outputs
    jsonschema.validate(json.loads(person.outputs[0].text), PERSON)
    assert isinstance(json.loads(any_object.outputs[0].text), dict)
    assert re.fullmatch(PHONE, phone.outputs[0].text)
    assert choice.outputs[0].text in CHOICES
    assert len(numbers.outputs) == 2
    for completion in numbers.outputs:
        assert re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", completion.text), completion.text
    for out in (person, any_object, phone, choice, numbers):
        assert all(c.finish_reason == "stop" for c in out.outputs), [c.finish_reason for c in out.outputs]
    assert unguided.outputs[0].finish_reason == "length" and len(unguided.outputs[0].token_ids) == 12


@pytest.fixture(scope="module")
def batch_outputs(llm):
    requests = guided_requests(llm)
    return llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)


def test_guided_batch_with_unguided_request(llm, batch_outputs):
    requests, outputs = guided_requests(llm), batch_outputs
    check_guided_outputs(outputs)
    # The unguided request is unaffected by its guided neighbours: same tokens alone.
    alone = llm.generate(requests[-1][0], requests[-1][1], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[-1].outputs[0].token_ids
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_guided_requests_survive_preemption(llm, smollm2_dir, batch_outputs, mode):
    """A 6-block cache cannot hold both requests: one is preempted mid-output, and since the grammar state
    follows the kept output tokens, both finish with the same (greedy and seeded) tokens as without preemption."""
    picked = [0, 2]   # the JSON schema and the (seeded) regex requests
    requests = [guided_requests(llm)[i] for i in picked]
    small = LLM(smollm2_dir, dtype="float32", max_model_len=96, num_kv_blocks=6, preemption_mode=mode,
                swap_space=1 / 32)
    outputs = small.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [batch_outputs[i].outputs[0].token_ids for i in picked]


def test_grammar_wins_over_conflicting_constraints(llm):
    """allowed_token_ids that the choice grammar never allows leave a row with nothing to sample: the sampler
    falls back to the best token the grammar allows, so the output is still one of the choices."""
    tokenizer = llm.get_tokenizer()
    unrelated = tokenizer.encode(" banana", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=unrelated,
                            guided_decoding=GuidedDecodingParams(choice=CHOICES))
    out = llm.generate(chat(llm, "Is the sky green?"), params, use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


@pytest.mark.parametrize("spec", [dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
                                  dict(regex="(unclosed"), dict(grammar="root ::= ")])
def test_bad_spec_is_rejected_before_queueing(llm, spec):
    engine: LLMEngine = llm.llm_engine
    with pytest.raises(ValueError, match=r"^guided_decoding "):
        engine.add_request("bad", "hello", SamplingParams(guided_decoding=GuidedDecodingParams(**spec)))
    assert not engine.requests and not engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_spec(llm):
    guided = llm.llm_engine._guided_decoding()
    first = guided.compile(GuidedDecodingParams(json=json.dumps(PERSON)))
    # The same schema as a dict (same key order) is the same grammar.
    assert guided.compile(GuidedDecodingParams(json=PERSON)) is first
    assert guided.compile(GuidedDecodingParams(regex=PHONE)) is not first


def test_json_schema_keys_come_in_the_schemas_order(llm):
    """The grammar is compiled from the schema as given: its properties' order is the output's key order (a
    canonical sorted dump made {"zeta", "alpha"} come out alpha first)."""
    tokenizer = llm.get_tokenizer()
    guided = llm.llm_engine._guided_decoding()
    schemas = [{"type": "object", "properties": {name: {"type": "integer"} for name in names},
                "required": list(names), "additionalProperties": False}
               for names in (("zeta", "alpha"), ("alpha", "zeta"))]
    for schema, (good, bad) in zip(schemas, (('{"zeta": 1, "alpha": 2}', '{"alpha": 2, "zeta": 1}'),
                                             ('{"alpha": 2, "zeta": 1}', '{"zeta": 1, "alpha": 2}'))):
        def accepts(text: str) -> bool:
            state = guided.new_state(GuidedDecodingParams(json=schema))
            return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert accepts(good) and not accepts(bad)


def test_unpack_bitmask_matches_xgrammar_kernel():
    """The sampler's fallback reads allowed tokens with unpack_bitmask: it must agree with xgrammar's own masking
    (bit 31 included, an odd vocabulary size, a subset of rows)."""
    import torch
    import xgrammar

    from engine.worker.sampler import unpack_bitmask

    vocab_size, generator = 101, torch.Generator().manual_seed(5)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, (vocab_size + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, vocab_size, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size, indices=[0, 2, 3])
    allowed = unpack_bitmask(bitmask, vocab_size)
    got = logits.clone()
    got[[0, 2, 3]] = got[[0, 2, 3]].masked_fill(~allowed[[0, 2, 3]], float("-inf"))
    assert torch.equal(got, expected) and not allowed.all() and allowed.any()


def test_choices_with_control_characters_are_generated_as_given(llm):
    """Choice strings go into the grammar as EBNF literals: quotes, backslashes and control characters escaped (a
    raw control character broke the grammar's parse: a 400 for a valid request); a NUL, which the grammar compiler
    reads as the literal's end, is refused by name."""
    choices = ['say "\\x01"\x01', "tab\there\x1f"]
    params = SamplingParams(temperature=0.0, max_tokens=24, guided_decoding=GuidedDecodingParams(choice=choices))
    out = llm.generate(chat(llm, "Pick one."), params, use_tqdm=False)[0].outputs[0]
    assert out.text in choices and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="cannot contain NUL"):
        GuidedDecodingParams(choice=["a\x00b"])
