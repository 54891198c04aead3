"""Token and position embeddings, and the LM head (which may share the token embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.communication import tensor_model_parallel_all_reduce, tensor_model_parallel_gather
from engine.distributed.parallel_state import get_tp_rank, get_tp_world_size
from engine.layers.quantization.unquantized import UnquantizedLinearMethod


class VocabEmbedding(nn.Module):
    """Rows of ``weight [vocab_size, hidden_size]``, times ``scale`` when given (Gemma multiplies by
    ``sqrt(hidden_size)``; the factor is rounded to the model dtype first, as transformers does).

    Vocab-parallel under tensor parallelism: rank r holds rows ``[r * V_r, (r + 1) * V_r)`` with
    ``V_r = ceil(vocab_size / tp)`` (the last rank's rows past the vocabulary are zero padding); a token
    outside a rank's rows contributes zeros there, and the all-reduce sums the one real row per token."""

    def __init__(self, vocab_size: int, hidden_size: int, *, scale: float | None = None):
        super().__init__()
        self.vocab_size, self.tp_size, self.tp_rank = vocab_size, get_tp_world_size(), get_tp_rank()
        self.num_rows = -(-vocab_size // self.tp_size)   # this rank's rows (padded)
        self.vocab_start = self.tp_rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # A 0-dim buffer in the default (model) dtype, so it follows the module's device and dtype.
        self.register_buffer("scale", None if scale is None else torch.tensor(float(scale)), persistent=False)
        # A GGUF model's embedding may keep the file's blocks instead of float rows (install_gguf_embedding in
        # engine/layers/quantization/gguf.py): its lookups then de-quantize the rows they gather.
        self.register_buffer("gguf_qweight", None, persistent=False)
        self.gguf_type: str | None = None
        self.gguf_dtype: torch.dtype | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter shape "
                             f"{(self.vocab_size, param.shape[1])}")
        rows = loaded[self.vocab_start:self.vocab_start + self.num_rows]
        param.data[:rows.shape[0]].copy_(rows)
        param.data[rows.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 ``[num_tokens]`` -> ``[num_tokens, hidden_size]``."""
        if self.tp_size == 1:
            embeddings = self._rows(input_ids)
        else:
            local_ids = input_ids - self.vocab_start
            outside = (local_ids < 0) | (local_ids >= self.num_rows)
            embeddings = self._rows(local_ids.masked_fill(outside, 0))
            embeddings = tensor_model_parallel_all_reduce(embeddings.masked_fill(outside.unsqueeze(-1), 0.0))
        return embeddings if self.scale is None else embeddings.mul_(self.scale)


    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_qweight is None:
            return F.embedding(ids, self.weight)
        from engine.layers import pk_ops
        from pagedkernels import gguf_take_rows
        rows, row_type = gguf_take_rows(self.gguf_qweight, self.gguf_type, ids.reshape(-1))
        values = pk_ops().gguf_dequantize(rows, row_type, dtype=self.gguf_dtype)
        return values.reshape(*ids.shape, values.shape[-1])


class PositionEmbedding(nn.Module):
    """Learned absolute positions (OPT): position p reads row ``p + offset`` of
    ``weight [num_positions + offset, hidden_size]`` (OPT's checkpoints keep 2 unused rows in front)."""

    def __init__(self, num_positions: int, hidden_size: int, *, offset: int = 0):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, hidden_size), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions int64 ``[num_tokens]`` -> ``[num_tokens, hidden_size]``."""
        return F.embedding(positions + self.offset, self.weight)


class LMHead(VocabEmbedding):
    """Logits of the hidden states it is given (the runner passes only each sequence's last token).

    Never quantized (no format here quantizes it): its product is the unquantized linear method's, which
    on the CPU may prepack its float32 weight for oneDNN (``packed_weight``).

    ``softcap`` (Gemma 2's final_logit_softcapping) maps each logit to ``softcap * tanh(logit / softcap)``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, softcap: float | None = None):
        super().__init__(vocab_size, hidden_size)
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)
        self.quant_method = UnquantizedLinearMethod()
        self.packed_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """``[num_seqs, hidden_size]`` -> float32 logits ``[num_seqs, vocab_size]``. Under tensor parallelism
        each rank computes its vocabulary rows and rank 0, the one that samples, gathers them (None elsewhere)."""
        logits = self.quant_method.apply(self, hidden_states, None).float()
        if self.tp_size > 1:
            logits = tensor_model_parallel_gather(logits, dst=0, dim=-1)
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
        if self.softcap is not None:
            # float32 here; transformers caps in the model dtype (the same thing in float32 models).
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits
