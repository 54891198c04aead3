"""Next-token sampling for a whole batch at once, in float32.

Per step, in vLLM v1's order: raw logprobs (if asked) -> min_tokens mask -> penalties -> greedy argmax ->
temperature -> min-p -> top-k / top-p -> random draw -> greedy and random rows merged. Every stage is one
tensor op over [num_seqs, vocab_size]; stages nobody in the batch uses are skipped. The only Python loops are
over requests (gathering their parameters) and over the seeded requests' generators.

Random draws use the exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. is a sample from probs. A
seeded request fills its row of q from its own torch.Generator, so its tokens do not depend on what else is in
the batch; the other rows draw from the sampler's generator (seeded from LLM(seed)).
"""
from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]                       # [num_seqs]
    # For sequences that asked for logprobs (None elsewhere): the top-`logprobs` token ids of the raw
    # log-softmax with their logprobs, plus the sampled token's logprob and 1-based rank.
    topk_token_ids: list[list[int] | None] | None = None
    topk_logprobs: list[list[float] | None] | None = None
    sampled_logprobs: list[float | None] | None = None
    sampled_ranks: list[int | None] | None = None


class Sampler:
    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [num_seqs, vocab_size] float32, the last position of each sequence in `seqs` (same order);
        modified in place (the engine hands over a fresh tensor each step). Returns one sampled token per
        sequence (and logprobs for those that asked)."""
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs)={len(seqs)}, vocab_size], got {tuple(logits.shape)}")
        logits = logits.float().contiguous()
        num_seqs, vocab_size = logits.shape
        device = logits.device
        params = [seq.params for seq in seqs]

        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        # min_tokens: EOS and stop tokens cannot be sampled before the request has min_tokens outputs.
        rows, cols = [], []
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = [t for t in seq.stop_token_ids if t < vocab_size]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits[rows, cols] = float("-inf")

        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            apply_penalties(logits, seqs)

        greedy = torch.tensor([p.greedy for p in params], device=device)
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            sampled = greedy_tokens
        else:
            temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                       dtype=torch.float32, device=device)
            logits.div_(temperature.unsqueeze(1))
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
                apply_min_p(logits, min_p)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
                logits = apply_top_k_top_p(logits, top_k, top_p)
            probs = torch.softmax(logits, dim=-1)
            q = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, seq in enumerate(seqs):
                if seq.generator is not None:
                    q[i].exponential_(generator=seq.generator)
            sampled = torch.where(greedy, greedy_tokens, probs.div_(q).argmax(dim=-1))

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled.tolist())
        return _gather_logprobs(raw_logprobs, sampled, [p.logprobs for p in params])


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place on logits [num_seqs, vocab_size], vLLM semantics: repetition_penalty on tokens seen in the prompt
    or the output (positive logits divided, negative multiplied); frequency_penalty * count and presence_penalty
    * (count > 0) subtracted for output tokens."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    prompt_counts = _bin_counts([seq.prompt_token_ids for seq in seqs], vocab_size, device)
    output_counts = _bin_counts([seq.output_token_ids for seq in seqs], vocab_size, device)
    output_mask = output_counts > 0
    rep = torch.tensor([seq.params.repetition_penalty for seq in seqs], dtype=torch.float32, device=device)
    freq = torch.tensor([seq.params.frequency_penalty for seq in seqs], dtype=torch.float32, device=device)
    pres = torch.tensor([seq.params.presence_penalty for seq in seqs], dtype=torch.float32, device=device)
    penalties = torch.where((prompt_counts > 0) | output_mask, rep.unsqueeze(1), 1.0)
    logits.mul_(torch.where(logits > 0, 1.0 / penalties, penalties))
    logits.sub_(freq.unsqueeze(1) * output_counts)
    logits.sub_(pres.unsqueeze(1) * output_mask)


def _bin_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[num_seqs, vocab_size] float32 occurrence counts; padding goes to an extra column that is dropped."""
    max_len = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max_len), vocab_size, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    padded = padded.clamp_(max=vocab_size).to(device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below min_p [num_seqs] times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the top_k [num_seqs] (int64, vocab_size = off) largest logits, then the smallest set whose
    probability mass reaches top_p [num_seqs] (1.0 = off); everything else -> -inf. One sort for the batch."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    kth_largest = logits_sort.gather(1, (vocab_size - top_k).clamp(0, vocab_size - 1).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth_largest, float("-inf"))
    cum_probs = torch.softmax(logits_sort, dim=-1).cumsum_(dim=-1)
    top_p_mask = cum_probs <= (1.0 - top_p).unsqueeze(1)
    top_p_mask[:, -1] = False   # the most likely token always survives
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]) -> SamplerOutput:
    max_k = max(k for k in num_logprobs if k is not None)
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))   # [num_seqs, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    topk_lp, topk_ids = raw_logprobs.topk(max_k, dim=-1) if max_k > 0 else (sampled_lp[:, :0], sampled[:, None][:, :0])
    # One host transfer for the whole batch.
    sampled_list, sampled_lp_list, ranks_list = sampled.tolist(), sampled_lp.squeeze(1).tolist(), ranks.tolist()
    topk_lp_list, topk_ids_list = topk_lp.tolist(), topk_ids.tolist()
    out = SamplerOutput(sampled_token_ids=sampled_list, topk_token_ids=[], topk_logprobs=[],
                        sampled_logprobs=[], sampled_ranks=[])
    for i, k in enumerate(num_logprobs):
        keep = k is not None
        out.topk_token_ids.append(topk_ids_list[i][:k] if keep else None)
        out.topk_logprobs.append(topk_lp_list[i][:k] if keep else None)
        out.sampled_logprobs.append(sampled_lp_list[i] if keep else None)
        out.sampled_ranks.append(ranks_list[i] if keep else None)
    return out
