"""Format ``safetensors``: replicated weights written once by rank 0 as safetensors (sharded past
``checkpoint.max_shard_size``, huggingface_hub's layout: :mod:`memtrain.weights`) and
``optimizer.pt`` with the optimizer's state and the fp16 GradScaler's (DDP)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from memtrain.optim import weight_decay_groups
from memtrain.weights import load_into, load_weights, save_weights

NAME = "safetensors"
WRITTEN_BY = "ddp"
"""The engine whose manifests meant this format before manifests named their format."""
OPTIMIZER_FILE = "optimizer.pt"


def expected_files(world_size: int) -> list[str]:
    """Glob patterns a complete save holds (the same for any world size: nothing is sharded)."""
    return ["model*.safetensors", OPTIMIZER_FILE]


def save(module: nn.Module, optimizer_state: dict[str, Any], scaler_state: Optional[dict], directory: str,
         max_shard_size: str) -> None:
    """Write ``module``'s weights and the optimizer (and GradScaler) state into ``directory``
    (one process: the caller is rank 0)."""
    save_weights(module.state_dict(), directory, max_shard_size)
    torch.save({"optimizer": optimizer_state, "scaler": scaler_state}, os.path.join(directory, OPTIMIZER_FILE))


def load(module: nn.Module, directory: str) -> dict[str, Any]:
    """Load the weights into ``module``; returns ``{"optimizer": state dict, "scaler": state dict
    or None}`` for the caller to load (any world size)."""
    load_into(module, read_full_weights(directory))
    return torch.load(os.path.join(directory, OPTIMIZER_FILE), map_location="cpu", weights_only=True)


def full_state_read_bytes(shape, saved) -> tuple[int, int]:
    """What :func:`read_full_state` returns and holds at most (bytes): the replicated fp32
    weights (a tied parameter once) and AdamW's two moments of each trained parameter; nothing
    beside them (``shape``: a :class:`memtrain.memory.shape.ModelShape`; ``saved``: a
    :class:`memtrain.checkpoint.formats.SavedRun`)."""
    read = 4 * shape.parameters + 2 * saved.state_element_bytes * shape.trained
    return read, read


def read_full_state(path: str, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model's weights and the optimizer state keyed by parameter name (the layout of
    ``torch.distributed.checkpoint.state_dict``'s full optimizer state dict), for another engine.

    ``optimizer.pt`` numbers parameters in the order the optimizer was built
    (:func:`memtrain.optim.weight_decay_groups` over the model's parameters); ``module`` (this
    run's model, of the same structure, wrapped or not) gives the names in that order.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    ordered = [names[id(p)] for group in weight_decay_groups(module, 0.0) for p in group["params"]]
    saved = torch.load(os.path.join(path, OPTIMIZER_FILE), map_location="cpu", weights_only=True)["optimizer"]
    optimizer = {"state": {ordered[i]: state for i, state in saved["state"].items()},
                 "param_groups": [{**g, "params": [ordered[i] for i in g["params"]]} for g in saved["param_groups"]]}
    return read_full_weights(path), optimizer


def read_full_weights(path: str) -> dict[str, torch.Tensor]:
    """The replicated weights rank 0 wrote."""
    return load_weights(path)
