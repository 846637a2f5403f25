"""A plain ``nn.Module`` language model for the ``model.factory`` path."""

import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding → GELU MLP block → vocabulary projection; input_ids [B, T] → logits [B, T, V]."""

    def __init__(self, vocab_size: int, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.head(h + self.block(h))


def make(vocab_size: int, dim: int = 16) -> nn.Module:
    return TinyLM(vocab_size, dim)
