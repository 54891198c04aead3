"""Beam search on shared blocks: `LLM.beam_search(prompts, BeamSearchParams(...))`.

A beam-search request is one sequence group. Its prompt is computed once; every step, each live beam computes
its last token, the worker returns each beam's best `num_candidates` next tokens with their log-softmax values
(the best candidates over all beams are among them), the engine hands them to `BeamSearchState.step`, and the chosen
continuations become the next beams: a beam continued k times is forked k - 1 times (the forks share all of its
blocks and copy none until they write into a shared, partly filled block), a beam not continued is freed.

The selection is transformers' `generate(num_beams=beam_width, do_sample=False, length_penalty=...,
early_stopping=...)` (transformers >= 4.50, vectorized `_beam_search`), step for step:
- candidates: the top K = max(2, 1 + number of EOS ids) * beam_width of (beam score + token logprob) over all
  live beams and the vocabulary (at the first step only the prompt's row);
- a candidate "hits" when its token is an EOS id (unless ignore_eos) or it reaches max_tokens; a hitting
  candidate among the top beam_width is a finished hypothesis scored sum_logprobs / generated_len **
  length_penalty (generated_len counts the EOS token); the best beam_width hypotheses are kept;
- the next live beams are the top beam_width candidates that do not hit;
- stopping, all three `early_stopping` rules of transformers (default False):
  True: stop as soon as beam_width hypotheses are finished;
  False: stop when beam_width hypotheses are finished and the best live beam's score divided by
  (current generated length) ** length_penalty cannot beat the worst of them;
  "never": the same, but with (max_tokens) ** length_penalty as the divisor when length_penalty > 0;
  and always when every candidate hits (max_tokens reached).
The best sequence equals transformers' first returned sequence (tests/engine/test_beam_search.py).
"""
from dataclasses import dataclass, field

import torch

# transformers' stand-in for minus infinity in beam scores (added, not assigned, so it is kept exactly).
_NEG = -1.0e9


@dataclass(slots=True)
class BeamSearchParams:
    """beam_width beams, at most max_tokens new tokens each; score = cum_logprob / len ** length_penalty."""
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam (vLLM's BeamSearchSequence): tokens are prompt + generated ids, text their decoding."""
    tokens: list[int]
    cum_logprob: float
    score: float   # cum_logprob / (generated length) ** length_penalty: the ranking key
    text: str | None = None
    finish_reason: str | None = None   # "stop" (EOS) or "length"


@dataclass(slots=True)
class BeamSearchOutput:
    """The finished beams of one prompt, best first (vLLM's BeamSearchOutput)."""
    sequences: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearchState:
    """The beam-search bookkeeping of one request (no tensors of the model, no blocks)."""

    def __init__(self, params: BeamSearchParams, prompt_len: int, eos_token_ids: frozenset[int]):
        self.params = params
        self.prompt_len = prompt_len
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * params.beam_width
        self.scores = torch.zeros(1)   # float32 running scores of the live beams, in their order
        self.num_generated = 0
        self.finished: list[tuple[float, float, list[int], str]] = []   # (score, cum_logprob, output ids, reason)
        self.improvable = True
        self.done = False
        self.next_index = 1

    def step(self, outputs: list[list[int]], candidates: list[tuple[list[int], list[float]]]) -> list[tuple[int, int]]:
        """outputs: the generated ids of each live beam; candidates: per beam, its `num_candidates` most likely
        next tokens (ids, log-softmax values; the best `num_candidates` over all beams are among them). Returns
        the next live beams as (parent beam position, token id); sets `done`."""
        p = self.params
        width = p.beam_width
        ids = torch.tensor([c[0] for c in candidates], dtype=torch.int64)          # [num_beams, K]
        values = torch.tensor([c[1] for c in candidates], dtype=torch.float32)
        num_per_beam = ids.shape[1]
        accumulated = (values + self.scores[:, None]).reshape(-1)
        top_scores, top_indices = accumulated.topk(min(self.num_candidates, accumulated.numel()))
        parents = (top_indices // num_per_beam).tolist()
        tokens = ids.reshape(-1)[top_indices].tolist()
        at_limit = self.num_generated + 1 >= p.max_tokens
        hits = [at_limit or t in self.eos_token_ids for t in tokens]

        # Finished hypotheses: hitting candidates among the top beam_width, while they can still enter.
        full = len(self.finished) == width
        if self.improvable and not (full and p.early_stopping is True):
            divisor = float(self.num_generated + 1) ** p.length_penalty
            normalized = (top_scores / divisor).tolist()
            for rank in range(min(width, len(tokens))):
                if hits[rank]:
                    reason = "length" if tokens[rank] not in self.eos_token_ids else "stop"
                    self.finished.append((normalized[rank], float(top_scores[rank]),
                                          outputs[parents[rank]] + [tokens[rank]], reason))
            self.finished.sort(key=lambda h: -h[0])   # stable: earlier hypotheses win ties, like topk on the merge
            del self.finished[width:]

        # Next live beams: the best candidates that do not hit.
        running = top_scores + torch.tensor(hits, dtype=torch.float32) * _NEG
        next_scores, next_ranks = running.topk(min(width, running.numel()))
        keep = [r for r in next_ranks.tolist() if not hits[r]]
        self.scores = running[keep]
        self.num_generated += 1

        if len(self.finished) == width:
            if p.early_stopping == "never" and p.length_penalty > 0.0:
                best_length = p.max_tokens
            else:
                best_length = self.num_generated
            best_possible = float(next_scores[0]) / float(best_length) ** p.length_penalty
            self.improvable = self.improvable and best_possible > min(h[0] for h in self.finished)
        self.done = (not self.improvable or (len(self.finished) == width and p.early_stopping is True)
                     or all(hits) or not keep)
        return [(parents[r], tokens[r]) for r in keep]
