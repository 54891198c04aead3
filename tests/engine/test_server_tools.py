"""Tool calling, structured outputs and reasoning_content on SmolLM2 through the official openai client (and
langchain-openai where installed), over loopback HTTP.

SmolLM2's own chat template ignores `tools`, so the server runs with a Hermes-style template (--chat-template)
that lists them as Qwen2/3's templates do. A 135M model does not call tools on its own reliably, so the tests
force its output through the grammar: tool_choice "required" and a named tool (the server's guided JSON schema),
and for "auto" a guided_regex that makes the model write a Hermes `<tool_call>` block for the parser to find.
Every structured output is parsed and validated against its schema."""
import json
import re
from typing import Literal

import pytest

from tests.extras import require_serve_extra, require_xgrammar  # noqa: E402

openai, jsonschema = require_serve_extra("openai", "jsonschema")
require_xgrammar()

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

MODEL = "smollm2"
TIMEOUT_S = 300
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call functions. Their signatures are inside <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
To call a function, answer with <tool_call>{"name": <name>, "arguments": <arguments object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                "is_capital": {"type": "boolean"}},
               "required": ["city", "is_capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smollm2_dir):
    engine = AsyncLLMEngine.from_args(smollm2_dir, dtype="float32", num_kv_blocks=128, max_model_len=1024)
    app = build_app(engine, served_model_names=[MODEL], chat_template=TOOL_TEMPLATE, enable_auto_tool_choice=True,
                    tool_call_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def _check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def _stream_tool_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls assembled from streamed deltas as OpenAI's SDKs do (id/name first, arguments appended)."""
    calls: dict[int, dict] = {}
    finish_reason, content, order = None, "", []
    for chunk in stream:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and call["arguments"] == "", "id and name come first"
                    call["id"], call["name"] = delta.id, delta.function.name
                    order.append("header")
                if delta.function and delta.function.arguments:
                    assert call["id"] is not None
                    call["arguments"] += delta.function.arguments
    return calls, finish_reason, content


def test_required_tool_choice(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=60, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    calls, finish_reason, _ = _stream_tool_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=0,
        stream=True))
    assert finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_named_tool_choice_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice=named,
                                           max_tokens=40, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    arguments = _check_call(call, WEATHER)
    calls, finish_reason, content = _stream_tool_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice=named, max_tokens=40, temperature=0,
        stream=True))
    assert finish_reason == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == arguments
    # The conversation goes on with the call and its result (arguments as JSON text, as clients send them).
    follow_up = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_named_tool_choice_cut_short_is_the_same_call_streamed_and_not(client):
    # max_tokens ends the arguments mid-way: a call with what was generated and finish_reason "length", whether
    # streamed or not (as vLLM and OpenAI answer), not the arguments moved into content.
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice=named, max_tokens=4, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    calls, finish_reason, content = _stream_tool_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish_reason == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_openai_parse_helpers(client):
    # The openai client's structured-output helpers: a pydantic model as response_format (strict json_schema),
    # parsed; the same through .stream; and as a strict function tool. Fields of a closed set keep the greedy
    # output short whatever the model's taste.
    from pydantic import BaseModel

    class Capital(BaseModel):
        city: Literal["Paris", "London", "Berlin"]
        certain: bool

    messages = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    choice = client.chat.completions.parse(response_format=Capital, **kwargs).choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Capital)
    assert Capital.model_validate_json(choice.message.content) == choice.message.parsed
    with client.chat.completions.stream(response_format=Capital, **kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.message.parsed == choice.message.parsed and streamed.message.content == choice.message.content
    reply = client.chat.completions.parse(tools=[openai.pydantic_function_tool(Capital)], tool_choice="required",
                                          **kwargs).choices[0]
    (call,) = reply.message.tool_calls
    assert call.function.name == "Capital" and isinstance(call.function.parsed_arguments, Capital)


def test_auto_tool_choice_parses_hermes_tool_calls(client):
    regex = r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", ' \
            r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>'
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0,
                  extra_body={"guided_regex": regex})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    arguments = _check_call(call, WEATHER)
    assert choice.finish_reason == "tool_calls"
    calls, finish_reason, content = _stream_tool_calls(client.chat.completions.create(stream=True, **kwargs))
    assert content == "Checking.\n" and finish_reason == "tool_calls"
    assert json.loads(calls[0]["arguments"]) == arguments and calls[0]["name"] == "get_weather"


def test_structured_outputs_parse_and_validate(client):
    messages = [{"role": "user", "content": "Name the capital of France."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    reply = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY_SCHEMA, "strict": True}}, **kwargs)
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY_SCHEMA)
    reply = client.chat.completions.create(extra_body={"guided_json": CITY_SCHEMA}, **kwargs)
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY_SCHEMA)
    reply = client.chat.completions.create(response_format={"type": "json_object"}, **{**kwargs, "max_tokens": 60})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:   # cut by max_tokens: still the start of an object
        assert reply.choices[0].message.content.lstrip().startswith("{")
    reply = client.chat.completions.create(extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]}, **kwargs)
    assert reply.choices[0].message.content in ("Paris", "Lyon", "Nice")
    reply = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower opened:", max_tokens=12,
                                      temperature=0, extra_body={"guided_regex": r"1[0-9]{3}"})
    assert re.fullmatch(r"1[0-9]{3}", reply.choices[0].text)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    reply = client.completions.create(model=MODEL, prompt="Is Paris in France?", max_tokens=12, temperature=0,
                                      extra_body={"guided_grammar": grammar})
    assert reply.choices[0].text in ("The answer is yes.", "The answer is no.")
    # n > 1 and streaming keep the grammar per sequence.
    reply = client.chat.completions.create(n=2, seed=3, extra_body={"guided_json": CITY_SCHEMA},
                                           **{**kwargs, "temperature": 1.0})
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        stream=True, extra_body={"guided_json": CITY_SCHEMA}, **kwargs) if chunk.choices)
    jsonschema.validate(json.loads(text), CITY_SCHEMA)


def test_reasoning_content(client):
    regex = r"<think>[a-z ]{3,20}</think>[A-Z][a-z ]{1,12}"
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=30, temperature=0,
                  extra_body={"guided_regex": regex})
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    raw = client.completions.create(model=MODEL, prompt="x", max_tokens=1)   # the server still answers
    assert raw.choices
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{3,20}", reasoning) and re.fullmatch(r"[A-Z][a-z ]{0,12}", message.content)
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
    # Without <think> in the output there is no reasoning.
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=5, temperature=0)
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


def test_langchain_bind_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Current weather of a city."""
        city: str = Field(max_length=20, description="the city")

    class City(BaseModel):
        name: str = Field(max_length=16)
        is_capital: bool

    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0,
                                       max_tokens=40, max_retries=0, timeout=TIMEOUT_S)
    message = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"])
    city = chat.with_structured_output(City).invoke("Name the capital of France.")
    assert isinstance(city, City) and city.name
    city = chat.with_structured_output(City, method="function_calling").invoke("Name the capital of France.")
    assert isinstance(city, City)


def test_chat_logprobs_join_to_the_content_across_partial_utf8_and_stop_strings(client):
    """Emoji and accented letters are several byte-level tokens each, and a stop string is cut from the text:
    the logprob tokens still join to exactly message.content, streamed or not."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say something about summer."}],
                  max_tokens=40, temperature=0, logprobs=True, top_logprobs=2, stop=["st tr"],
                  extra_body={"guided_regex": "🌞🎉 L'été à Paris, c'est très beau"})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    # The stop string spans tokens ("est", " tr..."): the first of them is partly content, partly cut.
    assert choice.message.content == "🌞🎉 L'été à Paris, c'e" and choice.finish_reason == "stop"
    tokens = [item.token for item in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content
    assert len(tokens) == reply.usage.completion_tokens > len(choice.message.content.encode()) // 4
    assert any(token == "" for token in tokens)   # a token ending inside a character adds nothing by itself
    for item in choice.logprobs.content:
        assert item.bytes == list(item.token.encode())
    streamed_tokens, streamed_text = [], ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for streamed in chunk.choices:
            streamed_text += streamed.delta.content or ""
            streamed_tokens += [item.token for item in (streamed.logprobs.content if streamed.logprobs else [])]
    assert streamed_text == choice.message.content and "".join(streamed_tokens) == streamed_text


def test_readme_server_example_runs(server, capsys):
    """README's server example, pointed at this loopback server."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Server"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    block = block.replace("http://127.0.0.1:8000/v1", server.url + "/v1").replace("SmolLM2-135M-Instruct", MODEL)
    namespace: dict = {}
    exec(compile(block, "README.md[server example]", "exec"), namespace)
    assert "city" in json.loads(namespace["reply"].choices[0].message.content)
    assert capsys.readouterr().out
