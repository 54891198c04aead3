"""Hypothesis fuzz of request bodies against a tiny random-weight server: every answer is a 2xx, or a 4xx carrying
OpenAI's error JSON, never a 5xx; afterwards /health is 200 and an ordinary request is served.

Bodies mix valid values with wrong types, huge and tiny numbers, NaN/Infinity (Python's JSON writes them), lone
surrogates, nested junk and unknown fields, for every field either endpoint knows; they are sent as raw bytes so
that what the server sees is exactly what was drawn."""
import collections
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
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
    STATUS_COUNTS[response.status_code] += 1
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
STATUS_COUNTS: collections.Counter = collections.Counter()


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


def test_engine_alive_after_fuzz(server):
    """Runs after the fuzz tests of this module (pytest keeps file order)."""
    assert server.http.get("/health").status_code == 200
    response = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                                         "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    block_manager = server.engine.engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    # The fuzz reached generation, not only the validators.
    assert STATUS_COUNTS[200] >= 10 and STATUS_COUNTS[400] >= 10, STATUS_COUNTS
