"""Gemma 2: the Llama attention and gated MLP with Gemma's knobs.

- attention scale ``query_pre_attn_scalar ** -0.5`` and tanh soft-capping of the scores
  (``attn_logit_softcapping``), and of the final logits (``final_logit_softcapping``);
- a sliding window in every other layer (transformers' ``layer_types``; by default layers 0, 2, 4, ...);
- ``(1 + w)`` RMSNorms, four per layer: before and after attention, before and after the MLP (the "post"
  norms apply to the block's output before it joins the residual stream);
- GeGLU MLP (``gelu_pytorch_tanh``), token embeddings scaled by ``sqrt(hidden_size)``, tied LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig, need, read_layer_types, read_rope
from engine.layers.activation import gated_activation
from engine.layers.attention import AttentionMetadata
from engine.layers.embed_head import LMHead, VocabEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

# Gemma's RMSNorm scales by (1 + weight); the checkpoint stores weight.
NORM_OFFSET = 1.0


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, o_bias=config.attention_bias, qk_norm=False,
                                        prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, prefix=f"{prefix}.mlp")
        norm = lambda: RMSNorm(config.hidden_size, config.norm_eps, offset=NORM_OFFSET)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # As in the Llama layer, the residual stream is carried unnormalized and each pre-norm adds the
        # previous block's (post-normed) output into it first.
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, meta))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2Model(LlamaModel):
    """Llama's forward over Gemma 2's layers, scaled embeddings and (1+w) final norm."""

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)   # not Llama's layers
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, scale=config.hidden_size ** 0.5)
        self.rotary_emb = rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta,
                                                       config.rope_scaling)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i, rotary_emb) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, offset=NORM_OFFSET)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's checkpoint mapping, forward and logits; its own layers, config mapping and softcapped head."""
    tie_word_embeddings_default = True
    one_token_uncompiled = False   # GeGLU and softcaps: ops to fuse (LlamaForCausalLM)

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        """ModelConfig fields from a Gemma 2 config.json; transformers' Gemma2Config defaults where a key is
        absent (softcaps 50 / 30, query_pre_attn_scalar 256, window 4096 in even layers)."""
        num_layers = common.num_hidden_layers
        # Older configs name the MLP activation hidden_activation, some both; hidden_activation wins, as in
        # transformers' Gemma2MLP.
        hidden_act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
        gated_activation(hidden_act)  # ValueError naming it when unsupported
        rope_theta, rope_scaling = read_rope(text, ())
        window = text.get("sliding_window", 4096)
        layer_types = read_layer_types(text, num_layers) or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        layer_windows = tuple(int(window) if window and t == "sliding_attention" else None for t in layer_types)
        return dict(
            intermediate_size=int(need(text, "intermediate_size", common.model_dir)),
            norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_act=hidden_act,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=int(window) if window else None,
            layer_sliding_windows=layer_windows,
            attention_bias=bool(text.get("attention_bias", False)),
            attention_scale=float(text.get("query_pre_attn_scalar", 256)) ** -0.5,
            attn_logit_softcap=_optional_float(text.get("attn_logit_softcapping", 50.0)),
            final_logit_softcap=_optional_float(text.get("final_logit_softcapping", 30.0)),
        )

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)   # not Llama's layers
        self.model = Gemma2Model(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, softcap=config.final_logit_softcap)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
