"""Request bodies of the OpenAI API (the fields this server implements), as pydantic models.

Types are strict: `n: "2"`, `stream: "yes"` or `true` as a token id are 400s naming the field, not coerced.
The extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `guided_json`,
...) are vLLM's and come from the client's `extra_body`. Range checks that SamplingParams makes stay there (its
ValueError names the field; the server turns it into a 400).

Fields OpenAI defines that this server cannot honour are declared and refused with a 400 naming them when set
(UNSUPPORTED_FIELDS); fields that change nothing here are accepted and ignored (IGNORED_FIELDS: `user`,
`metadata`, `store`, `service_tier`, `spaces_between_special_tokens`, `guided_decoding_backend`,
`parallel_tool_calls` true, `modalities` ["text"]). Other unknown fields are ignored, as OpenAI and vLLM do."""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Every int is an int64 (OpenAI's seed is one): a larger value is a 400 naming its field, never an overflow in
# the engine. Token ids are checked against the vocabulary by the engine (also a 400).
INT64_MAX = 2 ** 63 - 1
Seed = Annotated[int, Field(ge=-(2 ** 63), le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
NonNegative = Annotated[int, Field(ge=0, le=INT64_MAX)]

IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "spaces_between_special_tokens",
                  "guided_decoding_backend")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class _SamplingRequest(_Strict):
    model: str | None = None
    n: Count = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Extra sampling fields (vLLM's names).
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegative = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Count | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Structured outputs (OpenAI's response_format, vLLM's guided_*).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI fields this server cannot honour: a 400 naming them when set (see unsupported_fields()).
    best_of: Count | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None

    def unsupported_fields(self) -> list[str]:
        """Names of the fields set to something this server cannot do."""
        bad = []
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.use_beam_search:
            bad.append("use_beam_search")
        if self.length_penalty is not None and self.length_penalty != 1.0:
            bad.append("length_penalty")
        return bad

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_in_stream(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far."""
        return self.include_usage_in_stream and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: NonNegative | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported_fields(self) -> list[str]:
        return super().unsupported_fields() + (["suffix"] if self.suffix else [])


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    modalities: list[str] | None = None
    # Chat fields OpenAI has that this server cannot honour (refused when set).
    functions: list[Any] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        bad += [name for name in ("functions", "function_call", "audio", "prediction", "web_search_options",
                                  "reasoning_effort", "documents") if getattr(self, name) is not None]
        if self.echo:
            bad.append("echo")
        if self.modalities is not None and self.modalities != ["text"]:
            bad.append("modalities")
        return bad
