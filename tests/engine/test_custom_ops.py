"""The engine's own custom ops (``torch.ops.engine.*``): ``unified_attention`` (an attention layer as one
opaque op, its KV cache found through the forward context), ``unified_attention_rope`` (the same with the rotary
embedding and q/k norms done in the cache write: the few-row layers') and the tensor-parallel collectives
``tp_all_reduce`` / ``tp_all_gather``.

Each op passes torch.library.opcheck (schema and declared mutations, autograd registration, the fake
implementation against the real one, AOT dispatch with dynamic shapes) and runs inside a fullgraph
inductor compile with dynamic shapes, as the model runner compiles the forward, with the eager
results. The collectives run in this process as rank 0 of a gloo group of one (their sums over two
ranks are tests/engine/test_distributed.py's).
"""

from __future__ import annotations

import pytest
import torch

from engine import distributed as engine_dist
from engine.distributed import communication  # noqa: F401  (registers engine::tp_all_reduce / tp_all_gather)
from engine.distributed.parallel_state import free_port
import pagedkernels as pk
from engine.layers.attention import Attention, AttentionMetadata, Rope, forward_context
from tests.pagedkernels.oracle import make_paged_kv

ENGINE_OPS = ("unified_attention", "unified_attention_rope", "tp_all_reduce", "tp_all_gather")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16
SEQ_LENS = [5, 17, 33]


def test_every_engine_op_is_tested():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("engine::")}
    assert registered == set(ENGINE_OPS)


# ---------------------------------------------------------------------------------------------
# engine::unified_attention
# ---------------------------------------------------------------------------------------------

def _layers(seed=0):
    """Two attention layers with their own paged caches (NaN in every slot no sequence uses): a plain one,
    and one with a sliding window, a softcap and its own scale, so a wrong layer_index shows."""
    gen = torch.Generator().manual_seed(seed)
    layers = [Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM),
              Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale=0.2, sliding_window=8, softcap=5.0)]
    kv = make_paged_kv(SEQ_LENS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu", generator=gen)
    for index, layer in enumerate(layers):
        # one block layout (the sequences' block tables) for every layer, other numbers in each
        layer.key_cache, layer.value_cache = kv.key_cache * (1 - index * 1.5), kv.value_cache.flip(-1) ** (index + 1)
        layer.layer_index = index
    return layers, kv.block_tables, kv.seq_lens


def _batch(q_lens, block_tables, seed=1):
    """New tokens: the last q_lens[s] positions of sequence s (decode when every q_len is 1)."""
    gen = torch.Generator().manual_seed(seed)
    positions = [p for n, q_len in zip(SEQ_LENS, q_lens) for p in range(n - q_len, n)]
    owners = [s for s, q_len in enumerate(q_lens) for _ in range(q_len)]
    slots = torch.tensor([int(block_tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for s, p in zip(owners, positions)])
    num_tokens = len(positions)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q.view(num_tokens, NUM_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM), slots, cu_seqlens_q)


BATCHES = {"decode": [1, 1, 1], "prefill": [5, 3, 1]}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_unified_attention_opcheck(batch):
    layers, block_tables, seq_lens = _layers()
    q, k, v, slots, cu_seqlens_q = _batch(BATCHES[batch], block_tables)
    out = torch.zeros(q.shape)
    with forward_context(layers, batch == "decode"):
        for index in range(len(layers)):
            args = (q, k, v, out, slots, block_tables, seq_lens, cu_seqlens_q, index)
            torch.library.opcheck(torch.ops.engine.unified_attention, args)  # runs on copies of args
            # and the op does the layer's work: out and the cache writes as the layer's eager attend()
            torch.ops.engine.unified_attention(*args)
            expected_layers, _, _ = _layers()
            expected = expected_layers[index].attend(q, k, v, AttentionMetadata(
                slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                is_decode=batch == "decode"))
            torch.testing.assert_close(out, expected, atol=0, rtol=0)
            torch.testing.assert_close(layers[index].key_cache, expected_layers[index].key_cache, equal_nan=True)


@pytest.mark.parametrize("op", ["unified_attention", "unified_attention_rope"])
def test_unified_attention_outside_a_forward_context_is_an_error(op):
    layers, block_tables, seq_lens = _layers()
    q, k, v, slots, cu_seqlens_q = _batch([1, 1, 1], block_tables)
    rope = _rope_args(_rope([1, 1, 1], False)) if op == "unified_attention_rope" else ()
    with pytest.raises(RuntimeError, match="forward_context"):
        getattr(torch.ops.engine, op)(q, k, v, torch.empty(q.shape), slots, block_tables, seq_lens, cu_seqlens_q,
                                      0, *rope)


def test_unified_attention_compiled_fullgraph_inductor():
    """Both layers' forward, compiled (inductor, fullgraph, dynamic shapes): each runs as one
    engine::unified_attention node and gives the eager output and cache writes, for a decode batch and then a
    prefill batch on the same compiled graph: the op takes the batch's kind from the forward context, so the graph
    does not depend on it (one compile of a model for both kinds of step)."""
    from torch._dynamo.utils import counters

    from engine.worker.decode_graphs import compile_shapes

    torch._dynamo.reset()
    counters.clear()

    def forward(layers, q, k, v, meta):
        hidden = layers[0](q, k, v, meta)
        return hidden + layers[1](q * 0.5, k, v, meta).relu()

    compiled = torch.compile(forward, fullgraph=True, backend="inductor", dynamic=True)
    for batch in ("decode", "prefill"):
        eager_layers, block_tables, seq_lens = _layers()
        compiled_layers, _, _ = _layers()
        q, k, v, slots, cu_seqlens_q = _batch(BATCHES[batch], block_tables)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens,
                                 cu_seqlens_q=cu_seqlens_q, is_decode=batch == "decode")
        expected = forward(eager_layers, q, k, v, meta)
        with forward_context(compiled_layers, meta.is_decode), compile_shapes():   # as the engine compiles
            got = compiled(compiled_layers, q, k, v, meta)
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for eager, comp in zip(eager_layers, compiled_layers):
            torch.testing.assert_close(comp.key_cache, eager.key_cache, atol=0, rtol=0, equal_nan=True)
            torch.testing.assert_close(comp.value_cache, eager.value_cache, atol=0, rtol=0, equal_nan=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# engine::unified_attention_rope
# ---------------------------------------------------------------------------------------------

def _rope(q_lens, norms: bool, seed=2) -> Rope:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor([p for n, q_len in zip(SEQ_LENS, q_lens) for p in range(n - q_len, n)])
    weights = dict(q_weight=torch.rand(HEAD_DIM, generator=gen) + 0.5,
                   k_weight=torch.rand(HEAD_DIM, generator=gen) + 0.5, eps=1e-6) if norms else {}
    return Rope(positions, pk.compute_cos_sin_cache(64, HEAD_DIM, 10000.0), **weights)


def _rope_args(rope: Rope) -> tuple:
    return rope.positions, rope.cos_sin_cache, rope.q_weight, rope.k_weight, rope.eps


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_unified_attention_rope_opcheck(batch, norms):
    """The op rotates q and k in place (after the q/k norms), writes the cache and attends: what the layer's
    rotary embedding (or q/k norm + rotary) followed by unified_attention does."""
    layers, block_tables, seq_lens = _layers()
    q, k, v, slots, cu_seqlens_q = _batch(BATCHES[batch], block_tables)
    rope = _rope(BATCHES[batch], norms)
    with forward_context(layers, batch == "decode"):
        for index in range(len(layers)):
            out = torch.zeros(q.shape)
            q_i, k_i = q.clone(), k.clone()
            args = (q_i, k_i, v, out, slots, block_tables, seq_lens, cu_seqlens_q, index, *_rope_args(rope))
            torch.library.opcheck(torch.ops.engine.unified_attention_rope, args)  # runs on copies of args
            torch.ops.engine.unified_attention_rope(*args)
            expected_layers, _, _ = _layers()
            q_e, k_e = q.clone(), k.clone()
            if norms:
                pk.qk_norm_rotary_embedding(rope.positions, q_e, k_e, rope.q_weight, rope.k_weight, rope.eps,
                                            rope.cos_sin_cache)
            else:
                pk.rotary_embedding(rope.positions, q_e, k_e, rope.cos_sin_cache)
            expected = expected_layers[index].attend(q_e, k_e, v, AttentionMetadata(
                slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                is_decode=batch == "decode"))
            torch.testing.assert_close(out, expected, atol=0, rtol=0)
            torch.testing.assert_close(q_i, q_e, atol=0, rtol=0)
            torch.testing.assert_close(k_i, k_e, atol=0, rtol=0)
            torch.testing.assert_close(layers[index].key_cache, expected_layers[index].key_cache, equal_nan=True)


def test_unified_attention_rope_compiled_fullgraph_inductor():
    """Two layers given rotary work (with and without q/k norms), compiled (inductor, fullgraph, dynamic shapes): each
    runs as one engine::unified_attention_rope node on views of one qkv buffer and gives the eager output, rotated
    q/k and cache writes."""
    torch._dynamo.reset()
    q_lens = BATCHES["prefill"]

    def forward(layers, qkv, slots, block_tables, seq_lens, cu_seqlens_q, plain, normed):
        meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens,
                                 cu_seqlens_q=cu_seqlens_q, is_decode=False)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
        q, k = q.view(num_tokens, NUM_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        v = v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        hidden = layers[0](q, k, v, meta, rope=plain)
        return hidden + layers[1](q * 0.5, k.clone(), v, meta, rope=normed).relu()

    eager_layers, block_tables, seq_lens = _layers()
    compiled_layers, _, _ = _layers()
    q, k, v, slots, cu_seqlens_q = _batch(q_lens, block_tables)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    ropes = (_rope(q_lens, False), _rope(q_lens, True))
    eager_qkv, compiled_qkv = qkv.clone(), qkv.clone()
    with forward_context(eager_layers, False):
        expected = forward(eager_layers, eager_qkv, slots, block_tables, seq_lens, cu_seqlens_q, *ropes)
    compiled = torch.compile(forward, fullgraph=True, backend="inductor", dynamic=True)
    with forward_context(compiled_layers, False):
        got = compiled(compiled_layers, compiled_qkv, slots, block_tables, seq_lens, cu_seqlens_q, *ropes)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_qkv, eager_qkv, atol=1e-6, rtol=1e-6)   # q and k rotated in place
    for eager, comp in zip(eager_layers, compiled_layers):
        torch.testing.assert_close(comp.key_cache, eager.key_cache, atol=1e-6, rtol=0, equal_nan=True)
        torch.testing.assert_close(comp.value_cache, eager.value_cache, atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# engine::tp_all_reduce, engine::tp_all_gather
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def group_of_one():
    """This process as rank 0 of a gloo tensor-parallel group of one (the ops' real implementations call
    torch.distributed, which needs a group)."""
    engine_dist.init_distributed_environment(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
    try:
        yield
    finally:
        engine_dist.destroy_distributed_environment()


def test_collectives_opcheck(group_of_one):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.engine.tp_all_reduce, (x,))
    torch.library.opcheck(torch.ops.engine.tp_all_gather, (x, 1))
    assert torch.equal(torch.ops.engine.tp_all_reduce(x), x)
    assert torch.equal(torch.ops.engine.tp_all_gather(x, 1), x[None])


def test_collectives_compiled_fullgraph_inductor(group_of_one):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(5, 6, generator=gen), torch.randn(4, 6, generator=gen)

    def row_then_column_parallel(x, weight):
        reduced = torch.ops.engine.tp_all_reduce(x @ weight.t()) * 2.0   # [tokens, 4]
        gathered = torch.ops.engine.tp_all_gather(reduced, 1)            # [1, tokens, 4]
        return gathered.movedim(0, -1).flatten(-2) + 1.0

    expected = row_then_column_parallel(x, weight)
    torch.testing.assert_close(expected, (x @ weight.t()) * 2.0 + 1.0)
    compiled = torch.compile(row_then_column_parallel, fullgraph=True, backend="inductor", dynamic=True)
    torch.testing.assert_close(compiled(x, weight), expected, atol=1e-5, rtol=1e-5)
    x7 = torch.randn(7, 6, generator=gen)   # another token count: the same graph, dynamic in the tokens
    torch.testing.assert_close(compiled(x7, weight), row_then_column_parallel(x7, weight), atol=1e-5, rtol=1e-5)
