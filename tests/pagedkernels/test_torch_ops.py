"""pagedkernels.torch_ops: the ops registered as torch custom ops, and the public ops on tensors
without data.

torch.library.opcheck validates each registration (schema, declared mutations, autograd
registration, fake impl against the real one, AOT dispatch with dynamic shapes); a function calling
all of them compiles with inductor, fullgraph and dynamic shapes (no graph breaks) and gives the
eager results, K/V cache writes and in-place rotary/norm updates included. Decode attention is
checked with and without a caller's workspace (two ops: see the module's docstring), and the KV ops
with a float8 cache and its scales; the quantized GEMMs (wq_gemm, gguf_gemm, gguf_dequantize, fp8_gemm, w16_gemm)
and the multi-LoRA ops (lora_shrink, lora_expand_, add_lora_) are in the compiled step too.

The fake implementations run each op's own argument checks: under FakeTensorMode with CUDA tensors
(which FakeTensorMode makes on a CPU-only torch too) every op gives its output's shape, dtype and
device, a tensor on another device is a ValueError naming it, and a bad dtype raises the message
the real op raises. The public ``pk.*`` functions on meta or fake tensors check and allocate only,
under every backend, and never reach a kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import pagedkernels as pk
from pagedkernels import torch_ops
from tests.pagedkernels.oracle import make_paged_kv
from tests.pagedkernels.quant_oracle import random_gguf

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 2, 64, 16
NUM_HEADS = NUM_KV_HEADS * GROUP
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.03


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
        # Sized for the split-K default of 3 sequences on any device (an H100's 132 SMs at most).
        workspace=pk.decode_workspace(num_seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, device="cpu"),
        split_counters=pk.decode_split_counters(num_seqs, NUM_KV_HEADS, device="cpu"),
        # float8 caches (written in the step, then read)
        key_cache8=(kv.key_cache / K_SCALE).clamp(-448, 448).to(FP8),
        value_cache8=(kv.value_cache / V_SCALE).clamp(-448, 448).to(FP8),
        # quantized projections of the step's output: int4 (act-order), GGUF Q4_K, fp8
        wq=pk.quant_formats.quantize_wq(torch.randn(96, 128, generator=gen) / 10, bits=4, group_size=64),
        wq_perm=torch.randperm(128, generator=gen),
        gguf=random_gguf("Q4_K", 48, 256, gen),
        fp8=pk.quantize_fp8_weight(torch.randn(64, 48, generator=gen) / 10),
        w16=pk.pack_w16((torch.randn(40, 64, generator=gen) / 10).to(torch.bfloat16)),
        # a mixture of experts on the step's output: 6 experts of intermediate size 24, top-2
        router=torch.randn(40, 6, generator=gen),
        w13=torch.randn(6, 48, 40, generator=gen) / 6,
        w2=torch.randn(6, 40, 24, generator=gen) / 5,
        # adapters in 3 slots for a 2-slice (24 + 16 outputs) projection of x, rank 8; token 1 without one
        lora_a=torch.randn(3, 16, 32, generator=gen) / 6,
        lora_b=torch.randn(3, 40, 8, generator=gen) / 3,
        lora_base=torch.randn(32, 40, generator=gen) / 6,
        lora_indices=torch.tensor([2, -1, 0], dtype=torch.int32),
        # few-row products of the step's activation: one with its norm first, one added into a residual
        skinny_w=torch.randn(24, 128, generator=gen) / 7,
        skinny_norm=torch.rand(128, generator=gen) + 0.5,
        skinny_bias=torch.randn(24, generator=gen),
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
    # The same with the caller's split-K workspace (the other decode op under torch_ops), and a softcap.
    decode_ws = ops.paged_decode_attention(q, key_cache, value_cache, kv.block_tables, kv.seq_lens, scale=0.1,
                                           softcap=30.0, workspace=inp["workspace"])
    # and with the split counters too (the third decode op: the splits merged in the split kernel)
    decode_fused = ops.paged_decode_attention(q, key_cache, value_cache, kv.block_tables, kv.seq_lens, scale=0.2,
                                              workspace=inp["workspace"], split_counters=inp["split_counters"])
    prefill = ops.paged_prefill_attention(q, key_cache, value_cache, kv.block_tables, inp["cu_seqlens_q"],
                                          kv.seq_lens, scale=0.1, sliding_window=20)
    # the same attention over a float8 cache with its scales
    ops.reshape_and_cache(k, v, inp["key_cache8"], inp["value_cache8"], inp["slots"], k_scale=K_SCALE,
                          v_scale=V_SCALE)
    decode8 = ops.paged_decode_attention(q, inp["key_cache8"], inp["value_cache8"], kv.block_tables, kv.seq_lens,
                                         k_scale=K_SCALE, v_scale=V_SCALE)
    prefill8 = ops.paged_prefill_attention(q, inp["key_cache8"], inp["value_cache8"], kv.block_tables,
                                           inp["cu_seqlens_q"], kv.seq_lens, k_scale=K_SCALE, v_scale=V_SCALE)
    hidden = ops.rms_norm(decode.flatten(1) + decode_ws.flatten(1) + decode8.flatten(1) + decode_fused.flatten(1),
                          inp["norm_weight"], 1e-6)
    residual = prefill.flatten(1) + prefill8.flatten(1)
    hidden, residual = ops.fused_add_rms_norm(hidden, residual, inp["norm_weight"], 1e-6)
    act = ops.silu_and_mul(hidden)  # [num_seqs, 128]
    wq = inp["wq"]
    projected = ops.wq_gemm(act, wq.qweight, wq.scales, wq.zeros, bits=4, group_size=64, perm=inp["wq_perm"])
    gguf_out = ops.gguf_gemm(torch.cat([projected, projected, projected[:, :64]], dim=1), inp["gguf"], "Q4_K")
    gguf_weight = ops.gguf_dequantize(inp["gguf"], "Q4_K", dtype=torch.float32)
    fp8_out = ops.fp8_gemm(gguf_out, *inp["fp8"])
    w16_out = ops.w16_gemm(fp8_out, inp["w16"], 40)
    topk_weights, topk_ids = ops.moe_topk(w16_out @ inp["router"], 2, renormalize=True)
    moe_out = ops.fused_moe(w16_out, inp["w13"], inp["w2"], topk_weights, topk_ids)
    sorted_ids, expert_ids, num_post_padded = ops.moe_align_block_size(topk_ids, 16, 6)
    lora_buffer = ops.lora_shrink(inp["x"], inp["lora_a"], inp["lora_indices"], scale=0.5)
    lora_out = ops.lora_expand(lora_buffer, inp["lora_b"], inp["lora_indices"], inp["x"] @ inp["lora_base"],
                               slice_sizes=(24, 16))
    lora_added = ops.add_lora(inp["x"], inp["lora_a"], inp["lora_b"], inp["lora_indices"], inp["x"] @ inp["lora_base"],
                              scale=0.5, slice_sizes=(24, 16))
    skinny = ops.skinny_gemm(act, inp["skinny_w"], inp["skinny_bias"], norm_weight=inp["skinny_norm"], eps=1e-6)
    skinny_res = ops.skinny_gemm(torch.cat([act, act.flip(0)], dim=1), inp["skinny_w"], gated="silu",
                                 residual=skinny * 2)
    return (act, residual, decode_ws, projected, gguf_out, gguf_weight, fp8_out, w16_out, topk_weights, moe_out,
            sorted_ids, expert_ids, num_post_padded, lora_buffer, lora_out, lora_added, skinny, skinny_res)


def test_every_registered_op_is_listed_and_tested():
    """torch_ops.OPS is every op in the pagedkernels namespace; the specs below (opcheck, fake
    tensors) cover each of them."""
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("pagedkernels::")}
    assert registered == set(torch_ops.OPS)
    assert set(SPECS) == set(torch_ops.OPS) and set(_opcheck_cases()) == set(torch_ops.OPS)
    for name in torch_ops.OPS:
        assert hasattr(torch.ops.pagedkernels, name), name


def test_compiled_fullgraph_inductor_matches_eager():
    """Inductor, fullgraph, dynamic shapes (as the engine compiles its forward): every op is an opaque
    node whose fake implementation ran on symbolic shapes; the results and the mutated inputs (K/V
    caches, rotated q/k, the workspace) match eager."""
    torch._dynamo.reset()
    inp = _inputs()
    caches = [(inp["kv"].key_cache.clone(), inp["kv"].value_cache.clone()) for _ in range(3)]
    expected = _step(pk, inp, *caches[0])
    eager_ops = _step(torch_ops, inp, *caches[1])
    compiled = torch.compile(lambda i, kc, vc: _step(torch_ops, i, kc, vc), fullgraph=True, backend="inductor",
                             dynamic=True)
    got = compiled(inp, *caches[2])
    for a, b, c in zip(expected, eager_ops, got):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
    # The cache writes (a mutated input) happened under compile too; untouched slots keep their NaN.
    for ref, cache in zip(caches[0], caches[2]):
        torch.testing.assert_close(cache, ref, atol=1e-6, rtol=0, equal_nan=True)
    assert not torch.equal(caches[2][0].nan_to_num(), inp["kv"].key_cache.nan_to_num()), "no K was written"


def _opcheck_cases():
    inp = _inputs(seed=1)
    kv = inp["kv"]
    num_tokens = inp["x"].shape[0]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    hidden = torch.randn(num_tokens, 96, generator=gen)
    weight = torch.rand(96, generator=gen) + 0.5
    wq = inp["wq"]
    fp8_weight, fp8_scale = inp["fp8"]
    # The torch paths read table entries only where seq_lens say; opcheck compares results with
    # equal_nan semantics off, so give it caches without NaN.
    key_cache, value_cache = kv.key_cache.nan_to_num(), kv.value_cache.nan_to_num()
    decode = (q, key_cache, value_cache, kv.block_tables, kv.seq_lens)
    key_cache8, value_cache8 = (c.float().nan_to_num().to(FP8) for c in (inp["key_cache8"], inp["value_cache8"]))
    lora_indices = torch.tensor([3, -1, 0], dtype=torch.int32)
    lora_mapping = pk.lora_mapping(lora_indices, 4)
    lora_ranks = torch.tensor([[16, 8, 0], [4, 4, 4], [16, 16, 16], [8, 16, 12]], dtype=torch.int32)
    decode8 = (q, key_cache8, value_cache8, kv.block_tables, kv.seq_lens)
    return {
        "reshape_and_cache": (k, k.clone(), key_cache.clone(), value_cache.clone(), inp["slots"]),
        "paged_decode_attention": (*decode, 0.1, None, 30.0),
        "paged_decode_attention_workspace": (*decode8, inp["workspace"].zero_(), None, 9, None, K_SCALE, V_SCALE),
        "paged_decode_attention_fused_reduce": (*decode, inp["workspace"].clone(), torch.zeros(6, dtype=torch.int32),
                                                0.3, None, 20.0),
        "paged_prefill_attention": (q, key_cache8, value_cache8, kv.block_tables, inp["cu_seqlens_q"], kv.seq_lens,
                                    None, 7, None, K_SCALE, V_SCALE),
        "wq_gemm": (torch.randn(num_tokens, 128, generator=gen), wq.qweight, wq.scales, wq.zeros, 4, 64,
                    inp["wq_perm"]),
        "gguf_gemm": (torch.randn(num_tokens, 256, generator=gen), inp["gguf"], "Q4_K"),
        "gguf_dequantize": (inp["gguf"], "Q4_K", torch.float16),
        "fp8_gemm": (torch.randn(num_tokens, 48, generator=gen), fp8_weight, fp8_scale, None),
        "w16_gemm": (torch.randn(num_tokens, 64, generator=gen), inp["w16"], 40),
        "rms_norm": (hidden, weight, 1e-6),
        "fused_add_rms_norm_": (hidden.clone(), hidden.flip(0).clone(), weight, 1e-6),
        "rotary_embedding": (inp["positions"], q.clone(), k.clone(), inp["cos_sin"], True),
        "qk_norm_rotary_embedding": (inp["positions"], q.clone(), k.clone(), torch.rand(HEAD_DIM, generator=gen),
                                     torch.rand(HEAD_DIM, generator=gen), 1e-6, inp["cos_sin"], True),
        "silu_and_mul": (hidden,),
        "moe_topk": (torch.randn(num_tokens, 8, generator=gen), 2, "softmax", True, None, 1, 1, torch.float32),
        "moe_align_block_size": (torch.tensor([[3, 1], [1, 0], [7, 3]], dtype=torch.int32), 16, 8),
        "fused_moe": (torch.randn(num_tokens, 40, generator=gen), inp["w13"], inp["w2"], torch.rand(num_tokens, 2),
                      torch.tensor([[3, 1], [1, 0], [5, 3]], dtype=torch.int32), "silu",
                      torch.tensor([0, 1, -1, 2, 3, 4, 5, -1], dtype=torch.int32)),
        "lora_shrink": (torch.randn(num_tokens, 64, generator=gen), torch.randn(4, 48, 64, generator=gen),
                        lora_indices, 0.5, None, *lora_mapping, lora_ranks),
        "lora_expand_": (torch.randn(num_tokens, 48, generator=gen), torch.randn(4, 40, 16, generator=gen),
                         lora_indices, torch.randn(num_tokens, 40, generator=gen), [24, 8, 8], *lora_mapping,
                         lora_ranks),
        "add_lora_": (torch.randn(num_tokens, 64, generator=gen), torch.randn(4, 48, 64, generator=gen),
                      torch.randn(4, 40, 16, generator=gen), lora_indices, torch.randn(num_tokens, 40, generator=gen),
                      0.5, [24, 8, 8], None, *lora_mapping, lora_ranks),
        "skinny_gemm": (hidden, torch.randn(40, 48, generator=gen), torch.randn(40, generator=gen), None, None, "silu"),
        "skinny_gemm_residual_": (hidden, torch.randn(40, 96, generator=gen),
                                  torch.randn(num_tokens, 40, generator=gen), None, weight, 1e-6),
    }


# opcheck's schema test compares every input before and after the call bitwise with a kernel float8
# lacks on the CPU ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): calls with a float8
# tensor run the other default tests, and test_opcheck_float_caches runs the attention ops' schema test
# with float caches.
FLOAT8_FREE_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", torch_ops.OPS)
def test_opcheck(name):
    """opcheck's default tests: schema and declared mutations, autograd registration, the fake impl
    against the real one, AOT dispatch with dynamic shapes."""
    args = _opcheck_cases()[name]
    has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
    torch.library.opcheck(getattr(torch.ops.pagedkernels, name), args,
                          **({"test_utils": FLOAT8_FREE_UTILS} if has_fp8 else {}))


@pytest.mark.parametrize("name", ["paged_decode_attention_workspace", "paged_prefill_attention"])
def test_opcheck_float_caches(name):
    """The schema test (declared mutations) for the ops whose main case reads a float8 cache."""
    inp = _inputs(seed=4)
    kv = inp["kv"]
    q = torch.randn(3, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    caches = (kv.key_cache.nan_to_num(), kv.value_cache.nan_to_num())
    if name == "paged_prefill_attention":
        args = (q, *caches, kv.block_tables, inp["cu_seqlens_q"], kv.seq_lens, None, None, 20.0)
    else:
        args = (q, *caches, kv.block_tables, kv.seq_lens, inp["workspace"].zero_(), 0.2, None, None)
    torch.library.opcheck(getattr(torch.ops.pagedkernels, name), args)


def test_decode_ops_omitting_and_giving_the_workspace():
    """torch_ops.paged_decode_attention with the workspace left out, None, or given, positionally or
    by keyword, with the split counters beside it, eagerly: each gives the public op's result (torch 2.11 failed
    the first two). The counters without a workspace are refused."""
    inp = _inputs(seed=3)
    kv = inp["kv"]
    q = torch.randn(3, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    expected = pk.paged_decode_attention(*args, scale=0.2, sliding_window=9)
    counters = pk.decode_split_counters(3, NUM_KV_HEADS, device="cpu")
    calls = [
        lambda: torch_ops.paged_decode_attention(*args, scale=0.2, sliding_window=9),
        lambda: torch_ops.paged_decode_attention(*args, 0.2, 9, None, None),
        lambda: torch_ops.paged_decode_attention(*args, scale=0.2, sliding_window=9, workspace=inp["workspace"]),
        lambda: torch_ops.paged_decode_attention(*args, 0.2, 9, None, inp["workspace"]),
        lambda: torch.ops.pagedkernels.paged_decode_attention(*args, 0.2, 9),
        lambda: torch.ops.pagedkernels.paged_decode_attention_workspace(*args, inp["workspace"], 0.2, 9),
        lambda: torch_ops.paged_decode_attention(*args, 0.2, 9, workspace=inp["workspace"], split_counters=counters),
        lambda: torch.ops.pagedkernels.paged_decode_attention_fused_reduce(*args, inp["workspace"], counters, 0.2, 9),
    ]
    for call in calls:
        torch.testing.assert_close(call(), expected, atol=0, rtol=0)
    assert not counters.any()
    with pytest.raises(ValueError, match="split_counters needs a workspace"):
        torch_ops.paged_decode_attention(*args, split_counters=counters)


# ---------------------------------------------------------------------------------------------
# fake and meta tensors
# ---------------------------------------------------------------------------------------------

_CACHE = ((12, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), None)  # None: the case's float dtype
_Q = ((3, NUM_HEADS, HEAD_DIM), None)
_KV = ((3, NUM_KV_HEADS, HEAD_DIM), None)
_TABLES, _LENS = ((3, 4), torch.int32), ((3,), torch.int32)

# Each op's arguments in order: (name, (shape, dtype)) for a tensor, (name, value) otherwise; and the
# output's (shape, dtype) (None for the in-place ops).
_CACHE8 = ((12, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), FP8)
_LORA_INDICES = ((3,), torch.int32)
SPECS = {
    "reshape_and_cache": ([("key", _KV), ("value", _KV), ("key_cache", _CACHE8), ("value_cache", _CACHE8),
                           ("slot_mapping", ((3,), torch.int64)), ("k_scale", K_SCALE), ("v_scale", V_SCALE)], None),
    "paged_decode_attention": ([("q", _Q), ("key_cache", _CACHE), ("value_cache", _CACHE), ("block_tables", _TABLES),
                                ("seq_lens", _LENS), ("scale", 0.1), ("sliding_window", 20), ("softcap", 30.0),
                                ("k_scale", 1.0), ("v_scale", 1.0)], _Q),
    "paged_decode_attention_workspace": ([("q", _Q), ("key_cache", _CACHE8), ("value_cache", _CACHE8),
                                          ("block_tables", _TABLES), ("seq_lens", _LENS),
                                          ("workspace", ((4096,), torch.float32)), ("scale", None),
                                          ("sliding_window", None), ("softcap", 5.0), ("k_scale", K_SCALE),
                                          ("v_scale", V_SCALE)], _Q),
    "paged_decode_attention_fused_reduce": ([("q", _Q), ("key_cache", _CACHE), ("value_cache", _CACHE),
                                             ("block_tables", _TABLES), ("seq_lens", _LENS),
                                             ("workspace", ((4096,), torch.float32)),
                                             ("split_counters", ((8,), torch.int32)), ("scale", 0.2),
                                             ("sliding_window", 9), ("softcap", None), ("k_scale", 1.0),
                                             ("v_scale", 1.0)], _Q),
    "paged_prefill_attention": ([("q", _Q), ("key_cache", _CACHE8), ("value_cache", _CACHE8),
                                 ("block_tables", _TABLES), ("cu_seqlens_q", ((4,), torch.int32)), ("seq_lens", _LENS),
                                 ("scale", None), ("sliding_window", 7), ("softcap", None), ("k_scale", K_SCALE),
                                 ("v_scale", V_SCALE)], _Q),
    "wq_gemm": ([("x", ((3, 128), None)), ("qweight", ((40, 64), torch.uint8)), ("scales", ((40, 2), None)),
                 ("zeros", ((40, 2), None)), ("bits", 4), ("group_size", 64), ("perm", ((128,), torch.int64))],
                ((3, 40), None)),
    "gguf_gemm": ([("x", ((3, 256), None)), ("qweight", ((40, 210), torch.uint8)), ("quant_type", "Q6_K")],
                  ((3, 40), None)),
    "gguf_dequantize": ([("qweight", ((40, 68), torch.uint8)), ("quant_type", "Q8_0"), ("dtype", torch.bfloat16)],
                        ((40, 64), torch.bfloat16)),
    "fp8_gemm": ([("x", ((3, 48), None)), ("weight", ((40, 48), FP8)), ("weight_scale", ((40,), torch.float32)),
                  ("act_scale", ((1,), torch.float32))], ((3, 40), None)),
    "w16_gemm": ([("x", ((3, 64), None)), ("packed", ((2, 64, 32), torch.bfloat16)), ("n", 40)], ((3, 40), None)),
    "rms_norm": ([("x", ((3, 96), None)), ("weight", ((96,), None)), ("eps", 1e-6)], ((3, 96), None)),
    "fused_add_rms_norm_": ([("x", ((3, 96), None)), ("residual", ((3, 96), None)), ("weight", ((96,), None)),
                             ("eps", 1e-6)], None),
    "rotary_embedding": ([("positions", ((3,), torch.int64)), ("q", _Q), ("k", _KV),
                          ("cos_sin_cache", ((64, HEAD_DIM), torch.float32)), ("is_neox", True)], None),
    "qk_norm_rotary_embedding": ([("positions", ((3,), torch.int64)), ("q", _Q), ("k", _KV),
                                  ("q_weight", ((HEAD_DIM,), None)), ("k_weight", ((HEAD_DIM,), None)), ("eps", 1e-6),
                                  ("cos_sin_cache", ((64, HEAD_DIM), torch.float32)), ("is_neox", True)], None),
    "silu_and_mul": ([("x", ((3, 96), None))], ((3, 48), None)),
    "moe_topk": ([("logits", ((3, 8), None)), ("top_k", 2), ("scoring", "softmax"), ("renormalize", True),
                  ("correction_bias", ((8,), torch.float32)), ("num_expert_group", 1), ("topk_group", 1),
                  ("weights_dtype", torch.float32)], [((3, 2), torch.float32), ((3, 2), torch.int32)]),
    # 6 slots over 8 experts in blocks of 16: at most 6 busy experts, 6 + 6 * 15 rows
    "moe_align_block_size": ([("topk_ids", ((3, 2), torch.int32)), ("block_size", 16), ("num_experts", 8)],
                             [((96,), torch.int32), ((6,), torch.int32), ((1,), torch.int32)]),
    "fused_moe": ([("hidden", ((3, 40), None)), ("w13", ((4, 48, 40), None)), ("w2", ((4, 40, 24), None)),
                   ("topk_weights", ((3, 2), torch.float32)), ("topk_ids", ((3, 2), torch.int32)),
                   ("activation", "silu"), ("expert_map", ((6,), torch.int32))], ((3, 40), None)),
    "lora_shrink": ([("x", ((3, 64), None)), ("lora_a", ((4, 48, 64), None)), ("token_lora_indices", _LORA_INDICES),
                     ("scale", 0.5), ("num_splits", None), ("sorted_token_ids", _LORA_INDICES),
                     ("lora_token_starts", ((5,), torch.int32)), ("lora_ranks", ((4, 3), torch.int32))],
                    ((3, 48), torch.float32)),
    "lora_expand_": ([("buffer", ((3, 48), torch.float32)), ("lora_b", ((4, 40, 16), None)),
                      ("token_lora_indices", _LORA_INDICES), ("out", ((3, 40), None)), ("slice_sizes", [24, 8, 8]),
                      ("sorted_token_ids", _LORA_INDICES), ("lora_token_starts", ((5,), torch.int32)),
                      ("lora_ranks", ((4, 3), torch.int32))], None),
    "add_lora_": ([("x", ((3, 64), None)), ("lora_a", ((4, 48, 64), None)), ("lora_b", ((4, 40, 16), None)),
                   ("token_lora_indices", _LORA_INDICES), ("out", ((3, 40), None)), ("scale", 0.5),
                   ("slice_sizes", [24, 8, 8]), ("num_splits", None), ("sorted_token_ids", _LORA_INDICES),
                   ("lora_token_starts", ((5,), torch.int32)), ("lora_ranks", ((4, 3), torch.int32))], None),
    "skinny_gemm": ([("x", ((3, 64), None)), ("weight", ((40, 64), None)), ("bias", ((40,), None)),
                     ("norm_weight", ((64,), None)), ("eps", 1e-6)], ((3, 40), None)),
    "skinny_gemm_residual_": ([("x", ((3, 64), None)), ("weight", ((40, 64), None)), ("residual", ((3, 40), None)),
                               ("bias", ((40,), None)), ("norm_weight", ((64,), None)), ("eps", 1e-6)], None),
}
TENSOR_ARGS = [(op, arg) for op, (args, _) in SPECS.items() for arg, spec in args if isinstance(spec, tuple)]
# The arguments that can be on another device than the op's other tensors (silu_and_mul has one tensor).
MISMATCH_ARGS = [(op, arg) for op, arg in TENSOR_ARGS if sum(o == op for o, _ in TENSOR_ARGS) > 1]


def _build(op, device, dtype=torch.float16, *, odd=None, odd_device=None, odd_dtype=None):
    """The op's arguments as empty tensors on ``device``; the argument named ``odd`` on ``odd_device``
    and/or with ``odd_dtype`` instead."""
    args = []
    for arg, spec in SPECS[op][0]:
        if not isinstance(spec, tuple):
            args.append(spec)
            continue
        shape, arg_dtype = spec
        arg_dtype, arg_device = arg_dtype or dtype, device
        if arg == odd:
            arg_dtype, arg_device = odd_dtype or arg_dtype, odd_device or arg_device
        args.append(torch.zeros(shape, dtype=arg_dtype, device=arg_device))
    return args


def _check_output(op, result, device, dtype):
    expected = SPECS[op][1]
    if expected is None:
        assert result is None
        return
    if isinstance(expected, list):  # several outputs
        assert isinstance(result, tuple) and len(result) == len(expected)
        results = result
    else:
        expected, results = [expected], [result]
    for (shape, out_dtype), out in zip(expected, results):
        assert tuple(out.shape) == shape and out.dtype == (out_dtype or dtype)
        assert out.device.type == device and out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", torch_ops.OPS)
def test_fake_cuda_tensors(op, dtype):
    """The fake-CUDA tier's situation: the custom op under FakeTensorMode with CUDA tensors runs its
    fake implementation (the argument checks, then the output's metadata)."""
    with FakeTensorMode():
        args = _build(op, "cuda", dtype)
        assert all(isinstance(a, FakeTensor) and a.is_cuda for a in args if isinstance(a, torch.Tensor))
        result = getattr(torch.ops.pagedkernels, op)(*args)
    _check_output(op, result, "cuda", dtype)


@pytest.mark.parametrize("op,arg", MISMATCH_ARGS, ids=[f"{op}-{arg}" for op, arg in MISMATCH_ARGS])
def test_fake_device_mismatch_names_the_argument(op, arg):
    """One argument on the CPU, the others on CUDA: a ValueError that names it and its device."""
    with FakeTensorMode(), pytest.raises(ValueError, match=rf"\b{arg} is on cpu\b.*one device") as error:
        getattr(torch.ops.pagedkernels, op)(*_build(op, "cuda", odd=arg, odd_device="cpu"))
    assert "cuda" in str(error.value)


@pytest.mark.parametrize("op,arg", TENSOR_ARGS, ids=[f"{op}-{arg}" for op, arg in TENSOR_ARGS])
def test_fake_and_real_reject_a_bad_dtype_alike(op, arg):
    """float64 (no op takes it) for one argument: the real op on CPU tensors and the fake one on CUDA
    tensors raise the same ValueError, naming the argument, before reading any value."""
    with pytest.raises(ValueError, match=rf"\b{arg}\b") as real:
        getattr(torch.ops.pagedkernels, op)(*_build(op, "cpu", odd=arg, odd_dtype=torch.float64))
    with FakeTensorMode(), pytest.raises(ValueError) as fake:
        getattr(torch.ops.pagedkernels, op)(*_build(op, "cuda", odd=arg, odd_dtype=torch.float64))
    assert str(fake.value) == str(real.value)


def _public_call(op, args):
    """The public pk function an op wraps, called with ``args`` (in the op's order)."""
    names = [name for name, _ in SPECS[op][0]]
    kw = dict(zip(names, args))
    options = ("scale", "sliding_window", "softcap", "k_scale", "v_scale")
    if op == "paged_decode_attention_workspace":
        return pk.paged_decode_attention(*args[:5], workspace=kw["workspace"], **{k: kw[k] for k in options})
    if op == "paged_decode_attention_fused_reduce":
        return pk.paged_decode_attention(*args[:5], workspace=kw["workspace"], split_counters=kw["split_counters"],
                                         **{k: kw[k] for k in options})
    if op in ("paged_decode_attention", "paged_prefill_attention"):
        return getattr(pk, op)(*args[:-5], **{k: kw[k] for k in options})
    if op == "reshape_and_cache":
        return pk.reshape_and_cache(*args[:5], k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    if op == "wq_gemm":
        return pk.wq_gemm(*args[:4], bits=kw["bits"], group_size=kw["group_size"], perm=kw["perm"])
    if op == "gguf_dequantize":
        return pk.gguf_dequantize(kw["qweight"], kw["quant_type"], dtype=kw["dtype"])
    if op == "fp8_gemm":
        return pk.fp8_gemm(*args[:3], act_scale=kw["act_scale"])
    if op == "fused_add_rms_norm_":
        pk.fused_add_rms_norm(*args)
        return None
    if op == "rotary_embedding":
        return pk.rotary_embedding(*args[:4], is_neox=kw["is_neox"])
    if op == "qk_norm_rotary_embedding":
        return pk.qk_norm_rotary_embedding(*args[:7], is_neox=kw["is_neox"])
    if op == "moe_topk":
        return pk.moe_topk(*args[:2], **{k: kw[k] for k in names[2:]})
    if op == "fused_moe":
        return pk.fused_moe(*args[:5], activation=kw["activation"], expert_map=kw["expert_map"])
    mapping = {k: kw[k] for k in ("sorted_token_ids", "lora_token_starts", "lora_ranks") if k in kw}
    if op == "lora_shrink":
        return pk.lora_shrink(*args[:3], scale=kw["scale"], num_splits=kw["num_splits"], **mapping)
    if op == "lora_expand_":
        pk.lora_expand(*args[:4], slice_sizes=kw["slice_sizes"], **mapping)
        return None
    if op == "add_lora_":
        pk.add_lora(*args[:5], scale=kw["scale"], slice_sizes=kw["slice_sizes"], num_splits=kw["num_splits"],
                    **mapping)
        return None
    if op == "skinny_gemm":
        return pk.skinny_gemm(*args[:3], norm_weight=kw["norm_weight"], eps=kw["eps"])
    if op == "skinny_gemm_residual_":
        pk.skinny_gemm(*args[:2], kw["bias"], norm_weight=kw["norm_weight"], eps=kw["eps"], residual=kw["residual"])
        return None
    return getattr(pk, op)(*args)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch", "native"])
@pytest.mark.parametrize("op", torch_ops.OPS)
def test_public_ops_on_fake_and_meta_tensors(op, backend, monkeypatch):
    """pk.* on fake CUDA tensors (FakeTensorMode) and on meta tensors, whatever the backend: the
    checks run, the output is allocated, no kernel (Triton, native, PyTorch twin) is reached."""
    import importlib

    from pagedkernels import _native, cache_ops, decode_attention, gguf_quant, lora, prefill_attention

    # the modules, not the functions of the same names that pagedkernels re-exports
    wq_gemm, fp8_gemm, w16_gemm, fused_moe, moe_topk, moe_align, skinny_gemm = (
        importlib.import_module(f"pagedkernels.{m}")
        for m in ("wq_gemm", "fp8_gemm", "w16_gemm", "fused_moe", "moe_topk", "moe_align", "skinny_gemm"))

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was reached with tensors that hold no data")

    for module, attr in ((decode_attention, "_decode_triton"), (decode_attention, "_decode_torch"),
                         (prefill_attention, "_prefill_attention_triton"),
                         (prefill_attention, "_prefill_attention_torch"), (_native, "paged_attention"),
                         (_native, "rms_norm"), (_native, "rotary_embedding"), (_native, "silu_and_mul"),
                         (_native, "reshape_and_cache"), (cache_ops, "_launch_copy_blocks"),
                         (wq_gemm, "_wq_gemm_triton"), (wq_gemm, "dequantize_wq"), (_native, "quant_gemm"),
                         (_native, "quant_dequantize"), (gguf_quant, "_dequantize_triton"),
                         (gguf_quant, "_dequantize_torch"), (fp8_gemm, "_scaled_mm"), (_native, "w16_gemm"),
                         (w16_gemm, "unpack_w16"), (moe_topk, "_moe_topk_triton"), (moe_topk, "_moe_topk_torch"),
                         (_native, "moe_topk"), (moe_align, "_moe_align_triton"), (moe_align, "_moe_align_torch"),
                         (fused_moe, "_fused_moe_triton"), (fused_moe, "_fused_moe_torch"), (_native, "fused_moe"),
                         (fused_moe, "unpack_moe_weight"), (lora, "_shrink_triton"), (lora, "_expand_triton"),
                         (lora, "_launch_shrink"),
                         (lora, "_shrink_torch"), (lora, "_expand_torch"), (lora, "lora_mapping"),
                         (_native, "lora_shrink"), (_native, "lora_expand"), (skinny_gemm, "_skinny_triton"),
                         (skinny_gemm, "_skinny_torch")):
        monkeypatch.setattr(module, attr, no_kernel)
    with pk.use_backend(backend):
        with FakeTensorMode():
            _check_output(op, _public_call(op, _build(op, "cuda")), "cuda", torch.float16)
        _check_output(op, _public_call(op, _build(op, "meta")), "meta", torch.float16)
        first = SPECS[op][0][0][0]
        if (op, first) in MISMATCH_ARGS:
            # the first tensor on meta, the others on the CPU: a device mismatch, no computation
            with pytest.raises(ValueError, match=rf"\b{first} is on meta\b"):
                _public_call(op, _build(op, "cpu", odd=first, odd_device="meta"))


def test_public_block_ops_on_fake_and_meta_tensors():
    """copy_blocks and swap_blocks (no custom op) on meta / fake tensors: checked, nothing copied,
    and a device mismatch is still a ValueError."""
    def caches(device):
        return [torch.zeros(6, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=device)
                for _ in range(2)]

    for device in ("meta", "cuda"):
        with FakeTensorMode() if device == "cuda" else contextlib.nullcontext():
            keys, values = caches(device), caches(device)
            mapping = torch.zeros(2, 2, dtype=torch.int64, device=device)
            pk.copy_blocks(keys, values, mapping)
            pk.swap_blocks(keys[0], caches("cpu")[0], torch.zeros(2, 2, dtype=torch.int64))
            pk.swap_blocks(caches("cpu")[0], keys[0], torch.zeros(2, 2, dtype=torch.int64))
            with pytest.raises(ValueError, match=r"\bvalue_caches\[1\] is on cpu\b"):
                pk.copy_blocks(keys, [values[0], caches("cpu")[1]], mapping)
            with pytest.raises(ValueError, match="block_mapping must be on device cpu"):
                pk.swap_blocks(keys[0], keys[1], mapping)
