"""Model configuration read from a Hugging Face model directory (config.json + generation_config.json).

Reads both key styles transformers has written: version 4 (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and version 5 (``rope_parameters`` holding ``rope_theta`` and the scaling keys,
``dtype``). Nothing from transformers is imported: the engine runs on its own modules.

This module holds the configs and the helpers that read config.json's shared keys. Reading a model directory into
a ModelConfig needs each architecture's own mapping (``config_from_hf`` of its model class), so it lives above
both, with the model registry: ``engine.models.load_model_config``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from engine.gguf_file import is_gguf_path
from engine.lora.config import LoRAConfig
from engine.platform import DevicePolicy


logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    """What the engine needs to know about a model.

    ``from_pretrained`` reads the fields every architecture has the same way (sizes, vocabulary, dtype,
    special tokens); the architecture's own model class maps the rest of its config.json (which keys mean
    what, their defaults, what it rejects) through its ``config_from_hf`` classmethod, into the fields
    below the line. Fields an architecture has no use for keep their defaults.
    """
    model_dir: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    # -- mapped by the model class (config_from_hf) --------------------------------------------------------
    intermediate_size: int = 0
    norm_eps: float = 1e-6  # RMSNorm's eps, or LayerNorm's (OPT)
    hidden_act: str = "silu"  # transformers' activation name (gated for the Llama family and Gemma 2)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or {"rope_type": "linear" | "llama3" | "longrope", ...parameters}
    partial_rotary_factor: float = 1.0  # share of each head's dims that rotate
    sliding_window: int | None = None
    # Per layer: the sliding window of that layer (None = full attention). Mistral and Phi-3 slide in every
    # layer; Qwen2/Qwen3 only in the layers their config marks "sliding_attention"; Gemma 2 in every other.
    layer_sliding_windows: tuple[int | None, ...] = ()
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama/Qwen3 when the config says so)
    mlp_bias: bool = False
    attention_scale: float | None = None  # scale of q @ k^T; None = head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> softcap * tanh(score / softcap)
    final_logit_softcap: float | None = None  # logits -> softcap * tanh(logit / softcap)
    layer_norm_before: bool = True  # OPT: pre-LN (True) or post-LN blocks
    word_embed_proj_dim: int | None = None  # OPT: embedding width, projected in/out when not hidden_size
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: engine/models/moe.py).
    num_experts: int = 0  # routed experts of a MoE layer (0: a dense model)
    num_experts_per_tok: int = 0  # top_k
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the expert every token also takes (0: none)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv]
    # Set by the engine's options, not the checkpoint: the experts split across the ranks whole instead of each
    # expert's intermediate size (vLLM's --enable-expert-parallel).
    enable_expert_parallel: bool = False
    hf_config: dict = field(default_factory=dict, repr=False)
    max_model_len_set_by_user: bool = False   # given, not the model's max_position_embeddings
    # The linear layers' quantization (engine/layers/quantization/): config.json's quantization_config or
    # the one asked for (quantization=...); None: unquantized.
    quant_config: object | None = None


def need(text: dict, key: str, model_dir: str = "the model directory"):
    """``text[key]``, or a ValueError naming the key when config.json lacks it."""
    if text.get(key) is None:
        raise ValueError(f"config.json in {model_dir} has no {key!r}")
    return text[key]


def read_rope(text: dict, supported: tuple[str, ...]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either key style, for an architecture supporting the rope types
    ``supported`` ("default" always). transformers 5 puts rope_theta and the scaling keys together in
    rope_parameters; transformers 4 has rope_theta plus rope_scaling (whose type key is "rope_type", or
    "type" in older files). rope_scaling is None for plain rope, else ``{"rope_type": ..., **parameters}``
    with the parameters its type needs checked present. ``partial_rotary_factor`` (which transformers 5 also
    keeps in rope_parameters) is left out: see :func:`read_partial_rotary_factor`."""
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    theta = params.pop("rope_theta", text.get("rope_theta", 10000.0))
    scaling = {**scaling, **params}
    scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ("default", *supported):
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: "
                         f"{', '.join(('default', *supported))})")
    if rope_type == "default":
        return float(theta), None
    required = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(
                    rope_type, ("factor",))
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"{rope_type} rope scaling needs {missing} in config.json")
    return float(theta), {"rope_type": rope_type, **scaling}


def read_partial_rotary_factor(text: dict) -> float:
    """Share of each head's dims that rotate: ``partial_rotary_factor`` at the top level (transformers 4)
    or in rope_parameters (5); 1.0 when neither has it."""
    factor = (text.get("rope_parameters") or {}).get("partial_rotary_factor", text.get("partial_rotary_factor"))
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


def read_layer_types(text: dict, num_layers: int) -> list[str] | None:
    """transformers 5's per-layer ``layer_types`` ("full_attention" / "sliding_attention"), checked against
    the layer count; None when the config has none."""
    layer_types = text.get("layer_types")
    if layer_types is not None and len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return layer_types


def resolve_dtype(requested: str | torch.dtype, checkpoint: str | None,
                  device: str | torch.device | None, *, quantized: bool = False) -> torch.dtype:
    """The dtype to run in: an explicit request wins; "auto" takes the checkpoint's dtype (float32 when unnamed),
    except where the CPU has no fast arithmetic for it (:meth:`DevicePolicy.auto_dtype`: bf16 checkpoints run in bf16 on
    CPUs with AMX-BF16 or AVX512-BF16, in float32 on others; float16 ones, and ``quantized`` models (GPTQ, AWQ, fp8,
    GGUF), in float32 on every CPU). The choice and its reason are logged."""
    if isinstance(requested, torch.dtype):
        if requested not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {requested}")
        return requested
    if not isinstance(requested, str) or (requested != "auto" and requested.lower() not in _DTYPES):
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {requested!r}")
    if requested != "auto":
        return _DTYPES[requested.lower()]
    dtype = _DTYPES.get(str(checkpoint).replace("torch.", "").lower(), torch.float32)
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    chosen, reason = DevicePolicy.for_device(device_type).auto_dtype(dtype, quantized=quantized)
    logger.info("dtype 'auto' on %s: %s", device_type, reason)
    return chosen


def _read_json(path: str, *, required: bool) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"{path} not found: the model directory needs a config.json")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _ids(value) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)


def _first(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


# -- the engine's configuration: one EngineConfig, built and validated by EngineArgs.create_engine_config() ------


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache."""
    block_size: int                       # tokens per block, 8..128
    gpu_memory_utilization: float         # share of the GPU the engine may use (the KV budget is what is left)
    swap_space: float                     # GiB of CPU memory for swapped-out blocks (preemption_mode "swap")
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None   # a fixed number of blocks instead of the memory-derived one
    kv_cache_dtype: str = "auto"          # "auto" (the model dtype) | "fp8" (float8 e4m3, per-layer k/v scales)


# --kv-cache-dtype values (vLLM's names): "auto" stores K/V in the model's dtype; "fp8" and "fp8_e4m3" in float8 e4m3
# (torch.float8_e4m3fn), written as e4m3(x / scale) and de-quantized in the attention kernels' registers.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(kv_cache_dtype: object) -> str:
    """``kv_cache_dtype`` checked: one of KV_CACHE_DTYPES, else a ValueError saying what is supported."""
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return kv_cache_dtype
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError("kv_cache_dtype='fp8_e5m2' is not supported: the KV kernels store float8 e4m3 only "
                         "(kv_cache_dtype='fp8' or 'fp8_e4m3')")
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {kv_cache_dtype!r}")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache: the model's for "auto", float8 e4m3 for "fp8" / "fp8_e4m3"."""
    return model_dtype if check_kv_cache_dtype(kv_cache_dtype) == "auto" else torch.float8_e4m3fn


def check_kv_cache_scheme(hf_config: dict, model_dir: str) -> None:
    """A checkpoint's ``quantization_config.kv_cache_scheme`` (compressed-tensors / llm-compressor), when an fp8
    cache is asked for: its k/v scales are per-tensor float8 scales computed offline, or the engine cannot use
    them (ValueError naming what the checkpoint has)."""
    text = hf_config.get("text_config", hf_config)
    quant = hf_config.get("quantization_config") or text.get("quantization_config") or {}
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if not scheme:
        return
    problems = []
    if scheme.get("type", "float") != "float" or scheme.get("num_bits", 8) != 8:
        problems.append(f"type={scheme.get('type')!r} num_bits={scheme.get('num_bits')!r} (needs float, 8 bits)")
    if scheme.get("strategy", "tensor") != "tensor":
        problems.append(f"strategy={scheme.get('strategy')!r} (needs 'tensor': one scale per layer)")
    if scheme.get("dynamic", False):
        problems.append("dynamic=True (needs static scales stored in the checkpoint)")
    if scheme.get("symmetric", True) is False:
        problems.append("symmetric=False (needs symmetric scales)")
    if problems:
        raise ValueError(f"{model_dir}/config.json: quantization_config.kv_cache_scheme is not usable for an fp8 KV "
                         f"cache: {'; '.join(problems)}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int                     # sequences in one step
    max_num_batched_tokens: int           # token budget of one step (chunked prefill is always on)
    preemption_mode: str                  # "recompute" | "swap"
    max_num_seqs_per_request: int | None = None   # one request's rows in a step shared with others (None: all)
    # Schedule step N+1 while step N runs (engine/core/engine_core.py); resolved from EngineArgs' None by device.
    async_scheduling: bool = False


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts split across the tensor-parallel ranks whole


@dataclass(slots=True)
class DeviceConfig:
    device: torch.device


@dataclass(slots=True)
class LoadConfig:
    load_format: str = "auto"             # "auto": the checkpoint; "dummy": random weights (engine/worker/loader.py)


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): "ngram" proposes from the sequence's own earlier tokens
    (prompt lookup), "draft_model" from a small model with the target's tokenizer (`model`)."""
    method: str                           # "ngram" | "draft_model"
    num_speculative_tokens: int           # k: drafts per step
    prompt_lookup_max: int | None = None  # ngram: longest n-gram matched
    prompt_lookup_min: int | None = None  # ngram: shortest n-gram matched
    model: str | None = None              # draft_model: its directory
    draft_model_config: ModelConfig | None = None


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine, its executor and its workers are built from."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    speculative_config: SpeculativeConfig | None = None
    quant_config: object | None = None    # the model's QuantizationConfig (model_config.quant_config)
    seed: int = 0
    enforce_eager: bool = False
    tokenizer: str | None = None          # the tokenizer's directory (None: the model's)
    skip_tokenizer_init: bool = False
    generation_config: str = "auto"       # sampling defaults: "auto", "vllm" or a directory
    override_generation_config: dict | None = None   # generation_config.json keys over those defaults
    lora_config: LoRAConfig | None = None  # multi-LoRA (enable_lora): its limits; None: no adapters
    max_logprobs: int = 20                 # the most logprobs / prompt_logprobs a request may ask for (-1: any)

    @property
    def device(self) -> torch.device:
        return self.device_config.device

    def with_device(self, device: torch.device) -> "EngineConfig":
        """This config for a worker on `device` (a tensor-parallel rank's own GPU)."""
        return dataclasses.replace(self, device_config=DeviceConfig(torch.device(device)))


def resolve_model_path(model: str, *, revision: str | None = None, download_dir: str | None = None) -> str:
    """`model` if it is a local directory or GGUF file, else a Hugging Face hub id downloaded with
    huggingface_hub: at `revision` (a branch, tag or commit; None: the default branch), into `download_dir` (None:
    huggingface_hub's cache), as vLLM's --revision and --download-dir."""
    if os.path.isdir(model) or is_gguf_path(model):
        return model
    if isinstance(model, str) and model.endswith(".gguf"):
        raise ValueError(f"GGUF file {model!r} does not exist")
    if isinstance(model, str) and (os.path.isabs(model) or model.startswith(("./", "../", "~")) or model.count("/") > 1):
        # A hub id is "name" or "org/name": this is a path, and there is nothing there.
        raise ValueError(f"model {model!r}: no such directory")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:   # offline, unknown repo, invalid id: all mean "no such model here"
        raise ValueError(f"model {model!r} is not a local directory and could not be fetched from the "
                         f"Hugging Face hub ({type(e).__name__}: {e})") from e
