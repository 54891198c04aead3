"""`AsyncLLMEngine`: the engine behind an asyncio server (vLLM's AsyncLLMEngine, in one file).

One background task steps the engine while requests exist. `LLMEngine` is not thread-safe, so every call
into it (step, add_request, abort_request, get_metrics) runs on ONE dedicated worker thread: calls are
serialized with the step loop by construction (a single-thread executor is a FIFO command queue), and the
event loop never blocks on a step. Tokenization (and chat templating) runs on a second worker thread, so a
long prompt does not stall the steps of requests already running; detokenization is incremental inside the
step (engine/detokenizer.py) and costs a few short decodes per token.

    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=64)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
        print(output.outputs[0].text)   # cumulative, like vLLM's RequestOutput

A request whose consumer goes away (the generator is closed, garbage-collected or its task cancelled) is
aborted, so its blocks return to the pool.
"""
import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from engine.llm_engine import LLMEngine
from engine.outputs import EngineMetrics, RequestOutput
from engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The step loop raised; the engine can serve no more requests."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-tokenize")
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.dead_error: BaseException | None = None
        # Called (in the event loop) with every finished RequestOutput: the server's metrics hook in here.
        self.finished_callbacks: list[Callable[[RequestOutput], None]] = []

    @classmethod
    def from_args(cls, model: str, **llm_kwargs) -> "AsyncLLMEngine":
        """Build the LLMEngine (same arguments as engine.LLM) and wrap it."""
        return cls(LLMEngine(model, **llm_kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # -- the step loop ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop on the running event loop (done lazily by generate())."""
        if self.dead_error is not None:
            raise EngineDeadError("the engine step loop has failed") from self.dead_error
        if self.is_running:
            return
        self._wake = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run_step_loop(), name="engine-step-loop")

    async def _run_step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        has_work = False
        try:
            while True:
                if not has_work:
                    # Cleared after waking, not before waiting: a set() that raced with the last step survives.
                    await self._wake.wait()
                    self._wake.clear()
                outputs, has_work = await loop.run_in_executor(self._engine_thread, self._step)
                for output in outputs:
                    self._dispatch(output)
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # a failed step: fail every open request, refuse new ones
            self.dead_error = e
            for queue in self._streams.values():
                queue.put_nowait(EngineDeadError(f"the engine step loop failed: {type(e).__name__}: {e}"))
            raise

    def _step(self) -> tuple[list[RequestOutput], bool]:
        outputs = self.engine.step()
        return outputs, self.engine.has_unfinished_requests()

    def _dispatch(self, output: RequestOutput) -> None:
        if output.finished:
            for callback in self.finished_callbacks:
                callback(output)
        queue = self._streams.get(output.request_id)
        if queue is not None:   # None: its consumer left and the abort is queued behind this step
            queue.put_nowait(output)

    async def _call(self, fn, *args):
        """Run one LLMEngine call on the engine thread, between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    # -- requests ---------------------------------------------------------------------------------------------
    async def process_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt (as LLMEngine.process_prompt) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                self.engine.process_prompt, prompt)

    async def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                                  chat_template: str | None = None) -> tuple[str, list[int]]:
        """Render a conversation with the tokenizer's chat template and tokenize it (tokenizer thread).
        Raises ValueError when the tokenizer has no template or the messages do not render."""
        def render():
            tokenizer = self.engine.tokenizer
            if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
                raise ValueError("the model's tokenizer has no chat template")
            try:
                text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            except Exception as e:   # jinja errors (raise_exception in templates, bad roles) are bad input
                raise ValueError(f"cannot apply the chat template: {e}") from e
            # The template wrote every special token it wants: no BOS again (as LLM.chat).
            return text, tokenizer.encode(text, add_special_tokens=False)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, render)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (each cumulative; the last has finished=True).

        prompt: a str, or {"prompt_token_ids": [...]} (optionally with "prompt" text). Invalid input raises
        ValueError before anything is yielded, leaving other requests untouched."""
        self.start()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        text, token_ids = await self.process_prompt(prompt)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self._call(self.engine.add_request, request_id,
                             {"prompt": text, "prompt_token_ids": token_ids}, params)
            self._wake.set()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True   # the engine is dead: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not finished:
                # Fire and forget: the executor runs it after whatever step is in flight. (Awaiting is not
                # allowed here when the generator is being garbage-collected.)
                self._engine_thread.submit(self.engine.abort_request, request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a finish_reason "abort" output. Unknown ids are ignored."""
        output = await self._call(self.engine.abort_request, request_id)
        queue = self._streams.get(request_id)
        if output is not None and queue is not None:
            queue.put_nowait(output)

    async def get_metrics(self) -> EngineMetrics:
        """LLMEngine.get_metrics(), taken between steps."""
        return await self._call(self.engine.get_metrics)

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError("the engine step loop has failed") from self.dead_error

    async def shutdown(self) -> None:
        """Stop the step loop and abort whatever is in flight."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except BaseException:
                pass
            self._loop_task = None
        for request_id in list(self._streams):
            await self._call(self.engine.abort_request, request_id)
        self._engine_thread.shutdown(wait=True)
        self._tokenizer_thread.shutdown(wait=True)

