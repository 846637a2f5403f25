"""Format ``safetensors``: replicated weights written once by rank 0 as safetensors (sharded past
``checkpoint.max_shard_size``, huggingface_hub's layout: :mod:`memtrain.weights`) and
``optimizer.pt`` with the optimizer's state and the fp16 GradScaler's (DDP)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

NAME = "safetensors"
OPTIMIZER_FILE = "optimizer.pt"


def expected_files(world_size: int) -> list[str]:
    """Glob patterns a complete save holds (the same for any world size: nothing is sharded)."""
    return ["model*.safetensors", OPTIMIZER_FILE]


def save(module: nn.Module, optimizer_state: dict[str, Any], scaler_state: Optional[dict], directory: str,
         max_shard_size: str) -> None:
    """Write ``module``'s weights and the optimizer (and GradScaler) state into ``directory``
    (one process: the caller is rank 0)."""
    from memtrain.weights import save_weights

    save_weights(module.state_dict(), directory, max_shard_size)
    torch.save({"optimizer": optimizer_state, "scaler": scaler_state}, os.path.join(directory, OPTIMIZER_FILE))


def load(module: nn.Module, directory: str) -> dict[str, Any]:
    """Load the weights into ``module``; returns ``{"optimizer": state dict, "scaler": state dict
    or None}`` for the caller to load (any world size)."""
    from memtrain.weights import load_into

    load_into(module, read_full_weights(directory))
    return torch.load(os.path.join(directory, OPTIMIZER_FILE), map_location="cpu", weights_only=True)


def read_full_weights(path: str) -> dict[str, torch.Tensor]:
    """The replicated weights rank 0 wrote."""
    from memtrain.weights import load_weights

    return load_weights(path)
