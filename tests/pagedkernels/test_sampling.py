"""sample_from_logits against a float64 oracle of the inverse-CDF draw, the Triton kernel and the PyTorch twin."""

import importlib

import pytest
import torch

import pagedkernels as pk
from pagedkernels._backend import interpreter_active

sampling = importlib.import_module("pagedkernels.sampling")

BACKENDS = ["triton", "torch"]
BLOCK = sampling._BLOCK
# Under one block, a few blocks with a ragged last one (the draw's search crosses blocks).
VOCABS = [97, 2 * BLOCK + 37]
FLOAT32_MAX = torch.finfo(torch.float32).max


def skip_bf16_interpreter(backend: str, dtype: torch.dtype, device: str) -> None:
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def oracle_cdf(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (weights, normalized cdf) of each row: exp((x - max) / T) after the clean-up."""
    x = torch.nan_to_num(logits.double().cpu(), nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))
    t = temperature.double().cpu().clamp(max=FLOAT32_MAX).unsqueeze(1)
    weights = ((x - x.amax(dim=-1, keepdim=True)) / t).exp()
    cdf = weights.cumsum(dim=-1)
    return weights, cdf / cdf[:, -1:]


def assert_valid_draws(ids, logits, temperature, uniform, tol=1e-5):
    """Each id has weight > 0 and its cdf interval holds the uniform (within float32 rounding)."""
    weights, cdf = oracle_cdf(logits, temperature)
    ids = ids.cpu()
    for row, token in enumerate(ids.tolist()):
        u = float(uniform[row])
        assert weights[row, token] > 0, f"row {row}: token {token} has weight 0"
        below = float(cdf[row, token - 1]) if token > 0 else 0.0
        assert below - tol <= u <= float(cdf[row, token]) + tol, (row, token, below, u, float(cdf[row, token]))


def near_a_boundary(logits, temperature, uniform, tol=1e-5) -> torch.Tensor:
    """Rows whose uniform lies within `tol` of a boundary between two tokens' cdf intervals."""
    _, cdf = oracle_cdf(logits, temperature)
    return ((cdf - uniform.double().cpu().unsqueeze(1)).abs() < tol).any(dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", VOCABS)
def test_draws_follow_the_inverse_cdf(backend, device, dtype, vocab):
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(vocab)
    num_rows = 12
    logits = (torch.randn(num_rows, vocab, generator=g) * 3.0).to(dtype)
    # Masked tokens (-inf) and NaNs: never drawn. Row 3 has one live token, far into the row.
    logits[:, ::7] = float("-inf")
    logits[1, 5::11] = float("nan")
    logits[3] = float("-inf")
    logits[3, vocab - 2] = 0.5
    temperature = torch.tensor([0.7, 1.0, 2.5, 1.0, 0.05, 1e-20, float("inf"), 1.3, 0.9, 1.0, 3.0, 0.4])
    uniform = torch.rand(num_rows, generator=g)
    uniform[0], uniform[9] = 0.0, 1.0 - 2**-24   # the first live token; the last one
    # Rows with a stride wider than the vocabulary (a slice of a bigger buffer) whose padding is +inf: never read.
    buffer = torch.full((num_rows, vocab + 9), float("inf"), dtype=dtype)
    buffer[:, :vocab] = logits
    logits = buffer.to(device)[:, :vocab]
    temperature, uniform = temperature.to(device), uniform.to(device)
    before = logits.clone()
    with pk.use_backend(backend):
        ids, row_max = pk.sample_from_logits(logits, temperature, uniform)
    assert ids.dtype == torch.int64 and row_max.dtype == torch.float32
    assert torch.equal(logits.cpu(), before.cpu()) or torch.isnan(before).any()   # not modified
    assert_valid_draws(ids, logits, temperature, uniform)
    assert ids[3].item() == vocab - 2
    clean = torch.nan_to_num(logits.float().cpu(), nan=float("-inf"))
    torch.testing.assert_close(row_max.cpu(), clean.amax(dim=-1), rtol=0, atol=0)
    # The kernel and the twin draw the same tokens but within rounding of a boundary.
    with pk.use_backend("torch"):
        twin_ids, _ = pk.sample_from_logits(logits, temperature, uniform)
    same = ids.cpu() == twin_ids.cpu()
    assert bool((same | near_a_boundary(logits, temperature, uniform)).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_rows_take_the_first_maximum(backend, device, dtype):
    vocab = 2 * BLOCK + 37
    logits = torch.zeros(6, vocab, dtype=dtype)
    logits[0, [5, BLOCK + 3, 2 * BLOCK + 1]] = 2.0           # a tie across blocks: the first
    logits[1, [BLOCK + 9, BLOCK + 10]] = 4.0                  # a tie within a block
    logits[2, 7] = float("nan")
    logits[2, 2 * BLOCK + 30] = 1.0                           # NaN is never the maximum
    logits[3, [11, BLOCK + 2]] = float("inf")                 # +inf counts as the largest float32: the first
    logits[4] = float("-inf")                                 # nothing to draw: id 0, row max -inf
    logits[5, vocab - 1] = 1.0                                # in the ragged last block
    temperature = torch.zeros(6)
    temperature[4] = 0.8   # a sampling row with nothing to draw: the argmax all the same
    uniform = torch.full((6,), 0.5)
    with pk.use_backend(backend):
        ids, row_max = pk.sample_from_logits(logits.to(device), temperature.to(device), uniform.to(device))
    assert ids.cpu().tolist() == [5, BLOCK + 9, 2 * BLOCK + 30, 11, 0, vocab - 1]
    assert row_max.cpu().tolist()[3] == FLOAT32_MAX and row_max[4].item() == float("-inf")


def stratified_counts(row, temperature, num_draws, backend, device):
    """(each token's count, its float64 probability) over ``num_draws`` draws from ``row`` at ``temperature``, the
    uniform numbers swept evenly over [0, 1): a token's count is then within one draw of probability x num_draws."""
    logits = row.expand(num_draws, row.numel()).contiguous()
    temperatures = torch.full((num_draws,), temperature)
    uniform = (torch.arange(num_draws, dtype=torch.float64) + 0.5).div(num_draws).float()
    with pk.use_backend(backend):
        ids, _ = pk.sample_from_logits(logits.to(device), temperatures.to(device), uniform.to(device))
    counts = torch.bincount(ids.cpu(), minlength=row.numel()).double()
    return counts, torch.softmax(row.double() / temperature, dim=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draw_frequencies_are_the_probabilities(backend, device):
    """A stratified sweep of the uniform over one row: each token is drawn in proportion to its probability
    (within one draw of the exact count), and the zero-weight ones never."""
    vocab, num_draws = 50, 1000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=g) * 2.0
    row[[3, 17, 49]] = float("-inf")
    counts, probs = stratified_counts(row, 0.8, num_draws, backend, device)
    assert (counts - probs * num_draws).abs().max() <= 1.0 + 1e-9
    assert counts[[3, 17, 49]].sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_draw_frequencies_across_blocks(backend, device):
    """The same sweep over a row of three blocks whose maxima differ (the unfiltered draw sums each block relative to
    its own maximum, then rescales the sums to the row's): every token drawn within one draw of its exact count,
    each block's share of the draws its probability mass's."""
    vocab, num_draws = 2 * BLOCK + 37, 300
    g = torch.Generator().manual_seed(1)
    row = torch.rand(vocab, generator=g) * 0.5
    row[:BLOCK] -= 1.0   # block 0 lower, block 1 higher, block 2 (ragged) between
    row[BLOCK:2 * BLOCK] += 0.7
    row[::5] = float("-inf")
    counts, probs = stratified_counts(row, 0.9, num_draws, backend, device)
    assert (counts - probs * num_draws).abs().max() <= 1.0 + 1e-9
    assert counts[::5].sum() == 0
    for block in range(3):
        part = slice(block * BLOCK, (block + 1) * BLOCK)
        assert abs(counts[part].sum() - probs[part].sum() * num_draws) <= 1.0 + 1e-9


@pytest.mark.parametrize("backend", ["triton"])
def test_a_vocabulary_past_the_block_limit_draws_in_one_program_a_row(backend, device, monkeypatch):
    """Past _MAX_CHUNKS blocks a row (4M tokens) the unfiltered draw takes the filtered kernel's one program a row,
    its filters off: the same draws (within rounding of a boundary) and argmax."""
    monkeypatch.setattr(sampling, "_MAX_CHUNKS", 1)
    vocab = 2 * BLOCK + 37
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, vocab, generator=g) * 2.0
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.3, 1.0])
    uniform = torch.rand(6, generator=g)
    with pk.use_backend(backend):
        ids, row_max = pk.sample_from_logits(logits.to(device), temperature.to(device), uniform.to(device))
    assert_valid_draws(ids, logits, temperature.clamp(min=1e-30), uniform)
    assert ids[0].item() == int(logits[0].argmax())
    with pk.use_backend("torch"):
        twin_ids, twin_max = pk.sample_from_logits(logits, temperature, uniform)
    assert bool(((ids.cpu() == twin_ids) | near_a_boundary(logits, temperature, uniform)).all())
    torch.testing.assert_close(row_max.cpu(), twin_max, rtol=0, atol=0)

def oracle_kept(logits, temperature, top_k, top_p, tol=1e-5, min_p=None):
    """float64 (kept [rows, vocab] bool, weights, unsure [rows] bool) of vLLM's min-p, then top-k, then top-p: min-p
    drops the tokens whose weight is below min_p times the maximum's, top-k keeps the tokens with fewer than k tokens
    above them, top-p of those the ones whose weight above them is below p times the top-k survivors' weight.
    `unsure`: rows where a token's weight, or the weight above it, is within `tol` (relative) of its bound, where
    float32's sums may decide either way."""
    x = torch.nan_to_num(logits.double().cpu(), nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))
    t = temperature.double().cpu().clamp(max=FLOAT32_MAX).unsqueeze(1)
    weights = ((x - x.amax(dim=-1, keepdim=True)) / t).exp().nan_to_num(nan=0.0)
    near_min_p = torch.zeros(x.shape[0], dtype=torch.bool)
    if min_p is not None:
        m = min_p.double().cpu().unsqueeze(1)
        near_min_p = ((m > 0) & ((weights - m).abs() <= tol * m)).any(dim=-1)
        x = x.masked_fill(weights < m, float("-inf"))
        weights = weights.masked_fill(weights < m, 0.0)
    live = x > float("-inf")
    values, order = x.sort(dim=-1, descending=True)
    # Tokens above each one: the position of its value's first occurrence in descending order.
    above_count = torch.empty_like(order).scatter_(
        1, order, x.size(1) - torch.searchsorted(values.flip(-1).contiguous(), values, right=True))
    k = top_k.cpu().unsqueeze(1)
    kept = live & ((k <= 0) | (k >= live.sum(dim=-1, keepdim=True)) | (above_count < k))
    kept_weights = torch.where(kept, weights, 0.0)
    sorted_weights = kept_weights.gather(1, order)
    exclusive = sorted_weights.cumsum(dim=-1) - sorted_weights       # kept weight before each, descending
    above_mass = exclusive.gather(1, above_count)                     # before its value's first occurrence
    bound = top_p.double().cpu().unsqueeze(1) * kept_weights.sum(dim=-1, keepdim=True)
    filtered = top_p.cpu().unsqueeze(1) < 1.0
    unsure = (filtered & kept & ((above_mass - bound).abs() <= tol * bound)).any(dim=-1) | near_min_p
    kept &= ~filtered | (above_mass < bound) | (above_count == 0)   # the maximum always stays
    return kept, torch.where(kept, weights, 0.0), unsure


def filter_rows(vocab: int, dtype, generator) -> tuple[torch.Tensor, ...]:
    """Rows that exercise top-k and top-p: both, either, neither, k = 1, k past the live tokens, ties at the k-th
    value, a tiny and a huge temperature, masked and NaN tokens, a dead row, a greedy row with filters."""
    rows = 14
    logits = (torch.randn(rows, vocab, generator=generator) * 3.0).to(dtype)
    logits[:, ::7] = float("-inf")
    logits[1, 5::11] = float("nan")
    logits[5, [4, 40, vocab - 3]] = 30.0           # three tied at the top: top-k 2 keeps all three
    logits[6] = float("-inf")
    logits[6, [2, vocab // 2, vocab - 1]] = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)   # 3 live; top-k 10: off
    logits[12] = float("-inf")                     # nothing to draw
    temperature = torch.tensor([0.7, 1.0, 2.5, 0.6, 0.05, 1.0, 1.0, 3.0, 0.4, 1e-20, float("inf"), 1.0, 1.0, 0.0])
    top_k = torch.tensor([0, 20, 1, 50, 5, 2, 10, 3000, 0, 7, 0, vocab, 4, 3])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 1.0, 0.8, 0.99, 0.3, 0.5, 0.5, 0.9, 1e-6, 0.5])
    return logits, temperature, top_k, top_p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_top_p_draw_among_the_kept_tokens(backend, device, dtype, vocab):
    skip_bf16_interpreter(backend, dtype, device)
    g = torch.Generator().manual_seed(vocab + 1)
    logits, temperature, top_k, top_p = filter_rows(vocab, dtype, g)
    uniform = torch.rand(logits.shape[0], generator=g)
    uniform[0], uniform[3] = 0.0, 1.0 - 2**-24
    # min-p on a few rows: alone, and before top-k / top-p
    min_p = torch.zeros(logits.shape[0])
    min_p[[0, 3, 8, 11]] = torch.tensor([0.05, 0.2, 0.01, 0.5])
    args = [t.to(device) for t in (logits, temperature, uniform, top_k, top_p, min_p)]
    with pk.use_backend(backend):
        ids, row_max = pk.sample_from_logits(*args)
    checks = [(top_k, top_p, ids, min_p)]
    if vocab < BLOCK:   # (the interpreter's time) int32 top-k, and one of the two filters alone: the other is off
        with pk.use_backend(backend):
            ids32, _ = pk.sample_from_logits(*args[:3], args[3].int(), args[4], args[5])
            only_k, _ = pk.sample_from_logits(*args[:3], top_k=args[3])
            only_p, _ = pk.sample_from_logits(*args[:3], top_p=args[4])
            only_min_p, _ = pk.sample_from_logits(*args[:3], min_p=args[5])
        assert torch.equal(ids.cpu(), ids32.cpu())
        checks += [(top_k, torch.ones_like(top_p), only_k, None), (torch.zeros_like(top_k), top_p, only_p, None),
                   (torch.zeros_like(top_k), torch.ones_like(top_p), only_min_p, min_p)]
    for k, p, drawn, m in checks:
        kept, weights, unsure = oracle_kept(logits, temperature, k, p, min_p=m)
        cdf = weights.cumsum(dim=-1)
        cdf = cdf / cdf[:, -1:].clamp(min=1e-300)
        for row, token in enumerate(drawn.cpu().tolist()):
            if temperature[row] == 0 or row == 12 or unsure[row]:
                continue
            assert kept[row, token], (row, token, int(kept[row].sum()))
            below = float(cdf[row, token - 1]) if token > 0 else 0.0
            assert below - 1e-5 <= float(uniform[row]) <= float(cdf[row, token]) + 1e-5, (row, token)
    assert ids[13].item() == int(torch.nan_to_num(logits[13].float(), nan=float("-inf")).argmax())   # greedy
    assert ids[2].item() == int(torch.nan_to_num(logits[2].float(), nan=float("-inf")).argmax())      # top-k 1
    assert ids[12].item() == 0 and row_max[12].item() == float("-inf")
    assert int(oracle_kept(logits, temperature, top_k, top_p)[0][5].sum()) == 3   # the tie at the k-th value
    # The kernel and the twin agree but within rounding of a boundary.
    with pk.use_backend("torch"):
        twin, _ = pk.sample_from_logits(*args)
    kept, weights, unsure = oracle_kept(logits, temperature, top_k, top_p, min_p=min_p)
    cdf = weights.cumsum(dim=-1) / weights.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    near = ((cdf - uniform.double().unsqueeze(1)).abs() < 1e-5).any(dim=-1)
    assert bool(((ids.cpu() == twin.cpu()) | near | unsure).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_top_p_frequencies(backend, device):
    """A stratified sweep of the uniform: each kept token in proportion to its renormalized probability (within one
    draw), the others never; ties at the k-th value stay together."""
    # The interpreter runs a program per draw: fewer draws there (the twin's thousand check the same bound).
    vocab, num_draws = 300, (32 if backend == "triton" and device == "cpu" else 1000)
    g = torch.Generator().manual_seed(1)
    row = torch.randn(vocab, generator=g) * 2.0
    order = row.argsort(descending=True)
    row[order[5]] = row[order[4]]   # the 5th and 6th tie
    logits = row.expand(num_draws, vocab).contiguous()
    temperature = torch.full((num_draws,), 0.8)
    uniform = (torch.arange(num_draws, dtype=torch.float64) + 0.5).div(num_draws).float()
    for k, p, m in ((5, 1.0, 0.0), (0, 0.7, 0.0), (12, 0.8, 0.1)):
        top_k = torch.full((num_draws,), k)
        top_p = torch.full((num_draws,), p)
        min_p = torch.full((num_draws,), m)
        with pk.use_backend(backend):
            ids, _ = pk.sample_from_logits(*(t.to(device) for t in (logits, temperature, uniform, top_k, top_p,
                                                                    min_p)))
        kept, weights, _ = oracle_kept(logits[:1], temperature[:1], top_k[:1], top_p[:1], min_p=min_p[:1])
        probs = weights[0] / weights[0].sum()
        counts = torch.bincount(ids.cpu(), minlength=vocab).double()
        assert (counts - probs * num_draws).abs().max() <= 1.0 + 1e-9, (k, p)
        assert counts[~kept[0]].sum() == 0
        if k == 5:
            assert int(kept[0].sum()) == 6   # the tie at the 5th value kept



@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_top_p_edge_rows(backend, device):
    """Rows whose values make the threshold search's keys awkward: signed zeros (one value), the float32 extremes,
    +inf among finite values, denormals, a top-p of 0 (the maximum alone), a top-k equal to the live tokens."""
    vocab = 40
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3))
    logits[0] = 0.0
    logits[0, ::2] = -0.0                                          # one value, both signs: all tied
    logits[1, :20] = FLOAT32_MAX
    logits[1, 20:] = -FLOAT32_MAX
    logits[2, [3, 9]] = float("inf")                               # +inf ties at the largest float32
    logits[3] = torch.arange(vocab) * 1e-45                        # denormals (and 0)
    logits[4, 7] = 50.0
    logits[5] = float("-inf")
    logits[5, [1, 2, 30]] = torch.tensor([0.5, -0.5, 1.0])         # 3 live; top-k 3 keeps all
    logits[6] = torch.linspace(-1e30, 1e30, vocab)
    temperature = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1e29, 1.0])
    top_k = torch.tensor([3, 5, 1, 4, 0, 3, 10, 0])
    top_p = torch.tensor([0.5, 0.7, 1.0, 0.9, 0.0, 1.0, 0.6, 1e-8])
    uniform = torch.linspace(0.05, 0.95, 8)
    with pk.use_backend(backend):
        ids, _ = pk.sample_from_logits(*(t.to(device) for t in (logits, temperature, uniform, top_k, top_p)))
    kept, _, _ = oracle_kept(logits, temperature, top_k, top_p)
    assert int(kept[0].sum()) == vocab and int(kept[1].sum()) == 20
    for row, token in enumerate(ids.cpu().tolist()):
        assert kept[row, token], (row, token)
    assert ids[2].item() == 3                                      # top-k 1 among tied +inf: the first
    assert ids[4].item() == 7 and ids[7].item() == int(logits[7].argmax())   # top-p 0 and 1e-8: the maximum



@pytest.mark.skipif(not torch.cuda.is_available() and not interpreter_active(),
                    reason="counts the Triton kernel's passes: needs a GPU or the Triton interpreter")
def test_the_threshold_search_takes_few_passes(device):
    """The search's cost: passes over the row beyond the unfiltered draw's three. On rows of spread logits, a few
    for Qwen3's top-k 20 / top-p 0.95 and Llama 3's top-p 0.9 (a search run to the keys' full resolution takes
    about ten); none for a row without either filter, a greedy row or a dead one."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, BLOCK + 37, generator=g) * 3.0).to(device)
    temperature = torch.full((8,), 0.6, device=device)
    for k, p, most in ((20, 0.95, 6.0), (0, 0.9, 4.0)):
        passes = sampling.threshold_search_passes(logits, temperature, torch.full((8,), k, device=device),
                                                  torch.full((8,), p, device=device)).cpu()
        assert passes.min() >= 1 and passes.float().mean() <= most and passes.max() <= 8, (k, p, passes.tolist())
    # Fewer tokens left by min-p than top-k asks for: top-k is off, the first pass alone.
    passes = sampling.threshold_search_passes(logits, temperature, torch.full((8,), 20, device=device),
                                              torch.ones(8, device=device), torch.full((8,), 0.5, device=device))
    assert passes.cpu().tolist() == [1] * 8
    temperature[1] = 0.0
    logits[2] = float("-inf")
    passes = sampling.threshold_search_passes(logits, temperature, torch.tensor([0, 20, 20] + [0] * 5, device=device),
                                              torch.ones(8, device=device)).cpu()
    assert passes.tolist() == [0] * 8


def test_arguments_are_checked():
    logits = torch.zeros(2, 8)
    t, u = torch.ones(2), torch.zeros(2)
    with pytest.raises(ValueError, match="logits"):
        pk.sample_from_logits(torch.zeros(8), t, u)
    with pytest.raises(ValueError, match="logits"):
        pk.sample_from_logits(torch.zeros(2, 8, dtype=torch.int64), t, u)
    with pytest.raises(ValueError, match="logits"):
        pk.sample_from_logits(torch.zeros(2, 0), t, u)
    with pytest.raises(ValueError, match="logits"):
        pk.sample_from_logits(torch.zeros(8, 2).t(), t, u)
    with pytest.raises(ValueError, match="temperature"):
        pk.sample_from_logits(logits, torch.ones(3), u)
    with pytest.raises(ValueError, match="temperature"):
        pk.sample_from_logits(logits, torch.ones(2, dtype=torch.float64), u)
    with pytest.raises(ValueError, match="uniform"):
        pk.sample_from_logits(logits, t, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="top_k"):
        pk.sample_from_logits(logits, t, u, top_k=torch.ones(2))
    with pytest.raises(ValueError, match="top_k"):
        pk.sample_from_logits(logits, t, u, top_k=torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="top_p"):
        pk.sample_from_logits(logits, t, u, top_p=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="min_p"):
        pk.sample_from_logits(logits, t, u, min_p=torch.ones(2, 1))


def test_meta_tensors_are_checked_and_shaped():
    ids, row_max = pk.sample_from_logits(torch.empty(5, 100, device="meta"), torch.empty(5, device="meta"),
                                         torch.empty(5, device="meta"))
    assert ids.shape == (5,) and ids.dtype == torch.int64 and row_max.shape == (5,)
    ids, _ = pk.sample_from_logits(torch.empty(5, 100, device="meta"), torch.empty(5, device="meta"),
                                   torch.empty(5, device="meta"), torch.empty(5, dtype=torch.int64, device="meta"),
                                   torch.empty(5, device="meta"))
    assert ids.shape == (5,)
    ids, _ = pk.sample_from_logits(torch.zeros(0, 10), torch.zeros(0), torch.zeros(0))
    assert ids.shape == (0,)
