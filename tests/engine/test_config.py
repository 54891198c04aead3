"""ModelConfig: both transformers key styles, EOS ids, sliding windows, dtype policy, bad configs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.config import ModelConfig
from engine.models import load_model_config
from pagedkernels import _native as pk_native
from engine.models import SUPPORTED_ARCHITECTURES, get_model_class
from tests.engine.models_util import MISTRAL_SLIDING_WINDOW

LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def write_config(tmp_path, config: dict, generation_config: dict | None = None) -> str:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5}
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**base, **config}, f)
    if generation_config is not None:
        with open(tmp_path / "generation_config.json", "w") as f:
            json.dump(generation_config, f)
    return str(tmp_path)


def test_transformers_4_keys(tmp_path):
    model_dir = write_config(tmp_path, {
        "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING},
        "torch_dtype": "bfloat16", "eos_token_id": [128001, 128008], "bos_token_id": 128000})
    config = load_model_config(model_dir, device="cpu")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert config.head_dim == 256 // 8
    # "auto": a bf16 checkpoint runs in bf16 on a CPU with fast bf16 arithmetic, else in float32
    assert config.dtype == (torch.bfloat16 if pk_native.cpu_bf16_isa() else torch.float32)
    assert load_model_config(model_dir, device="cuda").dtype == torch.bfloat16
    assert load_model_config(model_dir, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    assert load_model_config(model_dir, dtype=torch.float16).dtype == torch.float16
    assert config.eos_token_ids == frozenset({128001, 128008})
    assert config.bos_token_id == 128000 and config.pad_token_id is None


def test_transformers_5_keys(tmp_path):
    model_dir = write_config(tmp_path, {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING},
        "dtype": "float16", "head_dim": 64, "eos_token_id": 7})
    config = load_model_config(model_dir, device="cuda")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert config.head_dim == 64
    assert config.dtype == torch.float16
    plain = write_config(tmp_path, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    config = load_model_config(plain, device="cuda")
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)
    assert config.dtype == torch.float32  # no dtype in the checkpoint: float32


def test_eos_ids_from_config_and_generation_config(tmp_path):
    model_dir = write_config(tmp_path, {"eos_token_id": 2, "pad_token_id": 0},
                             {"eos_token_id": [2, 32000, 32001], "bos_token_id": 1})
    config = load_model_config(model_dir)
    assert config.eos_token_ids == frozenset({2, 32000, 32001})
    assert config.bos_token_id == 1 and config.pad_token_id == 0
    os.remove(tmp_path / "generation_config.json")
    assert load_model_config(model_dir).eos_token_ids == frozenset({2})


def test_tiny_models(tiny_model_dir):
    llama = load_model_config(tiny_model_dir("llama"))
    assert llama.rope_scaling["rope_type"] == "llama3" and not llama.tie_word_embeddings
    assert llama.layer_sliding_windows == (None, None)
    assert llama.eos_token_ids == frozenset({0, 2})  # config.json has 0, generation_config [2, 0]
    mistral = load_model_config(tiny_model_dir("mistral"))
    assert mistral.sliding_window == MISTRAL_SLIDING_WINDOW
    assert mistral.layer_sliding_windows == (MISTRAL_SLIDING_WINDOW,) * 2
    qwen2 = load_model_config(tiny_model_dir("qwen2"))
    assert qwen2.attention_bias and qwen2.tie_word_embeddings and qwen2.sliding_window is None
    qwen3 = load_model_config(tiny_model_dir("qwen3"), max_model_len=100)
    assert not qwen3.attention_bias and qwen3.max_model_len == 100 and qwen3.max_position_embeddings == 1024
    assert get_model_class(qwen3.architecture).qk_norm


def test_qwen2_sliding_window_layers(tmp_path):
    """transformers 4: layers from max_window_layers on slide; 5: layer_types says which."""
    v4 = write_config(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                 "sliding_window": 32, "max_window_layers": 1})
    assert load_model_config(v4).layer_sliding_windows == (None, 32, 32)
    v5 = write_config(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                 "sliding_window": 32,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})
    assert load_model_config(v5).layer_sliding_windows == (32, None, 32)
    off = write_config(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                                  "sliding_window": 32})
    assert load_model_config(off).layer_sliding_windows == (None, None, None)


def test_unknown_architecture_lists_supported(tmp_path):
    model_dir = write_config(tmp_path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model_config(model_dir)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("FalconForCausalLM")


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_bad_configs(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        load_model_config(write_config(tmp_path, change))


def test_bad_arguments_and_files(tmp_path):
    model_dir = write_config(tmp_path, {})
    with pytest.raises(ValueError, match="max_model_len"):
        load_model_config(model_dir, max_model_len=5000)
    with pytest.raises(ValueError, match="dtype"):
        load_model_config(model_dir, dtype="int8")
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(model_dir)


# -- each model's own mapping ----------------------------------------------------------------------------------


def test_gemma2_mapping_and_defaults(tmp_path):
    """transformers 5 layer_types, else Gemma 2's default: even layers slide; scale from query_pre_attn_scalar;
    softcaps (default 50 / 30, null turns one off); embeddings tied unless the config says otherwise."""
    base = {"architectures": ["Gemma2ForCausalLM"], "head_dim": 64, "query_pre_attn_scalar": 144,
            "sliding_window": 16, "hidden_activation": "gelu_pytorch_tanh"}
    config = load_model_config(write_config(tmp_path, base))
    assert config.layer_sliding_windows == (16, None, 16)
    assert config.attention_scale == pytest.approx(1 / 12)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh" and config.head_dim == 64
    config = load_model_config(write_config(tmp_path, {
        **base, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": None, "tie_word_embeddings": False}))
    assert config.layer_sliding_windows == (None, 16, None)
    assert config.final_logit_softcap is None and not config.tie_word_embeddings
    with pytest.raises(ValueError, match="layer_types has 2 entries for 3 layers"):
        load_model_config(write_config(tmp_path, {**base, "layer_types": ["full_attention"] * 2}))
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        load_model_config(write_config(tmp_path, {**base, "hidden_activation": "relu"}))


def test_phi3_longrope_from_either_key_style(tmp_path):
    """Microsoft's files: rope_scaling type "su" (or "longrope") with original_max_position_embeddings at the
    top level; transformers 5: all of it in rope_parameters. factor = max positions / original ones."""
    short, long = [1.0] * 16, [2.0] * 16
    base = {"architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 4096,
            "original_max_position_embeddings": 1024, "sliding_window": 2047, "partial_rotary_factor": 0.5}
    v4 = load_model_config(write_config(tmp_path, {
        **base, "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long}}))
    v5 = load_model_config(write_config(tmp_path, {
        "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 4096, "sliding_window": 2047,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "short_factor": short, "long_factor": long, "original_max_position_embeddings": 1024}}))
    for config in (v4, v5):
        assert config.rope_scaling == {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                       "original_max_position_embeddings": 1024, "factor": 4.0}
        assert config.partial_rotary_factor == 0.5 and config.norm_eps == 1e-5
        assert config.layer_sliding_windows == (2047,) * 3
    plain = load_model_config(write_config(tmp_path, {"architectures": ["Phi3ForCausalLM"]}))
    assert plain.rope_scaling is None and plain.sliding_window is None and plain.layer_sliding_windows == (None,) * 3
    with pytest.raises(ValueError, match="long_factor"):
        load_model_config(write_config(tmp_path, {**base, "rope_scaling": {"type": "longrope",
                                                                                     "short_factor": short}}))


def test_opt_mapping_and_rejections(tmp_path):
    base = {"architectures": ["OPTForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": None, "ffn_dim": 1024, "intermediate_size": None}
    config = load_model_config(write_config(tmp_path, base))
    assert (config.intermediate_size, config.norm_eps, config.hidden_act) == (1024, 1e-5, "relu")
    assert config.attention_bias and config.mlp_bias and config.layer_norm_before and config.tie_word_embeddings
    assert config.word_embed_proj_dim == 256 and config.num_key_value_heads == 4 and config.head_dim == 64
    post_ln = load_model_config(write_config(tmp_path, {**base, "do_layer_norm_before": False,
                                                                  "word_embed_proj_dim": 128, "enable_bias": False}))
    assert not post_ln.layer_norm_before and post_ln.word_embed_proj_dim == 128 and not post_ln.attention_bias
    for change, match in (({"activation_function": "swiglu"}, "swiglu"),
                          ({"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine"),
                          ({"ffn_dim": None}, "ffn_dim")):
        with pytest.raises(ValueError, match=match):
            load_model_config(write_config(tmp_path, {**base, **change}))


def test_model_type_without_architectures(tmp_path):
    for model_type, architecture in (("opt", "OPTForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                                     ("phi3", "Phi3ForCausalLM")):
        config = load_model_config(write_config(tmp_path, {"architectures": None, "model_type": model_type,
                                                                     "ffn_dim": 64, "num_key_value_heads": None}))
        assert config.architecture == architecture


def test_tiny_new_architectures(tiny_model_dir):
    from tests.engine.models_util import GEMMA2_SLIDING_WINDOW, PHI3_ORIGINAL_MAX_POSITIONS, PHI3_SLIDING_WINDOW

    gemma2 = load_model_config(tiny_model_dir("gemma2"))
    assert gemma2.layer_sliding_windows == (GEMMA2_SLIDING_WINDOW, None)
    phi3 = load_model_config(tiny_model_dir("phi3"))
    assert phi3.rope_scaling["rope_type"] == "longrope" and phi3.partial_rotary_factor == 0.5
    assert phi3.rope_scaling["original_max_position_embeddings"] == PHI3_ORIGINAL_MAX_POSITIONS
    assert phi3.layer_sliding_windows == (PHI3_SLIDING_WINDOW,) * 2
    opt = load_model_config(tiny_model_dir("opt"))
    assert opt.tie_word_embeddings and opt.layer_norm_before and opt.num_key_value_heads == 2


@pytest.mark.parametrize("flags, checkpoint, expected, reason", [
    ({"avx2", "fma"}, "bfloat16", torch.float32, "float32, not the checkpoint's bfloat16: this CPU has neither"),
    ({"avx512f", "avx512_bf16"}, "bfloat16", torch.bfloat16, "the checkpoint's bfloat16: this CPU has AVX512-BF16"),
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", torch.bfloat16, "the checkpoint's bfloat16: this CPU has "
                                                                          "AMX-BF16"),
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, "float16", torch.float32, "float32, not the checkpoint's float16"),
    ({"avx2"}, "float32", torch.float32, "the checkpoint's dtype, float32"),
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, ("bfloat16", "gptq"), torch.float32, "a quantized model's CPU GEMMs"),
])
def test_dtype_auto_on_cpu_follows_its_bf16_arithmetic(tmp_path, monkeypatch, caplog, flags, checkpoint, expected,
                                                       reason):
    """dtype="auto" on a CPU: a bf16 checkpoint runs in bf16 where the CPU has AMX-BF16 or AVX512-BF16 (its flags in
    /proc/cpuinfo), in float32 elsewhere; float16 and quantized checkpoints in float32 everywhere; one log line says
    which and why. An explicit dtype is taken as asked."""
    monkeypatch.setattr(pk_native, "cpu_flags", lambda: frozenset(flags))
    checkpoint, quant = checkpoint if isinstance(checkpoint, tuple) else (checkpoint, None)
    quant_config = {"quantization_config": {"quant_method": quant, "bits": 4, "group_size": 128}} if quant else {}
    model_dir = write_config(tmp_path, {"torch_dtype": checkpoint, **quant_config})
    with caplog.at_level("INFO", logger="engine.config"):
        assert load_model_config(model_dir, device="cpu").dtype == expected
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.config"]
    assert len(lines) == 1 and reason in lines[0], lines
    assert load_model_config(model_dir, dtype="float32", device="cpu").dtype == torch.float32
    assert load_model_config(model_dir, dtype="bfloat16", device="cpu").dtype == torch.bfloat16


def test_dtype_auto_on_cpu_says_why_when_the_kernels_did_not_build(tmp_path, monkeypatch, caplog):
    """Without the native kernels a bf16 model would run on PyTorch twins: float32 then, and the log says why."""
    monkeypatch.setattr(pk_native, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(pk_native, "library", lambda: None)
    monkeypatch.setattr(pk_native, "_build_error", "no C compiler found")
    model_dir = write_config(tmp_path, {"torch_dtype": "bfloat16"})
    with caplog.at_level("INFO", logger="engine.config"):
        assert load_model_config(model_dir, device="cpu").dtype == torch.float32
    assert any("native kernels did not build (no C compiler found)" in r.getMessage() for r in caplog.records)


def test_bf16_panel_row_limits_by_isa_and_environment(monkeypatch):
    """The rows up to which a CPU bf16 product takes the panel kernel, eager and in a decode graph: AMX-BF16 64 and
    every row in a graph where the build has the tile kernel (measured on Emerald Rapids), 8 in both where it has not
    (the pair dot products alone); AVX512-BF16 96, and every row in a graph (measured on Zen 5); no fast bf16: every
    row. ENGINE_CPU_BF16_W16_MAX_ROWS / ..._GRAPH_MAX_ROWS override them ("all": every row); anything else is refused
    by name."""
    from engine.platform import _cpu_bf16_w16_max_rows as limit

    for name in ("ENGINE_CPU_BF16_W16_MAX_ROWS", "ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS"):
        monkeypatch.delenv(name, raising=False)
    assert [limit(isa) for isa in ("amx-bf16", "avx512-bf16", None)] == [64, 96, None]
    assert [limit(isa, graphs=True) for isa in ("amx-bf16", "avx512-bf16", None)] == [None, None, None]
    assert limit("amx-bf16", amx_tiles=False) == limit("amx-bf16", graphs=True, amx_tiles=False) == 8
    assert limit("avx512-bf16", amx_tiles=False) == 96   # only an AMX CPU's limits depend on the tiles
    monkeypatch.setenv("ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS", "48")
    assert limit("avx512-bf16", graphs=True) == 48 and limit("avx512-bf16") == 96
    monkeypatch.setenv("ENGINE_CPU_BF16_W16_MAX_ROWS", "all")
    assert limit("amx-bf16") is None
    monkeypatch.setenv("ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS"):
        limit("avx512-bf16", graphs=True)


@pytest.mark.parametrize("tiles", [True, False])
def test_amx_cpu_without_the_tile_kernel_takes_the_pair_dot_limits(monkeypatch, tiles):
    """On an AMX CPU the bf16 panel limits assume the native build's tile kernel; once the kernels are built, a build
    that cannot use the tiles (PAGEDKERNELS_CPU_AMX=0, an old compiler, another -march) gets the pair dot products'
    limits (8 eager and in graphs) instead of 64 / every row. Other CPUs' limits are left as they are."""
    import dataclasses

    from engine.layers.quantization import unquantized
    from pagedkernels import _native

    if _native.library() is None:
        pytest.skip("native CPU kernels unavailable (no C compiler): no panel path to limit")
    for name in ("ENGINE_CPU_BF16_W16_MAX_ROWS", "ENGINE_CPU_BF16_W16_GRAPH_MAX_ROWS"):
        monkeypatch.delenv(name, raising=False)
    for isa, expected in (("amx-bf16", (64, None) if tiles else (8, 8)), ("avx512-bf16", (64, None))):
        monkeypatch.setattr(unquantized, "_CPU_POLICY", dataclasses.replace(unquantized._CPU_POLICY, cpu_bf16_isa=isa))
        monkeypatch.setattr(unquantized, "BF16_W16_MAX_ROWS", 64)   # as the policy left them: changed only on AMX
        monkeypatch.setattr(unquantized, "BF16_W16_GRAPH_MAX_ROWS", None)   # without the tiles
        monkeypatch.setattr(unquantized, "_amx_limits_settled", False)
        monkeypatch.setattr(_native, "w16_amx", lambda rows=None: (tiles, 5))
        unquantized._settle_amx_limits()
        assert (unquantized.BF16_W16_MAX_ROWS, unquantized.BF16_W16_GRAPH_MAX_ROWS) == expected
        assert unquantized._amx_limits_settled
