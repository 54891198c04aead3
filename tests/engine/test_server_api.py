"""The OpenAI surface beyond plain generation, over loopback HTTP with the official openai client and raw httpx:
strict request types and error `param`s, lone surrogates, refused fields, echo + prompt logprobs with
max_tokens=0, top_p=0, logit_bias / allowed_token_ids / bad_words / truncate_prompt_tokens against LLM on the same
weights, the extra endpoints, vLLM metric names, sampling defaults from generation_config.json, chat-template
rules and the tokenizer pool, and a failing engine step that fails only its requests."""
import asyncio
import json
import re
import shutil
import time

import pytest

from tests.extras import require_serve_extra  # noqa: E402

openai, httpx = require_serve_extra("openai", "httpx")

from engine import LLM, SamplingParams  # noqa: E402
from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from engine.entrypoints.openai.serving import MAX_CHARS_PER_TOKEN  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 64
PROMPT = "Once upon a time there was"
TIMEOUT_S = 60
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                     "{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN)
    with ServerThread(build_app(engine, served_model_names=[MODEL], chat_template=THINKING_TEMPLATE)) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT_S, **kwargs)


def check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
STRICT_ERRORS = [
    ("/v1/completions", {**CMPL, "n": "2"}, "n"),
    ("/v1/completions", {**CMPL, "stream": "yes"}, "stream"),
    ("/v1/completions", {**CMPL, "prompt": [True, 5]}, "prompt"),
    ("/v1/completions", {**CMPL, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {**CMPL, "seed": 2 ** 70}, "seed"),
    ("/v1/completions", {**CMPL, "seed": "1"}, "seed"),
    ("/v1/completions", {**CMPL, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**CMPL, "logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ("/v1/completions", {**CMPL, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {**CMPL, "suffix": "tail"}, "suffix"),
    ("/v1/completions", {**CMPL, "best_of": 3}, "best_of"),
    ("/v1/completions", {**CMPL, "stop_token_ids": [False]}, "stop_token_ids"),
    ("/v1/completions", {**CMPL, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {**CMPL, "guided_regex": "(", "max_tokens": 2}, "guided_regex"),
    ("/v1/completions", {**CMPL, "guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10 ** 6}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", STRICT_ERRORS, ids=[p for _, _, p in STRICT_ERRORS])
def test_wrong_types_and_unsupported_fields_are_400s_naming_the_field(server, path, body, param):
    check_error(post(server, path, body), 400, param)


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}',
    b'{"model": "tiny", "prompt": ["ok", "a\\udfffb"], "max_tokens": 2}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "hi", "stop": ["\\udc00"], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}',        # not UTF-8 at all
    b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",   # deeper than the JSON parser goes
], ids=["prompt", "prompt-list", "message", "stop", "bad-utf8", "deep"])
def test_invalid_unicode_and_bodies_are_400_json(server, raw):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = post(server, path, raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    if b"\\u" in raw:
        expected = "messages" if b"messages" in raw else ("stop" if b"stop" in raw else "prompt")
        assert response.json()["error"]["param"] == expected
    assert post(server, "/v1/completions", CMPL).status_code == 200


def test_echo_with_prompt_logprobs_and_max_tokens_zero(client, llm):
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2),
                             use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = got.choices[0]
    assert choice.text == PROMPT and got.usage.completion_tokens == 0
    logprobs = choice.logprobs
    num_prompt_tokens = len(reference.prompt_token_ids)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_prompt_tokens == got.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, num_prompt_tokens):
        entry = reference.prompt_logprobs[position]
        token_id = reference.prompt_token_ids[position]
        assert logprobs.token_logprobs[position] == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert logprobs.tokens[position] == entry[token_id].decoded_token
        assert max(logprobs.top_logprobs[position].values()) == pytest.approx(
            max(lp.logprob for lp in entry.values()), abs=1e-5)
    assert "".join(logprobs.tokens) == PROMPT
    # With a completion: the prompt, then the completion, in text and in logprobs.
    completion = llm.generate(PROMPT, greedy(3), use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == PROMPT + completion
    assert len(got.choices[0].logprobs.tokens) == num_prompt_tokens + 3
    assert got.choices[0].logprobs.text_offset[num_prompt_tokens] == len(PROMPT)
    # Echo without logprobs, streamed: the prompt comes first.
    text = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert text == PROMPT + completion


def test_sampling_fields_match_llm(client, llm, server):
    tokenizer = llm.get_tokenizer()
    words = [t for t in range(len(tokenizer)) if len(tokenizer.decode([t]).strip()) > 1
             and tokenizer.decode([t]).strip().isalpha()]
    # top_p=0 is greedy (vLLM), even at temperature 1.
    reference = llm.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == reference.text
    # logit_bias +100 forces a token that greedy decoding would not pick.
    forced = next(t for t in words if t not in reference.token_ids)
    expected = llm.generate(PROMPT, greedy(4, logit_bias={forced: 100.0}), use_tqdm=False)[0].outputs[0]
    assert expected.token_ids == [forced] * 4
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text
    # allowed_token_ids and bad_words: as LLM does with the same SamplingParams, and unlike plain greedy.
    allowed = [t for t in words if t not in reference.token_ids][:3]
    for extra in ({"allowed_token_ids": allowed}, {"bad_words": [reference.text.split()[0]]}):
        expected = llm.generate(PROMPT, greedy(6, **extra), use_tqdm=False)[0].outputs[0]
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, **extra})
        assert got.choices[0].text == expected.text and expected.text != reference.text[:len(expected.text)], extra
    assert set(llm.generate(PROMPT, greedy(6, allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0].token_ids
               ) <= set(allowed)
    # truncate_prompt_tokens keeps the last k prompt tokens.
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    expected = llm.generate({"prompt_token_ids": prompt_ids[-3:]}, greedy(5), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3})
    assert got.usage.prompt_tokens == 3 and got.choices[0].text == expected.text


def test_chat_logprobs_join_to_the_content(client):
    for max_tokens, stop in ((12, None), (16, None)):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
                                               logprobs=True, top_logprobs=1, stop=stop)
        choice = reply.choices[0]
        assert "".join(item.token for item in choice.logprobs.content) == choice.message.content
        assert len(choice.logprobs.content) == reply.usage.completion_tokens


def test_endpoints(server, client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("nope")
    assert error.value.body["param"] == "model"
    assert httpx.get(server.url + "/version", timeout=TIMEOUT_S).json()["version"]
    # The OpenAPI document describes the request bodies (schema-driven clients and fuzzers read it).
    document = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT_S).json()
    schemas = document["components"]["schemas"]
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"messages", "tools", "response_format"} <= set(schemas["ChatCompletionRequest"]["properties"])
    refs = re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(document))
    assert refs and set(refs) <= set(schemas)
    tokens = post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    check_error(post(server, "/detokenize", {"tokens": [True]}), 400, "tokens")
    check_error(post(server, "/tokenize", {"prompt": 5}), 400, "prompt")
    # /tokenize with messages renders the chat template, with its variables (chat_template_kwargs).
    messages = [{"role": "user", "content": "hi"}]
    thinking = post(server, "/tokenize", {"messages": messages}).json()
    no_thinking = post(server, "/tokenize", {"messages": messages,
                                             "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert no_thinking["count"] > thinking["count"]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.usage.prompt_tokens == no_thinking["count"]


def test_vllm_metric_names(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert re.search(rf'^{name}{{model_name="{MODEL}"}} \S+$', text, re.M), name
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        count = re.search(rf'^{name}_count{{model_name="{MODEL}"}} (\S+)$', text, re.M)
        assert count and float(count.group(1)) >= 1, name
    assert re.search(rf'^vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} (\S+)$',
                     text, re.M)
    assert float(re.search(r'^vllm:generation_tokens_total\{.*\} (\S+)$', text, re.M).group(1)) >= 2


def test_oversized_prompt_is_refused_before_tokenizing(server, monkeypatch):
    engine = server.engine
    calls = []
    real_encode = engine._encode
    monkeypatch.setattr(engine, "_encode", lambda text, *a: calls.append(len(text)) or real_encode(text, *a))
    huge = "x" * (MAX_CHARS_PER_TOKEN * MAX_MODEL_LEN + 1)
    error = check_error(post(server, "/v1/completions", {**CMPL, "prompt": huge}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    check_error(post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}),
                400, "messages")
    assert calls == []
    # A body far past any prompt this server takes is refused unread.
    from engine.entrypoints.openai.api_server import max_body_bytes
    response = post(server, "/v1/completions", b'{"prompt": "' + b"x" * max_body_bytes(MAX_MODEL_LEN) + b'"}')
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_slow_tokenization_does_not_hold_up_other_requests(server, monkeypatch):
    """Tokenization runs on a pool of threads: while one request's prompt takes seconds to tokenize (made slow
    here, as a huge prompt is), a small request is tokenized, generated and answered."""
    engine, slow_s = server.engine, 3.0
    real_encode = engine._encode

    def encode(text, *args):
        if text.startswith("SLOW"):
            time.sleep(slow_s)
        return real_encode(text, *args)

    monkeypatch.setattr(engine, "_encode", encode)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as http:
            start = time.perf_counter()
            slow = asyncio.create_task(http.post("/v1/completions", json={**CMPL, "prompt": "SLOW " + PROMPT}))
            await asyncio.sleep(0.2)   # the slow one holds a tokenizer thread now
            small = await http.post("/v1/completions", json={**CMPL, "prompt": PROMPT})
            small_s = time.perf_counter() - start
            assert not slow.done()
            return small, small_s, await slow

    small, small_s, slow = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert small.status_code == 200 and slow.status_code == 200
    assert small_s < slow_s, small_s


def test_request_chat_template_only_when_trusted(model_dir):
    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    app = build_app(engine, served_model_names=[MODEL], trust_request_chat_template=True)
    with ServerThread(app) as server:
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        body = {**CHAT, "messages": [{"role": "user", "content": PROMPT}], "chat_template": template}
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == post(server, "/tokenize", {"prompt": PROMPT}).json()[
            "count"] - (1 if engine.tokenizer.bos_token_id is not None and engine.tokenizer.encode("a")[0]
                        == engine.tokenizer.bos_token_id else 0)


def test_unset_fields_take_generation_config_defaults(model_dir, tmp_path):
    """A model whose generation_config.json says top_k=1 samples greedily when the request leaves top_k unset,
    and as asked when the request sets it."""
    directory = tmp_path / "model"
    shutil.copytree(model_dir, directory)
    config_path = directory / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update({"top_k": 1, "max_new_tokens": 5})
    config_path.write_text(json.dumps(config))
    reference = LLM(model_dir, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN, generation_config="vllm")
    greedy_text = reference.generate(PROMPT, greedy(5), use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLMEngine.from_args(str(directory), num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    with ServerThread(build_app(engine, served_model_names=[MODEL])) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        texts = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=None, temperature=1.0, seed=seed,
                                           extra_body={"ignore_eos": True}).choices[0].text for seed in range(3)}
        assert texts == {greedy_text}   # top_k=1 and max_tokens=5 from the file
        sampled = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=seed,
                                             extra_body={"ignore_eos": True, "top_k": 0}).choices[0].text
                   for seed in range(3)}
        assert len(sampled) > 1


def test_a_failing_step_fails_only_its_requests(server, client, monkeypatch):
    """The model raising in a step: the requests in that step get a 500 (in-band for a stream), the engine is
    not dead (/health 200) and the next request is served."""
    runner = server.engine.engine.model_runner
    real_execute, calls = runner.execute_model, []
    fail_on = {0, 2}   # the first request's first step; the stream's second step (after its first token)

    def failing_execute(*args, **kwargs):
        calls.append(1)
        if len(calls) - 1 in fail_on:
            raise RuntimeError("injected failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", failing_execute)
    response = post(server, "/v1/completions", {**CMPL, "prompt": PROMPT})
    assert response.status_code == 500, response.text
    assert response.json()["error"]["type"] == "internal_server_error"
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**CHAT, "stream": True, "max_tokens": 5, "ignore_eos": True}, timeout=TIMEOUT_S) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events
    assert len(calls) == 3
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.parametrize("extreme", [{"repetition_penalty": 1e-45}, {"repetition_penalty": 3e38},
                                     {"temperature": 1e-30}, {"temperature": 1e30}, {"min_p": 1.0, "top_p": 1e-30},
                                     {"presence_penalty": 2, "frequency_penalty": -2}])
def test_extreme_sampling_values_never_kill_the_engine(server, client, extreme):
    response = post(server, "/v1/completions", {**CMPL, "prompt": PROMPT, "max_tokens": 4, **extreme})
    assert response.status_code in (200, 400), response.text
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
