"""pagedkernels.torch_ops: the ops registered as torch custom ops.

torch.library.opcheck validates each registration (schema, declared mutations, fake impl against
the real one); a function calling all of them compiles with fullgraph=True (no graph breaks) and
gives the eager results, K/V cache writes and in-place rotary/norm updates included.
"""

from __future__ import annotations

import torch

import pagedkernels as pk
from pagedkernels import torch_ops
from tests.pagedkernels.oracle import make_paged_kv

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 2, 64, 16
NUM_HEADS = NUM_KV_HEADS * GROUP


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [5, 17, 33]
    kv = make_paged_kv(seq_lens, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu", generator=gen)
    num_seqs = len(seq_lens)
    # The decode step's new token of each sequence goes to its last slot (position seq_len - 1).
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.stack([kv.block_tables[s, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
                         for s, p in enumerate(positions.tolist())])
    return dict(
        kv=kv, positions=positions, slots=slots,
        x=torch.randn(num_seqs, 32, generator=gen),
        w_qkv=torch.randn(32, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen) / 6,
        norm_weight=torch.rand(NUM_HEADS * HEAD_DIM, generator=gen) + 0.5,
        cos_sin=pk.compute_cos_sin_cache(64, HEAD_DIM, 10000.0),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32),
    )


def _step(ops, inp, key_cache, value_cache):
    """A decode step's attention block written against an ops namespace (pk or torch_ops)."""
    kv = inp["kv"]
    qkv = inp["x"] @ inp["w_qkv"]
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.view(-1, NUM_HEADS, HEAD_DIM), k.view(-1, NUM_KV_HEADS, HEAD_DIM), v.view(-1, NUM_KV_HEADS, HEAD_DIM)
    ops.rotary_embedding(inp["positions"], q, k, inp["cos_sin"], is_neox=True)  # in place on views of qkv
    ops.reshape_and_cache(k, v, key_cache, value_cache, inp["slots"])
    decode = ops.paged_decode_attention(q, key_cache, value_cache, kv.block_tables, kv.seq_lens, scale=0.1,
                                        sliding_window=20)
    prefill = ops.paged_prefill_attention(q, key_cache, value_cache, kv.block_tables, inp["cu_seqlens_q"],
                                          kv.seq_lens, scale=0.1, sliding_window=20)
    hidden = ops.rms_norm(decode.flatten(1), inp["norm_weight"], 1e-6)
    residual = prefill.flatten(1).clone()
    hidden, residual = ops.fused_add_rms_norm(hidden, residual, inp["norm_weight"], 1e-6)
    return ops.silu_and_mul(hidden), residual


def test_registered_under_torch_ops():
    for name in ("reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
                 "fused_add_rms_norm_", "rotary_embedding", "silu_and_mul"):
        assert hasattr(torch.ops.pagedkernels, name), name


def test_compiled_fullgraph_matches_eager():
    # aot_eager: dynamo's full trace and AOT functionalization of the mutations, without the ~15 s
    # of inductor's C++ compile (the engine's compiled decode path is exercised in tests/engine).
    torch._dynamo.reset()
    inp = _inputs()
    caches = [(inp["kv"].key_cache.clone(), inp["kv"].value_cache.clone()) for _ in range(3)]
    expected = _step(pk, inp, *caches[0])
    eager_ops = _step(torch_ops, inp, *caches[1])
    compiled = torch.compile(lambda i, kc, vc: _step(torch_ops, i, kc, vc), fullgraph=True, backend="aot_eager")
    got = compiled(inp, *caches[2])
    for a, b, c in zip(expected, eager_ops, got):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
    # The cache writes (a mutated input) happened under compile too; untouched slots keep their NaN.
    for ref, cache in zip(caches[0], caches[2]):
        torch.testing.assert_close(cache, ref, atol=1e-6, rtol=0, equal_nan=True)
    assert not torch.equal(caches[2][0].nan_to_num(), inp["kv"].key_cache.nan_to_num()), "no K was written"


def test_opcheck():
    inp = _inputs(seed=1)
    kv = inp["kv"]
    num_tokens = inp["x"].shape[0]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    hidden = torch.randn(num_tokens, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    # The torch paths read table entries only where seq_lens say; opcheck compares results with
    # equal_nan semantics off, so give it caches without NaN.
    key_cache, value_cache = kv.key_cache.nan_to_num(), kv.value_cache.nan_to_num()
    cases = [
        (torch.ops.pagedkernels.reshape_and_cache, (k, k.clone(), key_cache.clone(), value_cache.clone(), inp["slots"])),
        (torch.ops.pagedkernels.paged_decode_attention, (q, key_cache, value_cache, kv.block_tables, kv.seq_lens,
                                                         0.1, None, 30.0)),
        (torch.ops.pagedkernels.paged_prefill_attention, (q, key_cache, value_cache, kv.block_tables,
                                                          inp["cu_seqlens_q"], kv.seq_lens, None, 7, None)),
        (torch.ops.pagedkernels.rms_norm, (hidden, weight, 1e-6)),
        (torch.ops.pagedkernels.fused_add_rms_norm_, (hidden.clone(), hidden.flip(0).clone(), weight, 1e-6)),
        (torch.ops.pagedkernels.rotary_embedding, (inp["positions"], q.clone(), k.clone(), inp["cos_sin"], True)),
        (torch.ops.pagedkernels.silu_and_mul, (hidden,)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
