"""What the mixture-of-experts architectures share (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the Llama network
with some or all of its MLPs replaced by a routed block of experts (engine/layers/fused_moe.py).

:class:`MoEMixin`, put before a Llama-family class, makes a layer's MLP the expert block where the config's
``moe_layers`` says so, and maps the checkpoint's per-expert tensors (``{mlp}.experts.{e}.{name}.weight``)
onto the stacked expert weights through ``expert_weight_names`` (checkpoint name -> gate "w1", up "w3", down
"w2"). :func:`moe_config_fields` reads the config.json keys they share.

The routers differ in two details, which the model classes carry: whether the top-k weights are renormalized
(Mixtral always; the others when ``norm_topk_prob``), and the weights' dtype: Mixtral's stay float32, the others
round them to the model's dtype first (transformers' ``router_top_value.to(router_logits.dtype)``).
"""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig
from engine.layers.fused_moe import SparseMoeBlock


def moe_config_fields(text: dict, common: ModelConfig, *, expert_size_key: str, norm_topk_prob: bool | None = None,
                      sparse_step: bool = True) -> dict:
    """ModelConfig's MoE fields from a config.json (``text``): the experts (``num_experts`` or
    ``num_local_experts``, transformers names it either way), top-k, each expert's intermediate size (under
    ``expert_size_key``), ``norm_topk_prob`` (``norm_topk_prob`` given: the architecture's fixed choice), and which
    layers are sparse: with ``sparse_step`` Qwen's rule, layer i unless it is in ``mlp_only_layers`` or i + 1 is
    not a multiple of ``decoder_sparse_step``; else all of them."""
    num_layers = common.num_hidden_layers
    num_experts = text.get("num_experts", text.get("num_local_experts"))
    if not num_experts:
        raise ValueError("a mixture-of-experts config needs num_experts (or num_local_experts) >= 1")
    top_k = text.get("num_experts_per_tok")
    if not top_k or not 1 <= int(top_k) <= int(num_experts):
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k!r}")
    expert_size = text.get(expert_size_key)
    if not expert_size:
        raise ValueError(f"a mixture-of-experts config needs {expert_size_key}")
    if sparse_step:
        step = int(text.get("decoder_sparse_step", 1) or 1)
        dense = set(text.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    else:
        moe_layers = (True,) * num_layers
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k), moe_intermediate_size=int(expert_size),
                norm_topk_prob=bool(text.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob,
                moe_layers=moe_layers)


class MoEMixin:
    """Mixed into a Llama-family model class (before it): expert blocks where ``config.moe_layers`` says."""

    # checkpoint name of an expert's projection -> its shard of the stacked expert weights
    expert_weight_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    # The router's top-k weights rounded to the model's dtype (transformers' Qwen and OLMoE routers), or float32.
    router_weights_in_model_dtype = True

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int, prefix: str) -> nn.Module:
        if not config.moe_layers[layer_idx]:
            return super().make_mlp(config, layer_idx, prefix)
        return cls.make_moe_block(config, prefix)

    @classmethod
    def make_moe_block(cls, config: ModelConfig, prefix: str) -> nn.Module:
        return SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                              config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                              weights_in_model_dtype=cls.router_weights_in_model_dtype,
                              enable_expert_parallel=config.enable_expert_parallel, prefix=prefix)

    def __init__(self, config: ModelConfig):
        if config.quant_config is not None:
            raise ValueError(f"{config.architecture}: quantized checkpoints ({config.quant_config.name}) of mixture-"
                             "of-experts models are not supported: the experts run in the model's float dtype")
        super().__init__(config)
