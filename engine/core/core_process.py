"""The engine core in a process of its own (vLLM V1's EngineCoreProc): `EngineCore`'s step loop and nothing else,
so that no front-end work (HTTP, tokenization, chat templates, detokenization, streaming) can hold up a step, and no
step can hold up the front end.

The API server processes talk to it over one ZMQ socket (a ROUTER here, a DEALER in each front end,
engine/mp_engine.py) in msgpack messages:

    front end -> core   ("hello",)                                      -> ("ready", info)
                        ("add", EngineCoreRequest.to_wire())
                        ("abort", [request_id, ...])
                        ("stop", [[request_id, [index, ...]], ...])     completions ended on a stop string
                        ("call", call_id, method, *args)                -> ("result", call_id, value)
    core -> front end   ("outputs", [EngineCoreOutput.to_wire(), ...])  after each step, to the request's owner
                        ("dead", message)                               the core cannot go on (then it exits)

Outputs are the core's token-id deltas (engine/step_records.py): each front end's OutputProcessor makes the text,
finds the stop strings and tells the core which completions they ended ("stop"). A request the core refuses when
it arrives (a check only the core can make) comes back as a finished output with `error` (and `error_param`: a
400), so it reaches the request's stream like any failure.

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

from engine.step_records import EngineCoreOutput, EngineCoreRequest
from engine.outputs import EngineMetrics, SpecDecodeStats

logger = logging.getLogger(__name__)


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
class EngineCoreProc:
    """The step loop of one EngineCore behind a ROUTER socket."""

    def __init__(self, core, address: str, *, parent_pid: int | None = None):
        import zmq

        self.core = core
        core.async_grammar_compile = True
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.parent_pid = parent_pid
        self.owners: dict[str, bytes] = {}   # request_id -> the identity of the front end that sent it
        self.clients: set[bytes] = set()
        self.stop_requested = False   # set by SIGTERM: run() returns between steps

    def info(self) -> dict:
        """What a front end needs of the core: the limits its input processor checks, the sampling defaults, where
        its tokenizer is."""
        core = self.core
        config = core.config
        return {"max_model_len": core.max_model_len, "vocab_size": core.model_config.vocab_size,
                "max_num_seqs": config.scheduler_config.max_num_seqs, "sampling_defaults": core.sampling_defaults,
                "enable_lora": config.lora_config is not None, "max_logprobs": config.max_logprobs,
                "tokenizer": config.tokenizer or core.model_config.model_dir,
                "eos_token_ids": sorted(core.model_config.eos_token_ids), "pid": os.getpid()}

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        last_parent_check = time.monotonic()
        while not self.stop_requested:
            busy = self.core.has_unfinished_requests()
            if poller.poll(0 if busy else 500):
                self._drain()
            if time.monotonic() - last_parent_check > 1.0:
                last_parent_check = time.monotonic()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("the engine core's parent process is gone: exiting")
                    return
            if self.core.has_unfinished_requests():
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
            request = EngineCoreRequest.from_wire(message[1])
            try:
                self.core.add_request(request)
            except ValueError as e:   # a bad request: its stream gets a 400 naming the field
                error = EngineCoreOutput(request.request_id, [], finished=True, error=str(e), error_param=_param_of(e))
                self._send(identity, ["outputs", [error.to_wire()]])
                return
            self.owners[request.request_id] = identity
        elif kind == "abort":
            outputs = []
            for request_id in message[1]:
                output = self.core.abort_request(request_id)
                if output is not None:
                    outputs.append(output)
            self._dispatch(outputs)
        elif kind == "stop":   # completions a front end ended on a stop string
            outputs = []
            for request_id, indices in message[1]:
                output = self.core.stop_sequences(request_id, indices)
                if output is not None:
                    outputs.append(output)
            self._dispatch(outputs)
        elif kind == "call":
            _, call_id, method, *args = message
            if method == "get_metrics":
                value = encode_metrics(self.core.get_metrics())
            elif method == "reset_prefix_cache":
                value = self.core.reset_prefix_cache()
            elif method in ("add_lora", "remove_lora"):   # [status, value]: a bad adapter is the caller's error
                value = self._lora_call(method, *args)
            else:
                value = None
            self._send(identity, ["result", call_id, value])

    def _lora_call(self, method: str, arg) -> list:
        from engine.lora import LoRARequest

        try:
            if method == "add_lora":
                return ["ok", self.core.add_lora(LoRARequest.from_wire(arg))]
            return ["ok", self.core.remove_lora(arg)]
        except ValueError as e:
            return ["error", str(e)]

    def _step(self) -> None:
        from engine.executor import WorkerDiedError

        try:
            outputs = self.core.step()
        except WorkerDiedError:
            raise
        except Exception as e:
            # EngineCore fails only the requests of a bad step itself; should a step raise anyway, abort every
            # request in the core (their state is unknown), fail their streams and keep serving.
            logger.exception("engine step failed; failing the requests in the engine")
            outputs = self.core.fail_all_requests(e)
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        by_owner: dict[bytes, list] = {}
        for output in outputs:
            owner = self.owners.get(output.request_id)
            if output.finished:
                self.owners.pop(output.request_id, None)
            if owner is not None:
                by_owner.setdefault(owner, []).append(output.to_wire())
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


def run_engine_core(config, address: str, parent_pid: int, ready_pipe) -> None:
    """The core process's entry point (multiprocessing spawn): build the EngineCore of `config` (an EngineConfig),
    say it is ready (or why it is not) on ready_pipe, then serve until the parent is gone or the front ends are."""
    import signal

    # Ctrl-C reaches the whole process group: the parent then stops this process (SIGTERM) once its front ends
    # have shut down, so the core does not die under requests still being answered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    core = None
    try:
        from engine.core.engine_core import EngineCore

        core = EngineCoreProc(EngineCore(config), address, parent_pid=parent_pid)

        # The parent stops this process with SIGTERM. Its default action would end the process at once, inside a
        # step perhaps, and skip the shutdown below: tensor-parallel workers would then fail in their next
        # collective. Leave the loop between steps instead, and shut down in order.
        def stop(signum, frame):
            core.stop_requested = True
        signal.signal(signal.SIGTERM, stop)
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
            core.core.shutdown()
        finally:
            core.close()
