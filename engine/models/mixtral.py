"""Mixtral (8x7B, 8x22B): Mistral with every MLP a block of routed experts (``block_sparse_moe``, experts'
projections named w1 / w3 / w2); softmax routing, the top-k always renormalized, the weights kept in float32."""

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoEMixin, moe_config_fields


class MixtralForCausalLM(MoEMixin, LlamaForCausalLM):
    mlp_name = "block_sparse_moe"
    expert_weight_names = {"w1": "w1", "w3": "w3", "w2": "w2"}
    router_weights_in_model_dtype = False

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        """Mistral's mapping (a sliding window when the config names one); each expert's intermediate size is
        intermediate_size."""
        return {**super().config_from_hf(text, common),
                **moe_config_fields(text, common, expert_size_key="intermediate_size", norm_topk_prob=True,
                                    sparse_step=False)}
