"""Whole-model weights as safetensors files: write (sharded with an index past a size threshold,
as transformers' ``save_pretrained`` does), read back, and load into a module.

The file layout is huggingface_hub's (``model.safetensors``, or ``model-00001-of-00003.safetensors``
… plus ``model.safetensors.index.json``), written by ``huggingface_hub.save_torch_state_dict``;
tied weights (GPT-2's ``lm_head.weight`` = ``transformer.wte.weight``) are stored once.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def save_weights(state_dict: dict[str, torch.Tensor], directory: str, max_shard_size: str = "5GB") -> list[str]:
    """Write ``state_dict`` into ``directory`` as safetensors (sharded when larger than
    ``max_shard_size``, e.g. ``"5GB"`` or ``"500MB"``).

    Args:
        state_dict: name → tensor on CPU (any dtype); tensors sharing storage are written once.
        directory: existing directory.
        max_shard_size: largest shard (bytes as a string with a unit, or an int of bytes).

    Returns:
        The file names written (relative to ``directory``).
    """
    from huggingface_hub import save_torch_state_dict

    before = set(os.listdir(directory))
    save_torch_state_dict({k: v.detach().cpu() for k, v in state_dict.items()}, directory,
                          max_shard_size=max_shard_size)
    return sorted(set(os.listdir(directory)) - before)


def share_tied(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with the names of each parameter ``module`` ties (one parameter under two
    names: GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) pointing at one tensor, the
    first name's, so the files store it once however the engine gathered it (FSDP2's full state
    dict gives each name a copy of its own). Names are the state dict's (a compiled module's
    ``_orig_mod.`` left out); ``state_dict`` itself is not changed."""
    first: dict[int, str] = {}
    shared = dict(state_dict)
    for name, param in module.named_parameters(remove_duplicate=False):
        name = name.replace("_orig_mod.", "")
        head = first.setdefault(id(param), name)
        if head != name and head in shared and name in shared:
            shared[name] = shared[head]
    return shared


def weight_files(directory: str) -> list[str]:
    """The safetensors files of a weights directory (the index's shards, or the single file).

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor its index is there, or the index
            names a shard that is missing.
    """
    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
        for name in shards:
            if not os.path.exists(os.path.join(directory, name)):
                raise FileNotFoundError(f"{os.path.join(directory, name)} (named in {INDEX_NAME}) is missing")
        return shards
    if os.path.exists(os.path.join(directory, SINGLE_NAME)):
        return [SINGLE_NAME]
    raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {directory}")


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """Read all weights of a directory written by :func:`save_weights` (CPU tensors)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in weight_files(directory):
        state.update(load_file(os.path.join(directory, name)))
    return state


def load_into(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``module`` exactly (no dtype surprises: values are copied into the
    module's tensors).

    A key may be missing only when its tensor is tied to (shares storage with) one that is
    present, since tied weights are stored once.

    Raises:
        KeyError: names of unexpected keys, or of missing keys that are not tied to a loaded one.
    """
    own = module.state_dict(keep_vars=True)
    unexpected = sorted(set(state_dict) - set(own))
    loaded_ptrs = {own[k].data_ptr() for k in state_dict if k in own}
    missing = sorted(k for k in set(own) - set(state_dict) if own[k].data_ptr() not in loaded_ptrs)
    if unexpected or missing:
        raise KeyError(f"weights do not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
    with torch.no_grad():
        for key, value in state_dict.items():
            own[key].copy_(value)
