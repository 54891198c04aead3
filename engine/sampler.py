"""Next-token sampling for a whole batch at once, in float32.

Per step, in vLLM v1's order: raw logprobs (if asked) -> min_tokens mask -> penalties -> greedy argmax ->
temperature -> min-p -> top-k / top-p -> random draw -> greedy and random rows merged. Every stage is one
tensor op over [num_seqs, vocab_size]; stages nobody in the batch uses are skipped. The only Python loops are
over requests (gathering their parameters) and over the seeded requests' generators.

Random rows are sampled by inverse CDF: one uniform number per row, the first token whose cumulative
probability exceeds it. A seeded request draws its number from its own torch.Generator, so its tokens do not
depend on what else is in the batch; the other rows draw from the sampler's generator (seeded from LLM(seed)).
One number per row (instead of one per vocabulary entry, as in the exponential race argmax(probs / q)) keeps
the random draws off the CPU profile.
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

        sampled = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            if len(random_rows) < num_seqs:
                rows = torch.tensor(random_rows, device=device)
                sampled[rows] = self._sample_random(logits[rows], [seqs[i] for i in random_rows])
            else:
                sampled = self._sample_random(logits, seqs)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled.tolist())
        return _gather_logprobs(raw_logprobs, sampled, [p.logprobs for p in params])


    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [num_seqs, vocab_size] of non-greedy sequences (modified in place) -> sampled ids [num_seqs]."""
        device = logits.device
        params = [seq.params for seq in seqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        logits.div_(temperature.unsqueeze(1))
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        # One uniform per row; a seeded row draws its own from its generator.
        uniform = torch.rand(len(seqs), generator=self.generator, device=device)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                uniform[i:i + 1].uniform_(generator=seq.generator)
        return sample_inverse_cdf(torch.softmax(logits, dim=-1), uniform)


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of probs [num_seqs, vocab_size] (float32, rows summing to ~1) with
    uniform [num_seqs] in [0, 1): the first token whose cumulative probability exceeds uniform * total.
    A zero-probability token adds nothing to the running sum, so it can never be chosen."""
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so that rounding in uniform * total cannot run past the last live token.
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


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


# Top-p first looks for the nucleus among this many most likely tokens (one topk instead of a full-vocabulary
# sort, ~8x cheaper on CPU for a 49k vocabulary); rows whose nucleus is wider fall back to the sort.
_TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep, per row of logits [num_seqs, vocab_size], the top_k largest logits (0 = off), then the smallest
    set of most likely tokens whose probability reaches top_p (1.0 = off); the rest -> -inf (in place, or a
    new tensor when the full sort is used: use the returned tensor). vLLM semantics: a token survives top-p
    when the probability mass of the tokens ranked above it is below top_p."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    use_top_p = any(p < 1.0 for p in top_p)
    num_candidates = max(max(top_k), _TOP_P_CANDIDATES if use_top_p else 0)
    k = torch.tensor([t if t > 0 else vocab_size for t in top_k], device=device)
    p = torch.tensor(top_p, dtype=torch.float32, device=device)
    # On CUDA the full sort is cheap, and the candidate path's overflow check would be a host sync.
    if num_candidates * 2 >= vocab_size or logits.is_cuda:
        return _top_k_top_p_sorted(logits, k, p)
    no_top_k = torch.tensor([t == 0 for t in top_k], device=device).unsqueeze(1)
    candidates = logits.topk(num_candidates, dim=-1).values                      # [num_seqs, C], descending
    kth = candidates.gather(1, (k.clamp(max=num_candidates) - 1).unsqueeze(1))   # [num_seqs, 1]
    kth = kth.masked_fill(no_top_k, float("-inf"))
    candidates = candidates.masked_fill(candidates < kth, float("-inf"))
    threshold = kth
    overflow = None
    if use_top_p:
        # Normalizer of the top-k survivors: all inside the candidates when top-k is on, the whole row otherwise.
        log_norm = torch.where(no_top_k, torch.logsumexp(logits, dim=-1, keepdim=True),
                               torch.logsumexp(candidates, dim=-1, keepdim=True))
        probs = (candidates - log_norm).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        keep = mass_before < p.unsqueeze(1)
        keep[:, 0] = True
        keep &= candidates > float("-inf")
        smallest_kept = candidates.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
        threshold = torch.maximum(kth, smallest_kept.masked_fill((p >= 1.0).unsqueeze(1), float("-inf")))
        # Every candidate kept and more tokens behind them: the nucleus may extend past the candidates.
        overflow = keep[:, -1] & no_top_k.squeeze(1) & (p < 1.0)
    fallback = None
    if overflow is not None and bool(overflow.any()):
        rows = overflow.nonzero().squeeze(1)
        fallback = rows, _top_k_top_p_sorted(logits[rows], k[rows], p[rows])
    logits.masked_fill_(logits < threshold, float("-inf"))
    if fallback is not None:
        logits[fallback[0]] = fallback[1]
    return logits


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference form (vLLM's apply_top_k_top_p): one full sort of the batch. top_k [num_seqs] int64
    (vocab_size = off), top_p [num_seqs] float32 (1.0 = off)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    kth_largest = logits_sort.gather(1, (vocab_size - top_k).clamp(0, vocab_size - 1).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth_largest, float("-inf"))
    cum_probs = torch.softmax(logits_sort, dim=-1).cumsum_(dim=-1)
    top_p_mask = cum_probs <= (1.0 - top_p).unsqueeze(1)
    top_p_mask[:, -1] = False   # the most likely token always survives
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                     num_logprobs: list[int | None]) -> SamplerOutput:
    max_k = max(k for k in num_logprobs if k is not None)
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))   # [num_seqs, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    topk_lp, topk_ids = raw_logprobs.topk(max_k, dim=-1) if max_k > 0 else (sampled_lp[:, :0], sampled[:, None][:, :0])
    # One host transfer for the whole batch: ids and ranks are exact in float64 (< 2**53).
    packed = torch.cat([sampled[:, None].double(), sampled_lp.double(), ranks[:, None].double(),
                        topk_lp.double(), topk_ids.double()], dim=1).tolist()
    sampled_list = [int(row[0]) for row in packed]
    sampled_lp_list = [row[1] for row in packed]
    ranks_list = [int(row[2]) for row in packed]
    topk_lp_list = [row[3:3 + max_k] for row in packed]
    topk_ids_list = [[int(t) for t in row[3 + max_k:]] for row in packed]
    out = SamplerOutput(sampled_token_ids=sampled_list, topk_token_ids=[], topk_logprobs=[],
                        sampled_logprobs=[], sampled_ranks=[])
    for i, k in enumerate(num_logprobs):
        keep = k is not None
        out.topk_token_ids.append(topk_ids_list[i][:k] if keep else None)
        out.topk_logprobs.append(topk_lp_list[i][:k] if keep else None)
        out.sampled_logprobs.append(sampled_lp_list[i] if keep else None)
        out.sampled_ranks.append(ranks_list[i] if keep else None)
    return out
