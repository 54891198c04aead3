"""Sampling defaults from a model's generation_config.json, as vLLM's `--generation-config auto` takes them.

A model's authors often publish the sampling settings it was tuned for (Qwen3: temperature 0.6, top_p 0.95,
top_k 20). vLLM uses them as the defaults of every request that leaves those fields unset; so does this
engine. Only the fields below are read (vLLM's `get_diff_sampling_param`); `max_new_tokens` becomes the default
`max_tokens`. Everything else in the file (eos/bos/pad ids, do_sample) is not a sampling default: the EOS ids
are read by engine/config.py.
"""
import json
import logging
import math
import os

logger = logging.getLogger("engine")

# generation_config.json key -> SamplingParams field.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_sampling_defaults(generation_config: str, model_dir: str, overrides: dict | None = None) -> dict:
    """The SamplingParams overrides named by `generation_config`: "auto" reads `model_dir`'s
    generation_config.json, "vllm" uses none (vLLM's own defaults), any other value is a directory holding a
    generation_config.json. A missing file means no overrides; a malformed one is a ValueError naming
    generation_config. `overrides` (vLLM's --override-generation-config: generation_config.json's keys and values)
    go over the file's, a key that is not a sampling default a ValueError. Values are type-checked here; their
    ranges are checked by SamplingParams."""
    if not isinstance(generation_config, str) or not generation_config:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {generation_config!r}")
    overrides = check_generation_overrides(overrides)
    defaults = {} if generation_config == "vllm" else _file_defaults(generation_config, model_dir)
    return defaults | overrides


def check_generation_overrides(overrides: dict | None) -> dict:
    """override_generation_config's SamplingParams fields ({} for None): a ValueError for a value that is not a
    dict, a key that is not a sampling default, or a value of the wrong type."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"override_generation_config must be a dict, got {overrides!r}")
    unknown = sorted(set(overrides) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown} are not sampling defaults; the keys are "
                         f"{sorted(_SAMPLING_FIELDS)}")
    return _sampling_fields(overrides, "override_generation_config")


def _file_defaults(generation_config: str, model_dir: str) -> dict:
    config_dir = model_dir if generation_config == "auto" else generation_config
    if generation_config != "auto" and not os.path.isdir(config_dir):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {generation_config!r} "
                         f"(not a directory)")
    path = os.path.join(config_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return _sampling_fields(raw, f"generation_config: {path}")


def _sampling_fields(raw: dict, where: str) -> dict:
    """The SamplingParams fields of generation_config.json's keys in `raw`, type-checked (ValueError naming
    `where`)."""
    defaults = {}
    for key, field_name in _SAMPLING_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        integer = field_name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)) \
                or not math.isfinite(value):
            raise ValueError(f"{where}: {key}={value!r} is not a valid {'integer' if integer else 'number'}")
        defaults[field_name] = int(value) if integer else float(value)
    return defaults
