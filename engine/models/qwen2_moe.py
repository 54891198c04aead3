"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 (q/k/v biases) with routed experts plus a shared expert
every token takes, its output scaled by ``sigmoid(shared_expert_gate(x))``; softmax routing, renormalized when
``norm_topk_prob``."""

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.communication import tensor_model_parallel_all_reduce
from engine.distributed.parallel_state import get_tp_world_size
from engine.layers.fused_moe import SparseMoeBlock
from engine.layers.linear import Linear
from engine.models.llama import LlamaMLP
from engine.models.moe import MoEMixin, moe_config_fields
from engine.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """The routed experts and the shared expert, each rank's two partial sums added before one all-reduce
    (the shared expert is tensor-parallel like a dense MLP; its gate, one logit, is whole on every rank)."""

    def __init__(self, config: ModelConfig, prefix: str):
        super().__init__(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                         config.moe_intermediate_size, renormalize=config.norm_topk_prob, weights_in_model_dtype=True,
                         enable_expert_parallel=config.enable_expert_parallel, reduce_results=False, prefix=prefix)
        self.shared_expert = LlamaMLP(config, f"{prefix}.shared_expert",
                                      intermediate_size=config.shared_expert_intermediate_size, reduce_results=False)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        shared = self.shared_expert(hidden_states)
        out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return tensor_model_parallel_all_reduce(out) if get_tp_world_size() > 1 else out


class Qwen2MoeForCausalLM(MoEMixin, Qwen2ForCausalLM):
    one_token_uncompiled = False   # the shared expert's gate: ops to fuse (LlamaForCausalLM)

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        text = {"intermediate_size": text.get("moe_intermediate_size"), **text}
        fields = {**super().config_from_hf(text, common),
                  **moe_config_fields(text, common, expert_size_key="moe_intermediate_size"),
                  # transformers 5 names the q/k/v bias qkv_bias (True, as every Qwen2-MoE checkpoint has it)
                  "attention_bias": bool(text.get("qkv_bias", True))}
        shared = text.get("shared_expert_intermediate_size")
        if not shared:
            raise ValueError("Qwen2-MoE needs shared_expert_intermediate_size")
        fields["shared_expert_intermediate_size"] = int(shared)
        return fields

    @classmethod
    def make_moe_block(cls, config: ModelConfig, prefix: str) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(config, prefix)
