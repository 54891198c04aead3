"""Structured outputs (guided decoding) with xgrammar: the output follows a JSON schema, a regex, a list of
choices or an EBNF grammar.

One `GuidedDecoding` per engine holds xgrammar's GrammarCompiler, built from the tokenizer with the MODEL's
vocabulary size (the embedding can be padded past the tokenizer: those ids are never allowed), and an LRU of
compiled grammars keyed by their spec, so a schema used by many requests compiles once. Compilation happens in
add_request: a bad schema/regex/grammar, or one whose start admits no token at all, is a ValueError naming
guided_decoding before the request is queued. A grammar that dead-ends later (a state past the start that
admits no token and is not complete) fails its request when it gets there, also naming guided_decoding.

Each guided sequence owns a `GrammarState` (an xgrammar GrammarMatcher that has accepted exactly its output
tokens). Per step, the scheduler fills one token bitmask for the guided sequences that sample (`fill_bitmask`)
and sends it with the step; the worker's sampler applies it before penalties, greedy and top-k/top-p (vLLM's
order); the engine then feeds each sampled token to its matcher, and a matcher
that has accepted the grammar's end (a stop token) finishes its sequence with finish_reason "stop".
The matcher only depends on the output tokens, which recompute- and swap-preemption keep, so preempted
requests resume in the right grammar state; a forked sequence (n > 1) gets a fork of its parent's matcher.

JSON schemas and json_object compile without free whitespace (compact JSON): with any whitespace allowed, small
models tend to emit whitespace until max_tokens (the reason vLLM has --disable-any-whitespace).
"""
import json
import re
import threading
from collections import OrderedDict

import torch

from engine.sampling_params import GuidedDecodingParams

# Compiled grammars kept per engine (a JSON schema's compiled form is a few hundred KiB to a few MiB).
DEFAULT_GRAMMAR_CACHE_SIZE = 64


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_string(text: str) -> str:
    """`text` as a double-quoted EBNF (GBNF) string literal: backslash, quote and the other control characters
    escaped (a raw NUL ended the grammar compiler's parse of the literal)."""
    escaped = "".join(_EBNF_ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                      for c in text)
    return f'"{escaped}"'


def grammar_key(params: GuidedDecodingParams) -> tuple[str, str]:
    """The cache key of a spec: its kind and its text. A JSON schema keeps its key order: the grammar is compiled
    from this text, and the order of `properties` is the order the output's keys must come in."""
    kind = params.kind
    if kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        return kind, json.dumps(schema)
    if kind == "choice":
        return kind, json.dumps(params.choice)
    if kind == "json_object":
        return kind, ""
    return kind, getattr(params, kind)


class GrammarState:
    """One sequence's grammar matcher."""

    __slots__ = ("matcher", "error")

    def __init__(self, matcher):
        self.matcher = matcher
        self.error: str | None = None   # set when its bitmask could not be filled: the engine fails its request

    def fork(self) -> "GrammarState":
        """An independent copy in the same state (for a forked sequence)."""
        return GrammarState(self.matcher.fork())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the state is then unchanged)."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The matcher accepted the grammar's end (a stop token): nothing more may be generated."""
        return self.matcher.is_terminated()


class GuidedDecoding:
    """The grammar compiler of one engine and its cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *,
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE, max_threads: int = 2):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None)
        # xgrammar's own cache is off: the LRU below is the one cache, bounded by entries.
        self.compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()   # compile() may be called from a server's worker threads

    def compile(self, params: GuidedDecodingParams):
        """The xgrammar CompiledGrammar of `params` (cached). Raises ValueError naming guided_decoding when the
        schema, regex or grammar is invalid or unsupported."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        key = grammar_key(params)
        kind, spec = key
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(_ebnf_string(choice) for choice in params.choice))
            else:
                compiled = self.compiler.compile_grammar(spec)
        except Exception as e:   # xgrammar raises RuntimeError/ValueError/its own types for invalid specs
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message)   # xgrammar's "[time] file.cc:line: " prefix
            raise ValueError(f"guided_decoding {kind} is invalid: {message}") from e
        if not _admits_a_token(self._xgr, compiled, self.vocab_size):
            # Generation could only fail: the sampler's fallback would pick a token the grammar refuses.
            raise ValueError(f"guided_decoding {kind} admits no output: no token can begin it (the empty output "
                             f"is not one either)")
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cached(self, params: GuidedDecodingParams):
        """The compiled grammar of `params` when it is in the cache, else None (compiles nothing)."""
        key = grammar_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def new_state(self, params: GuidedDecodingParams, compiled=None) -> GrammarState:
        """A fresh matcher for one sequence (at the start of its output), of `compiled` (compiled here if None)."""
        return GrammarState(self._xgr.GrammarMatcher(self.compile(params) if compiled is None else compiled))


def _admits_a_token(xgrammar, compiled, vocab_size: int) -> bool:
    """Whether the grammar's start state allows any token (a stop token too, when the empty output is complete)."""
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def fill_bitmask(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """The next-token bitmask of each state: int32 [len(states), ceil(vocab_size / 32)] (bit set = allowed), on
    the CPU; the workers apply it to the logits (engine/worker/sampler.py)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(states), vocab_size)
    for row, state in enumerate(states):
        try:
            state.matcher.fill_next_token_bitmask(bitmask, row)
        except Exception as e:   # this sequence's matcher alone: it fails after the step (GrammarState.error)
            state.error = f"filling the token bitmask failed: {type(e).__name__}: {e}"
    return bitmask
