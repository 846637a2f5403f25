"""Format ``safetensors``: replicated weights written once by rank 0 as safetensors (sharded past
``checkpoint.max_shard_size``, huggingface_hub's layout: :mod:`memtrain.weights`) and
``optimizer.pt`` with the optimizer's state and the fp16 GradScaler's (DDP)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from memtrain.checkpoint.formats import WHOLE_MODULE
from memtrain.optim import weight_decay_groups
from memtrain.weights import load_into, load_weights, save_weights

NAME = "safetensors"
SAVES = (WHOLE_MODULE,)
"""The models it saves (:data:`memtrain.checkpoint.formats.MODEL_KINDS`)."""
WRITTEN_BY = "ddp"
"""The engine whose manifests meant this format before manifests named their format."""
OPTIMIZER_FILE = "optimizer.pt"


def staging_bytes(optimizer_bytes: int, largest_tensor_bytes: int = 0, async_save: bool = False) -> int:
    """Host bytes a save stages of ``optimizer_bytes`` of device-resident optimizer state: all of it
    (rank 0 hands ``torch.save`` the whole optimizer state dict, copied to the CPU first;
    ``largest_tensor_bytes`` and ``async_save``, a save written now either way, unused)."""
    return optimizer_bytes


def expected_files(state) -> list[str]:
    """Glob patterns a complete save holds (the same for any world size: nothing is sharded)."""
    return ["model*.safetensors", OPTIMIZER_FILE]


def save(state, directory: str, process_group=None, async_save: bool = False) -> None:
    """The writing rank (``state.writes``) writes the module's weights (sharded past
    ``state.max_shard_size``) and the optimizer (and GradScaler) state into ``directory``; the
    other ranks write nothing (``state``: a :class:`memtrain.checkpoint.formats.CheckpointState`
    whose model every rank holds whole). Written now, whatever ``async_save``."""
    if not state.writes:
        return None
    save_weights(state.model.state_dict(), directory, state.max_shard_size)
    torch.save({"optimizer": state.optimizer.state_dict(),
                "scaler": state.scaler.state_dict() if state.scaler is not None else None},
               os.path.join(directory, OPTIMIZER_FILE))
    return None


def load(state, directory: str, process_group=None) -> None:
    """Every rank loads the weights into ``state.model`` and the optimizer (and GradScaler) state
    (any saved world size). A GradScaler the checkpoint has none of starts afresh."""
    load_into(state.model, read_full_weights(directory))
    saved = torch.load(os.path.join(directory, OPTIMIZER_FILE), map_location="cpu", weights_only=True)
    state.optimizer.load_state_dict(saved["optimizer"])
    if state.scaler is not None and saved["scaler"] is not None:
        state.scaler.load_state_dict(saved["scaler"])


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
