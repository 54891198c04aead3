"""Prometheus metrics of the server (GET /metrics), on a registry of its own (one per app).

Gauges are read from the engine when scraped (`await ServerMetrics.render(engine)`); latency histograms are
observed as requests finish (AsyncLLMEngine.finished_callbacks). Every metric is exported twice: under this
project's `engine_` names (unlabelled) and under vLLM's `vllm:` names with a `model_name` label, so dashboards and
tools written for vLLM (Grafana boards, benchmark scrapers) read this server unchanged.

`request_success` counts requests, one per request whatever its `n`, under the request's finish reason: its worst
choice's ("error" > "abort" > "length" > "stop"). A request its client left (a dropped stream, a disconnect, the
shutdown deadline) counts under "abort", and only there: how long a client chose to wait is not a latency of the
server, so it adds to no histogram. The `model_name` label is the served model name, never a filesystem path
(metrics_model_name)."""
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from engine.async_engine import AsyncLLMEngine
from engine.outputs import RequestOutput

# vLLM's buckets: TTFT spans fast GPU prefills to long CPU ones; TPOT spans ms-scale GPU decodes to CPU ones.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


# Worst first: a request's finish reason is its worst choice's.
_FINISH_REASON_ORDER = ("error", "abort", "length", "stop")


def request_finish_reason(output: RequestOutput) -> str:
    """The finish reason of a whole request (all its choices): the worst of theirs; "abort" when it has none yet
    (a request left before its first output)."""
    reasons = {c.finish_reason or "abort" for c in output.outputs}
    return next((reason for reason in _FINISH_REASON_ORDER if reason in reasons), min(reasons, default="abort"))


def metrics_model_name(served_model_name: str) -> str:
    """The `model_name` label: the served name, except that a local path (the model directory, when no
    --served-model-name was given) is cut to its last component: scrapers and dashboards see no path."""
    if os.path.sep in served_model_name and os.path.exists(served_model_name):
        return os.path.basename(os.path.normpath(served_model_name))
    return served_model_name


def request_latencies(output: RequestOutput) -> tuple[float | None, float | None, float | None]:
    """(time to first token, time per output token after the first, end-to-end latency) in seconds."""
    m = output.metrics
    if m is None:
        return None, None, None
    ttft, tpot = m.time_to_first_token, m.time_per_output_token
    e2e = m.finished_time - m.arrival_time if m.finished_time is not None else None
    return ttft, tpot, e2e


class _EngineCounters:
    """Cumulative engine counters, exported from the last snapshot as Prometheus counters (both names)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.values = {"num_preemptions": 0, "num_prompt_tokens": 0, "num_generation_tokens": 0,
                       "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.spec_decode = None   # engine.outputs.SpecDecodeStats with speculative decoding

    def collect(self):
        for name, vllm_name, help_text, key in (
                ("engine_num_preemptions", "vllm:num_preemptions", "Preemptions so far", "num_preemptions"),
                ("engine_prompt_tokens", "vllm:prompt_tokens", "Prompt tokens admitted", "num_prompt_tokens"),
                ("engine_generation_tokens", "vllm:generation_tokens", "Generated tokens",
                 "num_generation_tokens"),
                (None, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 "prefix_cache_queries"),
                (None, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits")):
            if name is not None:
                family = CounterMetricFamily(name, help_text)
                family.add_metric([], self.values[key])
                yield family
            family = CounterMetricFamily(vllm_name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], self.values[key])
            yield family
        spec = self.spec_decode
        if spec is None:
            return
        # vLLM V1's speculative-decoding counters: acceptance rate = accepted / draft tokens, mean accepted
        # length = 1 + accepted / drafts.
        for vllm_name, help_text, value in (
                ("vllm:spec_decode_num_drafts", "Steps that verified drafts", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens)):
            family = CounterMetricFamily(vllm_name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position", labels=["model_name", "position"])
        for position, value in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(position)], value)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        self.num_running = Gauge("engine_num_requests_running", "Requests in the running batch", registry=registry)
        self.num_waiting = Gauge("engine_num_requests_waiting", "Requests waiting to be scheduled",
                                 registry=registry)
        self.num_swapped = Gauge("engine_num_requests_swapped", "Requests swapped out to CPU memory",
                                 registry=registry)
        self.kv_cache_usage = Gauge("engine_kv_cache_usage_ratio", "Share of KV-cache blocks in use (0-1)",
                                    registry=registry)
        self.prefix_hit = Gauge("engine_prefix_cache_hit_ratio",
                                "Prompt tokens served from the prefix cache / prompt tokens (0-1)", registry=registry)
        self.ttft = Histogram("engine_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("engine_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram("engine_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=registry)
        self.request_success = Counter("engine_request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=registry)
        # vLLM's names, labelled with the served model.
        label = ["model_name"]
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests in the running batch", label,
                                  registry=registry)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", label,
                                  registry=registry)
        self.vllm_swapped = Gauge("vllm:num_requests_swapped", "Requests swapped out to CPU memory", label,
                                  registry=registry)
        self.vllm_kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent)", label,
                                         registry=registry)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", label,
                                   buckets=TTFT_BUCKETS, registry=registry)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first",
                                   label, buckets=TPOT_BUCKETS, registry=registry)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", label,
                                  buckets=E2E_BUCKETS, registry=registry)
        self.vllm_request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                            ["model_name", "finished_reason"], registry=registry)
        self.vllm_prompt_tokens_hist = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", label,
                                                 buckets=_TOKEN_BUCKETS, registry=registry)
        self.vllm_generation_tokens_hist = Histogram("vllm:request_generation_tokens",
                                                     "Generated tokens per request", label, buckets=_TOKEN_BUCKETS,
                                                     registry=registry)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens",
                                  label, buckets=TPOT_BUCKETS, registry=registry)
        self.vllm_queue_time = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling",
                                         label, buckets=E2E_BUCKETS, registry=registry)
        self.counters = _EngineCounters(model_name)
        registry.register(self.counters)
        # request_id -> (output positions, time of the last one) seen so far: the inter-token latencies.
        self._last_token: dict[str, tuple[int, float]] = {}

    def attach(self, engine: AsyncLLMEngine) -> None:
        engine.finished_callbacks.append(self.observe_finished)
        engine.output_callbacks.append(self.observe_output)

    def observe_output(self, output: RequestOutput) -> None:
        """Every output of a request: one inter-token latency per step that produced tokens after the first."""
        m = output.metrics
        if m is None or m.last_token_time is None:
            return
        seen = self._last_token.get(output.request_id)
        if seen is not None and m.num_output_tokens > seen[0]:
            self.vllm_itl.labels(model_name=self.model_name).observe(max(m.last_token_time - seen[1], 0.0))
        if output.finished:
            self._last_token.pop(output.request_id, None)
        elif seen is None or m.num_output_tokens > seen[0]:
            self._last_token[output.request_id] = (m.num_output_tokens, m.last_token_time)

    def observe_finished(self, output: RequestOutput) -> None:
        model = self.model_name
        reason = request_finish_reason(output)
        self.request_success.labels(finished_reason=reason).inc()
        self.vllm_request_success.labels(model_name=model, finished_reason=reason).inc()
        if reason == "abort":
            return
        ttft, tpot, e2e = request_latencies(output)
        for value, ours, theirs in ((ttft, self.ttft, self.vllm_ttft), (tpot, self.tpot, self.vllm_tpot),
                                    (e2e, self.e2e, self.vllm_e2e)):
            if value is not None:
                ours.observe(value)
                theirs.labels(model_name=model).observe(value)
        if output.metrics is not None and output.metrics.first_scheduled_time is not None:
            self.vllm_queue_time.labels(model_name=model).observe(
                max(output.metrics.first_scheduled_time - output.metrics.arrival_time, 0.0))
        self.vllm_prompt_tokens_hist.labels(model_name=model).observe(len(output.prompt_token_ids))
        self.vllm_generation_tokens_hist.labels(model_name=model).observe(
            sum(len(c.token_ids) for c in output.outputs))

    async def render(self, engine: AsyncLLMEngine) -> bytes:
        stats = await engine.get_metrics()
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_hit.set(stats.prefix_cache_hit_rate)
        model = self.model_name
        self.vllm_running.labels(model_name=model).set(stats.num_running)
        self.vllm_waiting.labels(model_name=model).set(stats.num_waiting)
        self.vllm_swapped.labels(model_name=model).set(stats.num_swapped)
        self.vllm_kv_cache_usage.labels(model_name=model).set(stats.kv_cache_usage)
        for key in ("num_preemptions", "num_prompt_tokens", "num_generation_tokens"):
            self.counters.values[key] = getattr(stats, key)
        # Token counts of the prefix cache: lookups are the prompt tokens admitted, hits the ones found cached.
        self.counters.values["prefix_cache_queries"] = stats.num_prompt_tokens
        self.counters.values["prefix_cache_hits"] = round(stats.prefix_cache_hit_rate * stats.num_prompt_tokens)
        self.counters.spec_decode = stats.spec_decode
        return generate_latest(self.registry)
