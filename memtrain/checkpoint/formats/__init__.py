"""Checkpoint formats as plugins, chosen by the manifest's ``checkpoint_format``.

Each format is one module of this package with:

* ``NAME``: its ``checkpoint_format`` value;
* ``WRITTEN_BY`` (optional): the engine whose manifests meant it before manifests named their
  format (a format newer than that field leaves it out);
* ``PARAMETERS_IN_COMPUTE_DTYPE`` (optional, default False): it saves 16-bit weights under
  bf16/fp16 (:class:`SavedRun`);
* ``expected_files(world_size, **details) -> list[str]``: the glob patterns a complete save holds;
* ``read_full_weights(path) -> dict[str, Tensor]``: the whole model's weights (CPU) read in one
  process without a process group (``memtrain export``);
* ``read_full_state(path, module)`` where the format can: the weights and the optimizer state
  keyed by parameter name, for resuming under another engine;
* ``full_state_read_bytes(shape, saved) -> (read_bytes, read_peak_bytes)``: what its
  ``read_full_state`` returns and the most it holds while reading, for a model of ``shape``
  (:class:`memtrain.memory.shape.ModelShape`) saved by the run ``saved`` (:class:`SavedRun`):
  the engine switch's resume moment (:func:`memtrain.memory.moments.switch_resume_bytes`);
* its own ``save``/``load`` for the objects it stores (an engine names the format it writes,
  ``CHECKPOINT_FORMAT`` in its module, and calls them through :func:`format_module`).

A new format is one module here and its name in :data:`FORMATS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

from memtrain.errors import CheckpointError

FORMATS = ("safetensors", "dcp", "deepspeed")


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint's manifest says of the run that wrote it, for its format's read sizes.

    Attributes:
        world_size: the ranks that wrote it.
        zero_stage: DeepSpeed's ZeRO stage (None: not DeepSpeed).
        parameter_element_bytes: bytes per element of the module's parameters as saved (2 under
            bf16/fp16 where the format saves them as the engine holds them, its module's
            ``PARAMETERS_IN_COMPUTE_DTYPE``, else 4; unknown: 4).
        state_element_bytes: bytes per element of each AdamW moment (4 fp32, 2 bf16).
    """

    world_size: int
    zero_stage: Optional[int] = None
    parameter_element_bytes: int = 4
    state_element_bytes: int = 4

    @classmethod
    def of(cls, manifest: dict) -> "SavedRun":
        """From a manifest (:func:`memtrain.checkpoint.layout.read_manifest`); what it leaves out
        is taken at its largest."""
        config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        spec = manifest.get("engine_spec") or {}
        dtype = spec.get("optimizer_state_dtype") or (config.get("optimizer") or {}).get("state_dtype", "fp32")
        stage = manifest.get("zero_stage")
        name = manifest.get("checkpoint_format") or format_written_by(manifest.get("backend"))
        half = (name in FORMATS and getattr(format_module(name), "PARAMETERS_IN_COMPUTE_DTYPE", False)
                and config.get("precision") in ("bf16", "fp16"))
        return cls(int(manifest.get("world_size") or 1), stage, 2 if half else 4, 2 if dtype == "bf16" else 4)


def full_state_read_bytes(manifest: dict, shape) -> tuple[int, int]:
    """``(read_bytes, read_peak_bytes)`` of :func:`read_full_state` for checkpoint ``manifest`` and
    a model of ``shape`` (its format's ``full_state_read_bytes``).

    Raises:
        CheckpointError: the manifest names no known format.
    """
    return format_module(manifest.get("checkpoint_format") or "").full_state_read_bytes(shape, SavedRun.of(manifest))


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
    if not engine:
        return None
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
