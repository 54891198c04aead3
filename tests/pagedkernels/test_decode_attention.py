"""pk.paged_decode_attention against the float64 dense oracle: the Triton kernel (interpreted on CPU)
and the PyTorch twin, one suite parametrized by backend and device.

Interpreted Triton is slow, so shapes stay small (lengths <= 70, few heads) and each grid covers
every value of an axis (head size, page size, GQA group, dtype, split count) without the full cross
product.
"""

import pytest
import torch

import pagedkernels as pk
from pagedkernels import decode_attention
from pagedkernels.decode_attention import (
    MAX_SPLITS,
    MIN_TILES_PER_SPLIT,
    TILE_N,
    decode_num_splits,
    decode_workspace_numel,
)
from tests.pagedkernels.oracle import assert_attention_close, attention_oracle, make_paged_kv

BACKENDS = ["triton", "torch", "native"]


def _skip_unsupported(backend, dtype, device):
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def _case(seq_lens, *, num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32, device="cpu",
          seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator=gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    return q, kv


def _expected(q, kv, **kwargs):
    rows = []
    for s, n in enumerate(kv.seq_lens.tolist()):
        if n == 0:  # documented: no visible keys -> zeros
            rows.append(torch.zeros(q.shape[1:], dtype=torch.float64))
        else:
            rows.append(attention_oracle(q[s:s + 1], kv.keys[s], kv.values[s], **kwargs)[0])
    return torch.stack(rows)


def _run(backend, q, kv, **kwargs):
    with pk.use_backend(backend):
        return pk.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kwargs)


def _run_and_check(backend, q, kv, **kwargs):
    oracle_kwargs = {k: v for k, v in kwargs.items() if k in ("scale", "sliding_window", "softcap")}
    out = _run(backend, q, kv, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert_attention_close(out, _expected(q, kv, **oracle_kwargs))
    return out


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel in the module: records each launch grid, then launches."""

    def __init__(self, kernel, fail=False):
        self.kernel, self.fail, self.grids = kernel, fail, []

    def __getitem__(self, grid):
        if self.fail:
            raise AssertionError("kernel launched although the call was invalid")
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    split = _LaunchRecorder(decode_attention._decode_split_kernel)
    reduce = _LaunchRecorder(decode_attention._decode_reduce_kernel)
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", split)
    monkeypatch.setattr(decode_attention, "_decode_reduce_kernel", reduce)
    return split, reduce


# ---------------------------------------------------------------------------------------------
# numerics against the oracle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(backend, dtype, device):
    _skip_unsupported(backend, dtype, device)
    q, kv = _case([1, 17, 40], num_kv_heads=2, group=4, dtype=dtype, device=device)
    _run_and_check(backend, q, kv)


# Every head size, page size and GQA group appears at least once; lengths of 1 token, one short of
# a page, exactly a page, one past it, and several pages / tiles.
SHAPES = [
    # head_dim, block_size, group, num_kv_heads, dtype, seq_lens
    (64, 8, 1, 2, torch.float32, [1, 7, 8, 9, 70]),
    (80, 16, 3, 2, torch.float16, [15, 16, 17, 33]),
    (96, 32, 7, 1, torch.float32, [1, 31, 32, 65]),
    (128, 128, 4, 2, torch.float16, [1, 70]),
    (256, 16, 16, 1, torch.float32, [2, 48]),
    (128, 8, 3, 1, torch.bfloat16, [3, 41]),
    (64, 32, 16, 1, torch.float16, [64, 1]),
    # many sequences (the native kernel's whole-sequence work split), SmolLM2's 3 KV heads x 3, and a
    # group of 5 (query heads in register sets of 4 + 1)
    (64, 16, 3, 3, torch.float32, [5 + 9 * i for i in range(14)]),
    (128, 16, 5, 2, torch.float16, [1 + 11 * i for i in range(12)]),
    # head sizes whose tiles are padded to the next power of two (masked head dimension)
    (48, 16, 2, 2, torch.float32, [1, 33, 70]),
    (112, 8, 4, 1, torch.float16, [9, 40]),
    (160, 32, 1, 2, torch.float32, [32, 65]),
    (32, 16, 3, 1, torch.float16, [17, 50]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,block_size,group,num_kv_heads,dtype,seq_lens", SHAPES)
def test_shapes(backend, head_dim, block_size, group, num_kv_heads, dtype, seq_lens, device):
    _skip_unsupported(backend, dtype, device)
    q, kv = _case(seq_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                  dtype=dtype, device=device, seed=head_dim + block_size)
    _run_and_check(backend, q, kv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window,softcap,block_size", [
    (1, None, 16),  # only the query's own key
    (5, None, 8),
    (32, None, 16),  # window boundary on a tile boundary
    (100, None, 16),  # wider than every sequence
    (None, 1.0, 16),  # strong cap: scores of |s| ~ 3 are squeezed
    (None, 30.0, 32),
    (20, 5.0, 8),
])
def test_sliding_window_and_softcap(backend, sliding_window, softcap, block_size, device):
    q, kv = _case([1, 9, 33, 70], num_kv_heads=2, group=3, block_size=block_size, device=device, seed=7)
    q = q * 3  # larger scores, so softcap changes the result visibly
    _run_and_check(backend, q, kv, sliding_window=sliding_window, softcap=softcap)


# fp16 and bf16 through every feature: GQA and MHA, pages of 8 to 32 tokens, varlen batches, a
# sliding window, a softcap, forced and default split-K (with splits left empty), and 4096-token
# contexts, where a kernel keeping its accumulator or softmax sum in 16 bits fails the per-vector
# bound (oracle.ATTENTION_VECTOR_RTOL). bf16 Triton is checked on CUDA (the interpreter's is wrong).
HALF_PRECISION_CASES = {
    # seq_lens, num_kv_heads, group, head_dim, block_size, options
    "gqa_varlen": ([1, 17, 40, 70], 2, 4, 64, 16, {}),
    "mha_pages_of_8": ([9, 33, 2], 3, 1, 128, 8, {}),
    "window": ([1, 9, 33, 70], 2, 3, 64, 16, dict(sliding_window=20)),
    "softcap": ([5, 70], 2, 3, 80, 32, dict(softcap=5.0, scale=0.3)),
    "window_softcap_splits": ([1, 40, 70, 33], 2, 4, 64, 16, dict(sliding_window=40, softcap=10.0, num_splits=3)),
    "empty_splits": ([1, 40, 70], 1, 8, 96, 16, dict(num_splits=16)),
    "long_context": ([4096, 1500], 1, 4, 128, 16, {}),
    "long_window_splits": ([4096], 2, 2, 128, 32, dict(sliding_window=1000, num_splits=7)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(HALF_PRECISION_CASES))
def test_half_precision_features(backend, dtype, case, device):
    _skip_unsupported(backend, dtype, device)
    seq_lens, num_kv_heads, group, head_dim, block_size, options = HALF_PRECISION_CASES[case]
    q, kv = _case(seq_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                  dtype=dtype, device=device, seed=len(case))
    _run_and_check(backend, q * 2, kv, **options)  # larger scores: a softcap and the softmax's shape matter


def test_softcap_and_window_change_the_result():
    """Guards the tests above: the features are not no-ops on these inputs."""
    q, kv = _case([70, 33], num_kv_heads=2, group=3, seed=7)
    q = q * 3
    plain = _expected(q, kv)
    assert (plain - _expected(q, kv, softcap=5.0)).abs().max() > 1e-2
    assert (plain - _expected(q, kv, sliding_window=20)).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale(backend, device):
    q, kv = _case([12, 50], device=device, seed=3)
    _run_and_check(backend, q, kv, scale=0.3)


# 70 tokens are 3 tiles of 32: 7 and 16 splits leave splits with no tile at all.
@pytest.mark.triton
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (40, 10.0)])
def test_forced_splits_triton(num_splits, sliding_window, softcap, device, launches):
    q, kv = _case([1, 40, 70, 33], num_kv_heads=2, group=4, device=device, seed=num_splits)
    _run_and_check("triton", q, kv, num_splits=num_splits, sliding_window=sliding_window, softcap=softcap)
    split, reduce = launches
    assert split.grids == [(4, 2, num_splits)]
    assert len(reduce.grids) == (num_splits > 1)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_forced_splits_torch(num_splits, device):
    q, kv = _case([1, 40, 70], device=device)
    _run_and_check("torch", q, kv, num_splits=num_splits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_sequence_gives_zeros(backend, num_splits, device):
    q, kv = _case([0, 20, 0, 5], device=device, seed=11)
    out = _run_and_check(backend, q, kv, num_splits=num_splits, sliding_window=8)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("garbage", [-1, 10**6])
def test_unused_table_entries_never_read(backend, garbage, device):
    """Entries past a sequence's last block may be any padding value; value checks accept them and
    the kernels never load through them."""
    q, kv = _case([5, 40], block_size=8, device=device, seed=5)
    used_blocks = torch.tensor([1, 5], device=device)[:, None]
    columns = torch.arange(kv.block_tables.shape[1], device=device)[None, :]
    kv.block_tables = torch.where(columns < used_blocks, kv.block_tables, garbage).to(torch.int32)
    _run_and_check(backend, q, kv, num_splits=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_argument_and_strided_views(backend, device):
    """q is a view into a fused qkv buffer and out a view into a NaN-poisoned buffer: both strided
    over heads. Only out's view is written."""
    gen = torch.Generator().manual_seed(9)
    q_dense, kv = _case([6, 45], num_kv_heads=2, group=2, device=device, seed=9)
    qkv = torch.randn(2, 4 + 4, 64, generator=gen).to(device)
    qkv[:, :4] = q_dense
    q = qkv[:, :4]
    buffer = torch.full((2, 6, 64), float("nan"), device=device)
    out = buffer[:, 1:5]
    result = _run_and_check(backend, q, kv, out=out, num_splits=2)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double().cpu(), _expected(q_dense, kv), atol=2e-5, rtol=1e-4)
    assert torch.isnan(buffer[:, 0]).all() and torch.isnan(buffer[:, 5]).all()


@pytest.mark.triton
def test_triton_path_is_taken(device, launches):
    split, reduce = launches
    q, kv = _case([3, 30], device=device)
    _run("torch", q, kv, num_splits=2)
    assert split.grids == [] and reduce.grids == []
    _run("triton", q, kv, num_splits=2)
    assert split.grids == [(2, 2, 2)] and reduce.grids == [(2, 4)]
    if device == "cuda":
        _run("auto", q, kv, num_splits=2)
        assert len(split.grids) == 2


@pytest.mark.triton
def test_default_splits_come_from_the_heuristic(device, launches, monkeypatch):
    calls = []

    def fake_heuristic(num_seqs, num_kv_heads, max_context, num_multiprocessors):
        calls.append((num_seqs, num_kv_heads, max_context))
        return 5

    monkeypatch.setattr(decode_attention, "decode_num_splits", fake_heuristic)
    q, kv = _case([3, 70], block_size=16, device=device)
    _run_and_check("triton", q, kv)
    width = kv.block_tables.shape[1]
    assert calls == [(2, 2, width * 16)]  # upper bound from the table's width, not from seq_lens
    assert launches[0].grids == [(2, 2, 5)]
    _run_and_check("triton", q, kv, sliding_window=10)
    assert calls[-1] == (2, 2, 10 + TILE_N)  # a window bounds the work per sequence


# ---------------------------------------------------------------------------------------------
# caller-provided split-K workspace
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_workspace_gives_the_same_result(backend, num_splits, device, launches):
    """With and without a workspace, forced or default splits: both match the oracle. The Triton path
    writes its partial results into the workspace (NaN-poisoned: every float a launch uses is
    written before it is read) and leaves the rest of it alone."""
    q, kv = _case([1, 40, 70], num_kv_heads=2, group=3, head_dim=80, device=device, seed=13)
    allocated = _run_and_check(backend, q, kv, num_splits=num_splits)
    workspace = torch.full((decode_workspace_numel(3, 6, 80, 3) + 100,), float("nan"), device=device)
    given = _run_and_check(backend, q, kv, num_splits=num_splits, workspace=workspace)
    torch.testing.assert_close(given, allocated, atol=0, rtol=0)
    if backend == "triton":
        splits = launches[0].grids[-1][2]
        used = decode_workspace_numel(3, 6, 80, splits)
        assert not torch.isnan(workspace[:used]).any()
        assert torch.isnan(workspace[used:]).all()
    else:  # the PyTorch and native backends need no scratch
        assert torch.isnan(workspace).all()


@pytest.mark.triton
def test_workspace_caps_the_default_splits(device, launches, monkeypatch):
    """The heuristic's split count is capped to what the workspace holds (a shape-only choice, so
    graph capture stays sync-free); one split needs no workspace at all."""
    monkeypatch.setattr(decode_attention, "decode_num_splits", lambda *args, **kwargs: 5)
    q, kv = _case([3, 70], num_kv_heads=2, group=2, device=device, seed=17)
    for floats, splits in ((decode_workspace_numel(2, 4, 64, 2), 2), (decode_workspace_numel(2, 4, 64, 4) + 5, 4),
                           (0, 1), (10**5, 5)):
        workspace = torch.full((floats,), float("nan"), device=device)
        reductions = len(launches[1].grids)
        _run_and_check("triton", q, kv, workspace=workspace)
        assert launches[0].grids[-1] == (2, 2, splits)
        assert len(launches[1].grids) - reductions == (splits > 1)


def test_decode_workspace_never_caps_the_heuristic():
    """pk.decode_workspace holds the default split count of every batch size up to max_num_seqs, and
    is no bigger than the largest of them needs."""
    for max_num_seqs, num_q_heads, num_kv_heads, head_dim in ((1, 8, 8, 64), (64, 32, 8, 128), (300, 12, 4, 160)):
        workspace = pk.decode_workspace(max_num_seqs, num_q_heads, num_kv_heads, head_dim, device="cpu")
        assert workspace.dtype == torch.float32 and workspace.dim() == 1
        sms = 8  # the CPU stand-in of pagedkernels._backend.num_multiprocessors
        needs = [decode_workspace_numel(n, num_q_heads, head_dim,
                                        decode_num_splits(n, num_kv_heads, 1 << 20, sms))
                 for n in range(1, max_num_seqs + 1)]
        assert workspace.numel() == max(needs)
    # a bounded context splits less, so it needs less
    short = pk.decode_workspace(4, 8, 2, 128, device="cpu", max_context=256)
    assert short.numel() < pk.decode_workspace(4, 8, 2, 128, device="cpu").numel()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(num_q_heads=6, num_kv_heads=4), "num_q_heads"),
    (dict(head_dim=72), "head size"),
    (dict(num_kv_heads=2.0), "num_kv_heads"),
])
def test_decode_workspace_bad_arguments(kwargs, match):
    args = dict(max_num_seqs=8, num_q_heads=8, num_kv_heads=2, head_dim=64, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pk.decode_workspace(**args)


# ---------------------------------------------------------------------------------------------
# the split heuristic
# ---------------------------------------------------------------------------------------------

def test_num_splits_heuristic():
    grid = [(s, h, c, sm) for s in (1, 4, 64, 1024) for h in (1, 8) for c in (0, 16, 512, 4096, 131072)
            for sm in (8, 132)]
    for num_seqs, num_kv_heads, context, sms in grid:
        n = decode_num_splits(num_seqs, num_kv_heads, context, sms)
        assert 1 <= n <= MAX_SPLITS
        assert decode_num_splits(num_seqs, num_kv_heads, context, sms, max_splits=4) <= 4
        if n > 1:  # each split streams at least MIN_TILES_PER_SPLIT tiles
            assert context // n >= MIN_TILES_PER_SPLIT * TILE_N
            assert num_seqs * num_kv_heads * (n - 1) < 2 * sms  # no more than ~2 waves
        # monotone: longer context never fewer splits, bigger batch never more
        assert decode_num_splits(num_seqs, num_kv_heads, 2 * context, sms) >= n
        assert decode_num_splits(2 * num_seqs, num_kv_heads, context, sms) <= n
    # H100 (132 SMs), 8 KV heads, 4096 tokens: one sequence splits to the cap, a big batch not at all.
    assert decode_num_splits(1, 8, 4096, 132) == 32
    assert decode_num_splits(8, 8, 4096, 132) == 5
    assert decode_num_splits(64, 8, 4096, 132) == 1
    assert decode_num_splits(1, 8, 64, 132) == 1  # too short to split


# ---------------------------------------------------------------------------------------------
# the reduce fused into the split kernel (split_counters)
# ---------------------------------------------------------------------------------------------

# 70 tokens are 3 tiles of 32: 7 and 16 splits leave splits with no tile (and rows of seq_len 0 have none).
@pytest.mark.triton
@pytest.mark.parametrize("num_splits", [2, 3, 7, 16])
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (40, 10.0)])
def test_split_counters_fuse_the_reduce(num_splits, sliding_window, softcap, device, launches):
    """With split_counters the split kernel's last program per (sequence, KV head) merges the splits: no reduce
    launch, the oracle's result (and the two-kernel one's, up to the order of the sums), the counters zero again,
    and those past num_seqs * num_kv_heads untouched. A group of 3 (heads padded to 16 rows) and head 80 (padded
    to 128 columns): the merge masks both."""
    q, kv = _case([1, 40, 70, 0, 33], num_kv_heads=2, group=3, head_dim=80, device=device, seed=num_splits)
    counters = torch.zeros(10 + 3, dtype=torch.int32, device=device)
    counters[10:] = 7
    options = dict(num_splits=num_splits, sliding_window=sliding_window, softcap=softcap)
    unfused = _run_and_check("triton", q, kv, **options)
    fused = _run_and_check("triton", q, kv, split_counters=counters, **options)
    split, reduce = launches
    assert split.grids == [(5, 2, num_splits)] * 2 and reduce.grids == [(5, 6)]
    torch.testing.assert_close(fused, unfused, atol=1e-6, rtol=1e-5)
    assert torch.all(fused[3] == 0)
    assert counters[:10].tolist() == [0] * 10 and counters[10:].tolist() == [7] * 3
    # again with the same counters (a graph replays so), and with a workspace of the caller's
    workspace = torch.full((decode_workspace_numel(5, 6, 80, num_splits),), float("nan"), device=device)
    again = _run_and_check("triton", q, kv, split_counters=counters, workspace=workspace, **options)
    torch.testing.assert_close(again, fused, atol=0, rtol=0)
    assert counters[:10].tolist() == [0] * 10 and len(reduce.grids) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_counters_without_splits_or_on_other_backends(backend, device, launches):
    """One split writes the output directly and the PyTorch and native backends split nothing: the counters are
    accepted, never touched, and the result is the one without them."""
    q, kv = _case([5, 40], device=device, seed=21)
    counters = torch.zeros(4, dtype=torch.int32, device=device)
    for num_splits in (1, None) if backend == "triton" else (3,):
        plain = _run_and_check(backend, q, kv, num_splits=num_splits)
        given = _run_and_check(backend, q, kv, num_splits=num_splits, split_counters=counters)
        torch.testing.assert_close(given, plain, atol=0, rtol=0)
        assert counters.tolist() == [0] * 4
    if backend == "triton" and device == "cpu":
        assert launches[1].grids == []   # the interpreter's device has few SMs: the heuristic splits nothing here


def test_decode_split_counters():
    counters = pk.decode_split_counters(4, 8, device="cpu")
    assert counters.dtype == torch.int32 and counters.shape == (32,) and not counters.any()
    for kwargs, match in ((dict(max_num_seqs=0, num_kv_heads=8), "max_num_seqs"),
                          (dict(max_num_seqs=4, num_kv_heads=True), "num_kv_heads")):
        with pytest.raises(ValueError, match=match):
            pk.decode_split_counters(**kwargs, device="cpu")


@pytest.mark.triton
def test_split_counters_left_nonzero_are_refused(device, monkeypatch):
    """Counters another launch still holds (or garbage) would merge too early or never: with value checks on
    (always on CPU, PAGEDKERNELS_DEBUG=1 on CUDA) the launch refuses them."""
    monkeypatch.setenv("PAGEDKERNELS_DEBUG", "1")
    q, kv = _case([5, 40], device=device)
    counters = torch.tensor([0, 0, 1, 0], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="split_counters must be all zeros"):
        _run("triton", q, kv, num_splits=2, split_counters=counters)


# ---------------------------------------------------------------------------------------------
# argument validation
# ---------------------------------------------------------------------------------------------

def _valid_args():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=gen)
    key_cache = torch.randn(6, 16, 2, 64, generator=gen)
    value_cache = torch.randn(6, 16, 2, 64, generator=gen)
    block_tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 48], dtype=torch.int32)
    return dict(q=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens)


def _call(args, **kwargs):
    args = dict(args)
    return pk.paged_decode_attention(args.pop("q"), args.pop("key_cache"), args.pop("value_cache"),
                                     args.pop("block_tables"), args.pop("seq_lens"), **args, **kwargs)


BAD_ARGUMENTS = [
    ("q", dict(q=[[1.0]])),
    ("q", dict(q=torch.randn(2, 256))),
    ("q", dict(q=torch.randint(0, 3, (2, 4, 64)))),
    ("key_cache", dict(q=torch.randn(2, 4, 64).half())),  # q fp16, caches fp32
    ("key_cache", dict(key_cache=torch.randn(6, 16, 128))),
    ("key_cache", dict(key_cache=torch.randn(6, 16, 2, 64, device="meta"))),
    ("key_cache", dict(key_cache=torch.randn(6, 16, 2, 128)[..., ::2], value_cache=torch.randn(6, 16, 2, 64))),
    ("value_cache", dict(value_cache=torch.randn(6, 16, 2, 64).half())),
    ("value_cache", dict(value_cache=torch.randn(6, 8, 2, 64))),
    ("key_cache", dict(q=torch.randn(2, 4, 128))),  # head_dim differs from the caches'
    ("head size", dict(q=torch.randn(2, 4, 40), key_cache=torch.randn(6, 16, 2, 40),
                       value_cache=torch.randn(6, 16, 2, 40))),  # not a multiple of 16
    ("head size", dict(q=torch.randn(2, 4, 16), key_cache=torch.randn(6, 16, 2, 16),
                       value_cache=torch.randn(6, 16, 2, 16))),  # under 32
    ("head size", dict(q=torch.randn(2, 4, 272), key_cache=torch.randn(6, 16, 2, 272),
                       value_cache=torch.randn(6, 16, 2, 272))),  # over 256
    ("num_q_heads", dict(q=torch.randn(2, 3, 64))),  # 3 query heads over 2 KV heads
    ("block_tables", dict(block_tables=torch.zeros(2, 3, dtype=torch.int64))),
    ("block_tables", dict(block_tables=torch.zeros(3, 3, dtype=torch.int32))),
    ("block_tables", dict(block_tables=torch.zeros(6, dtype=torch.int32))),
    ("block_tables", dict(block_tables=torch.zeros(2, 3, dtype=torch.int32, device="meta"))),
    ("seq_lens", dict(seq_lens=torch.tensor([20, 48]))),  # int64
    ("seq_lens", dict(seq_lens=torch.tensor([20, 48, 1], dtype=torch.int32))),
    ("seq_lens", dict(seq_lens=torch.tensor([20, 48], dtype=torch.int32, device="meta"))),
    ("scale", dict(scale=0.0)),
    ("scale", dict(scale=-1.0)),
    ("sliding_window", dict(sliding_window=0)),
    ("sliding_window", dict(sliding_window=2.5)),
    ("sliding_window", dict(sliding_window=True)),
    ("softcap", dict(softcap=0.0)),
    ("softcap", dict(softcap=-3.0)),
    ("num_splits", dict(num_splits=0)),
    ("num_splits", dict(num_splits=2.0)),
    ("out", dict(out=torch.empty(2, 4, 63))),
    ("out", dict(out=torch.empty(2, 4, 64, dtype=torch.float16))),
    ("out", dict(out=torch.empty(2, 4, 64, device="meta"))),
    ("out", dict(out=torch.empty(2, 4, 128)[..., ::2])),
    ("workspace", dict(workspace=torch.empty(8192, dtype=torch.float16))),
    ("workspace", dict(workspace=torch.empty(2, 4096))),
    ("workspace", dict(workspace=torch.empty(8192, device="meta"))),
    ("workspace", dict(workspace=torch.empty(16384)[::2])),
    ("workspace", dict(workspace=[0.0] * 8192)),
    # 3 splits of 2 sequences x 4 heads x (64 + 1) floats need 1560
    ("workspace", dict(workspace=torch.empty(1559), num_splits=3)),
    ("split_counters", dict(split_counters=torch.zeros(4))),
    ("split_counters", dict(split_counters=torch.zeros(4, dtype=torch.int64))),
    ("split_counters", dict(split_counters=torch.zeros(2, 2, dtype=torch.int32))),
    ("split_counters", dict(split_counters=torch.zeros(8, dtype=torch.int32)[::2])),
    ("split_counters", dict(split_counters=torch.zeros(4, dtype=torch.int32, device="meta"))),
    ("split_counters", dict(split_counters=torch.zeros(3, dtype=torch.int32))),  # 2 sequences x 2 KV heads
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,overrides", BAD_ARGUMENTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_raise_before_launch(backend, name, overrides, monkeypatch):
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", _LaunchRecorder(None, fail=True))
    monkeypatch.setattr(decode_attention, "_decode_reduce_kernel", _LaunchRecorder(None, fail=True))
    args = _valid_args()
    kwargs = {k: v for k, v in overrides.items() if k not in args}
    args.update({k: v for k, v in overrides.items() if k in args})
    with pk.use_backend(backend), pytest.raises(ValueError, match=name):
        _call(args, **kwargs)


def test_valid_arguments_pass():
    """The base of the cases above is itself valid, so each case fails for its own reason."""
    with pk.use_backend("torch"):
        out = _call(_valid_args())
    assert out.shape == (2, 4, 64) and torch.isfinite(out).all()


BAD_VALUES = [
    ("too short", dict(seq_lens=torch.tensor([20, 49], dtype=torch.int32))),  # 3 blocks x 16 < 49
    ("out of range", dict(block_tables=torch.tensor([[0, 1, 2], [3, 4, 6]], dtype=torch.int32))),
    ("out of range", dict(block_tables=torch.tensor([[0, -1, 2], [3, 4, 5]], dtype=torch.int32))),
    ("capacity", dict(key_cache=torch.randn(2, 16, 2, 64), value_cache=torch.randn(2, 16, 2, 64),
                      block_tables=torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]], dtype=torch.int32),
                      seq_lens=torch.tensor([20, 40], dtype=torch.int32))),
    ("seq_lens", dict(seq_lens=torch.tensor([20, -1], dtype=torch.int32))),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("match,overrides", BAD_VALUES, ids=[m for m, _ in BAD_VALUES])
def test_bad_values_raise(backend, match, overrides, device, monkeypatch):
    if device == "cuda":  # value checks sync the GPU, so they run there only in debug mode
        monkeypatch.setenv("PAGEDKERNELS_DEBUG", "1")
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", _LaunchRecorder(None, fail=True))
    args = {**_valid_args(), **overrides}
    args = {k: v.to(device) for k, v in args.items()}
    with pk.use_backend(backend), pytest.raises(ValueError, match=match):
        _call(args)


# ---------------------------------------------------------------------------------------------
# CUDA only
# ---------------------------------------------------------------------------------------------

def capture_allocating_nothing(call, out):
    """``call`` run once (compiled) outside a capture, then captured in a CUDA graph; asserts the capture allocated
    nothing and returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    # torch's CUDA generator allocates its two graph-safe RNG tensors (1 KiB) when the first graph registers
    # and frees them when the last one goes: a capture that stays alive goes first, so the decode capture's
    # growth is the launch's own (measured on an H100: empty capture +1024, decode capture after it +0; on an
    # H200 with that first graph dropped before the decode capture, +1024 again).
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        out.zero_()
    graph = torch.cuda.CUDAGraph()
    allocated = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        call()
    assert torch.cuda.memory_allocated() == allocated
    del first
    return graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True], ids=["split+reduce", "split_counters"])
def test_cuda_graph_capture_and_replay(fused, monkeypatch):
    """No host sync and a shape-only grid: the launch captures, and replays follow new seq_lens. With
    ``out`` and the split-K workspace from the caller, the captured launch allocates nothing. With
    ``split_counters`` each replay leaves them zero for the next."""
    monkeypatch.delenv("PAGEDKERNELS_DEBUG", raising=False)
    q, kv = _case([5, 40, 70], num_kv_heads=2, group=4, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    workspace = pk.decode_workspace(3, 8, 2, 64, device="cuda")
    counters = pk.decode_split_counters(3, 2, device="cuda") if fused else None
    call = lambda: pk.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                             num_splits=3, out=out, workspace=workspace, split_counters=counters)
    graph = capture_allocating_nothing(call, out)
    for lens in ([5, 40, 70], [1, 17, 64], [0, 70, 3], [5, 40, 70]):
        kv.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.stack([attention_oracle(q[s:s + 1], kv.keys[s][:n], kv.values[s][:n])[0]
                                if n else torch.zeros(q.shape[1:], dtype=torch.float64) for s, n in enumerate(lens)])
        assert_attention_close(out, expected)
        if fused:
            assert not counters.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_counters_under_contention_on_cuda(dtype, monkeypatch):
    """Many programs racing for each counter on a real GPU: 48 sequences x 8 KV heads, each split 32 ways
    (12288 programs at once, head 128, group 4), launched 20 times back to back on one set of counters. Every
    launch equals the two-kernel one up to the order of the sums, and the counters end at zero."""
    monkeypatch.delenv("PAGEDKERNELS_DEBUG", raising=False)
    lens = [1 + (37 * i) % 1500 for i in range(48)]
    q, kv = _case(lens, num_kv_heads=8, group=4, head_dim=128, dtype=dtype, device="cuda", seed=3)
    counters = pk.decode_split_counters(48, 8, device="cuda")
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    unfused = pk.paged_decode_attention(*args, num_splits=32)
    assert_attention_close(unfused, _expected(q, kv))
    for _ in range(20):
        fused = pk.paged_decode_attention(*args, num_splits=32, split_counters=counters)
        torch.testing.assert_close(fused.float(), unfused.float(), atol=2e-3 if dtype != torch.float32 else 1e-5,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-5)
    torch.cuda.synchronize()
    assert not counters.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cache_over_2_pow_31_elements():
    """Blocks whose element offset exceeds 2**31 are addressed correctly (int64 offsets)."""
    block_size, num_kv_heads, head_dim = 16, 1, 128
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 64
    needed = 2 * num_blocks * block_size * num_kv_heads * head_dim * 2  # two fp16 caches
    if torch.cuda.mem_get_info()[0] < needed + 2**30:
        pytest.skip("needs about 9 GB of free GPU memory")
    q, kv = _case([40, 70], num_kv_heads=num_kv_heads, group=4, head_dim=head_dim, block_size=block_size,
                  dtype=torch.float16, device="cuda")
    key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
    value_cache = torch.empty_like(key_cache)
    # Move every used block to the top of the big cache (past 2**31 elements).
    table = kv.block_tables.long()
    high = table + (num_blocks - kv.key_cache.shape[0])
    key_cache[high.flatten()] = kv.key_cache[table.flatten()]
    value_cache[high.flatten()] = kv.value_cache[table.flatten()]
    assert high.min().item() * block_size * num_kv_heads * head_dim >= 2**31
    for num_splits in (1, 3):
        out = pk.paged_decode_attention(q, key_cache, value_cache, high.to(torch.int32), kv.seq_lens,
                                        num_splits=num_splits)
        assert_attention_close(out, _expected(q, kv))
