"""pk.rotary_cache_decode_attention: a decode step's rotary embedding, KV-cache write and attention in one split
kernel, against the two ops it replaces (rotary_embedding_and_cache, then paged_decode_attention) and the float64
attention oracle over the cache those two leave.

The Triton kernel runs interpreted on CPU tensors (small shapes) and compiled on CUDA; the PyTorch and native
backends run the two ops on copies of q and k, so every backend must leave q, k and v as they were.
"""

from dataclasses import dataclass

import pytest
import torch

import pagedkernels as pk
from pagedkernels import decode_attention, rotary
from tests.pagedkernels.oracle import assert_attention_close, attention_oracle, make_paged_kv
from tests.pagedkernels.test_decode_attention import _LaunchRecorder, capture_allocating_nothing

BACKENDS = ["triton", "torch", "native"]


@dataclass
class Step:
    positions: torch.Tensor
    qkv: torch.Tensor   # [num_seqs, (q + 2 kv heads) * head_dim]: q, k, v are strided views of it
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    rope: dict   # is_neox, q_weight, k_weight, eps

    def args(self, key_cache=None, value_cache=None):
        return (self.positions, self.q, self.k, self.v, self.key_cache if key_cache is None else key_cache,
                self.value_cache if value_cache is None else value_cache, self.slot_mapping, self.cos_sin_cache,
                self.block_tables, self.seq_lens)


def _step(seq_lens, *, num_kv_heads=2, group=2, head_dim=64, rot_dim=None, block_size=16, dtype=torch.float32,
          device="cpu", norm=False, is_neox=True, fp8=False, uncached=(), seed=0) -> Step:
    """A decode step: every sequence's cache holds its first seq_len - 1 tokens (position seq_len - 1 holds stale
    values the step overwrites), and its new token's un-rotated q/k/v sit in one fused qkv row."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, "cpu", generator=gen)
    num_q_heads = num_kv_heads * group
    qkv = torch.randn(len(seq_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    lens = kv.seq_lens.long()
    slots = []
    for s, n in enumerate(seq_lens):
        last = n - 1
        slots.append(-1 if n == 0 or s in uncached else
                     int(kv.block_tables[s, last // block_size]) * block_size + last % block_size)
    rope = {"is_neox": is_neox}
    if norm:
        rope.update(q_weight=(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device),
                    k_weight=(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device), eps=1e-6)
    key_cache, value_cache = kv.key_cache, kv.value_cache
    if fp8:
        key_cache = (key_cache.float().nan_to_num() / 0.5).to(torch.float8_e4m3fn)
        value_cache = (value_cache.float().nan_to_num() / 2.0).to(torch.float8_e4m3fn)
    qkv = qkv.to(device)
    return Step(positions=(lens - 1).clamp(min=0).to(device), qkv=qkv,
                q=qkv[:, :q_end].view(len(seq_lens), num_q_heads, head_dim),
                k=qkv[:, q_end:k_end].view(len(seq_lens), num_kv_heads, head_dim),
                v=qkv[:, k_end:].view(len(seq_lens), num_kv_heads, head_dim),
                key_cache=key_cache.to(device), value_cache=value_cache.to(device),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                cos_sin_cache=pk.compute_cos_sin_cache(512, rot_dim or head_dim, 10000.0, device=device),
                block_tables=kv.block_tables.to(device), seq_lens=kv.seq_lens.to(device), rope=rope)


def _two_ops(step: Step, **options):
    """The reference: rotary_embedding_and_cache on copies of q and k and the caches (PyTorch backend), then the
    float64 oracle over each sequence's cache as the write left it, its query rotated. Returns (expected output,
    key cache, value cache)."""
    scales = {k: options[k] for k in ("k_scale", "v_scale") if k in options}
    q, k = step.q.clone(), step.k.clone()
    key_cache, value_cache = step.key_cache.clone(), step.value_cache.clone()
    with pk.use_backend("torch"):
        pk.rotary_embedding_and_cache(step.positions, q, k, step.v, key_cache, value_cache, step.slot_mapping,
                                      step.cos_sin_cache, **step.rope, **scales)
    block_size = key_cache.shape[1]
    rows = []
    for s, n in enumerate(step.seq_lens.tolist()):
        if n == 0:
            rows.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            continue
        pos = torch.arange(n)
        blocks = step.block_tables[s].long().cpu()[pos // block_size]
        keys = key_cache.cpu()[blocks, pos % block_size].double() * options.get("k_scale", 1.0)
        values = value_cache.cpu()[blocks, pos % block_size].double() * options.get("v_scale", 1.0)
        oracle = {k: options[k] for k in ("scale", "sliding_window", "softcap") if k in options}
        rows.append(attention_oracle(q[s:s + 1], keys, values, **oracle)[0])
    return torch.stack(rows), key_cache, value_cache


def _fused(backend, step: Step, **options):
    before = step.qkv.clone()
    key_cache, value_cache = step.key_cache.clone(), step.value_cache.clone()
    with pk.use_backend(backend):
        out = pk.rotary_cache_decode_attention(*step.args(key_cache, value_cache), **step.rope, **options)
    assert torch.equal(step.qkv, before), "q, k and v must not be modified"
    assert out.shape == step.q.shape and out.dtype == step.q.dtype and out.device == step.q.device
    return out, key_cache, value_cache


def _assert_caches_equal(got, expected):
    """The caches the fused op left against the two ops': each value rounded alike, up to one rounding of the
    float32 arithmetic before it (another backend's or kernel's multiply-add contraction, the norm's sum of squares
    in another order); float8 codes at most one apart. Unwritten slots (NaN-filled by make_paged_kv) stay so."""
    if got.dtype == torch.float8_e4m3fn:
        diff = (got.view(torch.uint8).int() - expected.view(torch.uint8).int()).abs()
        assert int(diff.max()) <= 1
        return
    assert torch.equal(got.isnan(), expected.isnan())
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.nan_to_num(0.0), expected.nan_to_num(0.0), atol=8 * eps, rtol=2 * eps)


CASES = {
    # name: (seq_lens, step options, op options)
    "plain": ([1, 40, 77], {}, {}),
    "three splits": ([1, 40, 77], {}, {"num_splits": 3}),
    "qwen3 norms, split": ([33, 64, 2], {"norm": True}, {"num_splits": 2}),
    "group 3, head 80 (padded)": ([5, 50], {"group": 3, "head_dim": 80, "norm": True}, {}),
    "gpt-j pairs, partial rotary": ([9, 31], {"is_neox": False, "rot_dim": 32, "norm": True}, {}),
    "neox, partial rotary": ([9, 31], {"rot_dim": 32}, {"num_splits": 2}),
    "window + softcap, padding row": ([0, 40, 77], {}, {"sliding_window": 20, "softcap": 30.0, "num_splits": 2}),
    "page 8, uncached row": ([3, 26], {"block_size": 8, "uncached": (1,)}, {"scale": 0.2}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_rotary_and_cache_then_decode(case, dtype, backend, device):
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")
    seq_lens, step_options, options = CASES[case]
    step = _step(seq_lens, dtype=dtype, device=device, **step_options)
    expected, key_cache, value_cache = _two_ops(step, **options)
    out, got_k, got_v = _fused(backend, step, **options)
    assert_attention_close(out, expected)
    _assert_caches_equal(got_k, key_cache)
    _assert_caches_equal(got_v, value_cache)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_float8_cache(backend, dtype, device):
    """A float8 e4m3 cache: the new key and value cached as e4m3(x / scale), and the attention over the codes, the
    new token's included, as the two ops give (float32 queries: the kernel's 16-token tiles)."""
    step = _step([1, 40, 77], dtype=dtype, device=device, norm=True, fp8=True)
    options = {"k_scale": 0.5, "v_scale": 2.0, "num_splits": 2}
    expected, key_cache, value_cache = _two_ops(step, **options)
    out, got_k, got_v = _fused(backend, step, **options)
    assert_attention_close(out, expected)
    _assert_caches_equal(got_k, key_cache)
    _assert_caches_equal(got_v, value_cache)


@pytest.mark.triton
def test_one_launch(triton_device, monkeypatch):
    """On the Triton backend one split kernel does it all: no rotary/cache kernel, and with split counters no
    reduce kernel."""
    split = _LaunchRecorder(decode_attention._decode_split_kernel)
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", split)
    monkeypatch.setattr(decode_attention, "_decode_reduce_kernel", _LaunchRecorder(None, fail=True))
    monkeypatch.setattr(rotary, "_rotary_cache_kernel", _LaunchRecorder(None, fail=True))
    step = _step([1, 40, 77], device=triton_device, norm=True)
    counters = pk.decode_split_counters(3, 2, device=triton_device)
    expected, key_cache, _ = _two_ops(step, num_splits=3)
    out, got_k, _ = _fused("triton", step, num_splits=3, split_counters=counters)
    assert split.grids == [(3, 2, 3)]
    assert not counters.any()
    assert_attention_close(out, expected)
    _assert_caches_equal(got_k, key_cache)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_value_checks(backend, device, monkeypatch):
    """A slot that is not the new token's position under its block table, positions past the cos/sin table:
    refused before anything is written (PAGEDKERNELS_DEBUG's checks)."""
    monkeypatch.setenv("PAGEDKERNELS_DEBUG", "1")
    step = _step([3, 40], device=device)
    step.slot_mapping[1] += 1
    key_cache = step.key_cache.clone()
    with pk.use_backend(backend), pytest.raises(ValueError, match="slot_mapping"):
        pk.rotary_cache_decode_attention(*step.args(), **step.rope)
    if backend == "triton":   # the other backends' cache write takes any slot in range (reshape_and_cache)
        assert torch.equal(step.key_cache.nan_to_num(1.0), key_cache.nan_to_num(1.0))
    step = _step([3, 40], device=device)
    step.positions[0] = 10_000
    with pk.use_backend(backend), pytest.raises(ValueError, match="positions"):
        pk.rotary_cache_decode_attention(*step.args(), **step.rope)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_dimensional_views(backend, device):
    """q, k and v as the 2-D column slices of a fused qkv (the engine's layout before its views), with a partial
    rotary: the head size comes from the cache (or head_size), not from the rotary table."""
    step = _step([9, 31], rot_dim=32, device=device)
    expected, key_cache, _ = _two_ops(step)
    flat = Step(**{**vars(step), "q": step.q.flatten(1), "k": step.k.flatten(1), "v": step.v.flatten(1)})
    for options in ({}, {"head_size": 64}):
        cache = step.key_cache.clone()
        with pk.use_backend(backend):
            out = pk.rotary_cache_decode_attention(*flat.args(cache, step.value_cache.clone()), **step.rope, **options)
        assert_attention_close(out, expected)
        _assert_caches_equal(cache, key_cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tensors(backend, monkeypatch):
    """On meta tensors (and fake ones: tests/engine/test_fake_cuda.py's engine) the checks run and the output is
    allocated; no kernel and no PyTorch twin is reached."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was reached with tensors that hold no data")

    for module, attr in ((decode_attention, "_decode_triton"), (decode_attention, "_decode_torch"),
                         (decode_attention, "rotary_embedding_and_cache")):
        monkeypatch.setattr(module, attr, no_kernel)
    step = _step([3, 40], norm=True)
    meta = Step(**{name: value.to("meta") if isinstance(value, torch.Tensor) else value
                   for name, value in vars(step).items()})
    meta.rope = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in step.rope.items()}
    with pk.use_backend(backend):
        out = pk.rotary_cache_decode_attention(*meta.args(), **meta.rope, num_splits=2)
    assert out.device.type == "meta" and out.shape == step.q.shape and out.dtype == step.q.dtype
    with pytest.raises(ValueError, match="is on meta"):   # one tensor on another device than the rest
        pk.rotary_cache_decode_attention(*step.args()[:-1], meta.seq_lens, **step.rope)


@pytest.mark.parametrize("name, change, match", [
    ("k heads", lambda s: s.__setattr__("k", s.k[:, :1]), "key_cache|num_kv_heads|k"),
    ("v dtype", lambda s: s.__setattr__("v", s.v.double()), "v"),
    ("q tokens", lambda s: s.__setattr__("q", s.q[:1]), "q"),
    ("slot dtype", lambda s: s.__setattr__("slot_mapping", s.slot_mapping.int()), "slot_mapping"),
    ("seq_lens", lambda s: s.__setattr__("seq_lens", s.seq_lens[:1]), "seq_lens"),
    ("norm weights", lambda s: s.rope.update(q_weight=torch.ones(64)), "q_weight and k_weight"),
    ("workspace", lambda s: None, "workspace"),
])
def test_bad_arguments(name, change, match):
    step = _step([3, 40])
    change(step)
    options = {"num_splits": 4, "workspace": torch.empty(8)} if name == "workspace" else {}
    with pytest.raises(ValueError, match=match):
        pk.rotary_cache_decode_attention(*step.args(), **step.rope, **options)


# ---------------------------------------------------------------------------------------------
# CUDA only
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_graph_capture_and_replay(dtype, monkeypatch):
    """Captured with the caller's out, workspace and split counters: no allocation, and replays follow new
    positions, slots and lengths (each replay writes its step's token into the cache)."""
    monkeypatch.delenv("PAGEDKERNELS_DEBUG", raising=False)
    step = _step([5, 40, 70], group=4, dtype=dtype, device="cuda", norm=True)
    out = torch.empty_like(step.q)
    workspace = pk.decode_workspace(3, 8, 2, 64, device="cuda")
    counters = pk.decode_split_counters(3, 2, device="cuda")
    graph = capture_allocating_nothing(
        lambda: pk.rotary_cache_decode_attention(*step.args(), **step.rope, num_splits=3, out=out,
                                                 workspace=workspace, split_counters=counters), out)
    for lens in ([6, 41, 71], [1, 17, 64], [0, 70, 3]):
        fresh = _step(lens, group=4, dtype=dtype, device="cuda", norm=True, seed=len(lens) + lens[1])
        # The same tables (a shorter length only uses fewer of its blocks): the new slots under them.
        block_size = step.key_cache.shape[1]
        slots = [-1 if n == 0 else int(step.block_tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                 for s, n in enumerate(lens)]
        step.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        step.positions.copy_((step.seq_lens.long() - 1).clamp(min=0))
        step.slot_mapping.copy_(torch.tensor(slots))
        step.qkv.copy_(fresh.qkv)
        expected, key_cache, _ = _two_ops(step)
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, expected)
        _assert_caches_equal(step.key_cache, key_cache)
        assert not counters.any()
