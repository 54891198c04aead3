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
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None while running
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
    # Output positions produced so far: a step that gives each of the n sequences (or beams) a token counts once,
    # so time_per_output_token is the time between consecutive tokens of one sequence.
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first sampled token (None before it)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between consecutive sampled tokens after the first (None with fewer than 2 tokens)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class EngineMetrics:
    """A snapshot of the engine for servers and benchmarks (LLMEngine.get_metrics()). Counts are requests
    (an n > 1 request counts once); totals are since the engine started."""
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float          # share of KV blocks referenced by some sequence, in [0, 1]
    prefix_cache_hit_rate: float   # prompt tokens served from the prefix cache / all prompt tokens admitted, [0, 1]
    num_preemptions: int
    num_generation_tokens: int
    num_prompt_tokens: int
    spec_decode: "SpecDecodeStats | None" = None   # with speculative decoding


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding since the engine started (vLLM's vllm:spec_decode_* counters): steps that verified
    drafts, draft tokens verified, how many of them were accepted, and accepted tokens per draft position."""
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step emits on average: the accepted drafts plus the one sampled after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = field(default=None)
    # With SamplingParams(prompt_logprobs=k): per prompt token, {token_id: Logprob} (the prompt token and the
    # k most likely); None for the first token, which has no context.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the engine failed this request (every completion then has finish_reason "error"): a short
    # message, "internal error in engine step: <ExcType>: <msg>". The engine logs the traceback.
    error: str | None = None
    # Set with `error` when the request itself was at fault, found only after it was queued (its grammar did not
    # compile, or not within the time limit): the SamplingParams field to blame; a server answers 400 then.
    error_param: str | None = None
