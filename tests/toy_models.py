"""A plain ``nn.Module`` language model for the ``model.factory`` path."""

import os
import sys

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


class LayerDropLM(nn.Module):
    """Two residual MLP blocks, each skipped with probability ``layerdrop`` in training (as
    wav2vec2/WavLM do), so some parameters get no gradient on some steps. ``drops`` counts skips."""

    def __init__(self, vocab_size: int, dim: int = 16, layerdrop: float = 0.5):
        super().__init__()
        self.layerdrop = layerdrop
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(dim, vocab_size)
        self.register_buffer("drops", torch.zeros((), dtype=torch.int64))
        self.drops_reported = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.training and not self.drops_reported:  # for the test that ranks draw different masks
            self.drops_reported = True
            print(f"first random draw on rank {os.environ.get('RANK', '0')}: {torch.rand(()).item():.8f}",
                  file=sys.stderr, flush=True)
        for layer in self.layers:
            if self.training and torch.rand(()) < self.layerdrop:
                self.drops += 1
                continue
            h = h + layer(h)
        return self.head(h)


def make_layerdrop(vocab_size: int, dim: int = 16, layerdrop: float = 0.5) -> nn.Module:
    return LayerDropLM(vocab_size, dim, layerdrop)


class UnusedBranchLM(TinyLM):
    """A TinyLM with a parameter that never takes part in the loss (a forgotten branch)."""

    def __init__(self, vocab_size: int, dim: int = 16):
        super().__init__(vocab_size, dim)
        self.forgotten = nn.Linear(dim, dim)


def make_unused(vocab_size: int, dim: int = 16) -> nn.Module:
    return UnusedBranchLM(vocab_size, dim)


class PlantedBufferLM(TinyLM):
    """A TinyLM whose frozen random buffer is drawn differently on each rank (unseeded per rank,
    the SpeechBrain failure), and added to the logits."""

    def __init__(self, vocab_size: int, dim: int = 16):
        super().__init__(vocab_size, dim)
        import os

        g = torch.Generator().manual_seed(1000 + int(os.environ.get("RANK", "0")))
        self.register_buffer("planted", torch.randn(vocab_size, generator=g))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) + self.planted


def make_planted(vocab_size: int, dim: int = 16) -> nn.Module:
    return PlantedBufferLM(vocab_size, dim)


class RankLocalStatsLM(TinyLM):
    """A TinyLM with a buffer that accumulates statistics of each rank's own inputs (like
    BatchNorm running stats without synchronisation), so it drifts apart across ranks."""

    def __init__(self, vocab_size: int, dim: int = 16):
        super().__init__(vocab_size, dim)
        self.register_buffer("input_stats", torch.zeros(()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.input_stats += input_ids.float().mean()
        return super().forward(input_ids)


def make_rank_local_stats(vocab_size: int, dim: int = 16) -> nn.Module:
    return RankLocalStatsLM(vocab_size, dim)


class StackLM(nn.Module):
    """Embedding → a ``ModuleList`` of residual MLP blocks (with dropout) → vocabulary projection:
    a plain module whose repeated blocks activation checkpointing wraps."""

    def __init__(self, vocab_size: int, dim: int = 32, layers: int = 4, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout),
                                                  nn.Linear(4 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def make_stack(vocab_size: int, dim: int = 32, layers: int = 4, dropout: float = 0.1) -> nn.Module:
    return StackLM(vocab_size, dim, layers, dropout)


def broken(vocab_size: int) -> nn.Module:
    """A factory that fails the way a user's buggy model code does (for the error-message tests)."""
    raise RuntimeError("toy_models.broken always fails")
