"""LoRA adapters in the OpenAI server, under vLLM's names (#38 item 3).

- ``serve --enable-lora --lora-modules NAME=PATH ...`` (or vLLM's JSON form, ``'{"name": ..., "path": ...,
  "base_model_name": ...}'``): each adapter is served as a model of its own name. ``/v1/models`` lists it (its
  ``root`` the adapter's directory, its ``parent`` the base model), and a request whose ``model`` field names it runs
  on it; every other field works as on the base model.
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}``
  add and remove adapters while the server runs. As in vLLM, they exist only when the environment has
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (anyone who can call them makes the server read any directory it can
  see), and they sit behind the API key like every /v1 route. They answer vLLM's plain-text ``Success: ...``.

An adapter's ``lora_int_id`` (the engine's key for it) is a hash of its name and directory, the same in every API
server process, so several front ends (``--api-server-count``) name the same adapters alike. Adapters loaded at
run time are known to the API server process that loaded them only: with ``--api-server-count`` > 1 the two
routes answer 400.
"""

import hashlib
import json
import os

from engine.lora import LoRARequest

ENV_RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    """vLLM's switch: VLLM_ALLOW_RUNTIME_LORA_UPDATING set to 1 or true (any case)."""
    return os.environ.get(ENV_RUNTIME_UPDATING, "0").strip().lower() in ("1", "true")


def lora_int_id(name: str, path: str, generation: int = 0) -> int:
    """A positive 62-bit id for the adapter (name, path): the same in every process. `generation` tells apart
    adapters loaded again at run time under the same name and directory (their files may have changed, and the
    prefix cache keys KV blocks by the id)."""
    digest = hashlib.blake2b(f"{name}\0{path}\0{generation}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 2) or 1


def parse_lora_modules(values: list[str] | None) -> list[LoRARequest]:
    """--lora-modules: each value NAME=PATH or a JSON object {"name", "path"[, "base_model_name"]}. ValueError
    naming the flag for a malformed value or a name given twice."""
    modules: list[LoRARequest] = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON: {e}") from None
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"}) if isinstance(spec, dict) else []
            if not isinstance(spec, dict) or unknown or not all(isinstance(spec.get(k), str) and spec[k]
                                                                 for k in ("name", "path")):
                raise ValueError(f"--lora-modules: a JSON value has the keys name and path (strings) and optionally "
                                 f"base_model_name, got {value!r}")
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected NAME=PATH or a JSON object, got {value!r}")
            base = None
        if any(m.lora_name == name for m in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append(LoRARequest(name, lora_int_id(name, path), path, base_model_name=base))
    return modules


def check_lora_modules(engine_args, modules: list[LoRARequest], served_model_name: str) -> None:
    """Before the engine starts: --lora-modules needs --enable-lora, no adapter may take the base model's name,
    and each adapter must load on this model (a bad one is the ValueError the engine would raise for a request,
    now, instead of a failed request later)."""
    if not modules:
        return
    if not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for module in modules:
        if module.lora_name == served_model_name:
            raise ValueError(f"--lora-modules: {module.lora_name!r} is the base model's name (--served-model-name)")
    from engine.lora import check_lora_adapter

    config = engine_args.create_engine_config()
    for module in modules:
        check_lora_adapter(module, config.model_config, config.lora_config)


def add_lora_routes(app, serving, read_body) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter on `app` (when runtime updating is allowed);
    read_body(request): the request's JSON body as a dict (the app's parse_body, with its limits)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    from engine.entrypoints.openai.protocol import error_responses

    def documented(*fields: str, not_found: tuple = ()) -> dict:   # the OpenAPI document's body and answers
        body = {"type": "object", "required": list(fields),
                "properties": {field: {"type": "string", "minLength": 1} for field in fields}}
        return {"response_class": PlainTextResponse,
                "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
                "responses": {200: {"description": "Success: ... (text)"},
                              **error_responses(400, 401, *not_found, 408, 413, 500, 503)}}

    @app.post("/v1/load_lora_adapter", **documented("lora_name", "lora_path"))
    async def load_lora_adapter(raw_request: Request):
        return PlainTextResponse(await serving.load_lora_adapter(await read_body(raw_request)))

    @app.post("/v1/unload_lora_adapter", **documented("lora_name", not_found=(404,)))
    async def unload_lora_adapter(raw_request: Request):
        return PlainTextResponse(await serving.unload_lora_adapter(await read_body(raw_request)))
