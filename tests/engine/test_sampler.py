"""Sampler semantics on crafted logits: each SamplingParams field that acts on the distribution, seeded
reproducibility independent of the batch, logprobs of the raw logits."""
import pytest
import torch

from engine.worker.sampler import Sampler, _top_k_top_p_sorted, apply_penalties, apply_top_k_top_p, sample_inverse_cdf
from engine.sampling_params import SamplingParams
from engine.core.scheduler import new_sequence_data
from engine.core.sequence import Sequence
from engine.worker.input_batch import SequenceState
from tests.engine.sampler_paths import sampler_path  # noqa: F401 (autouse: every test on both paths)

VOCAB = 12


def seq_with(params: SamplingParams, prompt=(1, 2, 3), output=(), eos=frozenset({11})) -> SequenceState:
    """A sequence as the worker's sampler sees it: the core's Sequence, sent in full."""
    seq = Sequence("r", None, list(prompt), params, arrival_time=0.0, eos_token_ids=eos)
    for t in output:
        seq.append_token(t)
    return SequenceState.from_new(new_sequence_data(seq, 0))


def random_logits(num_rows, seed=0, vocab=VOCAB):
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def empirical(tokens, vocab=VOCAB):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def test_greedy_rows_take_argmax_next_to_random_rows():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = Sampler(seed=1)(logits.clone(), [seq_with(p) for p in params])
    expected = logits.argmax(-1).tolist()
    assert [out.sampled_token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature):
    row = random_logits(1, seed=3)
    n = 4000
    out = Sampler(seed=2)(row.expand(n, VOCAB), [seq_with(SamplingParams(temperature=temperature))] * n)
    expected = torch.softmax(row[0] / temperature, -1)
    assert (empirical(out.sampled_token_ids) - expected).abs().sum() < 0.08


def test_top_k_keeps_only_k_largest():
    row = random_logits(1, seed=4)
    n = 3000
    out = Sampler(seed=3)(row.expand(n, VOCAB), [seq_with(SamplingParams(top_k=3))] * n)
    top3 = set(row[0].topk(3).indices.tolist())
    assert set(out.sampled_token_ids) == top3
    expected = torch.zeros(VOCAB)
    expected[list(top3)] = torch.softmax(row[0, list(top3)], -1)
    assert (empirical(out.sampled_token_ids) - expected).abs().sum() < 0.08


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.05] + [0.0] * 6) + 1e-9
    row = probs.log().unsqueeze(0)
    n = 3000
    out = Sampler(seed=4)(row.expand(n, VOCAB), [seq_with(SamplingParams(top_p=0.7))] * n)
    assert set(out.sampled_token_ids) == {0, 1, 2}   # 0.4 + 0.25 < 0.7 <= 0.8


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.5, 0.2, 0.1, 0.09] + [0.11 / 8] * 8)
    row = probs.log().unsqueeze(0)
    n = 3000
    out = Sampler(seed=5)(row.expand(n, VOCAB), [seq_with(SamplingParams(min_p=0.19))] * n)
    assert set(out.sampled_token_ids) == {0, 1, 2}   # kept: p >= 0.19 * 0.5


def test_top_k_top_p_per_row_in_one_batch():
    logits = random_logits(3, seed=6)
    out = apply_top_k_top_p(logits.clone(), [2, 0, 5], [1.0, 0.5, 1.0])
    kept = torch.isfinite(out)
    assert kept[0].sum() == 2 and kept[2].sum() == 5
    probs = torch.softmax(logits[1], -1).sort(descending=True).values
    assert kept[1].sum() == int((probs.cumsum(0) < 0.5).sum()) + 1
    assert torch.equal(out[kept], logits[kept])


def test_top_k_top_p_candidate_path_equals_full_sort():
    """Vocabulary large enough for the topk-candidate path; rows cover: off, top-k only, top-p only (narrow and
    wider than the candidates, which falls back to the sort), both."""
    vocab = 6000
    gen = torch.Generator().manual_seed(10)
    scales = torch.tensor([3.0, 3.0, 3.0, 0.05, 3.0, 2.0, 0.05, 3.0]).unsqueeze(1)   # 0.05: nearly flat rows
    logits = torch.randn(8, vocab, generator=gen) * scales
    top_k = [0, 7, 0, 0, 50, 300, 0, 1]
    top_p = [1.0, 1.0, 0.9, 0.95, 0.8, 0.99, 0.3, 0.5]
    fast = apply_top_k_top_p(logits.clone(), top_k, top_p)
    k = torch.tensor([t if t > 0 else vocab for t in top_k])
    reference = _top_k_top_p_sorted(logits.clone(), k, torch.tensor(top_p))
    assert torch.equal(torch.isfinite(fast), torch.isfinite(reference))
    kept = torch.isfinite(fast).sum(-1).tolist()
    assert kept[0] == vocab and kept[1] == 7 and kept[7] == 1 and kept[3] > 1024   # row 3 used the fallback
    assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])


def test_inverse_cdf_never_picks_zero_probability_tokens():
    probs = torch.zeros(4, VOCAB)
    probs[:, 3], probs[:, 7] = 0.25, 0.75
    uniform = torch.tensor([0.0, 0.2499, 0.25, 1.0 - 2 ** -24])
    assert sample_inverse_cdf(probs.clone(), uniform).tolist() == [3, 3, 7, 7]


def test_seeded_request_independent_of_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = random_logits(1, seed=7)

    def run(batch_builder, steps=6):
        seq = seq_with(params)
        sampler = Sampler(seed=99)
        tokens = []
        for step in range(steps):
            others = batch_builder(step)
            batch_logits = logits.clone()
            if others:
                batch_logits = torch.cat([random_logits(len(others), seed=100 + step), logits])
            tokens.append(sampler(batch_logits, others + [seq]).sampled_token_ids[-1])
        return tokens

    alone = run(lambda step: [])
    crowded = run(lambda step: [seq_with(SamplingParams(temperature=0.8)) for _ in range(step + 1)]
                  + [seq_with(SamplingParams(temperature=0.9, seed=step))])
    assert alone == crowded
    assert len(set(alone)) > 1   # really random, not a constant
    other_seed = seq_with(SamplingParams(temperature=1.0, seed=4321))
    sampler = Sampler(seed=99)
    assert [sampler(logits.clone(), [other_seed]).sampled_token_ids[0] for _ in range(6)] != alone


def test_seeded_top_k_draw_independent_of_the_batchs_path(sampler_path):
    """A top-k row alone (every row filters: the draw among its candidates) and beside an unfiltered row (the
    draw over the full row) draws the same token from the same uniform, for many seeds (the candidates must be
    ordered as the vocabulary for that: a descending-order draw disagreed in about half the steps)."""
    vocab = 4096   # big enough for the candidate path (top_k * 2 < vocab)
    logits = random_logits(1, seed=11, vocab=vocab)
    other = random_logits(1, seed=12, vocab=vocab)
    differ = []
    # (the fused path's kernel draws both ways, interpreted: fewer seeds)
    for seed in range(40 if sampler_path != "fused" else 8):
        params = SamplingParams(temperature=0.8, top_k=50, seed=seed)
        alone = Sampler(seed=0)(logits.clone(), [seq_with(params)]).sampled_token_ids[0]
        mixed = Sampler(seed=0)(torch.cat([other, logits]), [seq_with(SamplingParams(temperature=1.0)),
                                                              seq_with(params)]).sampled_token_ids[1]
        differ.append(alone != mixed)
        assert alone in logits[0].topk(50).indices.tolist()
    assert not any(differ), differ


def test_seeded_unfiltered_draw_independent_of_a_filtering_neighbour():
    """A seeded row without min-p / top-k / top-p draws the same tokens alone and beside rows that filter (on the
    fused path: the kernel draws every row, its filters per row), for many seeds."""
    vocab = 300
    logits = random_logits(1, seed=21, vocab=vocab)
    others = random_logits(2, seed=22, vocab=vocab)
    filtering = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.1, min_p=0.1, top_k=40)]
    alone, beside = [], []
    for seed in range(24):
        params = SamplingParams(temperature=0.8, seed=seed)
        alone.append(Sampler(seed=0)(logits.clone(), [seq_with(params)]).sampled_token_ids[0])
        out = Sampler(seed=0)(torch.cat([others, logits]), [seq_with(p) for p in filtering] + [seq_with(params)])
        beside.append(out.sampled_token_ids[2])
    assert alone == beside
    assert len(set(alone)) > 3


def reference_penalties(logits, prompt, output, rep, pres, freq):
    out = logits.clone()
    for t in range(logits.shape[0]):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + pres * (count > 0)
    return out


def test_penalties_match_vllm_semantics():
    logits = random_logits(3, seed=8)
    cases = [((1, 2, 3), (3, 3, 5), 1.3, 0.5, 0.25), ((4, 4), (6,), 0.7, -0.5, 0.0),
             ((0,), (0, 0, 0, 9), 1.0, 0.0, 1.5)]
    seqs = [seq_with(SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f), prompt=pr, output=o)
            for pr, o, r, p, f in cases]
    got = logits.clone()
    apply_penalties(got, seqs)
    for i, (pr, o, r, p, f) in enumerate(cases):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], list(pr), list(o), r, p, f))


def test_presence_penalty_changes_greedy_choice_only_for_output_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.5
    prompt_only = seq_with(SamplingParams(temperature=0, presence_penalty=2.0), prompt=(5,))
    in_output = seq_with(SamplingParams(temperature=0, presence_penalty=2.0), output=(5,))
    out = Sampler()(logits.repeat(2, 1), [prompt_only, in_output])
    assert out.sampled_token_ids == [5, 6]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(3, VOCAB)
    logits[:, 11] = 10.0   # EOS
    logits[:, 7] = 9.0     # a stop token id
    logits[:, 2] = 1.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    seqs = [seq_with(p, output=()), seq_with(p, output=(1, 1)),
            seq_with(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True))]
    assert Sampler()(logits.clone(), seqs).sampled_token_ids == [2, 11, 11]   # ignore_eos: EOS is an ordinary token


def test_logprobs_are_raw_log_softmax_and_include_sampled_token():
    logits = random_logits(3, seed=9)
    params = [SamplingParams(temperature=2.0, logprobs=3, repetition_penalty=1.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, logprobs=0, seed=3)]
    out = Sampler(seed=5)(logits.clone(), [seq_with(p) for p in params])
    ref = torch.log_softmax(logits, -1)
    for i in (0, 2):
        token = out.sampled_token_ids[i]
        assert out.sampled_logprobs[i] == pytest.approx(ref[i, token].item(), abs=1e-6)
        assert out.sampled_ranks[i] == int((ref[i] > ref[i, token]).sum()) + 1
    assert out.topk_token_ids[0] == ref[0].topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor(out.topk_logprobs[0]), ref[0].topk(3).values)
    assert out.topk_token_ids[1] is None and out.topk_token_ids[2] == []


def test_a_draft_draw_with_its_probabilities():
    """Sampler.draw_with_probs (a draft model's draw: engine/worker/draft_model.py), on both sampler paths: a greedy
    row takes its argmax; a random row (top-p) is drawn from the q it returns, which is its temperature-scaled,
    top-p-filtered softmax; a row with nothing left (every logit -inf), greedy or random, takes its fallback (token
    0), and a random one's q is a point mass there."""
    from engine.worker.sampler import SamplingMetadata

    vocab = 32
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 3
    logits[2] = float("-inf")
    logits[3] = float("-inf")
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 0.8, 0.7, 0.0]), greedy=[True, False, False, True],
                            top_p=[1.0, 0.9, 1.0, 1.0])
    random_rows = [1, 2]
    draws, probs = [], []
    for _ in range(200):
        ids, q = Sampler(seed=len(draws)).draw_with_probs(
            logits.clone(), meta, random_rows, torch.tensor(random_rows))
        draws.append(ids)
        probs.append(q)
    ids = torch.stack(draws)
    assert (ids[:, 0] == logits[0].argmax()).all() and (ids[:, 2] == 0).all() and (ids[:, 3] == 0).all()
    q = probs[0]
    assert all(torch.equal(p, q) for p in probs)   # q does not depend on the draw
    expected = torch.softmax(logits[1] / 0.8, dim=-1)
    order = expected.argsort(descending=True)
    keep = order[:int((expected[order].cumsum(0) < 0.9).sum()) + 1]   # the smallest set reaching 0.9
    top_p = torch.zeros(vocab)
    top_p[keep] = expected[keep] / expected[keep].sum()
    torch.testing.assert_close(q[0], top_p)
    assert torch.equal(q[1], torch.nn.functional.one_hot(torch.tensor(0), vocab).float())
    # the random row's draws come from q: only its kept tokens, the likeliest most often
    assert set(ids[:, 1].tolist()) <= set(keep.tolist()) and len(set(ids[:, 1].tolist())) > 1
    assert torch.bincount(ids[:, 1], minlength=vocab).argmax() == order[0]
