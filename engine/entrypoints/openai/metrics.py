"""Prometheus metrics of the server (GET /metrics), on a registry of its own (one per app).

Gauges are read from the engine when scraped (`await ServerMetrics.refresh(engine)`); latency histograms are
observed as requests finish (AsyncLLMEngine.finished_callbacks). Names follow vLLM's with an `engine_` prefix."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from engine.async_engine import AsyncLLMEngine
from engine.outputs import RequestOutput

# vLLM's buckets: TTFT spans fast GPU prefills to long CPU ones; TPOT spans ms-scale GPU decodes to CPU ones.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


def request_latencies(output: RequestOutput) -> tuple[float | None, float | None, float | None]:
    """(time to first token, time per output token after the first, end-to-end latency) in seconds."""
    m = output.metrics
    if m is None:
        return None, None, None
    ttft, tpot = m.time_to_first_token, m.time_per_output_token
    e2e = m.finished_time - m.arrival_time if m.finished_time is not None else None
    return ttft, tpot, e2e


class _EngineCounters:
    """Cumulative engine counters, exported from the last snapshot as Prometheus counters."""

    def __init__(self):
        self.values = {"num_preemptions": 0, "num_prompt_tokens": 0, "num_generation_tokens": 0}

    def collect(self):
        for name, help_text, key in (
                ("engine_num_preemptions", "Preemptions (by recomputation) so far", "num_preemptions"),
                ("engine_prompt_tokens", "Prompt tokens of finished requests", "num_prompt_tokens"),
                ("engine_generation_tokens", "Generated tokens of finished requests", "num_generation_tokens")):
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], self.values[key])
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
        self.counters = _EngineCounters()
        registry.register(self.counters)

    def attach(self, engine: AsyncLLMEngine) -> None:
        engine.finished_callbacks.append(self.observe_finished)

    def observe_finished(self, output: RequestOutput) -> None:
        ttft, tpot, e2e = request_latencies(output)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        if e2e is not None:
            self.e2e.observe(e2e)
        for completion in output.outputs:
            self.request_success.labels(finished_reason=completion.finish_reason or "abort").inc()

    async def render(self, engine: AsyncLLMEngine) -> bytes:
        stats = await engine.get_metrics()
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_hit.set(stats.prefix_cache_hit_rate)
        for key in self.counters.values:
            self.counters.values[key] = getattr(stats, key)
        return generate_latest(self.registry)
