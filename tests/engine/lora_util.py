"""PEFT LoRA adapters of the tiny test models, and PEFT's own merged model as the oracle (transformers + peft,
float32), shared by the LoRA tests (test_lora.py: the layers and caches; test_lora_engine.py: the engine;
test_server_lora.py: the server).

The adapters differ in what PEFT lets them differ in: rank (4 to 16), lora_alpha, rslora, rank_pattern /
alpha_pattern, target subsets. Their A and B are random, sized so that an adapter moves the logits about as much as
the base weights make them (greedy tokens then differ from the base model's)."""

from __future__ import annotations

import copy
import functools
import json
import os

import torch

from tests.engine.models_util import load_hf_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: LoraConfig options (r, lora_alpha, target_modules, use_rslora, rank_pattern, alpha_pattern)
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=TARGETS),
    "qv-down-rslora-r16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "patterns-r4": dict(r=4, lora_alpha=4, target_modules=TARGETS, rank_pattern={"down_proj": 12},
                        alpha_pattern={"q_proj": 32}),
    "mlp-o-r16": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "o_proj"]),
}


@functools.lru_cache(maxsize=None)
def hf_base(model_dir: str):
    """transformers' model of ``model_dir`` (loaded once; PEFT gets deep copies, as it changes what it wraps)."""
    return load_hf_model(model_dir)


def make_peft_adapter(model_dir: str, out_dir: str, *, seed: int, **options) -> str:
    """A PEFT LoRA adapter of ``model_dir`` with random A and B, saved as PEFT saves it; returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(hf_base(model_dir)), LoraConfig(init_lora_weights=False, **options))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 / param.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=None)
def peft_merged_model(model_dir: str, adapter_dir: str | None):
    """transformers' model with the adapter merged by PEFT (``merge_and_unload``), or the base model."""
    from peft import PeftModel

    model = hf_base(model_dir)
    if adapter_dir is None:
        return model
    return PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).merge_and_unload()


def peft_merged_log_probs(model_dir: str, adapter_dir: str | None, token_ids: list[int]) -> torch.Tensor:
    """float32 log-softmax at every position of PEFT's merged model (or the base model)."""
    with torch.inference_mode():
        logits = peft_merged_model(model_dir, adapter_dir)(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def write_adapter(path, tensors: dict[str, torch.Tensor], **config) -> str:
    """An adapter directory as PEFT writes it, from raw tensors and adapter_config.json fields."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "bias": "none", **config}, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def lora_pair(module: str, rank: int, in_features: int, out_features: int, seed: int = 0) -> dict:
    """lora_A / lora_B of one module under PEFT's names, random."""
    gen = torch.Generator().manual_seed(seed)
    prefix = f"base_model.model.{module}"
    return {f"{prefix}.lora_A.weight": torch.randn(rank, in_features, generator=gen) / in_features ** 0.5,
            f"{prefix}.lora_B.weight": torch.randn(out_features, rank, generator=gen) / rank ** 0.5}
