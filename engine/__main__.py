"""Command line: `python -m engine generate "prompt"`, `python -m engine chat`, `python -m engine download`,
`python -m engine serve` (an OpenAI-compatible server; needs the `serve` extra).

The default model is SmolLM2-135M-Instruct, converted on first use (see engine/default_model.py)."""
import argparse
import sys


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")


def _add_sampling_args(parser: argparse.ArgumentParser, *, temperature: float, top_p: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default {temperature})")
    parser.add_argument("--top-p", type=float, default=top_p)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _build(args):
    from engine import LLM, SamplingParams
    from engine.default_model import default_model_path

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=args.stop)
    llm = LLM(args.model or default_model_path(), dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager)
    return llm, params


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")


def cmd_generate(args) -> None:
    llm, params = _build(args)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def cmd_chat(args) -> None:
    llm, params = _build(args)
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("exit", "quit"):
            break
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line.rstrip("\n")})
        reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
        conversation.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def cmd_download(args) -> None:
    from engine.default_model import default_model_path
    print(default_model_path())


def cmd_serve(args) -> None:
    from engine.entrypoints.openai.api_server import run_server
    run_server(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the completion")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _add_model_args(gen)
    _add_sampling_args(gen, temperature=0.0, top_p=1.0)
    chat = sub.add_parser("chat", help="interactive chat: one user message per stdin line ('exit' or EOF ends)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    # SmolLM2-Instruct's recommended chat sampling.
    _add_sampling_args(chat, temperature=0.2, top_p=0.9)
    sub.add_parser("download", help="fetch and convert the default model; print its directory")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _add_model_args(serve)
    _add_serve_args(serve)
    args = parser.parse_args(argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat, "download": cmd_download, "serve": cmd_serve}[args.command](args)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
