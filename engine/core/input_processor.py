"""Prompt and parameters in, a validated `EngineCoreRequest` out (vLLM V1's Processor): tokenization, the checks
that need the tokenizer or the model's limits, bad words as token ids. It runs before the engine core: in-process
inside `LLMEngine.add_request`, under `serve` in each API server process (on its tokenizer threads), so the core's
step loop never tokenizes.

Everything that can be wrong with a request and is known before it is queued raises ValueError here, naming the
field, and leaves the engine untouched; what only the core knows (its free KV cache, a grammar that does not
compile) it checks itself when the request arrives.
"""
from __future__ import annotations

import time

import torch

from engine.step_records import EngineCoreRequest
from engine.core.output_processor import Detokenizer
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

# The most logprobs (and prompt_logprobs) a request may ask for by default: vLLM's default max_logprobs.
MAX_LOGPROBS = 20


def check_prompt_token_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A tokenized prompt fits the model: not empty, every id in the vocabulary, at most max_model_len tokens."""
    if not token_ids:
        raise ValueError("prompt is empty (no tokens)")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) > max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}")


class InputProcessor:
    """Turns (prompt, SamplingParams) into an EngineCoreRequest for one model: its tokenizer (None with
    skip_tokenizer_init), vocabulary size, max_model_len and the most sequences a step holds."""

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 enable_lora: bool = False, max_logprobs: int = MAX_LOGPROBS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The most logprobs / prompt_logprobs a request may ask for (max_logprobs; -1: the whole vocabulary).
        self.logprobs_limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.enable_lora = enable_lora

    def process(self, request_id: str, prompt, params: SamplingParams, *, arrival_time: float | None = None,
                bad_words_token_ids: list[list[int]] | None = None, lora_request=None) -> EngineCoreRequest:
        """The request for the core; raises ValueError naming what is wrong. bad_words_token_ids: params.bad_words
        already tokenized (a server does it on a tokenizer thread), else they are tokenized here. lora_request: its
        LoRA adapter (an engine.lora.LoRARequest; the core loads and checks the adapter itself when the request
        arrives)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.check_params(params)
        self.check_lora_request(lora_request)
        text, token_ids = self.process_prompt(prompt, params.truncate_prompt_tokens)
        if params.bad_words:
            if bad_words_token_ids is None:
                bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
            if not all(0 <= t < self.vocab_size for ids in bad_words_token_ids for t in ids):
                raise ValueError(f"bad_words has a token id outside the vocabulary [0, {self.vocab_size})")
        return EngineCoreRequest(request_id, text, token_ids, params,
                                 arrival_time=arrival_time or time.time(),
                                 bad_words_token_ids=list(bad_words_token_ids or []) if params.bad_words else [],
                                 lora_request=lora_request)

    def check_lora_request(self, lora_request) -> None:
        """A request's lora_request: None, or a LoRARequest on an engine started with LoRA."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be an engine.LoRARequest or None, got {type(lora_request).__name__}")
        if not self.enable_lora:
            raise ValueError("lora_request: this engine was started without LoRA (enable_lora=True, serve "
                             "--enable-lora)")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: limits of this engine and ids of this vocabulary."""
        if params.n > self.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.max_num_seqs}, got {params.n}")
        limit = self.logprobs_limit
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be <= {limit}, got {value}")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = [t for t in (getattr(params, name) or ()) if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if self.tokenizer is None:   # skip_tokenizer_init: the options that work on text are refused up front
            for name in ("stop", "bad_words", "guided_decoding"):
                if getattr(params, name):
                    raise ValueError(f"{name} needs the tokenizer, and this engine has none "
                                     f"(skip_tokenizer_init=True)")

    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """Validate a prompt (str, {"prompt": str} or {"prompt_token_ids": [...]}, optionally with "prompt" as its
        text) and return (text, token ids). With truncate_prompt_tokens=k only the last k tokens are kept (before
        the length check; the text is then theirs). Raises ValueError on bad input."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or not prompt:
                raise ValueError(f"a prompt dict has the keys 'prompt' and/or 'prompt_token_ids', got {sorted(prompt)}")
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
                if isinstance(token_ids, torch.Tensor):
                    token_ids = token_ids.tolist()
                if not isinstance(token_ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                    raise ValueError(f"prompt_token_ids must be a list of int, got {token_ids!r:.100}")
                token_ids = list(token_ids)
            else:
                text, token_ids = self._tokenize(prompt["prompt"])
        else:
            text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        if truncate_prompt_tokens is not None and len(token_ids) > truncate_prompt_tokens:
            token_ids = token_ids[-truncate_prompt_tokens:]
            text = None if text is None or self.tokenizer is None else Detokenizer(self.tokenizer).decode(token_ids, skip_special_tokens=False)
        check_prompt_token_ids(token_ids, self.vocab_size, self.max_model_len)
        return text, token_ids

    def _tokenize(self, text) -> tuple[str, list[int]]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a str or a dict with 'prompt_token_ids', got {type(text).__name__}")
        if not text:
            raise ValueError("prompt is empty")
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs the tokenizer, and this engine has none "
                             "(skip_tokenizer_init=True); give {'prompt_token_ids': [...]}")
        return text, self.tokenizer.encode(text)

    def bad_words_token_ids(self, bad_words: list[str], tokenizer=None) -> list[list[int]]:
        """vLLM's rule: each word's tokens, and those of " " + word when that is a different first token of the
        same length (the word in the middle of a text). tokenizer: a copy of the engine's (a thread's own)."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        token_ids = []
        for word in bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced) if spaced and plain and spaced[0] != plain[0] \
                    and len(spaced) == len(plain) else (plain,):
                if ids and all(t < self.vocab_size for t in ids):
                    token_ids.append(ids)
        return token_ids
