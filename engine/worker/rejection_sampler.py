"""Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept a prefix of proposed tokens so that the
tokens that come out are distributed exactly as the target model's own sampling would produce them.

For each request the proposer gave `k` draft tokens d_1..d_k, drawn from its distributions q_1..q_k (an n-gram or
another deterministic proposer has none: q_i is then the point mass on d_i), and the target model scored all of
them in one forward, giving the (already processed: temperature, top-k/top-p, penalties...) distributions
p_1..p_{k+1}. Walking i = 1..k:

- accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
- on the first rejection emit one token from the residual distribution norm(max(0, p_i - q_i)) and stop;
- when all k are accepted, emit a bonus token from p_{k+1}.

Every emitted token is then distributed as p (the proof: P(emit x) = min(p, q)(x) + (1 - sum min(p, q)) *
norm(max(0, p - q))(x) = p(x)). Greedy requests (temperature 0) need no probabilities: accept while d_i is the
target's argmax, then emit the argmax at the first mismatch (or the bonus position): exactly the tokens
non-speculative greedy decoding gives.

All of it is tensor work over the batch padded to the longest draft (no per-token Python loop); a seeded request
draws its uniforms and residual samples from its own generator, one call per request per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER = -1   # padding of draft_token_ids and of output_token_ids past what a request emits


@dataclass(slots=True)
class RejectionOutput:
    """output_token_ids: int64 [num_reqs, max_k + 1], the accepted drafts then the one sampled token, -1 after;
    num_accepted: int64 [num_reqs], accepted draft tokens (each request emits num_accepted + 1 tokens)."""
    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, greedy: torch.Tensor, *,
                     generators: list[torch.Generator | None] | None = None,
                     default_generator: torch.Generator | None = None,
                     num_draft_tokens_host: list[int] | None = None) -> RejectionOutput:
    """Speculative sampling for a batch.

    draft_token_ids: int64 [num_reqs, max_k], request r's drafts in [:num_draft_tokens[r]], -1 after.
    num_draft_tokens: int64 [num_reqs] (0 is a plain sampling step: one token from p_1).
    target_probs: float32 [num_reqs, max_k + 1, vocab]; row i of request r is p_{i+1} (rows past
        num_draft_tokens[r] + 1 are ignored). Greedy rows may hold logits instead: only their argmax is used.
    draft_probs: float32 [num_reqs, max_k, vocab], the proposer's q_i, or None for a deterministic proposer.
    greedy: bool [num_reqs].
    generators: per request, its own generator (seeded requests) or None for `default_generator`.
    num_draft_tokens_host: num_draft_tokens as a list, when the caller has it: seeded requests need the counts on
        the host, which would otherwise read them back from the device.
    """
    num_reqs, max_k = draft_token_ids.shape
    device = target_probs.device
    if target_probs.shape[:2] != (num_reqs, max_k + 1):
        raise ValueError(f"target_probs must be [num_reqs={num_reqs}, max_k + 1={max_k + 1}, vocab], got "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape[:2] != (num_reqs, max_k):
        raise ValueError(f"draft_probs must be [num_reqs={num_reqs}, max_k={max_k}, vocab], got "
                         f"{tuple(draft_probs.shape)}")
    positions = torch.arange(max_k, device=device)
    is_draft = positions[None, :] < num_draft_tokens[:, None]                       # [num_reqs, max_k]
    drafts = draft_token_ids.clamp(min=0)                                             # safe to gather with

    # Acceptance per draft position: greedy rows by argmax, random rows by u < p(d) / q(d).
    target_argmax = target_probs.argmax(dim=-1)                                       # [num_reqs, max_k + 1]
    greedy_accept = drafts == target_argmax[:, :max_k]
    p_draft = target_probs[:, :max_k].gather(2, drafts[..., None]).squeeze(-1)        # [num_reqs, max_k]
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.gather(2, drafts[..., None]).squeeze(-1))
    uniform = _uniform((num_reqs, max_k), device, generators, default_generator,
                       num_draft_tokens if num_draft_tokens_host is None else num_draft_tokens_host)
    random_accept = uniform * q_draft < p_draft    # u < p / q without dividing (q may be 0 where p is too)
    accept = torch.where(greedy[:, None], greedy_accept, random_accept) & is_draft
    # The accepted prefix: positions before the first rejection (cumprod of the accept flags).
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)                            # [num_reqs]

    # The one sampled token, at position num_accepted: from the residual after a rejection, from p_{k+1} (the
    # bonus) when every draft was accepted.
    rows = torch.arange(num_reqs, device=device)
    p_final = target_probs[rows, num_accepted]                                        # [num_reqs, vocab]
    rejected = num_accepted < num_draft_tokens
    residual = p_final
    if max_k:
        at = num_accepted.clamp(max=max_k - 1)   # the rejected position (only used where rejected)
        if draft_probs is None:                  # q is the point mass on the rejected draft: zero its p
            q_final = torch.zeros_like(p_final)
            q_final.scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)   # (an index_put here waits for the device)
        else:
            q_final = draft_probs[rows, at]
        residual = torch.where(rejected[:, None], (p_final - q_final).clamp(min=0.0), p_final)
    # A residual with no mass (p <= q everywhere can only happen through rounding, since a rejection needs
    # p(d) < q(d)) falls back to p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_final, residual)
    sampled = _sample(residual, device, generators, default_generator)
    sampled = torch.where(greedy, target_argmax[rows, num_accepted], sampled)

    output = torch.full((num_reqs, max_k + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    emitted = torch.arange(max_k + 1, device=device)[None, :] < num_accepted[:, None]
    output[:, :max_k] = torch.where(emitted[:, :max_k], drafts, output[:, :max_k])
    output[rows, num_accepted] = sampled
    return RejectionOutput(output_token_ids=output, num_accepted=num_accepted)


def rejection_sample_greedy(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                            target_token_ids: torch.Tensor) -> RejectionOutput:
    """:func:`rejection_sample` for a batch whose every request is greedy, from the target's own picks
    ``target_token_ids`` int64 [num_reqs, max_k + 1] (the sampler's greedy draw of each of the k + 1 rows: its
    argmax, or a row's fallback where nothing was left): drafts accepted while each is the target's pick, then the
    pick at the first mismatch (or the bonus position) emitted. The same tokens rejection_sample gives such a batch,
    in a handful of small ops: no probabilities over the vocabulary, no random draw (on a GPU, about 25 launches
    fewer a verification step, each one the host waits on before the step's read)."""
    num_reqs, max_k = draft_token_ids.shape
    if target_token_ids.shape != (num_reqs, max_k + 1):
        raise ValueError(f"target_token_ids must be [num_reqs={num_reqs}, max_k + 1={max_k + 1}], got "
                         f"{tuple(target_token_ids.shape)}")
    positions = torch.arange(max_k + 1, device=target_token_ids.device)
    accept = (draft_token_ids == target_token_ids[:, :max_k]) & (positions[None, :max_k] < num_draft_tokens[:, None])
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    # The accepted drafts are the target's picks at their positions, and the emitted token its pick after them.
    output = torch.where(positions[None, :] <= num_accepted[:, None], target_token_ids, PLACEHOLDER)
    return RejectionOutput(output_token_ids=output, num_accepted=num_accepted)


def _uniform(shape: tuple[int, int], device, generators, default_generator,
             num_draft_tokens: torch.Tensor | list[int]) -> torch.Tensor:
    """Uniforms in [0, 1): a request with its own generator draws exactly one per draft token from it, so its
    stream does not depend on the other requests' draft lengths."""
    uniform = torch.rand(shape, device=device, generator=default_generator)
    if generators and any(g is not None for g in generators):
        counts = num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor) else num_draft_tokens
        for row, (generator, k) in enumerate(zip(generators, counts)):
            if generator is not None and k:
                uniform[row, :k].uniform_(generator=generator)
    return uniform


def _sample(probs: torch.Tensor, device, generators, default_generator) -> torch.Tensor:
    """One draw per row of unnormalized probs [num_reqs, vocab] by inverse CDF (the sampler's way)."""
    from engine.worker.sampler import sample_inverse_cdf

    uniform = torch.rand(probs.shape[0], device=device, generator=default_generator)
    for row, generator in enumerate(generators or ()):
        if generator is not None:
            uniform[row:row + 1].uniform_(generator=generator)
    return sample_inverse_cdf(probs.clone(), uniform)
