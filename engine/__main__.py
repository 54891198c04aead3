"""Command line: `python -m engine generate "prompt"`, `python -m engine chat`, `python -m engine download`,
`python -m engine serve [MODEL]` (an OpenAI-compatible server; needs the `serve` extra). The engine options
(--model, --max-model-len, --gpu-memory-utilization, ...) are EngineArgs' (engine/engine_args.py), the same for
every command and for `engine.LLM`. generate and chat print the text as the engine produces it.

The default model is SmolLM2-135M-Instruct, converted on first use (see engine/default_model.py)."""
import argparse
import importlib
import json
import signal
import sys

# What `serve` imports beyond the main dependencies (the `serve` extra; openai there is for clients only).
SERVE_MODULES = ("pydantic", "fastapi", "uvicorn", "prometheus_client", "zmq", "msgpack")
SERVE_INSTALL = 'pip install -c .ci/constraints.txt -e ".[serve]"'


class MissingExtraError(Exception):
    """A command needs an optional extra that is not installed; the message says what to install."""


def _add_sampling_args(parser: argparse.ArgumentParser, *, temperature: float, top_p: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default {temperature})")
    parser.add_argument("--top-p", type=float, default=top_p)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


def _build(args):
    from engine import LLM, SamplingParams
    from engine.engine_args import EngineArgs

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    engine_args = EngineArgs.from_cli_args(args)
    return LLM(engine_args.resolved_model(), **engine_args.engine_kwargs()), params   # LLM's kwargs are the fields


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form of --allowed-origins and its kin)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings, e.g. \'["https://example.com"]\', got {text!r}')
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server-only options (vLLM's names); the engine options come from EngineArgs."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None, help="model name in the API (default: the model)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics unless "
                            "--disable-metrics-auth)")
    group.add_argument("--disable-metrics-auth", action="store_true",
                       help="with --api-key, serve /metrics without the key (for a scraper that sends none)")
    group.add_argument("--chat-template", default=None,
                       help="chat template (a file, or the template itself) instead of the tokenizer's")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat_template (it runs on the server)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice 'auto': parse tool calls from the output (needs --tool-call-parser)")
    group.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                       help="how tool calls are written by the model: hermes (<tool_call>{...}</tool_call>, "
                            "Qwen2/3) or llama3_json ({\"name\": ..., \"parameters\": ...})")
    group.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                       help="move <think>...</think> text to reasoning_content")
    group.add_argument("--special-tokens-in-messages", choices=("escape", "reject", "allow"), default="escape",
                       help="special-token text (e.g. <|im_end|>) in the content of user and tool messages: escape "
                            "(default: it stays text, tokenized as such), reject (400), allow (it becomes control "
                            "tokens, as in transformers and vLLM: a client can forge turns, a system one included)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds the requests in flight get to finish; then every stream "
                            "still open ends with an error event and [DONE] and the server exits (default 30)")
    group.add_argument("--request-header-timeout", type=float, default=10.0,
                       help="seconds a connection gets to send a request's headers (408, or closed if it sent "
                            "nothing; 0: no limit; default 10)")
    group.add_argument("--request-body-timeout", type=float, default=60.0,
                       help="seconds a request gets to send its body (408; 0: no limit; default 60)")
    group.add_argument("--limit-concurrency", type=int, default=None,
                       help="connections each API server process keeps open at most; one more gets a 503 and is "
                            "closed (default: what the open-files limit leaves after 256)")
    group.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="uvicorn's log level (--uvicorn-log-level: vLLM's name)")
    group.add_argument("--allowed-origins", type=_json_strings, default=["*"],
                       help='origins whose pages a browser lets call the server (CORS), a JSON list '
                            '(default ["*"]: any, as vLLM)')
    group.add_argument("--allowed-methods", type=_json_strings, default=["*"], help="CORS methods, a JSON list")
    group.add_argument("--allowed-headers", type=_json_strings, default=["*"], help="CORS headers, a JSON list")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (with --ssl-certfile)")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate chain")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates against")
    group.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    group.add_argument("--root-path", default="",
                       help="the path prefix a proxy serves the server under (FastAPI's root_path)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc or /openapi.json")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="every response carries X-Request-Id (the request's own, else a fresh one)")
    request_logs = group.add_mutually_exclusive_group()
    request_logs.add_argument("--enable-log-requests", action="store_true",
                              help="log each request's prompt and sampling parameters at INFO (vLLM's)")
    request_logs.add_argument("--disable-log-requests", action="store_true",
                              help="vLLM's older flag: no request contents are logged, the default here")
    group.add_argument("--max-log-len", type=_non_negative_int, default=None,
                       help="with --enable-log-requests, the most prompt characters (and token ids) a log line "
                            "shows (default: all)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served as models of their own names (with --enable-lora): NAME=PATH, or "
                            "vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    group.add_argument("--api-server-count", type=int, default=1,
                       help="API server processes (HTTP, tokenization, chat templates, streaming) in front of the "
                            "one engine core process, sharing the port")


class _DeferredInterrupt:
    """While active, Ctrl-C (SIGINT) only sets `.requested`: the reply loop stops between two engine steps and
    aborts its request, instead of a KeyboardInterrupt landing in the middle of a step (which would leave the
    scheduler's state half-updated)."""

    def __enter__(self) -> "_DeferredInterrupt":
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _print_stream(llm, prompt, params, *, chat: bool, interrupt: _DeferredInterrupt | None = None) -> str:
    """Print the completion as it grows; return the text printed. With `interrupt`, a Ctrl-C stops the reply
    after the current step (the request is aborted)."""
    pieces = []
    stream = llm.stream_text(prompt, params, chat=chat)
    try:
        for piece in stream:
            print(piece, end="", flush=True)
            pieces.append(piece)
            if interrupt is not None and interrupt.requested:
                break
    finally:
        stream.close()   # aborts the request when it has not finished
    print(flush=True)
    return "".join(pieces)


def cmd_generate(args) -> None:
    llm, params = _build(args)
    if args.chat:
        _print_stream(llm, [{"role": "user", "content": args.prompt}], params, chat=True)
    else:
        _print_stream(llm, args.prompt, params, chat=False)


def cmd_chat(args) -> None:
    """One user message per stdin line. Ctrl-C during a reply stops that reply and the chat goes on; Ctrl-C or
    EOF at the prompt (or "exit", "quit") ends the chat."""
    llm, params = _build(args)
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() in ("exit", "quit"):
                break
            if not line.strip():
                continue
            conversation.append({"role": "user", "content": line.rstrip("\n")})
            with _DeferredInterrupt() as interrupt:
                reply = _print_stream(llm, conversation, params, chat=True, interrupt=interrupt)
            # A stopped reply stays in the conversation as far as it was shown (as vLLM-style chat CLIs do): the
            # model's context is then what the user saw, and the next message can refer to it.
            conversation.append({"role": "assistant", "content": reply})
            if interrupt.requested:
                print("[reply stopped; Ctrl-C at the prompt ends the chat]", file=sys.stderr, flush=True)
    except KeyboardInterrupt:   # Ctrl-C at the prompt: end the chat like EOF
        print(flush=True)


def cmd_download(args) -> None:
    from engine.default_model import default_model_path
    print(default_model_path())


def cmd_serve(args) -> None:
    for name in SERVE_MODULES:   # before any model is loaded
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing = e.name if isinstance(e, ModuleNotFoundError) and e.name else None
            why = f"{missing.split('.')[0]} is not installed" if missing else f"importing {name} failed: {e}"
            raise MissingExtraError(f"`serve` needs the serve extra ({why}); install it with: {SERVE_INSTALL}") from None
    from engine.entrypoints.openai.api_server import exit_now, run_server
    try:
        run_server(args)
    except SystemExit as e:   # a process of the server died: status 1
        exit_now(e.code if isinstance(e.code, int) else 1)
    exit_now(0)   # shut down in order: no interpreter teardown to wait for (see exit_now)


def build_parser() -> argparse.ArgumentParser:
    from engine.engine_args import EngineArgs

    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the completion")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen, temperature=0.0, top_p=1.0)
    chat = sub.add_parser("chat", help="interactive chat: one user message per stdin line (Ctrl-C stops a "
                                           "reply; 'exit', EOF or Ctrl-C at the prompt ends)")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat)
    # SmolLM2-Instruct's recommended chat sampling.
    _add_sampling_args(chat, temperature=0.2, top_p=0.9)
    sub.add_parser("download", help="fetch and convert the default model; print its directory")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    EngineArgs.add_cli_args(serve, positional_model=True)
    _add_serve_args(serve)
    parser.subcommands = {"generate": gen, "chat": chat, "serve": serve}
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, an unknown option reported with the usage of its subcommand (argparse would print the
    top-level usage, which lists no option of the command the user typed)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        subparser = getattr(parser, "subcommands", {}).get(args.command, parser)
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat, "download": cmd_download, "serve": cmd_serve}[args.command](args)
    except (ValueError, MissingExtraError) as e:
        parser.exit(2, f"error: {e}\n")
    except KeyboardInterrupt:   # Ctrl-C while loading or generating: no traceback (130 = killed by SIGINT)
        print(file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
