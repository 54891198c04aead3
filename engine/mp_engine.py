"""The API server's side of the engine core process (vLLM V1's AsyncLLM over an EngineCoreClient).

`MPAsyncLLMEngine` has AsyncLLMEngine's API (the server code is the same for both), but the engine runs in another
process (engine/core/engine_core.py): this process tokenizes, renders chat templates (in their sandbox processes),
validates prompts, and turns the core's per-step token deltas back into cumulative RequestOutputs for the streams:
it detokenizes them, finds stop strings (telling the core which completions they ended) and decodes logprob
tokens, so the core's step loop does none of that. Any number of these front ends (--api-server-count) can share
one core.

    core = start_engine_core(engine_args)            # the core process, ready to serve (address, info)
    engine = MPAsyncLLMEngine(core.address, core.info)

The core going away (crash, kill) is noticed within a second: every open stream ends with EngineDeadError, new
requests are refused and /health answers 500. A stream its consumer leaves (or interrupt_streams ends) is aborted
in the core and reported to the callbacks as finished with "abort", as in AsyncLLMEngine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.step_records import EngineCoreOutput
from engine.core.core_process import decode_metrics, packb, unpackb
from engine.core.input_processor import InputProcessor
from engine.core.output_processor import OutputProcessor
from engine.outputs import EngineMetrics
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CORE_STARTUP_TIMEOUT_S = 600.0


@dataclasses.dataclass
class EngineCoreHandle:
    """A started engine core process."""
    process: multiprocessing.Process
    address: str
    info: dict

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core process (SIGTERM, then SIGKILL), leaving no process behind."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        path = self.address.removeprefix("ipc://")
        if path != self.address and os.path.exists(path):
            os.unlink(path)


def start_engine_core(engine_args) -> EngineCoreHandle:
    """Start the engine core of `engine_args` (an EngineArgs) in a spawned process and wait until it serves.
    The options are checked here (a bad one is a ValueError before any process starts); raises RuntimeError with
    the core's own error when it does not start."""
    from engine.core.core_process import run_engine_core

    config = engine_args.create_engine_config()
    address = f"ipc://{tempfile.gettempdir()}/engine-core-{uuid.uuid4().hex[:12]}.sock"
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=run_engine_core, args=(config, address, os.getpid(), sender),
                              name="engine-core", daemon=False)
    process.start()
    sender.close()
    handle = EngineCoreHandle(process, address, {})
    try:
        if not receiver.poll(CORE_STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the engine core did not start within {CORE_STARTUP_TIMEOUT_S:g} s")
        message = receiver.recv()
    except EOFError:
        handle.shutdown()
        raise RuntimeError(f"the engine core process exited while starting (exit code {process.exitcode})") \
            from None
    except BaseException:
        handle.shutdown()
        raise
    if message[0] != "ready":
        handle.shutdown()
        error = message[1]
        if error.startswith("ValueError: "):   # a bad option: the CLI reports it as such
            raise ValueError(error.removeprefix("ValueError: "))
        raise RuntimeError(f"the engine core failed to start: {error}\n{message[2]}")
    handle.info = message[1]
    return handle


class _FrontendView:
    """What the front end has of the engine (the server reads `engine.engine`): the tokenizer, the limits, the
    sampling defaults, and the input processor (prompt validation, bad-words tokenization) and output processor
    (text, stop strings) that run in this process."""

    def __init__(self, info: dict):
        from engine.tokenizer import get_tokenizer

        self.tokenizer = get_tokenizer(info["tokenizer"])
        self.max_model_len = info["max_model_len"]
        self.sampling_defaults = dict(info["sampling_defaults"])
        self.model_config = _ModelView(info["vocab_size"], frozenset(info["eos_token_ids"]))
        self.input_processor = InputProcessor(self.tokenizer, vocab_size=info["vocab_size"],
                                              max_model_len=info["max_model_len"], max_num_seqs=info["max_num_seqs"],
                                              enable_lora=info.get("enable_lora", False),
                                              max_logprobs=info["max_logprobs"])
        self.output_processor = OutputProcessor(self.tokenizer)

    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        return self.input_processor.process_prompt(prompt, truncate_prompt_tokens)

    def bad_words_token_ids(self, bad_words: list[str], tokenizer=None) -> list[list[int]]:
        return self.input_processor.bad_words_token_ids(bad_words, tokenizer)


@dataclasses.dataclass
class _ModelView:
    vocab_size: int
    eos_token_ids: frozenset


class MPAsyncLLMEngine(AsyncLLMEngine):
    """AsyncLLMEngine's API on an engine core in another process (see the module docstring)."""

    def __init__(self, address: str, info: dict, *, core_pid: int | None = None, **kwargs):
        super().__init__(_FrontendView(info), **kwargs)
        self.address = address
        self.core_pid = core_pid if core_pid is not None else info.get("pid")
        self.identity = f"frontend-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._socket = None
        self._context = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        # Called once (in the event loop) when the core is found dead: `serve` shuts its server down then.
        self.dead_callbacks: list = []

    @property
    def is_running(self) -> bool:
        return self._reader is not None and not self._reader.done()

    # -- the connection -------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError("the engine core has failed") from self.dead_error
        if self.is_running:
            return
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop(), name="engine-core-reader")
        self._watchdog = loop.create_task(self._watch_core(), name="engine-core-watchdog")
        self._send(["hello"])

    def _send(self, message) -> None:
        self._socket.send(packb(message))   # zmq.asyncio: queued without blocking (DEALER, no high-water mark hit)

    async def _read_loop(self) -> None:
        try:
            while True:
                message = unpackb(await self._socket.recv())
                kind = message[0]
                if kind == "outputs":
                    self._on_outputs(message[1])
                elif kind == "result":
                    future = self._calls.pop(message[1], None)
                    if future is not None and not future.done():
                        future.set_result(message[2])
                elif kind == "dead":
                    self._die(EngineDeadError(message[1]))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 - the connection broke
            logger.exception("the connection to the engine core failed")
            self._die(EngineDeadError(f"the connection to the engine core failed: {type(e).__name__}: {e}"))

    async def _watch_core(self) -> None:
        """Notice a core process that died without a word (killed): every stream fails, /health turns 500."""
        while self.dead_error is None:
            await asyncio.sleep(0.5)
            if self.core_pid is not None and not _pid_alive(self.core_pid):
                self._die(EngineDeadError(f"the engine core process (pid {self.core_pid}) is gone"))

    def _die(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        logger.error("%s", error)
        self.dead_error = error
        for callback in self.dead_callbacks:
            callback(error)
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(str(error)))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))
        self._calls.clear()

    def _on_outputs(self, data: list) -> None:
        processed = self.engine.output_processor.process_outputs([EngineCoreOutput.from_wire(d) for d in data])
        if processed.stops:   # stop strings ended these completions: the core stops generating them
            self._send(["stop", [[request_id, indices] for request_id, indices in processed.stops]])
        if processed.failed:   # their output failed here (ended with the error): the core stops them
            self._send(["abort", processed.failed])
        for output in processed.request_outputs:
            self._dispatch(output)

    async def _call_core(self, method: str, *args):
        if self.dead_error is not None:
            raise EngineDeadError("the engine core has failed") from self.dead_error
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(["call", call_id, method, *args])
        return await future

    # -- requests -------------------------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, request_id: str, lora_request=None):
        """As AsyncLLMEngine.generate; the request runs in the core process."""
        self.start()
        self._check_not_interrupted()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        arrival = time.time()
        params = params if params is not None else SamplingParams(**self.engine.sampling_defaults)
        request = await self.process_request(request_id, prompt, params, arrival_time=arrival,
                                             lora_request=lora_request)
        if self.dead_error is not None:
            raise EngineDeadError("the engine core has failed") from self.dead_error
        self._check_not_interrupted()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        output_processor = self.engine.output_processor
        output_processor.add_request(request_id, request.prompt, request.prompt_token_ids, params)
        finished = False
        last = None
        try:
            self._send(["add", request.to_wire()])
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = isinstance(item, EngineDeadError)   # the core is gone: nothing to abort
                    raise item
                finished = item.finished
                if finished and not item.outputs and item.error:   # refused by add_request's checks: a 400
                    raise ValueError(item.error)
                last = item
                yield item
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not finished:
                output_processor.abort_request(request_id)
                if self.dead_error is None and self._socket is not None:
                    self._send(["abort", [request_id]])
                self._report_abort(request_id, request.prompt, request.prompt_token_ids, last)

    async def abort(self, request_id: str) -> None:
        if self.dead_error is None and self._socket is not None:
            self._send(["abort", [request_id]])

    async def get_metrics(self) -> EngineMetrics:
        return decode_metrics(await self._call_core("get_metrics"))

    async def reset_prefix_cache(self) -> bool:
        """The core empties its prefix cache (False while requests hold KV blocks)."""
        return bool(await self._call_core("reset_prefix_cache"))

    async def add_lora(self, lora_request) -> bool:
        """The core loads the adapter now (ValueError with its message for a bad one)."""
        self.engine.input_processor.check_lora_request(lora_request)
        status, value = await self._call_core("add_lora", lora_request.to_wire())
        if status == "error":
            raise ValueError(value)
        return value

    async def remove_lora(self, lora_int_id: int) -> bool:
        status, value = await self._call_core("remove_lora", lora_int_id)
        if status == "error":
            raise ValueError(value)
        return value

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error)) from self.dead_error
        if self.core_pid is not None and not _pid_alive(self.core_pid):
            self._die(EngineDeadError(f"the engine core process (pid {self.core_pid}) is gone"))
            raise self.dead_error

    async def shutdown(self) -> None:
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._reader = self._watchdog = None
        if self._socket is not None:
            if self.dead_error is None and self._streams:
                self._send(["abort", list(self._streams)])
            self._socket.close(linger=100)
            self._context.term()
            self._socket = None
        self._engine_thread.shutdown(wait=True)
        self._tokenizer_pool.shutdown(wait=True)
        if self._chat_template_sandbox is not None:
            self._chat_template_sandbox.shutdown()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (a dead child not yet reaped) still answers kill(0): read its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
