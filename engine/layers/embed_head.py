"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import PackableLinearMixin


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 ``[num_tokens]`` -> ``[num_tokens, hidden_size]``."""
        return F.embedding(input_ids, self.weight)


class LMHead(PackableLinearMixin, VocabEmbedding):
    """Logits of the hidden states it is given (the runner passes only each sequence's last token)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, hidden_size]`` -> float32 logits ``[num_seqs, vocab_size]``."""
        return self._linear(hidden_states, None).float()
