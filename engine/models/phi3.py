"""Phi-3: the Llama network, with q/k/v and gate/up already fused in the checkpoint (``qkv_proj``,
``gate_up_proj``: they load whole into the fused parameters, which split them into their shards),
LongRoPE scaling (``rope_scaling`` type "longrope", "su" in older configs), optional partial rotary, and a
sliding window in every layer when the config names one."""

from __future__ import annotations

from engine.config import ModelConfig, need, read_partial_rotary_factor, read_rope
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Nothing to rename: the checkpoint's names are the fused parameters' names.
    packed_modules_mapping: dict = {}
    rope_types = ("longrope",)

    @classmethod
    def config_from_hf(cls, text: dict, common: ModelConfig) -> dict:
        """ModelConfig fields from a Phi-3 config.json; transformers' Phi3Config defaults where a key is
        absent. LongRoPE's ``original_max_position_embeddings`` may sit at the top level (transformers 4
        and Microsoft's files) or in the rope parameters; ``factor`` defaults to max_position_embeddings
        over it, as transformers computes it."""
        hidden_act = text.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
        rope_text = dict(text)
        for key in ("rope_scaling", "rope_parameters"):
            if not isinstance(text.get(key), dict):
                continue
            scaling = dict(text[key])
            # transformers reads Phi-3's older type names "su" and "yarn" as "longrope".
            if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
                scaling.pop("type", None)
                scaling["rope_type"] = "longrope"
            if "original_max_position_embeddings" in text:
                scaling.setdefault("original_max_position_embeddings", text["original_max_position_embeddings"])
            rope_text[key] = scaling
        rope_theta, rope_scaling = read_rope(rope_text, cls.rope_types)
        if rope_scaling is not None and rope_scaling.get("factor") is None:
            rope_scaling["factor"] = common.max_position_embeddings / float(
                rope_scaling["original_max_position_embeddings"])
        window = text.get("sliding_window")
        window = int(window) if window else None
        return dict(
            intermediate_size=int(need(text, "intermediate_size", common.model_dir)),
            norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            hidden_act="silu",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=read_partial_rotary_factor(text),
            sliding_window=window,
            layer_sliding_windows=(window,) * common.num_hidden_layers,
        )
