"""What `LLM.generate` returns (vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`)."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token under the raw model output; rank 1 is the most likely token."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: {token_id: Logprob}, always including the sampled token.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = field(default=None)
