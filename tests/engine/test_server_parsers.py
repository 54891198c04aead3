"""Tool-call and reasoning parsers on fixed model outputs, whole and fed in random pieces (as a stream): the
content streamed so far is always a prefix of the final content, and the final split equals the whole-text one."""
import json
import random

import pytest

from engine.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from engine.entrypoints.openai.tool_parsers import (get_tool_parser, parse_required_tool_calls,
                                                   required_tools_schema)
from tests.extras import require, require_serve_extra

HERMES_CASES = [
    # (output, expected content, expected [(name, arguments)] or None)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": [1, 2], "y": "<tool_call>"}}\n</tool_call>', "Let me check.\n",
     [("a", {}), ("b", {"x": [1, 2], "y": "<tool_call>"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>', "", [("f", {"k": 1})]),
    ('<tool_call>{"name": "unclosed", "arguments": {"a": 1}}', "", [("unclosed", {"a": 1})]),
    ("No tools here, just < and <tool text.", "No tools here, just < and <tool text.", None),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", None),
    ('a <tool_call>{"arguments": {}}</tool_call>', 'a <tool_call>{"arguments": {}}</tool_call>', None),
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", {"n": 1}), ("b", {})]),
    ("  The weather is nice.", "  The weather is nice.", None),
    ('{"not": "a call"}', '{"not": "a call"}', None),
    ('{"name": "f", "parameters": {"a": 1}} trailing words', '{"name": "f", "parameters": {"a": 1}} trailing words',
     None),
]
REASONING_CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "reasoning without the opening tag</think>answer", "reasoning without the opening tag", "answer"),
    ("deepseek_r1", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "never closed", "never closed", ""),
]


def _calls(calls):
    return None if calls is None else [(c.name, json.loads(c.arguments)) for c in calls]


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name,cases", [("hermes", HERMES_CASES), ("llama3_json", LLAMA_CASES)])
def test_tool_parsers(name, cases):
    parser, rng = get_tool_parser(name), random.Random(0)
    for text, content, calls in cases:
        got_content, got_calls = parser.split(text, True)
        assert (got_content, _calls(got_calls)) == (content, calls), text
        if got_calls:
            assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_")
                                                                             for c in got_calls)
        for _ in range(5):   # streamed: every partial content is a prefix of the final one
            so_far = ""
            for piece in _pieces(text, rng):
                so_far += piece
                partial, partial_calls = parser.split(so_far, False)
                assert content.startswith(partial) and partial_calls is None, (text, so_far, partial)


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning_parsers(name, text, reasoning, content):
    parser, rng = get_reasoning_parser(name), random.Random(1)
    assert parser.split(text, True) == (reasoning, content)
    for _ in range(5):
        so_far = ""
        for piece in _pieces(text, rng):
            so_far += piece
            partial_reasoning, partial_content = parser.split(so_far, False)
            assert (reasoning or "").startswith(partial_reasoning or ""), (so_far, partial_reasoning)
            assert content.startswith(partial_content), (so_far, partial_content)


def test_required_tool_schema_and_its_parse():
    require_serve_extra()   # the request models (pydantic)
    jsonschema = require("jsonschema")
    from engine.entrypoints.openai.protocol import ChatTool

    tools = [ChatTool.model_validate({"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}}),
             ChatTool.model_validate({"type": "function", "function": {"name": "now"}})]
    schema = required_tools_schema(tools)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert _calls(parse_required_tool_calls(json.dumps(good))) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert parse_required_tool_calls("[]") is None and parse_required_tool_calls("{") is None
    assert required_tools_schema(tools, parallel=False)["maxItems"] == 1


def test_non_finite_logprobs_become_valid_json():
    """A model row without a finite value gives -inf (or NaN) logprobs; responses and stream events carry
    vLLM's -9999.0 instead, since JSON has no infinities (json.dumps would write -Infinity, which clients reject)."""
    require_serve_extra()
    from engine.entrypoints.openai.serving import NON_FINITE_LOGPROB, _sse, json_safe

    body = {"choices": [{"logprobs": {"token_logprobs": [-0.5, float("-inf"), float("nan")],
                                      "top_logprobs": [{"a": float("-inf")}]}, "index": 0}], "n": 2}
    safe = json_safe(body)
    assert safe["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, NON_FINITE_LOGPROB, NON_FINITE_LOGPROB]
    assert safe["choices"][0]["logprobs"]["top_logprobs"] == [{"a": NON_FINITE_LOGPROB}] and safe["n"] == 2
    event = _sse(body)
    assert json.loads(event.removeprefix("data: ")) == safe
