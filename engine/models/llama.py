"""Llama family decoder (Llama incl. Llama-3 rope scaling; Mistral = Llama with a sliding window).

Qwen2 and Qwen3 are the same network with q/k/v biases or per-head q/k RMSNorm; their classes
(qwen2.py, qwen3.py) only switch the class attributes below and their config mapping. Phi-3 (phi3.py) is
this network too, with q/k/v and gate/up fused in its checkpoints, partial rotary and LongRoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig, need, read_layer_types, read_rope
from engine.layers import pk_ops
from engine.layers.activation import SiluAndMul, gated_activation
from engine.layers.attention import Attention, AttentionMetadata, Rope
from engine.layers.embed_head import LMHead, VocabEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, MergedLinear, QKVLinear
from engine.layers.quantization.unquantized import UnquantizedLinearMethod
from engine.layers.rotary_embedding import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, *, o_bias: bool,
                 qk_norm: bool, prefix: str = ""):
        super().__init__()
        self.head_dim = config.head_dim
        quant = config.quant_config
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, bias=config.attention_bias, quant_config=quant,
                                  prefix=f"{prefix}.qkv_proj")
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                             parallel="row", quant_config=quant, prefix=f"{prefix}.o_proj")
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = rotary_emb
        window = config.layer_sliding_windows[layer_idx] if config.layer_sliding_windows else config.sliding_window
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=config.attention_scale,
                              sliding_window=window, softcap=config.attn_logit_softcap)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden_states), meta))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, *,
               rope_with_cache: bool = False) -> torch.Tensor:
        """The block between its two projections: ``qkv [num_tokens, q_size + 2 * kv_size]`` -> the attention's
        output ``[num_tokens, q_size]`` (q/k norm and rotary, the KV cache write, paged attention).
        ``rope_with_cache``: the norms and the rotation in the attention layer's cache write (one kernel on CUDA,
        ``pagedkernels.rotary_embedding_and_cache``), as the few-row layers do."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rope_with_cache and (not self.qk_norm or self.q_norm.eps == self.k_norm.eps):
            norms = (dict(q_weight=self.q_norm.weight, k_weight=self.k_norm.weight, eps=self.q_norm.eps)
                     if self.qk_norm else {})
            return self.attn(q, k, v, meta, rope=Rope(positions, self.rotary_emb.cos_sin_cache, **norms))
        if self.qk_norm:
            q, k = self.rotary_emb.forward_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        else:
            self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, meta)


class LlamaMLP(nn.Module):
    """The gated MLP; ``intermediate_size`` (default the config's) and ``reduce_results`` (False: this rank's
    partial sum) for the MoE models' dense and shared experts."""

    def __init__(self, config: ModelConfig, prefix: str = "", *, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        quant = config.quant_config
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [intermediate_size] * 2, bias=config.mlp_bias,
                                         quant_config=quant, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(intermediate_size, config.hidden_size, bias=config.mlp_bias, parallel="row",
                                quant_config=quant, prefix=f"{prefix}.down_proj", reduce_results=reduce_results)
        self.act_fn = gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Attention and MLP, each behind an RMSNorm. ``parts``: the model class whose ``make_attention`` and
    ``make_mlp`` build them (Llama's own by default; the MoE models put their expert blocks in as the MLP)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, *, o_bias: bool,
                 qk_norm: bool, prefix: str = "", parts: type | None = None):
        super().__init__()
        parts = parts or LlamaForCausalLM
        self.self_attn = parts.make_attention(config, layer_idx, rotary_emb, o_bias=o_bias, qk_norm=qk_norm,
                                              prefix=f"{prefix}.self_attn")
        # Registered under the checkpoint's name for it (Mixtral's block_sparse_moe), so parameters load by name.
        self.mlp_name = parts.mlp_name
        self.add_module(self.mlp_name, parts.make_mlp(config, layer_idx, prefix=f"{prefix}.{self.mlp_name}"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.skinny = False   # whether a meta.skinny forward takes _forward_skinny (LlamaModel.prepare_skinny)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.skinny and self.skinny:
            return self._forward_skinny(positions, hidden_states, residual, meta)
        # The residual stream is carried unnormalized between layers; each norm first adds the
        # previous block's output into it (fused, in place).
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self._modules[self.mlp_name](hidden_states), residual

    def _forward_skinny(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                        meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        """The layer for a few rows (``meta.skinny``): four ``skinny_gemm`` calls, the norms in the products after them,
        the residual adds and SiLU-and-mul in the products before them (pagedkernels/skinny_gemm.py), so the layer is
        norm+qkv, q/k norm+rotary+KV-cache write, attention, o+add, norm+gate_up, SiLU-and-mul+down+add. The same
        rounding points as :meth:`forward`. Returns the residual stream itself as the hidden states (and no
        residual): the next layer, or the final norm, takes it as a stream with nothing left to add."""
        ops = pk_ops()
        stream = hidden_states if residual is None else residual.add_(hidden_states)
        attn, mlp = self.self_attn, self._modules[self.mlp_name]
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv = ops.skinny_gemm(stream, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=norm1.weight,
                              eps=norm1.eps)
        ops.skinny_gemm(attn.attend(positions, qkv, meta, rope_with_cache=True), attn.o_proj.weight, attn.o_proj.bias,
                        residual=stream)
        gate_up = ops.skinny_gemm(stream, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=norm2.weight,
                                  eps=norm2.eps)
        if isinstance(mlp.act_fn, SiluAndMul):   # SiLU-and-mul in the down product's prologue
            ops.skinny_gemm(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, gated="silu", residual=stream)
        else:
            ops.skinny_gemm(mlp.act_fn(gate_up), mlp.down_proj.weight, mlp.down_proj.bias, residual=stream)
        return stream, None

    def can_run_skinny(self) -> bool:
        """Whether :meth:`_forward_skinny` computes this layer: Llama's attention and gated MLP with plain float
        weights in the activations' dtype (not quantized, not packed for the CPU, not wrapped with LoRA adapters) and
        no tensor parallelism (a row-parallel product is summed over the ranks before its residual add)."""
        attn, mlp = self.self_attn, self._modules[self.mlp_name]
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(layer.quant_method) is UnquantizedLinearMethod and layer.tp_size == 1
                   and layer.packed_weight is None and layer.w16_weight is None for layer in linears):
            return False
        weights = [getattr(layer, "weight", None) for layer in linears]   # None: freed for a packed copy
        return (all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.stride(-1) == 1 for w in weights)
                and len({w.dtype for w in weights}) == 1
                and type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, *, o_bias: bool, qk_norm: bool, parts: type | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table (max_model_len positions) shared by every layer.
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
            rotary_dim=int(config.head_dim * config.partial_rotary_factor))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary_emb, o_bias=o_bias, qk_norm=qk_norm,
                                                      prefix=f"model.layers.{i}", parts=parts)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def prepare_skinny(self) -> bool:
        """Marks each layer that :meth:`LlamaDecoderLayer.can_run_skinny`; whether any can (the runner then sets
        ``meta.skinny`` for small batches). A subclass's layers of another kind (Gemma 2's) have no few-row path."""
        for layer in self.layers:
            layer.skinny = isinstance(layer, LlamaDecoderLayer) and layer.can_run_skinny()
        return any(layer.skinny for layer in self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *,
                final_norm: bool = True) -> torch.Tensor:
        """The final hidden states; without ``final_norm`` the residual stream before the last norm (for a caller
        that folds the norm into its LM head product: LlamaForCausalLM.skinny_logits)."""
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        if not final_norm:
            return hidden_states if residual is None else hidden_states + residual
        if residual is None:   # the few-row layers hand on the stream itself
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    o_bias_follows_attention_bias = True  # Llama: o_proj has a bias iff attention_bias
    qk_norm = False
    rope_types = ("linear", "llama3")
    mlp_name = "mlp"  # the MLP's module name in the checkpoint (Mixtral: block_sparse_moe)
    # Whether a step of one token runs the model uncompiled (ModelRunner.uncompiled_step): where the compiled graph
    # is linears, the embedding, pagedkernels and engine ops and views only (tests/engine/test_cuda_graph_runner.py
    # traces each architecture's), the compiler has nothing to fuse, and compiling the whole model for one-token
    # steps (dynamo specializes a dimension of 1) costs only start-up time: so for the Llama family and the MoE
    # models built on it, LoRA's and quantized layers included (custom ops too). A model with elementwise ops
    # between its calls (Gemma 2's GeGLU and softcaps, Qwen2-MoE's shared-expert gate, OLMoE's clamps) sets it off.
    one_token_uncompiled = True

    @classmethod
    def make_attention(cls, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, *, o_bias: bool,
                       qk_norm: bool, prefix: str) -> nn.Module:
        """The attention block of layer ``layer_idx`` (a subclass may build its own)."""
        return LlamaAttention(config, layer_idx, rotary_emb, o_bias=o_bias, qk_norm=qk_norm, prefix=prefix)

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int, prefix: str) -> nn.Module:
        """The MLP of layer ``layer_idx``: ``forward(x [T, H]) -> [T, H]`` (the MoE models' expert blocks)."""
        return LlamaMLP(config, prefix=prefix)

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        """ModelConfig fields from a Llama/Mistral config.json (``text``: its language-model part).
        Mistral slides in every layer when its config names a window; Llama never does."""
        hidden_act = text.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
        rope_theta, rope_scaling = read_rope(text, cls.rope_types)
        sliding_window, layer_windows = cls._sliding_windows(text, common)
        return dict(
            intermediate_size=int(need(text, "intermediate_size", common.model_dir)),
            norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_act="silu",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            layer_sliding_windows=layer_windows,
            attention_bias=bool(text.get("attention_bias", False)),
            mlp_bias=bool(text.get("mlp_bias", False)),
        )

    @classmethod
    def _sliding_windows(cls, text: dict, common: ModelConfig) -> tuple[int | None, tuple[int | None, ...]]:
        num_layers = common.num_hidden_layers
        window = text.get("sliding_window")
        if common.architecture == "LlamaForCausalLM" or not window:
            return None, (None,) * num_layers
        window = int(window)
        layer_types = read_layer_types(text, num_layers)
        if layer_types is None:
            return window, (window,) * num_layers
        return window, tuple(window if t == "sliding_attention" else None for t in layer_types)

    def __init__(self, config: ModelConfig):
        super().__init__()
        o_bias = config.attention_bias and self.o_bias_follows_attention_bias
        self.model = LlamaModel(config, o_bias=o_bias, qk_norm=self.qk_norm, parts=type(self))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *,
                final_norm: bool = True) -> torch.Tensor:
        """input_ids, positions int64 ``[num_tokens]`` -> final hidden states ``[num_tokens, hidden_size]`` (without
        ``final_norm``: the stream before the final norm, for :meth:`skinny_logits`)."""
        if not final_norm:
            return self.model(input_ids, positions, meta, final_norm=False)
        return self.model(input_ids, positions, meta)

    def prepare_skinny(self) -> bool:
        """See :meth:`LlamaModel.prepare_skinny` (called by the runner once the weights are in their final form)."""
        return self.model.prepare_skinny()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, hidden_size]`` -> float32 ``[num_seqs, vocab_size]``."""
        return self.lm_head(hidden_states)

    def can_fold_final_norm(self) -> bool:
        """Whether :meth:`skinny_logits` computes :meth:`compute_logits` of the final norm: an RMSNorm before an LM head
        that is one plain product (no softcap, not split over ranks, its weight in the model's dtype and layout)."""
        head, norm = self.lm_head, self.model.norm
        weight = head.weight
        return (type(norm) is RMSNorm and head.softcap is None and head.tp_size == 1 and head.packed_weight is None
                and weight.dim() == 2 and weight.stride(-1) == 1 and weight.dtype == norm.weight.dtype
                and type(self.model).forward is LlamaModel.forward)

    def skinny_logits(self, stream: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden_size]`` residual stream before the final norm (``forward(..., final_norm=False)``, 1 to
        skinny_gemm's MAX_ROWS rows) -> float32 ``[rows, vocab_size]``: the final RMSNorm and the LM head in one
        few-row product (pagedkernels.skinny_gemm's norm prologue; the same rounding points as the two kernels).
        Only where :meth:`can_fold_final_norm`."""
        norm = self.model.norm
        return pk_ops().skinny_gemm(stream, self.lm_head.weight, None, norm_weight=norm.weight, eps=norm.eps).float()
