"""Hypothesis fuzz of request bodies against a tiny random-weight server, two kinds:

- junk: bodies mix valid values with wrong types, huge and tiny numbers, NaN/Infinity (Python's JSON writes them),
  lone surrogates, nested junk and unknown fields, for every field either endpoint knows; they are sent as raw
  bytes so that what the server sees is exactly what was drawn. Every answer is a 2xx, or a 4xx carrying OpenAI's
  error JSON, never a 5xx.
- valid: every field drawn only from values the API takes (right types, in range, token ids in the vocabulary,
  prompts that fit the context with the output budget, one structured output at a time). Every body is a 200 with
  generated tokens for every choice, so the fuzz reaches generation by construction.

Afterwards /health is 200, an ordinary request is served and every KV block is free again. What holds must not
depend on which examples hypothesis draws (that changes with its version, which the dev extra pins)."""
import importlib.util
import json
import os

import pytest

from tests.extras import require_serve_extra  # noqa: E402

httpx, hypothesis = require_serve_extra("httpx", "hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 64
TIMEOUT_S = 60

junk_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([0, 1, -1, 2, 20, 21, 63, 64, 65, 2 ** 31, 2 ** 63, 2 ** 64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-45, 1e-30, 1e-8, 0.5, 1.0, 2.0, 100.0, 1e30, 3.4e38, -0.0, -1e-45]),
    st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "NaN", "Infinity", "2", "yes", "true", "", "tiny"]))
junk = st.recursive(junk_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(min_value=-2, max_value=600), st.booleans()), min_size=0, max_size=6)
small_int = st.one_of(st.integers(min_value=-3, max_value=40), junk_scalars)
unit_float = st.one_of(st.floats(min_value=-1, max_value=3, allow_nan=False), junk_scalars)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), junk),
                                 "content": st.one_of(st.text(max_size=20), junk)})
tool = st.one_of(junk, st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["f", "get_x"]), st.text(max_size=5)),
     "parameters": st.one_of(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}), junk)})}))

COMMON = {
    "model": st.one_of(st.just(MODEL), junk), "n": small_int, "temperature": unit_float, "top_p": unit_float,
    "top_k": small_int, "min_p": unit_float, "seed": st.one_of(st.integers(), junk_scalars),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), junk),
    "stream": st.one_of(st.booleans(), junk_scalars), "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "presence_penalty": unit_float, "frequency_penalty": unit_float, "repetition_penalty": unit_float,
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-5, 600).map(str), st.text(max_size=4)),
                                            st.one_of(st.floats(-200, 200), junk_scalars), max_size=3), junk),
    "ignore_eos": st.one_of(st.booleans(), junk_scalars), "min_tokens": small_int, "stop_token_ids": token_ids,
    "allowed_token_ids": st.one_of(token_ids, junk), "bad_words": st.one_of(st.lists(st.text(max_size=4),
                                                                                     max_size=3), junk),
    "truncate_prompt_tokens": small_int, "prompt_logprobs": small_int, "skip_special_tokens": junk_scalars,
    "include_stop_str_in_output": junk_scalars,
    "response_format": st.one_of(st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                                  {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                                      "type": "object"}}}]), junk),
    "guided_regex": st.one_of(st.sampled_from(["[ab]{1,3}", "(", "a*", ""]), junk),
    "guided_choice": st.one_of(st.lists(st.text(min_size=1, max_size=3), max_size=3), junk),
    "guided_json": st.one_of(st.just({"type": "object"}), junk),
}
COMPLETION = {**COMMON, "prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=8), max_size=3),
                                            token_ids, st.lists(token_ids, max_size=2), junk),
              "max_tokens": small_int, "logprobs": small_int, "echo": junk_scalars, "suffix": junk_scalars}
CHAT = {**COMMON, "messages": st.one_of(st.lists(message, min_size=0, max_size=3), junk),
        "max_tokens": small_int, "max_completion_tokens": small_int, "logprobs": junk_scalars,
        "top_logprobs": small_int, "tools": st.one_of(st.lists(tool, max_size=2), junk),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required",
                                                  {"type": "function", "function": {"name": "f"}}]), junk),
        "chat_template_kwargs": junk, "chat_template": st.one_of(st.none(), st.text(max_size=10)),
        "add_generation_prompt": junk_scalars, "continue_final_message": junk_scalars}


def bodies(fields: dict):
    """A dict with a random subset of `fields` (each value drawn from its strategy) plus random extra keys."""
    chosen = st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields))
    return chosen.flatmap(lambda names: st.fixed_dictionaries({name: fields[name] for name in names})).flatmap(
        lambda body: st.dictionaries(st.text(max_size=8), junk, max_size=2).map(lambda extra: {**extra, **body}))


def _with_small_budget(body: dict) -> dict:
    """Keep generation short: a fuzz run is about the checks, not the tokens."""
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 8:
            body[key] = 8
    body.setdefault("max_tokens", 4)
    return body


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = AsyncLLMEngine.from_args(tiny_model_dir("qwen3"), num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)
    app = build_app(engine, served_model_names=[MODEL], enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(app) as server:
        server.engine = engine
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
            server.http = http
            yield server


def _check(server, path: str, body) -> None:
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    with server.http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
        payload = response.read()
    assert response.status_code < 500, (path, body, payload[:500])
    if response.status_code >= 400:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], payload
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            # In-band errors are for engine failures only; a fuzzed body must not cause one.
            assert "error" not in json.loads(event), (body, event)
    else:
        json.loads(payload)


# ENGINE_FUZZ_EXAMPLES=2000 explores further (and randomly); CI runs a fixed sample.
NUM_EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "75"))
FUZZ = settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                derandomize="ENGINE_FUZZ_EXAMPLES" not in os.environ, database=None)


@FUZZ
@given(body=bodies(COMPLETION).map(_with_small_budget))
def test_fuzz_completions(server, body):
    _check(server, "/v1/completions", body)


@FUZZ
@given(body=bodies(CHAT).map(_with_small_budget))
def test_fuzz_chat_completions(server, body):
    _check(server, "/v1/chat/completions", body)


@FUZZ
@given(body=st.one_of(junk, bodies({"prompt": COMPLETION["prompt"], "messages": CHAT["messages"],
                                    "tokens": token_ids, "add_special_tokens": junk_scalars})))
def test_fuzz_tokenize_detokenize(server, body):
    for path in ("/tokenize", "/detokenize"):
        _check(server, path, body)


# -- valid bodies: every one must be generated --------------------------------------------------------------------
# Sizes are bounded so that every prompt fits the context with its output budget: a character is at most 4 UTF-8
# bytes, and the byte-level tokenizer makes at most one token per byte. Completions: a text prompt of <= 12
# characters is <= 48 tokens, a token prompt <= 24 ids, plus <= 8 new tokens <= 64. Chat: <= 2 messages of <= 3
# characters, each <= 10 template tokens (the "system" role) + 12, plus 6 for the generation prompt and 8 new
# tokens = 58 <= 64 (the ChatML template of models_util.py renders neither tools nor kwargs).
VOCAB_SIZE = 512
MAX_NEW_TOKENS = 8
valid_id = st.integers(min_value=0, max_value=VOCAB_SIZE - 1)
valid_ids = st.lists(valid_id, min_size=1, max_size=6)
nonblank = st.text(min_size=1, max_size=4).filter(str.strip)
probability = st.floats(min_value=0.0, max_value=1.0)
tool_name = st.from_regex(r"[A-Za-z0-9_.\-]{1,12}", fullmatch=True)
valid_tool = st.builds(lambda name, parameters: {"type": "function", "function": {"name": name, **parameters}},
                       tool_name, st.sampled_from([{}, {"parameters": {"type": "object", "properties": {
                           "a": {"type": "integer"}}}}, {"description": "d", "parameters": {"type": "object"}}]))
# Structured outputs (and tool_choice "required" or a named tool) need xgrammar, a main dependency that images
# installing the package without its dependencies lack; without it the valid bodies are the unstructured ones.
HAVE_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
UNSTRUCTURED = st.sampled_from([{}, {"response_format": {"type": "text"}}])
# At most one structured output per request (a second one is a 400: "one structured output at a time").
GUIDED = UNSTRUCTURED if not HAVE_XGRAMMAR else st.one_of(
    UNSTRUCTURED,
    st.just({"response_format": {"type": "json_object"}}),
    st.just({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}}),
    st.builds(lambda schema: {"guided_json": schema},
              st.sampled_from([{"type": "object"}, {"type": "array", "items": {"type": "integer"}},
                               '{"type": "string"}'])),
    st.builds(lambda regex: {"guided_regex": regex}, st.sampled_from(["[ab]{1,3}", "a*", r"\d+", "(yes|no)"])),
    # (a NUL in a choice is refused: test_guided_choice_with_nul_is_refused)
    st.builds(lambda choice: {"guided_choice": choice}, st.lists(
        st.text(st.characters(exclude_characters="\x00"), min_size=1, max_size=3), min_size=1, max_size=3)),
    st.just({"guided_grammar": 'root ::= "yes" | "no"'}))
VALID_COMMON = {
    "model": st.sampled_from([MODEL, None]), "n": st.integers(1, 2), "temperature": st.one_of(
        st.floats(min_value=0.0, max_value=2.0), st.integers(0, 2), st.none()),
    "top_p": st.one_of(probability, st.none()), "top_k": st.one_of(st.integers(-1, VOCAB_SIZE + 10), st.none()),
    "min_p": st.one_of(probability, st.none()), "seed": st.one_of(st.integers(-(2 ** 63), 2 ** 63 - 1), st.none()),
    "stop": st.one_of(st.none(), nonblank, st.lists(nonblank, max_size=3)),
    "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(min_value=0.0, max_value=3.0, exclude_min=True),
    "logit_bias": st.dictionaries(valid_id.map(str), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(valid_id, max_size=3),
    "allowed_token_ids": valid_ids, "bad_words": st.lists(nonblank, max_size=3),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "truncate_prompt_tokens": st.integers(1, MAX_MODEL_LEN), "prompt_logprobs": st.integers(0, 20),
    "user": st.text(max_size=4), "metadata": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    "store": st.booleans(), "service_tier": st.just("auto"), "use_beam_search": st.just(False),
    "length_penalty": st.just(1.0),
}
VALID_COMPLETION = {**VALID_COMMON, "logprobs": st.integers(0, 20), "echo": st.booleans(), "suffix": st.just("")}
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)})
# (content null is OpenAI's for an assistant message with tool_calls only: a 400 otherwise)
valid_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "tool"]),
    "content": st.one_of(st.text(max_size=3), st.lists(text_part, min_size=1, max_size=1))})
VALID_CHAT = {**VALID_COMMON, "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
              "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}]),
              "parallel_tool_calls": st.booleans(), "modalities": st.just(["text"])}


def _valid_fields(fields: dict):
    chosen = st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields))
    return chosen.flatmap(lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))


@st.composite
def valid_completion_bodies(draw):
    body = draw(_valid_fields(VALID_COMPLETION)) | draw(GUIDED)
    body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=12), st.lists(st.text(min_size=1, max_size=12),
                                                                              min_size=1, max_size=2),
                                    st.lists(valid_id, min_size=1, max_size=24),
                                    st.lists(st.lists(valid_id, min_size=1, max_size=24), min_size=1, max_size=2)))
    return _valid_budget_and_stream(draw, body, "max_tokens")


@st.composite
def valid_chat_bodies(draw):
    body = draw(_valid_fields(VALID_CHAT))
    body["messages"] = draw(st.lists(valid_message, min_size=1, max_size=2))
    tools = draw(st.lists(valid_tool, max_size=2))
    choices = ["none", "auto", None] + (["required", "named"] if tools and HAVE_XGRAMMAR else [])
    tool_choice = draw(st.sampled_from(choices))
    if tools:
        body["tools"] = tools
    if tool_choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": draw(st.sampled_from(tools))["function"][
            "name"]}}
    elif tool_choice is not None:
        body["tool_choice"] = tool_choice
    if tool_choice not in ("required", "named"):   # those are a structured output of their own
        body |= draw(GUIDED)
    if draw(st.booleans()):
        body["logprobs"] = True
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 20))
    else:
        body["logprobs"] = False
    return _valid_budget_and_stream(draw, body, draw(st.sampled_from(["max_tokens", "max_completion_tokens"])))


def _valid_budget_and_stream(draw, body: dict, budget_field: str) -> dict:
    body[budget_field] = draw(st.integers(1, MAX_NEW_TOKENS))
    body["min_tokens"] = draw(st.integers(0, body[budget_field]))
    body["stream"] = draw(st.booleans())
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if body["stream"] and body.get("prompt_logprobs"):   # a 400 with stream, as vLLM's (0 streams)
        body["stream"] = False
        body.pop("stream_options", None)
    if "best_of" not in body and draw(st.booleans()):
        body["best_of"] = body.get("n", 1)
    return body


def _check_generated(server, path: str, body: dict, num_choices: int) -> None:
    """A valid body is a 200 whose every choice generated 1..budget tokens and finished."""
    budget = body.get("max_tokens") or body.get("max_completion_tokens")
    with server.http.stream("POST", path, json=body) as response:
        payload = response.read()
    assert response.status_code == 200, (path, body, payload[:500])
    if not body["stream"]:
        result = json.loads(payload)
        finish_reasons = {choice["index"]: choice["finish_reason"] for choice in result["choices"]}
        usage = result["usage"]
    else:
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (body, events[-3:])
        finish_reasons, usage = {}, None
        for event in map(json.loads, events[:-1]):
            assert "error" not in event, (body, event)
            for choice in event["choices"]:
                if choice.get("finish_reason") is not None:
                    finish_reasons[choice["index"]] = choice["finish_reason"]
            usage = event.get("usage") or usage
        assert (usage is not None) == body.get("stream_options", {}).get("include_usage", False), (body, usage)
    assert sorted(finish_reasons) == list(range(num_choices)), (body, finish_reasons)
    assert set(finish_reasons.values()) <= {"stop", "length", "tool_calls"}, (body, finish_reasons)
    if usage is not None:
        assert num_choices <= usage["completion_tokens"] <= num_choices * budget, (body, usage)


@FUZZ
@given(body=valid_completion_bodies())
def test_fuzz_valid_completions_generate(server, body):
    prompt = body["prompt"]
    num_prompts = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
    _check_generated(server, "/v1/completions", body, num_prompts * body.get("n", 1))


@FUZZ
@given(body=valid_chat_bodies())
def test_fuzz_valid_chat_completions_generate(server, body):
    _check_generated(server, "/v1/chat/completions", body, body.get("n", 1))


def test_engine_alive_after_fuzz(server):
    """Runs after the fuzz tests of this module (pytest keeps file order)."""
    assert server.http.get("/health").status_code == 200
    response = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                                         "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    block_manager = server.engine.engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
