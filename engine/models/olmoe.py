"""OLMoE (OLMoE-1B-7B): the Llama network with every MLP a block of routed experts and an RMSNorm over the whole
q and the whole k projection (all heads at once, before the rotary embedding; not per head as Qwen3's), and
q, k, v optionally clamped to ``[-clip_qkv, clip_qkv]``; softmax routing, renormalized when ``norm_topk_prob``.

Under tensor parallelism a rank holds some heads, but the norm's mean runs over all of them: q and k are
gathered from the ranks, normed whole, and each rank keeps its heads again (vLLM does the same)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.distributed.communication import tensor_model_parallel_all_gather
from engine.distributed.parallel_state import get_tp_rank, get_tp_world_size
from engine.layers.attention import AttentionMetadata
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.moe import MoEMixin, moe_config_fields


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, *, o_bias: bool,
                 qk_norm: bool, prefix: str = ""):
        super().__init__(config, layer_idx, rotary_emb, o_bias=o_bias, qk_norm=False, prefix=prefix)
        self.total_num_heads, self.total_num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_norm = RMSNorm(self.total_num_heads * self.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(self.total_num_kv_heads * self.head_dim, config.norm_eps)
        self.clip_qkv = config.clip_qkv
        self.tp_size, self.tp_rank = get_tp_world_size(), get_tp_rank()

    def _norm_whole(self, x: torch.Tensor, norm: RMSNorm, total_heads: int) -> torch.Tensor:
        """``x [T, local heads * head_dim]`` normed over every rank's heads; this rank's part of the result."""
        if self.tp_size == 1:
            return norm(x)
        num_tokens, local = x.shape
        gathered = tensor_model_parallel_all_gather(x.contiguous(), dim=-1)  # [T, tp * local], rank order
        if local // self.head_dim * self.tp_size > total_heads:
            # Fewer KV heads than ranks: each holds one, replicated over tp / total_heads ranks; one copy each.
            per_head = self.tp_size // total_heads
            heads = gathered.view(num_tokens, self.tp_size, self.head_dim)[:, ::per_head]
            normed = norm(heads.reshape(num_tokens, total_heads * self.head_dim))
            head = self.tp_rank // per_head
            return normed[:, head * self.head_dim:(head + 1) * self.head_dim]
        return norm(gathered)[:, self.tp_rank * local:(self.tp_rank + 1) * local]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._norm_whole(q, self.q_norm, self.total_num_heads)
        k = self._norm_whole(k, self.k_norm, self.total_num_kv_heads)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class OlmoeForCausalLM(MoEMixin, LlamaForCausalLM):
    one_token_uncompiled = False   # the q/k/v clamps: ops to fuse (LlamaForCausalLM)

    @classmethod
    def make_attention(cls, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, *, o_bias: bool,
                       qk_norm: bool, prefix: str) -> OlmoeAttention:
        return OlmoeAttention(config, layer_idx, rotary_emb, o_bias=o_bias, qk_norm=qk_norm, prefix=prefix)

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        clip = text.get("clip_qkv")
        return {**super().config_from_hf(text, common),
                **moe_config_fields(text, common, expert_size_key="intermediate_size", sparse_step=False),
                "clip_qkv": None if clip is None else float(clip)}
