"""ModelConfig: both transformers key styles, EOS ids, sliding windows, dtype policy, bad configs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.config import ModelConfig
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
    config = ModelConfig.from_pretrained(model_dir, device="cpu")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert config.head_dim == 256 // 8
    assert config.dtype == torch.float32  # bf16 checkpoint runs in float32 on CPU under "auto"
    assert ModelConfig.from_pretrained(model_dir, device="cuda").dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(model_dir, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(model_dir, dtype=torch.float16).dtype == torch.float16
    assert config.eos_token_ids == frozenset({128001, 128008})
    assert config.bos_token_id == 128000 and config.pad_token_id is None


def test_transformers_5_keys(tmp_path):
    model_dir = write_config(tmp_path, {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING},
        "dtype": "float16", "head_dim": 64, "eos_token_id": 7})
    config = ModelConfig.from_pretrained(model_dir, device="cuda")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert config.head_dim == 64
    assert config.dtype == torch.float16
    plain = write_config(tmp_path, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    config = ModelConfig.from_pretrained(plain, device="cuda")
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)
    assert config.dtype == torch.float32  # no dtype in the checkpoint: float32


def test_eos_ids_from_config_and_generation_config(tmp_path):
    model_dir = write_config(tmp_path, {"eos_token_id": 2, "pad_token_id": 0},
                             {"eos_token_id": [2, 32000, 32001], "bos_token_id": 1})
    config = ModelConfig.from_pretrained(model_dir)
    assert config.eos_token_ids == frozenset({2, 32000, 32001})
    assert config.bos_token_id == 1 and config.pad_token_id == 0
    os.remove(tmp_path / "generation_config.json")
    assert ModelConfig.from_pretrained(model_dir).eos_token_ids == frozenset({2})


def test_tiny_models(tiny_model_dir):
    llama = ModelConfig.from_pretrained(tiny_model_dir("llama"))
    assert llama.rope_scaling["rope_type"] == "llama3" and not llama.tie_word_embeddings
    assert llama.layer_sliding_windows == (None, None)
    assert llama.eos_token_ids == frozenset({0, 2})  # config.json has 0, generation_config [2, 0]
    mistral = ModelConfig.from_pretrained(tiny_model_dir("mistral"))
    assert mistral.sliding_window == MISTRAL_SLIDING_WINDOW
    assert mistral.layer_sliding_windows == (MISTRAL_SLIDING_WINDOW,) * 2
    qwen2 = ModelConfig.from_pretrained(tiny_model_dir("qwen2"))
    assert qwen2.attention_bias and qwen2.tie_word_embeddings and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_pretrained(tiny_model_dir("qwen3"), max_model_len=100)
    assert not qwen3.attention_bias and qwen3.max_model_len == 100 and qwen3.max_position_embeddings == 1024
    assert get_model_class(qwen3.architecture).qk_norm


def test_qwen2_sliding_window_layers(tmp_path):
    """transformers 4: layers from max_window_layers on slide; 5: layer_types says which."""
    v4 = write_config(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                 "sliding_window": 32, "max_window_layers": 1})
    assert ModelConfig.from_pretrained(v4).layer_sliding_windows == (None, 32, 32)
    v5 = write_config(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                 "sliding_window": 32,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})
    assert ModelConfig.from_pretrained(v5).layer_sliding_windows == (32, None, 32)
    off = write_config(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                                  "sliding_window": 32})
    assert ModelConfig.from_pretrained(off).layer_sliding_windows == (None, None, None)


def test_unknown_architecture_lists_supported(tmp_path):
    model_dir = write_config(tmp_path, {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_pretrained(model_dir)
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
        ModelConfig.from_pretrained(write_config(tmp_path, change))


def test_bad_arguments_and_files(tmp_path):
    model_dir = write_config(tmp_path, {})
    with pytest.raises(ValueError, match="max_model_len"):
        ModelConfig.from_pretrained(model_dir, max_model_len=5000)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_pretrained(model_dir, dtype="int8")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_pretrained(model_dir)
