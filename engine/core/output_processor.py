"""The engine core's token-id deltas in, the user's `RequestOutput`s out (vLLM V1's OutputProcessor).

Per request it keeps what the user sees: each completion's token ids, its text (incremental detokenization, below),
its logprobs with their tokens decoded, and how it finished. It applies the stop
conditions in vLLM's order (a stop token the core ended on, then a stop string in the new text, then the core's
length limit): a stop string ends its completion here at once (tokens after it in the same delta, possible under
speculative decoding, are dropped with their logprobs) and is reported in `stops`, so that the core stops
generating it. It runs behind the core: in-process in `LLMEngine.step`, under `serve` in each API server process,
so the core's step loop does no detokenization.

Incremental detokenization (`Detokenizer`) and stop strings: decoding token by token is wrong for byte-level tokenizers (a multi-byte character can be split across
tokens) and for SentencePiece ones (a token's leading space depends on its left neighbour); decoding the
whole output every step is right but quadratic. vLLM's `detokenize_incrementally` does neither: it decodes
two short windows of ids, `token_ids[prefix_offset:read_offset]` (already emitted, kept as left context) and
`token_ids[prefix_offset:]`, and emits the difference. While the text ends in U+FFFD (an incomplete UTF-8
sequence) nothing is emitted and the offsets stay, so the character comes out whole once its last byte
arrives. The windows start on the last 5 prompt tokens so the first output token has its context.

Without a tokenizer (the engine's skip_tokenizer_init) there is no text: `update` adds none, `decode` gives ""
and `decode_token` None (Logprob.decoded_token, as vLLM).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.step_records import EngineCoreOutput, LogprobEntry
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("engine")

_REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The Rust tokenizer's decode is several times faster than the Python wrapper's and does not
        # apply clean_up_tokenization_spaces (which is not stable under concatenation).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def decode_token(self, token_id: int) -> str | None:
        """One token on its own (for Logprob.decoded_token)."""
        if self.tokenizer is None:
            return None
        return self.decode([token_id], skip_special_tokens=False)

    def decode_beam(self, token_ids: list[int]) -> str:
        """A finished beam's text, decoded whole (as transformers decodes a beam search's output)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, seq) -> int:
        """Extend `seq.output_text` with the text of its newest token; returns the number of new characters. `seq`:
        a completion of the output processor (token_ids, prefix_offset, read_offset, output_text, params)."""
        if self.tokenizer is None:
            return 0
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix_text = self.decode(ids[seq.prefix_offset:seq.read_offset], skip)
        new_text = self.decode(ids[seq.prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return 0   # nothing printable yet (special token skipped, or a character still incomplete)
        delta = new_text[len(prefix_text):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += delta
        return len(delta)


def check_stop_strings(seq, num_new_chars: int) -> str | None:
    """Find a stop string overlapping the newest `num_new_chars` characters of `seq.output_text` (the
    earliest one when several match). On a match the text is cut before it (after it with
    include_stop_str_in_output) and the string is returned."""
    params = seq.params
    if not params.stop or num_new_chars == 0:
        return None
    text = seq.output_text
    # A match must overlap the new characters: search only the new text plus a tail of len(stop) - 1 before it.
    best_index, best_stop = None, None
    for stop in params.stop:
        index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
        if index != -1 and (best_index is None or index < best_index):
            best_index, best_stop = index, stop
    if best_stop is None:
        return None
    end = best_index + len(best_stop) if params.include_stop_str_in_output else best_index
    seq.output_text = text[:end]
    return best_stop


class _Completion:
    """One completion as the user sees it: tokens, logprobs, finish, and its text with the incremental
    detokenizer's state under the names Detokenizer.update and check_stop_strings read of a Sequence
    (`token_ids` holds the last prompt tokens as the first token's left context, then the output)."""

    __slots__ = ("params", "token_ids", "prefix_offset", "read_offset", "output_text", "output_token_ids",
                 "logprobs", "cumulative_logprob", "finish_reason", "stop_reason", "stopped_here")

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int]):
        self.params = params
        self.token_ids = list(prompt_token_ids[-5:])   # the same window a Sequence's offsets start on
        self.read_offset, self.prefix_offset = len(self.token_ids), 0
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.cumulative_logprob = None
        self.finish_reason = self.stop_reason = None
        self.stopped_here = False   # ended by a stop string found here: the core's later tokens are past it


class RequestState:
    """One request's outputs so far, rebuilt from the core's deltas (see the module docstring)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: Detokenizer, *, beam: bool = False):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.beam = beam
        self.completions: dict[int, _Completion] = {}
        self.prompt_logprobs = None
        self.stops: list[int] = []   # completion indices ended here by a stop string, for the core to finish
        self.finished = False

    def add(self, out: EngineCoreOutput) -> RequestOutput | None:
        """Apply one core output; returns the request's RequestOutput (cumulative), or None while a FINAL_ONLY
        request runs."""
        decode_token = self.detokenizer.decode_token
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None if entry is None else _logprob_dict(entry, decode_token)
                                    for entry in out.prompt_logprobs]
        for delta in out.completions:
            c = self.completions.get(delta.index)
            if c is None:
                c = self.completions[delta.index] = _Completion(self.params, self.prompt_token_ids)
            if c.stopped_here:
                continue
            if out.beam:   # a whole beam: its text at once
                c.output_token_ids = list(delta.token_ids)
                c.output_text = self.detokenizer.decode_beam(delta.token_ids)
                kept = len(delta.token_ids)
            else:
                kept = self._detokenize(c, delta.index, delta.token_ids, delta.finish_reason, delta.stop_reason)
            entries = None if delta.logprobs is None else [_logprob_dict(e, decode_token) for e in delta.logprobs]
            if entries is not None:
                c.logprobs = (c.logprobs or []) + entries[:kept]
            if kept == len(delta.token_ids) or delta.cumulative_logprob is None or entries is None:
                c.cumulative_logprob = delta.cumulative_logprob
            else:   # the core's sum without the dropped tokens: the kept ones added as the core adds them
                total = c.cumulative_logprob if c.cumulative_logprob is not None else 0.0
                for entry, token_id in zip(entries[:kept], delta.token_ids):
                    total += entry[token_id].logprob
                c.cumulative_logprob = total
            if not c.stopped_here:
                c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        finished = out.finished
        if not finished and not self.beam:
            # Every completion ended (some here, by stop strings): the request is done, whatever the core says next.
            finished = (len(self.completions) == self.params.n
                        and all(c.finish_reason is not None for c in self.completions.values()))
            if finished and out.metrics is not None:
                out.metrics.finished_time = time.time()
        self.finished = finished
        if not finished and self.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        outputs = [CompletionOutput(index=i, text=c.output_text, token_ids=list(c.output_token_ids),
                                    cumulative_logprob=c.cumulative_logprob,
                                    logprobs=None if c.logprobs is None else list(c.logprobs),
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for i, c in sorted(self.completions.items())]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=finished, num_cached_tokens=out.num_cached_tokens,
                             metrics=out.metrics, prompt_logprobs=self.prompt_logprobs, error=out.error,
                             error_param=out.error_param)

    def failed(self, message: str, out: EngineCoreOutput) -> RequestOutput:
        """The request's final output after its processing failed here: every completion ends with "error"."""
        self.finished = True
        indices = sorted(set(self.completions) | {c.index for c in out.completions}) or [0]
        outputs = []
        for i in indices:
            c = self.completions.get(i)
            outputs.append(CompletionOutput(index=i, text="" if c is None else c.output_text,
                                            token_ids=[] if c is None else list(c.output_token_ids),
                                            cumulative_logprob=None if c is None else c.cumulative_logprob,
                                            logprobs=None if c is None or c.logprobs is None else list(c.logprobs),
                                            finish_reason="error"))
        if out.metrics is not None:
            out.metrics.finished_time = time.time()
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=True, num_cached_tokens=out.num_cached_tokens,
                             metrics=out.metrics, prompt_logprobs=self.prompt_logprobs, error=message)

    def _detokenize(self, c: _Completion, index: int, token_ids: list[int], finish_reason, stop_reason) -> int:
        """Append `token_ids` to completion `c` with their text (stop token, stop string, length: vLLM's order);
        returns how many were kept (fewer when a stop string ends the completion inside them)."""
        params, detokenizer = self.params, self.detokenizer
        # The core ended on the last of these tokens by a stop token (EOS or stop_token_ids): its text only with
        # include_stop_str_in_output, and no stop-string check on it.
        stop_token_last = finish_reason == "stop" and not isinstance(stop_reason, str)
        last = len(token_ids) - 1
        for j, token_id in enumerate(token_ids):
            c.output_token_ids.append(token_id)
            c.token_ids.append(token_id)
            if stop_token_last and j == last:
                if params.include_stop_str_in_output:
                    detokenizer.update(c)
                return j + 1
            num_new_chars = detokenizer.update(c)
            if params.stop and len(c.output_token_ids) >= params.min_tokens:
                stop_str = check_stop_strings(c, num_new_chars)
                if stop_str is not None:
                    c.finish_reason, c.stop_reason, c.stopped_here = "stop", stop_str, True
                    if finish_reason is None:   # the core is still generating it
                        self.stops.append(index)
                    return j + 1
        return len(token_ids)


def _logprob_dict(entry: LogprobEntry, decode_token) -> dict[int, Logprob]:
    return {tid: Logprob(lp, rank, decode_token(tid)) for tid, lp, rank in entry}


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # (request id, completion indices) that stop strings ended here: the core must finish them.
    stops: list[tuple[str, list[int]]] = field(default_factory=list)
    # Requests whose processing failed here (their detokenization, say): ended with an error, the core must abort.
    failed: list[str] = field(default_factory=list)


class OutputProcessor:
    """The RequestStates of the requests in flight; `process_outputs` turns a core step into RequestOutputs."""

    def __init__(self, tokenizer):
        self.detokenizer = Detokenizer(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    *, beam: bool = False) -> None:
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, self.detokenizer,
                                                 beam=beam)

    def abort_request(self, request_id: str) -> None:
        """Forget a request (its consumer left): the core's later outputs for it are dropped."""
        self.requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        processed = ProcessedOutputs()
        for out in core_outputs:
            state = self.requests.get(out.request_id)
            if state is None:   # finished here already (a stop string), or aborted by its consumer
                continue
            try:
                output = state.add(out)
            except Exception as error:   # this request's own failure: it ends alone, with the error
                logger.exception("processing the output of request %r failed", out.request_id)
                del self.requests[out.request_id]
                processed.failed.append(out.request_id)
                processed.request_outputs.append(state.failed(f"{type(error).__name__}: {error}", out))
                continue
            if state.stops:
                processed.stops.append((out.request_id, state.stops))
                state.stops = []
            if state.finished:
                del self.requests[out.request_id]
            if output is not None:
                processed.request_outputs.append(output)
        return processed
