"""sample_from_logits against a float64 oracle of the inverse-CDF draw, the Triton kernel and the PyTorch twin."""

import importlib

import pytest
import torch

import pagedkernels as pk

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


@pytest.mark.parametrize("backend", BACKENDS)
def test_draw_frequencies_are_the_probabilities(backend, device):
    """A stratified sweep of the uniform over one row: each token is drawn in proportion to its probability
    (within one draw of the exact count), and the zero-weight ones never."""
    vocab, num_draws = 50, 1000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=g) * 2.0
    row[[3, 17, 49]] = float("-inf")
    logits = row.expand(num_draws, vocab).contiguous()
    temperature = torch.full((num_draws,), 0.8)
    uniform = (torch.arange(num_draws, dtype=torch.float64) + 0.5).div(num_draws).float()
    with pk.use_backend(backend):
        ids, _ = pk.sample_from_logits(logits.to(device), temperature.to(device), uniform.to(device))
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    probs = torch.softmax(row.double() / 0.8, dim=0)
    assert (counts - probs * num_draws).abs().max() <= 1.0 + 1e-9
    assert counts[[3, 17, 49]].sum() == 0


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


def test_meta_tensors_are_checked_and_shaped():
    ids, row_max = pk.sample_from_logits(torch.empty(5, 100, device="meta"), torch.empty(5, device="meta"),
                                         torch.empty(5, device="meta"))
    assert ids.shape == (5,) and ids.dtype == torch.int64 and row_max.shape == (5,)
    ids, _ = pk.sample_from_logits(torch.zeros(0, 10), torch.zeros(0), torch.zeros(0))
    assert ids.shape == (0,)
