"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 (per-head q/k RMSNorm) with routed experts in the layers
its config marks sparse; softmax routing, the top-k renormalized when ``norm_topk_prob``."""

from engine.config import ModelConfig
from engine.models.moe import MoEMixin, moe_config_fields
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEMixin, Qwen3ForCausalLM):
    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        # intermediate_size is the dense layers' (mlp_only_layers); published configs carry it, sparse-only ones
        # may not.
        text = {"intermediate_size": text.get("moe_intermediate_size"), **text}
        return {**super().config_from_hf(text, common),
                **moe_config_fields(text, common, expert_size_key="moe_intermediate_size")}
