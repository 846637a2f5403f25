"""Checkpoint formats as plugins, chosen by the manifest's ``checkpoint_format``.

Each format is one module of this package with:

* ``NAME``: its ``checkpoint_format`` value;
* ``WRITTEN_BY`` (optional): the engine whose manifests meant it before manifests named their
  format (a format newer than that field leaves it out);
* ``expected_files(world_size, **details) -> list[str]``: the glob patterns a complete save holds;
* ``read_full_weights(path) -> dict[str, Tensor]``: the whole model's weights (CPU) read in one
  process without a process group (``memtrain export``);
* ``read_full_state(path, module)`` where the format can: the weights and the optimizer state
  keyed by parameter name, for resuming under another engine;
* its own ``save``/``load`` for the objects it stores (an engine names the format it writes,
  ``CHECKPOINT_FORMAT`` in its module, and calls them through :func:`format_module`).

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


def format_written_by(engine: str):
    """The format ``engine`` wrote before manifests named their format (each format's
    ``WRITTEN_BY``), or None for an engine no format names."""
    return next((name for name in FORMATS if getattr(format_module(name), "WRITTEN_BY", None) == engine), None)


def read_full_state(path: str, manifest: dict, module) -> tuple[dict[str, torch.Tensor], dict]:
    """``(whole-model weights, full optimizer state keyed by parameter name)`` of checkpoint
    ``path`` for another engine (:meth:`memtrain.backends.base.Backend.load_full_state`);
    ``module`` is this run's model (names the parameters where the format numbers them).

    Raises:
        CheckpointError: the format cannot give its state to another engine yet.
    """
    module_of_format = format_module(manifest.get("checkpoint_format") or "")
    if not hasattr(module_of_format, "read_full_state"):
        raise CheckpointError(f"{path}: a {manifest.get('backend')} checkpoint ({module_of_format.NAME} format) cannot "
                              "be resumed under another engine yet; resume it under "
                              f"backend.name {manifest.get('backend')}, or `memtrain export` its weights")
    return module_of_format.read_full_state(path, module)


def read_full_weights(path: str, manifest: dict) -> dict[str, torch.Tensor]:
    """The whole model's weights (CPU) of the verified checkpoint ``path``, read by the format
    its manifest names (:func:`memtrain.checkpoint.layout.read_manifest` fills it in for
    manifests written before formats were named).

    Raises:
        CheckpointError: the manifest names no known format.
    """
    name = manifest.get("checkpoint_format")
    if name is None:
        raise CheckpointError(f"{path}: its manifest names no checkpoint_format")
    return format_module(name).read_full_weights(path)
