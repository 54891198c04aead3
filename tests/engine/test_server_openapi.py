"""The server judged against its own OpenAPI document (/openapi.json) by schemathesis, a client nobody here wrote:
its `st run` command with every check (one left out on the generation routes and /tokenize, for the reason
test_schemathesis_finds_nothing gives), against a tiny random-weight model behind an API key. Then the findings it
made once, each pinned by a plain request: a 405's Allow header, a 500 for a non-string model on /tokenize and
/detokenize, tool-call arguments, type or id of the wrong type accepted, 2.0 refused as an integer; and real answers
and stream events checked against the document's schemas."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.extras import require, require_serve_extra

httpx, jsonschema = require_serve_extra("httpx", "jsonschema")
require("schemathesis", "the OpenAPI conformance client")

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

MODEL = "tiny"
API_KEY = "openapi-test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # The model's generation_config.json caps what a request leaves unset at 4 new tokens (its max_new_tokens, which
    # a served model may have): schemathesis' valid requests then cost a few decode steps each, not a context's worth.
    model_dir = tmp_path_factory.mktemp("tiny-qwen3-short") / "model"
    shutil.copytree(tiny_model_dir("qwen3"), model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 4}))
    engine = AsyncLLMEngine.from_args(str(model_dir), num_kv_blocks=32, max_model_len=64)
    app = build_app(engine, served_model_names=[MODEL], api_key=API_KEY, enable_auto_tool_choice=True,
                    tool_call_parser="hermes")
    with ServerThread(app) as server:
        server.tokenizer = engine.tokenizer
        with httpx.Client(base_url=server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as http:
            server.http = http
            yield server


# Routes whose bodies the model bounds beyond what a schema can say (see test_schemathesis_finds_nothing).
MODEL_BOUNDED_ROUTES = "^/(v1/(chat/)?completions|tokenize)$"


def _schemathesis(server, tmp_path, *options: str) -> str:
    """`st run` on the server's document with every check but those `options` leave out; its output."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", "--checks", "all",
               "--max-examples", "20", "--generation-deterministic", "--workers", "1", "--request-timeout", "60",
               "--output-sanitize", "false", "--header", f"Authorization: Bearer {API_KEY}", *options]
    # cwd: its example database goes to the test's directory, not the checkout.
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                            env={**os.environ, "NO_COLOR": "1"})
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    return result.stdout


@pytest.mark.slow
def test_schemathesis_finds_nothing(server, tmp_path):
    # Every check on every route: no 5xx; only documented statuses, content types and headers; responses that
    # match their documented schemas; schema-invalid bodies refused; a 405 that names the allowed methods.
    # One exception: on the generation routes and /tokenize a body can fit the schema and still be refused for
    # what the model and the server are, not for its shape (a prompt plus max_tokens past the context length,
    # messages whose characters together pass the context's bound, a token id past the vocabulary, a chat
    # template from the request without --trust-request-chat-template), or for SamplingParams' cross-field rules
    # (min_tokens <= max_tokens, tool_choice with tools): positive_data_acceptance is left out there. (Where a
    # single field carries such a bound, the served document says it: /detokenize's token ids and count,
    # /tokenize's prompt length, max_tokens and truncate_prompt_tokens.)
    output = _schemathesis(server, tmp_path, "--exclude-path-regex", MODEL_BOUNDED_ROUTES)
    assert "Tested: 6" in output, output[-3000:]   # every other route of the document was reached
    output = _schemathesis(server, tmp_path, "--include-path-regex", MODEL_BOUNDED_ROUTES,
                           "--exclude-checks", "positive_data_acceptance")
    assert "Tested: 3" in output, output[-3000:]


def test_the_document_describes_every_answer(server):
    document = server.http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
                 "DetokenizeRequest", "ErrorResponse", "CompletionResponse", "ChatCompletionResponse", "ModelList"):
        assert name in schemas, name
    assert "HTTPValidationError" not in schemas   # FastAPI's 422: this server answers 400 instead
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses and "200" in responses, (method, path)
            for status in ("500", "503") if path == "/health" else ("401", "500", "503"):
                assert responses[status]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
            if method == "post":
                assert operation["requestBody"]["required"] and "400" in responses, path
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert "content" not in document["paths"]["/health"]["get"]["responses"]["200"]   # an empty body
    assert set(document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]) == {
        "application/json", "text/event-stream"}
    # The model's bounds on single fields: the vocabulary on /detokenize's token ids, the context on max_tokens.
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == len(server.tokenizer) - 1
    for name, field in [("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens"),
                        ("ChatCompletionRequest", "truncate_prompt_tokens")]:
        assert schemas[name]["properties"][field]["anyOf"][0]["maximum"] == 64, (name, field)


def test_a_405_names_the_allowed_methods(server):
    response = server.http.request("TRACE", "/v1/models")
    assert response.status_code == 405 and response.headers["allow"] == "GET"
    assert response.json()["error"]["type"] == "api_error"
    response = server.http.delete("/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": {}, "prompt": "hi"}, "model"),
    ("/tokenize", {"model": [1], "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/detokenize", {"model": {}, "tokens": [1]}, "model"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []},
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": None,
                                 "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "messages"),
])
def test_wrong_types_are_400s_naming_the_field(server, path, body, param):
    response = server.http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_integer_may_come_as_a_number_without_a_fraction(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3.0, "n": 2.0, "temperature": 0, "logprobs": 1.0}
    response = server.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    assert response.json()["usage"]["completion_tokens"] == 6
    for value in (2.5, "2", True):
        response = server.http.post("/v1/completions", json={**body, "n": value})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", value


def _conforms(document: dict, instance, schema_name: str) -> None:
    jsonschema.validate(instance, {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]})


@pytest.mark.parametrize("path, body, response_name, chunk_name", [
    ("/v1/completions", {"prompt": ["hello", "the sky"], "echo": True}, "CompletionResponse", "CompletionChunk"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "top_logprobs": 2,
                              "logprobs": True}, "ChatCompletionResponse", "ChatCompletionChunk"),
])
def test_answers_and_stream_events_match_their_documented_schemas(server, path, body, response_name, chunk_name):
    """Every answer of a generation route, and every event of its stream, is what the document says (what
    schemathesis checks too, here on requests that surely reach generation and streaming)."""
    document = server.http.get("/openapi.json").json()
    body = {**body, "model": MODEL, "max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 1, "ignore_eos": True}
    if path == "/v1/completions":
        body["logprobs"] = 2
    response = server.http.post(path, json=body)
    assert response.status_code == 200, response.text
    _conforms(document, response.json(), response_name)
    events = []
    with server.http.stream("POST", path, json={**body, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]" and len(events) > 3
    for event in events[:-1]:
        _conforms(document, json.loads(event), chunk_name)
    usage = json.loads(events[-2])   # the last event before [DONE]: the usage, no choices
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")   # the prefix cache may differ: not compared
    assert usage["choices"] == [] and [usage["usage"][k] for k in counts] == [response.json()["usage"][k]
                                                                              for k in counts]
    error = server.http.post(path, json={**body, "n": 0})
    assert error.status_code == 400
    _conforms(document, error.json(), "ErrorResponse")


def test_an_earlier_tool_call_may_have_a_null_id(server):
    """Clients that replay an assistant turn whose tool call had no id send "id": null (langchain can); taken as
    absent, as the document says. A wrong-typed id is the 400 above."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    response = server.http.post("/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    response = server.http.post("/tokenize", json={"messages": [messages[0], {**messages[1], "tool_calls": [
        {**messages[1]["tool_calls"][0], "id": 7}]}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
