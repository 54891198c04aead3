"""PEFT LoRA adapters as PEFT saves them: ``adapter_config.json`` + ``adapter_model.safetensors`` (or
``adapter_model.bin``), loaded and checked against the base model before any of it reaches a device slot.

Tensors are named ``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and ``....lora_B.weight``
(``[out_features, r]``); ``<module>`` is the base model's module path (``model.layers.0.self_attn.q_proj``). An
adapter's delta on a token's projection is ``scaling * B @ A @ x`` with ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (rank-stabilized LoRA); ``rank_pattern`` / ``alpha_pattern`` give
some modules their own r / alpha (PEFT's rule: a key matches a module whose name is it or ends with ``.<key>``,
the key read as a regular expression). The scaling is folded into B here, in float32, before the weights take the
model's dtype.

Every problem is a ValueError naming the adapter, raised before anything is loaded (the engine then fails that
request only): a missing or unreadable file, a config the engine does not run (DoRA, trained biases,
``modules_to_save``, embedding targets, activated LoRA, ...), a rank over ``max_lora_rank``, a target module the
engine does not apply LoRA to (the error lists those it does), and weights whose shapes do not match the base
model's projections (an adapter trained for another model).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Mapping

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."
# <module>.lora_A.weight, also with an adapter name PEFT sometimes leaves in (<module>.lora_A.default.weight)
_TENSOR_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
# Config keys whose non-empty values mean something the engine does not run.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules_to_save (fully trained modules beside the adapter)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "target_parameters": "target_parameters (LoRA on parameters, not modules)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer_replication",
    "use_qalora": "QA-LoRA",
}


@dataclass
class LoRAModuleWeights:
    """One projection's adapter: ``lora_a [r, in_features]``, ``lora_b [out_features, r]`` (scaling folded in)."""
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: its id and name, the path it came from, its weights per target module (checkpoint names)
    on the host."""
    lora_int_id: int
    lora_name: str
    path: str
    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
                   for w in self.modules.values())


def _pattern_value(patterns: Mapping, module: str, default):
    """PEFT's per-module override: the first pattern key equal to ``module`` or matching its end after a dot."""
    for key, value in patterns.items():
        if key == module or re.match(rf"(.*\.)?(?:{key})$", module):
            return value
    return default


def read_adapter_config(path: str, where: str | None = None) -> dict:
    """``path/adapter_config.json``, checked for what the engine runs (errors start with ``where``)."""
    where = where or f"LoRA adapter {path}"
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"{where}: not a directory (expected PEFT's {CONFIG_FILE} and adapter_model.safetensors)")
    if not os.path.isfile(config_path):
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold an object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported ({CONFIG_FILE}: {key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases are not supported ({CONFIG_FILE}: bias={config['bias']!r}, "
                         f"the engine runs bias='none')")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out=true (GPT-2's Conv1D layout) is not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: {CONFIG_FILE}: r must be a positive int, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: {CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{where}: {CONFIG_FILE}: {key} must be an object, got {config[key]!r}")
    return config


def _read_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(file, device="cpu")
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - safetensors and torch raise their own types for corrupt files
            raise ValueError(f"{where}: cannot read {name}: {e}") from e
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{where}: {name} does not hold a state dict of tensors")
        return tensors
    raise ValueError(f"{where}: no adapter weights ({' or '.join(WEIGHT_FILES)})")


def load_peft_adapter(path: str, *, lora_int_id: int, lora_name: str, targets: Mapping[str, tuple[int, int]],
                      max_lora_rank: int, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Load the PEFT adapter in ``path`` for a base model whose LoRA targets are ``targets``: checkpoint module
    name -> (in_features, out_features), whole (unsharded). Returns its weights in ``dtype`` on the host, B
    scaled. ValueError (naming the adapter and what is wrong) for anything the engine cannot run as given."""
    where = f"LoRA adapter {lora_name!r} ({path})"
    config = read_adapter_config(path, where)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    declared = config.get("target_modules")
    if isinstance(declared, (list, tuple)):
        supported = {name.rpartition(".")[2] for name in targets}
        unknown = sorted({str(m).rpartition(".")[2] for m in declared} - supported)
        if unknown:
            raise ValueError(f"{where}: target module(s) {unknown} are not supported: LoRA applies to "
                             f"{sorted(supported)} of this model")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path, where).items():
        module = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        match = _TENSOR_NAME.match(module)
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A/B weight of a supported module (only "
                             f"lora_A / lora_B of {sorted({t.rpartition('.')[2] for t in targets})})")
        module = match["module"]
        if module not in targets:
            if ".experts." in f".{module}.":
                raise ValueError(f"{where}: targets {module!r}, an expert of a mixture of experts: LoRA on the "
                                 f"experts is not supported (the attention projections and dense MLPs are)")
            last = module.rpartition(".")[2]
            if last in {t.rpartition(".")[2] for t in targets}:
                raise ValueError(f"{where}: targets {module!r}, which this base model does not have (it has "
                                 f"{_layer_count(targets)} decoder layers): an adapter for another model?")
            raise ValueError(f"{where}: target module {module!r} is not supported: LoRA applies to "
                             f"{sorted({t.rpartition('.')[2] for t in targets})} of this model")
        parts.setdefault(module, {})[match["which"]] = tensor
    if not parts:
        raise ValueError(f"{where}: the adapter holds no LoRA weights")
    adapter = LoRAAdapter(lora_int_id, lora_name, path)
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            (have,) = pair
            raise ValueError(f"{where}: {module} has lora_{have} but not lora_{'B' if have == 'A' else 'A'}")
        a, b = pair["A"], pair["B"]
        in_features, out_features = targets[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{where}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not an "
                             f"[r, in] and [out, r] pair")
        rank = a.shape[0]
        if (a.shape[1], b.shape[0]) != (in_features, out_features):
            raise ValueError(f"{where}: {module} maps {a.shape[1]} -> {b.shape[0]} features, but the base model's "
                             f"{module} maps {in_features} -> {out_features}: an adapter for another model?")
        if rank > max_lora_rank:
            raise ValueError(f"{where}: {module} has rank {rank}, over max_lora_rank={max_lora_rank} (raise "
                             f"max_lora_rank to serve it)")
        configured = _pattern_value(rank_pattern, module, config["r"])
        if configured != rank:
            raise ValueError(f"{where}: {module}'s weights have rank {rank}, but {CONFIG_FILE} gives it r="
                             f"{configured}")
        alpha = _pattern_value(alpha_pattern, module, config.get("lora_alpha", config["r"]))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
            raise ValueError(f"{where}: {module}: LoRA weights must be floating point, got {a.dtype} / {b.dtype}")
        adapter.modules[module] = LoRAModuleWeights(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype))
    return adapter


def _layer_count(targets) -> int:
    layers = {int(m.group(1)) for name in targets for m in [re.search(r"layers\.(\d+)\.", name)] if m}
    return len(layers)
