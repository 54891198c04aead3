"""engine.lora: PEFT adapters on the engine's models, against PEFT's own merged model (transformers + peft, fp32).

The model-level test runs the engine's model (its weights from the tiny checkpoints, the LoRA layers wrapped
around its projections) on one prefill batch whose sequences use four different adapters and the base model, and
compares every position's log-probabilities with transformers running ``PeftModel.merge_and_unload()`` of each
adapter on its sequence alone (the adapters: tests/engine/lora_util.py ADAPTERS). The rest: loading errors (each a
ValueError naming the problem, leaving the caches as they were), the caches' LRU order and pinning, the batch
buffers, tensor-parallel shards (TP=2 ranks built in one process with ``planned_layout``, their partial outputs
combined as the collectives would, against TP=1).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="the oracle is PEFT's merged model (pip install peft, the dev extra)")

from engine.distributed.parallel_state import planned_layout  # noqa: E402
from engine.layers.attention import Attention, AttentionMetadata  # noqa: E402
from engine.layers.linear import Linear, MergedLinear, QKVLinear  # noqa: E402
from engine.layers.quantization import process_weights_after_loading  # noqa: E402
from engine.lora import (LoRABatch, LoRAConfig, LoRALinear, LoRAManager, LoRARequest, PinnedLRU,  # noqa: E402
                         token_slots)
from engine.models import get_model_class, load_model_config  # noqa: E402
from engine.worker.loader import load_model  # noqa: E402
from tests.engine.lora_util import ADAPTERS, lora_pair, peft_merged_log_probs, write_adapter  # noqa: E402
from tests.engine.models_util import random_token_ids  # noqa: E402


def engine_model(model_dir: str):
    """The engine's model of ``model_dir`` in float32 on the CPU, as the model runner builds it (oneDNN-prepacked
    linears included)."""
    config = load_model_config(model_dir, dtype=torch.float32, device="cpu")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = get_model_class(config.architecture)(config)
    finally:
        torch.set_default_dtype(previous)
    load_model(model, model_dir)
    model.eval()
    with torch.no_grad():
        process_weights_after_loading(model, prepack=True)
    return model


def prefill_log_probs(model, sequences: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """One prefill forward of ``sequences`` (each its own blocks of a fresh KV cache): float32 log-softmax at every
    position, per sequence."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    lens = [len(s) for s in sequences]
    blocks = [math.ceil(n / block_size) for n in lens]
    kv = torch.zeros(2, len(layers), sum(blocks), block_size, layers[0].num_kv_heads, layers[0].head_dim)
    for i, layer in enumerate(layers):
        layer.layer_index, layer.key_cache, layer.value_cache = i, kv[0, i], kv[1, i]
    tables = torch.zeros(len(sequences), max(blocks), dtype=torch.int32)
    first = 0
    for s, count in enumerate(blocks):
        tables[s, :count] = torch.arange(first, first + count)
        first += count
    positions = torch.cat([torch.arange(n) for n in lens])
    owner = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor(lens))
    slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             cu_seqlens_q=cu, is_decode=False)
    with torch.inference_mode():
        hidden = model(torch.tensor([t for s in sequences for t in s]), positions, meta)
        return list(torch.log_softmax(model.compute_logits(hidden).float(), dim=-1).split(lens))


# ---------------------------------------------------------------------------------------------
# against PEFT
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,names", [("llama", list(ADAPTERS)), ("qwen3", ["all-r8", "patterns-r4"]),
                                        ("gemma2", ["qv-down-rslora-r16", "mlp-o-r16"])])
def test_mixed_adapter_batch_matches_peft_merged_models(arch, names, tiny_model_dir, peft_adapters):
    """One forward over sequences on different adapters and the base model: each sequence's log-probabilities are
    PEFT's merged model's for its adapter (within float32 rounding; greedy tokens equal everywhere), and each
    adapter moved them well away from the base model's."""
    model_dir = tiny_model_dir(arch)
    dirs = peft_adapters(arch, names)
    model = engine_model(model_dir)
    manager = LoRAManager(model, LoRAConfig(max_lora_rank=16, max_loras=4), max_num_tokens=128,
                          dtype=torch.float32)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(dirs.items())]
    # Interleaved: base, adapter 1, adapter 2, ..., base again; lengths differ.
    order = [None, *requests, None]
    sequences = [random_token_ids(7 + 3 * i, seed=40 + i) for i in range(len(order))]
    slot_of = manager.set_active_adapters(requests)
    assert sorted(slot_of.values()) == list(range(len(requests)))
    manager.prepare_batch(token_slots([-1 if r is None else slot_of[r.lora_int_id] for r in order],
                                      [len(s) for s in sequences]))
    got = prefill_log_probs(model, sequences)
    for request, sequence, log_probs in zip(order, sequences, got):
        expected = peft_merged_log_probs(model_dir, None if request is None else dirs[request.lora_name], sequence)
        what = "base" if request is None else request.lora_name
        torch.testing.assert_close(log_probs, expected, atol=2e-3, rtol=0, msg=lambda m: f"{arch} {what}: {m}")
        assert torch.equal(log_probs.argmax(-1), expected.argmax(-1)), f"{arch} {what}: greedy tokens differ"
        if request is not None:
            base = peft_merged_log_probs(model_dir, None, sequence)
            assert (expected - base).abs().max() > 0.5, f"{arch} {what}: the adapter hardly changes the model"
    # A step of base-model requests only: the kernels are skipped, and the outputs are the base model's.
    manager.prepare_batch(None, num_tokens=0)
    assert not manager.batch.active
    alone = prefill_log_probs(model, sequences[:1])[0]
    torch.testing.assert_close(alone, got[0], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# loading errors
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_manager(tiny_model_dir):
    """An engine Llama with LoRA (max_lora_rank 16, 2 slots, 3 adapters on the host)."""
    model = engine_model(tiny_model_dir("llama"))
    return model, LoRAManager(model, LoRAConfig(max_lora_rank=16, max_loras=2, max_cpu_loras=3), max_num_tokens=64,
                              dtype=torch.float32)


Q = "model.layers.0.self_attn.q_proj"   # the tiny Llama: hidden 128, 4 heads of 64 (q 256), 2 KV heads (k/v 128)


@pytest.mark.parametrize("tensors,config,match", [
    (lambda: lora_pair(Q, 32, 128, 256), dict(r=32), r"q_proj has rank 32, over max_lora_rank=16"),
    (lambda: {**lora_pair(Q, 8, 128, 256), **lora_pair("lm_head", 8, 128, 512)}, dict(target_modules=["q_proj"]),
     r"target module 'lm_head' is not supported: LoRA applies to \['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
     r"'q_proj', 'up_proj', 'v_proj'\] of this model"),
    (lambda: lora_pair(Q, 8, 128, 256), dict(target_modules=["q_proj", "embed_tokens"]),
     r"target module\(s\) \['embed_tokens'\] are not supported"),
    (lambda: lora_pair(Q, 8, 64, 256), {}, r"q_proj maps 64 -> 256 features, but the base model's .*q_proj maps "
                                            r"128 -> 256: an adapter for another model\?"),
    (lambda: lora_pair("model.layers.7.self_attn.q_proj", 8, 128, 256), {},
     r"targets 'model.layers.7.self_attn.q_proj', which this base model does not have \(it has 2 decoder layers\)"),
    (lambda: lora_pair(Q, 8, 128, 256), dict(use_dora=True), "DoRA .* is not supported"),
    (lambda: lora_pair(Q, 8, 128, 256), dict(bias="lora_only"), "trained biases are not supported"),
    (lambda: lora_pair(Q, 8, 128, 256), dict(r=4), r"q_proj's weights have rank 8, but adapter_config.json gives it "
                                                    r"r=4"),
    (lambda: {k: v for k, v in lora_pair(Q, 8, 128, 256).items() if "lora_A" in k}, {},
     "q_proj has lora_A but not lora_B"),
])
def test_a_bad_adapter_is_a_value_error_that_changes_nothing(tensors, config, match, llama_manager, tmp_path):
    model, manager = llama_manager
    before = (manager.host.keys(), manager.slots.keys(), manager.num_adapter_loads)
    path = write_adapter(tmp_path / "bad", tensors(), **config)
    with pytest.raises(ValueError, match=match) as error:
        manager.add_adapter(LoRARequest("bad", 99, path))
    assert "'bad'" in str(error.value)   # names the adapter
    with pytest.raises(ValueError, match=match):
        manager.set_active_adapters([LoRARequest("bad", 99, path)])
    assert (manager.host.keys(), manager.slots.keys(), manager.num_adapter_loads) == before


def test_missing_files_and_ids(llama_manager, tmp_path):
    _, manager = llama_manager
    with pytest.raises(ValueError, match=r"not a directory"):
        manager.add_adapter(LoRARequest("gone", 98, str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no adapter_config.json"):
        manager.add_adapter(LoRARequest("empty", 98, str(tmp_path / "empty")))
    write_adapter(tmp_path / "noweights", {})
    os.remove(tmp_path / "noweights" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"no adapter weights \(adapter_model.safetensors or adapter_model.bin\)"):
        manager.add_adapter(LoRARequest("noweights", 98, str(tmp_path / "noweights")))


# ---------------------------------------------------------------------------------------------
# the caches
# ---------------------------------------------------------------------------------------------

def test_pinned_lru_evicts_the_least_recently_used_unpinned():
    lru = PinnedLRU(3)
    for key in "abc":
        assert lru.put(key, key.upper()) == []
    assert lru.get("a") == "A"                     # order now b, c, a
    assert lru.put("d", "D") == [("b", "B")]
    lru.pin(["c"])
    assert lru.put("e", "E") == [("a", "A")]       # c is older but pinned
    assert lru.keys() == ["c", "d", "e"]
    lru.pin(["c", "d", "e"])
    with pytest.raises(ValueError, match="all 3 entries are pinned"):
        lru.put("f", "F")
    with pytest.raises(ValueError, match="pinned"):
        lru.pop("d")
    lru.pin([])
    assert lru.pop("d") == "D" and lru.keys() == ["c", "e"]
    with pytest.raises(KeyError):
        lru.pin(["zz"])


def _adapters_for_slots(tmp_path, count):
    """``count`` small adapters on q_proj and down_proj of the tiny Llama's layer 0 (distinct weights)."""
    paths = []
    for i in range(count):
        tensors = {**lora_pair(Q, 8, 128, 256, seed=10 * i), **lora_pair("model.layers.0.mlp.down_proj", 8, 256, 128,
                                                                          seed=10 * i + 1)}
        paths.append(write_adapter(tmp_path / f"a{i}", tensors, lora_alpha=16))
    return [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]


def _expected_q_delta(x, request):
    """The q rows' delta of layer 0's qkv_proj for adapter ``request``, by hand: scaling (16 / 8) * x A^T B^T."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(request.lora_path, "adapter_model.safetensors"))
    a, b = tensors[f"base_model.model.{Q}.lora_A.weight"], tensors[f"base_model.model.{Q}.lora_B.weight"]
    return x.double() @ a.double().t() @ b.double().t() * 2.0


def test_slots_evict_lru_keep_the_batch_pinned_and_outputs_right(tiny_model_dir, tmp_path):
    """2 device slots, 3 host entries, 4 adapters: each step's adapters get slots (the least recently used
    unpinned adapter gives its slot up; its host copy stays until the host cache evicts it too); a step of 3
    distinct adapters is refused before anything changes; an adapter evicted from both and brought back computes
    what it did before, bit for bit."""
    model = engine_model(tiny_model_dir("llama"))
    manager = LoRAManager(model, LoRAConfig(max_lora_rank=16, max_loras=2, max_cpu_loras=3), max_num_tokens=8,
                          dtype=torch.float32)
    r1, r2, r3, r4 = _adapters_for_slots(tmp_path, 4)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LoRALinear)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))

    def q_delta(request):
        manager.prepare_batch(np.array([manager.slot_of(request.lora_int_id), -1], dtype=np.int32))
        with torch.no_grad():
            out = qkv(x)
        manager.prepare_batch(None)
        with torch.no_grad():
            base = qkv(x)
        assert torch.equal(out[1], base[1])   # the token without an adapter
        assert torch.equal(out[0, 256:], base[0, 256:])   # k and v: this adapter has no k_proj / v_proj
        return (out[0, :256] - base[0, :256]).double()

    assert manager.set_active_adapters([r1, r2, r1]) == {1: 0, 2: 1} and manager.slots.pinned == {1, 2}
    delta_1 = q_delta(r1)
    torch.testing.assert_close(delta_1, _expected_q_delta(x[0], r1), atol=1e-4, rtol=1e-4)
    assert manager.set_active_adapters([r2]) == {2: 1}                    # slots, oldest first: 1, 2
    assert manager.set_active_adapters([r3, r2]) == {3: 0, 2: 1}         # 1 gives up slot 0
    assert manager.slots.keys() == [3, 2] and manager.host.keys() == [1, 3, 2]
    with pytest.raises(ValueError, match="at most max_loras=2 distinct adapters, got 3"):
        manager.set_active_adapters([r1, r2, r3])
    assert manager.slots.keys() == [3, 2] and manager.slots.pinned == {3, 2} and manager.host.keys() == [1, 3, 2]
    assert manager.set_active_adapters([r4, r3]) == {4: 1, 3: 0}         # host evicts 1, slots evict 2
    assert manager.host.keys() == [2, 4, 3] and manager.slots.keys() == [4, 3]
    loads = (manager.num_adapter_loads, manager.num_slot_loads)
    assert manager.set_active_adapters([r1]) == {1: 1}                    # from disk again, into 4's slot
    assert manager.host.keys() == [4, 3, 1] and manager.slots.keys() == [3, 1]
    assert (manager.num_adapter_loads, manager.num_slot_loads) == (loads[0] + 1, loads[1] + 1)
    assert torch.equal(q_delta(r1), delta_1)
    with pytest.raises(ValueError, match="adapter 1 is in use by the running batch"):
        manager.remove_adapter(1)
    assert manager.remove_adapter(3) is True and manager.remove_adapter(3) is False
    assert manager.slots.keys() == [1] and [r.lora_int_id for r in manager.list_adapters()] == [4, 1]
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a0'"):
        manager.add_adapter(LoRARequest("other", 1, r2.lora_path))
    with pytest.raises(ValueError, match="already has LoRA layers"):
        LoRAManager(model, LoRAConfig(), max_num_tokens=8, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------------------------

HIDDEN, HEAD_DIM, INTER = 32, 16, 48


def _lora_layer(kind: str, tp: int, rank: int, full: dict, adapters: list[dict], num_kv_heads: int):
    """Rank ``rank`` of ``tp``'s LoRA layer of ``kind`` (its base weights cut from ``full`` by the layer's own
    loaders, its two slots holding ``adapters``: {slice: (A, B)} whole, or {None: (A, B)} for the fused whole)."""
    batch = LoRABatch(8, 2, "cpu")
    with planned_layout(tp, rank):
        if kind == "qkv":
            base = QKVLinear(HIDDEN, HEAD_DIM, 4, num_kv_heads, bias=True)
            for shard in ("q", "k", "v"):
                base.weight.weight_loader(base.weight, full[shard], shard)
                base.bias.weight_loader(base.bias, full[shard + "_bias"], shard)
        elif kind == "gate_up":
            base = MergedLinear(HIDDEN, [INTER, INTER])
            for shard in (0, 1):
                base.weight.weight_loader(base.weight, full[shard], shard)
        else:   # a row-parallel projection with a bias (added once, after the sum)
            base = Linear(INTER, HIDDEN, bias=True, parallel="row")
            base.weight.weight_loader(base.weight, full["w"])
            base.bias.weight_loader(base.bias, full["bias"])
        layer = LoRALinear(base, batch, max_rank=8)
    for slot, adapter in enumerate(adapters):
        for slice_index, (a, b) in adapter.items():
            layer.set_slice(slot, slice_index, a, b)
    return layer, batch


@pytest.mark.parametrize("kind,num_kv_heads", [("qkv", 2), ("qkv", 1), ("gate_up", 2), ("row", 2)])
def test_tensor_parallel_shards_equal_one_rank(kind, num_kv_heads):
    """TP=2: column-parallel layers keep whole A and their rows of B (a KV head replicated on both ranks when
    there is one), row-parallel ones their columns of A and whole B: each rank's output concatenated (column) or
    summed before the bias (row, as the all-reduce does) is TP=1's, for tokens on two adapters and none."""
    gen = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    kv = num_kv_heads * HEAD_DIM
    if kind == "qkv":
        sizes = {"q": 4 * HEAD_DIM, "k": kv, "v": kv}
        full = {s: rand(n, HIDDEN) / 4 for s, n in sizes.items()} | {f"{s}_bias": rand(n) for s, n in sizes.items()}
        slices = [(i, n) for i, n in enumerate(sizes.values())]
        in_features = HIDDEN
    elif kind == "gate_up":
        full, slices = {0: rand(INTER, HIDDEN) / 4, 1: rand(INTER, HIDDEN) / 4}, [(0, INTER), (1, INTER)]
        in_features = HIDDEN
    else:
        full, slices, in_features = {"w": rand(HIDDEN, INTER) / 4, "bias": rand(HIDDEN)}, [(None, HIDDEN)], INTER
    adapters = [{s: (rand(r, in_features), rand(n, r)) for s, n in slices} for r in (8, 5)]
    if kind == "qkv":   # the second adapter as a fused-checkpoint one: one A for every slice, B's rows stacked
        a = rand(5, HIDDEN)
        adapters[1] = {None: (a, torch.cat([adapters[1][i][1] for i, _ in slices]))}
    x = rand(3, in_features)
    slots = np.array([0, -1, 1], dtype=np.int32)

    def run(tp, rank, x_part):
        layer, batch = _lora_layer(kind, tp, rank, full, adapters, num_kv_heads)
        batch.prepare(slots)
        with torch.no_grad():
            return layer.forward_local(x_part), layer

    whole, _ = run(1, 0, x)
    # TP=1 against the math: base + A/B per token
    if kind == "qkv":
        expected = torch.cat([x @ full[s].t() + full[f"{s}_bias"] for s in ("q", "k", "v")], dim=1)
        deltas = [torch.cat([x[0] @ a.t() @ b.t() for a, b in adapters[0].values()]),
                  torch.cat([x[2] @ adapters[1][None][0].t() @ b.t()
                             for b in adapters[1][None][1].split(list(sizes.values()))])]
    elif kind == "gate_up":
        expected = torch.cat([x @ full[0].t(), x @ full[1].t()], dim=1)
        deltas = [torch.cat([x[t] @ a.t() @ b.t() for a, b in adapters[slot].values()]) for t, slot in ((0, 0), (2, 1))]
    else:
        expected = x @ full["w"].t() + full["bias"]
        deltas = [x[t] @ adapters[slot][None][0].t() @ adapters[slot][None][1].t() for t, slot in ((0, 0), (2, 1))]
    expected[0] += deltas[0]
    expected[2] += deltas[1]
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)

    if kind == "row":
        parts = [run(2, r, x[:, r * INTER // 2:(r + 1) * INTER // 2]) for r in (0, 1)]
        assert all(layer.lora_b.shape[1] == HIDDEN and layer.lora_a.shape[2] == INTER // 2 for _, layer in parts)
        combined = parts[0][0] + parts[1][0] + full["bias"]   # the all-reduce, then the bias once
    else:
        parts = [run(2, r, x) for r in (0, 1)]
        pieces = []
        for s, (_, size) in enumerate(slices):
            local = [layer.slice_local[s] for _, layer in parts]
            outs = [out[:, off:off + n] for (out, _), (off, n) in zip(parts, local)]
            replicated = local[0][1] == size   # a KV head both ranks hold
            if replicated:
                torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
            pieces.append(outs[0] if replicated else torch.cat(outs, dim=1))
        combined = torch.cat(pieces, dim=1)
    torch.testing.assert_close(combined, whole, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# the records
# ---------------------------------------------------------------------------------------------

def test_lora_request_has_vllm_names_and_equality():
    a = LoRARequest("sql", 3, "/adapters/sql")
    assert (a.adapter_id, a.name, a.path) == (3, "sql", "/adapters/sql")
    assert a == LoRARequest("sql", 7, "/elsewhere") and hash(a) == hash(LoRARequest("sql", 7))   # by name
    assert a != LoRARequest("chat", 3, "/adapters/sql") and a != "sql"
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="lora_int_id must be an int > 0"):
            LoRARequest("sql", bad, "/p")
    with pytest.raises(ValueError, match="lora_name must be a non-empty str"):
        LoRARequest("", 1, "/p")


def test_lora_config_limits():
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    for kwargs, match in ((dict(max_loras=0), "max_loras must be a positive int"),
                          (dict(max_lora_rank=1024), "max_lora_rank must be at most 512"),
                          (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras must be an int >= max_loras \(4\)")):
        with pytest.raises(ValueError, match=match):
            LoRAConfig(**kwargs)


def test_batch_prepare_pads_and_checks():
    batch = LoRABatch(6, 2, "cpu")
    batch.prepare(np.array([1, -1, 0]), num_tokens=5)
    assert batch.token_lora_indices.tolist() == [1, -1, 0, -1, -1, -1] and batch.active and batch.num_tokens == 5
    batch.prepare(np.array([-1, -1]))
    assert not batch.active
    batch.prepare(None, num_tokens=4, active=True)   # a graph's LoRA variant captured on padding rows
    assert batch.active and batch.token_lora_indices[:4].tolist() == [-1] * 4
    with pytest.raises(ValueError, match=r"token_slots must lie in \[-1, 2\), got 2"):
        batch.prepare(np.array([0, 2]))
    with pytest.raises(ValueError, match=r"num_tokens must lie in \[3 \(the slots given\), 6\]"):
        batch.prepare(np.array([0, 1, 0]), num_tokens=7)
    assert token_slots([2, -1, 0], [3, 1, 2]).tolist() == [2, 2, 2, -1, 0, 0]


def test_compiled_layer_follows_the_batch_without_recompiling():
    """Under torch.compile (fullgraph, dynamic: the engine's compiled forward) a LoRA layer gives eager's results
    for batches of other sizes and slots, compiled once; a step without adapters (``active`` False, a guard) is
    the one other variant. aot_eager: dynamo's trace, the ops' fake implementations and AOT dispatch, without
    inductor's compile time (tests/pagedkernels/test_torch_ops.py compiles the ops with inductor)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(0)
    base = QKVLinear(HIDDEN, HEAD_DIM, 4, 2)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=gen))
    batch = LoRABatch(16, 2, "cpu")
    layer = LoRALinear(base, batch, max_rank=8)
    for slot in range(2):
        for s, (full, _) in enumerate(layer.slice_source):
            layer.set_slice(slot, s, torch.randn(8, HIDDEN, generator=gen), torch.randn(full, 8, generator=gen))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    counts = []
    for slots in ([0, -1, 1, 1, 0], [1, 1, 1, 1, -1, -1, 0, 0, 0], [-1, 0, -1]):
        x = torch.randn(len(slots), HIDDEN, generator=gen)
        batch.prepare(np.array(slots))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
        counts.append(counter.frame_count)
    assert counts[0] >= 1 and counts[1] == counts[2] == counts[0]   # the first call's compile serves the others
    batch.prepare(None)
    x = torch.randn(4, HIDDEN, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), base(x), rtol=0, atol=0)
    assert counts[0] < counter.frame_count <= 2 * counts[0]
    torch._dynamo.reset()
