"""Loader: single and sharded safetensors into fused parameters; missing/corrupt weights are ValueErrors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig

from engine.models import load_model_config
from engine.worker.loader import load_model, weight_files
from engine.models import get_model_class
from tests.engine.models_util import build_tiny_model_dir


def build_engine_model(model_dir: str) -> torch.nn.Module:
    config = load_model_config(model_dir)
    model = get_model_class(config.architecture)(config)
    for param in model.parameters():
        param.data.fill_(float("nan"))  # a parameter the loader skips stays NaN
    load_model(model, model_dir)
    return model


def checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weight_files(model_dir):
        tensors.update(load_file(path))
    return tensors


def assert_loaded(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every engine parameter equals the checkpoint tensors it fuses, in the fused order."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if ".qkv_proj." in name:
            parts = [name.replace(".qkv_proj.", f".{p}.") for p in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            parts = [name.replace(".gate_up_proj.", f".{p}.") for p in ("gate_proj", "up_proj")]
        else:
            parts = [name]
        torch.testing.assert_close(param.data, torch.cat([tensors[p] for p in parts]), rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_checkpoint(tmp_path, arch):
    """Sharded (index + several files) loads exactly like the checkpoint tensors; qwen2 adds
    q/k/v biases and tied embeddings, llama an untied lm_head."""
    model_dir = build_tiny_model_dir(arch, str(tmp_path / arch), max_shard_size="300KB")
    files = weight_files(model_dir)
    assert len(files) > 2 and os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json"))
    tensors = checkpoint_tensors(model_dir)
    model = build_engine_model(model_dir)
    assert_loaded(model, tensors)
    if arch == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "model.layers.0.self_attn.q_proj.bias" in tensors
    else:
        torch.testing.assert_close(model.lm_head.weight.data, tensors["lm_head.weight"], rtol=0, atol=0)


def test_single_file_with_extra_tied_head(tmp_path, tiny_model_dir):
    """A tied checkpoint that still carries lm_head.weight (and a stale rotary inv_freq) loads."""
    model_dir = str(tmp_path / "qwen3")
    shutil.copytree(tiny_model_dir("qwen3"), model_dir)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(32)
    save_file(tensors, path, metadata={"format": "pt"})
    model = build_engine_model(model_dir)
    assert_loaded(model, {k: v for k, v in tensors.items() if "inv_freq" not in k})
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (64,)


def copy_model(tiny_model_dir, tmp_path, arch: str = "llama") -> str:
    model_dir = str(tmp_path / arch)
    shutil.copytree(tiny_model_dir(arch), model_dir)
    return model_dir


def rewrite(model_dir: str, edit) -> None:
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_weight_file(tmp_path):
    model_dir = build_tiny_model_dir("llama", str(tmp_path / "sharded"), max_shard_size="300KB")
    victim = weight_files(model_dir)[1]
    os.remove(victim)
    with pytest.raises(ValueError, match=os.path.basename(victim)):
        build_engine_model(model_dir)
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(model_dir, name))
    with pytest.raises(ValueError, match="model.safetensors"):
        build_engine_model(model_dir)


@pytest.mark.parametrize("victim", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                    "model.norm.weight", "lm_head.weight"])
def test_missing_parameter(tiny_model_dir, tmp_path, victim):
    model_dir = copy_model(tiny_model_dir, tmp_path)
    rewrite(model_dir, lambda tensors: tensors.pop(victim))
    with pytest.raises(ValueError, match=f"missing.*{victim}"):
        build_engine_model(model_dir)


def test_wrong_shape_and_unexpected_tensor(tiny_model_dir, tmp_path):
    model_dir = copy_model(tiny_model_dir, tmp_path)
    name = "model.layers.0.self_attn.v_proj.weight"
    rewrite(model_dir, lambda tensors: tensors.__setitem__(name, tensors[name][:-1].clone()))
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        build_engine_model(model_dir)
    model_dir = copy_model(tiny_model_dir, tmp_path / "b")
    rewrite(model_dir, lambda tensors: tensors.__setitem__("model.layers.0.mlp.extra.weight", torch.rand(3)))
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        build_engine_model(model_dir)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "bad_index"])
def test_corrupt_safetensors(tiny_model_dir, tmp_path, damage):
    model_dir = copy_model(tiny_model_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        match = "model.safetensors"
    elif damage == "garbage_header":
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(b"\x00garbage, not a json header")
        match = "model.safetensors"
    else:
        with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}}, f)
        match = "index"
    with pytest.raises(ValueError, match=match):
        build_engine_model(model_dir)


def test_fused_checkpoint_loads_whole_and_names_what_is_missing(tiny_model_dir, tmp_path):
    """Phi-3's qkv_proj / gate_up_proj tensors load straight into the fused parameters; a fused tensor
    missing from the checkpoint is reported by its own name."""
    model_dir = tiny_model_dir("phi3")
    tensors = checkpoint_tensors(model_dir)
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    model = build_engine_model(model_dir)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.data, tensors[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    del tensors["model.layers.1.mlp.gate_up_proj.weight"]
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weights missing from \S+: model\.layers\.1\.mlp\.gate_up_proj\.weight$"):
        build_engine_model(str(broken))
