"""One definition of the engine's options: `EngineArgs`, shared by `LLM`, `python -m engine generate/chat` and
`python -m engine serve` (vLLM's EngineArgs, with its flag names).

    args = EngineArgs.from_cli_args(parser.parse_args())   # after EngineArgs.add_cli_args(parser)
    engine = args.create_engine()                          # an LLMEngine

The fields are exactly LLMEngine's (and LLM's) keyword arguments with their defaults (tests/engine/test_cli.py
checks that they stay so)."""
import argparse
import dataclasses
from dataclasses import dataclass

import torch


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
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    swap_space: float = 4
    preemption_mode: str = "recompute"
    generation_config: str = "auto"
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    skip_tokenizer_init: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> argparse.ArgumentParser:
        """Add the engine options under vLLM's flag names. positional_model: also accept the model as an
        optional positional argument (`serve MODEL`), which wins over --model when both are given."""
        group = parser.add_argument_group("engine")
        if positional_model:
            parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                                help="model directory or hub id (same as --model)")
        group.add_argument("--model", default=None, help="model directory or hub id (default: SmolLM2-135M-Instruct)")
        group.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
        group.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
        group.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
        group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
        group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
        group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
        group.add_argument("--num-kv-blocks", type=int, default=None,
                           help="KV-cache size in blocks (overrides the memory-derived size)")
        group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                           help="share of GPU memory the engine may use (CUDA only)")
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
        group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                           help="processes (one GPU each, or a share of the CPU cores) the model is sharded over")
        group.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                           help="auto: the model's safetensors; dummy: random weights (the directory needs only its "
                                "config.json)")
        group.add_argument("--skip-tokenizer-init", action="store_true",
                           help="no tokenizer: prompts are token ids, outputs carry token ids and empty text")
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
        """LLMEngine's keyword arguments: every field but the model."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}

    def create_engine(self):
        """The LLMEngine these options describe."""
        from engine.core.llm_engine import LLMEngine
        return LLMEngine(self.resolved_model(), **self.engine_kwargs())
