"""Token and position embeddings, and the LM head (which may share the token embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import PackableLinearMixin


class VocabEmbedding(nn.Module):
    """Rows of ``weight [vocab_size, hidden_size]``, times ``scale`` when given (Gemma multiplies by
    ``sqrt(hidden_size)``; the factor is rounded to the model dtype first, as transformers does)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, scale: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        # A 0-dim buffer in the default (model) dtype, so it follows the module's device and dtype.
        self.register_buffer("scale", None if scale is None else torch.tensor(float(scale)), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 ``[num_tokens]`` -> ``[num_tokens, hidden_size]``."""
        embeddings = F.embedding(input_ids, self.weight)
        return embeddings if self.scale is None else embeddings.mul_(self.scale)


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


class LMHead(PackableLinearMixin, VocabEmbedding):
    """Logits of the hidden states it is given (the runner passes only each sequence's last token).

    ``softcap`` (Gemma 2's final_logit_softcapping) maps each logit to ``softcap * tanh(logit / softcap)``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, softcap: float | None = None):
        super().__init__(vocab_size, hidden_size)
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, hidden_size]`` -> float32 logits ``[num_seqs, vocab_size]``."""
        logits = self._linear(hidden_states, None).float()
        if self.softcap is not None:
            # float32 here; transformers caps in the model dtype (the same thing in float32 models).
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits
