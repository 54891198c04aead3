"""Next-token sampling for a whole batch at once, in float32.

Per step, in vLLM v1's order: raw logprobs (if asked) -> logit_bias -> grammar mask (guided decoding) ->
allowed_token_ids / bad_words / min_tokens masks -> penalties -> greedy argmax -> temperature -> min-p ->
top-k / top-p -> random draw -> greedy and random rows merged. Every stage is one tensor op over
[num_seqs, vocab_size]; stages nobody in the batch uses are skipped. The only Python loops are over requests
(gathering their parameters, filling their grammar masks) and over the seeded requests' generators.

Whatever the parameters and the logits, every sampled id is in [0, vocab_size):
- NaN logits count as -inf (never sampled) and +inf as the largest float32, from the greedy argmax on (a raw
  logprob that comes out NaN is reported as -inf). Penalties, the only stage that can overflow (a tiny
  repetition_penalty divides by almost 0), saturate at the float32 range. Where a tiny temperature would
  overflow, it divides logits minus the row maximum, so the largest logit is 0 and softmax stays exact.
- A row with every token at -inf (the grammar, allowed_token_ids, bad_words and min_tokens masks leave nothing,
  or the model gave only NaN/-inf) falls back, in this order, to: the argmax of the row before the
  allowed_token_ids / bad_words / min_tokens masks (so a grammar stays satisfied); the first token the grammar
  allows; token 0.

Random rows are sampled by inverse CDF: one uniform number per row, the first token whose cumulative
probability exceeds it. A seeded request draws its number from its own torch.Generator, so its tokens do not
depend on what else is in the batch; the other rows draw from the sampler's generator (seeded from LLM(seed)).
One number per row (instead of one per vocabulary entry, as in the exponential race argmax(probs / q)) keeps
the random draws off the CPU profile.
"""
from dataclasses import dataclass

import torch

from engine.core.sequence import Sequence

_FLOAT32_MAX = torch.finfo(torch.float32).max
# Repetition penalties are clamped to this range so that 1 / penalty stays finite in float32.
_MIN_REPETITION_PENALTY = torch.finfo(torch.float32).tiny
_MAX_REPETITION_PENALTY = 1.0 / torch.finfo(torch.float32).tiny


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
        sequence, each in [0, vocab_size) (and logprobs for those that asked)."""
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs)={len(seqs)}, vocab_size], got {tuple(logits.shape)}")
        logits = logits.float().contiguous()
        num_seqs, vocab_size = logits.shape
        device = logits.device
        params = [seq.params for seq in seqs]

        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, params)

        guided_rows = [i for i, seq in enumerate(seqs) if seq.guided is not None]
        grammar_bitmask = None
        if guided_rows:
            from engine.core.guided_decoding import apply_grammar_bitmask   # imports xgrammar: only when used
            grammar_bitmask = apply_grammar_bitmask(logits, [seqs[i].guided for i in guided_rows], guided_rows)

        # Token masks the request asked for; the rows they touch keep an unmasked copy for the fallback.
        mask_rows = [i for i, seq in enumerate(seqs)
                     if seq.params.allowed_token_ids is not None or seq.bad_words_token_ids
                     or seq.num_output_tokens < seq.params.min_tokens]
        unmasked = None
        if mask_rows:
            unmasked = logits[torch.tensor(mask_rows, device=device)]
            apply_token_masks(logits, seqs, mask_rows)

        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            apply_penalties(logits, seqs)

        row_max, sampled = logits.max(dim=-1)
        # max propagates NaN, so a row with a NaN or +inf anywhere has a NaN or +inf maximum: the check of these
        # num_seqs values stands for a pass over the whole batch (no stage before needs clean logits: they only
        # add, mask or saturate). A -inf maximum is a row with nothing left to sample.
        dead_rows = []
        if not bool(torch.isfinite(row_max).all()):
            if bool((row_max.isnan() | (row_max == float("inf"))).any()):
                _sanitize(logits)
                row_max, sampled = logits.max(dim=-1)
            dead_rows = (row_max == float("-inf")).nonzero().squeeze(1).tolist()
        if dead_rows:
            sampled[dead_rows] = torch.tensor(
                _fallback_tokens(dead_rows, mask_rows, unmasked, guided_rows, grammar_bitmask, vocab_size),
                device=device)
        dead_set = set(dead_rows)
        random_rows = [i for i, p in enumerate(params) if not p.greedy and i not in dead_set]
        if random_rows:
            if len(random_rows) < num_seqs:
                rows = torch.tensor(random_rows, device=device)
                sampled[rows] = self._sample_random(logits[rows], row_max[rows], [seqs[i] for i in random_rows])
            else:
                sampled = self._sample_random(logits, row_max, seqs)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled.tolist())
        return _gather_logprobs(raw_logprobs, sampled, [p.logprobs for p in params])

    def _sample_random(self, logits: torch.Tensor, row_max: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [num_seqs, vocab_size] of non-greedy sequences (modified in place; each row has a finite
        maximum row_max [num_seqs]) -> sampled ids [num_seqs]."""
        device = logits.device
        params = [seq.params for seq in seqs]
        # A huge temperature is clamped to the float32 range (it flattens the row instead of making
        # -inf / inf = NaN).
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        temperature = temperature.clamp_(max=_FLOAT32_MAX).unsqueeze(1)
        if bool(torch.isfinite(row_max.unsqueeze(1) / temperature).all()):
            logits.div_(temperature)   # every logit <= row_max: nothing overflows to +inf
        else:
            # Shifted so the row maximum is exactly 0: a tiny temperature cannot overflow it to +inf.
            logits.sub_(row_max.unsqueeze(1)).div_(temperature)
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


def sampler_dummy_run(logits: torch.Tensor, num_logprobs: int = 20) -> torch.Tensor:
    """The sampler's largest footprint on logits [num_seqs, vocab_size], for the memory profile: raw logprobs,
    penalties, min-p, top-k/top-p by the full sort, the draw and the top logprobs, all on, with no value read
    back to the host. Returns the sampled ids [num_seqs] (on the logits' device)."""
    from types import SimpleNamespace

    logits = logits.float().clone()
    num_seqs, vocab_size = logits.shape
    device = logits.device
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    params = SimpleNamespace(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
    apply_penalties(logits, [SimpleNamespace(prompt_token_ids=[0], output_token_ids=[0], params=params)] * num_seqs)
    apply_min_p(logits, torch.full((num_seqs,), 0.05, device=device))
    logits = _top_k_top_p_sorted(logits, torch.full((num_seqs,), 50, device=device),
                                 torch.full((num_seqs,), 0.9, device=device))
    sampled = sample_inverse_cdf(torch.softmax(logits, dim=-1), torch.rand(num_seqs, device=device))
    raw_logprobs.topk(min(num_logprobs, vocab_size), dim=-1)
    return sampled


def _sanitize(logits: torch.Tensor) -> None:
    """In place: NaN -> -inf (such a token is never chosen), +inf -> the largest float32 (so that shifting
    by the row maximum stays finite)."""
    torch.nan_to_num_(logits, nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))


def _fallback_tokens(dead_rows: list[int], mask_rows: list[int], unmasked: torch.Tensor | None,
                     guided_rows: list[int], grammar_bitmask: torch.Tensor | None, vocab_size: int) -> list[int]:
    """The token of each row with nothing left to sample (see the module docstring for the order)."""
    tokens = []
    for row in dead_rows:
        if row in mask_rows:
            before_masks = unmasked[mask_rows.index(row)].nan_to_num(nan=float("-inf"))
            if bool(before_masks.amax() > float("-inf")):
                tokens.append(int(before_masks.argmax()))
                continue
        if row in guided_rows:
            from engine.core.guided_decoding import unpack_bitmask
            allowed = unpack_bitmask(grammar_bitmask[row:row + 1], vocab_size)[0].nonzero()
            if allowed.numel():
                tokens.append(int(allowed[0]))
                continue
        tokens.append(0)
    return tokens


def apply_logit_bias(logits: torch.Tensor, params: list) -> None:
    """In place on logits [num_seqs, vocab_size]: add each row's logit_bias {token id: bias} (ids were checked
    against the vocabulary when the request was added)."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                      torch.tensor(values, dtype=torch.float32, device=device), accumulate=True)


def apply_token_masks(logits: torch.Tensor, seqs: list[Sequence], mask_rows: list[int]) -> None:
    """In place on logits [num_seqs, vocab_size], for the rows in mask_rows: everything outside
    allowed_token_ids, the last token of each bad word whose other tokens end the output, and (before
    min_tokens outputs) EOS and stop_token_ids -> -inf."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    allowed_rows = [i for i in mask_rows if seqs[i].params.allowed_token_ids is not None]
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool, device=device)
        rows, cols = [], []
        for j, i in enumerate(allowed_rows):
            ids = seqs[i].params.allowed_token_ids
            rows += [j] * len(ids)
            cols += ids
        keep[rows, cols] = True
        index = torch.tensor(allowed_rows, device=device)
        logits[index] = logits[index].masked_fill_(~keep, float("-inf"))
    rows, cols = [], []
    for i in mask_rows:
        seq = seqs[i]
        banned = [t for t in seq.stop_token_ids if t < vocab_size] \
            if seq.num_output_tokens < seq.params.min_tokens else []
        for word in seq.bad_words_token_ids:
            prefix_len = len(word) - 1
            if prefix_len == 0 or (seq.num_output_tokens >= prefix_len
                                   and seq.output_token_ids[-prefix_len:] == word[:-1]):
                banned.append(word[-1])
        rows += [i] * len(banned)
        cols += banned
    if rows:
        logits[rows, cols] = float("-inf")


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
    * (count > 0) subtracted for output tokens. A finite logit stays finite (saturating at the float32 range: a
    tiny penalty divides by almost 0), a masked -inf stays -inf, NaN stays NaN."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    prompt_counts = _bin_counts([seq.prompt_token_ids for seq in seqs], vocab_size, device)
    output_counts = _bin_counts([seq.output_token_ids for seq in seqs], vocab_size, device)
    output_mask = output_counts > 0
    rep = torch.tensor([seq.params.repetition_penalty for seq in seqs], dtype=torch.float32, device=device)
    rep.clamp_(_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY)   # 1 / rep finite; the caller clamps overflow
    freq = torch.tensor([seq.params.frequency_penalty for seq in seqs], dtype=torch.float32, device=device)
    pres = torch.tensor([seq.params.presence_penalty for seq in seqs], dtype=torch.float32, device=device)
    penalties = torch.where((prompt_counts > 0) | output_mask, rep.unsqueeze(1), 1.0)
    penalized = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    penalized.clamp_(-_FLOAT32_MAX, _FLOAT32_MAX).masked_fill_(logits == float("-inf"), float("-inf"))
    logits.copy_(penalized)
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
    # A row of the model output with no finite logit has NaN logprobs: report its tokens as impossible (-inf).
    sampled_lp, topk_lp = sampled_lp.nan_to_num(nan=float("-inf")), topk_lp.nan_to_num(nan=float("-inf"))
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
