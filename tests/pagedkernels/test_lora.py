"""pk.lora_shrink / pk.lora_expand against a float64 oracle: a batch of tokens over mixed adapter slots, ranks 8 to 64
zero-padded to the stack's rank, slots without tokens between used ones (their weights NaN: never read), tokens
without an adapter, fused projections as 1, 2 and 3 slices of unequal sizes, the Triton path's K splits. The
Triton kernels run interpreted on CPU (small shapes: an interpreted launch costs a second), the native kernels and
the PyTorch twin at every dtype.

The oracle sees only each adapter's own rank: the padding must contribute nothing. With ``lora_ranks`` (each slot's
rank per slice) the padding is NaN: it must not be read at all. Memory an op must not read is NaN (unused slots, the buffer rows of tokens without an adapter); memory it must not write is checked bit for
bit (the other columns of a wider output, the rows of tokens without an adapter).
"""

from __future__ import annotations

import pytest
import torch

import pagedkernels as pk
from pagedkernels import _native
from pagedkernels.lora import MAX_SHRINK_SPLITS, shrink_num_splits
from tests.conftest import TRITON_DEVICE

NATIVE = _native.library() is not None
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# cases and the oracle
# ---------------------------------------------------------------------------------------------

# name: (num_tokens, in_features, slice sizes, the stack's rank, each slot's rank (None: no token uses it),
#        forced K splits of the Triton shrink or None)
CASES = {
    # q/k/v-like slices, ranks 8 / 64 / 16 in a rank-64 stack, slot 2 empty between used ones
    "mixed-qkv": (13, 48, (40, 16, 16), 64, [8, 64, None, 16], None),
    # gate/up-like slices, K split three ways over five K tiles (uneven), slot 2 empty at the end
    "gate-up-split-k": (20, 80, (24, 24), 16, [16, 8, None], 3),
    # a single decode token on the second slot
    "decode-token": (1, 48, (24,), 16, [None, 8], None),
    # no token has an adapter
    "no-adapter": (5, 32, (16,), 8, [8], None),
    # a stack rank that is no multiple of 8 (the native expand's transposes in eights, then the rest)
    "rank-12": (9, 40, (24, 16), 12, [4, 12], None),
    # odd ranks (the bf16 pair-dot expand pairs rank values: the last one alone) and a K past a multiple of 32
    "odd-ranks": (11, 72, (24, 16, 8), 16, [5, None, 11, 16], None),
}


def _params(op_dtypes_for_triton):
    """(backend, device, dtype, case, ranked): the Triton cases on TRITON_DEVICE (the conftest skips a "triton" case
    on "cpu" where the interpreter is off, i.e. on a GPU machine, so the device is a parameter). ``ranked``: the op
    gets ``lora_ranks`` and the padding past each rank is NaN (for every case on the native and torch backends; on
    the interpreter for the float32 cases)."""
    params = []
    for case in CASES:
        for ranked in (False, True):
            tag = "-ranked" if ranked else ""
            for dtype in DTYPES:
                params.append(pytest.param("torch", "cpu", dtype, case, ranked, id=f"torch-{_name(dtype)}-{case}{tag}"))
                params.append(pytest.param("native", "cpu", dtype, case, ranked,
                                           id=f"native-{_name(dtype)}-{case}{tag}",
                                           marks=pytest.mark.skipif(not NATIVE, reason="no C compiler here")))
                # The interpreter's bf16 arithmetic is wrong (bf16 runs on CUDA), and each interpreted launch costs
                # about a second: fp32 for every case, fp16 for the two that cross the most masks.
                if TRITON_DEVICE == "cuda" or (dtype == torch.float32 or
                                               (not ranked and (dtype, case) in op_dtypes_for_triton)):
                    params.append(pytest.param("triton", TRITON_DEVICE, dtype, case, ranked,
                                               id=f"triton-{TRITON_DEVICE}-{_name(dtype)}-{case}{tag}"))
    return params


TRITON_FP16 = {(torch.float16, "mixed-qkv"), (torch.float16, "gate-up-split-k")}


def _name(dtype):
    return str(dtype).replace("torch.", "")


class Adapters:
    """Random adapters of each slot's own rank, and their stack: ``lora_a [slots, S*R, K]``, ``lora_b [slots, N,
    R]`` zero-padded past each rank, NaN for a slot no token uses."""

    def __init__(self, in_features, slice_sizes, max_rank, ranks, dtype, gen):
        self.slice_sizes, self.max_rank, self.ranks = tuple(slice_sizes), max_rank, ranks
        if gen is None:   # see absolute()
            return
        num_slots, num_slices, out_features = len(ranks), len(slice_sizes), sum(slice_sizes)
        self.a = [[None] * num_slices for _ in ranks]  # [slot][slice]: [rank, K], the dtype's values as float64
        self.b = [[None] * num_slices for _ in ranks]  # [slot][slice]: [N_s, rank]
        self.lora_a = torch.full((num_slots, num_slices * max_rank, in_features), float("nan"), dtype=dtype)
        self.lora_b = torch.full((num_slots, out_features, max_rank), float("nan"), dtype=dtype)
        for slot, rank in enumerate(ranks):
            if rank is None:
                continue
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            offset = 0
            for s, size in enumerate(slice_sizes):
                a = (torch.randn(rank, in_features, generator=gen) / in_features ** 0.5).to(dtype)
                b = torch.randn(size, rank, generator=gen).to(dtype)
                self.lora_a[slot, s * max_rank: s * max_rank + rank] = a
                self.lora_b[slot, offset:offset + size, :rank] = b
                self.a[slot][s], self.b[slot][s] = a.double(), b.double()
                offset += size

    def ranked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``lora_a``, ``lora_b`` with NaN past each slot's rank instead of zeros, and ``lora_ranks`` int32 [slots, S]
        (0 for an unused slot)."""
        lora_a, lora_b = self.lora_a.clone(), self.lora_b.clone()
        ranks = torch.zeros(len(self.ranks), len(self.slice_sizes), dtype=torch.int32)
        for slot, rank in enumerate(self.ranks):
            if rank is None:
                continue
            ranks[slot] = rank
            lora_b[slot, :, rank:] = float("nan")
            for s in range(len(self.slice_sizes)):
                lora_a[slot, s * self.max_rank + rank:(s + 1) * self.max_rank] = float("nan")
        return lora_a, lora_b, ranks

    def absolute(self) -> "Adapters":
        """The same adapters with every weight's magnitude (the oracle of |x| then gives the accumulation's scale)."""
        other = Adapters(0, self.slice_sizes, self.max_rank, self.ranks, None, None)
        other.a = [[None if a is None else a.abs() for a in slot] for slot in self.a]
        other.b = [[None if b is None else b.abs() for b in slot] for slot in self.b]
        return other

    def shrink(self, x, indices, scale):
        """float64 [num_tokens, S*R]: each slice's rank rows, zeros past them and for tokens without an adapter."""
        out = torch.zeros(x.shape[0], len(self.slice_sizes) * self.max_rank, dtype=torch.float64)
        for t, slot in enumerate(indices.tolist()):
            if slot < 0:
                continue
            for s, a in enumerate(self.a[slot]):
                out[t, s * self.max_rank: s * self.max_rank + a.shape[0]] = scale * (x[t].double() @ a.t())
        return out

    def expand(self, buffer, indices, base):
        """float64 base + delta; ``buffer`` read only at each adapter's own rank (a NaN elsewhere would show)."""
        out = base.double().clone()
        for t, slot in enumerate(indices.tolist()):
            if slot < 0:
                continue
            offset = 0
            for s, b in enumerate(self.b[slot]):
                u = buffer[t, s * self.max_rank: s * self.max_rank + b.shape[1]].double()
                out[t, offset:offset + b.shape[0]] += b @ u
                offset += b.shape[0]
        return out


def _indices(num_tokens, ranks, gen):
    """Each used slot at least once (when there are enough tokens), the rest drawn from the used slots and -1, in
    shuffled order (not grouped by slot)."""
    used = [slot for slot, rank in enumerate(ranks) if rank is not None]
    if ranks == [8] and num_tokens == 5:  # "no-adapter"
        return torch.full((num_tokens,), -1, dtype=torch.int32)
    choices = used + [-1]
    values = (used + [-1])[:num_tokens] if num_tokens >= len(choices) else used[:num_tokens]
    values += [choices[i] for i in torch.randint(len(choices), (num_tokens - len(values),), generator=gen).tolist()]
    return torch.tensor(values, dtype=torch.int32)[torch.randperm(num_tokens, generator=gen)]


def _case(case, dtype, seed=0):
    num_tokens, in_features, slice_sizes, max_rank, ranks, splits = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    adapters = Adapters(in_features, slice_sizes, max_rank, ranks, dtype, gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    return adapters, x, _indices(num_tokens, ranks, gen), splits


def _assert_within(got, exact, bound, what):
    excess = ((got.double() - exact).abs() - bound)
    assert not got.isnan().any(), f"{what}: NaN (a padded, unused or masked value was read)"
    worst = excess.max().item() if excess.numel() else 0.0
    assert worst <= 0, f"{what}: off the float64 oracle by {worst:.3g} past the bound"


def _product_bound(magnitudes, out_dtype, exact, *, rounded_operand: torch.dtype | None = None):
    """float32 accumulation (2^-21 per term, times 4 for the lanes' partial sums and their sum), the output's
    rounding, and for the Triton expand of 16-bit weights the buffer rounded to them first."""
    bound = magnitudes * 2.0 ** -21 * 4
    if rounded_operand is not None:
        bound = bound + magnitudes * torch.finfo(rounded_operand).eps
    if out_dtype != torch.float32:
        bound = bound + exact.abs() * torch.finfo(out_dtype).eps
    return bound + 1e-30


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,device,dtype,case,ranked", _params(TRITON_FP16))
def test_shrink_matches_the_float64_oracle(backend, device, dtype, case, ranked):
    adapters, x, indices, splits = _case(case, dtype)
    _check_shrink(backend, device, adapters, x, indices, splits, ranked)


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not NATIVE, reason="no C compiler here"))])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_shrink_of_a_prompt_s_many_tokens_matches_the_oracle(backend, dtype):
    """A prefill's long runs: the native shrink takes a slot of many tokens in chunks (32 rows of 1024 features),
    each against all the slot's rows of A, beside a slot of few tokens taken a block of A at a time, in one call."""
    gen = torch.Generator().manual_seed(3)
    adapters = Adapters(1024, (40, 16, 16), 64, [8, 64, None, 16], dtype, gen)
    slots = [0] * 75 + [1] * 5 + [3] * 33 + [-1] * 7    # in chunks: 75 = 25 + 25 + 25, 33 = 16 + 17; 5: blocks
    indices = torch.tensor(slots, dtype=torch.int32)[torch.randperm(len(slots), generator=gen)]
    x = torch.randn(len(slots), 1024, generator=gen).to(dtype)
    _check_shrink(backend, "cpu", adapters, x, indices, None, True)


def _check_shrink(backend, device, adapters, x, indices, splits, ranked):
    # Every row is written: zeros for tokens without an adapter (and past each rank), into an `out` that starts
    # as NaN.
    out = torch.full((x.shape[0], adapters.lora_a.shape[1]), float("nan"), device=device)
    lora_a, _, ranks = adapters.ranked() if ranked else (adapters.lora_a, None, None)
    with pk.use_backend(backend):
        result = pk.lora_shrink(x.to(device), lora_a.to(device), indices.to(device), scale=0.5,
                                num_splits=splits, out=out, lora_ranks=None if ranks is None else ranks.to(device))
    assert result.data_ptr() == out.data_ptr() and result.dtype == torch.float32
    exact = adapters.shrink(x, indices, 0.5)
    magnitudes = adapters.absolute().shrink(x.abs(), indices, 0.5)
    _assert_within(result.cpu(), exact, _product_bound(magnitudes, torch.float32, exact), f"{backend} shrink")
    assert (result.cpu()[indices < 0] == 0).all()


@pytest.mark.parametrize("backend,device,dtype,case,ranked", _params(TRITON_FP16))
def test_expand_matches_the_float64_oracle(backend, device, dtype, case, ranked):
    """``out`` is a strided view of a wider tensor (the base layer's output inside a bigger buffer): only its
    columns of the adapted rows change; the buffer rows of tokens without an adapter are NaN (never read), and with
    ``lora_ranks`` so are its columns past each rank."""
    adapters, _, indices, _ = _case(case, dtype, seed=1)
    _, lora_b, ranks = adapters.ranked() if ranked else (None, adapters.lora_b, None)
    gen = torch.Generator().manual_seed(2)
    num_tokens, out_features = indices.shape[0], sum(adapters.slice_sizes)
    buffer = torch.randn(num_tokens, adapters.lora_a.shape[1], generator=gen)
    for s, size in enumerate(adapters.slice_sizes):  # past each adapter's rank the shrink gives zeros
        for t, slot in enumerate(indices.tolist()):
            if slot >= 0:
                buffer[t, s * adapters.max_rank + adapters.ranks[slot]:(s + 1) * adapters.max_rank] = (
                    float("nan") if ranked else 0.0)
    buffer[indices < 0] = float("nan")
    wide = torch.randn(num_tokens, out_features + 7, generator=gen).to(dtype)
    wide[:, :3] = float("nan")
    wide[:, 3 + out_features:] = float("nan")
    before = wide.clone()
    base = before[:, 3:3 + out_features]
    wide = wide.to(device)
    mapping = pk.lora_mapping(indices.to(device), adapters.lora_b.shape[0])
    with pk.use_backend(backend):
        result = pk.lora_expand(buffer.to(device), lora_b.to(device), indices.to(device),
                                wide[:, 3:3 + out_features], slice_sizes=adapters.slice_sizes,
                                sorted_token_ids=mapping[0], lora_token_starts=mapping[1],
                                lora_ranks=None if ranks is None else ranks.to(device))
    assert result.data_ptr() == wide[:, 3:].data_ptr()
    wide = wide.cpu()
    torch.testing.assert_close(wide[:, :3], before[:, :3], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(wide[:, 3 + out_features:], before[:, 3 + out_features:], rtol=0, atol=0,
                               equal_nan=True)
    torch.testing.assert_close(wide[indices < 0], before[indices < 0], rtol=0, atol=0, equal_nan=True)
    got = wide[:, 3:3 + out_features]
    exact = adapters.expand(buffer, indices, base)
    magnitudes = (adapters.absolute().expand(buffer.abs().nan_to_num(), indices, torch.zeros_like(base))
                  + base.double().abs())
    # The Triton expand of 16-bit weights rounds the buffer to them, and so does the native bf16 expand where the
    # build takes bf16 pair dot products (AVX512-BF16).
    rounded = dtype if dtype != torch.float32 and (backend == "triton" or (
        backend == "native" and dtype == torch.bfloat16 and _native.bf16_dot_path() != "bf16 widened to float32")) \
        else None
    _assert_within(got[indices >= 0], exact[indices >= 0],
                   _product_bound(magnitudes, dtype, exact, rounded_operand=rounded)[indices >= 0],
                   f"{backend} expand")


@pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_a_token_gets_the_same_bits_in_any_batch(dtype):
    """The native kernels compute a token's shrink and expand results with the same operations whatever tokens
    share its batch (the grouping, the pairing of tokens, the threads): alone or among others, bit for bit. (Not
    the twin's property: torch's GEMMs block by the row count.)"""
    backend = "native"
    adapters, x, indices, _ = _case("mixed-qkv", dtype, seed=3)
    base = torch.randn(x.shape[0], sum(adapters.slice_sizes), generator=torch.Generator().manual_seed(3)).to(dtype)
    with pk.use_backend(backend):
        buffer = pk.lora_shrink(x, adapters.lora_a, indices)
        together = pk.lora_expand(buffer, adapters.lora_b, indices, base.clone(), slice_sizes=adapters.slice_sizes)
        for t in range(x.shape[0]):
            alone = pk.lora_shrink(x[t:t + 1], adapters.lora_a, indices[t:t + 1])
            assert torch.equal(alone, buffer[t:t + 1])
            row = pk.lora_expand(alone, adapters.lora_b, indices[t:t + 1], base[t:t + 1].clone(),
                                 slice_sizes=adapters.slice_sizes)
            assert torch.equal(row, together[t:t + 1])


def _add_lora_params():
    """Every case on the twin and the native kernels; interpreted (a launch a second) the float32 cases with
    ``lora_ranks`` (the engine's calls) and the float16 case whose K is split."""
    params = []
    for case in CASES:
        for dtype in DTYPES:
            params.append(pytest.param("torch", "cpu", dtype, case, id=f"torch-{_name(dtype)}-{case}"))
            params.append(pytest.param("native", "cpu", dtype, case, id=f"native-{_name(dtype)}-{case}",
                                       marks=pytest.mark.skipif(not NATIVE, reason="no C compiler here")))
            if TRITON_DEVICE == "cuda" or dtype == torch.float32 or (dtype, case) == (torch.float16,
                                                                                      "gate-up-split-k"):
                params.append(pytest.param("triton", TRITON_DEVICE, dtype, case,
                                           id=f"triton-{TRITON_DEVICE}-{_name(dtype)}-{case}"))
    return params


@pytest.mark.parametrize("backend,device,dtype,case", _add_lora_params())
def test_add_lora_matches_the_float64_oracle(backend, device, dtype, case):
    """``add_lora``: the base output plus ``scale * (x A^T) B^T`` per token's slot, in place, with each slot's own
    rank (the padding NaN: never read), rows of tokens without an adapter untouched bit for bit. On the Triton path
    the expand sums the shrink's K-split planes as it reads them: interpreted on the CPU, the same bits as
    ``lora_shrink`` (which sums them with ``torch.sum``) then ``lora_expand`` at the same splits."""
    adapters, x, indices, splits = _case(case, dtype, seed=4)
    lora_a, lora_b, ranks = adapters.ranked()
    base = torch.randn(x.shape[0], sum(adapters.slice_sizes), generator=torch.Generator().manual_seed(4)).to(dtype)
    args = [t.to(device) for t in (x, lora_a, lora_b, indices)]
    options = dict(scale=0.5, slice_sizes=adapters.slice_sizes, lora_ranks=ranks.to(device))
    out = base.clone().to(device)
    with pk.use_backend(backend):
        result = pk.add_lora(*args, out, num_splits=splits, **options)
        if backend == "triton":
            buffer = pk.lora_shrink(args[0], args[1], args[3], scale=0.5, num_splits=splits or _splits(x, lora_a),
                                    lora_ranks=options["lora_ranks"])
            apart = pk.lora_expand(buffer, args[2], args[3], base.clone().to(device),
                                   slice_sizes=adapters.slice_sizes, lora_ranks=options["lora_ranks"])
    assert result.data_ptr() == out.data_ptr()
    got = result.cpu()
    if backend == "triton" and device == "cpu":
        assert torch.equal(got, apart)
    assert torch.equal(got[indices < 0], base[indices < 0])
    live = indices >= 0
    absolute = adapters.absolute()
    exact = adapters.expand(adapters.shrink(x, indices, 0.5), indices, base)
    magnitudes = (absolute.expand(absolute.shrink(x.abs(), indices, 0.5), indices, torch.zeros_like(base))
                  + base.double().abs())
    rounded = dtype if dtype != torch.float32 and (backend == "triton" or (
        backend == "native" and dtype == torch.bfloat16 and _native.bf16_dot_path() != "bf16 widened to float32")) \
        else None
    # two float32 accumulations (the shrink's, then the expand's), each within the product bound
    _assert_within(got[live], exact[live], _product_bound(2 * magnitudes, dtype, exact, rounded_operand=rounded)[live],
                   f"{backend} add_lora")


def test_add_lora_sums_the_planes_apart_where_the_expand_does_not(monkeypatch):
    """Where :func:`expand_sums_planes` says no (prefill tiles, float32 on CUDA), add_lora sums the planes with
    ``torch.sum`` before the expand, as lora_shrink does. Interpreted: the same bits as the expand summing them; on
    CUDA (float16, whose decode tiles the expand sums), both within the float64 oracle's bound (torch.sum's order of
    the planes is its own there)."""
    from pagedkernels import lora

    dtype = torch.float16 if TRITON_DEVICE == "cuda" else torch.float32
    adapters, x, indices, splits = _case("gate-up-split-k", dtype, seed=6)
    lora_a, lora_b, ranks = adapters.ranked()
    base = torch.randn(x.shape[0], sum(adapters.slice_sizes), generator=torch.Generator().manual_seed(6)).to(dtype)
    args = [t.to(TRITON_DEVICE) for t in (x, lora_a, lora_b, indices)]
    options = dict(scale=0.5, slice_sizes=adapters.slice_sizes, lora_ranks=ranks.to(TRITON_DEVICE),
                   num_splits=splits)
    kernel, launched = lora._lora_expand_kernel, []

    class Recorded:   # the expand's launches, noting whether each summed the planes
        def __getitem__(self, grid):
            def launch(*a, **kw):
                launched.append(kw["SUM_PLANES"])
                return kernel[grid](*a, **kw)
            return launch
    monkeypatch.setattr(lora, "_lora_expand_kernel", Recorded())
    results = {}
    with pk.use_backend("triton"):
        for sums in (True, False):
            monkeypatch.setattr(lora, "expand_sums_planes", lambda *a, sums=sums: sums)
            results[sums] = pk.add_lora(*args, base.clone().to(TRITON_DEVICE), **options).cpu()
    assert launched == [True, False]
    if TRITON_DEVICE == "cpu":
        assert torch.equal(results[False], results[True])
    live = indices >= 0
    absolute = adapters.absolute()
    exact = adapters.expand(adapters.shrink(x, indices, 0.5), indices, base)
    magnitudes = (absolute.expand(absolute.shrink(x.abs(), indices, 0.5), indices, torch.zeros_like(base))
                  + base.double().abs())
    bound = _product_bound(2 * magnitudes, dtype, exact, rounded_operand=None if dtype == torch.float32 else dtype)
    for sums, got in results.items():
        assert torch.equal(got[~live], base[~live])
        _assert_within(got[live], exact[live], bound[live], f"add_lora, planes summed {'in' if sums else 'apart'}")


def _splits(x, lora_a):
    """The split count add_lora takes by default (so lora_shrink can be given the same)."""
    from pagedkernels.lora import _shrink_splits
    return _shrink_splits(x, lora_a.shape[1])


# ---------------------------------------------------------------------------------------------
# the grouping, the split heuristic
# ---------------------------------------------------------------------------------------------

def test_lora_mapping_groups_tokens_by_slot_stably():
    indices = torch.tensor([2, -1, 0, 2, 3, -1, 0, 2], dtype=torch.int32)
    sorted_ids, starts = torch.full((8,), -7, dtype=torch.int32), torch.full((5,), -7, dtype=torch.int32)
    result = pk.lora_mapping(indices, 4, sorted_token_ids=sorted_ids, lora_token_starts=starts)
    assert result[0] is sorted_ids and result[1] is starts
    assert sorted_ids.tolist() == [2, 6, 0, 3, 7, 4, 1, 5]   # slot 0, (slot 1: none), slot 2, slot 3, then -1s
    assert starts.tolist() == [0, 2, 2, 5, 6]
    empty = pk.lora_mapping(torch.empty(0, dtype=torch.int32), 3)
    assert empty[0].shape == (0,) and empty[1].tolist() == [0, 0, 0, 0]


def test_shrink_splits_follow_the_shapes_only():
    """The documented examples (H100, 132 SMs); never past MAX_SHRINK_SPLITS or under 256 features a split; and
    the interpreter's stand-in gives the small tiles tests need."""
    def splits(tokens, width, k):
        return shrink_num_splits(tokens, width, k, 132, torch.bfloat16, "cuda")
    assert [splits(n, 48, 4096) for n in (1, 64, 1024, 8192)] == [16, 16, 16, 3]
    assert splits(1, 48, 576) == 2 and splits(1, 192, 255) == 1
    assert splits(1, 16, 1 << 20) == MAX_SHRINK_SPLITS


def test_the_expand_sums_the_planes_where_its_tile_allows():
    """The documented rule (shapes, dtype and device kind only): on CUDA the 16-bit tiles of up to 64 x 32 buffer
    values (each of them compiled without spills in the AOT table), never float32; the interpreter always."""
    from pagedkernels.lora import expand_sums_planes

    def sums(tokens, rank, dtype=torch.bfloat16, kind="cuda"):
        return expand_sums_planes(tokens, rank, dtype, kind)
    assert sums(1, 16) and sums(32, 64, torch.float16) and sums(128, 16) and sums(64, 32)
    assert not sums(128, 64) and not sums(1024, 64) and not sums(1, 16, torch.float32)
    assert sums(128, 64, torch.float32, "interpreter")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

NATIVE_PARAM = pytest.param("native", "cpu", marks=pytest.mark.skipif(not NATIVE, reason="no C compiler here"))


@pytest.mark.parametrize("backend,device", [("torch", "cpu"), NATIVE_PARAM, ("triton", TRITON_DEVICE)])
@pytest.mark.parametrize("index,rank,match", [
    (2, None, r"token_lora_indices must lie in \[-1, 2\) (.*)got 2 for token 0"),
    (-2, None, r"token_lora_indices must lie in \[-1, 2\) (.*)got -2 for token 0"),
    (1, 17, r"lora_ranks must lie in \[0, 16\] (.*)got 17 for slot 1, slice 0"),
    (1, -1, r"lora_ranks must lie in \[0, 16\] (.*)got -1 for slot 1, slice 0"),
])
def test_a_bad_index_or_rank_raises_before_writing(backend, device, index, rank, match, monkeypatch):
    """Values are checked on CPU tensors always, on CUDA with PAGEDKERNELS_DEBUG=1 (a host sync)."""
    monkeypatch.setenv("PAGEDKERNELS_DEBUG", "1")
    adapters, x, _, _ = _case("decode-token", torch.float32)
    x, lora_a, lora_b = x.to(device), adapters.lora_a.to(device).nan_to_num(), adapters.lora_b.to(device).nan_to_num()
    indices = torch.tensor([index], dtype=torch.int32, device=device)
    ranks = None if rank is None else torch.tensor([[4], [rank]], dtype=torch.int32, device=device)
    out = torch.full((1, lora_a.shape[1]), 3.0, device=device)
    base = torch.full((1, lora_b.shape[1]), 5.0, device=device)
    with pk.use_backend(backend):
        with pytest.raises(ValueError, match=match):
            pk.lora_shrink(x, lora_a, indices, out=out, lora_ranks=ranks)
        with pytest.raises(ValueError, match=match.split(" (.*)")[0]):
            pk.lora_expand(out, lora_b, indices, base, lora_ranks=ranks)
        with pytest.raises(ValueError, match=match.split(" (.*)")[0]):
            pk.add_lora(x, lora_a, lora_b, indices, base, lora_ranks=ranks)
    assert (out == 3.0).all() and (base == 5.0).all()


def _args():
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(3, 32, generator=gen), lora_a=torch.randn(2, 16, 32, generator=gen),
                lora_b=torch.randn(2, 24, 8, generator=gen), indices=torch.tensor([0, -1, 1], dtype=torch.int32),
                buffer=torch.randn(3, 16, generator=gen), out=torch.randn(3, 24, generator=gen))


@pytest.mark.parametrize("call,match", [
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"].half(), a["indices"]), r"lora_a must have dtype in \(float32\)"),
    (lambda a: pk.lora_shrink(a["x"][:, :16], a["lora_a"], a["indices"]), r"lora_a must have shape \[\*, \*, 16\]"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"].long()), "token_lora_indices must have dtype"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"][:2]), r"token_lora_indices must have shape \[3\]"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"], scale=float("inf")), "scale must be a finite"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"], num_splits=0), "num_splits must be an int >= 1"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"], out=torch.empty(3, 8)),
     r"out must have shape \[3, 16\]"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"], sorted_token_ids=a["indices"]),
     "sorted_token_ids and lora_token_starts come together"),
    (lambda a: pk.lora_shrink(a["x"].t(), a["lora_a"], a["indices"]), "x must"),
    (lambda a: pk.lora_expand(a["buffer"], a["lora_b"], a["indices"], a["out"], slice_sizes=(8, 8)),
     r"slice_sizes \[8, 8\] sum to 16, not out's 24"),
    (lambda a: pk.lora_expand(a["buffer"], a["lora_b"], a["indices"], a["out"], slice_sizes=(6, 6, 6, 6)),
     "slice_sizes must be 1 to 3 positive ints"),
    (lambda a: pk.lora_expand(a["buffer"], a["lora_b"], a["indices"], a["out"], slice_sizes=(24,)),
     r"buffer must have shape \[3, 8\]"),   # one slice of rank 8 (two: the 16 columns given)
    (lambda a: pk.lora_expand(a["buffer"], a["lora_b"].half(), a["indices"], a["out"], slice_sizes=(12, 12)),
     r"lora_b must have dtype in \(float32\)"),
    (lambda a: pk.lora_expand(a["buffer"].half(), a["lora_b"], a["indices"], a["out"], slice_sizes=(12, 12)),
     r"buffer must have dtype in \(float32\)"),
    (lambda a: pk.lora_mapping(a["indices"], 0), "num_loras must be an int >= 1"),
    (lambda a: pk.add_lora(a["x"], a["lora_a"], a["lora_b"][:1], a["indices"], a["out"], slice_sizes=(12, 12)),
     "lora_a and lora_b must stack the same slots, got 2 and 1"),
    (lambda a: pk.add_lora(a["x"], a["lora_a"], a["lora_b"], a["indices"], a["out"]),
     r"lora_a has 16 rank rows, not the 1 slices x lora_b's rank 8 = 8"),
    (lambda a: pk.add_lora(a["x"], a["lora_a"], a["lora_b"], a["indices"], a["out"][:2], slice_sizes=(12, 12)),
     r"token_lora_indices must have shape \[2\]"),
    (lambda a: pk.add_lora(a["x"], a["lora_a"], a["lora_b"].half(), a["indices"], a["out"], slice_sizes=(12, 12)),
     r"lora_b must have dtype in \(float32\)"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"], lora_ranks=torch.ones(2, 3, dtype=torch.int32)),
     "lora_ranks has 3 slices, which do not divide lora_a's 16 rank rows"),
    (lambda a: pk.lora_shrink(a["x"], a["lora_a"], a["indices"], lora_ranks=torch.ones(3, 2, dtype=torch.int32)),
     r"lora_ranks must have shape \[2, \*\]"),
    (lambda a: pk.lora_expand(a["buffer"], a["lora_b"], a["indices"], a["out"], slice_sizes=(12, 12),
                              lora_ranks=torch.ones(2, 2)), "lora_ranks must have dtype"),
    (lambda a: pk.lora_expand(a["buffer"], a["lora_b"], a["indices"], a["out"], slice_sizes=(12, 12),
                              lora_ranks=torch.ones(2, 1, dtype=torch.int32)), r"lora_ranks must have shape \[2, 2\]"),
])
def test_argument_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_args())


# ---------------------------------------------------------------------------------------------
# graphs
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not NATIVE, reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("fused", [False, True], ids=["shrink-expand", "add_lora"])
def test_cpu_graph_replays_follow_new_indices_and_fewer_rows(fused):
    """shrink + expand (or add_lora, the engine's call) recorded once in a CPU graph (pagedkernels.cpu_graph) over
    static buffers: replays read the indices and activations the buffers hold then, and a replay of fewer rows
    computes just those."""
    from pagedkernels.cpu_graph import CPUGraph

    adapters, x, indices, _ = _case("mixed-qkv", torch.float32, seed=5)
    lora_a, lora_b = adapters.lora_a.nan_to_num(), adapters.lora_b.nan_to_num()
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(x.shape[0], lora_b.shape[1], generator=gen)
    static_x, static_indices, static_base = x.clone(), indices.clone(), base.clone()
    full = torch.tensor([[rank or 0] * len(adapters.slice_sizes) for rank in adapters.ranks], dtype=torch.int32)
    static_ranks = full.clone()

    def step():
        out = static_base.clone()
        if fused:
            return pk.add_lora(static_x, lora_a, lora_b, static_indices, out, slice_sizes=adapters.slice_sizes,
                               lora_ranks=static_ranks)
        buffer = pk.lora_shrink(static_x, lora_a, static_indices, lora_ranks=static_ranks)
        return pk.lora_expand(buffer, lora_b, static_indices, out, slice_sizes=adapters.slice_sizes,
                              lora_ranks=static_ranks)

    with pk.use_backend("native"):
        graph = CPUGraph()
        graph.capture(step, rows=x.shape[0])
        assert graph.num_kernel_calls == 2 and graph.resizable
        for seed in (6, 7):
            g = torch.Generator().manual_seed(seed)
            static_x.copy_(torch.randn(x.shape, generator=g))
            static_indices.copy_(indices[torch.randperm(x.shape[0], generator=g)])
            torch.testing.assert_close(graph.replay(), step(), rtol=0, atol=0)
        whole = step()
        static_ranks.copy_(torch.minimum(full, torch.tensor(4, dtype=torch.int32)))   # the ranks it reads then too
        cut = step()
        torch.testing.assert_close(graph.replay(), cut, rtol=0, atol=0)
        assert not torch.equal(cut, whole)
        static_ranks.copy_(full)
        static_indices.copy_(torch.flip(indices, [0]))
        eager = step()
        torch.testing.assert_close(graph.replay(4)[:4], eager[:4], rtol=0, atol=0)
    exact = adapters.expand(adapters.shrink(static_x, static_indices, 1.0), static_indices, static_base)
    torch.testing.assert_close(eager.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True], ids=["shrink-expand", "add_lora"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_capture_follows_the_index_buffers(dtype, fused, monkeypatch):
    """The mapping (sort, scatter-add, cumsum), the split shrink and its sum (or add_lora: the planes summed in the
    expand), and the expand capture into one CUDA graph; replays follow the indices copied into the device buffer,
    with a different number of adapters each."""
    monkeypatch.delenv("PAGEDKERNELS_DEBUG", raising=False)
    adapters, x, indices, _ = _case("mixed-qkv", dtype, seed=8)
    lora_a, lora_b = adapters.lora_a.nan_to_num().cuda(), adapters.lora_b.nan_to_num().cuda()
    x, static_indices = x.cuda(), indices.cuda()
    base = torch.randn(x.shape[0], lora_b.shape[1], device="cuda").to(dtype)
    out = torch.empty_like(base)
    sorted_ids = torch.empty(x.shape[0], dtype=torch.int32, device="cuda")
    starts = torch.empty(lora_a.shape[0] + 1, dtype=torch.int32, device="cuda")

    def step():
        out.copy_(base)
        pk.lora_mapping(static_indices, lora_a.shape[0], sorted_token_ids=sorted_ids, lora_token_starts=starts)
        if fused:
            pk.add_lora(x, lora_a, lora_b, static_indices, out, slice_sizes=adapters.slice_sizes, num_splits=3,
                        sorted_token_ids=sorted_ids, lora_token_starts=starts)
            return
        buffer = pk.lora_shrink(x, lora_a, static_indices, num_splits=3, sorted_token_ids=sorted_ids,
                                lora_token_starts=starts)
        pk.lora_expand(buffer, lora_b, static_indices, out, slice_sizes=adapters.slice_sizes,
                       sorted_token_ids=sorted_ids, lora_token_starts=starts)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new in (indices, torch.where(indices == 0, 1, indices), torch.full_like(indices, -1)):
        static_indices.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        exact = adapters.expand(adapters.shrink(x.cpu(), new, 1.0), new, base.cpu())
        torch.testing.assert_close(out.cpu().double(), exact, rtol=2e-2, atol=2e-2)
