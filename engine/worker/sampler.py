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


@dataclass(slots=True)
class SamplingMetadata:
    """The sampling state of the rows of a logits tensor, in its row order. Tensors are on the logits' device;
    a stage no row uses is None (or empty) and skipped. Built by the worker from its persistent batch
    (engine/worker/input_batch.py), or from sequence-like objects by `from_sequences`."""
    temperature: torch.Tensor                       # float32 [num_rows]; 0 = greedy
    greedy: list[bool]
    top_k: list[int] | None = None                  # per row, 0 = off
    top_p: list[float] | None = None                # per row, 1.0 = off
    min_p: torch.Tensor | None = None               # float32 [num_rows]
    generators: dict[int, torch.Generator] | None = None   # row -> its own generator (seeded sequences)
    # Penalties: (repetition, frequency, presence) float32 [num_rows] each, prompt_mask bool [num_rows, vocab],
    # output_counts float32 [num_rows, vocab].
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    logit_bias: dict[int, dict[int, float]] | None = None          # row -> {token: bias}
    allowed_token_ids: dict[int, list[int]] | None = None          # row -> the only tokens it may take
    banned_token_ids: dict[int, list[int]] | None = None           # row -> tokens masked this step (bad words,
    #                                                                 stop tokens before min_tokens)
    num_logprobs: list[int | None] | None = None                   # per row, None: no logprobs
    grammar_bitmask: tuple[list[int], torch.Tensor] | None = None  # (rows, int32 [len(rows), ceil(vocab / 32)])

    @classmethod
    def from_sequences(cls, seqs, device: torch.device | str, vocab_size: int) -> "SamplingMetadata":
        """From objects with `params`, `prompt_token_ids`, `output_token_ids`, `generator`, `stop_token_ids`,
        `bad_words_token_ids` and optionally `guided` (a grammar state with a `.matcher`): the core's
        Sequence in tests, the worker's SequenceState."""
        params = [seq.params for seq in seqs]
        meta = cls(temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   greedy=[p.greedy for p in params])
        if any(p.top_k > 0 for p in params):
            meta.top_k = [p.top_k for p in params]
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = [p.top_p for p in params]
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        meta.generators = {i: seq.generator for i, seq in enumerate(seqs) if seq.generator is not None} or None
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            meta.penalties = penalty_tensors(seqs, vocab_size, device)
        meta.logit_bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias} or None
        meta.allowed_token_ids = {i: p.allowed_token_ids for i, p in enumerate(params)
                                  if p.allowed_token_ids is not None} or None
        banned = {i: ids for i, seq in enumerate(seqs)
                  if (ids := banned_token_ids(seq.output_token_ids, seq.params.min_tokens, seq.stop_token_ids,
                                              seq.bad_words_token_ids))}
        meta.banned_token_ids = banned or None
        if any(p.logprobs is not None for p in params):
            meta.num_logprobs = [p.logprobs for p in params]
        guided = [i for i, seq in enumerate(seqs) if getattr(seq, "guided", None) is not None]
        if guided:
            import xgrammar

            bitmask = xgrammar.allocate_token_bitmask(len(guided), vocab_size)
            for j, i in enumerate(guided):
                seqs[i].guided.matcher.fill_next_token_bitmask(bitmask, j)
            meta.grammar_bitmask = (guided, bitmask)
        return meta


def penalty_tensors(seqs, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
    """(repetition, frequency, presence [num_seqs], prompt_mask bool [num_seqs, vocab], output_counts float32
    [num_seqs, vocab]) counted from sequence-like objects (the worker keeps its counts up to date instead)."""
    num_seqs = len(seqs)
    rep = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=torch.float32, device=device)
    freq = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=torch.float32, device=device)
    pres = torch.tensor([s.params.presence_penalty for s in seqs], dtype=torch.float32, device=device)
    prompt_mask = _bin_counts([s.prompt_token_ids for s in seqs], vocab_size, device) > 0
    output_counts = _bin_counts([s.output_token_ids for s in seqs], vocab_size, device)
    assert prompt_mask.shape == (num_seqs, vocab_size)
    return rep, freq, pres, prompt_mask, output_counts


def banned_token_ids(output_token_ids, min_tokens: int, stop_token_ids, bad_words_token_ids) -> list[int]:
    """Tokens a sequence may not take next: its stop tokens (EOS, stop_token_ids) until min_tokens outputs, and
    the last token of each bad word whose other tokens end the output."""
    banned = list(stop_token_ids) if len(output_token_ids) < min_tokens else []
    for word in bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (len(output_token_ids) >= prefix_len
                               and list(output_token_ids[-prefix_len:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


class Sampler:
    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu"):
        self.seed, self.device = seed, device
        self._generator: torch.Generator | None = None

    @property
    def generator(self) -> torch.Generator:
        """The generator of the rows without their own, seeded from LLM(seed), made on first use."""
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(self.seed)
        return self._generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, meta) -> SamplerOutput:
        """logits: [num_rows, vocab_size] float32, one row per sampled sequence; modified in place (the caller
        hands over a fresh tensor). meta: the rows' SamplingMetadata, or the sequences themselves (see
        SamplingMetadata.from_sequences). Returns one sampled token per row, each in [0, vocab_size) (and
        logprobs for the rows that asked)."""
        if not isinstance(meta, SamplingMetadata):
            meta = SamplingMetadata.from_sequences(meta, logits.device, logits.shape[1])
        if logits.ndim != 2 or logits.shape[0] != len(meta.greedy):
            raise ValueError(f"logits must be [num_rows={len(meta.greedy)}, vocab_size], got {tuple(logits.shape)}")
        logits = logits.float().contiguous()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.num_logprobs is not None else None
        logits, row_max, sampled, context = process_logits(logits, meta)
        dead_rows = context["dead_rows"]
        dead_set = set(dead_rows)
        random_rows = [i for i, greedy in enumerate(meta.greedy) if not greedy and i not in dead_set]
        if random_rows:
            num_rows = logits.shape[0]
            if len(random_rows) < num_rows:
                rows = torch.tensor(random_rows, device=logits.device)
                sampled[rows] = self._sample_random(logits[rows], row_max[rows], meta, random_rows)
            else:
                sampled = self._sample_random(logits, row_max, meta, random_rows)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled.tolist())
        return _gather_logprobs(raw_logprobs, sampled, meta.num_logprobs)

    def _sample_random(self, logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata,
                       rows: list[int]) -> torch.Tensor:
        """logits [len(rows), vocab_size] of non-greedy rows `rows` (modified in place; each has a finite maximum
        row_max [len(rows)]) -> sampled ids [len(rows)]."""
        probs = random_probs(logits, row_max, meta, rows)
        return sample_inverse_cdf(probs, self.uniform(len(rows), logits.device, meta, rows))

    def uniform(self, num: int, device, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        """One uniform per row; a row with its own generator draws it from that generator."""
        uniform = torch.rand(num, generator=self.generator, device=device)
        if meta.generators:
            for i, row in enumerate(rows):
                generator = meta.generators.get(row)
                if generator is not None:
                    uniform[i:i + 1].uniform_(generator=generator)
        return uniform


def process_logits(logits: torch.Tensor, meta: SamplingMetadata):
    """The stages before the draw, in place on logits [num_rows, vocab] float32: logit_bias, grammar mask, token
    masks, penalties; then the greedy argmax, NaN/inf handled and dead rows given their fallback. Returns
    (logits, row_max, argmax ids, context) where context["dead_rows"] lists the rows that had nothing left."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    if meta.logit_bias:
        apply_logit_bias(logits, meta.logit_bias)
    grammar_rows, grammar_bitmask = [], None
    if meta.grammar_bitmask is not None:
        grammar_rows, grammar_bitmask = _apply_grammar(logits, meta.grammar_bitmask)
    mask_rows = sorted(set(meta.allowed_token_ids or ()) | set(meta.banned_token_ids or ()))
    unmasked = None
    if mask_rows:
        unmasked = logits[torch.tensor(mask_rows, device=device)]
        apply_token_masks(logits, meta.allowed_token_ids or {}, meta.banned_token_ids or {})
    if meta.penalties is not None:
        _penalize(logits, *meta.penalties)
    row_max, sampled = logits.max(dim=-1)
    # max propagates NaN, so a row with a NaN or +inf anywhere has a NaN or +inf maximum: the check of these
    # num_rows values stands for a pass over the whole batch (no stage before needs clean logits: they only
    # add, mask or saturate). A -inf maximum is a row with nothing left to sample.
    dead_rows = []
    if not bool(torch.isfinite(row_max).all()):
        if bool((row_max.isnan() | (row_max == float("inf"))).any()):
            _sanitize(logits)
            row_max, sampled = logits.max(dim=-1)
        dead_rows = (row_max == float("-inf")).nonzero().squeeze(1).tolist()
    if dead_rows:
        sampled[dead_rows] = torch.tensor(
            _fallback_tokens(dead_rows, mask_rows, unmasked, grammar_rows, grammar_bitmask, vocab_size),
            device=device)
    return logits, row_max, sampled, {"dead_rows": dead_rows}


def random_probs(logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    """Probabilities of non-greedy rows `rows` (logits [len(rows), vocab], processed, each with a finite maximum
    row_max): temperature, min-p, top-k / top-p, softmax."""
    device = logits.device
    # A huge temperature is clamped to the float32 range (it flattens the row instead of making
    # -inf / inf = NaN).
    index = torch.tensor(rows, device=device) if len(rows) != len(meta.greedy) else None
    temperature = meta.temperature if index is None else meta.temperature[index]
    temperature = temperature.clamp(max=_FLOAT32_MAX).unsqueeze(1)
    if bool(torch.isfinite(row_max.unsqueeze(1) / temperature).all()):
        logits.div_(temperature)   # every logit <= row_max: nothing overflows to +inf
    else:
        # Shifted so the row maximum is exactly 0: a tiny temperature cannot overflow it to +inf.
        logits.sub_(row_max.unsqueeze(1)).div_(temperature)
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p if index is None else meta.min_p[index])
    top_k = [meta.top_k[r] for r in rows] if meta.top_k is not None else None
    top_p = [meta.top_p[r] for r in rows] if meta.top_p is not None else None
    if (top_k and any(k > 0 for k in top_k)) or (top_p and any(p < 1.0 for p in top_p)):
        logits = apply_top_k_top_p(logits, top_k or [0] * len(rows), top_p or [1.0] * len(rows))
    return torch.softmax(logits, dim=-1)


def sampler_dummy_run(logits: torch.Tensor, num_logprobs: int = 20) -> torch.Tensor:
    """The sampler's largest footprint on logits [num_seqs, vocab_size], for the memory profile: raw logprobs,
    penalties, min-p, top-k/top-p by the full sort, the draw and the top logprobs, all on, with no value read
    back to the host. Returns the sampled ids [num_seqs] (on the logits' device)."""
    logits = logits.float().clone()
    num_seqs, vocab_size = logits.shape
    device = logits.device
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    full = lambda value: torch.full((num_seqs,), value, dtype=torch.float32, device=device)  # noqa: E731
    _penalize(logits, full(1.1), full(0.1), full(0.1), torch.zeros(num_seqs, vocab_size, dtype=torch.bool,
                                                                    device=device),
              torch.zeros(num_seqs, vocab_size, device=device))
    apply_min_p(logits, full(0.05))
    logits = _top_k_top_p_sorted(logits, torch.full((num_seqs,), 50, device=device), full(0.9))
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
            allowed = unpack_bitmask(grammar_bitmask[row:row + 1].cpu(), vocab_size)[0].nonzero()
            if allowed.numel():
                tokens.append(int(allowed[0]))
                continue
        tokens.append(0)
    return tokens


def _apply_grammar(logits: torch.Tensor, grammar: tuple[list[int], torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """Mask what each guided row's grammar forbids (xgrammar's kernel). grammar: (rows, int32 bitmask
    [len(rows), ceil(vocab / 32)]). Returns (rows, the bitmask over all rows of logits: all ones elsewhere)."""
    import xgrammar

    rows, compact = grammar
    num_rows, vocab_size = logits.shape
    bitmask = torch.full((num_rows, compact.shape[1]), -1, dtype=torch.int32)
    bitmask[rows] = compact.to("cpu", torch.int32)
    device_bitmask = bitmask.to(logits.device, non_blocking=True) if logits.is_cuda else bitmask
    xgrammar.apply_token_bitmask_inplace(logits, device_bitmask, vocab_size=vocab_size, indices=rows)
    return rows, bitmask


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32 [num_rows, ceil(vocab_size / 32)] (bit j of word w: token 32 * w + j) -> bool
    [num_rows, vocab_size], True where the token is allowed. For the sampler's fallback on a few rows; the
    masking itself uses xgrammar's kernel, several times faster than these tensor ops."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmask.device)) & 1   # arithmetic shift: bit 31 still 0/1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> None:
    """In place on logits [num_rows, vocab_size]: add row r's {token id: bias} (ids checked against the
    vocabulary when the request was added)."""
    rows, cols, values = [], [], []
    for row, bias in logit_bias.items():
        rows += [row] * len(bias)
        cols += bias.keys()
        values += bias.values()
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                      torch.tensor(values, dtype=torch.float32, device=device), accumulate=True)


def apply_token_masks(logits: torch.Tensor, allowed_token_ids: dict[int, list[int]],
                      banned_token_ids: dict[int, list[int]]) -> None:
    """In place on logits [num_rows, vocab_size]: everything outside a row's allowed_token_ids, and its banned
    tokens (bad words, stop tokens before min_tokens) -> -inf."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    if allowed_token_ids:
        allowed_rows = list(allowed_token_ids)
        keep = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool, device=device)
        rows, cols = [], []
        for j, row in enumerate(allowed_rows):
            ids = allowed_token_ids[row]
            rows += [j] * len(ids)
            cols += ids
        keep[rows, cols] = True
        index = torch.tensor(allowed_rows, device=device)
        logits[index] = logits[index].masked_fill_(~keep, float("-inf"))
    rows, cols = [], []
    for row, banned in banned_token_ids.items():
        banned = [t for t in banned if t < vocab_size]
        rows += [row] * len(banned)
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


def apply_penalties(logits: torch.Tensor, seqs) -> None:
    """In place on logits [num_seqs, vocab_size], for sequence-like objects (prompt_token_ids, output_token_ids,
    params): see `_penalize`."""
    _penalize(logits, *penalty_tensors(seqs, logits.shape[1], logits.device))


def _penalize(logits: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor,
              prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> None:
    """In place on logits [num_rows, vocab_size], vLLM semantics: repetition_penalty on tokens seen in the prompt
    or the output (positive logits divided, negative multiplied); frequency_penalty * count and presence_penalty
    * (count > 0) subtracted for output tokens. A finite logit stays finite (saturating at the float32 range: a
    tiny penalty divides by almost 0), a masked -inf stays -inf, NaN stays NaN.
    rep, freq, pres: float32 [num_rows]; prompt_mask bool and output_counts float32 [num_rows, vocab_size]."""
    output_mask = output_counts > 0
    rep = rep.clamp(_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY)   # 1 / rep finite; overflow clamped below
    penalties = torch.where(prompt_mask | output_mask, rep.unsqueeze(1), 1.0)
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
