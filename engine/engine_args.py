"""One definition of the engine's options: `EngineArgs`, shared by `LLM`, `python -m engine generate/chat` and
`python -m engine serve` (vLLM's EngineArgs, with its flag names).

    args = EngineArgs.from_cli_args(parser.parse_args())   # after EngineArgs.add_cli_args(parser)
    config = args.create_engine_config()                   # an EngineConfig, every option validated once
    engine = LLMEngine(config)                             # or args.create_engine()

The fields are exactly LLM's keyword arguments with their defaults (tests/engine/test_cli.py checks that they
stay so). `create_engine_config` is the one place the options are checked and turned into the configs the
engine, its executor and its workers take (engine/config.py)."""
import argparse
import dataclasses
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:   # engine.config imports the model code: loaded when a config is built, not for --help
    from engine.config import EngineConfig, ModelConfig, SpeculativeConfig


@dataclass(slots=True)
class EngineArgs:
    """See `engine.LLM` for what each option means."""
    model: str | None = None          # None: the default model (SmolLM2-135M-Instruct, converted on first use)
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_seqs_per_request: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    swap_space: float = 4
    preemption_mode: str = "recompute"
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    hf_overrides: dict | None = None
    max_logprobs: int = 20
    # A hub model's version and where it downloads to (vLLM's names; a local directory ignores them).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    tensor_parallel_size: int = 1
    # vLLM's other parallel sizes: only 1 for now (a clear error, not a TypeError, for a vLLM script asking more).
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    speculative_config: dict | None = None
    quantization: str | None = None
    async_scheduling: bool | None = None   # None: on CUDA unless speculative decoding; off on CPU
    # Multi-LoRA (vLLM's names): PEFT adapters chosen per request (engine/lora).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM options that mean nothing here, accepted so that vLLM scripts run (a warning says what they do here).
    trust_remote_code: bool = False
    disable_log_stats: bool = False
    enable_chunked_prefill: bool | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> argparse.ArgumentParser:
        """Add the engine options under vLLM's flag names. positional_model: also accept the model as an
        optional positional argument (`serve MODEL`), which wins over --model when both are given."""
        group = parser.add_argument_group("engine")
        if positional_model:
            parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                                help="model directory or hub id (same as --model)")
        group.add_argument("--model", default=None, help="model directory, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
        group.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
        group.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
        group.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
        group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
        group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
        group.add_argument("--max-num-seqs-per-request", type=int, default=None,
                           help="most sequences of one request (n > 1) in a step while other requests run or "
                                "wait (default: no limit; serve: 16 on CPU, 32 on GPUs)")
        group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
        group.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=None,
                           help="KV-cache size in blocks (overrides the memory-derived size)")
        group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                           help="share of GPU memory the engine may use (CUDA only)")
        group.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                           help="KV-cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3 with "
                                "per-layer k/v scales from the checkpoint, else 1.0: twice the blocks of 16-bit)")
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                           help="reuse the KV of full blocks shared with earlier prompts")
        group.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
        group.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
        group.add_argument("--swap-space", type=float, default=4,
                           help="GiB of CPU memory for swapped-out KV blocks (with --preemption-mode swap)")
        group.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
        group.add_argument("--generation-config", default="auto",
                           help="sampling defaults: 'auto' (the model's generation_config.json), 'vllm' (none), "
                                "or a directory holding a generation_config.json")
        group.add_argument("--revision", default=None,
                           help="a hub model's branch, tag or commit (default: its default branch)")
        group.add_argument("--tokenizer-revision", default=None, help="the same for a hub --tokenizer")
        group.add_argument("--download-dir", default=None,
                           help="where hub models download to (default: the Hugging Face cache)")
        group.add_argument("--max-logprobs", type=int, default=20,
                           help="the most logprobs (and prompt_logprobs) a request may ask for (default 20, as "
                                "vLLM; -1: the whole vocabulary)")
        group.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                           help="config.json keys set over the model's, e.g. '{\"max_position_embeddings\": 8192}'")
        group.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                           help='sampling defaults over generation_config\'s, in its keys, e.g. '
                                '\'{"temperature": 0.5, "max_new_tokens": 256}\'')
        group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                           help="processes (one GPU each, or a share of the CPU cores) the model is sharded over")
        group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                           help="pipeline stages (vLLM's; only 1 for now)")
        group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                           help="engine replicas (vLLM's; only 1 for now)")
        group.add_argument("--enable-expert-parallel", action="store_true",
                           help="MoE models: split the experts across the tensor-parallel ranks whole (each rank "
                                "holds its share of the experts) instead of splitting each expert's intermediate "
                                "size")
        group.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                           help="auto: the model's safetensors; dummy: random weights (the directory needs only its "
                                "config.json)")
        group.add_argument("--skip-tokenizer-init", action="store_true",
                           help="no tokenizer: prompts are token ids, outputs carry token ids and empty text")
        group.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                           help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                                '"prompt_lookup_max": 4}\' or \'{"model": "DRAFT_DIR", "num_speculative_tokens": 4}\'')
        group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                           help="schedule the next step while the device runs this one, reading sampled ids one "
                                "step late (default: on with CUDA, except with speculative decoding; off on CPU)")
        group.add_argument("--enable-lora", action="store_true",
                           help="serve PEFT LoRA adapters on the base model, chosen per request")
        group.add_argument("--max-loras", type=int, default=1,
                           help="most distinct adapters in one step (their device slots; default 1)")
        group.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served (default 16)")
        group.add_argument("--max-cpu-loras", type=int, default=None,
                           help="adapters kept loaded in host memory (default: --max-loras)")
        group.add_argument("--trust-remote-code", action="store_true",
                           help="accepted for vLLM compatibility: no model code is downloaded or run, the "
                                "architectures are the engine's own")
        group.add_argument("--disable-log-stats", action="store_true",
                           help="accepted for vLLM compatibility: the engine logs no periodic stats")
        group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                           help="accepted for vLLM compatibility: chunked prefill is always on")
        group.add_argument("--quantization", "-q", default=None,
                           help="quantization method: the checkpoint's (gptq, awq, fp8, compressed-tensors; "
                                "default: config.json's quantization_config), or fp8 to quantize a float "
                                "checkpoint's linear weights on load")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_positional", None) is not None:
            values["model"] = args.model_positional
        return cls(**values)

    def resolved_model(self) -> str:
        if self.model is not None:
            return self.model
        from engine.default_model import default_model_path
        return default_model_path()

    def engine_kwargs(self) -> dict:
        """LLM's keyword arguments: every field but the model."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}

    def create_engine_config(self) -> "EngineConfig":
        """Validate every option once (ValueError naming the option) and build the EngineConfig: the model's
        config read from its directory, the device resolved, the step budget defaulted by the device."""
        from engine.config import (CacheConfig, DeviceConfig, EngineConfig, LoadConfig, ModelConfig, ParallelConfig,
                                   SchedulerConfig, check_kv_cache_dtype, check_kv_cache_scheme)
        from engine.platform import DevicePolicy, resolve_device

        _check_int("block_size", self.block_size, 8, 128)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_seqs_per_request is not None:
            _check_int("max_num_seqs_per_request", self.max_num_seqs_per_request, 1)
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        _check_number("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check_number("swap_space", self.swap_space)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        _check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        check_kv_cache_dtype(self.kv_cache_dtype)
        _check_int("seed", self.seed)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("max_logprobs", self.max_logprobs, -1)
        for name, what in (("pipeline_parallel_size", "pipeline parallelism"),
                           ("data_parallel_size", "data parallelism (several engine replicas)")):
            _check_int(name, getattr(self, name), 1)
            if getattr(self, name) != 1:
                raise ValueError(f"{name}={getattr(self, name)}: {what} is not supported yet; shard the model "
                                 f"with tensor_parallel_size (or run one server per replica)")
        _check_choice("load_format", self.load_format, ("auto", "dummy"))
        _note_vllm_compatibility_options(self)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None (the device's default), got "
                             f"{self.async_scheduling!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "skip_tokenizer_init", "enable_lora",
                     "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.generation_config is None or not isinstance(self.generation_config, str):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        from engine.core.generation_config import check_generation_overrides
        check_generation_overrides(self.override_generation_config)   # before the model loads

        from engine.config import resolve_model_path
        from engine.models import load_model_config

        device = resolve_device(self.device)
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a method name or None, got {self.quantization!r}")
        for name in ("revision", "tokenizer_revision", "download_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str or None, got {getattr(self, name)!r}")
        model_path = resolve_model_path(self.resolved_model(), revision=self.revision, download_dir=self.download_dir)
        model_config = load_model_config(model_path, dtype=self.dtype, hf_overrides=self.hf_overrides,
                                         max_model_len=self.max_model_len, device=device,
                                         quantization=self.quantization)
        if self.kv_cache_dtype != "auto":
            check_kv_cache_scheme(model_config.hf_config, model_config.model_dir)
        if self.enable_expert_parallel:   # how the model's experts shard: the layers read it from the model config
            model_config = dataclasses.replace(model_config, enable_expert_parallel=True)
        policy = DevicePolicy.for_device(device)
        speculative_config = _speculative_config(self.speculative_config, model_config, device, self.dtype)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or policy.default_max_num_batched_tokens,
            preemption_mode=self.preemption_mode, max_num_seqs_per_request=self.max_num_seqs_per_request,
            async_scheduling=_async_scheduling(self.async_scheduling, policy, speculative_config))
        lora_config = _lora_config(self)
        cache_config = CacheConfig(block_size=self.block_size, gpu_memory_utilization=float(self.gpu_memory_utilization),
                                   swap_space=float(self.swap_space), enable_prefix_caching=self.enable_prefix_caching,
                                   num_gpu_blocks_override=self.num_kv_blocks, kv_cache_dtype=self.kv_cache_dtype)
        return EngineConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                            parallel_config=ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel),
                            device_config=DeviceConfig(device), load_config=LoadConfig(self.load_format),
                            speculative_config=speculative_config, quant_config=model_config.quant_config,
                            seed=self.seed, enforce_eager=self.enforce_eager,
                            tokenizer=None if self.tokenizer is None else resolve_model_path(
                                self.tokenizer, revision=self.tokenizer_revision, download_dir=self.download_dir),
                            skip_tokenizer_init=self.skip_tokenizer_init, generation_config=self.generation_config,
                            override_generation_config=self.override_generation_config,
                            lora_config=lora_config, max_logprobs=self.max_logprobs)

    def create_engine(self):
        """The LLMEngine these options describe."""
        from engine.core.llm_engine import LLMEngine
        return LLMEngine(self.create_engine_config())


def _note_vllm_compatibility_options(args: "EngineArgs") -> None:
    """vLLM options that have no effect here: checked, and a line in the log when they ask for something."""
    import logging

    logger = logging.getLogger("engine")
    for name in ("trust_remote_code", "disable_log_stats"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(args, name)!r}")
    if args.enable_chunked_prefill is not None and not isinstance(args.enable_chunked_prefill, bool):
        raise ValueError(f"enable_chunked_prefill must be a bool or None, got {args.enable_chunked_prefill!r}")
    if args.trust_remote_code:
        logger.warning("trust_remote_code=True: no model code is downloaded or run here; the model must be one of "
                       "the engine's own architectures (README \"Supported models\")")
    if args.enable_chunked_prefill is False:
        logger.warning("enable_chunked_prefill=False: chunked prefill is always on in this engine (a prompt longer "
                       "than max_num_batched_tokens is computed over several steps)")


def _lora_config(args: "EngineArgs"):
    """The LoRAConfig of enable_lora=True (limits checked: ValueError naming the option), else None. The limits
    mean nothing without enable_lora, but are checked all the same (a typo should not wait for the day it is on)."""
    from engine.lora import LoRAConfig

    for name in ("max_loras", "max_lora_rank"):
        _check_int(name, getattr(args, name), 1)
    if args.max_cpu_loras is not None:
        _check_int("max_cpu_loras", args.max_cpu_loras, 1)
    config = LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)
    return config if args.enable_lora else None


def _async_scheduling(requested: bool | None, policy, speculative_config) -> bool:
    """Async scheduling as asked, else the device's default. Speculative decoding runs without it: a step's drafts
    are proposed from the tokens the step before accepted, which the scheduler must know to size the step."""
    if requested is None:
        return policy.async_scheduling_by_default and speculative_config is None
    if requested and speculative_config is not None:
        raise ValueError("async_scheduling=True does not work with speculative_config (each step's drafts depend on "
                         "how many the step before accepted); leave async_scheduling unset or False")
    return requested


def _check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _json_object(text: str) -> dict:
    """argparse type of --speculative-config: a JSON object."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


_SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


def _speculative_config(spec: dict | None, model_config: "ModelConfig", device,
                        dtype) -> "SpeculativeConfig | None":
    """vLLM's speculative_config dict, checked: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": ..., "prompt_lookup_min": ...} or {"model": DRAFT, "num_speculative_tokens": k}."""
    from engine.config import ModelConfig, SpeculativeConfig

    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - _SPECULATIVE_KEYS)
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown} (known: {sorted(_SPECULATIVE_KEYS)})")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method == "ngram" and spec.get("model") is not None:
        raise ValueError("speculative_config: method 'ngram' takes no model")
    _check_choice("speculative_config method", method, ("ngram", "draft_model"))
    k = spec.get("num_speculative_tokens")
    _check_int("speculative_config num_speculative_tokens", k, 1, 32)
    if method == "ngram":
        lookup_max = spec.get("prompt_lookup_max", spec.get("prompt_lookup_min", 4))
        lookup_min = spec.get("prompt_lookup_min", min(lookup_max, 1) if isinstance(lookup_max, int) else 1)
        _check_int("speculative_config prompt_lookup_max", lookup_max, 1)
        _check_int("speculative_config prompt_lookup_min", lookup_min, 1, lookup_max)
        return SpeculativeConfig("ngram", k, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min)
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if key in spec:
            raise ValueError(f"speculative_config: {key} is for method 'ngram', not a draft model")
    from engine.config import resolve_model_path
    from engine.models import load_model_config

    draft_dir = resolve_model_path(spec["model"]) if isinstance(spec.get("model"), str) else None
    if draft_dir is None:
        raise ValueError(f"speculative_config: model must be a draft model's directory, got {spec.get('model')!r}")
    draft = load_model_config(draft_dir, dtype=model_config.dtype, device=device,
                              max_model_len=min(model_config.max_model_len, _max_positions(draft_dir)))
    if draft.vocab_size != model_config.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size}) differs from the "
                         f"target's ({model_config.vocab_size}); a draft must share the target's tokenizer")
    if draft.max_model_len < model_config.max_model_len:
        raise ValueError(f"speculative_config: the draft model holds {draft.max_model_len} positions, fewer than "
                         f"max_model_len={model_config.max_model_len}; lower max_model_len")
    return SpeculativeConfig("draft_model", k, model=draft_dir, draft_model_config=draft)


def _max_positions(model_dir: str) -> int:
    import json
    import os

    from engine.gguf_file import is_gguf_path, read_gguf_config

    if is_gguf_path(model_dir):   # a GGUF draft model: its metadata's context length
        hf, _ = read_gguf_config(model_dir)
        return int(hf.get("max_position_embeddings") or 2048)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    text = hf.get("text_config", hf)
    return int(text.get("max_position_embeddings") or 2048)
