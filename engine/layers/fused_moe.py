"""The mixture-of-experts block: a router (one logit per expert) and the experts' SwiGLU MLPs, on
``pagedkernels.moe_topk`` and ``pagedkernels.fused_moe``.

:class:`FusedMoE` holds the experts as two stacked weights, ``w13_weight [E, 2I, H]`` (each expert's gate rows,
then its up rows) and ``w2_weight [E, H, I]``, loaded from the checkpoint's per-expert tensors (HF's
``experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``) by shard ids
``(expert, "w1" | "w3" | "w2")``, or from a tensor of all experts at once (expert None: GGUF's ``ffn_*_exps``).

Parallelism, as vLLM's:

- tensor parallelism (the default): every rank holds every expert's slice of the intermediate size, I / tp
  rows of gate and up and the same columns of down (Megatron's column/row split inside each expert); each rank's
  output is a partial sum over its slice.
- expert parallelism (``enable_expert_parallel``): rank r holds experts [first_r, first_r + E_r) whole, a
  contiguous share (the first E % world ranks one more); slots routed to other ranks' experts add nothing here
  (``expert_map``: global -> local expert or -1), so each rank's output is a partial sum over its experts.

Either way the block ends in one all-reduce (of the router's replicated choices every rank has the same).

On the CPU (native kernels built) the weights are repacked after loading into the native kernel's panels
(``pagedkernels.pack_moe_weight``): a float32 model's in 16 bits when every value is a bf16 / fp16 one (a 16-bit
checkpoint's, widened to float32 on load): half the bytes, the same products (``ENGINE_CPU_W16=0`` keeps them
float32); a bf16 (or fp16) model's in its own dtype, the kernel taking its hidden states in that dtype too.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.communication import tensor_model_parallel_all_reduce
from engine.distributed.parallel_state import get_tp_rank, get_tp_world_size
from engine.layers import pk_ops
from engine.layers.linear import Linear

# Shard kinds of an expert's checkpoint tensors: gate (w1) and up (w3) stack into w13, down is w2.
EXPERT_SHARDS = ("w1", "w3", "w2")


def expert_range(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """[first, end) of the experts rank ``rank`` of ``world_size`` holds under expert parallelism: contiguous
    shares, the first ``num_experts % world_size`` ranks one more than the others."""
    share, extra = divmod(num_experts, world_size)
    first = rank * share + min(rank, extra)
    return first, first + share + (rank < extra)


class FusedMoE(nn.Module):
    """The experts of one layer (see the module docstring): ``forward(hidden [T, H], router_logits [T, E])``
    -> ``[T, H]``, all-reduced over the ranks (``reduce_results=False``: this rank's partial sum, for a caller
    that adds more to it before its own all-reduce)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, scoring: str = "softmax", activation: str = "silu",
                 weights_in_model_dtype: bool = False, reduce_results: bool = True,
                 enable_expert_parallel: bool = False, prefix: str = ""):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.renormalize, self.scoring, self.activation = renormalize, scoring, activation
        self.weights_in_model_dtype, self.reduce_results, self.prefix = weights_in_model_dtype, reduce_results, prefix
        self.world_size, self.rank = get_tp_world_size(), get_tp_rank()
        self.expert_parallel = enable_expert_parallel and self.world_size > 1
        if self.expert_parallel:
            if num_experts < self.world_size:
                raise ValueError(f"enable_expert_parallel: num_experts={num_experts} cannot be shared by "
                                 f"tensor_parallel_size={self.world_size} ranks (each needs an expert)")
            first, end = expert_range(num_experts, self.world_size, self.rank)
            self.intermediate_size, self.intermediate_start = intermediate_size, 0
        else:
            first, end = 0, num_experts
            if intermediate_size % self.world_size:
                raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                                 f"tensor_parallel_size={self.world_size} (or pass enable_expert_parallel=True: "
                                 f"experts split across the ranks whole)")
            self.intermediate_size = intermediate_size // self.world_size
            self.intermediate_start = self.rank * self.intermediate_size
        self.full_intermediate_size = intermediate_size
        self.local_experts = range(first, end)
        self.num_local_experts = end - first
        local_i = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * local_i, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, local_i), requires_grad=False)
        for param, kinds in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            param.weight_loader = self.weight_loader
            param.shard_ids = tuple((e, kind) for e in self.local_experts for kind in kinds)
        if self.expert_parallel:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[first:end] = torch.arange(self.num_local_experts, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.expert_map = None
        # On the CPU, the weights in the native kernel's panels (process_weights_after_loading), else None.
        self.register_buffer("w13_packed", None, persistent=False)
        self.register_buffer("w2_packed", None, persistent=False)

    # -- loading -------------------------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """``shard_id = (expert, kind)``: one expert's ``[I, H]`` gate (w1) or up (w3) or ``[H, I]`` down (w2)
        checkpoint tensor; ``expert`` None: the ``[E, ...]`` tensor of every expert. Experts of other ranks are
        skipped; this rank's slice of I is cut out."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_SHARDS):
            raise ValueError(f"expert shard id must be (expert, one of {EXPERT_SHARDS}), got {shard_id!r}")
        expert, kind = shard_id
        if expert is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"shape {tuple(loaded.shape)}: expected the {self.num_experts} experts' {kind} "
                                 f"tensors stacked along dim 0")
            for e in self.local_experts:
                self._load_expert(param, loaded[e], e, kind)
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is past num_experts={self.num_experts}")
        if expert in self.local_experts:
            self._load_expert(param, loaded, expert, kind)

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, kind: str) -> None:
        local, full, size, start = (expert - self.local_experts.start, self.full_intermediate_size,
                                    self.intermediate_size, self.intermediate_start)
        want = (full, self.hidden_size) if kind != "w2" else (self.hidden_size, full)
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match expert {kind} shape {want}")
        if kind == "w2":
            param.data[local].copy_(loaded[:, start:start + size])
        else:
            offset = 0 if kind == "w1" else size
            param.data[local, offset:offset + size].copy_(loaded[start:start + size])

    def process_weights_after_loading(self) -> None:
        """On the CPU (native kernels built): the weights in the native kernel's panels, the parameters freed. A
        float32 model's are 16-bit where every value is a 16-bit one; a 16-bit model's keep their dtype."""
        from engine.layers.quantization.unquantized import _w16_enabled
        from pagedkernels import _native, pack_moe_weight

        w13, w2 = self.w13_weight.data, self.w2_weight.data
        if w13.device.type != "cpu" or _native.library() is None or not w13.numel():
            return
        if w13.dtype == torch.float32:
            dtype = _exact_16bit_dtype(w13, w2) if _w16_enabled() else None
        else:
            dtype = w13.dtype
        self.w13_packed, self.w2_packed = pack_moe_weight(w13, dtype), pack_moe_weight(w2, dtype)
        self.w13_weight = nn.Parameter(w13.new_empty(0), requires_grad=False)
        self.w2_weight = nn.Parameter(w2.new_empty(0), requires_grad=False)

    # -- forward -------------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        ops = pk_ops()
        weights_dtype = hidden_states.dtype if self.weights_in_model_dtype else torch.float32
        topk_weights, topk_ids = ops.moe_topk(router_logits, self.top_k, scoring=self.scoring,
                                              renormalize=self.renormalize, weights_dtype=weights_dtype)
        packed = self.w13_packed is not None
        out = ops.fused_moe(hidden_states, self.w13_packed if packed else self.w13_weight,
                            self.w2_packed if packed else self.w2_weight, topk_weights, topk_ids,
                            activation=self.activation, expert_map=self.expert_map)
        if self.reduce_results and self.world_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class SparseMoeBlock(nn.Module):
    """A layer's MoE MLP: the router ``gate`` (a linear to one logit per expert, whole on every rank: each
    rank routes the same way) and the ``experts``. Checkpoint names: ``{prefix}.gate.weight``,
    ``{prefix}.experts.{e}.*``."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, weights_in_model_dtype: bool, enable_expert_parallel: bool = False,
                 reduce_results: bool = True, prefix: str = ""):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=renormalize,
                                weights_in_model_dtype=weights_in_model_dtype, reduce_results=reduce_results,
                                enable_expert_parallel=enable_expert_parallel, prefix=f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` -> the experts' weighted sum, same shape."""
        return self.experts(hidden_states, self.gate(hidden_states))


def _exact_16bit_dtype(*weights: torch.Tensor) -> torch.dtype | None:
    """bf16 or fp16 if every value of the stacked float32 weights is one (checked expert by expert: no temporary
    of a whole layer), else None."""
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(w[e].to(dtype).float(), w[e]) for w in weights for e in range(w.shape[0])):
            return dtype
    return None
