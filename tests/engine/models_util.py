"""Random-weight Hugging Face model directories for engine tests, built at test time.

``build_tiny_model_dir(arch, out_dir)`` writes a small float32 model of one supported architecture
(``TINY_ARCHITECTURES``) with ``save_pretrained`` (safetensors), a small byte-level BPE tokenizer
with a ChatML chat template, and a generation_config. Each architecture exercises its own feature:

- ``llama``:  Llama-3 rope scaling (original context 64, so all three frequency regimes occur), untied lm_head.
- ``mistral``: sliding window of 12 tokens in every layer (prompts in tests are longer than that).
- ``qwen2``:  bias on q/k/v, tied embeddings.
- ``qwen3``:  q/k RMSNorm per head, tied embeddings.
- ``opt``:    learned positions (offset 2), pre-LN LayerNorms with biases, ReLU MLP, biases on every linear,
  tied embeddings, no rotary; 2 heads, no GQA.
- ``gemma2``: sliding window of 8 tokens in layer 0 (full attention in layer 1), attention scale
  ``query_pre_attn_scalar ** -0.5`` with a scalar unlike head_dim, Gemma 2's softcaps (50 on the scores, 30
  on the logits), which bend here: the scores reach ~100-200 and the top logits ~40-50 (turning either cap
  off moves log-probabilities by 17 and 40 nats), (1 + w) norms, GeGLU, scaled embeddings.
- ``phi3``:   fused qkv_proj / gate_up_proj checkpoints, half the head dims rotating (partial rotary),
  LongRoPE (original context 256 of 1024: the attention factor applies; engines of max_model_len <= 256, as
  in the shared tests, rotate by the short factors, longer ones by the long factors: test_models_phi3.py),
  a sliding window of 40 in every layer.

The mixture-of-experts architectures (``TINY_MOE_ARCHITECTURES``, tests/engine/test_models_moe.py; kept out of
``TINY_ARCHITECTURES`` so that the suites parametrized over that list do not grow by four models each):

- ``mixtral``:   8 experts, top-2 (renormalized, float32 weights), intermediate 96 per expert, ``block_sparse_moe``
  with w1/w2/w3 names, GQA 4 on 2 heads.
- ``qwen2_moe``: 8 experts, top-4 (not renormalized), 48 per expert, a shared expert of 96 behind its sigmoid
  gate, q/k/v biases, tied embeddings.
- ``qwen3_moe``: 16 experts, top-4 (renormalized), 48 per expert, layer 1 a dense MLP of 192 (``mlp_only_layers``),
  per-head q/k norms; 6 query heads on 3 KV heads of 32 (so that 2 and 3 ranks both split it).
- ``olmoe``:     8 experts, top-2, 64 per expert, q/k norms over all heads, ``clip_qkv`` 3 (which bites: q/k
  reach ~5 and v ~12 here), 4 heads, no GQA.

All but OPT and Phi-3 use GQA with 4 query heads on 2 KV heads (Phi-3: 2 on 1, OPT: none); all use head_dim 64 (a pagedkernels head size) and a
512-token vocabulary. The weights are drawn with a larger spread than transformers' default init so that the
next-token distributions are peaked: greedy ties (which would make token-for-token parity depend on
rounding) are then vanishingly rare. The special tokens' output rows are scaled down, so greedy
generation rarely ends early on EOS (tests that need EOS pass stop_token_ids or use SmolLM2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gemma2", "phi3")
TINY_MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
OLMOE_CLIP_QKV = 3.0
TINY_VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN_IDS = [2, 0]  # generation_config lists both; config.json names only 0
MISTRAL_SLIDING_WINDOW = 12
GEMMA2_SLIDING_WINDOW = 8
GEMMA2_QUERY_PRE_ATTN_SCALAR = 40
GEMMA2_ATTN_SOFTCAP = 50.0
GEMMA2_FINAL_SOFTCAP = 30.0
PHI3_ORIGINAL_MAX_POSITIONS = 256
PHI3_SLIDING_WINDOW = 40
PHI3_PARTIAL_ROTARY_FACTOR = 0.5

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged attention kernel reads keys and values from
fixed-size blocks of a cache. Continuous batching schedules new requests while others decode.
Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.
def main():\n    print("hello, world")\n    return 0\nfor i in range(10): total += i * i
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159. Questions? Answers! Lists: apples, pears, plums.
User: What is the capital of France? Assistant: The capital of France is Paris.
Die Katze schläft auf dem Sofa. Le café est très chaud. 東京は日本の首都です。 Emoji: 🙂🚀.
"""


def tiny_config(arch: str, **overrides):
    """A small transformers config of architecture ``arch`` (see module docstring)."""
    from transformers import (Gemma2Config, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig, OPTConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    if arch not in TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES:
        raise ValueError(f"arch must be one of {TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES}, got {arch!r}")
    common = dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=1, eos_token_id=0, pad_token_id=2,
        dtype="float32",
    )
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral":
        config = MistralConfig(**common, tie_word_embeddings=False, sliding_window=MISTRAL_SLIDING_WINDOW,
                               rope_theta=1e6)
    elif arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    elif arch == "qwen3":
        config = Qwen3Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    elif arch == "opt":
        config = OPTConfig(vocab_size=TINY_VOCAB_SIZE, hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=1024, word_embed_proj_dim=128,
                           do_layer_norm_before=True, activation_function="relu", enable_bias=True,
                           init_std=0.25, bos_token_id=1, eos_token_id=0, pad_token_id=2, dtype="float32",
                           tie_word_embeddings=True)
    elif arch == "mixtral":
        config = MixtralConfig(**{**common, "intermediate_size": 96}, tie_word_embeddings=False, rope_theta=1e6,
                               num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(**common, tie_word_embeddings=True, rope_theta=1e6, num_experts=8,
                                num_experts_per_tok=4, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                norm_topk_prob=False)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**{**common, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 32,
                                   "intermediate_size": 192}, tie_word_embeddings=True, rope_theta=1e6,
                                num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, norm_topk_prob=True,
                                mlp_only_layers=[1])
    elif arch == "olmoe":
        olmoe = {key: value for key, value in common.items() if key != "head_dim"} | {"num_key_value_heads": 4}
        config = OlmoeConfig(**{**olmoe, "intermediate_size": 64}, tie_word_embeddings=False, rope_theta=1e4,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=OLMOE_CLIP_QKV)
    elif arch == "gemma2":
        config = Gemma2Config(**common, tie_word_embeddings=True, rope_theta=10000.0,
                              sliding_window=GEMMA2_SLIDING_WINDOW, query_pre_attn_scalar=GEMMA2_QUERY_PRE_ATTN_SCALAR,
                              attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP, final_logit_softcapping=GEMMA2_FINAL_SOFTCAP,
                              hidden_activation="gelu_pytorch_tanh")
    else:
        rotary_dim = int(64 * PHI3_PARTIAL_ROTARY_FACTOR)
        generator = torch.Generator().manual_seed(1234)
        short_factor = (1.0 + torch.rand(rotary_dim // 2, generator=generator)).tolist()
        long_factor = (1.0 + 7.0 * torch.rand(rotary_dim // 2, generator=generator)).tolist()
        # Phi-3 has no head_dim key: it is hidden_size / num_attention_heads = 128 / 2 = 64 (GQA 2 on 1).
        phi3 = ({key: value for key, value in common.items() if key != "head_dim"}
                | {"num_attention_heads": 2, "num_key_value_heads": 1})
        config = Phi3Config(**phi3, tie_word_embeddings=False, sliding_window=PHI3_SLIDING_WINDOW,
                            original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITIONS,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "partial_rotary_factor": PHI3_PARTIAL_ROTARY_FACTOR,
                                             "short_factor": short_factor, "long_factor": long_factor})
    for key, value in overrides.items():
        setattr(config, key, value)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def make_tokenizer():
    """A byte-level BPE tokenizer with ``TINY_VOCAB_SIZE`` tokens (3 special ones first), trained on a
    fixed built-in corpus: any text encodes, and multi-byte characters split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model_dir(arch: str, out_dir: str, *, seed: int = 0, max_shard_size: str | None = None,
                         **config_overrides) -> str:
    """Write a random-weight float32 model of ``arch`` with tokenizer and generation_config into
    ``out_dir`` and return it. ``max_shard_size`` (e.g. "100KB") saves a sharded checkpoint."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norm weights away from 1 and biases away from 0, so loading them wrongly shows.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
        # Special tokens (EOS included) get small output rows: greedy runs then go on to max_tokens
        # instead of stopping after a few tokens, which keeps parity tests long enough to mean something.
        model.get_output_embeddings().weight[: len(SPECIAL_TOKENS)] *= 0.1
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    tokenizer = make_tokenizer()
    if len(tokenizer) != config.vocab_size:
        raise AssertionError(f"tokenizer has {len(tokenizer)} tokens, model vocab is {config.vocab_size}")
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """The transformers reference model for ``model_dir`` (eval mode, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.eval()


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """float32 log-softmax of transformers' logits at every position of ``token_ids``: [len, vocab]."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def random_token_ids(num_tokens: int, *, vocab_size: int = TINY_VOCAB_SIZE, seed: int = 0) -> list[int]:
    """Token ids drawn uniformly from the non-special part of the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL_TOKENS), vocab_size, (num_tokens,), generator=generator).tolist()


def model_dir_files(model_dir: str) -> list[str]:
    return sorted(os.listdir(model_dir))


def engine_config(model_dir: str, **kwargs):
    """The EngineConfig of `model_dir` with `kwargs` as engine options (EngineArgs' names), for tests that build
    a ModelRunner or an executor directly."""
    from engine.engine_args import EngineArgs

    return EngineArgs(model=model_dir, **kwargs).create_engine_config()


def make_engine(model_dir: str, **kwargs):
    """An LLMEngine of `model_dir` with `kwargs` as engine options (EngineArgs' names)."""
    from engine.core.llm_engine import LLMEngine
    from engine.engine_args import EngineArgs

    return LLMEngine.from_engine_args(EngineArgs(model=model_dir, **kwargs))


@dataclass(eq=False)
class ScheduledSeq:
    """The three fields of a scheduled entry (the core side's Sequence) that the model runner reads."""
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
