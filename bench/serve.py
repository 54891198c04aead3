"""Serving benchmark: a load generator against an OpenAI-compatible server (vLLM's benchmark_serving, small).

    python -m bench.serve --launch --num-prompts 32 --max-concurrency 8            # starts `engine serve` itself
    python -m bench.serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Each streams from /v1/completions with `ignore_eos` and `max_tokens` set to its
drawn output length, so the output lengths are exactly the drawn ones. Datasets:
- `random`: input and output lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)];
- `sharegpt-shaped`: lengths from log-normal fits of ShareGPT conversations (input median ~180 tokens,
  output median ~150, long tails), clipped to --max-input-len / --max-output-len. The lengths only, not the text.
With a tokenizer (--tokenizer, or the launched model's) prompts are random token ids (exact input lengths);
without one they are random words, and the input token counts come from the server's `usage`.

Reported, as vLLM does: request throughput, output and total token throughput; TTFT (time to first token),
TPOT (time per output token after the first, per request), ITL (gaps between streamed chunks) and E2EL
(end-to-end latency) as mean / median / p99 in ms; failed requests. `--out DIR` writes
DIR/<date>-<device>-serve.json with the arguments and the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

# Log-normal fits (of ln tokens) to ShareGPT-V3 conversations as tokenized by Llama tokenizers: first human
# turn ~ exp(5.2) = 180 tokens, first reply ~ exp(5.0) = 150 tokens.
SHAREGPT_INPUT_LOG_MEAN, SHAREGPT_INPUT_LOG_STD = 5.2, 1.1
SHAREGPT_OUTPUT_LOG_MEAN, SHAREGPT_OUTPUT_LOG_STD = 5.0, 0.9

_WORDS = ("time river table light north paper music garden window story number market village winter "
          "bridge forest letter engine silver morning").split()


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    input_len: int | None   # None: unknown until the server's usage says
    output_len: int


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


# -- datasets -------------------------------------------------------------------------------------------------
def make_requests(args, tokenizer) -> list[BenchRequest]:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        def uniform(length):
            low, high = max(int(length * (1 - args.random_range_ratio)), 1), int(length * (1 + args.random_range_ratio))
            return rng.integers(low, high + 1, size=n)
        input_lens, output_lens = uniform(args.random_input_len), uniform(args.random_output_len)
    else:
        input_lens = np.exp(rng.normal(SHAREGPT_INPUT_LOG_MEAN, SHAREGPT_INPUT_LOG_STD, n)).astype(int)
        output_lens = np.exp(rng.normal(SHAREGPT_OUTPUT_LOG_MEAN, SHAREGPT_OUTPUT_LOG_STD, n)).astype(int)
    input_lens = np.clip(input_lens, 4, args.max_input_len)
    output_lens = np.clip(output_lens, 1, args.max_output_len)
    if tokenizer is not None:
        special = set(tokenizer.all_special_ids)
        vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
        return [BenchRequest(rng.choice(vocab, size=int(i)).tolist(), int(i), int(o))
                for i, o in zip(input_lens, output_lens)]
    return [BenchRequest(" ".join(rng.choice(_WORDS, size=int(i))), None, int(o))
            for i, o in zip(input_lens, output_lens)]


# -- one request ------------------------------------------------------------------------------------------------
async def send_request(http, url: str, model: str, request: BenchRequest, headers: dict) -> RequestResult:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(input_len=request.input_len or 0)
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[len("data: "):])
                if "error" in payload:
                    result.error = payload["error"].get("message", "error")
                    return result
                if payload.get("usage"):
                    result.input_len = payload["usage"]["prompt_tokens"]
                    result.output_len = payload["usage"]["completion_tokens"]
                if payload.get("choices") and payload["choices"][0].get("text"):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, num_chunks = now, num_chunks + 1
        result.latency = time.perf_counter() - start
        result.success = num_chunks > 0 or result.output_len > 0
        if not result.success:
            result.error = "no output"
    except Exception as e:   # a refused connection, a timeout: a failed request, not a crashed benchmark
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(base_url: str, model: str, requests: list[BenchRequest], *, request_rate: float,
                   max_concurrency: int | None, seed: int, api_key: str | None, timeout_s: float
                   ) -> tuple[list[RequestResult], float]:
    import httpx

    rng = np.random.default_rng(seed + 1)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        async def limited(request):
            if semaphore is None:
                return await send_request(http, url, model, request, headers)
            async with semaphore:
                return await send_request(http, url, model, request, headers)

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))   # Poisson arrivals
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# -- report -----------------------------------------------------------------------------------------------------
def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.success]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    ms = lambda values: [1000.0 * v for v in values]   # noqa: E731
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    report = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
              "total_input_tokens": total_input, "total_output_tokens": total_output,
              "request_throughput": len(ok) / duration_s, "output_throughput": total_output / duration_s,
              "total_token_throughput": (total_input + total_output) / duration_s}
    for name, values in (("ttft", ms(r.ttft for r in ok)), ("tpot", ms(tpots)),
                         ("itl", ms(x for r in ok for x in r.itl)), ("e2el", ms(r.latency for r in ok))):
        values = list(values)
        for stat, fn in (("mean", np.mean), ("median", np.median), ("p99", lambda v: np.percentile(v, 99))):
            report[f"{stat}_{name}_ms"] = float(fn(values)) if values else None
    report["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return report


def format_report(report: dict) -> str:
    lines = ["{s:=^60}".format(s=" Serving Benchmark Result ")]
    rows = [("Successful requests", report["completed"]), ("Failed requests", report["failed"]),
            ("Benchmark duration (s)", report["duration_s"]),
            ("Total input tokens", report["total_input_tokens"]),
            ("Total generated tokens", report["total_output_tokens"]),
            ("Request throughput (req/s)", report["request_throughput"]),
            ("Output token throughput (tok/s)", report["output_throughput"]),
            ("Total token throughput (tok/s)", report["total_token_throughput"])]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", None))
        rows += [(f"{stat.capitalize()} {name.upper()} (ms)", report[f"{stat}_{name}_ms"])
                 for stat in ("mean", "median", "p99")]
    for label, value in rows:
        if value is None and label.startswith("--"):
            lines.append("{s:-^60}".format(s=f" {label.strip('- ')} "))
        else:
            lines.append(f"{label:<44}{value:>16.2f}" if isinstance(value, float) else f"{label:<44}{value!s:>16}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines + ["=" * 60])


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    # The load average tells whether other processes shared the machine during the run.
    info = {"cpu": cpu, "num_cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
            "python": platform.python_version(), "gpu": None}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


# -- launching a server -----------------------------------------------------------------------------------------
class LaunchedServer:
    """`python -m engine serve` in a subprocess on a free loopback port."""

    def __init__(self, model: str | None, serve_args: list[str], startup_timeout_s: float = 300.0):
        command = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--log-level", "warning", *(["--model", model] if model else []), *serve_args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + startup_timeout_s
        output = []
        while True:
            line = self.process.stdout.readline()
            output.append(line)
            match = re.search(r"serving '(.*)' on (http://\S+)", line)
            if match:
                self.model, self.url = match.group(1), match.group(2)
                break
            if (not line and self.process.poll() is not None) or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the server did not start:\n" + "".join(output[-20:]))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name in the API (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (Poisson arrivals); inf: all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--dataset", choices=("random", "sharegpt-shaped"), default="random")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=512)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory: prompts of random token ids")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--launch", action="store_true", help="start `python -m engine serve` (default model: SmolLM2)")
    parser.add_argument("--launch-model", default=None, help="model directory for --launch")
    parser.add_argument("--serve-args", default="", help="extra `engine serve` arguments for --launch")
    parser.add_argument("--out", default=None, help="directory for <date>-<device>-serve.json")
    parser.add_argument("--json", default=None, help="write the report to this file")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be > 0")

    server = None
    try:
        base_url, tokenizer_path = args.base_url, args.tokenizer
        if args.launch:
            from engine.default_model import default_model_path

            model_dir = args.launch_model or default_model_path()
            server = LaunchedServer(model_dir, shlex.split(args.serve_args))
            base_url, tokenizer_path = server.url, tokenizer_path or model_dir
        tokenizer = None
        if tokenizer_path:
            from engine.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(tokenizer_path)
        model = args.model or _first_model(base_url, args.api_key)
        requests = make_requests(args, tokenizer)
        results, duration = asyncio.run(run_load(
            base_url, model, requests, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
            seed=args.seed, api_key=args.api_key, timeout_s=args.timeout))
    finally:
        if server is not None:
            server.close()
    report = summarize(results, duration)
    print(format_report(report))
    config = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()}
    full = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": model,
            "machine": machine(), "args": config, "result": report,
            "per_request": [asdict(r) | {"itl": None} for r in results]}
    paths = [args.json] if args.json else []
    if args.out:
        device = "gpu" if full["machine"]["gpu"] else "cpu"
        paths.append(os.path.join(args.out, f"{datetime.date.today().isoformat()}-{device}-serve.json"))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(full, f, indent=1)
        print(f"wrote {path}")
    return full


if __name__ == "__main__":
    main()
