"""What goes into the engine core and what comes out of it (vLLM V1's EngineCoreRequest / EngineCoreOutput).

The core works on token ids only. In front of it the input processor (engine/core/input_processor.py) turns a
prompt and its SamplingParams into an `EngineCoreRequest` (tokenized, validated); behind it the output processor
(engine/core/output_processor.py) turns the core's `EngineCoreOutput`s into the user's `RequestOutput`s (text by
incremental detokenization, stop strings, decoded logprob tokens). In-process (`LLM`, `LLMEngine`) the three run one
after another in one step; under `serve` the core runs in a process of its own (engine/core/core_process.py) and
these records cross a ZMQ socket as msgpack lists (`to_wire` / `from_wire`).

An output is a delta: each step the core sends, for every request it touched, the token ids (and logprobs) each
completion gained since its last output, so a request's traffic is linear in its length. A beam search is the
exception: it sends one output when it finishes, holding its beams whole (`beam`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.outputs import RequestMetrics
from engine.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))


@dataclass(slots=True)
class EngineCoreRequest:
    """A request as the core takes it: the prompt already tokenized and checked against the model."""
    request_id: str
    prompt: str | None                  # the prompt's text when there is one (outputs carry it back)
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # params.bad_words as token ids (the input processor has the tokenizer); [] without bad words.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The LoRA adapter the request runs with (engine.lora.LoRARequest), None for the base model.
    lora_request: LoRARequest | None = None

    def to_wire(self) -> list:
        return [self.request_id, self.prompt, self.prompt_token_ids, encode_params(self.params), self.arrival_time,
                self.bad_words_token_ids, None if self.lora_request is None else self.lora_request.to_wire()]

    @classmethod
    def from_wire(cls, data: list) -> "EngineCoreRequest":
        request_id, prompt, prompt_token_ids, params, arrival_time, bad_words, lora = data
        return cls(request_id, prompt, prompt_token_ids, decode_params(params), arrival_time, bad_words or [],
                   LoRARequest.from_wire(lora))


# One logprob entry of one token position: [(token id, logprob, rank), ...], the position's own token first.
LogprobEntry = list[tuple[int, float, int]]


@dataclass(slots=True)
class CompletionDelta:
    """What one completion (sequence) of a request gained since its last output."""
    index: int
    token_ids: list[int]                       # new token ids (a finished beam: all of them)
    logprobs: list[LogprobEntry] | None        # one entry per new token, when the request asked for logprobs
    cumulative_logprob: float | None
    finish_reason: str | None = None           # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None       # a stop token id (a stop string is found behind the core)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's step: its completions' deltas, whether the core finished it, and its bookkeeping."""
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With prompt_logprobs: one entry per prompt token (None for the first), sent once (with the first output).
    prompt_logprobs: list[LogprobEntry | None] | None = None
    error: str | None = None          # the core failed or refused the request (RequestOutput.error)
    error_param: str | None = None    # the request's own field at fault (a 400 for a server)
    beam: bool = False                # a finished beam search: completions hold whole beams, best first

    def to_wire(self) -> list:
        m = self.metrics
        return [self.request_id, self.finished, self.num_cached_tokens,
                None if m is None else [getattr(m, name) for name in _METRIC_FIELDS], self.error, self.error_param,
                self.prompt_logprobs, self.beam,
                [[c.index, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason]
                 for c in self.completions]]

    @classmethod
    def from_wire(cls, data: list) -> "EngineCoreOutput":
        request_id, finished, num_cached, metrics, error, error_param, prompt_logprobs, beam, completions = data
        return cls(request_id, [CompletionDelta(*c) for c in completions], finished, num_cached,
                   None if metrics is None else RequestMetrics(**dict(zip(_METRIC_FIELDS, metrics))),
                   prompt_logprobs, error, error_param, beam)


def encode_params(params: SamplingParams) -> dict:
    """SamplingParams as plain msgpack-able data (only the fields that differ from the defaults)."""
    out = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name == "guided_decoding" and value is not None:
            value = {g.name: getattr(value, g.name) for g in dataclasses.fields(GuidedDecodingParams)
                     if getattr(value, g.name) not in (None, False)}
        elif f.name == "output_kind":
            value = value.value
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        out[f.name] = value
    return out


def decode_params(data: dict) -> SamplingParams:
    data = dict(data)
    if "output_kind" in data:
        data["output_kind"] = RequestOutputKind(data["output_kind"])
    return SamplingParams(**data)
