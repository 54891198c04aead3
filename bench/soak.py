"""Soak test of `python -m engine serve`: a fixed count of mixed requests at a fixed concurrency, reported per
window of requests (1,000 by default), to show that nothing fails and nothing leaks over time.

    PYTHONPATH=. python -m bench.soak --launch --num-requests 10000 --out bench/results    # SmolLM2, concurrency 32
    PYTHONPATH=. python -m bench.soak --launch --small                                     # a minute: does it work
    PYTHONPATH=. python -m bench.soak --base-url http://127.0.0.1:8000 --server-pid PID ...

The load (closed loop: `--concurrency` clients, each sending its next request when the last one ends), drawn from
`--seed`: /v1/completions and /v1/chat/completions, streamed and not, n from 1 to 4, logprobs, stop strings,
structured outputs (guided_choice, guided_regex, guided_json, response_format json_object), and streams the client
abandons after a random number of events (an abort at a random point). Every answer is checked: its status, its
choices (count, finish reasons, a guided choice among the choices, JSON that parses, no stop string left in the
text), `[DONE]` at the end of a stream, usage within n x max_tokens. Anything else is an error; a 5xx, or an in-band
error of type internal_server_error, is also a 5xx.

Per window of `--window` requests (in the order they complete): errors, 5xx, aborts; p50 / p99 TTFT (streamed
requests: to the first event with text) and TPOT ((latency - TTFT) / (completion tokens - 1), from the streamed
usage); and the RSS of every process of the server (the `serve` process, the engine core, API servers, chat-template
workers), read when the window ends. The first window is the warm-up (the KV cache is committed at start-up, but
allocator pools, compiled grammars and caches fill during it); the RSS drift of each process is measured from the
end of the 2nd window to the end of the last (goal: within 2%). After the load the server must be idle: no request
running or waiting, KV-cache usage 0.

The JSON (`--out DIR`: DIR/<date>-soak-<cpu>.json, or `--json FILE`) holds the machine, the arguments, every window
and the summary; the table is printed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

_WORDS = ("time river table light north paper music garden window story number market village winter bridge "
          "forest letter engine silver morning the and of a to in is it that was").split()
STOPS = (" the", ".", "\n", " and", ",")
CHOICES = ["yes", "no", "maybe"]
JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@dataclass(slots=True)
class SoakRequest:
    index: int
    path: str                  # "/v1/completions" | "/v1/chat/completions"
    body: dict
    stream: bool
    n: int
    abort_after: int | None    # streamed: close after this many events (an abort at a random point)
    guided: str | None         # "choice" | "regex" | "json" | None


@dataclass(slots=True)
class Outcome:
    index: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    is_5xx: bool = False
    aborted: bool = False
    ttft: float | None = None
    tpot: float | None = None
    finished_at: float = 0.0


# -- the load -----------------------------------------------------------------------------------------------------
def make_requests(count: int, model: str, seed: int, *, max_tokens: tuple[int, int],
                  max_prompt_words: int = 64) -> list[SoakRequest]:
    """`count` requests of the mix (see the module docstring), drawn from `seed`; prompts of 8 to
    max_prompt_words words."""
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(count):
        chat = rng.random() < 0.5
        stream = rng.random() < 0.6
        n = int(rng.choice([1, 2, 3, 4], p=[0.55, 0.2, 0.15, 0.1]))
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(min(8, max_prompt_words), max_prompt_words + 1))))
        body: dict = {"model": model, "n": n, "max_tokens": int(rng.integers(max_tokens[0], max_tokens[1] + 1)),
                      "temperature": float(rng.choice([0.0, 0.7])), "stream": stream}
        if rng.random() < 0.3:
            body["seed"] = int(rng.integers(0, 2 ** 31))
        if chat:
            path = "/v1/chat/completions"
            messages = [{"role": "user", "content": words}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": "You are terse."})
            body["messages"] = messages
            if rng.random() < 0.3:
                body["logprobs"] = True
                body["top_logprobs"] = int(rng.integers(0, 6))
        else:
            path = "/v1/completions"
            body["prompt"] = words
            if rng.random() < 0.3:
                body["logprobs"] = int(rng.integers(0, 6))
        guided = None
        draw = rng.random()
        if draw < 0.15:
            guided = str(rng.choice(["choice", "regex", "json"]))
            if guided == "choice":
                body["guided_choice"] = CHOICES
            elif guided == "regex":
                body["guided_regex"] = "[0-9]{1,4}"
            elif chat and rng.random() < 0.5:
                body["response_format"] = {"type": "json_object"}
            else:
                body["guided_json"] = JSON_SCHEMA
            body["max_tokens"] = max(body["max_tokens"], 24)
        elif draw < 0.45:
            body["stop"] = [str(s) for s in rng.choice(STOPS, size=int(rng.integers(1, 3)), replace=False)]
        if stream:
            body["stream_options"] = {"include_usage": True}
        abort_after = int(rng.integers(0, 6)) if stream and rng.random() < 0.1 else None
        requests.append(SoakRequest(index, path, body, stream, n, abort_after, guided))
    return requests


def _check_choice(request: SoakRequest, text: str, finish_reason, stop_reason) -> str | None:
    """What is wrong with one finished choice, None when nothing."""
    if finish_reason not in ("stop", "length"):
        return f"finish_reason {finish_reason!r}"
    if finish_reason == "stop":
        if request.guided == "choice" and text not in CHOICES:
            return f"guided_choice gave {text[:40]!r}"
        if request.guided == "regex" and not re.fullmatch(r"[0-9]{1,4}", text):
            return f"guided_regex gave {text[:40]!r}"
        if request.guided == "json":
            try:
                value = json.loads(text)
            except ValueError:
                return f"guided JSON does not parse: {text[:40]!r}"
            if not isinstance(value, dict):
                return f"guided JSON is not an object: {text[:40]!r}"
    for stop in request.body.get("stop") or ():
        if stop in text:
            return f"stop string {stop!r} left in the text"
    return None


def _text_of(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


async def run_one(http, base_url: str, request: SoakRequest, headers: dict) -> Outcome:
    outcome = Outcome(request.index)
    chat = request.path.endswith("chat/completions")
    start = time.perf_counter()
    try:
        if not request.stream:
            response = await http.post(base_url + request.path, json=request.body, headers=headers)
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.is_5xx = response.status_code >= 500
                outcome.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return outcome
            reply = response.json()
            choices = reply["choices"]
            if len(choices) != request.n:
                outcome.error = f"{len(choices)} choices for n={request.n}"
                return outcome
            for choice in choices:
                problem = _check_choice(request, _text_of(choice, chat), choice["finish_reason"],
                                        choice.get("stop_reason"))
                if problem is None and ("logprobs" in request.body and request.body["logprobs"] is not False
                                        and choice.get("logprobs") is None):
                    problem = "logprobs missing"
                if problem:
                    outcome.error = problem
                    return outcome
            usage = reply["usage"]["completion_tokens"]
            if not request.n <= usage <= request.n * request.body["max_tokens"]:
                outcome.error = f"usage.completion_tokens {usage}"
                return outcome
            outcome.ok = True
            return outcome
        texts: dict[int, str] = {}
        finishes: dict[int, tuple] = {}
        usage = None
        events = 0
        done = False
        async with http.stream("POST", base_url + request.path, json=request.body, headers=headers) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.is_5xx = response.status_code >= 500
                outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if request.abort_after is not None and events >= request.abort_after:
                    outcome.aborted = outcome.ok = True   # leave mid-stream: the server aborts the request
                    return outcome
                events += 1
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    error = payload["error"]
                    outcome.is_5xx = error.get("type") == "internal_server_error"
                    outcome.error = f"in-band error: {error.get('message', '')[:200]}"
                    return outcome
                for choice in payload.get("choices", ()):
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if outcome.ttft is None:
                            outcome.ttft = time.perf_counter() - start
                        texts[choice["index"]] = texts.get(choice["index"], "") + piece
                    if choice.get("finish_reason") is not None:
                        finishes[choice["index"]] = (choice["finish_reason"], choice.get("stop_reason"))
                usage = payload.get("usage") or usage
        if not done:
            outcome.error = "the stream ended without [DONE]"
            return outcome
        if sorted(finishes) != list(range(request.n)):
            outcome.error = f"finish reasons for choices {sorted(finishes)} of n={request.n}"
            return outcome
        for index, (finish_reason, stop_reason) in finishes.items():
            problem = _check_choice(request, texts.get(index, ""), finish_reason, stop_reason)
            if problem:
                outcome.error = problem
                return outcome
        if usage is None:
            outcome.error = "no usage in the stream"
            return outcome
        tokens = usage["completion_tokens"]
        if not request.n <= tokens <= request.n * request.body["max_tokens"]:
            outcome.error = f"usage.completion_tokens {tokens}"
            return outcome
        latency = time.perf_counter() - start
        per_choice = tokens / request.n
        if outcome.ttft is not None and per_choice > 1:
            outcome.tpot = (latency - outcome.ttft) / (per_choice - 1)
        outcome.ok = True
        return outcome
    except Exception as e:   # a refused or cut connection, a timeout, a body that is not JSON: an error
        outcome.error = f"{type(e).__name__}: {str(e)[:200]}"
        return outcome
    finally:
        outcome.finished_at = time.perf_counter()


# -- the server's processes ---------------------------------------------------------------------------------------
def process_tree(root: int) -> list[int]:
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        pids.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                frontier += [int(child) for child in f.read().split()]
        except OSError:
            pass
    return pids


def process_role(pid: int, root: int, core_pid: int | None) -> str:
    if pid == root:
        return "serve"
    if pid == core_pid:
        return "engine-core"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "chat_template_sandbox" in cmdline:
        return "chat-template-worker"
    if "resource_tracker" in cmdline:
        return "resource-tracker"
    # The other processes `serve` spawns are its API servers (the core's pid is known when it was launched here).
    return "api-server" if "multiprocessing" in cmdline and core_pid is not None else "child"


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def sample_rss(root: int | None, core_pid: int | None) -> dict[str, dict]:
    """{pid: {"role", "rss_mb"}} of every process of the server now."""
    if root is None:
        return {}
    sample = {}
    for pid in process_tree(root):
        rss = rss_bytes(pid)
        if rss is not None:
            sample[str(pid)] = {"role": process_role(pid, root, core_pid), "rss_mb": rss / 2 ** 20}
    return sample


# -- the run ------------------------------------------------------------------------------------------------------
async def run_soak(base_url: str, requests: list[SoakRequest], *, concurrency: int, window: int, api_key: str | None,
                   timeout_s: float, server_pid: int | None, core_pid: int | None) -> tuple[list[Outcome], list[dict]]:
    """Run every request with `concurrency` clients; returns the outcomes (in completion order) and one RSS sample
    per window (taken as its last request completes)."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    outcomes: list[Outcome] = []
    samples: list[dict] = []
    queue = iter(requests)

    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def client() -> None:
            for request in queue:   # shared: each request is taken once
                outcomes.append(await run_one(http, base_url, request, headers))
                if len(outcomes) % window == 0:
                    samples.append(sample_rss(server_pid, core_pid))
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return outcomes, samples


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1000.0) if values else None


def summarize(outcomes: list[Outcome], samples: list[dict], window: int) -> dict:
    windows = []
    for start in range(0, len(outcomes), window):
        part = outcomes[start:start + window]
        ttfts = [o.ttft for o in part if o.ok and o.ttft is not None and not o.aborted]
        tpots = [o.tpot for o in part if o.ok and o.tpot is not None]
        index = start // window
        windows.append({
            "window": index + 1, "requests": len(part), "errors": sum(not o.ok for o in part),
            "5xx": sum(o.is_5xx for o in part), "aborted": sum(o.aborted for o in part),
            "p50_ttft_ms": percentile_ms(ttfts, 50), "p99_ttft_ms": percentile_ms(ttfts, 99),
            "p50_tpot_ms": percentile_ms(tpots, 50), "p99_tpot_ms": percentile_ms(tpots, 99),
            "rss": samples[index] if index < len(samples) else None,
            "error_examples": sorted({o.error for o in part if o.error})[:5]})
    drift = {}
    complete = [w["rss"] for w in windows if w["rss"]]
    if len(complete) >= 2:   # from the end of the 2nd window (after the warm-up) to the end of the last
        first, last = complete[1] if len(complete) > 2 else complete[0], complete[-1]
        for pid, entry in last.items():
            if pid in first:
                before = first[pid]["rss_mb"]
                drift[pid] = {"role": entry["role"], "from_mb": before, "to_mb": entry["rss_mb"],
                              "drift": (entry["rss_mb"] - before) / before if before else None}
    per_1000 = 1000.0 / max(len(outcomes), 1)
    drifts = [d["drift"] for d in drift.values() if d["drift"] is not None]
    return {"requests": len(outcomes), "errors": sum(not o.ok for o in outcomes),
            "5xx": sum(o.is_5xx for o in outcomes), "aborted": sum(o.aborted for o in outcomes),
            "errors_per_1000": sum(not o.ok for o in outcomes) * per_1000,
            "5xx_per_1000": sum(o.is_5xx for o in outcomes) * per_1000,
            "rss_drift": drift, "max_rss_drift": max(drifts, key=abs) if drifts else None,
            "rss_flat_within_2_percent": all(abs(d) <= 0.02 for d in drifts) if drifts else None,
            "windows": windows}


def format_report(summary: dict) -> str:
    def cell(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)
    lines = [f"{'window':>6} {'requests':>8} {'errors':>6} {'5xx':>4} {'aborted':>7} {'p50 TTFT':>9} {'p99 TTFT':>9} "
             f"{'p50 TPOT':>9} {'p99 TPOT':>9}  RSS MB per process (role:pid)"]
    for w in summary["windows"]:
        rss = " ".join(f"{e['role']}:{pid}={e['rss_mb']:.0f}" for pid, e in sorted((w["rss"] or {}).items()))
        lines.append(f"{w['window']:>6} {w['requests']:>8} {w['errors']:>6} {w['5xx']:>4} {w['aborted']:>7} "
                     f"{cell(w['p50_ttft_ms']):>9} {cell(w['p99_ttft_ms']):>9} {cell(w['p50_tpot_ms']):>9} "
                     f"{cell(w['p99_tpot_ms']):>9}  {rss}")
        for example in w["error_examples"]:
            lines.append(f"{'':>6} error: {example}")
    for pid, d in sorted(summary["rss_drift"].items()):
        lines.append(f"RSS drift {d['role']}:{pid} {d['from_mb']:.1f} -> {d['to_mb']:.1f} MB "
                     f"({cell(d['drift'] and 100 * d['drift'], '{:+.2f}')} %)")
    lines.append(f"errors per 1000: {summary['errors_per_1000']:.2f}, 5xx per 1000: {summary['5xx_per_1000']:.2f}, "
                 f"RSS flat within 2%: {summary['rss_flat_within_2_percent']}, idle after: {summary.get('idle_after')}")
    return "\n".join(lines)


def idle_after(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> dict:
    """The server's gauges once the load is over (polled until nothing runs or waits, up to timeout_s)."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
        gauges = {name: float(re.search(rf"^engine_{name} (\S+)$", text, re.M).group(1))
                  for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio")}
        if (gauges["num_requests_running"] == gauges["num_requests_waiting"] == 0
                and gauges["kv_cache_usage_ratio"] == 0) or time.monotonic() > deadline:
            gauges["idle"] = gauges["num_requests_running"] == gauges["num_requests_waiting"] == 0 and \
                gauges["kv_cache_usage_ratio"] == 0
            return gauges
        time.sleep(0.1)


class LaunchedServer:
    """`python -m engine serve` in a subprocess on a free loopback port, its output in a file (a pipe nobody
    reads would fill and block the server during a long run)."""

    def __init__(self, model: str, serve_args: list[str], startup_timeout_s: float = 600.0):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="soak-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "engine", "serve", model, "--host", "127.0.0.1", "--port", "0",
                   "--log-level", "warning", *serve_args]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            with open(self.log.name) as f:
                output = f.read()
            match = re.search(r"serving '(.*)' on (http://\S+?)\s.*?engine core: pid (\d+)", output)
            if match:
                self.model, self.url, self.core_pid = match.group(1), match.group(2), int(match.group(3))
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the server did not start:\n" + output[-3000:])
            time.sleep(0.2)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def main(argv: list[str] | None = None) -> dict:
    from bench.serve import machine

    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="the server's pid, for the RSS of its processes (with --base-url)")
    parser.add_argument("--model", default=None, help="model name in the API (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--window", type=int, default=1000, help="requests per reported window")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=8, help="max_tokens is drawn in [min, max]")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-words", type=int, default=64, help="prompts have 8 to this many words")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--small", action="store_true",
                        help="a quick check that it works: 96 requests in windows of 32 at concurrency 8")
    parser.add_argument("--launch", action="store_true", help="start `python -m engine serve` (default model: SmolLM2)")
    parser.add_argument("--launch-model", default=None, help="model directory for --launch")
    parser.add_argument("--serve-args", default="", help="extra `engine serve` arguments for --launch")
    parser.add_argument("--out", default=None, help="directory for <date>-soak-<cpu>.json")
    parser.add_argument("--json", default=None, help="write the report to this file")
    args = parser.parse_args(argv)
    if args.small:
        args.num_requests, args.window, args.concurrency = 96, 32, 8
    for name in ("num_requests", "window", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt_words < 1:
        parser.error("--max-prompt-words must be >= 1")
    if not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("--min-tokens and --max-tokens must satisfy 1 <= min <= max")

    server = None
    server_pid, core_pid, base_url = args.server_pid, None, args.base_url.rstrip("/")
    try:
        if args.launch:
            from engine.default_model import default_model_path

            server = LaunchedServer(args.launch_model or default_model_path(), shlex.split(args.serve_args))
            base_url, server_pid, core_pid = server.url, server.process.pid, server.core_pid
        model = args.model
        if model is None:
            import httpx

            headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        requests = make_requests(args.num_requests, model, args.seed, max_tokens=(args.min_tokens, args.max_tokens),
                                 max_prompt_words=args.max_prompt_words)
        started = time.perf_counter()
        outcomes, samples = asyncio.run(run_soak(
            base_url, requests, concurrency=args.concurrency, window=args.window, api_key=args.api_key,
            timeout_s=args.timeout, server_pid=server_pid, core_pid=core_pid))
        duration = time.perf_counter() - started
        summary = summarize(outcomes, samples, args.window)
        summary["duration_s"] = duration
        summary["idle_after"] = idle_after(base_url, args.api_key)
    finally:
        if server is not None:
            server.close()
    print(format_report(summary))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": model,
              "machine": machine(), "args": vars(args), "summary": summary,
              "mix": {"streamed": sum(r.stream for r in requests), "chat": sum("chat" in r.path for r in requests),
                      "n_gt_1": sum(r.n > 1 for r in requests), "guided": sum(r.guided is not None for r in requests),
                      "stop": sum("stop" in r.body for r in requests),
                      "logprobs": sum("logprobs" in r.body for r in requests),
                      "abort_planned": sum(r.abort_after is not None for r in requests)},
              "per_request": [asdict(o) for o in sorted(outcomes, key=lambda o: o.index)]}
    paths = [args.json] if args.json else []
    if args.out:
        cpu = re.sub(r"[^a-z0-9]+", "-", report["machine"]["cpu"].lower()).strip("-")[:40]
        paths.append(os.path.join(args.out, f"{datetime.date.today().isoformat()}-soak-{cpu}.json"))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
