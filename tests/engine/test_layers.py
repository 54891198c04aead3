"""Engine layers against transformers' definitions: rope frequencies (incl. scalings), fused linears."""

from __future__ import annotations

import pytest
import torch

from engine.layers.linear import MergedLinear, QKVLinear
from engine.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq


@pytest.mark.parametrize("head_dim, theta, rope_scaling", [
    (64, 10000.0, None),
    (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),
    (64, 10000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                   "original_max_position_embeddings": 64}),
    (96, 1e6, {"rope_type": "linear", "factor": 4.0}),
])
def test_rope_inv_freq_matches_transformers(head_dim, theta, rope_scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=4096, rope_parameters=parameters)
    if rope_scaling is None:
        expected = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, "cpu")
        assert attention_factor == 1.0
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
    assert inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(inv_freq.float(), expected.float(), rtol=1e-6, atol=0)
    if rope_scaling is not None:  # the scaling changed something
        plain = rope_inv_freq(head_dim, theta, None)
        assert not torch.allclose(inv_freq, plain)


def test_rotary_embedding_rotates_neox_pairs():
    """Position p rotates the pair (x[i], x[i + d/2]) by p * inv_freq[i]; norms are preserved."""
    head_dim, generator = 64, torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(head_dim, max_position=128, base=10000.0)
    positions = torch.tensor([0, 5, 127])
    q = torch.randn(3, 4, head_dim, generator=generator)
    k = torch.randn(3, 2, head_dim, generator=generator)
    q_rot, k_rot = q.clone(), k.clone()
    rope(positions, q_rot, k_rot)
    angles = positions[:, None, None].double() * rope_inv_freq(head_dim, 10000.0, None)
    for x, out in ((q, q_rot), (k, k_rot)):
        x1, x2 = x.double().chunk(2, dim=-1)
        expected = torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], -1)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_rot[0], q[0])  # position 0 is the identity


def test_fused_linear_weight_loaders():
    generator = torch.Generator().manual_seed(1)
    qkv = QKVLinear(hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2, bias=True)
    parts = {s: torch.randn(n, 32, generator=generator) for s, n in (("q", 32), ("k", 16), ("v", 16))}
    biases = {s: torch.randn(w.shape[0], generator=generator) for s, w in parts.items()}
    for shard in ("v", "q", "k"):  # any order
        qkv.weight.weight_loader(qkv.weight, parts[shard], shard)
        qkv.bias.weight_loader(qkv.bias, biases[shard], shard)
    x = torch.randn(5, 32, generator=generator)
    expected = torch.cat([x @ parts[s].T + biases[s] for s in ("q", "k", "v")], dim=-1)
    torch.testing.assert_close(qkv(x), expected)
    assert qkv.weight.shard_ids == ("q", "k", "v")

    gate_up = MergedLinear(32, [48, 48])
    gate, up = torch.randn(48, 32, generator=generator), torch.randn(48, 32, generator=generator)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    torch.testing.assert_close(gate_up(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    with pytest.raises(ValueError, match="shape"):
        qkv.weight.weight_loader(qkv.weight, parts["q"], "k")


def _onednn_or_skip():
    from engine.layers import linear as linear_module

    if linear_module._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear (or ENGINE_CPU_LINEAR=torch)")


def test_prepacked_linears_match_plain_and_keep_tied_weights(monkeypatch):
    """prepack_linears reorders every float32 CPU linear weight once (oneDNN's blocked layout), frees
    the plain copy unless another module shares it (a tied LM head's embedding), and the packed path
    computes what F.linear does, for any row count; a call the packed path cannot take (under
    torch.compile) rebuilds the plain weight instead of failing."""
    _onednn_or_skip()
    from torch import nn

    from engine.layers.embed_head import LMHead, VocabEmbedding
    from engine.layers.linear import Linear, prepack_linears

    g = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.proj = Linear(64, 96, bias=True)
    model.embed = VocabEmbedding(200, 64)
    model.head = LMHead(200, 64)
    model.untied_head = LMHead(200, 64)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    model.head.weight = model.embed.weight
    plain = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}

    assert prepack_linears(model) == 3
    assert model.proj.weight.numel() == 0 and model.untied_head.weight.numel() == 0
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (200, 64)
    for rows in (1, 7, 48, 300):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(model.proj(x), torch.nn.functional.linear(x, plain["proj.weight"],
                                                                             plain["proj.bias"]))
        torch.testing.assert_close(model.head(x), x @ plain["embed.weight"].T)
        torch.testing.assert_close(model.untied_head(x), x @ plain["untied_head.weight"].T)
    from engine.layers import linear as linear_module

    monkeypatch.setattr(linear_module, "_onednn_applies", lambda x: False)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(model.proj(x), torch.nn.functional.linear(x, plain["proj.weight"], plain["proj.bias"]))


def test_prepack_skips_what_onednn_does_not_take():
    """Only float32 weights pack; others keep F.linear's path untouched."""
    _onednn_or_skip()
    from engine.layers.linear import Linear, prepack_linears

    layer = Linear(32, 16).to(torch.bfloat16)
    assert prepack_linears(layer) == 0
    assert layer.packed_weight is None and layer.weight.shape == (16, 32)
