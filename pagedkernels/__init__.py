"""pagedkernels: paged-attention and KV-cache Triton kernels with PyTorch twins.

KV-cache layout, one pair per layer: ``key_cache`` and ``value_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot is ``block_id * block_size + offset``.
Every op dispatches through :func:`set_backend` (``auto`` = Triton for CUDA tensors; for CPU tensors the
native kernel where it builds, else PyTorch). On meta tensors or fake ones (``FakeTensorMode``,
``torch.compile``'s tracing) an op checks its arguments as always and allocates its outputs, nothing
else: that is also its custom op's fake implementation (``torch_ops``).
"""

from ._backend import get_backend, set_backend, use_backend  # noqa: F401  (must come first)
from ._backend import programmatic_dependent_launch, set_programmatic_dependent_launch  # noqa: F401

from .decode_attention import (  # noqa: F401
    decode_split_counters,
    decode_workspace,
    decode_workspace_numel,
    paged_decode_attention,
    rotary_cache_decode_attention,
)
from .prefill_attention import paged_prefill_attention  # noqa: F401
from .cache_ops import copy_blocks, reshape_and_cache, swap_blocks  # noqa: F401
from .activation import silu_and_mul  # noqa: F401
from .rms_norm import fused_add_rms_norm, rms_norm  # noqa: F401
from .rotary import (compute_cos_sin_cache, qk_norm_rotary_embedding, rotary_embedding,  # noqa: F401
                     rotary_embedding_and_cache)
from .wq_gemm import wq_gemm  # noqa: F401
from .gguf_quant import (GGUF_BLOCKS, GGUF_INTERLEAVED, gguf_deinterleave, gguf_dequantize, gguf_gemm,  # noqa: F401
                         gguf_interleave, gguf_take_rows)
from .fp8_gemm import fp8_gemm, quantize_fp8_weight  # noqa: F401
from .w16_gemm import pack_w16, w16_gemm  # noqa: F401
from .skinny_gemm import (  # noqa: F401  (few-row GEMM: decode at small batch, norm / residual fused)
    set_skinny_gemm_deep, skinny_gemm, skinny_gemm_deep)
from .moe_topk import moe_topk  # noqa: F401
from .moe_align import moe_align_block_size  # noqa: F401
from .fused_moe import fused_moe, moe_gemv_max_tokens, pack_moe_weight, set_moe_gemv_max_tokens  # noqa: F401
from .lora import add_lora, lora_expand, lora_mapping, lora_shrink  # noqa: F401  (multi-LoRA: Punica-style SGMV)
from .sampling import sample_from_logits  # noqa: F401  (next-token draws: argmax or inverse CDF, one kernel)
from .cpu_graph import CPUGraph, CPUGraphPool, GraphCaptureError  # noqa: F401  (native kernel calls, replayed from C)
from . import quant_formats  # noqa: F401  (canonical int4/int8 layout; GPTQ/AWQ/GGUF conversions)
from . import torch_ops  # noqa: F401  (torch.ops.pagedkernels.*, for torch.compile)

__version__ = "0.1.0"
