"""Speculative sampling keeps the target's distribution exactly: a chi-square test over many draws on a small
vocabulary with fixed draft and target probabilities, a control that the test rejects a sampler ignoring the
draft probabilities, greedy rows that follow the argmax, and seeded rows independent of their batch."""
import numpy as np
import pytest
import torch

from engine.worker.ngram_proposer import propose_ngram
from engine.worker.rejection_sampler import (PLACEHOLDER, RejectionOutput, rejection_sample,
                                             rejection_sample_greedy)

VOCAB = 6
NUM_DRAWS = 40_000
# Target p_1, p_2, p_3 and draft q_1, q_2: unlike each other, with tokens the draft never proposes (q = 0 < p)
# and tokens the target never emits (p = 0 < q).
TARGET = torch.tensor([[0.30, 0.05, 0.20, 0.00, 0.25, 0.20],
                       [0.10, 0.40, 0.00, 0.25, 0.15, 0.10],
                       [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])
DRAFT = torch.tensor([[0.10, 0.40, 0.00, 0.30, 0.10, 0.10],
                      [0.25, 0.05, 0.30, 0.05, 0.05, 0.30]])


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) for counts against probs (cells with probability 0 must have no count)."""
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def _speculate(sampler=rejection_sample, seed: int = 0):
    """NUM_DRAWS rows, each with two drafts drawn from q_1, q_2, through `sampler`."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(DRAFT[i], NUM_DRAWS, replacement=True, generator=gen)
                          for i in range(2)], dim=1)                                   # [NUM_DRAWS, 2] ~ q
    return sampler(drafts, torch.full((NUM_DRAWS,), 2), TARGET.expand(NUM_DRAWS, 3, VOCAB),
                   DRAFT.expand(NUM_DRAWS, 2, VOCAB), torch.zeros(NUM_DRAWS, dtype=torch.bool), default_generator=gen)


def _distribution_failures(out) -> list[str]:
    """What is wrong with speculative output for drafts drawn from q: emitted tokens not distributed as p (first
    token; second given the first accepted; bonus given both), or an acceptance rate other than sum(min(p, q))
    (the rate exact speculative sampling reaches; a sampler that ignores q accepts less)."""
    failures = []
    emitted = [out.output_token_ids[:, 0], out.output_token_ids[out.num_accepted >= 1, 1],
               out.output_token_ids[out.num_accepted == 2, 2]]
    for position, tokens in enumerate(emitted):
        counts = torch.bincount(tokens, minlength=VOCAB).double()
        if tokens.numel() < 1000 or counts[TARGET[position] == 0].sum() > 0 \
                or _chi_square_p_value(counts, TARGET[position].double()) < 1e-4:
            failures.append(f"position {position}: {counts.tolist()} vs p = {TARGET[position].tolist()}")
    for position in range(2):
        rate = (out.num_accepted > position).double().mean().item()
        expected = torch.minimum(TARGET[: position + 1], DRAFT[: position + 1]).sum(-1).prod().item()
        if abs(rate - expected) > 0.01:
            failures.append(f"acceptance through position {position}: {rate:.3f}, exact sampling gives {expected:.3f}")
    return failures


def test_emitted_tokens_follow_the_target_distribution():
    assert _distribution_failures(_speculate()) == []


def test_the_test_fails_samplers_that_ignore_the_draft_probabilities():
    """Controls: drafts drawn from q accepted as if proposed deterministically (q taken as the point mass on the
    draft: still p-distributed, but accepted far less than exact sampling), and drafts accepted by p/q with the
    rejected token resampled from p instead of the residual max(0, p - q) (biased)."""
    def ignoring_q(drafts, num_drafts, target, draft_probs, greedy, **kwargs):
        return rejection_sample(drafts, num_drafts, target, None, greedy, **kwargs)

    def residual_from_p(drafts, num_drafts, target, draft_probs, greedy, *, default_generator):
        p_d = target[:, :2].gather(2, drafts[..., None]).squeeze(-1)
        q_d = draft_probs.gather(2, drafts[..., None]).squeeze(-1)
        accepted = (torch.rand(p_d.shape, generator=default_generator) * q_d < p_d).long().cumprod(1).sum(1)
        rows = torch.arange(drafts.shape[0])
        sampled = torch.multinomial(target[rows, accepted], 1, generator=default_generator).squeeze(1)  # the bug
        out = torch.where(torch.arange(2)[None] < accepted[:, None], drafts, PLACEHOLDER)
        out = torch.cat([out, torch.full_like(out[:, :1], PLACEHOLDER)], dim=1)
        out[rows, accepted] = sampled
        return RejectionOutput(out, accepted)

    assert any("acceptance" in f for f in _distribution_failures(_speculate(ignoring_q)))
    assert any("position" in f for f in _distribution_failures(_speculate(residual_from_p)))


def test_deterministic_proposals_follow_the_target_distribution():
    """An n-gram proposer's q is the point mass on its draft: acceptance p(d), residual p without d."""
    gen = torch.Generator().manual_seed(3)
    drafts = torch.tensor([[1, 3]]).expand(NUM_DRAWS, 2)
    out = rejection_sample(drafts, torch.full((NUM_DRAWS,), 2), TARGET.expand(NUM_DRAWS, 3, VOCAB), None,
                           torch.zeros(NUM_DRAWS, dtype=torch.bool), default_generator=gen)
    first = out.output_token_ids[:, 0]
    assert _chi_square_p_value(torch.bincount(first, minlength=VOCAB).double(), TARGET[0].double()) > 1e-3
    second = out.output_token_ids[out.num_accepted >= 1, 1]
    assert _chi_square_p_value(torch.bincount(second, minlength=VOCAB).double(), TARGET[1].double()) > 1e-3


def test_greedy_rows_follow_the_argmax_and_pad_the_rest():
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    drafts = torch.stack([argmax[0, :3],                                          # all three right: bonus too
                          torch.stack([argmax[1, 0], (argmax[1, 1] + 1) % 10, argmax[1, 2]]),   # wrong at 2
                          torch.tensor([(argmax[2, 0] + 1) % 10, PLACEHOLDER, PLACEHOLDER])])   # one draft, wrong
    out = rejection_sample(drafts, torch.tensor([3, 3, 1]), logits, None, torch.ones(3, dtype=torch.bool))
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.output_token_ids[0].tolist() == argmax[0].tolist()
    assert out.output_token_ids[1].tolist() == [argmax[1, 0], argmax[1, 1], PLACEHOLDER, PLACEHOLDER]
    assert out.output_token_ids[2].tolist() == [argmax[2, 0], PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]


@pytest.mark.parametrize("max_k", [0, 1, 3, 5])
def test_the_all_greedy_path_gives_the_tokens_of_rejection_sampling(max_k):
    """rejection_sample_greedy (a batch of greedy requests, from the target's picks) emits what rejection_sample
    emits for it: over many rows of 2-token vocabularies (so drafts often match) with every draft count from 0 to
    max_k, the padding past each row's drafts -1 or a stale token that would match; wrong shapes are refused."""
    gen = torch.Generator().manual_seed(max_k)
    rows = 400
    logits = torch.randn(rows, max_k + 1, 2, generator=gen)
    picks = logits.argmax(-1)
    num_drafts = torch.randint(0, max_k + 1, (rows,), generator=gen)
    drafts = torch.randint(0, 2, (rows, max_k), generator=gen)
    past = torch.arange(max_k)[None, :] >= num_drafts[:, None]
    stale = torch.rand(rows, 1, generator=gen) < 0.5   # padding that would match the pick there, or -1
    drafts = torch.where(past, torch.where(stale, picks[:, :max_k], PLACEHOLDER), drafts)
    expected = rejection_sample(drafts, num_drafts, logits, None, torch.ones(rows, dtype=torch.bool),
                                default_generator=torch.Generator().manual_seed(0))
    out = rejection_sample_greedy(drafts, num_drafts, picks)
    assert torch.equal(out.num_accepted, expected.num_accepted)
    assert torch.equal(out.output_token_ids, expected.output_token_ids)
    if max_k:
        assert 0 < int((out.num_accepted == num_drafts).sum()) < rows   # all accepted in some rows, not in all
    with pytest.raises(ValueError, match="target_token_ids must be"):
        rejection_sample_greedy(drafts, num_drafts, picks[:, :max_k])


def test_no_drafts_is_plain_sampling_and_seeded_rows_ignore_their_batch():
    probs = torch.softmax(torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    drafts = torch.tensor([[7, 8], [9, PLACEHOLDER]])

    def run(num_drafts_other: int):
        generators = [torch.Generator().manual_seed(42), None]
        out = rejection_sample(drafts, torch.tensor([2, num_drafts_other]), probs, None,
                               torch.zeros(2, dtype=torch.bool), generators=generators,
                               default_generator=torch.Generator().manual_seed(5))
        return out.output_token_ids[0].tolist()

    assert run(1) == run(0)   # row 0's tokens do not depend on row 1's draft length
    out = rejection_sample(torch.empty(4, 0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                           probs[:1, :1].expand(4, 1, 50), None, torch.zeros(4, dtype=torch.bool))
    assert out.output_token_ids.shape == (4, 1) and (out.num_accepted == 0).all()


@pytest.mark.parametrize("tokens, expected", [
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], [4, 5, 9]),          # the 3-gram 1 2 3 occurred: what followed
    ([5, 1, 2, 7, 8, 1, 2, 6, 6, 1, 2], [6, 6, 1]),     # the latest occurrence wins
    ([1, 2, 3, 4, 5, 6], []),                           # nothing repeats
    ([4, 4], [4]),                                      # only what follows exists
])
def test_ngram_proposals(tokens, expected):
    assert propose_ngram(np.array(tokens), num_speculative_tokens=3, prompt_lookup_min=1,
                         prompt_lookup_max=3) == expected


def test_ngram_prefers_the_longest_match():
    tokens = np.array([1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3])
    # The 2-gram "2 3" last occurred before 20 21, but the 3-gram "1 2 3" before 10 11: the longer match wins.
    assert propose_ngram(tokens, num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=3) == [10, 11]
    assert propose_ngram(tokens, num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2) == [20, 21]
