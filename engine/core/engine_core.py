"""The engine core in a process of its own (vLLM V1's EngineCoreProc): the scheduler, the executor and the step
loop, and nothing else, so that no front-end work (HTTP, tokenization, chat templates, detokenization, streaming) can hold up a
step, and no step can hold up the front end.

The API server processes talk to it over one ZMQ socket (a ROUTER here, a DEALER in each front end,
engine/mp_engine.py) in msgpack messages:

    front end -> core   ("hello",)                                      -> ("ready", info)
                        ("add", request_id, prompt_text, prompt_token_ids, params, bad_words_token_ids, arrival)
                        ("abort", [request_id, ...])
                        ("stop", [[request_id, [index, ...]], ...])     completions ended on a stop string
                        ("call", call_id, method)                       -> ("result", call_id, value)
    core -> front end   ("outputs", [encoded RequestOutput, ...])       after each step, to the request's owner
                        ("dead", message)                               the core cannot go on (then it exits)

Outputs are deltas (encode_output): each step sends the new token ids and logprobs of every completion, not the
cumulative lists, so a request's traffic is linear in its length. The core does no detokenization (its LLMEngine
runs with detokenize=False): the front end rebuilds vLLM's cumulative RequestOutput, text included, and finds the
stop strings (OutputAccumulator), telling the core which completions a stop string ended ("stop"), as vLLM V1's
OutputProcessor does. A request's validation errors at add time come back as an output with `error`
(and `error_param`: a 400), so they reach the request's stream like any failure.

Between steps the core reads every queued message (adds, aborts, calls run in order, between steps, as the
in-process engine thread runs them). It exits when its parent process is gone, and tells its front ends when it
cannot go on (the model's worker died, the step loop broke).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback

from engine.core.detokenizer import check_stop_strings
from engine.outputs import (CompletionOutput, EngineMetrics, Logprob, RequestMetrics, RequestOutput,
                            SpecDecodeStats)
from engine.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_METRIC_FIELDS = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
                  "num_preemptions", "num_output_tokens")


# -- serialization ------------------------------------------------------------------------------------------------
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


def _encode_logprobs(entries) -> list:
    return [[[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in entry.items()]
            if entry is not None else None for entry in entries]


def _decode_logprobs(entries, decode_token=None) -> list:
    """Logprob entries from the wire; `decode_token` (the front end's) fills in decoded_token where the core left
    it out (its engine does not detokenize)."""
    if decode_token is None:
        return [{tid: Logprob(lp, rank, text) for tid, lp, rank, text in entry} if entry is not None else None
                for entry in entries]
    return [{tid: Logprob(lp, rank, decode_token(tid) if text is None else text) for tid, lp, rank, text in entry}
            if entry is not None else None for entry in entries]


class OutputEncoder:
    """Core side: each RequestOutput as the delta since the last one sent for its request."""

    def __init__(self):
        self._sent: dict[str, dict[int, tuple[int, int, int]]] = {}   # request -> index -> (chars, tokens, lps)

    def encode(self, output: RequestOutput) -> list:
        first = output.request_id not in self._sent
        sent = self._sent.setdefault(output.request_id, {})
        completions = []
        for c in output.outputs:
            num_chars, num_tokens, num_lps = sent.get(c.index, (0, 0, 0))
            # Text only grows, except that a finished completion may be cut back (a stop string removed).
            start = min(num_chars, len(c.text))
            logprobs = None if c.logprobs is None else _encode_logprobs(c.logprobs[num_lps:])
            completions.append([c.index, start, c.text[start:], c.token_ids[num_tokens:], logprobs,
                                c.cumulative_logprob, c.finish_reason, c.stop_reason])
            sent[c.index] = (len(c.text), len(c.token_ids), len(c.logprobs) if c.logprobs is not None else 0)
        m = output.metrics
        metrics = None if m is None else [getattr(m, name) for name in _METRIC_FIELDS]
        prompt_logprobs = None
        if output.prompt_logprobs is not None and (first or output.finished):
            prompt_logprobs = _encode_logprobs(output.prompt_logprobs)
        if output.finished:
            del self._sent[output.request_id]
        return [output.request_id, output.finished, output.num_cached_tokens, metrics, output.error,
                output.error_param, prompt_logprobs, completions]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class _Completion:
    """One completion of a request, as the front end rebuilds it: tokens, logprobs, finish, and its text with the
    incremental detokenizer's state under the names Detokenizer.update and check_stop_strings read of a Sequence
    (`token_ids` holds the last prompt tokens as the first token's left context, then the output)."""

    __slots__ = ("params", "token_ids", "prefix_offset", "read_offset", "output_text", "output_token_ids",
                 "logprobs", "cumulative_logprob", "finish_reason", "stop_reason", "stopped_here")

    def __init__(self, params: SamplingParams | None, prompt_token_ids: list[int]):
        self.params = params
        self.token_ids = list(prompt_token_ids[-5:])   # the same window a Sequence's offsets start on
        self.read_offset, self.prefix_offset = len(self.token_ids), 0
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.logprobs = None
        self.cumulative_logprob = None
        self.finish_reason = self.stop_reason = None
        self.stopped_here = False   # ended by a stop string found here: the core's later tokens are past it


class OutputAccumulator:
    """Front-end side: rebuilds each request's cumulative RequestOutput from the core's deltas.

    With a `detokenizer` (the serving front end: the core's LLMEngine runs with detokenize=False) the text is made
    here, as LLMEngine makes it in-process: incremental detokenization, then the stop conditions in the same order
    (a stop token the core ended on, a stop string in the new text, the core's length limit), logprob tokens
    decoded. A stop string ends its completion here at once (tokens after it in the same delta, possible under
    speculative decoding, are dropped with their logprobs) and is queued in `stops` for the core to finish that
    completion, so the stream is what LLM.generate gives. Without one, the text comes from the core."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], *,
                 params: SamplingParams | None = None, detokenizer=None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self._decode_token = None if detokenizer is None else detokenizer.decode_token
        self.completions: dict[int, _Completion] = {}
        self.prompt_logprobs = None
        self.stops: list[int] = []   # completion indices ended here by a stop string, for the core to finish

    def add(self, data: list) -> RequestOutput:
        _, finished, num_cached_tokens, metrics, error, error_param, prompt_logprobs, completions = data
        if prompt_logprobs is not None:
            self.prompt_logprobs = _decode_logprobs(prompt_logprobs, self._decode_token)
        for index, start, text, token_ids, logprobs, cumulative, finish_reason, stop_reason in completions:
            c = self.completions.get(index)
            if c is None:
                c = self.completions[index] = _Completion(self.params, self.prompt_token_ids)
            if c.stopped_here:
                continue
            entries = None if logprobs is None else _decode_logprobs(logprobs, self._decode_token)
            if self.detokenizer is None:
                c.output_text = c.output_text[:start] + text
                c.output_token_ids += token_ids
                kept = len(token_ids)
            else:
                kept = self._detokenize(c, index, token_ids, finish_reason, stop_reason)
            if entries is not None:
                c.logprobs = (c.logprobs or []) + entries[:kept]
            if kept == len(token_ids):
                c.cumulative_logprob = cumulative
            elif cumulative is not None and entries is not None:
                # The core's sum without the dropped tokens: the kept ones added as the core adds them.
                total = c.cumulative_logprob if c.cumulative_logprob is not None else 0.0
                for entry, token_id in zip(entries[:kept], token_ids):
                    total += entry[token_id].logprob
                c.cumulative_logprob = total
            else:
                c.cumulative_logprob = cumulative
            if not c.stopped_here:
                c.finish_reason, c.stop_reason = finish_reason, stop_reason
        request_metrics = None if metrics is None else RequestMetrics(**dict(zip(_METRIC_FIELDS, metrics)))
        if not finished and self.detokenizer is not None and self.params is not None:
            # Every completion ended (some here, by stop strings): the request is done, whatever the core says next.
            finished = (len(self.completions) == self.params.n
                        and all(c.finish_reason is not None for c in self.completions.values()))
            if finished and request_metrics is not None:
                request_metrics.finished_time = time.time()
        outputs = [CompletionOutput(index=i, text=c.output_text, token_ids=list(c.output_token_ids),
                                    cumulative_logprob=c.cumulative_logprob,
                                    logprobs=None if c.logprobs is None else list(c.logprobs),
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for i, c in sorted(self.completions.items())]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=finished, num_cached_tokens=num_cached_tokens,
                             metrics=request_metrics, prompt_logprobs=self.prompt_logprobs, error=error,
                             error_param=error_param)

    def _detokenize(self, c: _Completion, index: int, token_ids: list[int], finish_reason, stop_reason) -> int:
        """Append `token_ids` to completion `c` with their text (LLMEngine._check_stop's order); returns how many
        were kept (fewer when a stop string ends the completion inside them)."""
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


def encode_metrics(metrics: EngineMetrics) -> dict:
    return dataclasses.asdict(metrics)


def decode_metrics(data: dict) -> EngineMetrics:
    data = dict(data)
    if data.get("spec_decode") is not None:
        data["spec_decode"] = SpecDecodeStats(**data["spec_decode"])
    return EngineMetrics(**data)


def packb(message) -> bytes:
    import msgpack
    return msgpack.packb(message, use_bin_type=True)


def unpackb(data: bytes):
    import msgpack
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# -- the core process ---------------------------------------------------------------------------------------------
class EngineCore:
    """The step loop of one LLMEngine behind a ROUTER socket."""

    def __init__(self, engine, address: str, *, parent_pid: int | None = None):
        import zmq

        self.engine = engine
        engine.async_grammar_compile = True
        engine.detokenize = False   # the front ends make the text and find stop strings (OutputAccumulator)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.parent_pid = parent_pid
        self.owners: dict[str, bytes] = {}   # request_id -> the identity of the front end that sent it
        self.clients: set[bytes] = set()
        self.encoder = OutputEncoder()

    def info(self) -> dict:
        engine = self.engine
        config = engine.config
        return {"max_model_len": engine.max_model_len, "vocab_size": engine.model_config.vocab_size,
                "sampling_defaults": engine.sampling_defaults,
                "tokenizer": config.tokenizer or engine.model_config.model_dir,
                "eos_token_ids": sorted(engine.model_config.eos_token_ids), "pid": os.getpid()}

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        last_parent_check = time.monotonic()
        while True:
            busy = self.engine.has_unfinished_requests()
            if poller.poll(0 if busy else 500):
                self._drain()
            if time.monotonic() - last_parent_check > 1.0:
                last_parent_check = time.monotonic()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("the engine core's parent process is gone: exiting")
                    return
            if self.engine.has_unfinished_requests():
                self._step()

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(identity, unpackb(payload))

    def _send(self, identity: bytes, message) -> None:
        self.socket.send_multipart([identity, packb(message)])

    def _handle(self, identity: bytes, message: list) -> None:
        kind = message[0]
        if kind == "hello":
            self.clients.add(identity)
            self._send(identity, ["ready", self.info()])
        elif kind == "add":
            _, request_id, text, token_ids, params, bad_words, arrival = message
            try:
                self.engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids},
                                        decode_params(params), arrival_time=arrival,
                                        bad_words_token_ids=bad_words)
            except ValueError as e:   # a bad request: its stream gets a 400 naming the field
                error = RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=token_ids, outputs=[],
                                      finished=True, error=str(e), error_param=_param_of(e))
                self._send(identity, ["outputs", [self.encoder.encode(error)]])
                return
            self.owners[request_id] = identity
        elif kind == "abort":
            outputs = []
            for request_id in message[1]:
                output = self.engine.abort_request(request_id)
                if output is not None:
                    outputs.append(output)
            self._dispatch(outputs)
        elif kind == "stop":   # completions a front end ended on a stop string
            outputs = []
            for request_id, indices in message[1]:
                output = self.engine.stop_sequences(request_id, indices)
                if output is not None:
                    outputs.append(output)
            self._dispatch(outputs)
        elif kind == "call":
            _, call_id, method = message
            if method == "get_metrics":
                value = encode_metrics(self.engine.get_metrics())
            else:
                value = None
            self._send(identity, ["result", call_id, value])

    def _step(self) -> None:
        from engine.executor import WorkerDiedError

        try:
            outputs = self.engine.step()
        except WorkerDiedError:
            raise
        except Exception as e:
            # LLMEngine fails only the requests of a bad step itself; should a step raise anyway, abort every
            # request in the engine (their state is unknown), fail their streams and keep serving.
            logger.exception("engine step failed; failing the requests in the engine")
            outputs = self.engine.fail_all_requests(e)
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_owner: dict[bytes, list] = {}
        for output in outputs:
            owner = self.owners.get(output.request_id)
            if output.finished:
                self.owners.pop(output.request_id, None)
            if owner is None:
                self.encoder.forget(output.request_id)
                continue
            by_owner.setdefault(owner, []).append(self.encoder.encode(output))
        for owner, encoded in by_owner.items():
            self._send(owner, ["outputs", encoded])

    def tell_dead(self, message: str) -> None:
        for identity in self.clients:
            try:
                self._send(identity, ["dead", message])
            except Exception:
                pass

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def _param_of(error: ValueError) -> str | None:
    word = str(error).split(" ", 1)[0].rstrip(":")
    return word if word.isidentifier() else None


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, the model's Python objects, tokenizer, caches) out of the garbage
    collector's reach, as vLLM does after start-up: they live as long as the process, and a full collection
    traversed them all. In the serving core one took 147 ms (tiny Llama; a step is 1-15 ms), every few seconds
    under load: a pause in every running request's stream."""
    import gc

    gc.collect()
    gc.freeze()


def run_engine_core(engine_args_fields: dict, address: str, parent_pid: int, ready_pipe) -> None:
    """The core process's entry point (multiprocessing spawn): build the engine, say it is ready (or why it is
    not) on ready_pipe, then serve until the parent is gone or the front ends are."""
    import signal

    # Ctrl-C reaches the whole process group: the parent then stops this process (SIGTERM) once its front ends
    # have shut down, so the core does not die under requests still being answered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    core = None
    try:
        from engine.engine_args import EngineArgs

        engine = EngineArgs(**engine_args_fields).create_engine()
        core = EngineCore(engine, address, parent_pid=parent_pid)
        freeze_startup_objects()
        ready_pipe.send(("ready", core.info()))
        ready_pipe.close()
    except BaseException as e:   # noqa: BLE001 - tell the parent why, then exit
        ready_pipe.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        ready_pipe.close()
        sys.exit(1)
    try:
        core.run()
    except BaseException as e:   # noqa: BLE001 - the model's worker died, or the loop broke
        logger.exception("the engine core failed")
        core.tell_dead(f"the engine core failed: {type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        try:
            core.engine.shutdown()
        finally:
            core.close()
