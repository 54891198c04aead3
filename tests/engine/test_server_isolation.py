"""No request, however valid or extreme, can fail or stall another (issue 21), driven as a hostile but well-formed
client would: the openai client against `python -m engine serve` (the engine core in its own process) on a tiny
random-weight Llama over loopback, with innocent greedy streams running next to each hostile request and compared
with the same streams run alone, byte for byte.

The cases that need a hook inside the engine (a sampler failing for one request, which thread compiles a
grammar) run against the in-process server (ServerThread + build_app) instead."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.extras import require_serve_extra

openai, httpx = require_serve_extra("openai", "httpx")

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

MODEL = "tiny"
TIMEOUT_S = 120
INNOCENT = ["Once upon a time", "The quick brown fox", "Numbers: 0 1 2 3"]


class ServeProcess:
    """`python -m engine serve` in a subprocess (its own session), on a free loopback port; its output is drained
    on a thread (and kept) so that the server never blocks on a full pipe."""

    def __init__(self, model_dir: str, *extra: str, startup_timeout_s: float = 240.0):
        command = [sys.executable, "-m", "engine", "serve", model_dir, "--served-model-name", MODEL,
                   "--host", "127.0.0.1", "--port", "0", "--max-model-len", "128", "--num-kv-blocks", "2048",
                   "--log-level", "warning", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.lines: list[str] = []
        self.url = None
        started = threading.Event()

        def drain():
            for line in self.process.stdout:
                self.lines.append(line)
                match = re.search(r"serving '.*' on (http://\S+)", line)
                if match:
                    self.url = match.group(1)
                    started.set()
            started.set()
        threading.Thread(target=drain, daemon=True).start()
        if not started.wait(startup_timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def tree(self) -> set[int]:
        """The pids of the server process and all its descendants."""
        pids, frontier = set(), [self.process.pid]
        while frontier:
            pid = frontier.pop()
            pids.add(pid)
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    frontier += [int(child) for child in f.read().split()]
            except OSError:
                pass
        return pids

    def cpu_seconds(self) -> float:
        """CPU time used so far by the server's processes (those alive now)."""
        total = 0
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])   # utime, stime (clock ticks)
        return total / os.sysconf("SC_CLK_TCK")

    def wait_quiet(self, timeout_s: float = 60, interval_s: float = 0.5, busy_fraction: float = 0.1) -> None:
        """Wait until the server's processes use under `busy_fraction` of a core for `interval_s` (chat-template
        workers replacing killed ones import for seconds after the request that killed them has its answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            before = self.cpu_seconds()
            time.sleep(interval_s)
            if self.cpu_seconds() - before < busy_fraction * interval_s:
                return
            assert time.monotonic() < deadline, "the server never went quiet"

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
                raise AssertionError("the server did not stop within the timeout")
        return self.process.returncode


def metric_samples(text: str, name: str) -> list[float]:
    """The values of every sample named `name` (any labels) in a /metrics page (Prometheus' text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: set[int], timeout_s: float = 20.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {pid for pid in pids if _alive(pid)}
        if not left:
            return left
        time.sleep(0.1)
    return {pid for pid in pids if _alive(pid)}


@pytest.fixture(scope="module")
def served(llama_dir):
    server = ServeProcess(llama_dir, "--trust-request-chat-template")
    yield server
    pids = server.tree()
    assert server.stop() == 0
    assert not _wait_gone(pids), "processes left after shutdown"


def stream_text(client, prompt: str, max_tokens: int = 24) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


@pytest.fixture(scope="module")
def reference(served):
    """The innocent streams' greedy texts, each run alone."""
    return [stream_text(served.client, prompt) for prompt in INNOCENT]


def next_to_innocents(served, reference, hostile):
    """Run hostile() while the innocent greedy streams run; they must equal their runs alone. Returns what
    hostile() returned or raised."""
    with ThreadPoolExecutor(len(INNOCENT) + 1) as pool:
        innocents = [pool.submit(stream_text, served.client, prompt) for prompt in INNOCENT]

        def guarded():
            try:
                return hostile()
            except Exception as e:   # noqa: BLE001 - handed to the caller to check
                return e
        result = pool.submit(guarded)
        texts = [f.result(timeout=TIMEOUT_S) for f in innocents]
        result = result.result(timeout=TIMEOUT_S)
    assert texts == reference
    return result


def assert_400(result, param: str):
    assert isinstance(result, openai.BadRequestError), result
    assert result.status_code == 400 and result.body["param"] == param, result.body


# -- item 2: range checks, before the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("field, value, param", [
    ("top_k", 1180591620717411303424, "top_k"), ("top_k", 2 ** 63, "top_k"), ("seed", 2 ** 63, "seed"),
    ("seed", -(2 ** 63) - 1, "seed"), ("max_tokens", 2 ** 64, "max_tokens"), ("min_tokens", 2 ** 63, "min_tokens"),
    ("n", 2 ** 63, "n"), ("n", 10 ** 6, "n"), ("logprobs", 2 ** 63, "logprobs"), ("logprobs", 21, "logprobs"),
    ("prompt_logprobs", 2 ** 64, "prompt_logprobs"), ("truncate_prompt_tokens", 2 ** 63, "truncate_prompt_tokens"),
    ("stop_token_ids", [10 ** 9], "stop_token_ids"), ("stop_token_ids", [2 ** 63], "stop_token_ids"),
    ("allowed_token_ids", [10 ** 9], "allowed_token_ids"), ("logit_bias", {"1000000000": 1}, "logit_bias"),
])
def test_out_of_range_numbers_are_400s_and_disturb_nobody(served, reference, field, value, param):
    body = {"temperature": 1.0, field: value}
    if field != "max_tokens":
        body["max_tokens"] = 4

    def hostile():
        extra = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature", "n", "seed", "logprobs")}
        return served.client.completions.create(
            model=MODEL, prompt="hello", temperature=1.0, extra_body=extra,
            **{k: v for k, v in body.items() if k in ("max_tokens", "n", "seed", "logprobs")})
    assert_400(next_to_innocents(served, reference, hostile), param)


def test_int64_limits_are_served(served, reference):
    def hostile():
        return served.client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=1.0,
                                                seed=-(2 ** 63), extra_body={"top_k": 2 ** 63 - 1})
    result = next_to_innocents(served, reference, hostile)
    assert result.choices[0].finish_reason == "length"


def test_negative_seeds_do_not_collide_with_positive_ones(served):
    def sample(seed):
        return served.client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=1.0,
                                                seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(-1) == sample(-1)
    assert sample(-1) != sample(2 ** 63 - 1)


# -- item 3: nothing heavy on the step loop --------------------------------------------------------------------
def test_a_huge_guided_choice_is_a_fast_400(served, reference):
    choices = [f"option number {i}" for i in range(20_000)]   # ~400 KB: under the body limit, over 64 KiB of spec

    def hostile():
        start = time.monotonic()
        try:
            served.client.completions.create(model=MODEL, prompt="pick", max_tokens=8,
                                             extra_body={"guided_choice": choices})
        except openai.BadRequestError as e:
            assert time.monotonic() - start < 30
            return e
    assert_400(next_to_innocents(served, reference, hostile), "guided_choice")


def test_many_bad_words_are_served_without_disturbing_others(served, reference):
    words = [f"w{i}" for i in range(100_000)]

    def hostile():
        return served.client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0.0,
                                                extra_body={"bad_words": words, "ignore_eos": True})
    result = next_to_innocents(served, reference, hostile)
    assert result.choices[0].finish_reason == "length"


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "did not render within"),
    ("{{ 'x' * 10**9 }}", "more than"),
])
def test_a_hostile_chat_template_is_a_400_and_the_server_lives(served, reference, template, message):
    def hostile():
        return served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, extra_body={"chat_template": template})
    result = next_to_innocents(served, reference, hostile)
    assert_400(result, "messages")
    assert message in result.body["message"]
    assert httpx.get(served.url + "/health", timeout=TIMEOUT_S).status_code == 200
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_two_looping_templates_at_once_time_nobody_else_out(served, reference):
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

    def hostile():
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(served.client.chat.completions.create, model=MODEL, max_tokens=4,
                                 messages=[{"role": "user", "content": "hi"}], extra_body={"chat_template": template})
                     for _ in range(2)]
            errors = []
            for call in calls:
                try:
                    call.result()
                except openai.BadRequestError as e:
                    errors.append(e)
            return errors
    assert len(next_to_innocents(served, reference, hostile)) == 2


# -- item 4: fairness ----------------------------------------------------------------------------------------------
def test_a_heavy_n_request_leaves_others_within_3x_their_latency(served):
    def ordinary() -> float:
        start = time.monotonic()
        served.client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16,
                                         temperature=0.0, extra_body={"ignore_eos": True})
        return time.monotonic() - start

    def unloaded_latency() -> float:
        # Once the server is quiet: one whose chat-template workers were just replaced (the looping-template
        # tests above kill them) spends seconds importing in the background, and on two cores that made requests
        # 1.3-4x slower meanwhile. Quiet: its processes idle for half a second; settled: the last three ordinary
        # requests within 25% of each other.
        served.wait_quiet()
        recent: list[float] = []
        deadline = time.monotonic() + 60
        while True:
            recent = (recent + [ordinary()])[-3:]
            if len(recent) == 3 and max(recent) <= 1.25 * min(recent):
                return statistics.median(recent)
            assert time.monotonic() < deadline, f"the unloaded latency never settled: {recent}"

    def loaded_latency() -> float:
        with ThreadPoolExecutor(1) as pool:
            heavy = pool.submit(served.client.completions.create, model=MODEL, prompt="hello", n=256,
                                max_tokens=100, temperature=1.0, extra_body={"ignore_eos": True})
            deadline = time.monotonic() + 30
            while "vllm:num_requests_running{model_name=\"tiny\"} 1.0" not in httpx.get(served.url + "/metrics").text:
                assert time.monotonic() < deadline and not heavy.done()
                time.sleep(0.05)
            loaded = [ordinary() for _ in range(5)]
            assert not heavy.done(), "the heavy request ended before the measurement: it proves nothing"
            result = heavy.result(timeout=TIMEOUT_S)
        assert len(result.choices) == 256
        return statistics.median(loaded)

    # Three tries: on two cores the core's two torch threads, the API server, the template workers and this client
    # share the CPUs, and a burst of contention (steps of 80-110 ms against 10-15, no garbage collection in
    # them) can inflate one try. Measured on a quiet 2-core EPYC: 2.0-2.6x in a fresh server, 2.0-3.2x here; with
    # the suite's other worker busy beside it, one try in a fresh-clone CI read 3.97x and the next 3.18x, and a busy
    # loop beside it alone put single tries at 17x and 38x, the next at 1.3x and 2.8x.
    ratios = []
    for _ in range(3):
        unloaded = unloaded_latency()
        ratios.append(loaded_latency() / unloaded)
        if ratios[-1] <= 3:
            break
    assert min(ratios) <= 3, ratios


# -- item 5: fields that were wrong or ignored ----------------------------------------------------------------
def test_json_schema_keys_keep_the_schemas_order(served):
    schema = {"type": "object", "properties": {"zeta": {"const": 1}, "alpha": {"const": 2}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    reply = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert list(json.loads(reply.choices[0].message.content)) == ["zeta", "alpha"]


def test_chat_prompt_logprobs_are_returned(served):
    reply = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                  max_tokens=2, extra_body={"prompt_logprobs": 2})
    prompt_logprobs = reply.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == reply.usage.prompt_tokens and prompt_logprobs[0] is None
    assert all(1 <= len(entry) <= 3 and all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())
               for entry in prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=2, stream=True, extra_body={"prompt_logprobs": 2})
    assert info.value.body["param"] == "prompt_logprobs"


def test_continuous_usage_stats(served):
    chunks = list(served.client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 1
    chunks = list(served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(chunk.usage is not None for chunk in chunks)


def test_metrics_have_inter_token_latency_and_queue_time(served):
    served.client.completions.create(model=MODEL, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(served.url + "/metrics", timeout=TIMEOUT_S).text
    for name in ("vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds"):
        count = re.search(rf'^{re.escape(name)}_count{{model_name="tiny"}} (\S+)$', text, re.M)
        assert count and float(count.group(1)) > 0, name


# -- item 1: the processes ----------------------------------------------------------------------------------------
def long_streams(server, count: int, max_tokens: int = 1000, started: int | None = None):
    """Start `count` streams, each on a connection of its own (so that --api-server-count spreads them); returns
    (futures of each stream's (events, end time), the exception that cut it, or {"status", "error"} for a request
    answered with an HTTP error before any event; the pool). Returns once every stream has its first event
    (`started`: once that many have)."""
    pool = ThreadPoolExecutor(count)
    first_events = [threading.Event() for _ in range(count)]

    def stream(i: int):
        events = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True}) as response:
                if response.status_code != 200:   # refused before its first event: an HTTP error of its own
                    first_events[i].set()
                    return {"status": response.status_code, "error": json.loads(response.read())["error"]}
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_events[i].set()
        except httpx.HTTPError as e:   # the connection was cut
            first_events[i].set()
            return e
        return events, time.monotonic()
    futures = [pool.submit(stream, i) for i in range(count)]
    deadline = time.monotonic() + 120
    while sum(event.is_set() for event in first_events) < (count if started is None else started):
        assert time.monotonic() < deadline, "a stream did not start"
        time.sleep(0.005)
    return futures, pool


def core_requests(server) -> int:
    """Requests the engine core holds (running and waiting), from /metrics (any API server asks the core)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return int(sum(float(v) for v in re.findall(
        r'^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$', text, flags=re.M)))


def ended_in_band(result) -> dict | None:
    """The in-band error a stream ended with (then [DONE]), None when its connection was cut."""
    if isinstance(result, Exception):
        return None
    events, _ = result
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2]).get("error")
    assert error is not None, f"the stream ended on its own ({len(events)} events) before the server ended it: " \
                              f"{events[-2][:300]}"
    return error


def test_a_killed_core_is_reported_and_the_server_exits(llama_dir):
    server = ServeProcess(llama_dir, "--max-model-len", "1024")
    pids = server.tree()
    futures, pool = long_streams(server, 3)
    core = re.search(r"engine core: pid (\d+)", "".join(server.lines))
    killed = time.monotonic()
    os.kill(int(core.group(1)), signal.SIGKILL)
    with pool:
        results = [f.result(timeout=30) for f in futures]
    for result in results:   # every stream ends at once, with the error in-band and [DONE]
        error = ended_in_band(result)
        assert error is not None and "engine core" in error["message"], error
        assert result[1] - killed <= 3.0
    assert server.process.wait(30) == 1
    assert time.monotonic() - killed <= 5.0
    assert "engine core process" in "".join(server.lines)
    assert not _wait_gone(pids)


def test_several_api_servers_share_one_core_and_stop_cleanly(llama_dir):
    # One sequence at a time, so at the SIGTERM three of the four long streams below are queued behind the first and
    # cannot have ended: the tiny model writes a stream's 1000 tokens in about a second on a 2-core machine, and when
    # the test waited for every stream's first token before the SIGTERM (two or four at a time), the streams had at
    # times all run to their end by then (fresh-clone CI runs, beside another load and once on a quiet machine).
    server = ServeProcess(llama_dir, "--api-server-count", "2", "--max-model-len", "1024", "--shutdown-timeout", "0.2",
                          "--max-num-seqs", "1")
    try:
        assert "2 API server processes" in "".join(server.lines)
        texts = {server.client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0.0)
                 .choices[0].text for _ in range(6)}
        assert len(texts) == 1
        # Each on a connection of its own (httpx.post opens one per call): the kernel spreads new connections over
        # every socket listening on the port (SO_REUSEPORT), and the supervisor's own, once left open and never
        # accepted on, held a third of the connections (of 2 API servers) unanswered (this loop then passed with
        # probability (2/3)**12 < 1%).
        for _ in range(12):
            response = httpx.post(server.url + "/v1/completions", timeout=30,
                                  json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0.0})
            assert response.status_code == 200, response.text
        pids = server.tree()
        assert len(pids) >= 4   # the supervisor, the core, two API servers (and their template sandboxes)
        # SIGTERM with streams in flight: each API server drains for --shutdown-timeout, then ends them in-band. The
        # first stream has begun, and every request has reached the core (held there, or already ended): none was
        # left in a connection the SIGTERM could cut before its request reached the core.
        futures, pool = long_streams(server, 4, started=1)
        deadline = time.monotonic() + 60
        while core_requests(server) + sum(future.done() for future in futures) < 4:
            assert time.monotonic() < deadline, "the core never held the four streams' requests"
            time.sleep(0.005)
    finally:
        pids = server.tree()
        stopped = time.monotonic()
        assert server.stop() == 0
    stop_took = time.monotonic() - stopped
    assert stop_took <= 0.2 + 5
    with pool:
        results = [future.result(timeout=30) for future in futures]
    # What each stream got and when it ended against the SIGTERM: the failure message below (the test failed once in
    # a fresh-clone CI run with every stream run to its end, and never in 12 runs alone or beside two busy loops).
    seen = [result if not isinstance(result, tuple) else
            (len(result[0]), result[0][-2][-160:], f"ended {result[1] - stopped:+.2f} s") for result in results]
    # The first stream may have run to its 1000 tokens (all the tiny model's context allows) before the SIGTERM; the
    # others were queued behind it. A stream in flight at the SIGTERM ends in-band; one whose request had not begun
    # streaming yet is answered 503 with the same reason (no event had been sent: the status is still free).
    told = 0
    for result in results:
        assert not isinstance(result, Exception), f"a stream's connection was cut: {result!r}"
        if isinstance(result, dict):
            assert result["status"] == 503 and result["error"]["code"] == "server_shutting_down", result
            told += 1
            continue
        events, _ = result
        last = json.loads(events[-2])
        if "error" in last:
            assert ended_in_band(result)["code"] == "server_shutting_down"
            told += 1
        else:
            assert events[-1] == "[DONE]" and last["choices"][0]["finish_reason"] == "length", events[-3:]
    assert told >= 3, f"the stop took {stop_took:.2f} s; the streams (events, end, against the SIGTERM): {seen}"
    assert not _wait_gone(pids)


def test_a_dead_api_server_takes_the_server_down(llama_dir):
    server = ServeProcess(llama_dir, "--api-server-count", "2", "--max-model-len", "1024")
    pids = server.tree()
    children = [pid for pid in pids if pid != server.process.pid]
    # Neither the core, a template sandbox nor multiprocessing's resource tracker (also a child of the supervisor).
    frontends = [pid for pid in children if not any(name in open(f"/proc/{pid}/cmdline").read() for name in (
        "engine-core", "chat_template_sandbox", "resource_tracker"))]
    with open(f"/proc/{server.process.pid}/task/{server.process.pid}/children") as f:
        direct = [int(p) for p in f.read().split()]
    core = int(re.search(r"engine core: pid (\d+)", "".join(server.lines)).group(1))
    victim = next(pid for pid in direct if pid != core and pid in frontends)
    # 12 streams on connections of their own: all on the victim with probability 2**-12.
    futures, pool = long_streams(server, 12)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    with pool:
        results = [f.result(timeout=30) for f in futures]
    survivors = [r for r in results if ended_in_band(r) is not None]
    assert survivors, "no stream was on the surviving API server"
    for result in survivors:   # the survivor's healthy streams end at once, the reason in-band
        assert "another of its processes exited" in ended_in_band(result)["message"]
        assert result[1] - killed <= 3.0
    assert server.process.wait(30) == 1
    assert time.monotonic() - killed <= 5.0
    assert "api-server" in "".join(server.lines)
    assert not _wait_gone(pids)


# -- in-process: a failure inside a step, and where grammars compile ---------------------------------------------
@pytest.fixture(scope="module")
def inprocess(llama_dir):
    engine = AsyncLLMEngine.from_args(llama_dir, num_kv_blocks=256, max_model_len=128)
    with ServerThread(build_app(engine, served_model_names=[MODEL])) as server:
        server.engine = engine
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT_S)
        yield server


class _FailForBias:
    """The engine's sampler, raising whenever its rows include one with a logit bias on token 7."""

    def __init__(self, sampler):
        self.sampler = sampler

    def _check(self, meta):
        if meta.logit_bias and any(7 in bias[0].tolist() for bias in meta.logit_bias.values()):
            raise RuntimeError("this request breaks the sampler")

    def __call__(self, logits, meta):
        self._check(meta)
        return self.sampler(logits, meta)

    def sample(self, logits, meta):   # the runner's entry (the draws stay on the device)
        self._check(meta)
        return self.sampler.sample(logits, meta)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_a_request_failing_inside_a_step_fails_alone(inprocess):
    reference = [stream_text(inprocess.client, prompt) for prompt in INNOCENT]
    runner = inprocess.engine.engine.model_runner
    original = runner.sampler
    runner.sampler = _FailForBias(original)
    try:
        def hostile():
            return list(inprocess.client.completions.create(
                model=MODEL, prompt="hello", max_tokens=8, temperature=0.0, stream=True,
                extra_body={"logit_bias": {"7": 1.0}, "ignore_eos": True}))
        result = next_to_innocents(inprocess, reference, hostile)
    finally:
        runner.sampler = original
    # A stream fails in-band: the error arrives as an event the client raises on.
    assert isinstance(result, openai.APIError) and "this request breaks the sampler" in str(result), result


def test_grammars_compile_off_the_step_thread(inprocess, monkeypatch):
    pytest.importorskip("xgrammar")
    from engine.core.guided_decoding import GuidedDecoding

    threads = []
    original = GuidedDecoding.compile

    def recording(self, params):
        threads.append(threading.current_thread().name)
        return original(self, params)
    monkeypatch.setattr(GuidedDecoding, "compile", recording)
    reply = inprocess.client.completions.create(model=MODEL, prompt="pick", max_tokens=8, temperature=0.0,
                                                extra_body={"guided_choice": [f"choice {i}" for i in range(300)]})
    assert reply.choices[0].text in {f"choice {i}" for i in range(300)}
    assert threads and all(name.startswith("engine-grammar") for name in threads), threads


# -- item 6: numbers at their limits, fuzzed ---------------------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LIMIT_INTS = st.sampled_from([0, 1, -1, 2, 20, 21, 256, 257, 2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, -(2 ** 63),
                              -(2 ** 63) - 1, 2 ** 64, 10 ** 30]) | st.integers(-(2 ** 65), 2 ** 65)
LIMIT_FLOATS = st.sampled_from([0.0, -0.0, 1e-45, 5e-324, 1e-8, 0.5, 1.0, 2.0, 100.0, 3.4e38, 3.5e38,
                                1.7976931348623157e308, -1.7976931348623157e308, float("inf"), float("-inf"),
                                float("nan")]) | st.floats()
NUMERIC_FIELDS = {
    "n": LIMIT_INTS, "max_tokens": LIMIT_INTS, "min_tokens": LIMIT_INTS, "top_k": LIMIT_INTS, "seed": LIMIT_INTS,
    "logprobs": LIMIT_INTS, "prompt_logprobs": LIMIT_INTS, "truncate_prompt_tokens": LIMIT_INTS,
    "temperature": LIMIT_FLOATS | LIMIT_INTS, "top_p": LIMIT_FLOATS, "min_p": LIMIT_FLOATS,
    "presence_penalty": LIMIT_FLOATS, "frequency_penalty": LIMIT_FLOATS, "repetition_penalty": LIMIT_FLOATS,
    "logit_bias": st.dictionaries(LIMIT_INTS.map(str), LIMIT_FLOATS, max_size=2),
    "stop_token_ids": st.lists(LIMIT_INTS, max_size=2), "allowed_token_ids": st.lists(LIMIT_INTS, min_size=1, max_size=2),
}
numeric_bodies = st.lists(st.sampled_from(sorted(NUMERIC_FIELDS)), unique=True, min_size=1, max_size=5).flatmap(
    lambda names: st.fixed_dictionaries({name: NUMERIC_FIELDS[name] for name in names}))


@pytest.fixture(scope="module")
def innocent_loop(served, reference):
    """Greedy innocent streams running over and over (bounded: until stopped, or 10 minutes) during the fuzz;
    every one must equal its run alone."""
    stop, mismatches, runs = threading.Event(), [], []

    def loop():
        deadline = time.monotonic() + 600
        while not stop.is_set() and time.monotonic() < deadline:
            for prompt, expected in zip(INNOCENT, reference):
                text = stream_text(served.client, prompt)
                runs.append(text)
                if text != expected:
                    mismatches.append((prompt, text, expected))
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield mismatches
    stop.set()
    thread.join(TIMEOUT_S)
    assert runs and not mismatches


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=numeric_bodies, chat=st.booleans())
def test_fuzz_numbers_at_their_limits_never_5xx_nor_disturb_a_greedy_stream(served, innocent_loop, body, chat):
    body = dict(body, model=MODEL)
    # Bounded work per example: a valid request generates a few tokens at most (n up to 256 of them).
    max_tokens = body.get("max_tokens", 4)
    if 0 <= max_tokens <= 128:   # values past the context stay: they are 400s, not work
        body["max_tokens"] = min(max(max_tokens, 1 if chat else 0), 4)
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hello"
    route = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(served.url + route, content=json.dumps(body), timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code == 400:
        assert response.json()["error"]["param"] is not None, (body, response.text)
    assert not innocent_loop
