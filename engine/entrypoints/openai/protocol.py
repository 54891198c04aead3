"""Request bodies of the OpenAI API (the fields this server implements), as pydantic models, and the response
bodies and error statuses the server's OpenAPI document describes (its handlers build the responses as dicts).

Types are strict: `n: "2"`, `stream: "yes"` or `true` as a token id are 400s naming the field, not coerced; a
number with no fraction is an integer (`n: 2.0`), as JSON Schema has it.
The extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `guided_json`,
...) are vLLM's and come from the client's `extra_body`. Range checks that SamplingParams makes stay there (its
ValueError names the field; the server turns it into a 400).

Fields OpenAI defines that this server cannot honour are declared and refused with a 400 naming them when set
(UNSUPPORTED_FIELDS); fields that change nothing here are accepted and ignored (IGNORED_FIELDS: `user`,
`metadata`, `store`, `service_tier`, `spaces_between_special_tokens`, `guided_decoding_backend`,
`parallel_tool_calls` true, `modalities` ["text"]). Other unknown fields are ignored, as OpenAI and vLLM do."""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# Every int is an int64 (OpenAI's seed is one): a larger value is a 400 naming its field, never an overflow in
# the engine. Token ids are checked against the vocabulary by the engine (also a 400).
INT64_MAX = 2 ** 63 - 1


def _integral(value):
    """A JSON number with no fraction is an integer (JSON Schema's rule: 2.0 is one); other values stay as they
    came, for the strict int check to take or refuse (a bool, a string, 2.5)."""
    return int(value) if type(value) is float and value.is_integer() else value


def Int(ge: int, le: int):
    """An integer field in [ge, le]: strict (no strings, no bools), but 2.0 counts as 2."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


Seed = Int(-(2 ** 63), INT64_MAX)
TokenId = Int(0, INT64_MAX)
Count = Int(1, INT64_MAX)
NonNegative = Int(0, INT64_MAX)

IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "spaces_between_special_tokens",
                  "guided_decoding_backend")


def _doc(**schema) -> Any:
    """A field's range, written in the OpenAPI document only: SamplingParams checks it (a 400 naming the field in
    its own words), which a pydantic constraint would pre-empt with another message."""
    return Field(default=None, json_schema_extra=schema)


# A chat message as the server takes it (serving._chat_messages checks it; this is its OpenAPI schema): a known role
# and content (a string or a list of text parts), which only an assistant message with tool calls may leave out or
# null. Other keys (name, tool_call_id, ...) pass to the chat template.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")   # "function": OpenAI's old "tool"
_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}}
_TOOL_CALLS = {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
    "id": {"type": ["string", "null"]}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]}}}}}}
CHAT_MESSAGE_SCHEMA = {"type": "object", "anyOf": [
    {"required": ["role", "content"], "properties": {
        "role": {"enum": list(CHAT_ROLES)}, "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS]},
        "tool_calls": {"anyOf": [_TOOL_CALLS, {"type": "null"}]}}},
    {"required": ["role", "tool_calls"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS, {"type": "null"}]},
        "tool_calls": {**_TOOL_CALLS, "minItems": 1}}}]}


def _non_empty_alternatives(schema: dict) -> None:
    """The OpenAPI document's prompt: each alternative (a string, a list, the lists in a list) non-empty, as
    OpenAIServing.create_completion checks."""
    def non_empty(alternative: dict) -> None:
        if alternative.get("type") == "string":
            alternative["minLength"] = 1
        elif alternative.get("type") == "array":
            alternative["minItems"] = 1
            non_empty(alternative["items"])
    for alternative in schema["anyOf"]:
        non_empty(alternative)


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
    temperature: float | None = _doc(minimum=0)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Extra sampling fields (vLLM's names).
    top_k: Int(-1, INT64_MAX) | None = None
    min_p: float | None = _doc(minimum=0, maximum=1)
    repetition_penalty: float | None = _doc(exclusiveMinimum=0)
    ignore_eos: bool = False
    min_tokens: NonNegative = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Count | None = None
    prompt_logprobs: NonNegative | None = None   # at most the engine's max_logprobs (its 400)
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
    # A string, a list of strings, a list of token ids, or a list of token-id lists; none of them empty.
    prompt: Annotated[str | list[str] | list[TokenId] | list[list[TokenId]],
                      Field(json_schema_extra=_non_empty_alternatives)]
    max_tokens: NonNegative | None = 16
    logprobs: NonNegative | None = None   # at most the engine's max_logprobs (its 400)
    echo: bool = False
    suffix: str | None = None

    def unsupported_fields(self) -> list[str]:
        return super().unsupported_fields() + (["suffix"] if self.suffix else [])


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[dict[str, Any]], Field(json_schema_extra={"minItems": 1, "items": CHAT_MESSAGE_SCHEMA})]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NonNegative | None = None   # at most the engine's max_logprobs (its 400)
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


# -- /tokenize and /detokenize (vLLM's): their bodies, as OpenAIServing.tokenize / detokenize check them ------------
class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(json_schema_extra={"minItems": 1, "items": CHAT_MESSAGE_SCHEMA})]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


# -- Response bodies, for the OpenAPI document: the handlers build plain dicts, and the schemathesis test checks
# every response against these (tests/engine/test_server_openapi.py). Fields beyond them may come (vLLM's). -------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, of every 4xx and 5xx."""
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None   # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None = None   # with --reasoning-parser


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One event of a streamed completion: a choice's new text, or (stream_options.include_usage) the usage at the
    end with no choices."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: ChatCompletionDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (or the usage at the end, with no choices)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# The error statuses of the OpenAPI document (api_server's module docstring says when each comes).
ERROR_STATUSES = {
    400: "Invalid request: parameters, types, malformed JSON or a prompt too long (`param` names the field)",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model",
    408: "The request's body did not arrive in time",
    413: "The body is far larger than any prompt the server takes",
    500: "The engine failed this request (the server goes on serving the others)",
    503: "Past the server's connection limit, or ended by its shutdown",
}


def error_responses(*statuses: int) -> dict:
    """`responses=` of a route, for the OpenAPI document: OpenAI's error body (JSON whatever the route's own
    media type) under each of `statuses`; the document's components must hold ErrorResponse."""
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    return {status: {"description": ERROR_STATUSES[status], "content": body} for status in statuses}
