"""Per-request sampling parameters, validated at construction (vLLM's `SamplingParams` names and meanings)."""
import enum
import json
import math
from dataclasses import dataclass, replace

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them would overflow float32.
_SAMPLING_EPS = 1e-5
# OpenAI's range for logit_bias values; a bias of +-100 already bans or forces a token.
_MAX_LOGIT_BIAS = 100.0
# Every int field is an int64 (OpenAI's seed is one; torch, numpy and the JSON clients' own types take no more).
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class RequestOutputKind(enum.Enum):
    """When the engine hands back a request's RequestOutput (vLLM's names): CUMULATIVE after every step that
    produced tokens (streaming; each holds everything so far), FINAL_ONLY once, when it finishes (offline
    generation: no per-step output to build). vLLM's DELTA (only the new tokens) is not offered: the server
    computes its stream deltas from cumulative outputs."""
    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(slots=True)
class GuidedDecodingParams:
    """Structured output: constrain the generated text to a grammar (vLLM's GuidedDecodingParams). Exactly one
    field is set: `json` (a JSON schema, as a dict or as JSON text), `regex`, `choice` (the output is one of
    these strings), `grammar` (EBNF in xgrammar's GBNF dialect, root rule `root`) or `json_object=True` (any
    JSON object). Compiled by engine/core/guided_decoding.py when the request is added."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                raise ValueError(f"guided_decoding json_object must be a bool, got {self.json_object!r}")
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(f"guided_decoding must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {kinds or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"guided_decoding json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"guided_decoding json must be a JSON schema (an object), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided_decoding {name} must be a non-empty str, got {value!r:.100}")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"guided_decoding choice must be a non-empty list of non-empty str, "
                                 f"got {self.choice!r:.100}")
            if any("\x00" in c for c in self.choice):
                # xgrammar reads a literal as a C string: a NUL would end it (the choice would allow "")
                raise ValueError("guided_decoding choice strings cannot contain NUL (\\x00)")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    temperature 0 is greedy (argmax of the penalized logits; top_p/top_k/min_p are then ignored). top_k 0 or -1
    disables top-k. `stop` strings are searched in the generated text and cut from it unless
    `include_stop_str_in_output`. `logprobs=k` returns, per generated token, the k most likely tokens plus the
    sampled one, taken from the raw model output (before penalties and temperature), like vLLM v1's default
    "raw_logprobs" mode. `prompt_logprobs=k` returns, per prompt token after the first, its logprob
and the k most likely tokens at that position (RequestOutput.prompt_logprobs); such a request does not take
prefix-cache hits for its prompt (every prompt position is computed, so every logprob exists), though the blocks
it computes are cached for others. `max_tokens=0` computes the prompt (and its logprobs) and finishes with no
output (finish_reason "length"). Penalties follow vLLM: `repetition_penalty` applies to prompt and output tokens
    (divides positive logits, multiplies negative ones), `presence_penalty` and `frequency_penalty` to output
    tokens only (subtracted once / once per occurrence). `min_tokens` keeps EOS and `stop_token_ids` from being
    sampled (and stop strings from matching) until that many tokens exist. `max_tokens=None` generates until
    the model's max_model_len.

    Token constraints, vLLM semantics: `logit_bias` {token id: bias} is added to the raw logits before the
    penalties (values clamped to [-100, 100]); `allowed_token_ids` keeps only those ids; `bad_words` bans each
    word's token sequence (with and without a leading space: its last token is masked when the output ends
    with the others); `guided_decoding` constrains the output to a grammar (see GuidedDecodingParams).
    Token ids are checked against the model's vocabulary when the request is added. `truncate_prompt_tokens=k`
    keeps only the last k prompt tokens. A row whose every token is masked by these constraints gets a
    defined fallback (see engine/worker/sampler.py), never an invalid id.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_float("temperature", self.temperature, minimum=0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == -1:
            self.top_k = 0
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                             f"and max_tokens={self.max_tokens}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {type(self.stop).__name__}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of int or None, got {type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            clamped = {}
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, str) and token_id.isdigit():   # JSON object keys are strings
                    token_id = int(token_id)
                _check_int("logit_bias", token_id, minimum=0)
                _check_float("logit_bias", bias)
                clamped[token_id] = float(min(max(bias, -_MAX_LOGIT_BIAS), _MAX_LOGIT_BIAS))
            self.logit_bias = clamped or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple, set, frozenset)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of int, got {self.allowed_token_ids!r:.100}")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, minimum=0)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of str, got {type(self.bad_words).__name__}")
            self.bad_words = list(self.bad_words)
            for word in self.bad_words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words must contain only non-blank strings, got {word!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)
        if self.guided_decoding is not None:
            if isinstance(self.guided_decoding, dict):
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise ValueError(f"guided_decoding must be a GuidedDecodingParams, "
                                 f"got {type(self.guided_decoding).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so drop them (as vLLM does).
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def final_only(self) -> "SamplingParams":
        """These parameters with output_kind FINAL_ONLY (self when they already have it)."""
        if self.output_kind is RequestOutputKind.FINAL_ONLY:
            return self
        return replace(self, output_kind=RequestOutputKind.FINAL_ONLY)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _check_int(name: str, value, *, minimum: int | None = None, maximum: int = INT64_MAX) -> None:
    """An int (not a bool) in [minimum (default INT64_MIN), maximum (default INT64_MAX)]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r:.100}")
    if value < (INT64_MIN if minimum is None else minimum):
        raise ValueError(f"{name} must be >= {INT64_MIN if minimum is None else minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_float(name: str, value, *, minimum: float | None = None, maximum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {value!r:.100}")
    try:
        finite = math.isfinite(value)
    except OverflowError:   # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r:.100}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:.8g}, got {value}")
