"""/v1/completions and /v1/chat/completions on an AsyncLLMEngine: request -> engine requests -> response JSON
or server-sent events.

Every check happens before the first engine request is queued, and the engine's own checks (add_request)
surface before the HTTP response starts (the first output of every engine request is awaited first), so a
bad request gets a clean 4xx and leaves the requests in flight untouched. Streamed text holds back the last
len(longest stop string) - 1 characters until the request finishes, because a stop string is cut from the
text once it completes: streamed and non-streamed outputs are then equal."""
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.async_engine import AsyncLLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


class OpenAIError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _param_of(error: ValueError) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ...")."""
    word = str(error).split(" ", 1)[0]
    return word if word.isidentifier() else None


@dataclass(slots=True)
class _ChoiceState:
    """What one streamed choice has sent so far."""
    num_chars: int = 0
    num_tokens: int = 0
    sent_role: bool = False
    finished: bool = False


@dataclass(slots=True)
class _Prepared:
    request_id: str
    params: SamplingParams
    prompts: list[tuple[str | None, list[int]]]
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    firsts: list[RequestOutput] = field(default_factory=list)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str]):
        self.engine = engine
        self.served_model_names = served_model_names

    # -- shared -------------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "engine", "root": name,
             "max_model_len": self.engine.max_model_len} for name in self.served_model_names]}

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str) -> int:
        """The output budget; a request that cannot fit the context is a 400 (not silently shortened)."""
        max_model_len = self.engine.max_model_len
        if requested is None:
            requested = max_model_len - num_prompt_tokens
            if requested < 1:
                raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                  f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
                                  param="messages", code="context_length_exceeded")
        elif requested >= 1 and num_prompt_tokens + requested > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                              f"prompt, {requested} in the completion). Please reduce the prompt or {param}.",
                              param=param, code="context_length_exceeded")
        return requested

    async def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        try:
            return await self.engine.process_prompt(prompt)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise bad_request(str(e), param="prompt", code=code) from e

    async def _start(self, prepared: _Prepared) -> None:
        """Queue one engine request per prompt and wait for each one's first output, so that the engine's
        own rejections (ValueError from add_request) become a 400 before any response byte is sent."""
        prepared.streams = [
            self.engine.generate({"prompt": text, "prompt_token_ids": token_ids}, prepared.params,
                                 f"{prepared.request_id}-{i}")
            for i, (text, token_ids) in enumerate(prepared.prompts)]
        try:
            prepared.firsts = list(await asyncio.gather(*(anext(s) for s in prepared.streams)))
        except BaseException as e:
            await _close_all(prepared.streams)
            if isinstance(e, ValueError):
                raise bad_request(str(e), param=_param_of(e)) from e
            raise

    @staticmethod
    async def _outputs(prepared: _Prepared) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs of all the request's engine requests as they come. Closing this
        iterator closes the engine streams, which aborts the requests still running."""
        tasks: list[asyncio.Task] = []
        try:
            for i, first in enumerate(prepared.firsts):
                yield i, first
            pending = [i for i, first in enumerate(prepared.firsts) if not first.finished]
            if len(pending) == 1:
                async for output in prepared.streams[pending[0]]:
                    yield pending[0], output
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int) -> None:
                try:
                    async for output in prepared.streams[i]:
                        queue.put_nowait((i, output))
                except Exception as e:
                    queue.put_nowait((i, e))
                queue.put_nowait((i, None))

            tasks = [asyncio.create_task(pump(i)) for i in pending]
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)   # a running generator cannot be closed
            await _close_all(prepared.streams)

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def create_completion(self, request: CompletionRequest):
        """A response dict, or an async iterator of SSE lines when request.stream."""
        self.check_model(request.model)
        if request.echo:
            raise bad_request("echo is not supported", param="echo")
        if request.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        raw = request.prompt
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        prompts = [await self._tokenize(p if isinstance(p, str) else {"prompt_token_ids": p}) for p in raw]
        budgets = {self._max_tokens(request.max_tokens, len(ids), "max_tokens") for _, ids in prompts}
        # One SamplingParams for all prompts: an unset max_tokens resolves per prompt, so take the smallest.
        params = self._params(request, max_tokens=min(budgets), logprobs=request.logprobs)
        prepared = _Prepared(f"cmpl-{uuid.uuid4().hex}", params, prompts)
        await self._start(prepared)
        if request.stream:
            return self._stream_completion(request, prepared)
        finals = await _collect(self._outputs(prepared), len(prompts))
        choices = []
        for i, output in enumerate(finals):
            for completion in output.outputs:
                choices.append({"index": i * params.n + completion.index, "text": completion.text,
                                "logprobs": self._completion_logprobs(completion, 0, 0, request.logprobs),
                                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self._model_name(request.model), "choices": choices, "usage": _usage(finals)}

    async def _stream_completion(self, request: CompletionRequest, prepared: _Prepared) -> AsyncIterator[str]:
        created, model = int(time.time()), self._model_name(request.model)
        n, holdback = prepared.params.n, max(prepared.params.max_stop_str_len - 1, 0)
        states: dict[int, _ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        outputs = self._outputs(prepared)
        try:
            async for i, output in outputs:
                if output.finished:
                    finals[i] = output
                for completion in output.outputs:
                    state = states.setdefault(i * n + completion.index, _ChoiceState())
                    delta, token_range = _advance(state, completion, holdback)
                    if delta is None:
                        continue
                    choice = {"index": i * n + completion.index, "text": delta,
                              "logprobs": self._completion_logprobs(completion, *token_range, request.logprobs),
                              "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
                    yield _sse({"id": prepared.request_id, "object": "text_completion", "created": created,
                                "model": model, "choices": [choice]})
            if request.include_usage_in_stream:
                yield _sse({"id": prepared.request_id, "object": "text_completion", "created": created,
                            "model": model, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)])})
        except Exception as e:   # the engine died mid-stream: tell the client in-band
            yield _sse(OpenAIError(500, str(e), type="internal_server_error").to_json())
        finally:
            await outputs.aclose()   # a client gone mid-stream: abort its engine requests now
        yield "data: [DONE]\n\n"

    @staticmethod
    def _completion_logprobs(completion: CompletionOutput, start: int, text_offset: int, k: int | None):
        """The legacy completions logprobs object for tokens [start:] of a completion."""
        if k is None or completion.logprobs is None:
            return None
        tokens, token_logprobs, top_logprobs, text_offsets = [], [], [], []
        for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
            sampled = entry[token_id]
            tokens.append(sampled.decoded_token)
            token_logprobs.append(sampled.logprob)
            # Keyed by text: tokens that decode alike (e.g. partial UTF-8 bytes) keep the likeliest one.
            top: dict[str, float] = {}
            for lp in sorted(entry.values(), key=lambda lp: lp.rank):
                if lp.rank <= k or lp is sampled:
                    top.setdefault(lp.decoded_token, lp.logprob)
            top_logprobs.append(top)
            text_offsets.append(text_offset)
            text_offset += len(sampled.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offsets}

    # -- /v1/chat/completions ---------------------------------------------------------------------------------
    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        messages = _chat_messages(request.messages)
        try:
            text, token_ids = await self.engine.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, chat_template=request.chat_template)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        text, token_ids = await self._tokenize({"prompt": text, "prompt_token_ids": token_ids})
        if request.max_completion_tokens is not None:
            max_tokens = self._max_tokens(request.max_completion_tokens, len(token_ids), "max_completion_tokens")
        else:
            max_tokens = self._max_tokens(request.max_tokens, len(token_ids), "max_tokens")
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._params(request, max_tokens=max_tokens, logprobs=logprobs)
        prepared = _Prepared(f"chatcmpl-{uuid.uuid4().hex}", params, [(text, token_ids)])
        await self._start(prepared)
        if request.stream:
            return self._stream_chat(request, prepared)
        (final,) = await _collect(self._outputs(prepared), 1)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c, 0, logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in sorted(final.outputs, key=lambda c: c.index)]
        return {"id": prepared.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self._model_name(request.model), "choices": choices, "usage": _usage([final])}

    async def _stream_chat(self, request: ChatCompletionRequest, prepared: _Prepared) -> AsyncIterator[str]:
        created, model = int(time.time()), self._model_name(request.model)
        holdback = max(prepared.params.max_stop_str_len - 1, 0)
        logprobs = prepared.params.logprobs
        states: dict[int, _ChoiceState] = {}
        final = None
        outputs = self._outputs(prepared)
        chunk = lambda choice: _sse({"id": prepared.request_id, "object": "chat.completion.chunk",  # noqa: E731
                                     "created": created, "model": model, "choices": [choice]})
        try:
            async for _, output in outputs:
                final = output if output.finished else final
                for completion in output.outputs:
                    state = states.setdefault(completion.index, _ChoiceState())
                    if not state.sent_role:
                        state.sent_role = True
                        yield chunk({"index": completion.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None})
                    delta, token_range = _advance(state, completion, holdback)
                    if delta is None:
                        continue
                    yield chunk({"index": completion.index, "delta": {"content": delta} if delta else {},
                                 "logprobs": self._chat_logprobs(completion, token_range[0], logprobs),
                                 "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
            if request.include_usage_in_stream and final is not None:
                yield _sse({"id": prepared.request_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [], "usage": _usage([final])})
        except Exception as e:
            yield _sse(OpenAIError(500, str(e), type="internal_server_error").to_json())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _chat_logprobs(completion: CompletionOutput, start: int, k: int | None):
        if k is None or completion.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
            sampled = entry[token_id]
            top = [_chat_token(lp.decoded_token, lp.logprob)
                   for lp in sorted(entry.values(), key=lambda lp: lp.rank) if lp.rank <= k]
            content.append({**_chat_token(sampled.decoded_token, sampled.logprob), "top_logprobs": top})
        return {"content": content}

    # -- helpers --------------------------------------------------------------------------------------------
    def _model_name(self, requested: str | None) -> str:
        return requested or self.served_model_names[0]

    @staticmethod
    def _params(request, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return request.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(e)) from e


def _advance(state: _ChoiceState, completion: CompletionOutput, holdback: int
             ) -> tuple[str | None, tuple[int, int]]:
    """The new text of a streamed choice (None: nothing to send now) and the token range it covers
    (start token, text offset of that token's first character)."""
    if state.finished:
        return None, (0, 0)
    finished = completion.finish_reason is not None
    text = completion.text
    end = len(text) if finished else max(len(text) - holdback, state.num_chars)
    new_tokens = len(completion.token_ids) > state.num_tokens
    if end == state.num_chars and not finished and not (new_tokens and completion.logprobs is not None):
        return None, (0, 0)
    delta = text[state.num_chars:end]
    token_range = (state.num_tokens, state.num_chars)
    state.num_chars, state.num_tokens, state.finished = end, len(completion.token_ids), finished
    return delta, token_range


def _chat_token(token: str | None, logprob: float) -> dict:
    token = token or ""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _chat_messages(messages: list[dict]) -> list[dict]:
    """Validate messages; content given as a list of text parts is joined into one string."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    result = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}] has no role", param="messages")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}]: only text content parts are supported", param="messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              param="messages")
        result.append({**message, "role": role, "content": content})
    return result


def _usage(finals: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, output in outputs:
        if output.finished:
            finals[i] = output
    return [finals[i] for i in range(num_prompts)]


async def _close_all(streams) -> None:
    for stream in streams:
        await stream.aclose()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
