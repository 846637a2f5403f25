"""Engines behind one interface (:class:`memtrain.backends.base.Backend`): DDP, FSDP2, DeepSpeed.

A registry: each engine is a module ``memtrain.backends.NAME`` that builds its backend and also
answers, without building one, "how is the model built for me", "bytes of model state per rank"
and "which placements do I offer" (``VARIANTS``), so the planners and the memory estimate never
branch on engines. Checkpoint files are read by their format (:mod:`memtrain.checkpoint.formats`).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

from memtrain.backends.base import Backend

BACKENDS = ("ddp", "fsdp", "deepspeed")


def env_true(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1/true/yes."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def infer_backend_name(requested: str, deepspeed_config: Optional[str] = None, zero_stage: Optional[int] = None) -> str:
    """Resolve ``backend.name``. ``auto`` follows the launcher: ``accelerate launch`` with an FSDP
    config (``ACCELERATE_USE_FSDP``) → fsdp; with a DeepSpeed config (``ACCELERATE_USE_DEEPSPEED``)
    or the DeepSpeed launcher's ``--deepspeed FILE`` → deepspeed; otherwise DeepSpeed when the
    config names a ``backend.zero_stage`` (a DeepSpeed setting), else ddp."""
    if requested != "auto":
        return requested
    if env_true("ACCELERATE_USE_FSDP"):
        return "fsdp"
    if deepspeed_config or zero_stage is not None or env_true("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    return "ddp"


def engine_name(backend) -> str:
    """The engine a ``backend`` section (:class:`memtrain.config.BackendConfig`) runs:
    :func:`infer_backend_name` over every field that decides it."""
    return infer_backend_name(backend.name, backend.deepspeed_config, backend.zero_stage)


def engine_module(name: str) -> ModuleType:
    """The module of engine ``name`` (imported on first use; DeepSpeed itself is imported only
    when a DeepSpeed engine is built or read).

    Raises:
        ValueError: an unknown engine (names ``backend.name`` and the choices).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend.name: '{name}' is not one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"memtrain.backends.{name}")


def engine_variants(engines: tuple[str, ...] = BACKENDS) -> list:
    """Every :class:`memtrain.backends.spec.EngineVariant` of ``engines``, each engine's own list
    (its module's ``VARIANTS``) in the order of ``engines``: the one list of placements."""
    return [variant for name in engines for variant in engine_module(name).VARIANTS]


def make_backend(cfg, spec, process, precision: str, plan) -> Backend:
    """Build the engine ``spec`` (a :class:`memtrain.backends.spec.EngineSpec`) for ``cfg`` (a
    :class:`memtrain.config.Config`) on ``process`` (a :class:`memtrain.distributed.ProcessState`),
    starting with micro-batch ``plan``.

    Raises:
        ValueError: unknown engine or an option the engine cannot honour (message names the field).
        memtrain.config.ConfigError: a DeepSpeed JSON contradicting the memtrain config.
    """
    return engine_module(spec.name).build(cfg, spec, process, precision, plan)


def model_build_context(cfg, spec, precision: str, world_size: int, python_function: bool = False):
    """The context the model is built in for the engine ``spec`` (DeepSpeed ZeRO-3 with
    ``model.pretrained``, or with a Python caller's model function (``python_function``): built
    already partitioned; else none)."""
    return engine_module(spec.name).model_build_context(cfg, spec, precision, world_size, python_function)

