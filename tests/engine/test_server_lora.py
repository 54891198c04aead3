"""LoRA adapters in the OpenAI server (#38 item 3), over loopback HTTP: `--lora-modules` adapters listed in
/v1/models and picked by a request's model field (completions, chat, streamed or not: each the tokens LLM.generate
gives with that adapter), vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter behind the API key and the
VLLM_ALLOW_RUNTIME_LORA_UPDATING switch, the flag's parsing and start-up checks, and the engine core process
(serve's) running adapters sent over its socket."""
import asyncio
import types

import pytest

from tests.extras import require_serve_extra  # noqa: E402

openai, httpx = require_serve_extra("openai", "httpx")
pytest.importorskip("peft", reason="the adapters are made with PEFT (pip install peft, the dev extra)")

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from engine.entrypoints.openai.lora import (ENV_RUNTIME_UPDATING, check_lora_modules, lora_int_id,  # noqa: E402
                                            parse_lora_modules)
from engine.entrypoints.openai.serving import OpenAIError, OpenAIServing  # noqa: E402
from tests.engine.lora_util import lora_pair, write_adapter  # noqa: E402

MODEL = "tiny"
KEY = "sesame"
TIMEOUT_S = 60
ENGINE_OPTIONS = dict(num_kv_blocks=64, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=16)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_dirs(peft_adapters):
    return peft_adapters("llama", ["all-r8", "mlp-o-r16", "patterns-r4"])


@pytest.fixture(scope="module")
def llm(llama_dir):
    """The reference: the engine in this process, requests given their LoRARequest directly."""
    llm = LLM(llama_dir, **ENGINE_OPTIONS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def server(llama_dir, adapter_dirs):
    """The tiny Llama with two --lora-modules adapters (NAME=PATH and vLLM's JSON form), an API key, and runtime
    loading allowed."""
    modules = parse_lora_modules([f"sql={adapter_dirs['all-r8']}",
                                  f'{{"name": "chat", "path": "{adapter_dirs["mlp-o-r16"]}"}}'])
    engine = AsyncLLMEngine.from_args(llama_dir, **ENGINE_OPTIONS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_RUNTIME_UPDATING, "True")
        app = build_app(engine, served_model_names=[MODEL], api_key=KEY, lora_modules=modules)
    with ServerThread(app) as server:
        server.modules = {m.lora_name: m for m in modules}
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=TIMEOUT_S)


def _reference_text(llm: LLM, lora: LoRARequest | None, max_tokens: int = 12) -> str:
    (output,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             lora_request=lora, use_tqdm=False)
    return output.outputs[0].text


def test_models_lists_the_adapters(server, client, adapter_dirs):
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [MODEL, "sql", "chat"]
    assert cards["sql"].root == adapter_dirs["all-r8"] and cards["sql"].parent == MODEL
    assert client.models.retrieve("chat").root == adapter_dirs["mlp-o-r16"]


def test_the_model_field_picks_the_adapter(server, client, llm):
    """Completions (plain and streamed) and chat on each adapter and on the base model: LLM.generate's tokens with
    that adapter; the adapters' differ from the base model's."""
    texts = {}
    for model in (MODEL, "sql", "chat"):
        lora = server.modules.get(model)
        expected = _reference_text(llm, lora)
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected and got.model == model
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
        texts[model] = expected
    assert texts["sql"] != texts[MODEL] and texts["chat"] != texts[MODEL]
    messages = [{"role": "user", "content": "Hello"}]
    (reference,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            lora_request=server.modules["sql"], use_tqdm=False)
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == reference.outputs[0].text and chat.model == "sql"


def test_an_unknown_model_is_a_404(server, client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert error.value.body["param"] == "model"


def test_load_and_unload_at_run_time(server, client, llm, adapter_dirs, tmp_path):
    """vLLM's routes: behind the key (401), 400 naming lora_path for an adapter that does not load (another
    model's shapes) or lora_name for a name taken, then the adapter is served (its own tokens) until unloaded
    (404 afterwards, for a request and for a second unload)."""
    path = adapter_dirs["patterns-r4"]
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path}, key=None).status_code == 401
    bad = write_adapter(tmp_path / "bad", lora_pair("model.layers.0.self_attn.q_proj", 8, 64, 256))
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": bad})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    assert "an adapter for another model?" in response.json()["error"]["message"]
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'x' added successfully."
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name"
    assert "x" in [card.id for card in client.models.list().data]
    expected = _reference_text(llm, LoRARequest("x", 77, path))
    assert client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == expected
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'x' removed successfully."
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="x", prompt=PROMPT, max_tokens=2)


def _stub_engine(enable_lora: bool):
    processor = types.SimpleNamespace(enable_lora=enable_lora)
    return types.SimpleNamespace(max_model_len=128, finished_callbacks=[], output_callbacks=[],
                                 engine=types.SimpleNamespace(input_processor=processor))


def test_runtime_routes_need_the_switch_lora_and_one_api_server(monkeypatch):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist; with it they answer 400 on a server
    without --enable-lora, or with several API server processes (each would know its own names)."""
    def paths():
        app = build_app(_stub_engine(True), served_model_names=[MODEL])
        return {route.path for route in app.routes}

    monkeypatch.delenv(ENV_RUNTIME_UPDATING, raising=False)
    assert "/v1/load_lora_adapter" not in paths()
    monkeypatch.setenv(ENV_RUNTIME_UPDATING, "1")
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths()
    document = build_app(_stub_engine(True), served_model_names=[MODEL]).openapi()   # both in the OpenAPI document
    load, unload = (document["paths"][f"/v1/{verb}_lora_adapter"]["post"] for verb in ("load", "unload"))
    assert load["requestBody"]["content"]["application/json"]["schema"]["required"] == ["lora_name", "lora_path"]
    assert "404" in unload["responses"] and "404" not in load["responses"]
    assert unload["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    for serving, match in [(OpenAIServing(_stub_engine(False), [MODEL]), "LoRA is not enabled"),
                           (OpenAIServing(_stub_engine(True), [MODEL], api_server_count=2), "--api-server-count 2")]:
        with pytest.raises(OpenAIError, match=match) as error:
            asyncio.run(serving.load_lora_adapter({"lora_name": "x", "lora_path": "/p"}))
        assert error.value.status == 400


def test_lora_modules_flag(llama_dir, adapter_dirs, tmp_path):
    """NAME=PATH or vLLM's JSON; malformed values, a name twice, the base model's name, a missing --enable-lora
    and an adapter that does not load on the model are refused before the engine starts."""
    path = adapter_dirs["all-r8"]
    sql, chat = parse_lora_modules([f"sql={path}", f'{{"name": "chat", "path": "{path}", "base_model_name": "b"}}'])
    assert (sql.lora_name, sql.lora_path, chat.lora_name, chat.base_model_name) == ("sql", path, "chat", "b")
    assert sql.lora_int_id == lora_int_id("sql", path) != chat.lora_int_id   # the same in every API server process
    for values, match in [(["sql"], "expected NAME=PATH"), (["{nope"], "not valid JSON"),
                          (['{"name": "a"}'], "the keys name and path"), ([f"a={path}", f"a={path}"], "given twice")]:
        with pytest.raises(ValueError, match=match):
            parse_lora_modules(values)
    args = EngineArgs(model=llama_dir, **ENGINE_OPTIONS)
    check_lora_modules(args, [sql], MODEL)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        check_lora_modules(EngineArgs(model=llama_dir), [sql], MODEL)
    with pytest.raises(ValueError, match="is the base model's name"):
        check_lora_modules(args, parse_lora_modules([f"{MODEL}={path}"]), MODEL)
    bad = write_adapter(tmp_path / "bad", lora_pair("model.layers.0.self_attn.q_proj", 32, 128, 256), r=32)
    with pytest.raises(ValueError, match=r"LoRA adapter 'big' .* rank 32, over max_lora_rank=16"):
        check_lora_modules(args, parse_lora_modules([f"big={bad}"]), MODEL)


def test_engine_core_process_runs_adapters(llama_dir, llm, adapter_dirs, tmp_path):
    """serve's process split: requests on adapters cross the core's socket and come back with LLM.generate's tokens;
    add_lora / remove_lora are calls to the core, a bad adapter a ValueError in the front end."""
    from engine.mp_engine import MPAsyncLLMEngine, start_engine_core

    pytest.importorskip("zmq", reason="the engine core process needs pyzmq (the serve extra)")
    lora = LoRARequest("sql", lora_int_id("sql", adapter_dirs["all-r8"]), adapter_dirs["all-r8"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [_reference_text(llm, r) for r in (lora, None)]
    bad = LoRARequest("bad", 5, write_adapter(tmp_path / "bad", lora_pair("model.layers.9.mlp.up_proj", 8, 128, 256)))
    core = start_engine_core(EngineArgs(model=llama_dir, **ENGINE_OPTIONS))

    async def run():
        engine = MPAsyncLLMEngine(core.address, core.info)
        try:
            texts = []
            for i, r in enumerate((lora, None)):
                async for output in engine.generate(PROMPT, params, request_id=f"r{i}", lora_request=r):
                    last = output
                texts.append(last.outputs[0].text)
            with pytest.raises(ValueError, match="which this base model does not have"):
                await engine.add_lora(bad)
            with pytest.raises(ValueError, match="lora_request: .* which this base model does not have"):
                async for _ in engine.generate(PROMPT, params, request_id="bad", lora_request=bad):
                    pass
            removed = [await engine.remove_lora(lora.lora_int_id) for _ in range(2)]
            return texts, removed
        finally:
            await engine.shutdown()

    try:
        texts, removed = asyncio.run(run())
    finally:
        core.shutdown()
    assert texts == expected and removed == [True, False]
