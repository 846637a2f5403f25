"""Checkpoint formats as plugins, chosen by the manifest's ``checkpoint_format``.

Each format is one module of this package with:

* ``NAME``: its ``checkpoint_format`` value;
* ``expected_files(world_size, **details) -> list[str]``: the glob patterns a complete save holds;
* ``read_full_weights(path) -> dict[str, Tensor]``: the whole model's weights (CPU) read in one
  process without a process group (``memtrain export``, and an engine switch on resume);
* its own ``save``/``load`` for the objects it stores (the engines call them).

A new format is one module here and its name in :data:`FORMATS`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from memtrain.errors import CheckpointError

FORMATS = ("safetensors", "dcp", "deepspeed")


def format_module(name: str) -> ModuleType:
    """The module of checkpoint format ``name``.

    Raises:
        CheckpointError: an unknown format (names the known ones).
    """
    if name not in FORMATS:
        raise CheckpointError(f"checkpoint format '{name}' is not one of {', '.join(FORMATS)}")
    return importlib.import_module(f"memtrain.checkpoint.formats.{name}")


def read_full_weights(path: str, manifest: dict) -> dict[str, torch.Tensor]:
    """The whole model's weights (CPU) of the verified checkpoint ``path``, read by the format
    its manifest names (:func:`memtrain.checkpoint.manifest.read_manifest` fills it in for
    manifests written before formats were named).

    Raises:
        CheckpointError: the manifest names no known format.
    """
    name = manifest.get("checkpoint_format")
    if name is None:
        raise CheckpointError(f"{path}: its manifest names no checkpoint_format")
    return format_module(name).read_full_weights(path)
