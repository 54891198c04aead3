"""`AsyncLLMEngine`: the engine behind an asyncio server (vLLM's AsyncLLMEngine, in one file).

One background task steps the engine while requests exist. `LLMEngine` is not thread-safe, so every call
into it (step, add_request, abort_request, get_metrics) runs on ONE dedicated worker thread: calls are
serialized with the step loop by construction (a single-thread executor is a FIFO command queue), and the
event loop never blocks on a step. Tokenization (and chat templating) runs on a small pool of tokenizer
threads, each with its own copy of the tokenizer (HF fast tokenizers release the GIL while encoding, and a
copy per thread keeps their Rust state from being shared), so a long prompt neither stalls the steps of
requests already running nor the tokenization of other requests; detokenization is incremental, behind the
engine core in the step (engine/core/output_processor.py), and costs a few short decodes per token.

A step that raises fails the requests it held (their streams end with an error output), is logged, and the
loop goes on serving; LLMEngine itself finishes the requests of a failed step with `RequestOutput.error`.

    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=64)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
        print(output.outputs[0].text)   # cumulative, like vLLM's RequestOutput

A request whose consumer goes away (the generator is closed, garbage-collected or its task cancelled) is
aborted, so its blocks return to the pool, and the callbacks see it finish with finish_reason "abort".

`interrupt_streams(message)` ends every stream at once (a server's shutdown deadline): each generate() raises
StreamInterruptedError and its request is aborted; requests that arrive afterwards are refused the same way.
"""
import asyncio
import copy
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from engine.step_records import EngineCoreRequest
from engine.core.llm_engine import LLMEngine
from engine.outputs import EngineMetrics, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Tokenizer threads: two keep one huge prompt from holding up every other request on a 2-core machine
# without oversubscribing it (the step thread needs a core too).
NUM_TOKENIZER_THREADS = 2


class EngineDeadError(RuntimeError):
    """The step loop raised; the engine can serve no more requests."""


class StreamInterruptedError(RuntimeError):
    """The server ended this request's stream before the request finished (interrupt_streams: its shutdown
    deadline); the request was aborted."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, num_tokenizer_threads: int = NUM_TOKENIZER_THREADS):
        self.engine = engine
        # Grammars compile on a thread of the engine's, never on the step thread (LLMEngine._pending_grammars).
        engine.async_grammar_compile = True
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=num_tokenizer_threads,
                                                  thread_name_prefix="engine-tokenize")
        self._thread_tokenizers = threading.local()
        self._chat_template_sandbox = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.dead_error: BaseException | None = None
        self.interrupt_message: str | None = None   # set by interrupt_streams: no stream runs any more
        # Called (in the event loop) with every finished RequestOutput: the server's metrics hook in here.
        self.finished_callbacks: list[Callable[[RequestOutput], None]] = []
        # Called (in the event loop) with every RequestOutput, finished or not (the inter-token latency metric).
        self.output_callbacks: list[Callable[[RequestOutput], None]] = []

    @classmethod
    def from_args(cls, model: str, **llm_kwargs) -> "AsyncLLMEngine":
        """Build the LLMEngine (same arguments as engine.LLM, see engine/engine_args.py) and wrap it."""
        from engine.engine_args import EngineArgs
        return cls(EngineArgs(model=model, **llm_kwargs).create_engine())

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
        except BaseException as e:   # the loop itself broke (not a step: _step contains those)
            logger.exception("the engine step loop failed")
            self.dead_error = e
            for queue in self._streams.values():
                queue.put_nowait(EngineDeadError(f"the engine step loop failed: {type(e).__name__}: {e}"))
            raise

    def _step(self) -> tuple[list[RequestOutput], bool]:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # LLMEngine fails only the requests of a bad step itself; should a step raise anyway, abort every
            # request in the engine (their state is unknown), fail their streams and keep serving.
            logger.exception("engine step failed; failing the requests in the engine")
            outputs = self.engine.fail_all_requests(e)
        return outputs, self.engine.has_unfinished_requests()

    def _dispatch(self, output: RequestOutput) -> None:
        for callback in self.output_callbacks:
            callback(output)
        if output.finished:
            for callback in self.finished_callbacks:
                callback(output)
        queue = self._streams.get(output.request_id)
        if queue is not None:   # None: its consumer left and the abort is queued behind this step
            queue.put_nowait(output)

    def interrupt_streams(self, message: str) -> int:
        """End every open stream now: its generate() raises StreamInterruptedError(message) and aborts its
        request; generate() refuses new requests the same way from now on. Returns how many streams were open."""
        self.interrupt_message = message
        for queue in self._streams.values():
            queue.put_nowait(StreamInterruptedError(message))
        return len(self._streams)

    def _check_not_interrupted(self) -> None:
        if self.interrupt_message is not None:
            raise StreamInterruptedError(self.interrupt_message)

    def _report_abort(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      last: RequestOutput | None) -> None:
        """Tell the callbacks that a request whose consumer left finished as aborted (the engine's own abort
        output goes nowhere: its stream is gone), from the last output the consumer saw."""
        outputs = [] if last is None else [dataclasses.replace(c, finish_reason=c.finish_reason or "abort")
                                           for c in last.outputs]
        self._dispatch(RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                     outputs=outputs, finished=True,
                                     metrics=None if last is None else last.metrics))

    async def _call(self, fn, *args):
        """Run one LLMEngine call on the engine thread, between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    # -- requests ---------------------------------------------------------------------------------------------
    def _thread_tokenizer(self):
        """This tokenizer thread's own copy of the engine's tokenizer."""
        if self.engine.tokenizer is None:
            raise ValueError("this needs the tokenizer, and the engine has none (skip_tokenizer_init=True): prompts "
                             "must be token ids")
        tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._thread_tokenizers.tokenizer = copy.deepcopy(self.engine.tokenizer)
        return tokenizer

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (on a tokenizer thread), as LLMEngine tokenizes a text prompt."""
        return self._thread_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def _process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None)
        if isinstance(text, str) and text and (isinstance(prompt, str) or set(prompt) == {"prompt"}):
            prompt = {"prompt": text, "prompt_token_ids": self._encode(text)}
        return self.engine.process_prompt(prompt, truncate_prompt_tokens)   # validation only, once the ids exist

    async def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt (as LLMEngine.process_prompt) on a tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self._process_prompt, prompt,
                                                                truncate_prompt_tokens)

    def _process_request(self, request_id: str, prompt, params: SamplingParams,
                         arrival_time: float | None, lora_request=None) -> EngineCoreRequest:
        text, token_ids = self._process_prompt(prompt, params.truncate_prompt_tokens)
        bad_words = None
        if params.bad_words and self.engine.tokenizer is not None:
            # 100k bad words are seconds of work the step loop must not do.
            bad_words = self.engine.bad_words_token_ids(params.bad_words, self._thread_tokenizer())
        return self.engine.input_processor.process(request_id, {"prompt": text, "prompt_token_ids": token_ids},
                                                   params, arrival_time=arrival_time, bad_words_token_ids=bad_words,
                                                   lora_request=lora_request)

    async def process_request(self, request_id: str, prompt, params: SamplingParams, *,
                              arrival_time: float | None = None, lora_request=None) -> EngineCoreRequest:
        """The input processor's request (engine/core/input_processor.py), made on a tokenizer thread: the prompt and
        the bad words tokenized, everything validated (ValueError naming the field)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self._process_request,
                                                                request_id, prompt, params, arrival_time, lora_request)

    async def run_on_tokenizer_thread(self, fn, *args):
        """fn(*args, tokenizer=...) on a tokenizer thread, with that thread's tokenizer (tokenize, detokenize)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, lambda: fn(*args, tokenizer=self._thread_tokenizer()))

    async def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                                  chat_template: str | None = None, tools: list[dict] | None = None,
                                  continue_final_message: bool = False,
                                  chat_template_kwargs: dict | None = None,
                                  literals: dict[str, str] | None = None) -> tuple[str, list[int]]:
        """Render a conversation with the chat template (the tokenizer's unless `chat_template`) and tokenize it
        (tokenizer thread). tools go to the template as `tools`; chat_template_kwargs are further template
        variables (e.g. enable_thinking). literals: {placeholder: text} put in the messages in place of text
        that must stay text: each placeholder in the rendered prompt becomes that text, tokenized with special
        tokens split (never a control token). Raises ValueError when there is no template or the messages do
        not render."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this needs the tokenizer, and the engine has none (skip_tokenizer_init=True)")
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template")
        try:
            template = tokenizer.get_chat_template(chat_template, tools)
        except Exception as e:
            raise ValueError(f"cannot apply the chat template: {type(e).__name__}: {e}") from e
        template_vars = dict(chat_template_kwargs or {})
        for reserved in ("conversation", "messages", "tokenize", "chat_template", "tools", "conversations",
                         "documents", "add_generation_prompt", "continue_final_message",
                         "return_assistant_tokens_mask"):
            template_vars.pop(reserved, None)
        template_vars = {**tokenizer.special_tokens_map, **template_vars}
        # Rendered in a sandbox process (time and memory limits), never on a thread of this process.
        text = await self.chat_template_sandbox.render(
            chat_template=template, messages=messages, tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, template_vars=template_vars)
        if literals:
            return await self.run_on_tokenizer_thread(_encode_with_literals, text, literals)
        # The template wrote every special token it wants: no BOS again (as LLM.chat).
        token_ids = await self.run_on_tokenizer_thread(
            lambda tokenizer: tokenizer.encode(text, add_special_tokens=False))
        return text, token_ids

    @property
    def chat_template_sandbox(self):
        """The sandbox processes chat templates render in (engine/chat_template_sandbox.py)."""
        if self._chat_template_sandbox is None:
            from engine.chat_template_sandbox import ChatTemplateSandbox
            self._chat_template_sandbox = ChatTemplateSandbox()
        return self._chat_template_sandbox

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (each cumulative; the last has finished=True).

        prompt: a str, or {"prompt_token_ids": [...]} (optionally with "prompt" text). lora_request: its LoRA
        adapter (engine.LoRARequest; None: the base model). Invalid input raises ValueError before anything is
        yielded, leaving other requests untouched."""
        self.start()
        self._check_not_interrupted()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        params = params if params is not None else self.engine.default_sampling_params()
        request = await self.process_request(request_id, prompt, params, lora_request=lora_request)
        self._check_not_interrupted()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        added = finished = False
        last = None
        try:
            await self._call(self.engine.add_processed_request, request)
            added = True
            self._wake.set()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = isinstance(item, EngineDeadError)   # the engine is dead: nothing to abort
                    raise item
                finished = item.finished
                last = item
                yield item
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not finished:
                # Fire and forget: the executor runs it after whatever step is in flight. (Awaiting is not
                # allowed here when the generator is being garbage-collected.)
                self._engine_thread.submit(self.engine.abort_request, request_id)
                if added:
                    self._report_abort(request_id, request.prompt, request.prompt_token_ids, last)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a finish_reason "abort" output. Unknown ids are ignored."""
        output = await self._call(self.engine.abort_request, request_id)
        if output is not None:
            self._dispatch(output)   # its stream (if any) ends with it, and the callbacks count it

    async def get_metrics(self) -> EngineMetrics:
        """LLMEngine.get_metrics(), taken between steps."""
        return await self._call(self.engine.get_metrics)

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine.reset_prefix_cache between steps."""
        return await self._call(self.engine.reset_prefix_cache)

    async def add_lora(self, lora_request) -> bool:
        """LLMEngine.add_lora between steps: the adapter loaded now (ValueError for a bad one)."""
        return await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """LLMEngine.remove_lora between steps."""
        return await self._call(self.engine.remove_lora, lora_int_id)

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
        self._tokenizer_pool.shutdown(wait=True)
        if self._chat_template_sandbox is not None:
            self._chat_template_sandbox.shutdown()


def _encode_with_literals(text: str, literals: dict[str, str], *, tokenizer) -> tuple[str, list[int]]:
    """(text with each placeholder of `literals` replaced by its text, token ids): the text between placeholders
    tokenized as a rendered prompt is (special tokens are control tokens), each literal with special tokens split
    into ordinary ones. Raises ValueError when the rendered text holds a placeholder's start but not the whole
    placeholder (the template changed it)."""
    import re

    pieces, token_ids, position = [], [], 0
    for match in re.finditer("|".join(map(re.escape, literals)), text):
        segment = text[position:match.start()]
        literal = literals[match.group(0)]
        if segment:
            token_ids += tokenizer.encode(segment, add_special_tokens=False)
        token_ids += tokenizer.encode(literal, add_special_tokens=False, split_special_tokens=True)
        pieces += [segment, literal]
        position = match.end()
    tail = text[position:]
    if tail:
        token_ids += tokenizer.encode(tail, add_special_tokens=False)
    pieces.append(tail)
    text = "".join(pieces)
    common = next(iter(literals)).rsplit("N", 1)[0]   # the placeholders' shared part (each ends in N<index>X)
    if common in text:
        raise ValueError("the chat template altered the placeholder of special-token text in a message")
    return text, token_ids
