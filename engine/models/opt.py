"""OPT (facebook/opt-*): learned absolute positions (offset 2), LayerNorm, ReLU MLP, biases everywhere,
no rotary embedding, tied embeddings.

Pre-LN blocks (``do_layer_norm_before``, every size but 350m) carry the residual stream unnormalized
between layers as the Llama family does, each LayerNorm first adding the previous block's output into it.
Post-LN blocks (opt-350m) normalize after each residual add. When the embedding width
(``word_embed_proj_dim``) differs from ``hidden_size`` (opt-350m again), ``project_in`` / ``project_out``
map between the two around the decoder.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig, need
from engine.layers.activation import Activation, check_plain_activation
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.embed_head import LMHead, PositionEmbedding, VocabEmbedding
from engine.layers.layernorm import LayerNorm
from engine.layers.linear import Linear, QKVLinear

# OPT's position table keeps two rows in front of position 0 (a fairseq padding convention).
POSITION_OFFSET = 2
# torch.nn.LayerNorm's default, which OPT's layers use.
LAYER_NORM_EPS = 1e-5


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str = ""):
        super().__init__()
        self.head_dim = config.head_dim
        bias, quant = config.attention_bias, config.quant_config
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_attention_heads, bias=bias, quant_config=quant,
                                  prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads   # this rank's heads
        self.out_proj = Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                               parallel="row", quant_config=quant, prefix=f"{prefix}.out_proj")
        # transformers multiplies q by head_dim ** -0.5 and attends with scale 1; the kernel scales the scores.
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim)

    def forward(self, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str = ""):
        super().__init__()
        self.layer_norm_before = config.layer_norm_before
        quant = config.quant_config
        self.self_attn = OPTAttention(config, prefix=f"{prefix}.self_attn")
        self.self_attn_layer_norm = LayerNorm(config.hidden_size, config.norm_eps)
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, parallel="column",
                          quant_config=quant, prefix=f"{prefix}.fc1")
        self.activation_fn = Activation(config.hidden_act)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, parallel="row",
                          quant_config=quant, prefix=f"{prefix}.fc2")
        self.final_layer_norm = LayerNorm(config.hidden_size, config.norm_eps)

    def mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-LN: (block output, residual stream without it), as the Llama family carries them.
        Post-LN: (normalized layer output, None)."""
        if not self.layer_norm_before:
            hidden_states = self.self_attn_layer_norm(self.self_attn(hidden_states, meta), hidden_states)[0]
            return self.final_layer_norm(self.mlp(hidden_states), hidden_states)[0], None
        if residual is None:
            residual, hidden_states = hidden_states, self.self_attn_layer_norm(hidden_states)
        else:
            hidden_states, residual = self.self_attn_layer_norm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, meta)
        hidden_states, residual = self.final_layer_norm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class OPTDecoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        embed_dim = config.word_embed_proj_dim or config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, embed_dim)
        self.embed_positions = PositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                                 offset=POSITION_OFFSET)
        self.project_in = self.project_out = None
        if embed_dim != config.hidden_size:
            # Quantized too where the format says so (GPTQ/AWQ/fp8 quantize every decoder linear).
            self.project_in = Linear(embed_dim, config.hidden_size, quant_config=config.quant_config,
                                     prefix="model.decoder.project_in")
            self.project_out = Linear(config.hidden_size, embed_dim, quant_config=config.quant_config,
                                      prefix="model.decoder.project_out")
        self.layers = nn.ModuleList(OPTDecoderLayer(config, prefix=f"model.decoder.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        # transformers keeps a final LayerNorm only in pre-LN models (post-LN layers end normalized).
        self.final_layer_norm = LayerNorm(config.hidden_size, config.norm_eps) if config.layer_norm_before else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        hidden_states, residual = hidden_states + self.embed_positions(positions), None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, meta)
        if self.final_layer_norm is not None:
            hidden_states, _ = self.final_layer_norm(hidden_states, residual)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, meta)


class OPTForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    # facebook's own checkpoints name the decoder at the top level ("decoder.layers.0...."); transformers
    # saves it under "model.".
    checkpoint_prefix_mapping = {"decoder.": "model.decoder."}
    tie_word_embeddings_default = True

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        """ModelConfig fields from an OPT config.json; transformers' OPTConfig defaults where a key is absent."""
        activation = text.get("activation_function", "relu")
        if not text.get("layer_norm_elementwise_affine", True):
            raise ValueError("layer_norm_elementwise_affine=False is not supported")
        if text.get("_remove_final_layer_norm", False):
            raise ValueError("_remove_final_layer_norm=True is not supported")
        if common.num_key_value_heads != common.num_attention_heads:
            raise ValueError(f"OPT has no grouped-query attention: num_key_value_heads={common.num_key_value_heads} "
                             f"differs from num_attention_heads={common.num_attention_heads}")
        if common.head_dim * common.num_attention_heads != common.hidden_size:
            raise ValueError(f"head_dim={common.head_dim} times num_attention_heads={common.num_attention_heads} "
                             f"must be hidden_size={common.hidden_size} for OPT")
        enable_bias = bool(text.get("enable_bias", True))
        return dict(
            intermediate_size=int(need(text, "ffn_dim", common.model_dir)),
            norm_eps=LAYER_NORM_EPS,
            hidden_act=check_plain_activation(activation),
            attention_bias=enable_bias,
            mlp_bias=enable_bias,
            layer_norm_before=bool(text.get("do_layer_norm_before", True)),
            word_embed_proj_dim=int(text.get("word_embed_proj_dim") or common.hidden_size),
        )

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model = OPTModel(config)
        self.lm_head = LMHead(config.vocab_size, config.word_embed_proj_dim or config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions int64 ``[num_tokens]`` -> final hidden states ``[num_tokens, embed dim]``."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, embed dim]`` -> float32 ``[num_seqs, vocab_size]``."""
        return self.lm_head(hidden_states)
