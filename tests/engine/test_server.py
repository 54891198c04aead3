"""The OpenAI-compatible server, driven over loopback HTTP with the official `openai` client (sync and async).

A tiny random-weight Llama (max_model_len 128) serves most tests, with LLM.generate on the same weights as
the reference; SmolLM2 checks a real chat (EOS stops, streamed == non-streamed)."""
import asyncio
import json
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.extras import require_serve_extra  # noqa: E402

openai, httpx = require_serve_extra("openai", "httpx")

from engine import LLM, SamplingParams  # noqa: E402
from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 64
PROMPTS = ["Once upon a time", "The quick brown fox jumps over", "def main():\n    print(", "Numbers: 0 1 2 3"]
TIMEOUT_S = 60


def _n_supported() -> bool:
    try:
        SamplingParams(n=2)
        return True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN)
    with ServerThread(build_app(engine, served_model_names=[MODEL])) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def wait_idle(server, timeout_s: float = 10.0) -> None:
    """Poll /metrics until nothing runs, waits or is swapped out; then every KV block must be free."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
        counts = [float(re.search(rf"^engine_num_requests_{state} (\S+)$", text, re.M).group(1))
                  for state in ("running", "waiting", "swapped")]
        if counts == [0, 0, 0]:
            break
        assert time.monotonic() < deadline, f"still (running, waiting, swapped) = {counts}"
        time.sleep(0.05)
    block_manager = server.engine.engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert "engine_kv_cache_usage_ratio 0.0" in httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT_S, **kwargs)


# -- basics -----------------------------------------------------------------------------------------------------
def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    long_prompt = " ".join(PROMPTS)   # several full KV blocks: the second request hits the prefix cache
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    assert float(re.search(r"^engine_prefix_cache_hit_ratio (\S+)$", text, re.M).group(1)) > 0
    assert float(re.search(r"^engine_prompt_tokens_total (\S+)$", text, re.M).group(1)) > 0
    for name in ("engine_num_requests_running", "engine_num_requests_waiting", "engine_kv_cache_usage_ratio",
                 "engine_prefix_cache_hit_ratio"):
        assert re.search(rf"^{name} \S+$", text, re.M), name
    for name in ("engine_time_to_first_token_seconds", "engine_time_per_output_token_seconds"):
        assert float(re.search(rf"^{name}_count (\S+)$", text, re.M).group(1)) >= 1, name
        assert f"# TYPE {name} histogram" in text


def test_greedy_completions_equal_llm_generate(client, llm):
    expected = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    single = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == expected[0].outputs[0].text
    assert single.choices[0].finish_reason == "length"
    assert single.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert single.usage.completion_tokens == 10
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == [o.outputs[0].text for o in expected]
    assert batch.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + 10 * len(PROMPTS)
    # Token-id prompts are accepted as they are.
    by_ids = client.completions.create(model=MODEL, prompt=expected[1].prompt_token_ids, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected[1].outputs[0].text


def test_extra_sampling_fields_match_llm(client, llm):
    fields = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3, min_tokens=3)
    expected = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=12, **fields),
                            use_tqdm=False)[0].outputs[0]
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0, presence_penalty=0.5,
        frequency_penalty=1.5, extra_body={"repetition_penalty": 1.3, "min_tokens": 3})
    assert got.choices[0].text == expected.text
    # top_k=1 and min_p=1 keep only the most likely token: sampling at temperature 1 is then greedy.
    reference = llm.generate(PROMPTS[2], greedy(8), use_tqdm=False)[0].outputs[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0,
                                        extra_body={"ignore_eos": True, **extra})
        assert got.choices[0].text == reference, extra


def test_logprobs_equal_llm(client, llm):
    expected = llm.generate(PROMPTS[1], greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == 6
    for token_id, entry, token, token_logprob, top in zip(expected.token_ids, expected.logprobs, got.tokens,
                                                          got.token_logprobs, got.top_logprobs):
        assert token == entry[token_id].decoded_token
        assert token_logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        # Keyed by decoded text, so tokens that decode alike (partial UTF-8 bytes) share one key.
        top_expected = {}
        for lp in sorted(entry.values(), key=lambda lp: lp.rank):
            if lp.rank <= 3:
                top_expected.setdefault(lp.decoded_token, lp.logprob)
        assert top == pytest.approx(top_expected, abs=1e-5)
        assert max(top.values()) == pytest.approx(token_logprob, abs=1e-5)   # greedy: the sampled one is rank 1
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)

    messages = [{"role": "user", "content": PROMPTS[1]}]
    expected = llm.chat(messages, greedy(5, logprobs=2), use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for token_id, entry, item in zip(expected.token_ids, expected.logprobs, content):
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            sorted((lp.logprob for lp in entry.values() if lp.rank <= 2), reverse=True), abs=1e-5)
        assert item.bytes == list(item.token.encode())


# -- streaming, stop, seed, n -----------------------------------------------------------------------------------
def _stream_chat(client, **kwargs) -> tuple[str, str, object]:
    text, finish_reason, usage = "", None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason, usage


def test_streamed_chat_equals_non_streamed_and_llm_chat(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    expected = llm.chat(messages, greedy(16), use_tqdm=False)[0].outputs[0].text
    kwargs = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == expected and full.choices[0].message.role == "assistant"
    text, finish_reason, usage = _stream_chat(client, **kwargs)
    assert (text, finish_reason) == (expected, full.choices[0].finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)
    # The second request found the first one's full prompt blocks in the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens == (full.usage.prompt_tokens // 16) * 16 > 0


def _stream_completion_chunks(client, **kwargs) -> tuple[list[str], str | None]:
    chunks, finish_reason = [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        chunks.append(chunk.choices[0].text)
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return chunks, finish_reason


def test_stop_strings_cut_the_text_streamed_or_not(client, llm):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    chunks, _ = _stream_completion_chunks(client, **kwargs)
    reference = "".join(chunks)
    assert reference == llm.generate(PROMPTS[0], greedy(24), use_tqdm=False)[0].outputs[0].text
    # A stop string spanning two tokens: its first character streams before the match completes unless the
    # server holds it back.
    boundaries = [sum(map(len, chunks[:i])) for i in range(2, len(chunks))]
    stop = next(reference[b - 1:b + 1] for b in boundaries
                if 0 < b < len(reference) and reference.index(reference[b - 1:b + 1]) == b - 1)
    expected = reference[:reference.index(stop)]
    got = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert (got.text, got.finish_reason) == (expected, "stop")
    chunks, finish_reason = _stream_completion_chunks(client, stop=stop, **kwargs)
    assert ("".join(chunks), finish_reason) == (expected, "stop")


def test_seed_reproduces_sampling(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_n_choices(server, client):
    if _n_supported():
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=5,
                                        extra_body={"ignore_eos": True})
        assert sorted(c.index for c in got.choices) == [0, 1, 2]
        assert got.usage.completion_tokens == 24
        again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3,
                                          seed=5, extra_body={"ignore_eos": True})
        assert [c.text for c in again.choices] == [c.text for c in got.choices]
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert [c.index for c in chat.choices] == [0, 1]
        assert chat.choices[0].message.content == chat.choices[1].message.content   # greedy
    else:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, n=2)
        assert error.value.body["param"] == "n" and "n > 1" in error.value.body["message"]
    wait_idle(server)


# -- errors -----------------------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", ', 400, None),   # malformed JSON
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 2.0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [100000]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 200}, 400, "prompt"),          # over the context
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": MAX_MODEL_LEN}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
]


def _check_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{s}-{p}" for i, (_, _, s, p) in enumerate(BAD_REQUESTS)])
def test_errors_are_openai_json(server, path, body, status, param):
    _check_error(post(server, path, body), status, param)


def test_context_errors_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=4)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=500)
    assert "maximum context length is 128" in error.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_bad_requests_do_not_disturb_requests_in_flight(server, llm):
    expected = llm.generate(PROMPTS[3], greedy(40), use_tqdm=False)[0].outputs[0].text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT_S) as client:
            async def good():
                text = ""
                async for chunk in await client.completions.create(
                        model=MODEL, prompt=PROMPTS[3], max_tokens=40, temperature=0, stream=True,
                        extra_body={"ignore_eos": True}):
                    text += chunk.choices[0].text
                return text

            async def bad():
                async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                    for path, body, status, param in BAD_REQUESTS:
                        content = body if isinstance(body, str) else json.dumps(body)
                        response = await http.post(server.url + path, content=content,
                                                   headers={"content-type": "application/json"})
                        _check_error(response, status, param)

            text, _ = await asyncio.gather(good(), bad())
            return text

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT_S)) == expected
    wait_idle(server)


def test_api_key(model_dir):
    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    with ServerThread(build_app(engine, served_model_names=[MODEL], api_key="sekret")) as server:
        for key in ("wrong", None):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            response = httpx.get(server.url + "/v1/models", headers=headers, timeout=TIMEOUT_S)
            _check_error(response, 401, None)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model=MODEL, prompt="hi", max_tokens=2)
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0, timeout=TIMEOUT_S)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200   # no key needed


def test_on_ready_comes_once_the_start_up_is_done(model_dir):
    """`serve` announces its address from on_ready: by then the engine runs and the chat-template workers have
    imported their renderer (before, the announcement came first and the first requests queued behind the
    start-up or shared two cores with the workers' imports: 0.1-3.4 s for a 0.068 s completion)."""
    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    seen = []

    def on_ready():
        sandbox = engine.chat_template_sandbox
        seen.append((len(sandbox._idle), all(worker.ready for worker in sandbox._idle)))
    with ServerThread(build_app(engine, served_model_names=[MODEL], on_ready=on_ready)) as server:
        assert seen == [(engine.chat_template_sandbox.num_workers, True)]
        reply = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)\
            .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("listener", ["serve", "ServerThread"])
def test_accepted_connections_have_nodelay(listener):
    """asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP; the listening sockets were made
    with proto 0, so a response's body, written after its headers, waited for the client's delayed ACK: 40-45 ms
    on every request of a kept-alive connection."""
    import socket

    from engine.entrypoints.openai.api_server import _listen_socket

    if listener == "serve":
        sock = _listen_socket("127.0.0.1", 0, reuse_port=False)
    else:
        sock = ServerThread(None).sock   # never started: only its socket is used

    async def main() -> int:
        accepted = asyncio.get_running_loop().create_future()

        async def on_connection(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
        server = await asyncio.start_server(on_connection, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        value = await asyncio.wait_for(accepted, TIMEOUT_S)
        writer.close()
        server.close()
        return value
    try:
        assert asyncio.run(main()) != 0
    finally:
        sock.close()


# -- load and disconnects ---------------------------------------------------------------------------------------
def test_many_concurrent_streams_all_complete(server, llm):
    num_streams, max_tokens = 36, 8
    expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy(max_tokens),
                                                                            use_tqdm=False))}

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT_S) as client:
            async def one(i):
                prompt, text, usage = PROMPTS[i % len(PROMPTS)], "", None
                if i % 2:
                    stream = await client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                    async for chunk in stream:
                        usage = chunk.usage or usage
                        text += chunk.choices[0].text if chunk.choices else ""
                else:
                    response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                               temperature=0, extra_body={"ignore_eos": True})
                    text, usage = response.choices[0].text, response.usage
                return prompt, text, usage

            return await asyncio.gather(*(one(i) for i in range(num_streams)))

    results = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert len(results) == num_streams
    for prompt, text, usage in results:
        assert text == expected[prompt]
        assert usage.completion_tokens == max_tokens
    wait_idle(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_disconnect_mid_stream_frees_everything(server, path, monkeypatch):
    core = server.engine.engine
    aborted = []

    def recording_abort(request_id):
        output = type(core).abort_request(core, request_id)
        aborted.append((request_id, output))
        return output

    monkeypatch.setattr(core, "abort_request", recording_abort)
    body = {"model": MODEL, "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
    body.update({"prompt": PROMPTS[0]} if "chat" not in path else
                {"messages": [{"role": "user", "content": PROMPTS[0]}]})
    with httpx.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", server.url + path, json=body) as response:
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 3:
                    break   # leave mid-stream: the connection closes with the context
    assert "[DONE]" not in "".join(lines)
    wait_idle(server)
    # The request was aborted while still running (not left to finish its 100 tokens).
    assert len(aborted) == 1 and aborted[0][1] is not None
    assert aborted[0][1].outputs[0].finish_reason == "abort" and len(aborted[0][1].outputs[0].token_ids) < 100


def test_client_leaving_a_non_streamed_request_aborts_it(server, monkeypatch):
    core = server.engine.engine
    real_step, aborted = core.step, []

    running = threading.Event()

    def slow_step():   # 100 tokens take >= 2 s: the client leaves long before
        time.sleep(0.02)
        outputs = real_step()
        if core.get_num_unfinished_requests():
            running.set()
        return outputs

    def recording_abort(request_id):
        output = type(core).abort_request(core, request_id)
        aborted.append(output)
        return output

    monkeypatch.setattr(core, "step", slow_step)
    monkeypatch.setattr(core, "abort_request", recording_abort)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    # A raw connection the client closes once the engine runs its request (a client timeout raced a slow machine:
    # one that fires before the request reaches the engine leaves nothing to abort).
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert running.wait(TIMEOUT_S)
    wait_idle(server)
    assert len(aborted) == 1 and aborted[0] is not None
    assert aborted[0].outputs[0].finish_reason == "abort" and len(aborted[0].outputs[0].token_ids) < 100


# -- the CLI ----------------------------------------------------------------------------------------------------
def _self_signed_certificate(directory: Path) -> tuple[str, str] | None:
    """(key file, certificate file) for 127.0.0.1, made by the openssl command; None without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=TIMEOUT_S)
    return str(key), str(cert)


def test_cli_serve_subprocess(model_dir, tmp_path):
    """`python -m engine serve` serves its options (HTTPS with --ssl-keyfile/--ssl-certfile where the openssl command
    can make a certificate for the test, else HTTP); Ctrl-C (SIGINT) shuts it down cleanly: the app's shutdown
    (which stops the engine) completes, no traceback, exit status 0 (as the uvicorn command)."""
    tls = _self_signed_certificate(tmp_path)
    command = [sys.executable, "-m", "engine", "serve", model_dir, "--port", "0",
               "--served-model-name", "tiny-cli", "--api-key", "k", "--max-model-len", "64",
               "--num-kv-blocks", "16", "--no-enable-prefix-caching", "--uvicorn-log-level", "info",
               "--enable-log-requests", "--max-log-len", "8", "--enable-request-id-headers"]
    if tls is not None:
        command += ["--ssl-keyfile", tls[0], "--ssl-certfile", tls[1]]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + TIMEOUT_S
        before = []
        while "serving" not in line:
            assert time.monotonic() < deadline and process.poll() is None, line
            line = process.stdout.readline()
            before.append(line)
        # announced from the app's start-up (ready to answer at once), not before it
        assert any("Waiting for application startup" in b for b in before), before
        url = re.search(r"(https?://127\.0\.0\.1:\d+)", line).group(1)
        assert url.startswith("https://" if tls is not None else "http://"), line
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT_S,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=tls[1])) if tls is not None else None)
        assert [m.id for m in client.models.list().data] == ["tiny-cli"]
        reply = client.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        raw = client.completions.with_raw_response.create(model="tiny-cli", prompt="secret words", max_tokens=1)
        assert re.fullmatch(r"[0-9a-f]{32}", raw.headers["x-request-id"])
        with pytest.raises(openai.BadRequestError):   # --max-model-len 64 reached the engine
            client.completions.create(model="tiny-cli", prompt="hi", max_tokens=64)
        process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        output, _ = process.communicate(timeout=TIMEOUT_S)
        # The client's idle keep-alive connection does not hold the shutdown (under TLS asyncio waited 30 s for
        # its close_notify).
        assert time.monotonic() - interrupted < 15, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT_S)
    assert process.returncode == 0, output
    assert "Traceback" not in output and "Application shutdown complete" in output, output
    # --enable-log-requests: the API server process logs each request, its prompt cut to --max-log-len characters
    assert re.search(r"engine-api INFO Received request cmpl-[0-9a-f]+-0: prompt: 'secret w', params: ", output), output


def test_readme_curl_example(server):
    """README's curl example, pointed at this loopback server."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if b.startswith("curl ")]
    block = block.replace("http://127.0.0.1:8000", server.url).replace("SmolLM2-135M-Instruct", MODEL)
    result = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["model"] == MODEL and reply["choices"][0]["message"]["role"] == "assistant", reply
    assert 1 <= reply["usage"]["completion_tokens"] <= 32, reply


# -- SmolLM2 ----------------------------------------------------------------------------------------------------
def test_smollm2_chat_streamed_equals_non_streamed(smollm2_dir):
    engine = AsyncLLMEngine.from_args(smollm2_dir, dtype="float32", num_kv_blocks=64, max_model_len=512)
    with ServerThread(build_app(engine, served_model_names=["smollm2"])) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                      max_tokens=48, temperature=0)
        full = client.chat.completions.create(**kwargs)
        text, finish_reason, usage = _stream_chat(client, **kwargs)
        assert "Paris" in full.choices[0].message.content
        assert full.choices[0].finish_reason == "stop"   # the model's own EOS
        assert (text, finish_reason) == (full.choices[0].message.content, "stop")
        assert usage.completion_tokens == full.usage.completion_tokens < 48
