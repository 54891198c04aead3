"""What the engine core exchanges: with its workers, each step (vLLM V1's SchedulerOutput / ModelRunnerOutput); with
the front end around it, each request and step (vLLM V1's EngineCoreRequest / EngineCoreOutput).

With the workers the core sends a diff, not the batch: a sequence the worker has not seen comes once as
`NewSequenceData` (all its tokens, its block table, its sampling parameters); afterwards each step names only what
changed for it (`CachedSequenceData`: the tokens the core appended since, the block-table entries from the first
one that changed, its computed-token count). The worker keeps every sequence's state in its persistent batch
(engine/worker/input_batch.py) until the core says it finished. Sequences are identified by their `seq_id` (an int,
unique in the engine): an n > 1 request or a beam search has several.

With the front end the core works on token ids only. In front of it the input processor
(engine/core/input_processor.py) turns a prompt and its SamplingParams into an `EngineCoreRequest` (tokenized,
validated); behind it the output processor (engine/core/output_processor.py) turns the core's `EngineCoreOutput`s
into the user's `RequestOutput`s (text by incremental detokenization, stop strings, decoded logprob tokens).
In-process (`LLM`, `LLMEngine`) the three run one after another in one step; under `serve` the core runs in a
process of its own (engine/core/core_process.py) and these records cross a ZMQ socket as msgpack lists (`to_wire` /
`from_wire`). An output is a delta: each step the core sends, for every request it touched, the token ids (and
logprobs) each completion gained since its last output, so a request's traffic is linear in its length. A beam
search is the exception: it sends one output when it finishes, holding its beams whole (`beam`).

Everything here is plain data (lists, ints, SamplingParams), picklable for the tensor-parallel workers, and imports
nothing of the core, the worker or the front end: they depend on this module, not on each other.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.lora.request import LoRARequest
from engine.outputs import RequestMetrics
from engine.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams


@dataclass(slots=True)
class NewSequenceData:
    """A sequence the worker has not seen: a new request, a fork (n > 1, beam search)."""
    seq_id: int
    token_ids: list[int]               # every token it has: prompt + output so far
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    params: SamplingParams
    # Seed of its own generator (seeded requests; forks get their own stream), None: the worker's shared one.
    seed: int | None
    # Masked while fewer than params.min_tokens are generated: EOS (unless ignore_eos) and stop_token_ids.
    stop_token_ids: list[int]
    # bad_words as token ids (the core has the tokenizer): the last token of each is masked after the others.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # A beam of a beam search: return the top `beam_candidates` log-softmax entries instead of sampling.
    beam_candidates: int = 0
    # The LoRA adapter its tokens run with (None: the base model); a fork has its parent's.
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class CachedSequenceData:
    """A sequence the worker knows, scheduled this step."""
    seq_id: int
    # Appended by the core since the worker last ran it. The worker that sampled a token appends it itself (it
    # may be the input of the next step before the core has it, under async scheduling), so it skips those it has.
    new_token_ids: list[int]
    block_ids_from: int                # the worker's block table from this index on is replaced by new_block_ids
    new_block_ids: list[int]
    num_computed_tokens: int
    # Position of new_token_ids[0] in the sequence (None: right after the worker's last token).
    token_start: int | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions: what to compute, which KV blocks to move first, what to forget."""
    new_seqs: list[NewSequenceData]
    cached_seqs: list[CachedSequenceData]
    # seq_id -> tokens to compute this step, drafts included (every scheduled sequence, in batch order).
    num_scheduled_tokens: dict[int, int]
    # seq_id -> draft tokens this step verifies (speculative decoding); they follow the sequence's tokens.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # A fork made as its parent's prompt completes (n > 1): child seq_id -> parent seq_id. The child is not
    # computed this step; it samples from its parent's logits with its own parameters and generator.
    sample_from: dict[int, int] = field(default_factory=dict)
    # Sequences the worker can forget (finished, aborted).
    finished_seq_ids: list[int] = field(default_factory=list)
    # Block moves before the forward, in order: [("swap_out" | "swap_in" | "copy", [(src, dst), ...])].
    block_moves: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    # Guided decoding: (seq_ids, int32 [len(seq_ids), ceil(vocab / 32)] token bitmask), for sequences that sample.
    grammar_bitmask: tuple[list[int], torch.Tensor] | None = None
    # Multi-LoRA: the step's distinct adapters, lora_int_id -> LoRARequest (at most max_loras; the scheduler chose
    # the step so). Decided with the step, so a worker places exactly these in its slots before the forward.
    lora_requests: dict[int, LoRARequest] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions [start, start + len(token_ids)) of one sequence: position p's
    entry scores token p (from the logits at p - 1)."""
    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    topk_token_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass(slots=True)
class SampleLogprobs:
    """For each emitted token of a sequence this step: its logprob, its rank, and the top-k (ids, logprobs)."""
    logprobs: list[float]
    ranks: list[int]
    topk_token_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a step gives back (rank 0; the other ranks return None)."""
    # seq_id -> the tokens it emits this step: one sampled token, or under speculation the accepted drafts and
    # one more. Sequences still inside their prompt emit nothing.
    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> logprobs of those tokens (sequences that asked for them).
    logprobs: dict[int, SampleLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # Beam rows: seq_id -> (token ids, log-softmax values) of its top beam_candidates next tokens.
    beam_candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # seq_id -> draft tokens proposed for its next step (speculative decoding).
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> how many of this step's draft tokens were accepted.
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)
    # seq_id -> why its sampling (or prompt logprobs) failed this step: the core fails that request alone.
    failed: dict[int, str] = field(default_factory=dict)


# -- the front end's requests and the core's outputs ------------------------------------------------------------
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
