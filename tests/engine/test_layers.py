"""Engine layers against transformers' definitions: rope frequencies (incl. scalings), fused linears."""

from __future__ import annotations

import math

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
    from engine.layers.quantization import unquantized

    monkeypatch.setattr(unquantized, "_onednn_applies", lambda x: False)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(model.proj(x), torch.nn.functional.linear(x, plain["proj.weight"], plain["proj.bias"]))


def test_16bit_exact_weights_get_a_16bit_copy_for_few_row_products(monkeypatch):
    """A float32 weight whose values are all bf16 (or fp16) ones, as a 16-bit checkpoint's are, gets a packed
    16-bit copy at prepack; products of up to W16_MAX_ROWS rows take pagedkernels.w16_gemm on it, larger ones
    oneDNN's float32 copy, both giving the float32 product of the same values. Weights with other values or
    ENGINE_CPU_W16=0 keep oneDNN alone."""
    _onednn_or_skip()
    from pagedkernels import _native

    if _native.library() is None:
        pytest.skip("no C compiler here: the 16-bit kernel is native")
    import pagedkernels as pk
    from torch import nn

    from engine.layers.embed_head import LMHead, VocabEmbedding
    from engine.layers.linear import Linear, prepack_linears
    from engine.layers.quantization import unquantized

    g = torch.Generator().manual_seed(1)
    model = nn.Module()
    model.bf16 = Linear(64, 40, bias=True)
    model.fp16 = Linear(48, 24)
    model.inexact = Linear(64, 16)
    model.odd_k = Linear(40, 16)   # K not a multiple of the kernel's vectors: takes it all the same
    model.embed = VocabEmbedding(100, 64)
    model.head = LMHead(100, 64)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g).to(torch.bfloat16).float())
    model.fp16.weight.data.copy_((torch.randn(24, 48, generator=g) / 300).to(torch.float16).float())
    model.inexact.weight.data.copy_(torch.randn(16, 64, generator=g))
    model.head.weight = model.embed.weight
    plain = {name: p.detach().clone().double() for name, p in model.named_parameters(remove_duplicate=False)}
    assert prepack_linears(model) == 5
    assert model.bf16.w16_weight.dtype == torch.bfloat16 and model.fp16.w16_weight.dtype == torch.float16
    assert model.head.w16_weight is not None and model.head.w16_rows == 100
    assert model.inexact.w16_weight is None and model.odd_k.w16_weight is not None

    calls = []
    real = pk.w16_gemm
    monkeypatch.setattr(pk, "w16_gemm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for rows in (1, 3, unquantized.W16_MAX_ROWS, unquantized.W16_MAX_ROWS + 1, unquantized.W16_MAX_ROWS + 20):
        for name in ("bf16", "fp16", "head"):
            layer = getattr(model, name)
            x = torch.randn(rows, layer.w16_weight.shape[1], generator=g)
            weight = plain["embed.weight" if name == "head" else f"{name}.weight"]
            expected = x.double() @ weight.T + (plain["bf16.bias"] if name == "bf16" else 0)
            torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert calls == [rows for rows in (1, 3, unquantized.W16_MAX_ROWS) for _ in range(3)]

    monkeypatch.setenv("ENGINE_CPU_W16", "0")
    again = Linear(64, 40)
    again.weight.data.copy_(plain["bf16.weight"].float())
    assert prepack_linears(again) == 1 and again.w16_weight is None


def test_prepack_skips_what_onednn_does_not_take():
    """Only float32 and bf16 weights pack (bf16: tests/engine/test_bf16_cpu.py); float16 ones keep F.linear's path
    untouched."""
    _onednn_or_skip()
    from engine.layers.linear import Linear, prepack_linears

    layer = Linear(32, 16).to(torch.float16)
    assert prepack_linears(layer) == 0
    assert layer.packed_weight is None and layer.w16_weight is None and layer.weight.shape == (16, 32)


# -- the per-model knobs ---------------------------------------------------------------------------------------


def test_longrope_inv_freqs_and_attention_factor_match_transformers():
    """Both LongRoPE frequency sets (partial rotary: 32 of 64 dims) and the cos/sin factor, against
    transformers' longrope init (short set below the original context, long set past it)."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary_embedding import longrope_inv_freqs

    g = torch.Generator().manual_seed(2)
    short, long = (1 + torch.rand(16, generator=g)).tolist(), (1 + 7 * torch.rand(16, generator=g)).tolist()
    parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                  "short_factor": short, "long_factor": long, "original_max_position_embeddings": 512}
    config = Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096,
                        original_max_position_embeddings=512, rope_parameters=parameters)
    expected_short, factor_short = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=512)
    expected_long, factor_long = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=513)
    short_inv, long_inv, attention_factor = longrope_inv_freqs(
        32, 10000.0, {**parameters, "factor": 4096 / 512})
    torch.testing.assert_close(short_inv.float(), expected_short, rtol=1e-6, atol=0)
    torch.testing.assert_close(long_inv.float(), expected_long, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(factor_short) and factor_short == factor_long > 1.1
    with pytest.raises(ValueError, match="short_factor has 16 entries"):
        longrope_inv_freqs(64, 10000.0, {**parameters, "factor": 8.0})  # 16 factors for 32 frequencies


def test_longrope_table_is_long_past_the_original_context():
    """One factor set per engine: the long one when the table (max_model_len) reaches past the original
    context, else the short one; cos and sin both carry the attention factor."""
    from engine.layers.rotary_embedding import longrope_inv_freqs

    parameters = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16,
                  "original_max_position_embeddings": 32, "factor": 4.0}
    short, long, attention_factor = longrope_inv_freqs(32, 10000.0, parameters)
    assert attention_factor == pytest.approx((1 + math.log(4.0) / math.log(32.0)) ** 0.5)
    for max_position, inv_freq in ((32, short), (33, long)):
        rope = RotaryEmbedding(64, max_position, 10000.0, parameters, rotary_dim=32)
        assert rope.uses_long_factors == (max_position > 32) and rope.cos_sin_cache.shape == (max_position, 32)
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
        expected = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
        torch.testing.assert_close(rope.cos_sin_cache.double(), expected, rtol=0, atol=1e-6)


def test_partial_rotary_leaves_the_other_dims():
    head_dim, g = 64, torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_dim, max_position=64, base=10000.0, rotary_dim=16)
    q, k = torch.randn(4, 2, head_dim, generator=g), torch.randn(4, 1, head_dim, generator=g)
    q_rot, k_rot = q.clone(), k.clone()
    rope(torch.tensor([1, 7, 20, 63]), q_rot, k_rot)
    torch.testing.assert_close(q_rot[..., 16:], q[..., 16:], rtol=0, atol=0)
    torch.testing.assert_close(k_rot[..., 16:], k[..., 16:], rtol=0, atol=0)
    assert not torch.allclose(q_rot[..., :16], q[..., :16])
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(head_dim, 64, 10000.0, rotary_dim=80)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_qk_norm_rotary_fused_equals_the_norms_then_the_rotation(backend):
    """Qwen3's attention inputs: forward_qk_norm(fused=True) (CUDA's default: one kernel, in place on views of
    the fused qkv) gives what the norms then the rotation give (the CPU's default), the Triton kernel under the
    interpreter included; v is untouched."""
    import pagedkernels as pk
    from engine.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(64, max_position=32, base=10000.0)
    q_norm, k_norm = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)
    q_norm.weight.data.copy_(0.5 + torch.rand(64, generator=g))
    k_norm.weight.data.copy_(0.5 + torch.rand(64, generator=g))
    positions = torch.tensor([0, 3, 17, 31])
    qkv = torch.randn(4, (3 + 2) * 64, generator=g)
    views = lambda t: (t[:, :192].view(4, 3, 64), t[:, 192:256].view(4, 1, 64))   # noqa: E731
    expected_q, expected_k = rope.forward_qk_norm(positions, *views(qkv.clone()), q_norm, k_norm, fused=False)
    fused = qkv.clone()
    with pk.use_backend(backend):
        q, k = rope.forward_qk_norm(positions, *views(fused), q_norm, k_norm, fused=True)
    assert q.data_ptr() == fused.data_ptr()   # in place, on the views
    torch.testing.assert_close(q, expected_q, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(k, expected_k, atol=2e-6, rtol=2e-6)
    assert torch.equal(fused[:, 256:], qkv[:, 256:])
    # norms of different eps: the unfused path, whatever `fused` asks
    k_norm.eps = 1e-5
    unfused = qkv.clone()
    q2, _ = rope.forward_qk_norm(positions, *views(unfused), q_norm, k_norm, fused=True)
    assert q2.data_ptr() != unfused.data_ptr() and torch.equal(unfused, qkv)


def test_rms_norm_offset_is_added_once_at_load():
    """Gemma's (1 + w): the loaded weight is stored as 1 + w, and the norm equals transformers' Gemma2RMSNorm."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from engine.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, generator=g) * 0.3
    norm = RMSNorm(96, 1e-6, offset=1.0)
    norm.weight.weight_loader(norm.weight, w)
    torch.testing.assert_close(norm.weight.data, w + 1)
    reference = Gemma2RMSNorm(96, eps=1e-6)
    reference.weight.data.copy_(w)
    x, residual = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(norm(x.clone()), reference(x))
        out, new_residual = norm(x.clone(), residual.clone())
        torch.testing.assert_close(new_residual, x + residual)
        torch.testing.assert_close(out, reference(x + residual))
    with pytest.raises(ValueError, match="shape"):
        norm.weight.weight_loader(norm.weight, w[:95])


def test_layer_norm_with_residual():
    from engine.layers.layernorm import LayerNorm

    g = torch.Generator().manual_seed(5)
    norm = LayerNorm(48, 1e-5)
    norm.weight.data.copy_(torch.rand(48, generator=g) + 0.5)
    norm.bias.data.copy_(torch.randn(48, generator=g))
    x, residual = torch.randn(3, 48, generator=g), torch.randn(3, 48, generator=g)
    reference = torch.nn.functional.layer_norm(x + residual, (48,), norm.weight, norm.bias, 1e-5)
    out, new_residual = norm(x, residual.clone())
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (48,), norm.weight, norm.bias, 1e-5))


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu", "silu"])
def test_gated_activations_match_transformers(name):
    from transformers.activations import ACT2FN

    from engine.layers.activation import gated_activation

    x = torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(6)) * 3
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(gated_activation(name)(x), ACT2FN[name](gate) * up)
    with pytest.raises(ValueError, match="hidden_act='relu2'"):
        gated_activation("relu2")


def test_scaled_embedding_and_softcapped_head():
    """Gemma: embeddings times sqrt(hidden) rounded to the model dtype; logits -> cap * tanh(logit / cap)."""
    from engine.layers.embed_head import LMHead, PositionEmbedding, VocabEmbedding

    g = torch.Generator().manual_seed(7)
    with torch.device("cpu"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            embed = VocabEmbedding(50, 3072, scale=3072 ** 0.5)
        finally:
            torch.set_default_dtype(previous)
    embed.weight.data.copy_(torch.randn(50, 3072, generator=g))
    ids = torch.tensor([3, 0, 49])
    assert embed.scale.dtype == torch.bfloat16 and embed.scale.item() == 55.5  # sqrt(3072) = 55.43 rounded
    expected = embed.weight[ids] * torch.tensor(3072 ** 0.5, dtype=torch.bfloat16)
    torch.testing.assert_close(embed(ids), expected, rtol=0, atol=0)

    head = LMHead(50, 16, softcap=5.0)
    head.weight.data.copy_(torch.randn(50, 16, generator=g))
    h = torch.randn(4, 16, generator=g) * 4
    logits = h @ head.weight.T
    assert logits.abs().max() > 10  # the cap bends these
    torch.testing.assert_close(head(h), 5.0 * torch.tanh(logits / 5.0))

    positions = PositionEmbedding(10, 8, offset=2)
    positions.weight.data.copy_(torch.randn(12, 8, generator=g))
    torch.testing.assert_close(positions(torch.tensor([0, 9])), positions.weight[[2, 11]])


def test_attention_rejects_bad_knobs():
    from engine.layers.attention import Attention

    for kwargs, match in (({"softcap": 0.0}, "softcap"), ({"scale": -1.0}, "scale"),
                          ({"sliding_window": 0}, "sliding_window")):
        with pytest.raises(ValueError, match=match):
            Attention(4, 2, 64, **kwargs)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(4, 3, 64)


def test_fused_checkpoint_tensor_loads_whole():
    """Phi-3 stores qkv_proj / gate_up_proj fused: shard_id None loads the whole tensor (split into its
    shards on the way), a wrong shape is a ValueError."""
    g = torch.Generator().manual_seed(8)
    qkv = QKVLinear(hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2)
    fused = torch.randn(64, 32, generator=g)
    qkv.weight.weight_loader(qkv.weight, fused, None)
    torch.testing.assert_close(qkv.weight.data, fused, rtol=0, atol=0)
    gate_up = MergedLinear(32, [48, 48])
    fused = torch.randn(96, 32, generator=g)
    gate_up.weight.weight_loader(gate_up.weight, fused, None)
    torch.testing.assert_close(gate_up.weight.data, fused, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fused parameter shape"):
        qkv.weight.weight_loader(qkv.weight, fused, None)
