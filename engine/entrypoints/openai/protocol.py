"""Request bodies of the OpenAI API (the fields this server implements), as pydantic models.

Unknown fields are ignored (as OpenAI and vLLM do); the extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, ...) come from the client's `extra_body`. Range checks
live in SamplingParams, whose ValueError names the field; the server turns it into a 400."""
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extra sampling fields (vLLM's names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (naming the field) for invalid values."""
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        defaults = SamplingParams()
        pick = lambda value, default: default if value is None else value   # noqa: E731
        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0), seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None
