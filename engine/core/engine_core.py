"""The engine core in a process of its own (vLLM V1's EngineCoreProc): the scheduler, the executor and the step
loop, and nothing else, so that no front-end work (HTTP, tokenization, chat templates, streaming) can hold up a
step, and no step can hold up the front end.

The API server processes talk to it over one ZMQ socket (a ROUTER here, a DEALER in each front end,
engine/mp_engine.py) in msgpack messages:

    front end -> core   ("hello",)                                      -> ("ready", info)
                        ("add", request_id, prompt_text, prompt_token_ids, params, bad_words_token_ids, arrival)
                        ("abort", [request_id, ...])
                        ("call", call_id, method)                       -> ("result", call_id, value)
    core -> front end   ("outputs", [encoded RequestOutput, ...])       after each step, to the request's owner
                        ("dead", message)                               the core cannot go on (then it exits)

Outputs are deltas (encode_output): each step sends the new token ids, logprobs and text of every completion, not
the cumulative lists, so a request's traffic is linear in its length; the front end rebuilds vLLM's cumulative
RequestOutput (OutputAccumulator). A request's validation errors at add time come back as an output with `error`
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


def _decode_logprobs(entries) -> list:
    return [{tid: Logprob(lp, rank, text) for tid, lp, rank, text in entry} if entry is not None else None
            for entry in entries]


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


class OutputAccumulator:
    """Front-end side: rebuilds each request's cumulative RequestOutput from the core's deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.completions: dict[int, list] = {}   # index -> [text, token_ids, logprobs, cum, finish, stop]
        self.prompt_logprobs = None

    def add(self, data: list) -> RequestOutput:
        _, finished, num_cached_tokens, metrics, error, error_param, prompt_logprobs, completions = data
        if prompt_logprobs is not None:
            self.prompt_logprobs = _decode_logprobs(prompt_logprobs)
        for index, start, text, token_ids, logprobs, cumulative, finish_reason, stop_reason in completions:
            state = self.completions.setdefault(index, ["", [], None, None, None, None])
            state[0] = state[0][:start] + text
            state[1] = state[1] + token_ids
            if logprobs is not None:
                state[2] = (state[2] or []) + _decode_logprobs(logprobs)
            state[3], state[4], state[5] = cumulative, finish_reason, stop_reason
        outputs = [CompletionOutput(index=i, text=s[0], token_ids=s[1], cumulative_logprob=s[3],
                                    logprobs=None if s[2] is None else list(s[2]), finish_reason=s[4],
                                    stop_reason=s[5])
                   for i, s in sorted(self.completions.items())]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=finished, num_cached_tokens=num_cached_tokens,
                             metrics=None if metrics is None else RequestMetrics(**dict(zip(_METRIC_FIELDS, metrics))),
                             prompt_logprobs=self.prompt_logprobs, error=error, error_param=error_param)


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
