"""Checkpoint formats as plugins: a run's engine writes through the format it was handed
(:func:`memtrain.backends.make_backend` gives it its module's ``CHECKPOINT_FORMAT`` unless the
caller names another format that saves the model as that engine holds it, its
``CHECKPOINT_MODEL``, as Lightning Fabric's Strategy takes its ``checkpoint_io``; no engine
imports or names another format), and a checkpoint is read by the format its manifest names
(``checkpoint_format``; a resumed run whose engine writes another one takes the checkpoint's
whole state from it, as from another engine).

Each format is one module of this package (found by scanning the package: :data:`FORMATS`) with:

* ``NAME``: its ``checkpoint_format`` value;
* ``SAVES``: the models it saves, of :data:`MODEL_KINDS` (what an engine's ``checkpoint_state``
  hands it: the engine module's ``CHECKPOINT_MODEL``), so every engine that holds one of them can
  be handed it;
* ``WRITTEN_BY`` (optional): the engine whose manifests meant it before manifests named their
  format (a format newer than that field leaves it out);
* ``PARAMETERS_IN_COMPUTE_DTYPE`` (optional, default False): it saves 16-bit weights under
  bf16/fp16 (:class:`SavedRun`);
* ``save(state, directory, process_group=None, async_save=False) -> Optional[Future]`` and
  ``load(state, directory, process_group=None)``: write and read ``state`` (a
  :class:`CheckpointState`, what the engine holds) in ``directory``; every rank calls them (a
  format decides which rank writes what). ``async_save``: write in the background over
  ``process_group`` and return the future (a format that cannot writes now and returns None);
* ``expected_files(state) -> list[str]``: the glob patterns a complete save of ``state`` holds;
* ``staging_bytes(optimizer_bytes, largest_tensor_bytes=0, async_save=False) -> int``: the host
  bytes a save stages of a rank's ``optimizer_bytes`` of device-resident optimizer state (its
  largest tensor ``largest_tensor_bytes``), for the placement planner's host peak;
* ``read_full_weights(path) -> dict[str, Tensor]``: the whole model's weights (CPU) read in one
  process without a process group (``memtrain export``);
* ``read_full_state(path, module)`` where the format can: the weights and the optimizer state
  keyed by parameter name, for resuming under another engine;
* ``full_state_read_bytes(shape, saved) -> (read_bytes, read_peak_bytes)``: what its
  ``read_full_state`` returns and the most it holds while reading, for a model of ``shape``
  (:class:`memtrain.memory.shape.ModelShape`) saved by the run ``saved`` (:class:`SavedRun`):
  the engine switch's resume moment (:func:`memtrain.memory.moments.switch_resume_bytes`).

A new format is one module here and its tests: nothing else names it (an engine is handed it by
its ``SAVES``, a checkpoint read by the name in its manifest).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import torch
from torch import nn

from memtrain.errors import CheckpointError

FORMATS = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
"""Every format: the modules of this package."""

WHOLE_MODULE = "whole_module"
"""A :class:`CheckpointState`'s model that is the user's module, whole on every rank (DDP)."""
SHARDED_MODULE = "sharded_module"
"""A model whose parameters are DTensors sharded over the ranks (FSDP2's ``fully_shard``)."""
DEEPSPEED_ENGINE = "deepspeed_engine"
"""DeepSpeed's engine, which also holds the optimizer and the loss scaler."""
MODEL_KINDS = (WHOLE_MODULE, SHARDED_MODULE, DEEPSPEED_ENGINE)
"""What an engine's ``CHECKPOINT_MODEL`` and a format's ``SAVES`` name."""


@dataclass(frozen=True)
class CheckpointState:
    """What a format saves and loads: the training state as the engine holds it
    (``checkpoint_state`` of :class:`memtrain.backends.base.Backend`).

    Attributes:
        model: the model as the format reads it: the user's module where every rank holds it
            whole (DDP), the engine's sharded module (FSDP2), DeepSpeed's engine (which also
            holds the optimizer and the loss scaler).
        optimizer: the optimizer the engine steps (None where ``model`` holds it).
        scaler: the fp16 GradScaler (DDP), or None.
        writes: this rank writes the state every rank holds alike (rank 0).
        world_size: the ranks that save or load it.
        zero_stage: DeepSpeed's ZeRO stage (None elsewhere): which files a save holds.
        max_shard_size: the largest weights file a format that shards by size writes
            (``checkpoint.max_shard_size``, e.g. ``"5GB"``).
    """

    model: nn.Module
    optimizer: Any = None
    scaler: Any = None
    writes: bool = True
    world_size: int = 1
    zero_stage: Optional[int] = None
    max_shard_size: str = "5GB"


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
        sharded: the saving engine held the model sharded over its ranks
            (:data:`SHARDED_MODULE`), so each tensor was saved in ``world_size`` pieces; False:
            whole (also where the manifest does not say).
    """

    world_size: int
    zero_stage: Optional[int] = None
    parameter_element_bytes: int = 4
    state_element_bytes: int = 4
    sharded: bool = False

    @classmethod
    def of(cls, manifest: dict) -> "SavedRun":
        """From a manifest (:func:`memtrain.checkpoint.layout.read_manifest`); what it leaves out
        is taken at its largest."""
        config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        dtype = saved_state_dtype(manifest)[1]
        stage = manifest.get("zero_stage")
        name = manifest.get("checkpoint_format") or format_written_by(manifest.get("backend"))
        half = (name in FORMATS and getattr(format_module(name), "PARAMETERS_IN_COMPUTE_DTYPE", False)
                and config.get("precision") in ("bf16", "fp16"))
        return cls(int(manifest.get("world_size") or 1), stage, 2 if half else 4, 2 if dtype == "bf16" else 4,
                   manifest.get("checkpoint_model") == SHARDED_MODULE)


def saved_state_dtype(manifest: dict) -> tuple[Optional[str], str]:
    """``(chosen, dtype)``: the optimizer state dtype a checkpoint's run chose through the planner
    (its manifest's ``engine_spec``; None where the planner did not choose it, or the checkpoint
    predates the spec) and the dtype its state was saved in (that choice, else its config's
    ``optimizer.state_dtype``, else ``fp32``, what memtrain used before the field existed)."""
    chosen = (manifest.get("engine_spec") or {}).get("optimizer_state_dtype")
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    return chosen, chosen or (config.get("optimizer") or {}).get("state_dtype") or "fp32"


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
    if name not in FORMATS:  # also keeps a name from reaching import_module as a path
        raise CheckpointError(f"checkpoint format '{name}' is not one of {', '.join(FORMATS)}")
    return importlib.import_module(f"memtrain.checkpoint.formats.{name}")


def formats_saving(model_kind: str) -> tuple[str, ...]:
    """The formats whose ``SAVES`` hold ``model_kind`` (one of :data:`MODEL_KINDS`): those an
    engine holding that model can be handed."""
    return tuple(name for name in FORMATS if model_kind in format_module(name).SAVES)


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
