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

The draws stay on the device (`Sampler.sample` -> `SampledTensors`); `SampledIds` holds a step's plain-sampled rows
until the host reads them: a copy to pinned host memory is queued behind the sampler and read when the values are
wanted (at once without async scheduling, one step later with it, when the next step's inputs also take the ids
from the device: `scatter_into`), and `AsyncModelRunnerOutput` is a step's output whose ids are filled in by
`get_output()`, the engine core's one deliberate wait. On CPU the ids are read where they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.step_records import ModelRunnerOutput, SampleLogprobs
from pagedkernels import sample_from_logits as pk_sample_from_logits

FLOAT32_MAX = torch.finfo(torch.float32).max
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
class SampledTensors:
    """What the sampler drew, still on the logits' device (no value read back): the runner copies it to the host
    when it wants the values (at once, or one step later under async scheduling) and unpacks it there."""
    sampled_token_ids: torch.Tensor                 # int64 [num_rows]
    # float64 [num_rows, 3 + 2 * max_k] (see pack_logprobs) when some row asked for logprobs, else None.
    packed_logprobs: torch.Tensor | None = None
    num_logprobs: list[int | None] | None = None

    def to_lists(self, sampled: list[int], packed: list[list[float]] | None) -> SamplerOutput:
        """The SamplerOutput of these draws, given their values on the host (`sampled_token_ids.tolist()`,
        `packed_logprobs.tolist()`)."""
        if packed is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return unpack_logprobs(packed, self.num_logprobs)


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
    penalties: "Penalties | None" = None
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
        if any(0 < p.top_k < vocab_size for p in params):
            meta.top_k = [p.top_k if p.top_k < vocab_size else 0 for p in params]
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = [p.top_p for p in params]
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        meta.generators = {i: seq.generator for i, seq in enumerate(seqs) if seq.generator is not None} or None
        penalized = [i for i, p in enumerate(params)
                     if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
        if penalized:
            meta.penalties = Penalties.build(penalized, [params[i] for i in penalized],
                                             [seqs[i].prompt_token_ids for i in penalized],
                                             [seqs[i].output_token_ids for i in penalized], device)
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


@dataclass(slots=True)
class Penalties:
    """Repetition, frequency and presence penalties of some rows, as vLLM applies them, from the rows' own tokens
    rather than vocabulary-wide counts: a step touches only the tokens a sequence has (prompt + output), not the
    whole vocabulary (256 rows x 49k tokens is 12.6M entries per stage; 256 sequences of a few hundred tokens
    are a few 10k).

    rows int64 [m]: the logits rows; repetition/frequency/presence float32 [m];
    seen_ids int64 [m, S]: prompt and output token ids, padded with a copy of one of them;
    output_ids int64 [m, O] with output_weight float32 [m, O]: every output token (1) and padding (0);
    unique_output_ids int64 [m, U]: each output token once, padded with a copy of one of them (with
    unique_weight float32 [m, U] 0 only for a row without output)."""
    rows: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    seen_ids: torch.Tensor
    output_ids: torch.Tensor
    output_weight: torch.Tensor
    unique_output_ids: torch.Tensor
    unique_weight: torch.Tensor

    @classmethod
    def build(cls, rows: list[int], params: list, prompts: list[list[int]], outputs: list[list[int]],
              device, unique_outputs: list[list[int]] | None = None) -> "Penalties":
        """From each row's prompt and output tokens (and, when the caller keeps them, its distinct outputs)."""
        if unique_outputs is None:
            unique_outputs = [list(dict.fromkeys(out)) for out in outputs]
        seen = [list(prompt) + list(out) for prompt, out in zip(prompts, outputs)]
        seen_ids = _padded(seen, [s[0] for s in seen])
        output_ids, output_weight = _padded(outputs, [0] * len(outputs)), _weights(outputs)
        unique_ids = _padded(unique_outputs, [u[0] if u else 0 for u in unique_outputs])
        unique_weight = torch.tensor([[1.0 if u else 0.0] for u in unique_outputs])
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return cls(rows=to(torch.tensor(rows, dtype=torch.int64)),
                   repetition=to(torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)),
                   frequency=to(torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)),
                   presence=to(torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)),
                   seen_ids=to(seen_ids), output_ids=to(output_ids), output_weight=to(output_weight),
                   unique_output_ids=to(unique_ids), unique_weight=to(unique_weight))


def _padded(lists: list[list[int]], fill: list[int]) -> torch.Tensor:
    """int64 [len(lists), max(len)] (at least one column), row i padded with fill[i]."""
    width = max(1, max((len(x) for x in lists), default=0))
    return torch.tensor([list(x) + [f] * (width - len(x)) for x, f in zip(lists, fill)], dtype=torch.int64)


def _weights(lists: list[list[int]]) -> torch.Tensor:
    width = max(1, max((len(x) for x in lists), default=0))
    return torch.tensor([[1.0] * len(x) + [0.0] * (width - len(x)) for x in lists], dtype=torch.float32)


class BadWords:
    """A request's bad words (token sequences) indexed once, so a step costs a lookup per distinct word length
    instead of a pass over every word: single-token words are always banned; for longer ones, the output's last
    L tokens (for each prefix length L) are looked up among the words' prefixes."""

    __slots__ = ("words", "always", "by_prefix", "prefix_lens")

    def __init__(self, words: list[list[int]]):
        self.words = words
        always, by_prefix = [], {}
        for word in words:
            if len(word) == 1:
                always.append(word[0])
            elif word:
                by_prefix.setdefault(tuple(word[:-1]), []).append(word[-1])
        self.always = list(dict.fromkeys(always))
        self.by_prefix = by_prefix
        self.prefix_lens = sorted({len(prefix) for prefix in by_prefix})

    def __len__(self) -> int:
        return len(self.words)

    def __iter__(self):
        return iter(self.words)

    def banned(self, output_token_ids) -> list[int]:
        banned = list(self.always)
        n = len(output_token_ids)
        for prefix_len in self.prefix_lens:
            if prefix_len > n:
                break
            last = self.by_prefix.get(tuple(output_token_ids[n - prefix_len:]))
            if last:
                banned += last
        return banned


def banned_token_ids(output_token_ids, min_tokens: int, stop_token_ids, bad_words_token_ids) -> list[int]:
    """Tokens a sequence may not take next: its stop tokens (EOS, stop_token_ids) until min_tokens outputs, and
    the last token of each bad word whose other tokens end the output (bad_words_token_ids: a BadWords, or the
    words as lists, indexed here)."""
    banned = list(stop_token_ids) if len(output_token_ids) < min_tokens else []
    if bad_words_token_ids:
        if not isinstance(bad_words_token_ids, BadWords):
            bad_words_token_ids = BadWords(bad_words_token_ids)
        banned += bad_words_token_ids.banned(output_token_ids)
    return banned


class Sampler:
    """sync_free (default: on CUDA): the whole draw on the device, no value read back to the host (the stages'
    checks become masks, the fallback of a row with nothing left a `torch.where`), so a CUDA step can be queued
    ahead of the device; on CPU the host checks skip work instead (a pass over the vocabulary costs more there
    than a branch)."""

    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu", sync_free: bool | None = None,
                 fused_draw: bool = False):
        self.seed, self.device = seed, device
        self.sync_free = torch.device(device).type == "cuda" if sync_free is None else sync_free
        # The sync-free draw in one kernel (pagedkernels.sample_from_logits: the argmax, or the inverse-CDF draw at
        # the row's temperature, among the tokens min-p keeps) instead of a dozen passes of tensor ops over the
        # logits, for batches without top-k / top-p (DevicePolicy.fused_sampler).
        self.fused_draw = fused_draw
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
        drawn = self.sample(logits, meta)
        packed = drawn.packed_logprobs
        return drawn.to_lists(drawn.sampled_token_ids.tolist(), None if packed is None else packed.tolist())

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, meta) -> SampledTensors:
        """As __call__, but the draws stay on the logits' device (SampledTensors)."""
        if not isinstance(meta, SamplingMetadata):
            meta = SamplingMetadata.from_sequences(meta, logits.device, logits.shape[1])
        if logits.ndim != 2 or logits.shape[0] != len(meta.greedy):
            raise ValueError(f"logits must be [num_rows={len(meta.greedy)}, vocab_size], got {tuple(logits.shape)}")
        logits = logits.float().contiguous()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.num_logprobs is not None else None
        sampled = self.draw(logits, meta)
        if raw_logprobs is None:
            return SampledTensors(sampled)
        return SampledTensors(sampled, pack_logprobs(raw_logprobs, sampled, meta.num_logprobs), meta.num_logprobs)

    def draw(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The draw of :meth:`sample` alone: int64 [num_rows] ids on the logits' device, no logprobs. logits:
        [num_rows, vocab_size] float32, contiguous, modified in place."""
        if self.sync_free:
            return self._sample_on_device(logits, meta)
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
        return sampled

    def _sample_on_device(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The sync-free draw (see the class docstring): the same stages in the same order, every row's greedy and
        random pick computed and the right one taken per row, a dead row's fallback chosen by masks. With
        fused_draw and no row with top-k or top-p, every row takes its token from pagedkernels.sample_from_logits
        after the stages (min-p in the kernel, by a mask). A batch with top-k / top-p keeps the tensor ops: the
        kernel's threshold search ran 0.21x the candidates path on the H200 at 256 rows (1.35 against 6.51 ms:
        bench/results/2026-11-30-nvidia-h200-session4-phase15-decide.md)."""
        num_rows, vocab_size = logits.shape
        if self.fused_draw and meta.top_k is None and meta.top_p is None:
            unmasked, mask_rows, grammar_rows, grammar_bitmask = apply_stages(logits, meta)
            uniform = self._all_rows_uniform(logits, meta)
            # Every row greedy: no uniform is read (the temperatures stand in, a float32 [num_rows] at hand).
            sampled, row_max = pk_sample_from_logits(logits, meta.temperature,
                                                     uniform if uniform is not None else meta.temperature,
                                                     None, None, meta.min_p)
            fallback = _fallback_on_device(num_rows, mask_rows, unmasked, grammar_rows, grammar_bitmask, vocab_size,
                                           logits.device)
            return torch.where(row_max == float("-inf"), fallback, sampled)
        top_k = _candidate_top_k(meta, vocab_size)
        argmax, greedy, scaled, dead, fallback = self._process_on_device(logits, meta, top_k_top_p=top_k is None)
        sampled = argmax
        if scaled is not None:
            uniform = self._all_rows_uniform(logits, meta)
            if top_k is None:
                drawn = _sample_from_logits(scaled, uniform).clamp_(max=vocab_size - 1)
            else:   # every row has top-k: drawn among its candidates, no sort of the batch
                values, ids, _ = top_k_top_p_candidates(scaled, top_k, meta.top_p or [1.0] * num_rows)
                drawn = _draw_among_candidates(values, ids, uniform)
            sampled = torch.where(greedy, sampled, drawn)
        return torch.where(dead, fallback, sampled)

    def _all_rows_uniform(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
        """Every row's uniform number (None when every row is greedy: nothing is drawn)."""
        if all(meta.greedy):
            return None
        return self.uniform(logits.shape[0], logits.device, meta, list(range(logits.shape[0])))

    def _process_on_device(self, logits: torch.Tensor, meta: SamplingMetadata, top_k_top_p: bool = True):
        """The stages before a sync-free draw, in place on logits [num_rows, vocab] float32 (bias, masks,
        penalties, NaN/inf handled), without reading a value: returns (argmax [num_rows], greedy flags or None,
        the scaled logits of every row (temperature, min-p, and top-k / top-p unless `top_k_top_p` is False: the
        caller filters; None when every row is greedy), dead [num_rows]: rows with nothing left, fallback
        [num_rows]: their token)."""
        num_rows, vocab_size = logits.shape
        unmasked, mask_rows, grammar_rows, grammar_bitmask = apply_stages(logits, meta)
        _sanitize(logits)
        row_max = logits.amax(dim=-1)
        argmax = logits.argmax(dim=-1)
        greedy = scaled = None
        if not all(meta.greedy):
            greedy = _flags(meta.greedy, logits.device)
            # A greedy row divides by 1 here (its pick is the argmax anyway); a dead row's values are dropped below.
            temperature = torch.where(greedy, 1.0, meta.temperature.clamp(max=FLOAT32_MAX)).unsqueeze(1)
            scaled = logits.sub(row_max.unsqueeze(1)).div_(temperature)
            scaled.nan_to_num_(nan=float("-inf"))
            if meta.min_p is not None:
                apply_min_p(scaled, meta.min_p)
            if top_k_top_p and (meta.top_k is not None or meta.top_p is not None):
                top_k = meta.top_k if meta.top_k is not None else [0] * num_rows
                top_p = meta.top_p if meta.top_p is not None else [1.0] * num_rows
                scaled = _top_k_top_p_sorted(scaled, _as_tensor(top_k, logits.device, vocab_size),
                                             _as_tensor(top_p, logits.device))
        dead = row_max == float("-inf")
        fallback = _fallback_on_device(num_rows, mask_rows, unmasked, grammar_rows, grammar_bitmask, vocab_size,
                                       logits.device)
        return argmax, greedy, scaled, dead, fallback

    def target_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Rejection sampling's target rows (engine/worker/rejection_sampler.py) from logits [num_rows, vocab]
        (modified in place), on the device without reading a value: a greedy row's processed logits (only their
        argmax is used), a random row's probabilities after temperature, min-p and top-k / top-p, a dead row a
        point mass on its fallback token. The sync-free counterpart of process_logits + random_probs."""
        argmax, greedy, scaled, dead, fallback = self._process_on_device(logits, meta)
        probs = logits
        if scaled is not None:
            probs = torch.where(greedy.unsqueeze(1), logits, torch.softmax(scaled, dim=-1))
        point = torch.zeros_like(probs).scatter_(1, fallback.unsqueeze(1), 1.0)
        return torch.where(dead.unsqueeze(1), point, probs)

    def draw_with_probs(self, logits: torch.Tensor, meta: SamplingMetadata, random_rows: list[int],
                        random_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's draw (engine/worker/draft_model.py) from logits [num_rows, vocab] float32 (modified in
        place): (ids [num_rows], the probabilities q [len(random_rows), vocab] the random rows were drawn from, or
        None without random rows). Greedy rows take their argmax, random rows an inverse-CDF draw from q (after
        temperature, min-p, top-k / top-p), a row with nothing left its fallback (a random one's q: a point mass on
        it). ``random_index``: ``random_rows`` on the logits' device. Sync-free or with host checks, as the sampler
        draws."""
        if self.sync_free:
            argmax, _, scaled, dead, fallback = self._process_on_device(logits, meta)
            ids = torch.where(dead, fallback, argmax)
            if not random_rows:
                return ids, None
            q = torch.softmax(scaled[random_index], dim=-1)
            point = torch.zeros_like(q).scatter_(1, fallback[random_index].unsqueeze(1), 1.0)
            q = torch.where(dead[random_index].unsqueeze(1), point, q)
        else:
            logits, row_max, ids, context = process_logits(logits, meta)
            if not random_rows:
                return ids, None
            q = random_probs(logits[random_index], row_max[random_index], meta, random_rows)
            dead = set(context["dead_rows"])
            for j, row in enumerate(random_rows if dead else ()):
                if row in dead:   # its fallback (in ids already), as the sync-free path has it
                    q[j] = 0.0
                    q[j, ids[row]] = 1.0
        ids[random_index] = sample_inverse_cdf(q.clone(), self.uniform(len(random_rows), logits.device, meta,
                                                                      random_rows))
        return ids, q

    def _sample_random(self, logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata,
                       rows: list[int]) -> torch.Tensor:
        """logits [len(rows), vocab_size] of non-greedy rows `rows` (modified in place; each has a finite maximum
        row_max [len(rows)]) -> sampled ids [len(rows)]."""
        return sample_random(logits, row_max, meta, rows, self.uniform(len(rows), logits.device, meta, rows))

    def warm_up_kernels(self, logits: torch.Tensor) -> None:
        """With fused_draw, its kernels on ``logits`` (float32 ``[rows, vocab]``, as a step's) before serving, so
        that the first sampled step does not wait for Triton to compile them (ModelRunner.warm_up_kernels): the
        draw without filters and with min-p, the two launches ``_sample_on_device`` makes. Nothing is kept."""
        if not self.fused_draw:
            return
        rows = logits.shape[0]
        half = torch.full((rows,), 0.5, dtype=torch.float32, device=logits.device)
        pk_sample_from_logits(logits, half, half, None, None, None)
        pk_sample_from_logits(logits, half, half, None, None, half)

    def uniform(self, num: int, device, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        """One uniform per row; a row with its own generator draws it from that generator."""
        uniform = torch.rand(num, generator=self.generator, device=device)
        if meta.generators:
            for i, row in enumerate(rows):
                generator = meta.generators.get(row)
                if generator is not None:
                    uniform[i:i + 1].uniform_(generator=generator)
        return uniform


def plain_greedy(meta: SamplingMetadata) -> bool:
    """Every row greedy and nothing acting on its logits before the argmax (no bias, masks, penalties, grammar),
    nor logprobs asked: the draw is the argmax of the raw logits."""
    return (all(meta.greedy) and meta.logit_bias is None and meta.allowed_token_ids is None
            and meta.banned_token_ids is None and meta.penalties is None and meta.grammar_bitmask is None
            and meta.num_logprobs is None)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata):
    """The stages before the draw, in place on logits [num_rows, vocab] float32: logit_bias, grammar mask, token
    masks, penalties; then NaN/inf handled, the greedy rows' argmax and dead rows given their fallback. Returns
    (logits, row_max, ids: the argmax of greedy rows, the fallback of dead rows, 0 elsewhere, context) where
    context["dead_rows"] lists the rows that had nothing left."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    unmasked, mask_rows, grammar_rows, grammar_bitmask = apply_stages(logits, meta)
    # amax propagates NaN, so a row with a NaN or +inf anywhere has a NaN or +inf maximum: the check of these
    # num_rows values stands for a pass over the whole batch (no stage before needs clean logits: they only
    # add, mask or saturate). A -inf maximum is a row with nothing left to sample. (amax, not max, unless every row
    # is greedy: on CPU the values alone are ~6x faster than values and indices, wanted for greedy rows only.)
    all_greedy = all(meta.greedy)
    row_max, sampled = logits.max(dim=-1) if all_greedy else (logits.amax(dim=-1), None)
    dead_rows = []
    if not bool(torch.isfinite(row_max).all()):
        if bool((row_max.isnan() | (row_max == float("inf"))).any()):
            _sanitize(logits)
            row_max, sampled = logits.max(dim=-1) if all_greedy else (logits.amax(dim=-1), None)
        dead_rows = (row_max == float("-inf")).nonzero().squeeze(1).tolist()
    if not all_greedy:
        sampled = torch.zeros(num_rows, dtype=torch.int64, device=device)
        greedy_rows = [i for i, greedy in enumerate(meta.greedy) if greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=device)
            sampled[index] = logits[index].argmax(dim=-1)
    if dead_rows:
        sampled[dead_rows] = torch.tensor(
            _fallback_tokens(dead_rows, mask_rows, unmasked, grammar_rows, grammar_bitmask, vocab_size),
            device=device)
    return logits, row_max, sampled, {"dead_rows": dead_rows}


def apply_stages(logits: torch.Tensor, meta: SamplingMetadata):
    """The stages before the draw, in place on logits [num_rows, vocab] float32: logit_bias, grammar mask, token
    masks, penalties. Returns (the masked rows' logits before the token masks, those rows, the guided rows, the
    grammar bitmask over all rows): what a row left with nothing falls back on."""
    if meta.logit_bias:
        apply_logit_bias(logits, meta.logit_bias)
    grammar_rows, grammar_bitmask = [], None
    if meta.grammar_bitmask is not None:
        grammar_rows, grammar_bitmask = _apply_grammar(logits, meta.grammar_bitmask)
    mask_rows = sorted(set(meta.allowed_token_ids or ()) | set(meta.banned_token_ids or ()))
    unmasked = None
    if mask_rows:
        unmasked = logits[_as_tensor(mask_rows, logits.device)]
        apply_token_masks(logits, meta.allowed_token_ids or {}, meta.banned_token_ids or {})
    if meta.penalties is not None:
        _penalize(logits, meta.penalties)
    return unmasked, mask_rows, grammar_rows, grammar_bitmask


def _as_tensor(values: list, device, fill_zero_with: int | None = None) -> torch.Tensor:
    """A per-row list as a tensor on `device` (int64 for ints, float32 for floats), built on the host and copied
    without blocking (from pinned memory on CUDA). fill_zero_with: the value a 0 stands for (top-k's "off")."""
    dtype = torch.float32 if any(isinstance(v, float) for v in values) else torch.int64
    tensor = torch.tensor(values, dtype=dtype)
    if fill_zero_with is not None:
        tensor.masked_fill_(tensor == 0, fill_zero_with)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _flags(values: list[bool], device) -> torch.Tensor:
    return _as_tensor([int(v) for v in values], device).bool()


def _candidate_top_k(meta: SamplingMetadata, vocab_size: int) -> list[int] | None:
    """The per-row top-k of a sync-free draw among candidates (top_k_top_p_candidates), or None for the full sort:
    every random row must have top-k (a greedy row, whose pick is its argmax, needs 1 candidate), and fewer
    candidates than half the vocabulary."""
    if meta.top_k is None:
        return None
    top_k = [k if k > 0 else (1 if greedy else 0) for k, greedy in zip(meta.top_k, meta.greedy)]
    if not all(k > 0 for k in top_k) or max(top_k) * 2 >= vocab_size:
        return None
    return top_k


def _fallback_on_device(num_rows: int, mask_rows: list[int], unmasked: torch.Tensor | None, grammar_rows: list[int],
                        grammar_bitmask: torch.Tensor | None, vocab_size: int, device) -> torch.Tensor:
    """_fallback_tokens for every row at once, by masks (no value read): the argmax of the row before the token
    masks when it has a live token; else the first token the grammar allows; else 0."""
    fallback = torch.zeros(num_rows, dtype=torch.int64, device=device)
    if grammar_rows:
        on_device = grammar_bitmask.pin_memory() if torch.device(device).type == "cuda" else grammar_bitmask
        allowed = unpack_bitmask(on_device.to(device, non_blocking=True), vocab_size)   # [num_rows, vocab]
        first_allowed = allowed.to(torch.uint8).argmax(dim=-1)   # 0 where nothing is allowed: token 0 then
        fallback = first_allowed
    if mask_rows:
        index = _as_tensor(mask_rows, device)
        before = unmasked.nan_to_num(nan=float("-inf"))
        live = before.amax(dim=-1) > float("-inf")
        fallback[index] = torch.where(live, before.argmax(dim=-1), fallback[index])
    return fallback


def _scale_and_filter(logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata,
                      rows: list[int]) -> tuple[torch.Tensor, list[int] | None, list[float] | None]:
    """Temperature and min-p, in place on logits [len(rows), vocab] of non-greedy rows `rows` (processed, each
    with a finite maximum row_max); returns (logits, top_k, top_p) of those rows (None: no row uses it)."""
    device = logits.device
    index = torch.tensor(rows, device=device) if len(rows) != len(meta.greedy) else None
    # A huge temperature is clamped to the float32 range (it flattens the row instead of making
    # -inf / inf = NaN).
    temperature = meta.temperature if index is None else meta.temperature[index]
    temperature = temperature.clamp(max=FLOAT32_MAX).unsqueeze(1)
    if bool(torch.isfinite(row_max.unsqueeze(1) / temperature).all()):
        logits.div_(temperature)   # every logit <= row_max: nothing overflows to +inf
    else:
        # Shifted so the row maximum is exactly 0: a tiny temperature cannot overflow it to +inf.
        logits.sub_(row_max.unsqueeze(1)).div_(temperature)
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p if index is None else meta.min_p[index])
    top_k = [meta.top_k[r] for r in rows] if meta.top_k is not None else None
    top_p = [meta.top_p[r] for r in rows] if meta.top_p is not None else None
    filtered = (top_k and any(k > 0 for k in top_k)) or (top_p and any(p < 1.0 for p in top_p))
    return logits, (top_k or [0] * len(rows)) if filtered else None, (top_p or [1.0] * len(rows)) if filtered else None


def random_probs(logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    """Probabilities [len(rows), vocab] of non-greedy rows `rows` (logits [len(rows), vocab], processed, each with
    a finite maximum row_max): temperature, min-p, top-k / top-p, softmax."""
    logits, top_k, top_p = _scale_and_filter(logits, row_max, meta, rows)
    if top_k is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def sample_random(logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata, rows: list[int],
                  uniform: torch.Tensor) -> torch.Tensor:
    """One token per non-greedy row (see random_probs), drawn by inverse CDF with `uniform` [len(rows)]. When
    every row filters by top-k / top-p and its kept tokens are among its candidates, the draw is among the
    candidates alone (their softmax, not the vocabulary's)."""
    logits, top_k, top_p = _scale_and_filter(logits, row_max, meta, rows)
    if top_k is not None:
        if all(k > 0 or p < 1.0 for k, p in zip(top_k, top_p)):
            candidates = top_k_top_p_candidates(logits, top_k, top_p)
            if candidates is not None and (candidates[2] is None or not bool(candidates[2].any())):
                return _draw_among_candidates(candidates[0], candidates[1], uniform)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return _sample_from_logits(logits, uniform)


def _draw_among_candidates(values: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of each row among its candidates (top_k_top_p_candidates: values [num_seqs, C], -inf
    where not kept, token ids [num_seqs, C]), taken in token-id order as in the full row, so that the same uniform
    picks the same token either way. A row with nothing kept (a dead one, replaced by its fallback) gets one of
    its candidates."""
    ids, order = ids.sort(dim=-1)
    chosen = _sample_from_logits(values.gather(1, order), uniform).clamp_(max=ids.shape[1] - 1)
    return ids.gather(1, chosen.unsqueeze(1)).squeeze(1)


def _sample_from_logits(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from softmax(logits) (rows in token-id order, each with a finite maximum), on the
    unnormalized weights exp(logit - row max). A row's draw depends on its kept tokens alone: the candidate
    path (only the kept tokens) and the full row (the others exp(-inf) = 0, which add exactly nothing to the
    running sum) produce bit-identical sums, so a seeded request draws the same tokens whichever path its
    batch takes (the batch decides the path: every row must filter for the candidate one)."""
    weights = logits.sub(logits.amax(dim=-1, keepdim=True)).exp_()
    return sample_inverse_cdf(weights, uniform)


def sampler_dummy_run(logits: torch.Tensor, num_logprobs: int = 20) -> torch.Tensor:
    """The sampler's largest footprint on logits [num_seqs, vocab_size], for the memory profile: raw logprobs,
    penalties, min-p, top-k/top-p by the full sort, the draw and the top logprobs, all on, with no value read
    back to the host. Returns the sampled ids [num_seqs] (on the logits' device)."""
    logits = logits.float().clone()
    num_seqs, vocab_size = logits.shape
    device = logits.device
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    full = lambda value: torch.full((num_seqs,), value, dtype=torch.float32, device=device)  # noqa: E731
    ids = torch.zeros(num_seqs, 1, dtype=torch.int64, device=device)
    _penalize(logits, Penalties(torch.arange(num_seqs, device=device), full(1.1), full(0.1), full(0.1), ids, ids,
                                torch.ones(num_seqs, 1, device=device), ids, torch.ones(num_seqs, 1, device=device)))
    apply_min_p(logits, full(0.05))
    logits = _top_k_top_p_sorted(logits, torch.full((num_seqs,), 50, device=device), full(0.9))
    sampled = sample_inverse_cdf(torch.softmax(logits, dim=-1), torch.rand(num_seqs, device=device))
    raw_logprobs.topk(min(num_logprobs, vocab_size), dim=-1)
    return sampled


def _sanitize(logits: torch.Tensor) -> None:
    """In place: NaN -> -inf (such a token is never chosen), +inf -> the largest float32 (so that shifting
    by the row maximum stays finite)."""
    torch.nan_to_num_(logits, nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))


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
    device_bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else bitmask
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
    device = logits.device
    for row, bias in logit_bias.items():
        if isinstance(bias, tuple):   # (ids, values) tensors made once per request (the worker's SequenceState)
            ids, biases = bias
            logits[row].index_add_(0, ids.to(device), biases.to(device))
            continue
        rows += [row] * len(bias)
        cols += bias.keys()
        values += bias.values()
    if rows:
        logits.index_put_((_as_tensor(rows, device), _as_tensor(cols, device)),
                          _as_tensor([float(v) for v in values], device), accumulate=True)


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
            if isinstance(ids, torch.Tensor):   # made once per request
                keep[j, ids.to(device)] = True
                continue
            rows += [j] * len(ids)
            cols += ids
        if rows:
            keep[_as_tensor(rows, device), _as_tensor(cols, device)] = True
        index = _as_tensor(allowed_rows, device)
        logits[index] = logits[index].masked_fill_(~keep, float("-inf"))
    rows, cols = [], []
    for row, banned in banned_token_ids.items():
        banned = [t for t in banned if t < vocab_size]
        rows += [row] * len(banned)
        cols += banned
    if rows:
        logits[_as_tensor(rows, device), _as_tensor(cols, device)] = float("-inf")


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
    params = [seq.params for seq in seqs]
    _penalize(logits, Penalties.build(list(range(len(seqs))), params, [s.prompt_token_ids for s in seqs],
                                      [s.output_token_ids for s in seqs], logits.device))


def _penalize(logits: torch.Tensor, penalties: Penalties) -> None:
    """In place on logits [num_rows, vocab_size], vLLM semantics: repetition_penalty on tokens seen in the prompt
    or the output (positive logits divided, negative multiplied); frequency_penalty * count and presence_penalty
    * (count > 0) subtracted for output tokens. A finite logit stays finite (saturating at the float32 range: a
    tiny penalty divides by almost 0), a masked -inf stays -inf, NaN stays NaN. Only the rows' own tokens are
    read and written; a token listed twice gets the same value both times."""
    rows = penalties.rows.unsqueeze(1)
    seen = logits[rows, penalties.seen_ids]                                            # [m, S]
    rep = penalties.repetition.clamp(_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY).unsqueeze(1)
    penalized = torch.where(seen > 0, seen / rep, seen * rep).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
    logits[rows, penalties.seen_ids] = torch.where(seen == float("-inf"), seen, penalized)
    logits.index_put_((rows.expand_as(penalties.output_ids), penalties.output_ids),
                      -penalties.frequency.unsqueeze(1) * penalties.output_weight, accumulate=True)
    unique = logits[rows, penalties.unique_output_ids]
    logits[rows, penalties.unique_output_ids] = unique - penalties.presence.unsqueeze(1) * penalties.unique_weight


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below min_p [num_seqs] times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


# Top-p first looks for the nucleus among this many most likely tokens (one topk instead of a full-vocabulary
# sort, ~8x cheaper on CPU for a 49k vocabulary); rows whose nucleus is wider fall back to the sort.
_TOP_P_CANDIDATES = 1024


def top_k_top_p_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """What top-k (0 = off) and top-p (1.0 = off) keep of each row of logits [num_seqs, vocab], found among its
    C most likely tokens: (values [num_seqs, C], descending, -inf where not kept; their token ids [num_seqs, C];
    overflow: bool [num_seqs], rows with top-p and no top-k whose nucleus may reach past the C candidates, or
    None). C is the largest top_k, or _TOP_P_CANDIDATES where a row has top-p alone. None when C is half the
    vocabulary or more, or on CUDA where a row has top-p alone (its overflow check would be a host sync):
    `_top_k_top_p_sorted` then. Where every row has top-k no row can overflow, and the candidates are one top-k
    selection where the full sort orders the whole batch (256 rows of Qwen3's 151,936 tokens: 39M keys a step).
    vLLM semantics: a token survives top-p when the probability mass of the tokens ranked above it is below top_p."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    num_candidates = max((k if k > 0 else (_TOP_P_CANDIDATES if p < 1.0 else 1)) for k, p in zip(top_k, top_p))
    if num_candidates * 2 >= vocab_size or (logits.is_cuda and not all(k > 0 for k in top_k)):
        return None
    # The rows' parameters from pinned memory on CUDA (_as_tensor): a pageable copy would make the host wait.
    no_top_k = _flags([t == 0 for t in top_k], device).unsqueeze(1)
    k = _as_tensor([t if t > 0 else vocab_size for t in top_k], device)
    values, ids = logits.topk(num_candidates, dim=-1)                                 # [num_seqs, C], descending
    kth = values.gather(1, (k.clamp(max=num_candidates) - 1).unsqueeze(1))            # [num_seqs, 1]
    kth = kth.masked_fill(no_top_k, float("-inf"))
    values = values.masked_fill(values < kth, float("-inf"))
    overflow = None
    if any(p < 1.0 for p in top_p):
        p = _as_tensor([float(q) for q in top_p], device)
        # Normalizer of the top-k survivors: all among the candidates when top-k is on, the whole row otherwise.
        log_norm = torch.logsumexp(values, dim=-1, keepdim=True)
        if any(t == 0 and q < 1.0 for t, q in zip(top_k, top_p)):
            log_norm = torch.where(no_top_k, torch.logsumexp(logits, dim=-1, keepdim=True), log_norm)
        probs = (values - log_norm).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        keep = mass_before < p.unsqueeze(1)
        keep[:, 0] = True
        values = values.masked_fill(~keep, float("-inf"))
        # Every candidate kept and more tokens behind them: the nucleus may extend past the candidates.
        overflow = keep[:, -1] & no_top_k.squeeze(1) & (p < 1.0)
    return values, ids, overflow


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep, per row of logits [num_seqs, vocab_size], what top-k and top-p keep (see top_k_top_p_candidates);
    the rest -> -inf (in place, or a new tensor when the full sort is used: use the returned tensor)."""
    vocab_size = logits.shape[1]
    candidates = top_k_top_p_candidates(logits, top_k, top_p)
    k = torch.tensor([t if t > 0 else vocab_size for t in top_k], device=logits.device)
    p = torch.tensor(top_p, dtype=torch.float32, device=logits.device)
    if candidates is None:
        return _top_k_top_p_sorted(logits, k, p)
    values, _, overflow = candidates
    # The smallest kept value of each row: everything below it goes (nothing in a row with neither filter).
    threshold = values.masked_fill(values == float("-inf"), float("inf")).amin(dim=-1, keepdim=True)
    unfiltered = [t == 0 and q >= 1.0 for t, q in zip(top_k, top_p)]
    if any(unfiltered):
        threshold.masked_fill_(torch.tensor(unfiltered, device=logits.device).unsqueeze(1), float("-inf"))
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


def pack_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]) -> torch.Tensor:
    """Per row, in one float64 tensor [num_rows, 3 + 2 * max_k] (one host transfer for the batch; ids and ranks are
    exact in float64): the sampled id, its logprob, its 1-based rank, the top max_k logprobs, their ids."""
    max_k = max(k for k in num_logprobs if k is not None)
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))   # [num_rows, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    topk_lp, topk_ids = raw_logprobs.topk(max_k, dim=-1) if max_k > 0 else (sampled_lp[:, :0], sampled[:, None][:, :0])
    # A row of the model output with no finite logit has NaN logprobs: report its tokens as impossible (-inf).
    sampled_lp, topk_lp = sampled_lp.nan_to_num(nan=float("-inf")), topk_lp.nan_to_num(nan=float("-inf"))
    return torch.cat([sampled[:, None].double(), sampled_lp.double(), ranks[:, None].double(),
                      topk_lp.double(), topk_ids.double()], dim=1)


def unpack_logprobs(packed: list[list[float]], num_logprobs: list[int | None]) -> SamplerOutput:
    """The SamplerOutput of pack_logprobs' rows (as lists on the host; any subset of a packed batch's rows: the top
    logprobs' width, the batch's largest k, read from the rows' length)."""
    max_k = (len(packed[0]) - 3) // 2 if packed else 0
    out = SamplerOutput(sampled_token_ids=[int(row[0]) for row in packed], topk_token_ids=[], topk_logprobs=[],
                        sampled_logprobs=[], sampled_ranks=[])
    for row, k in zip(packed, num_logprobs):
        keep = k is not None
        out.topk_token_ids.append([int(t) for t in row[3 + max_k:3 + max_k + k]] if keep else None)
        out.topk_logprobs.append(row[3:3 + k] if keep else None)
        out.sampled_logprobs.append(row[1] if keep else None)
        out.sampled_ranks.append(int(row[2]) if keep else None)
    return out


# -- the draws on their way to the host --------------------------------------------------------------------------------

def _record_event():
    event = torch.cuda.Event()
    event.record()
    return event


class SampledIds:
    """The plain-sampled rows of one step, in order: `seq_ids` and their ids on the device (`ids`, int64), with the
    packed logprobs of the rows that asked (SampledTensors). `start_copy()` queues the copy to the host;
    `resolve()` waits for it (if it has not landed) and returns {seq_id: SampleLogprobs or None} after filling
    `values`. Failed rows (sampling raised for them alone) are named in `failed`: their ids are 0 and unused."""

    def __init__(self, seq_ids: list[int], device: torch.device, host_lengths: list[int] | None = None):
        self.seq_ids = seq_ids
        self.position = {seq_id: j for j, seq_id in enumerate(seq_ids)}
        # Each row's token count on the host when it sampled (where its id goes; rank 0, which samples).
        self.host_lengths = host_lengths or []
        self._device = device
        self._ids: torch.Tensor | None = None   # see `ids`
        self.parts: list[tuple[int, SampledTensors]] = []   # (first position, what one sampling call drew)
        self.failed: set[int] = set()
        self.values: list[int] | None = None
        self.logprobs: dict[int, SampleLogprobs] = {}
        self._host = None
        self._event = None

    @property
    def ids(self) -> torch.Tensor:
        """int64 [len(seq_ids)] on the device: the ids drawn so far, 0 where none was (a failed row; all of them on a
        tensor-parallel rank that receives them by broadcast)."""
        if self._ids is None:
            self._ids = torch.zeros(len(self.seq_ids), dtype=torch.int64, device=self._device)
        return self._ids

    def add(self, start: int, drawn: SampledTensors) -> None:
        """What one sampling call drew for positions start.. (the whole batch, or one row after a failure). A draw of
        every row is copied as it is (no zeros first); its tensor may be a graph's output, overwritten by the next
        replay."""
        count = drawn.sampled_token_ids.shape[0]
        if self._ids is None and start == 0 and count == len(self.seq_ids):
            self._ids = drawn.sampled_token_ids.to(dtype=torch.int64, copy=True)
        else:
            self.ids[start:start + count] = drawn.sampled_token_ids
        self.parts.append((start, drawn))

    def start_copy(self) -> None:
        """Queue the copy of the ids (and logprobs) to pinned host memory behind the sampler (CUDA); on CPU the
        values are where they are."""
        if torch.device(self._device).type != "cuda":
            return
        tensors = [self.ids] + [drawn.packed_logprobs for _, drawn in self.parts if drawn.packed_logprobs is not None]
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = _record_event()

    def resolve(self) -> None:
        """The values on the host (waiting for the copy if it has not landed yet: the one deliberate wait)."""
        if self.values is not None:
            return
        if self._event is not None:
            self._event.synchronize()
            ids, packed = self._host[0], iter(self._host[1:])
        else:
            ids, packed = self.ids, iter(drawn.packed_logprobs for _, drawn in self.parts
                                         if drawn.packed_logprobs is not None)
        self.values = ids.tolist()
        for start, drawn in self.parts:
            if drawn.packed_logprobs is None:
                continue
            rows = drawn.to_lists(self.values[start:start + drawn.sampled_token_ids.shape[0]], next(packed).tolist())
            for j, lp in enumerate(rows.sampled_logprobs):
                if lp is not None:
                    self.logprobs[self.seq_ids[start + j]] = SampleLogprobs(
                        [lp], [rows.sampled_ranks[j]], [rows.topk_token_ids[j]], [rows.topk_logprobs[j]])

    def tokens(self) -> dict[int, list[int]]:
        """{seq_id: [its sampled id]} of the rows that did not fail (after resolve())."""
        return {seq_id: [self.values[j]] for j, seq_id in enumerate(self.seq_ids) if seq_id not in self.failed}

    def fill(self, output: ModelRunnerOutput) -> None:
        """Put the resolved values into `output` (sampled ids and logprobs)."""
        self.resolve()
        output.sampled_token_ids.update(self.tokens())
        for seq_id, logprobs in self.logprobs.items():
            if seq_id not in self.failed:
                output.logprobs[seq_id] = logprobs

    def scatter_into(self, input_ids: torch.Tensor, token_index, seq_ids: list[int], to_device_many) -> None:
        """input_ids[token_index[i]] = the id sampled for seq_ids[i], on the device (no value read); token_index: ints
        (a list or an int64 array). `to_device_many`: host arrays -> device tensors in one copy
        (HostStaging.to_device_many). Every id, in order, onto every input (a decode step of the same sequences): one
        device copy, nothing from the host."""
        if len(token_index) == 0:
            return
        src = np.asarray([self.position[s] for s in seq_ids], dtype=np.int64)
        dst = np.asarray(token_index, dtype=np.int64)
        n = len(src)
        if n == len(self.seq_ids) == input_ids.shape[0] and (src == dst).all() and (src == np.arange(n)).all():
            input_ids.copy_(self.ids)
            return
        src, dst = to_device_many(src, dst)
        input_ids.index_copy_(0, dst, self.ids.index_select(0, src))


class AsyncModelRunnerOutput:
    """A step's output whose plain-sampled ids are still on their way to the host (async scheduling)."""

    def __init__(self, output: ModelRunnerOutput, sampled: SampledIds):
        self._output = output
        self._sampled = sampled

    def get_output(self) -> ModelRunnerOutput:
        """The complete ModelRunnerOutput (waits for the ids' copy if it has not landed)."""
        self._sampled.fill(self._output)
        return self._output
