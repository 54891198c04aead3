"""The FastAPI app (`build_app`) and `python -m engine serve` (`run_server`).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics. Errors
are OpenAI's JSON: 400 for invalid parameters, malformed JSON and over-long prompts, 401 without the API key
(when one is set), 404 for an unknown model or route."""
import asyncio
import socket
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.serving import OpenAIError, OpenAIServing


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.to_json(), status_code=error.status)


class _APIKeyMiddleware:
    """401 on /v1 routes without `Authorization: Bearer <api_key>`. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would hide client disconnects from the handlers."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                response = _error_response(OpenAIError(401, "Incorrect or missing API key.", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str], api_key: str | None = None) -> FastAPI:
    """The server app around a (not yet started) AsyncLLMEngine; the step loop starts with the app."""
    serving = OpenAIServing(engine, served_model_names)
    metrics = ServerMetrics(served_model_names[0])
    metrics.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="engine OpenAI-compatible server", lifespan=lifespan)
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
    async def http_error(_: Request, error: StarletteHTTPException):
        return _error_response(OpenAIError(error.status_code, str(error.detail),
                                           type="not_found_error" if error.status_code == 404 else "api_error"))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        return _error_response(OpenAIError(500, str(error), type="internal_server_error"))

    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return _respond(await _cancel_on_disconnect(raw_request, serving.create_completion(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return _respond(await _cancel_on_disconnect(raw_request, serving.create_chat_completion(request)))

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
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


# -- `python -m engine serve` (its arguments: engine/__main__.py) ---------------------------------------------
def engine_from_args(args) -> tuple[AsyncLLMEngine, str]:
    from engine.default_model import default_model_path

    model = args.model or default_model_path()
    engine = AsyncLLMEngine.from_args(
        model, dtype=args.dtype, device=args.device, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, seed=args.seed)
    return engine, args.served_model_name or args.model or "SmolLM2-135M-Instruct"


def run_server(args) -> None:
    import uvicorn

    engine, name = engine_from_args(args)
    app = build_app(engine, served_model_names=[name], api_key=args.api_key)
    # Bind before announcing, so "serving on" means connections are accepted.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(f"serving {name!r} on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])


class ServerThread:
    """Run an app with uvicorn on a background thread, on a free port of 127.0.0.1 (tests, benchmarks).

        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, *, host: str = "127.0.0.1", startup_timeout_s: float = 30.0):
        import threading

        import uvicorn

        self.sock = socket.socket(socket.AF_INET)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
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
