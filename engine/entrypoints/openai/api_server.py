"""The FastAPI app (`build_app`) and `python -m engine serve` (`run_server`).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, POST /tokenize,
POST /detokenize, GET /version, GET /health, GET /metrics. Errors are OpenAI's JSON: 400 for invalid parameters,
wrong types, malformed JSON, text that is not valid Unicode (lone surrogates) and over-long prompts, 401 without
the API key (when one is set: on every route but /health, and /metrics unless --disable-metrics-auth), 404 for an
unknown model or route, 408 for headers or a body that do not arrive in time, 413 for a body far past any prompt
the server takes, 500 for a request the engine failed (the engine goes on serving the others), 503 for a
connection past --limit-concurrency and for a request the shutdown ended (in-band for a stream), 405 with Allow for
a method a route does not take. GET /openapi.json documents all of it: each route's body, its answers and their
schemas (protocol.py's models), and the error body under each status a route can return.

LoRA adapters (engine/entrypoints/openai/lora.py): --lora-modules adapters are models of their own names; with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True also POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Production limits of `serve` (each a flag): --shutdown-timeout (DrainingServer), --request-header-timeout and
--limit-concurrency (http_limits.py, below the app), --request-body-timeout (parse_body).

Request bodies are parsed here rather than by FastAPI, so that every way a body can be wrong (bytes that are not
UTF-8, JSON nesting too deep for the parser, strings no encoder takes) ends as a 400 before anything else runs."""
import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.entrypoints.openai.lora import add_lora_routes, parse_lora_modules
from engine.entrypoints.openai.lora import runtime_updating_allowed as runtime_lora_updating_allowed
from engine.entrypoints.openai.metrics import metrics_model_name, ServerMetrics
from engine.entrypoints.openai.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                                CompletionChunk, CompletionRequest, CompletionResponse,
                                                DetokenizeRequest, DetokenizeResponse, error_responses, ErrorResponse,
                                                ModelCard, ModelList, TokenizeChatRequest, TokenizeCompletionRequest,
                                                TokenizeResponse, VersionResponse)
from engine.entrypoints.openai.serving import json_safe, MAX_CHARS_PER_TOKEN, OpenAIError, OpenAIServing

logger = logging.getLogger(__name__)

# Production limits (`serve`'s defaults; each has its flag).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0   # an orchestrator's usual grace period (Kubernetes' terminationGracePeriodSeconds)
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0       # a prompt at the body limit over a slow link
# Once the shutdown deadline ends the streams, how long their last events get to reach the clients before the
# connections left are closed.
SHUTDOWN_FLUSH_S = 1.0
# File descriptors kept for the process's own use (model files, ZMQ, pipes to workers) below RLIMIT_NOFILE when
# the connection cap is derived from it.
RESERVED_FDS = 256


def _error_response(error: OpenAIError, headers: dict | None = None) -> JSONResponse:
    # After a 408 the rest of the body may still come: the connection cannot carry another request.
    if isinstance(error, _BodyTimeoutError):
        headers = {**(headers or {}), "connection": "close"}
    return JSONResponse(error.to_json(), status_code=error.status, headers=headers)


def _check_unicode(value) -> None:
    """400 for a string that is not valid Unicode (a lone surrogate from a JSON escape such as \\ud800):
    nothing downstream (tokenizer, UTF-8 encoder) can take it."""
    stack = [(value, "body")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError(400, f"{path} holds text that is not valid Unicode (a lone surrogate)",
                                  param=path.split(".")[1] if "." in path else None,
                                  code="invalid_unicode") from None
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, path))
                stack.append((child, f"{path}.{key}" if path == "body" else path))
        elif isinstance(item, list):
            stack.extend((child, path) for child in item)


def max_body_bytes(max_model_len: int) -> int:
    """Largest request body read: room for a prompt at the size limit (MAX_CHARS_PER_TOKEN characters per token
    of context, up to 4 UTF-8 bytes each, more with JSON escapes) plus 1 MiB of other fields. Past it the
    body is refused unread, before the JSON parser (which holds the event loop) sees it."""
    return 8 * MAX_CHARS_PER_TOKEN * max_model_len + (1 << 20)


class _BodyTimeoutError(OpenAIError):
    """The body did not arrive in time: answered 408 with `Connection: close` (the rest of it may still come)."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout")


async def _read_body(raw_request: Request, max_bytes: int) -> bytes:
    too_large = OpenAIError(413, f"the request body is larger than this server takes ({max_bytes} bytes)",
                            code="request_too_large")
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(raw_request: Request, model: type[BaseModel] | None, max_bytes: int,
                     timeout_s: float | None = None):
    """The request's JSON body, validated as `model` (a dict when None); every failure is an OpenAIError 400
    (413 for a body over max_bytes, 408 for one that does not arrive within timeout_s) naming the field the
    client sent."""
    try:
        body = await asyncio.wait_for(_read_body(raw_request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise _BodyTimeoutError(timeout_s) from None
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise OpenAIError(400, f"malformed JSON body: {type(e).__name__}: {str(e)[:200]}") from None
    _check_unicode(data)
    if not isinstance(data, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return data if model is None else validate_body(data, model)


def validate_body(data: dict, model: type[BaseModel]):
    """`data` (a request's JSON object) as `model`; a ValidationError is a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        location = [str(part) for part in first.get("loc", ())]
        param = location[0] if location else None
        raise OpenAIError(400, f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid value')}",
                          param=param) from None
    except RecursionError:
        raise OpenAIError(400, "the body is nested too deeply") from None


# The models the routes' own docs refer to by name, besides those FastAPI adds: the request bodies (parse_body reads
# them, not FastAPI), the error body and the streams' chunks.
DOCUMENTED_MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                     DetokenizeRequest, ErrorResponse, CompletionChunk, ChatCompletionChunk]
# The errors every route can answer (the API key, a failure, the connection limit), and those of a route with a body.
ANY_ROUTE_ERRORS = (401, 500, 503)
BODY_ERRORS = (400, 408, 413)


def _body_schema(*models: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that parses its body itself (parse_body): one of `models`, which
    _openapi_document adds (and the models they nest) to the document's components."""
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


def _stream_or_json(model: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """responses= of a generation route: `model` as JSON, or with "stream": true server-sent events, each a
    `chunk`'s JSON (an error that ends the stream: OpenAI's error body) and the last `[DONE]`."""
    data = {"anyOf": [{"const": "[DONE]"}, {
        "type": "string", "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                    {"$ref": "#/components/schemas/ErrorResponse"}]}}]}
    return {200: {"model": model, "description": f"{model.__name__}, or with stream: {chunk.__name__} events",
                  # OpenAPI 3.1: an event stream's schema is that of each event
                  "content": {"text/event-stream": {"schema": {
                      "type": "object", "required": ["data"], "properties": {"data": data}}}}},
            **error_responses(*BODY_ERRORS, 404, *ANY_ROUTE_ERRORS)}


def _at_most(field: dict, maximum: int) -> None:
    """An integer field's schema (or its integer alternative, when it may be null) bounded by `maximum`."""
    for alternative in field.get("anyOf", [field]):
        if alternative.get("type") == "integer":
            alternative["maximum"] = min(alternative.get("maximum", maximum), maximum)


def _openapi_document(app: FastAPI, models: list[type[BaseModel]], vocab_size: Callable[[], int | None] = lambda: None,
                      max_model_len: int | None = None, max_logprobs: Callable[[], int | None] = lambda: None):
    """app.openapi, with `models` (and the models they nest) under components/schemas. FastAPI's 422
    (its own validation error) goes: this server answers 400 for every invalid request. The bounds this model
    sets on single fields are written in: vocab_size() (None: not known) on /detokenize's token ids; max_model_len
    on max_tokens and truncate_prompt_tokens, and (times MAX_CHARS_PER_TOKEN) on /tokenize's prompt length and
    /detokenize's token count; max_logprobs() on logprobs, top_logprobs and prompt_logprobs. (Bounds across fields,
    a prompt plus max_tokens within the context, no schema says.)"""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            vocabulary = vocab_size()
            if vocabulary is not None and "DetokenizeRequest" in schemas:
                schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = vocabulary - 1
            if max_model_len is not None:   # OpenAIServing's bounds
                max_chars = max_model_len * MAX_CHARS_PER_TOKEN
                schemas["TokenizeCompletionRequest"]["properties"]["prompt"]["maxLength"] = max_chars
                schemas["DetokenizeRequest"]["properties"]["tokens"]["maxItems"] = max_chars
                for name in ("CompletionRequest", "ChatCompletionRequest"):
                    for field in ("max_tokens", "max_completion_tokens", "truncate_prompt_tokens"):
                        if field in schemas[name]["properties"]:
                            _at_most(schemas[name]["properties"][field], max_model_len)
            most_logprobs = max_logprobs()
            if most_logprobs is not None:   # the input processor's limit
                for name in ("CompletionRequest", "ChatCompletionRequest"):
                    for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
                        if field in schemas[name]["properties"]:   # (chat's logprobs is a bool: left alone)
                            _at_most(schemas[name]["properties"][field], most_logprobs)
            app.openapi_schema = document
        return app.openapi_schema
    return openapi


@dataclass(frozen=True)
class CORSOptions:
    """Which browser pages may call the server (Starlette's CORSMiddleware; vLLM's --allowed-origins,
    --allowed-methods, --allowed-headers, --allow-credentials and their defaults: any origin, method and header,
    no credentials)."""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class _RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's own X-Request-Id
    when it sent one, else a fresh uuid4 hex. A plain ASGI middleware (see _APIKeyMiddleware)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = [value for name, value in scope["headers"] if name == b"x-request-id"]
        request_id = sent[0] if sent else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", request_id)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


class _APIKeyMiddleware:
    """Every route but the `open_paths` (/health; /metrics too with disable_metrics_auth) needs
    `Authorization: Bearer <api_key>`: 401 without it or with another key (unknown routes too, so that nothing
    about the server shows without the key), 400 with more than one Authorization header (which one counts would
    be up to each proxy on the way). The key is compared in constant time on SHA-256 digests, so the time taken
    tells nothing of the key or its length. A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide
    client disconnects from the handlers."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = frozenset({"/health"})):
        self.app, self.open_paths = app, open_paths
        self.key_digest = hashlib.sha256(api_key.encode("utf-8")).digest()

    def _refusal(self, headers) -> OpenAIError | None:
        values = [value for name, value in headers if name == b"authorization"]
        if len(values) > 1:
            return OpenAIError(400, f"the request has {len(values)} Authorization headers; send one",
                               param="authorization", code="invalid_api_key")
        scheme, _, token = values[0].strip().partition(b" ") if values else (b"", b"", b"")
        digest = hashlib.sha256(token.strip()).digest()
        # compare_digest on both, whatever the scheme: the time taken does not depend on what was sent.
        if not hmac.compare_digest(digest, self.key_digest) or scheme.lower() != b"bearer":
            return OpenAIError(401, "Incorrect or missing API key.", code="invalid_api_key")   # OpenAI's
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            error = self._refusal(scope["headers"])
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str], api_key: str | None = None,
              disable_metrics_auth: bool = False, chat_template: str | None = None, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, special_tokens_in_messages: str = "escape",
              request_body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
              on_ready: Callable[[], None] | None = None, lora_modules: list | None = None,
              api_server_count: int = 1, cors: CORSOptions | None = CORSOptions(),
              disable_fastapi_docs: bool = False, enable_request_id_headers: bool = False,
              enable_log_requests: bool = False, max_log_len: int | None = None) -> FastAPI:
    """The server app around a (not yet started) AsyncLLMEngine; the step loop starts with the app, and
    on_ready is called once its start-up is done (the engine started, the chat-template workers imported).

    api_key: every route but /health needs `Authorization: Bearer <api_key>` (and /metrics unless
    disable_metrics_auth). chat_template: the template text to use instead of the tokenizer's. trust_request_chat_template: let requests
    bring their own (it runs on the server). enable_auto_tool_choice with tool_call_parser ("hermes",
    "llama3_json"): tool_choice "auto" parses tool calls from the output. reasoning_parser ("qwen3",
    "deepseek_r1"): <think> text goes to reasoning_content. special_tokens_in_messages ("escape", "reject",
    "allow"): what special-token text in user and tool message content becomes (OpenAIServing._guard_special_tokens).
    request_body_timeout_s: a body must arrive within this long (408 otherwise; None: no limit). lora_modules:
    LoRARequests served as models of their names (--lora-modules); api_server_count: the API server processes in
    front of the engine (runtime adapter loading needs one). cors: the browsers' cross-origin rules (vLLM's
    --allowed-origins and its kin; default any origin, as vLLM's; None: no CORS headers at all);
    disable_fastapi_docs: no /docs, /redoc or /openapi.json; enable_request_id_headers: every response carries
    X-Request-Id (the request's own, else a fresh one); enable_log_requests: each request's prompt and parameters
    logged at INFO (vLLM's --enable-log-requests), the prompt cut to max_log_len characters (and ids)."""
    serving = OpenAIServing(engine, served_model_names, chat_template=chat_template,
                            trust_request_chat_template=trust_request_chat_template,
                            enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                            reasoning_parser=reasoning_parser,
                            special_tokens_in_messages=special_tokens_in_messages, lora_modules=lora_modules,
                            api_server_count=api_server_count, log_requests=enable_log_requests,
                            max_log_len=max_log_len)
    metrics = ServerMetrics(metrics_model_name(served_model_names[0]))
    body_limit = max_body_bytes(engine.max_model_len)
    metrics.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        engine.chat_template_sandbox.start()   # its processes import the renderer now, not on the first chat
        await asyncio.get_running_loop().run_in_executor(None, engine.chat_template_sandbox.wait_started)
        if on_ready is not None:
            on_ready()
        yield
        await engine.shutdown()

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if disable_fastapi_docs else {}
    app = FastAPI(title="engine OpenAI-compatible server", lifespan=lifespan, **docs)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(OpenAIError(400, f"malformed JSON body: {first.get('msg', '')}"))
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        return _error_response(OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                                           param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException):   # its headers stay (a 405's Allow)
        return _error_response(OpenAIError(error.status_code, str(error.detail),
                                           type="not_found_error" if error.status_code == 404 else "api_error"),
                               headers=error.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        return _error_response(OpenAIError(500, str(error), type="internal_server_error"))

    if api_key is not None:
        open_paths = frozenset({"/health", "/metrics"} if disable_metrics_auth else {"/health"})
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    if enable_request_id_headers:
        app.add_middleware(_RequestIdMiddleware)
    if cors is not None:   # outermost (added last): a browser's preflight carries no API key, and needs none
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is serving (an empty body)"}, **error_responses(500, 503)})
    async def health():
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text format"}, **error_responses(*ANY_ROUTE_ERRORS)})
    async def prometheus_metrics():
        return Response(await metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception):   # a bug, not the client's fault: log it, stay JSON
        logger.exception("unhandled error in a request")
        return _error_response(OpenAIError(500, f"internal error: {type(error).__name__}", type="internal_server_error"))

    @app.get("/version", responses={200: {"model": VersionResponse}, **error_responses(*ANY_ROUTE_ERRORS)})
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version
        try:
            return {"version": package_version("pagedkernels-engine")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(*ANY_ROUTE_ERRORS)})
    async def list_models():
        return serving.models()

    @app.get("/v1/models/{model_id:path}",
             responses={200: {"model": ModelCard}, **error_responses(404, *ANY_ROUTE_ERRORS)})
    async def get_model(model_id: str):
        return serving.model(model_id)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest),
              responses=_stream_or_json(CompletionResponse, CompletionChunk))
    async def completions(raw_request: Request):
        request = await parse_body(raw_request, CompletionRequest, body_limit, request_body_timeout_s)
        return _respond(await _cancel_on_disconnect(raw_request, serving.create_completion(request)))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest),
              responses=_stream_or_json(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(raw_request: Request):
        request = await parse_body(raw_request, ChatCompletionRequest, body_limit, request_body_timeout_s)
        return _respond(await _cancel_on_disconnect(raw_request, serving.create_chat_completion(request)))

    def vocab_size() -> int | None:
        tokenizer = getattr(engine, "tokenizer", None)
        return None if tokenizer is None else len(tokenizer)

    def max_logprobs() -> int | None:
        processor = getattr(getattr(engine, "engine", None), "input_processor", None)
        return getattr(processor, "logprobs_limit", None)

    app.openapi = _openapi_document(app, DOCUMENTED_MODELS, vocab_size=vocab_size, max_model_len=engine.max_model_len,
                                    max_logprobs=max_logprobs)

    if runtime_lora_updating_allowed():
        add_lora_routes(app, serving, lambda raw_request: parse_body(raw_request, None, body_limit,
                                                                     request_body_timeout_s))

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeCompletionRequest, TokenizeChatRequest),
              responses={200: {"model": TokenizeResponse}, **error_responses(*BODY_ERRORS, 404, *ANY_ROUTE_ERRORS)})
    async def tokenize(raw_request: Request):
        body = await parse_body(raw_request, None, body_limit, request_body_timeout_s)
        return await serving.tokenize(validate_body(body, TokenizeChatRequest if "messages" in body
                                                    else TokenizeCompletionRequest))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **error_responses(*BODY_ERRORS, 404, *ANY_ROUTE_ERRORS)})
    async def detokenize(raw_request: Request):
        return await serving.detokenize(await parse_body(raw_request, DetokenizeRequest, body_limit,
                                                         request_body_timeout_s))

    return app


async def _cancel_on_disconnect(raw_request: Request, coroutine, poll_s: float = 0.25):
    """Await a handler, cancelling it (which aborts its engine requests) when the client goes away before
    the response: uvicorn does not cancel a handler on disconnect. A stream, once returned, is cancelled by
    StreamingResponse itself."""
    task = asyncio.ensure_future(coroutine)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)   # nginx's "client closed request"; nobody reads it
    finally:
        if not task.done():
            task.cancel()


def _respond(result):
    if isinstance(result, Response):
        return result
    if isinstance(result, dict):
        return JSONResponse(json_safe(result))
    return StreamingResponse(result, media_type="text/event-stream")


# -- `python -m engine serve` (its arguments: engine/__main__.py and EngineArgs) ------------------------------
def serve_engine_args(args):
    """The EngineArgs of `serve`'s arguments, with the server's defaults (fair share of a step)."""
    from engine.engine_args import EngineArgs
    from engine.platform import DevicePolicy, resolve_device

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_num_seqs_per_request is None:   # a server shares its steps fairly by default
        share = DevicePolicy.for_device(resolve_device(engine_args.device)).serve_max_num_seqs_per_request
        engine_args.max_num_seqs_per_request = min(share, engine_args.max_num_seqs)
    if engine_args.skip_tokenizer_init:
        raise ValueError("serve needs the tokenizer (requests are text and chat messages): drop "
                         "--skip-tokenizer-init")
    return engine_args


def engine_from_args(args) -> tuple[AsyncLLMEngine, str]:
    """An in-process AsyncLLMEngine of `serve`'s arguments (tests, and tools that want one process)."""
    engine = AsyncLLMEngine(serve_engine_args(args).create_engine())
    return engine, served_model_name(args)


def served_model_name(args) -> str:
    """The model's name in the API: --served-model-name, else the model as given (a path stays a path), else the
    default model's name."""
    from engine.default_model import MODEL_NAME
    from engine.engine_args import EngineArgs

    return args.served_model_name or EngineArgs.from_cli_args(args).model or MODEL_NAME


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding the template, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:   # neither a file nor a Jinja template: most likely a mistyped path
        raise ValueError(f"chat_template {value!r} is neither a file nor a template")
    return value


def _interrupt(signum, frame):
    """SIGTERM as Ctrl-C: the same orderly shutdown."""
    raise KeyboardInterrupt


def default_connection_limit() -> int:
    """--limit-concurrency's default: what RLIMIT_NOFILE leaves after RESERVED_FDS, so that connections can never
    take the descriptors the process needs for itself (at least 64)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(64, soft - RESERVED_FDS)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a bounded shutdown. Once it should exit (SIGTERM, SIGINT, stop()) the listener
    closes, idle connections close, and the requests in flight get `shutdown_timeout_s` to finish; then every
    stream still open ends with an in-band 503 error and `[DONE]` and a request not streamed yet gets a 503
    (engine.interrupt_streams), and SHUTDOWN_FLUSH_S later every connection left (a client that does not read)
    is closed. The process then exits within shutdown_timeout_s + SHUTDOWN_FLUSH_S and the app's own shutdown.
    uvicorn's graceful shutdown alone waits for every connection, for ever.

    stop(0, reason) ends everything at once: `serve` does that when the engine core or another API server
    process dies (the surviving streams end at once, with the reason in-band)."""

    def __init__(self, config, engine: AsyncLLMEngine, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        if shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {shutdown_timeout_s}")
        # uvicorn's own deadline only as a backstop, after ours.
        config.timeout_graceful_shutdown = shutdown_timeout_s + SHUTDOWN_FLUSH_S + 1.0
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop_reason = (f"the server is shutting down and this request did not finish within its "
                            f"{shutdown_timeout_s:g} s (--shutdown-timeout)")

    def stop(self, grace_s: float, reason: str) -> None:
        """Shut down giving the requests in flight at most grace_s (shortening a grace period already running);
        `reason` is what the streams ended then are told. Plain attribute writes only: safe in a signal handler
        and from any thread."""
        if grace_s < self.shutdown_timeout_s:
            self.shutdown_timeout_s, self.stop_reason = grace_s, reason
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.create_task(self._end_at_deadline(), name="shutdown-deadline")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _abort_closed_connections(self) -> None:
        """End the connections uvicorn has closed (idle keep-alive ones, or their last response written) whose
        transport still waits: under TLS, asyncio waits for the client's close_notify up to 30 s
        (ssl_shutdown_timeout), which an idle client never sends, and uvicorn waits for the connection. Every byte
        of theirs is written, so nothing is lost."""
        for connection in list(self.server_state.connections):
            transport = connection.transport
            if transport.is_closing() and transport.get_write_buffer_size() == 0:
                transport.abort()

    async def _end_at_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < self.shutdown_timeout_s:   # re-read: stop() may shorten it
            self._abort_closed_connections()
            await asyncio.sleep(0.05)
        num_streams = self.engine.interrupt_streams(self.stop_reason)
        if num_streams:
            logger.warning("shutdown: ended %d request(s) still running: %s", num_streams, self.stop_reason)
        await asyncio.sleep(SHUTDOWN_FLUSH_S)
        for connection in list(self.server_state.connections):
            connection.transport.abort()
        for task in list(self.server_state.tasks):
            task.cancel()


def _listen_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (accepted ones
    # inherit it). With proto 0, Nagle held each response's body (written after its headers) until the client's
    # delayed ACK: 40-45 ms added to every request on a kept-alive connection (a 16-token completion of the tiny
    # model: 0.068 s, of which 0.043 s waiting).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:   # several API server processes accept on one port (the kernel spreads the connections)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    # Listening from here on: a connection made before uvicorn accepts (its start-up done, when the address is
    # announced) queues instead of being refused.
    sock.listen(2048)
    return sock


def _http_protocol(args) -> type:
    """uvicorn's HTTP protocol class with the header deadline and the connection cap of `serve`'s arguments."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from engine.entrypoints.openai.http_limits import limited_protocol

    limit = args.limit_concurrency if args.limit_concurrency is not None else default_connection_limit()
    return limited_protocol(AutoHTTPProtocol, header_timeout_s=args.request_header_timeout or None,
                            max_connections=limit)


def _frontend_app(args, address: str, info: dict, on_ready: Callable[[], None] | None = None):
    from engine.mp_engine import MPAsyncLLMEngine

    engine = MPAsyncLLMEngine(address, info)
    app = build_app(engine, served_model_names=[served_model_name(args)], api_key=args.api_key,
                    disable_metrics_auth=args.disable_metrics_auth,
                    chat_template=load_chat_template(args.chat_template),
                    trust_request_chat_template=args.trust_request_chat_template,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser,
                    special_tokens_in_messages=args.special_tokens_in_messages,
                    request_body_timeout_s=args.request_body_timeout or None, on_ready=on_ready,
                    lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
                    api_server_count=getattr(args, "api_server_count", 1), cors=cors_options(args),
                    disable_fastapi_docs=args.disable_fastapi_docs,
                    enable_request_id_headers=args.enable_request_id_headers,
                    enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len)
    return engine, app


def ssl_options(args) -> dict:
    """uvicorn's TLS settings from --ssl-keyfile, --ssl-certfile, --ssl-ca-certs and --ssl-cert-reqs (vLLM's): HTTPS
    on the server's own port, no proxy needed."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
    if args.ssl_keyfile is None:
        return {}
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
            "ssl_cert_reqs": args.ssl_cert_reqs}


def _scheme(args) -> str:
    return "https" if args.ssl_certfile is not None else "http"


def cors_options(args) -> CORSOptions:
    """The CORS rules of the command line's --allowed-origins, --allowed-methods, --allowed-headers (each a JSON
    list of strings, as vLLM takes them) and --allow-credentials."""
    return CORSOptions(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                       args.allow_credentials)


def _run_frontend(args, address: str, info: dict, sock: socket.socket,
                  on_ready: Callable[[], None] | None = None) -> int:
    """Serve HTTP on `sock` with a front end of the core at `address` until shut down (0) or the core dies (1);
    on_ready is called once the app's start-up is done. SIGTERM/SIGINT shut down with --shutdown-timeout for the
    requests in flight, SIGUSR1 at once (DrainingServer)."""
    import signal

    from engine.core.core_process import freeze_startup_objects

    def ready() -> None:
        freeze_startup_objects()   # as the core does: no full collection walks the start-up's objects again
        if on_ready is not None:
            on_ready()
    engine, app = _frontend_app(args, address, info, ready)
    # --root-path: the prefix a proxy serves the app under (uvicorn's root_path: routes match with or without it)
    server = DrainingServer(uvicorn.Config(app, log_level=args.log_level, http=_http_protocol(args),
                                           root_path=args.root_path, **ssl_options(args)),
                            engine, args.shutdown_timeout)
    core_died = []

    def on_dead(error) -> None:   # the core is gone: no request can be served, so the server stops at once
        core_died.append(error)
        server.stop(0, f"the server is shutting down: {error}")
    engine.dead_callbacks.append(on_dead)
    # The supervisor's "stop now": another process of the server died (its streams are cut; ours end cleanly).
    signal.signal(signal.SIGUSR1, lambda signum, frame: server.stop(
        0, "the server is shutting down: another of its processes exited"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has shut down gracefully (the app's lifespan stopped the engine), then re-raises the
        # signal it captured; end with status 0, as the uvicorn command does.
        pass
    if core_died:
        logger.error("shutting down: %s", core_died[0])
        return 1
    return 0


def _frontend_process_main(args, address: str, info: dict, port: int, ready) -> None:
    """An API server process of --api-server-count N > 1."""
    import signal

    configure_api_logging()
    sock = _listen_socket(args.host, port, reuse_port=True)
    signal.signal(signal.SIGTERM, _interrupt)

    def on_ready() -> None:
        ready.send(os.getpid())
        ready.close()
    exit_now(_run_frontend(args, address, info, sock, on_ready))


def configure_api_logging() -> None:
    """An API server process logs the engine's INFO lines (--enable-log-requests' among them) to stderr, as the core
    process does; a no-op where the root logger is set up already (an embedding application, pytest)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-api %(levelname)s %(message)s")


def exit_now(status: int) -> None:
    """End this process with `status` once the server has shut down (everything it holds released in order):
    output flushed, then os._exit, skipping the interpreter's teardown, which took 2-3 s with torch and triton
    loaded on a busy machine: time an orchestrator's grace period (--shutdown-timeout + 5 s) and a failover
    (5 s) do not have."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def run_server(args) -> None:
    """`python -m engine serve`: the engine core in its own process, --api-server-count API server processes in
    front of it (this process itself when 1). A process that dies takes the server down with it at once (every
    surviving stream ends with the error in-band; exit status 1, the cause logged); Ctrl-C or SIGTERM shuts
    everything down, the requests in flight given --shutdown-timeout seconds (status 0). No process is left
    either way."""
    import signal

    from engine.entrypoints.openai.lora import check_lora_modules
    from engine.mp_engine import start_engine_core

    configure_api_logging()

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    count = getattr(args, "api_server_count", 1)
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {count}")
    for flag, value in (("--shutdown-timeout", args.shutdown_timeout),
                        ("--request-header-timeout", args.request_header_timeout),
                        ("--request-body-timeout", args.request_body_timeout)):
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0 seconds, got {value}")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")
    load_chat_template(args.chat_template)   # a bad template (or TLS file) is refused before the model loads
    ssl_options(args)
    engine_args = serve_engine_args(args)
    name = served_model_name(args)
    check_lora_modules(engine_args, parse_lora_modules(getattr(args, "lora_modules", None)), name)
    # Bind before the engine starts (a port in use fails fast), announce once connections are accepted.
    sock = _listen_socket(args.host, args.port, reuse_port=count > 1)
    port = sock.getsockname()[1]
    core = start_engine_core(engine_args)
    status = 0
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if count == 1:
            def announce() -> None:   # once requests are served at once (not queued behind the start-up)
                print(f"serving {name!r} on {_scheme(args)}://{args.host}:{port} (engine core: pid {core.process.pid})",
                      flush=True)
            status = _run_frontend(args, core.address, core.info, sock, announce)
        else:
            status = _supervise(args, core, port, count, name, sock)
    except KeyboardInterrupt:
        status = 0
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        core.shutdown()
        sock.close()
    if status:
        raise SystemExit(status)


def _stop_frontends(frontends: list, grace_s: float) -> None:
    """Stop the API server processes still running: SIGTERM (each drains for grace_s, DrainingServer), or SIGUSR1
    when grace_s is 0 (each ends its streams at once); SIGKILL for any still there SHUTDOWN_FLUSH_S + 2 s after
    its deadline. Leaves no process."""
    import signal
    import time

    for process in frontends:
        if process.is_alive():
            try:
                os.kill(process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGUSR1)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s + SHUTDOWN_FLUSH_S + 2.0
    for process in frontends:
        process.join(max(deadline - time.monotonic(), 0.0))
    for process in frontends:
        if process.is_alive():
            logger.error("%s (pid %d) did not stop in time: killed", process.name, process.pid)
            process.kill()
            process.join(5)


def _supervise(args, core, port: int, count: int, name: str, sock: socket.socket) -> int:
    """Start `count` API server processes on `port` and wait: the first process (or the core) to exit ends the
    others at once (status 1); Ctrl-C/SIGTERM ends them all, each draining for --shutdown-timeout (status 0).
    `sock`, this process's listening socket on the port
    (it held the port while the core started), is closed once the API servers listen on it: with SO_REUSEPORT the
    kernel spreads connections over every listening socket of the port, and one left open here, never accepted,
    held a third of the connections (of 2 API servers) unanswered."""
    import multiprocessing
    import time
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("spawn")
    frontends = []
    try:
        # All started at once, then waited for (one after the other, each start-up's imports waited for the last's:
        # 7 s more per process on 2 cores).
        receivers = []
        for i in range(count):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_frontend_process_main, name=f"api-server-{i}",
                                      args=(args, core.address, core.info, port, sender))
            process.start()
            sender.close()
            frontends.append(process)
            receivers.append(receiver)
        deadline = time.monotonic() + 300
        for i, receiver in enumerate(receivers):
            if not receiver.poll(max(deadline - time.monotonic(), 0.0)) or not isinstance(receiver.recv(), int):
                raise RuntimeError(f"API server process {i} did not start")
        sock.close()
        print(f"serving {name!r} on {_scheme(args)}://{args.host}:{port} ({count} API server processes, engine core: pid "
              f"{core.process.pid})", flush=True)
        watched = {p.sentinel: p for p in frontends}
        watched[core.process.sentinel] = core.process
        ended = wait(list(watched))
        process = watched[ended[0]]
        logger.error("%s (pid %d) exited with status %s: shutting the server down", process.name, process.pid,
                     process.exitcode)
        _stop_frontends(frontends, 0.0)
        return 1
    except KeyboardInterrupt:
        _stop_frontends(frontends, args.shutdown_timeout)
        return 0
    finally:   # a failed start, or a second Ctrl-C while stopping: no process is left behind
        for process in frontends:
            if process.is_alive():
                process.kill()
                process.join(5)


class ServerThread:
    """Run an app with uvicorn on a background thread, on a free port of 127.0.0.1 (tests, benchmarks).

        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, *, host: str = "127.0.0.1", startup_timeout_s: float = 30.0, root_path: str = ""):
        import threading

        import uvicorn

        self.sock = _listen_socket(host, 0, reuse_port=False)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", root_path=root_path))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="uvicorn")
        self.startup_timeout_s = startup_timeout_s

    def __enter__(self) -> "ServerThread":
        import time

        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
