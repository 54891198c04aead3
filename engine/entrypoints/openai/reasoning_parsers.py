"""Reasoning text of `<think>` models: what the model writes between `<think>` and `</think>` goes to
`reasoning_content`, the rest to `content`.

- "qwen3": reasoning only when the output opens with `<think>` (Qwen3 with enable_thinking=False writes none).
- "deepseek_r1": the chat template already opened `<think>`, so everything up to `</think>` is reasoning, with or
  without an opening tag; an output that never closes it is all reasoning.

Like the tool parsers, `split(text, final)` works on the cumulative text: while not final it holds back a partial
tag at the end, so what was streamed of each part is always a prefix of that part's final value."""
from engine.entrypoints.openai.tool_parsers import _partial_suffix

START, END = "<think>", "</think>"


class ThinkReasoningParser:
    def __init__(self, *, start_optional: bool):
        self.start_optional = start_optional

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of the output so far."""
        body = text.lstrip()
        if not final and START.startswith(body):   # may still become "<think>"
            return (None if not self.start_optional else ""), ""
        if body.startswith(START):
            body = body[len(START):]
        elif not self.start_optional:
            return None, text
        body = body.lstrip("\n")   # left strips only: they keep each part's streamed text a prefix of its final one
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):].lstrip("\n")
        if not final:
            body = body[:len(body) - _partial_suffix(body, END)]
        return body, ""


REASONING_PARSERS = {"qwen3": lambda: ThinkReasoningParser(start_optional=False),
                     "deepseek_r1": lambda: ThinkReasoningParser(start_optional=True)}


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]()
