"""Tool calls in model output: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2/3,
Hermes) and Llama 3's JSON (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
separated by `;`).

A parser works on the cumulative text, so streaming and non-streaming share it: `split(text, final)` returns
(content, tool calls or None). While not final, content stops before anything that may turn out to be the start
of a tool call (a partial `<tool_call>` tag, or Llama 3 JSON from the first character), so the content streamed
so far is always a prefix of the final content; the tool calls themselves are parsed once the output is final.
Also here: the JSON schema that forces tool calls through guided decoding (`tool_choice` "required" or named)."""
import json
import re
import uuid
from dataclasses import dataclass


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str   # a JSON object, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _tool_call_from(obj, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back while streaming)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall] | None]:
        position = text.find(self.start)
        if position < 0:
            if final:
                return text, None
            return text[:len(text) - _partial_suffix(text, self.start)], None
        content = text[:position]
        if not final:
            return content, None
        calls = []
        for match in self._call.finditer(text, position):
            try:
                call = _tool_call_from(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:   # not a tool call after all: the whole output is content
                return text, None
            calls.append(call)
        return content, calls


class Llama3JsonToolParser:
    python_tag = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall] | None]:
        stripped = text.lstrip()
        if stripped.startswith(self.python_tag):
            stripped = stripped[len(self.python_tag):].lstrip()
        elif not final and _partial_suffix(stripped, self.python_tag) == len(stripped):
            return "", None   # may still become the tag
        if not stripped.startswith("{"):
            return (text, None) if final or stripped else ("", None)
        if not final:
            return "", None
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(stripped):
            try:
                obj, position = decoder.raw_decode(stripped, position)
            except json.JSONDecodeError:
                return text, None
            call = _tool_call_from(obj, "parameters")
            if call is None:
                return text, None
            calls.append(call)
            while position < len(stripped) and stripped[position] in " \t\n;":
                position += 1
        return "", calls


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str):
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()


# -- forced tool calls (guided decoding) ----------------------------------------------------------------------
def _parameters_schema(function) -> dict:
    return function.parameters if function.parameters else {"type": "object", "properties": {}}


def required_tools_schema(tools, *, parallel: bool = True) -> dict:
    """JSON schema of a non-empty array of calls [{"name": ..., "parameters": {...}}] of the given tools
    (vLLM's schema for tool_choice="required"); parse the output with `parse_required_tool_calls`."""
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                "parameters": _parameters_schema(tool.function)},
               "required": ["name", "parameters"]} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_tool_schema(tool) -> dict:
    """JSON schema of the arguments of one named tool: the output is its arguments object."""
    return _parameters_schema(tool.function)


def parse_required_tool_calls(text: str) -> list[ToolCall] | None:
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    parsed = [_tool_call_from(call, "parameters") for call in calls]
    return None if any(call is None for call in parsed) else parsed
