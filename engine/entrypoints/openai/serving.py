"""/v1/completions, /v1/chat/completions, /tokenize and /detokenize on an AsyncLLMEngine: request -> engine
requests -> response JSON or server-sent events.

Every check happens before the first engine request is queued, and the engine's own checks (add_request)
surface before the HTTP response starts (the first output of every engine request is awaited first), so a
bad request gets a clean 4xx and leaves the requests in flight untouched. A request the engine failed
(RequestOutput.error, a step that raised) is a 500 for that request alone, in-band for a stream; one whose own
field was at fault only once queued (RequestOutput.error_param: a grammar that dead-ends) a 400 naming it; one the
server's shutdown ended (StreamInterruptedError) a 503.

Streamed text holds back the last len(longest stop string) - 1 characters until the request finishes, because a
stop string is cut from the text once it completes: streamed and non-streamed outputs are then equal. Tool calls
and reasoning text are split out of the cumulative text by the parsers (tool_parsers.py, reasoning_parsers.py),
which only ever extend what was streamed.

Sampling fields the client left unset take the model's defaults (generation_config.json, through
LLMEngine.sampling_defaults) and then OpenAI's, as vLLM does."""
import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.async_engine import AsyncLLMEngine, StreamInterruptedError
from engine.entrypoints.openai.lora import lora_int_id
from engine.lora import LoRARequest
from engine.entrypoints.openai.protocol import (CHAT_ROLES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                TokenizeChatRequest, TokenizeCompletionRequest)
from engine.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from engine.entrypoints.openai.tool_parsers import (ToolCall, get_tool_parser, named_tool_schema,
                                                   parse_required_tool_calls, required_tools_schema)
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

# A prompt (or the text of all messages) longer than this many characters per token of context is refused
# before tokenizing: no tokenizer makes tokens that long on real text (SmolLM2's run ~4 characters a token),
# and tokenizing tens of MB would hold a tokenizer thread for seconds.
MAX_CHARS_PER_TOKEN = 32
# vLLM's stand-in for top_p=0 (SamplingParams needs (0, 1]): only the most likely token survives top-p.
_TOP_P_ZERO = 1e-8

logger = logging.getLogger("engine")


class OpenAIError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def to_json(self) -> dict:
        # Lone surrogates (from a client's JSON) cannot be encoded as UTF-8: escape them in the message.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def shutting_down(error: StreamInterruptedError) -> OpenAIError:
    """A request the server's shutdown ended (or refused): 503, in-band for a stream."""
    return OpenAIError(503, str(error), type="service_unavailable_error", code="server_shutting_down")


def _param_of(error: ValueError, renames: dict[str, str] | None = None) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ..."); renames maps it to the field the
    client sent (max_tokens -> max_completion_tokens, guided_decoding -> response_format, ...)."""
    word = str(error).split(" ", 1)[0]
    if not word.isidentifier():
        return None
    return (renames or {}).get(word, word)


@dataclass(slots=True)
class _ChoiceState:
    """What one streamed choice has sent so far."""
    num_chars: int = 0          # characters of the (holdback-trimmed) raw text already processed
    num_tokens: int = 0
    sent_role: bool = False
    finished: bool = False
    num_content_chars: int = 0
    num_reasoning_chars: int = 0
    tool_header_sent: bool = False
    num_argument_chars: int = 0
    pieces: "TokenPieces | None" = None


@dataclass(slots=True)
class _Prepared:
    request_id: str
    params: SamplingParams
    prompts: list[tuple[str | None, list[int]]]
    renames: dict[str, str] = field(default_factory=dict)
    lora_request: LoRARequest | None = None   # the adapter the request's model field names
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    firsts: list[RequestOutput] = field(default_factory=list)


@dataclass(slots=True)
class _ToolMode:
    """How a chat request's output becomes tool calls: "none", "auto" (the tool parser), "required" (a guided
    JSON array of calls) or "named" (guided JSON arguments of `name`)."""
    kind: str = "none"
    name: str | None = None


class TokenPieces:
    """The text each output token adds, so that the pieces of all tokens join to the output text (vLLM's
    incremental detokenization): a token that ends inside a UTF-8 character adds "" and the character comes
    with the token that completes it."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.num_chars = 0   # characters of the output text the pieces handed out so far cover
        self.pending: list[tuple[str, int, dict]] = []   # tokens not handed out yet (see release)

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new_text[len(prefix_text):]
        return ""

    def release(self, token_ids: list[int], entries: list, visible_chars: int, final: bool) -> list[tuple[str, int, dict]]:
        """Queue the new tokens (ids and their logprob entries) and hand out (piece, token id, entry) for those
        whose text lies within the first `visible_chars` characters of the output (all of them once final, cut
        to the final text: a stop string removed from the text is not content). A streamed token whose text
        may still be cut waits, so the streamed pieces join to the streamed content."""
        self.pending.extend((self.add(token_id), token_id, entry) for token_id, entry in zip(token_ids, entries))
        released = []
        while self.pending:
            piece, token_id, entry = self.pending[0]
            room = visible_chars - self.num_chars
            if not final and len(piece) > room:
                break
            piece = piece[:max(room, 0)]
            self.num_chars += len(piece)
            released.append((piece, token_id, entry))
            self.pending.pop(0)
        return released


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], *, chat_template: str | None = None,
                 trust_request_chat_template: bool = False, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 special_tokens_in_messages: str = "escape", lora_modules: list[LoRARequest] | None = None,
                 api_server_count: int = 1, log_requests: bool = False, max_log_len: int | None = None):
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if special_tokens_in_messages not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"special_tokens_in_messages must be one of {SPECIAL_TOKEN_MODES}, got "
                             f"{special_tokens_in_messages!r}")
        self.special_tokens_in_messages = special_tokens_in_messages
        self._special_token_pattern: re.Pattern | None | bool = False   # False: not built yet
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        # LoRA adapters served as models of their own names (engine/entrypoints/openai/lora.py).
        self.lora_requests: dict[str, LoRARequest] = {m.lora_name: m for m in lora_modules or ()}
        self.api_server_count = api_server_count
        self._lora_loads = 0   # adapters loaded at run time (each gets its own lora_int_id)
        # vLLM's --enable-log-requests / --max-log-len: each engine request's prompt and parameters, logged
        # (the prompt cut to max_log_len characters, its ids to max_log_len ids; None: whole).
        if max_log_len is not None and (isinstance(max_log_len, bool) or not isinstance(max_log_len, int)
                                        or max_log_len < 0):
            raise ValueError(f"max_log_len must be an int >= 0 or None, got {max_log_len!r}")
        self.log_requests, self.max_log_len = log_requests, max_log_len

    # -- shared -------------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names and model not in self.lora_requests:
            raise OpenAIError(404, f"The model `{model}` does not exist.", type="not_found_error", param="model",
                              code="model_not_found")

    def model_card(self, name: str) -> dict:
        lora = self.lora_requests.get(name)
        if lora is not None:   # vLLM's card of an adapter: its directory as root, the base model as parent
            return {"id": name, "object": "model", "created": 0, "owned_by": "engine", "root": lora.lora_path,
                    "parent": lora.base_model_name or self.served_model_names[0],
                    "max_model_len": self.engine.max_model_len}
        return {"id": name, "object": "model", "created": 0, "owned_by": "engine", "root": name,
                "max_model_len": self.engine.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card(name) for name in [*self.served_model_names,
                                                                                *self.lora_requests]]}

    def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card(model_id)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model field names (None: the base model)."""
        return None if model is None else self.lora_requests.get(model)

    # -- /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's; engine/entrypoints/openai/lora.py) ---------
    def _check_runtime_lora(self) -> None:
        if not self.engine.engine.input_processor.enable_lora:
            raise bad_request("LoRA is not enabled on this server (serve --enable-lora)")
        if self.api_server_count > 1:
            raise bad_request(f"adapters cannot be loaded or unloaded at run time with --api-server-count "
                              f"{self.api_server_count}: each API server process keeps its own adapter names (give "
                              f"them with --lora-modules)")

    async def load_lora_adapter(self, body: dict) -> str:
        """{"lora_name", "lora_path"}: load the adapter in the engine (400 naming lora_path when it does not
        load), then serve it under lora_name."""
        self._check_runtime_lora()
        name, path = body.get("lora_name"), body.get("lora_path")
        for param, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise bad_request(f"{param} must be a non-empty string", param=param)
        if name in self.lora_requests or name in self.served_model_names:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self._lora_loads += 1
        lora = LoRARequest(name, lora_int_id(name, path, self._lora_loads), path)
        try:
            await self.engine.add_lora(lora)
        except ValueError as e:
            raise bad_request(str(e).removeprefix("lora_request: "), param="lora_path") from e
        if name in self.lora_requests:   # loaded by a concurrent call meanwhile
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self.lora_requests[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, body: dict) -> str:
        """{"lora_name"}: stop serving the adapter and unload it (requests already running on it finish on it)."""
        self._check_runtime_lora()
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("lora_name must be a non-empty string", param="lora_name")
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", type="not_found_error",
                              param="lora_name")
        await self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @property
    def sampling_defaults(self) -> dict:
        """The model's sampling defaults (generation_config.json), {} when it has none."""
        return dict(getattr(self.engine.engine, "sampling_defaults", None) or {})

    def _check_prompt_size(self, num_chars: int, param: str) -> None:
        limit = MAX_CHARS_PER_TOKEN * self.engine.max_model_len
        if num_chars > limit:
            raise bad_request(f"{param} has {num_chars} characters; this server takes at most {limit} "
                              f"({MAX_CHARS_PER_TOKEN} per token of its {self.engine.max_model_len}-token context)",
                              param=param, code="context_length_exceeded")

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str, prompt_param: str) -> int:
        """The output budget; a request that cannot fit the context is a 400 (not silently shortened). Unset:
        what is left of the context, capped by the model's default max_tokens."""
        max_model_len = self.engine.max_model_len
        if requested is None:
            requested = max_model_len - num_prompt_tokens
            if requested < 1:
                raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                  f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
                                  param=prompt_param, code="context_length_exceeded")
            default = self.sampling_defaults.get("max_tokens")
            if default is not None:
                requested = min(requested, default)
        elif num_prompt_tokens + requested > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                              f"prompt, {requested} in the completion). Please reduce the prompt or {param}.",
                              param=param, code="context_length_exceeded")
        return requested

    async def _tokenize(self, prompt, param: str) -> tuple[str | None, list[int]]:
        try:
            return await self.engine.process_prompt(prompt)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise bad_request(str(e), param=param, code=code) from e

    def _check_unsupported(self, request) -> None:
        for name in request.unsupported_fields():
            raise bad_request(f"{name} is not supported by this server", param=name)
        limit = self.engine.max_model_len
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens > limit:
            raise bad_request(f"truncate_prompt_tokens ({request.truncate_prompt_tokens}) must be at most this "
                              f"model's maximum context length ({limit})", param="truncate_prompt_tokens")

    def _guard_special_tokens(self, messages: list[dict]) -> tuple[list[dict], dict[str, str] | None]:
        """Special-token text in the content of user and tool messages (special_tokens_in_messages): "escape"
        swaps each occurrence for a placeholder that the tokenization after rendering turns back into the text's
        own tokens, never the control token (returns the messages and {placeholder: text}); "reject" is a 400
        naming the message; "allow" leaves it (it becomes control tokens: a user can forge turns)."""
        if self.special_tokens_in_messages == "allow":
            return messages, None
        pattern = self._special_token_pattern
        if pattern is False:
            pattern = self._special_token_pattern = _special_token_pattern(self.engine.tokenizer)
        if pattern is None:
            return messages, None
        literals: dict[str, str] = {}
        nonce = uuid.uuid4().hex
        guarded = []
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] in UNTRUSTED_ROLES and content and (match := pattern.search(content)):
                if self.special_tokens_in_messages == "reject":
                    raise bad_request(f"messages[{i}].content holds the special token {match.group(0)!r}; this "
                                      f"server refuses special-token text in {message['role']} messages",
                                      param="messages", code="special_token_in_content")

                def placeholder(match: re.Match) -> str:
                    key = f"{LITERAL_PREFIX}{nonce}N{len(literals)}X"
                    literals[key] = match.group(0)
                    return key
                message = {**message, "content": pattern.sub(placeholder, content)}
            guarded.append(message)
        return guarded, (literals or None)

    def _guided_decoding(self, request, tool_schema: dict | None = None) -> tuple[object | None, str | None]:
        """(GuidedDecodingParams or None, the request field that asked for it)."""
        specs = []
        response_format = request.response_format
        if response_format is not None and response_format.type == "json_object":
            specs.append(("response_format", {"json_object": True}))
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.json_schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
            specs.append(("response_format", {"json": response_format.json_schema.json_schema}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(request, name) is not None:
                specs.append((name, {key: getattr(request, name)}))
        if tool_schema is not None:
            specs.append(("tool_choice", {"json": tool_schema}))
        if not specs:
            return None, None
        if len(specs) > 1:
            raise bad_request(f"{specs[1][0]} cannot be combined with {specs[0][0]}: one structured output at a time",
                              param=specs[1][0])
        field_name, kwargs = specs[0]
        try:
            from engine.sampling_params import GuidedDecodingParams
        except ImportError:
            raise bad_request("structured outputs are not supported by this engine", param=field_name) from None
        try:
            return GuidedDecodingParams(**kwargs), field_name
        except ValueError as e:
            raise bad_request(f"{field_name}: {e}", param=field_name) from e

    def _sampling_params(self, request, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                         guided, renames: dict[str, str]) -> SamplingParams:
        """SamplingParams of a request: unset fields from the model's defaults, then OpenAI's."""
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if request.stream and request.prompt_logprobs:   # vLLM refuses it too (0, the prompt tokens' own, streams)
            raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        defaults = self.sampling_defaults
        pick = lambda value, name, default: (  # noqa: E731
            value if value is not None else defaults.get(name, default))
        top_p = pick(request.top_p, "top_p", 1.0)
        if top_p == 0:
            top_p = _TOP_P_ZERO
        kwargs = dict(
            n=request.n, temperature=pick(request.temperature, "temperature", 1.0), top_p=top_p,
            top_k=pick(request.top_k, "top_k", 0), min_p=pick(request.min_p, "min_p", 0.0), seed=request.seed,
            max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop,
            stop_token_ids=request.stop_token_ids, include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=pick(request.presence_penalty, "presence_penalty", 0.0),
            frequency_penalty=pick(request.frequency_penalty, "frequency_penalty", 0.0),
            repetition_penalty=pick(request.repetition_penalty, "repetition_penalty", 1.0),
            skip_special_tokens=request.skip_special_tokens)
        if request.logit_bias:
            vocab_size = len(self.engine.tokenizer)
            logit_bias = {}
            for key, bias in request.logit_bias.items():
                try:
                    token_id = int(key)
                except ValueError:
                    raise bad_request(f"logit_bias keys must be token ids, got {key!r:.50}", param="logit_bias") from None
                if not 0 <= token_id < vocab_size:
                    raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")
                logit_bias[token_id] = bias
            kwargs["logit_bias"] = logit_bias
        for name in ("allowed_token_ids", "bad_words", "truncate_prompt_tokens"):
            if getattr(request, name) is not None:
                kwargs[name] = getattr(request, name)
        if guided is not None:
            kwargs["guided_decoding"] = guided
        try:
            return SamplingParams(**kwargs)
        except TypeError as e:   # a field this engine's SamplingParams does not have (yet)
            name = next((k for k in kwargs if f"'{k}'" in str(e)), None)
            raise bad_request(f"{name} is not supported by this engine", param=renames.get(name, name)) from e
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(e, renames)) from e

    async def _start(self, prepared: _Prepared) -> None:
        """Queue one engine request per prompt and wait for each one's first output, so that the engine's
        own rejections (ValueError from add_request) become a 400 before any response byte is sent."""
        if self.log_requests:
            self._log_request(prepared)
        prepared.streams = [
            self.engine.generate({"prompt": text, "prompt_token_ids": token_ids}, prepared.params,
                                 f"{prepared.request_id}-{i}", lora_request=prepared.lora_request)
            for i, (text, token_ids) in enumerate(prepared.prompts)]
        try:
            prepared.firsts = list(await asyncio.gather(*(anext(s) for s in prepared.streams)))
        except BaseException as e:
            await _close_all(prepared.streams)
            if isinstance(e, ValueError):
                raise bad_request(str(e), param=_param_of(e, prepared.renames)) from e
            if isinstance(e, StreamInterruptedError):
                raise shutting_down(e) from e
            raise
        for first in prepared.firsts:
            _raise_if_failed(first, prepared.renames)

    def _log_request(self, prepared: _Prepared) -> None:
        limit = self.max_log_len
        for i, (text, token_ids) in enumerate(prepared.prompts):
            logger.info("Received request %s-%d: prompt: %r, params: %s, prompt_token_ids: %s (%d), lora_request: %s",
                        prepared.request_id, i, text if text is None or limit is None else text[:limit],
                        prepared.params, token_ids if limit is None else token_ids[:limit], len(token_ids),
                        prepared.lora_request)

    @staticmethod
    async def _outputs(prepared: _Prepared) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs of all the request's engine requests as they come. Closing this
        iterator closes the engine streams, which aborts the requests still running. A failed engine request
        raises OpenAIError (500); one the server's shutdown ended, OpenAIError (503)."""
        tasks: list[asyncio.Task] = []
        try:
            for i, first in enumerate(prepared.firsts):
                yield i, first
            pending = [i for i, first in enumerate(prepared.firsts) if not first.finished]
            if len(pending) == 1:
                async for output in prepared.streams[pending[0]]:
                    _raise_if_failed(output, prepared.renames)
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
                    _raise_if_failed(item, prepared.renames)
                    yield i, item
        except StreamInterruptedError as e:
            raise shutting_down(e) from e
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)   # a running generator cannot be closed
            await _close_all(prepared.streams)

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def create_completion(self, request: CompletionRequest):
        """A response dict, or an async iterator of SSE lines when request.stream."""
        self.check_model(request.model)
        self._check_unsupported(request)
        raw = request.prompt
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        self._check_prompt_size(sum(len(p) for p in raw if isinstance(p, str)), "prompt")
        prompts = []
        for p in raw:
            if not p:
                raise bad_request("prompt must not be empty", param="prompt")
            text, token_ids = await self._tokenize(p if isinstance(p, str) else {"prompt_token_ids": p}, "prompt")
            if request.truncate_prompt_tokens is not None and len(token_ids) > request.truncate_prompt_tokens:
                token_ids = token_ids[-request.truncate_prompt_tokens:]   # the left is dropped, as vLLM
                text = None
            prompts.append((text, token_ids))
        budgets = {self._max_tokens(request.max_tokens, len(ids), "max_tokens", "prompt") for _, ids in prompts}
        guided, guided_field = self._guided_decoding(request)
        renames = {"guided_decoding": guided_field} if guided_field else {}
        # echo with logprobs: the prompt's logprobs come first (vLLM, OpenAI's legacy behaviour).
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        if request.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.prompt_logprobs)
        # One SamplingParams for all prompts: an unset max_tokens resolves per prompt, so take the smallest.
        params = self._sampling_params(request, max_tokens=min(budgets), logprobs=request.logprobs,
                                       prompt_logprobs=prompt_logprobs, guided=guided, renames=renames)
        prepared = _Prepared(f"cmpl-{uuid.uuid4().hex}", params, prompts, renames,
                             lora_request=self.lora_request(request.model))
        await self._start(prepared)
        if request.stream:
            return self._stream_completion(request, prepared)
        finals = await _collect(self._outputs(prepared), len(prompts))
        choices = []
        for i, output in enumerate(finals):
            prompt_text = self._prompt_text(output) if request.echo else ""
            for completion in output.outputs:
                logprobs = self._completion_logprobs(completion, 0, len(prompt_text), request.logprobs)
                if request.echo and request.logprobs is not None:
                    logprobs = _join_logprobs(self._prompt_logprobs(output, request.logprobs), logprobs)
                choice = {"index": i * params.n + completion.index, "text": prompt_text + completion.text,
                          "logprobs": logprobs, "finish_reason": completion.finish_reason,
                          "stop_reason": completion.stop_reason}
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _vllm_prompt_logprobs(output)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self._model_name(request.model), "choices": choices, "usage": _usage(finals)}

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids)

    def _prompt_logprobs(self, output: RequestOutput, k: int) -> dict:
        """The legacy logprobs object of the prompt tokens (the first has no logprob: None, as OpenAI)."""
        tokens, token_logprobs, top_logprobs, text_offsets, offset = [], [], [], [], 0
        entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        for position, token_id in enumerate(output.prompt_token_ids):
            entry = entries[position] if position < len(entries) else None
            if entry is None or token_id not in entry:
                token = self.engine.tokenizer.decode([token_id])
                tokens.append(token)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token = entry[token_id].decoded_token or ""
                tokens.append(token)
                token_logprobs.append(entry[token_id].logprob)
                top_logprobs.append(_top_by_text(entry, token_id, k))
            text_offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offsets}

    async def _stream_completion(self, request: CompletionRequest, prepared: _Prepared) -> AsyncIterator[str]:
        created, model = int(time.time()), self._model_name(request.model)
        n, holdback = prepared.params.n, max(prepared.params.max_stop_str_len - 1, 0)
        states: dict[int, _ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}   # each prompt's last output (continuous usage stats)
        continuous = request.continuous_usage_in_stream
        outputs = self._outputs(prepared)
        try:
            async for i, output in outputs:
                latest[i] = output
                if output.finished:
                    finals[i] = output
                for completion in output.outputs:
                    index = i * n + completion.index
                    first = index not in states
                    state = states.setdefault(index, _ChoiceState())
                    delta, token_range = _advance(state, completion, holdback)
                    echo_text = self._prompt_text(output) if request.echo and first else ""
                    if delta is None and not echo_text:
                        continue
                    logprobs = self._completion_logprobs(completion, token_range[0], token_range[1],
                                                         request.logprobs) if delta is not None else None
                    if echo_text and request.logprobs is not None:
                        logprobs = _join_logprobs(self._prompt_logprobs(output, request.logprobs), logprobs)
                    choice = {"index": index, "text": echo_text + (delta or ""), "logprobs": logprobs,
                              "finish_reason": completion.finish_reason if delta is not None else None,
                              "stop_reason": completion.stop_reason if delta is not None else None}
                    chunk = {"id": prepared.request_id, "object": "text_completion", "created": created,
                             "model": model, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = _usage(list(latest.values()))
                    yield _sse(chunk)
            if request.include_usage_in_stream:
                yield _sse({"id": prepared.request_id, "object": "text_completion", "created": created,
                            "model": model, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)])})
        except OpenAIError as e:
            yield _sse(e.to_json())
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
            top_logprobs.append(_top_by_text(entry, token_id, k))
            text_offsets.append(text_offset)
            text_offset += len(sampled.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offsets}

    # -- /v1/chat/completions ---------------------------------------------------------------------------------
    def _tool_mode(self, request: ChatCompletionRequest) -> _ToolMode:
        choice, tools = request.tool_choice, request.tools
        if not tools:
            if choice in ("required",) or not (choice is None or isinstance(choice, str)):
                raise bad_request("tool_choice needs tools", param="tool_choice")
            return _ToolMode()
        if choice == "none":
            return _ToolMode()
        if choice == "required":
            return _ToolMode("required")
        if choice is None or choice == "auto":
            if not self.enable_auto_tool_choice:
                raise bad_request('"auto" tool choice needs the server to run with --enable-auto-tool-choice and '
                                  '--tool-call-parser', param="tool_choice")
            return _ToolMode("auto")
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                              param="tool_choice")
        return _ToolMode("named", choice.function.name)

    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        self._check_unsupported(request)
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise bad_request("chat_template from requests is not allowed on this server (start it with "
                              "--trust-request-chat-template)", param="chat_template")
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        messages = _chat_messages(request.messages)
        self._check_prompt_size(_num_chars(messages) + _num_chars(request.chat_template_kwargs)
                                + (len(json.dumps([t.model_dump(by_alias=True) for t in request.tools]))
                                   if request.tools else 0), "messages")
        mode = self._tool_mode(request)
        tools = ([t.model_dump(by_alias=True, exclude_none=True) for t in request.tools]
                 if request.tools and mode.kind != "none" else None)
        messages, literals = self._guard_special_tokens(messages)
        try:
            text, token_ids = await self.engine.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt,
                chat_template=request.chat_template or self.chat_template, tools=tools,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs, literals=literals)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        text, token_ids = await self._tokenize({"prompt": text, "prompt_token_ids": token_ids}, "messages")
        if request.truncate_prompt_tokens is not None and len(token_ids) > request.truncate_prompt_tokens:
            text, token_ids = None, token_ids[-request.truncate_prompt_tokens:]
        if request.max_completion_tokens is not None:
            max_tokens = self._max_tokens(request.max_completion_tokens, len(token_ids), "max_completion_tokens",
                                          "messages")
        else:
            max_tokens = self._max_tokens(request.max_tokens, len(token_ids), "max_tokens", "messages")
        tool_schema = None
        if mode.kind == "required":
            tool_schema = required_tools_schema(request.tools, parallel=request.parallel_tool_calls)
        elif mode.kind == "named":
            tool_schema = named_tool_schema(next(t for t in request.tools if t.function.name == mode.name))
        guided, guided_field = self._guided_decoding(request, tool_schema)
        renames = {"logprobs": "top_logprobs", "prompt_logprobs": "prompt_logprobs"}
        if request.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        if guided_field:
            renames["guided_decoding"] = guided_field
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                       prompt_logprobs=request.prompt_logprobs, guided=guided, renames=renames)
        prepared = _Prepared(f"chatcmpl-{uuid.uuid4().hex}", params, [(text, token_ids)], renames,
                             lora_request=self.lora_request(request.model))
        await self._start(prepared)
        if request.stream:
            return self._stream_chat(request, prepared, mode)
        (final,) = await _collect(self._outputs(prepared), 1)
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            reasoning, content, calls = self._split_chat_text(c.text, True, mode)
            message = {"role": "assistant", "content": content}
            if self.reasoning_parser is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                if not (content or "").strip():
                    message["content"] = None
            else:
                message["tool_calls"] = []
            finish_reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(
                                c, logprobs, TokenPieces(self.engine.tokenizer, params.skip_special_tokens),
                                start=0, visible_chars=len(c.text), final=True),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        response = {"id": prepared.request_id, "object": "chat.completion", "created": int(time.time()),
                    "model": self._model_name(request.model), "choices": choices, "usage": _usage([final])}
        if request.prompt_logprobs is not None:   # vLLM's top-level field of a chat completion
            response["prompt_logprobs"] = _vllm_prompt_logprobs(final)
        return response

    def _split_chat_text(self, text: str, final: bool, mode: _ToolMode
                         ) -> tuple[str | None, str, list[ToolCall] | None]:
        """(reasoning, content, tool calls) of an output's text so far. While not final, every part is a prefix
        of its final value; tool calls are only parsed once final."""
        reasoning, content = (self.reasoning_parser.split(text, final) if self.reasoning_parser is not None
                              else (None, text))
        if mode.kind == "auto":
            content, calls = self.tool_call_parser.split(content, final)
            return reasoning, content, calls
        if mode.kind == "required":
            if not final:
                return reasoning, "", None
            calls = parse_required_tool_calls(content)
            return reasoning, ("" if calls else content), calls
        if mode.kind == "named":
            # The output is the named tool's arguments: a call whenever there are any, also when max_tokens (or a
            # stop string) cut them short, as the stream sends them and as vLLM and OpenAI answer; the
            # finish_reason ("length") says the arguments are incomplete.
            if not final or not content:
                return reasoning, "", None
            return reasoning, "", [ToolCall(mode.name, content)]
        return reasoning, content, None

    async def _stream_chat(self, request: ChatCompletionRequest, prepared: _Prepared, mode: _ToolMode
                           ) -> AsyncIterator[str]:
        created, model = int(time.time()), self._model_name(request.model)
        holdback = max(prepared.params.max_stop_str_len - 1, 0)
        logprobs, skip_special = prepared.params.logprobs, prepared.params.skip_special_tokens
        states: dict[int, _ChoiceState] = {}
        final = latest = None
        outputs = self._outputs(prepared)
        continuous = request.continuous_usage_in_stream

        def chunk(choice: dict) -> str:
            body = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [choice]}
            if continuous and latest is not None:
                body["usage"] = _usage([latest])   # vLLM's continuous_usage_stats: the counts so far
            return _sse(body)
        try:
            async for _, output in outputs:
                latest = output
                final = output if output.finished else final
                for completion in output.outputs:
                    state = states.setdefault(completion.index, _ChoiceState())
                    if state.finished:
                        continue
                    if not state.sent_role:
                        state.sent_role = True
                        yield chunk({"index": completion.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None})
                    finished = completion.finish_reason is not None
                    text = completion.text
                    end = len(text) if finished else max(len(text) - holdback, state.num_chars)
                    state.num_chars = end
                    delta: dict = {}
                    # Named tool: the output is the tool's arguments; stream them as they come.
                    if mode.kind == "named":
                        reasoning, arguments = (self.reasoning_parser.split(text[:end], finished)
                                                if self.reasoning_parser else (None, text[:end]))
                        if arguments and not state.tool_header_sent:
                            state.tool_header_sent = True
                            call = ToolCall(mode.name, "")
                            yield chunk({"index": completion.index, "delta": {"tool_calls": [
                                {"index": 0, **call.to_openai()}]}, "logprobs": None, "finish_reason": None})
                        calls = None
                        if len(arguments) > state.num_argument_chars:
                            delta["tool_calls"] = [{"index": 0, "function": {
                                "arguments": arguments[state.num_argument_chars:]}}]
                            state.num_argument_chars = len(arguments)
                        content = ""
                    else:
                        reasoning, content, calls = self._split_chat_text(text[:end], finished, mode)
                    if reasoning is not None and len(reasoning) > state.num_reasoning_chars:
                        delta["reasoning_content"] = reasoning[state.num_reasoning_chars:]
                        state.num_reasoning_chars = len(reasoning)
                    if len(content) > state.num_content_chars:
                        delta["content"] = content[state.num_content_chars:]
                        state.num_content_chars = len(content)
                    entry_logprobs = None
                    if logprobs is not None and (len(completion.token_ids) > state.num_tokens or finished):
                        if state.pieces is None:
                            state.pieces = TokenPieces(self.engine.tokenizer, skip_special)
                        entry_logprobs = self._chat_logprobs(completion, logprobs, state.pieces,
                                                             start=state.num_tokens, visible_chars=end,
                                                             final=finished)
                    state.num_tokens = len(completion.token_ids)
                    finish_reason = None
                    if finished:
                        state.finished = True
                        finish_reason = completion.finish_reason
                        if calls:
                            for position, call in enumerate(calls):
                                yield chunk({"index": completion.index, "delta": {"tool_calls": [
                                    {"index": position, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]},
                                    "logprobs": None, "finish_reason": None})
                                yield chunk({"index": completion.index, "delta": {"tool_calls": [
                                    {"index": position, "function": {"arguments": call.arguments}}]},
                                    "logprobs": None, "finish_reason": None})
                        if (calls or state.tool_header_sent) and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    if not delta and entry_logprobs is None and not finished:
                        continue
                    yield chunk({"index": completion.index, "delta": delta, "logprobs": entry_logprobs,
                                 "finish_reason": finish_reason,
                                 "stop_reason": completion.stop_reason if finished else None})
            if request.include_usage_in_stream and final is not None:
                yield _sse({"id": prepared.request_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [], "usage": _usage([final])})
        except OpenAIError as e:
            yield _sse(e.to_json())
        except Exception as e:
            yield _sse(OpenAIError(500, str(e), type="internal_server_error").to_json())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _chat_logprobs(completion: CompletionOutput, k: int | None, pieces: TokenPieces, *, start: int,
                       visible_chars: int, final: bool):
        """Chat logprobs of the tokens [start:] of a completion that `pieces` releases (see TokenPieces.release).
        Each entry's token is the text that token adds to the output, so the tokens join to message.content."""
        if k is None or completion.logprobs is None:
            return None
        released = pieces.release(completion.token_ids[start:], completion.logprobs[start:], visible_chars, final)
        if not released:
            return None
        content = []
        for piece, token_id, entry in released:
            top = [_chat_token(lp.decoded_token, lp.logprob)
                   for lp in sorted(entry.values(), key=lambda lp: lp.rank) if lp.rank <= k]
            content.append({**_chat_token(piece, entry[token_id].logprob), "top_logprobs": top})
        return {"content": content}

    # -- /tokenize, /detokenize -----------------------------------------------------------------------------
    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            messages = _chat_messages(request.messages)
            self._check_prompt_size(_num_chars(messages), "messages")
            messages, literals = self._guard_special_tokens(messages)
            try:
                _, tokens = await self.engine.apply_chat_template(
                    messages, add_generation_prompt=request.add_generation_prompt, chat_template=self.chat_template,
                    chat_template_kwargs=request.chat_template_kwargs, literals=literals)
            except ValueError as e:
                raise bad_request(str(e), param="messages") from e
        else:
            prompt = request.prompt
            self._check_prompt_size(len(prompt), "prompt")
            tokens = await self.engine.run_on_tokenizer_thread(
                lambda tokenizer: tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens))
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        tokens, vocab_size = request.tokens, len(self.engine.tokenizer)
        if not all(t < vocab_size for t in tokens):
            raise bad_request(f"tokens must be a list of token ids in [0, {vocab_size})", param="tokens")
        if len(tokens) > self.engine.max_model_len * MAX_CHARS_PER_TOKEN:
            raise bad_request("too many tokens", param="tokens")
        return {"prompt": await self.engine.run_on_tokenizer_thread(lambda tokenizer: tokenizer.decode(tokens))}

    # -- helpers --------------------------------------------------------------------------------------------
    def _model_name(self, requested: str | None) -> str:
        return requested or self.served_model_names[0]


def _raise_if_failed(output: RequestOutput, renames: dict[str, str] | None = None) -> None:
    error = getattr(output, "error", None)
    if error:
        param = getattr(output, "error_param", None)
        if param is not None:   # the request's own fault, found once queued (its grammar): a 400
            raise bad_request(error, param=(renames or {}).get(param, param))
        raise OpenAIError(500, f"the engine failed this request: {error}", type="internal_server_error")


def _top_by_text(entry: dict, sampled_id: int, k: int) -> dict[str, float]:
    """Top-k of one position keyed by text: tokens that decode alike (partial UTF-8 bytes) keep the likeliest."""
    top: dict[str, float] = {}
    for token_id, lp in sorted(entry.items(), key=lambda item: item[1].rank):
        if lp.rank <= k or token_id == sampled_id:
            top.setdefault(lp.decoded_token, lp.logprob)
    return top


def _join_logprobs(first: dict, second: dict | None) -> dict:
    if second is None:
        return first
    return {key: first[key] + second[key] for key in first}


def _vllm_prompt_logprobs(output: RequestOutput):
    """vLLM's `prompt_logprobs` field: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in output.prompt_logprobs]


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
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}


def _num_chars(value) -> int:
    """Characters in all the strings of a JSON value (keys too)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


# What --special-tokens-in-messages does with special-token text in the content of these roles' messages (the
# text of end users and of tools' outputs, where an application does not write it itself).
SPECIAL_TOKEN_MODES = ("escape", "reject", "allow")
UNTRUSTED_ROLES = ("user", "tool", "function")
# Placeholders are ASCII letters and digits only: no template filter (tojson, escape, trim) changes them.
LITERAL_PREFIX = "SPECIALTOKENTEXT"


def _special_token_pattern(tokenizer) -> re.Pattern | None:
    """A regex of the tokenizer's special tokens (those its encode turns into control tokens wherever they occur
    in text), longest first; None when it has none."""
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            tokens.add(str(token.content))
    tokens = sorted((t for t in tokens if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _chat_messages(messages: list[dict] | None) -> list[dict]:
    """Validate messages as OpenAI does (a known role; content, which only an assistant message with tool calls
    may leave out or null); content given as a list of text parts is joined into one string; the arguments of
    earlier tool calls (JSON text in the API) become objects, as chat templates expect."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", param="messages")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}] has no role", param="messages")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r:.40}",
                              param="messages")
        if content is None and not (role == "assistant" and (message.get("tool_calls") or
                                                             message.get("function_call"))):
            raise bad_request(f"messages[{i}].content is required for role {role!r}"
                              + (" without tool_calls" if role == "assistant" else ""), param="messages")
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
        message = {**message, "role": role, "content": content}
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list", param="messages")
            converted = []
            for call in tool_calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise bad_request(f"messages[{i}].tool_calls entries need function.name", param="messages")
                if call.get("type", "function") != "function" or not isinstance(call.get("id", ""), (str, type(None))):
                    raise bad_request(f"messages[{i}].tool_calls entries' type must be \"function\" and their id a "
                                      "string", param="messages")
                arguments = function.get("arguments")
                if arguments is not None and not isinstance(arguments, (str, dict)):
                    raise bad_request(f"messages[{i}].tool_calls entries' function.arguments must be a JSON string "
                                      "or an object", param="messages")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass
                converted.append({**call, "function": {**function, "arguments": arguments}})
            message["tool_calls"] = converted
        result.append(message)
    return result


def _usage(finals: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
    completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, output in outputs:
        if output.finished:
            finals[i] = output
    return [finals[i] for i in range(num_prompts)]


async def _close_all(streams) -> None:
    for stream in streams:
        await stream.aclose()


# What a logprob of -inf (or NaN: a model row without a finite value) is sent as; JSON has no infinities, and
# vLLM sends this number.
NON_FINITE_LOGPROB = -9999.0


def json_safe(obj):
    """`obj` with every non-finite float replaced by NON_FINITE_LOGPROB (only logprobs can be non-finite), so the
    body is valid JSON; the same object when there is none."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else NON_FINITE_LOGPROB
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(value) for value in obj]
    return obj


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(json_safe(payload), ensure_ascii=False, allow_nan=False)}\n\n"
