"""Engines behind one interface (:class:`memtrain.backends.base.Backend`): DDP, FSDP2, DeepSpeed.

A registry: each engine is a module ``memtrain.backends.NAME`` that builds its backend and also
answers, without building one: how the model is built for it (``model_build_context``), its
bytes of model state per rank (``state_bytes``, :func:`model_state_bytes`), the placements it
offers (``VARIANTS``), the engine settings that are levers (``SETTINGS``), whether it takes lossy
optimizer state (``LOSSY_OPTIMIZER_STATE``), the config it cannot honour (``validate``) and what
the OOM stop message says of it (``stop_words``, ``stop_advice``), so the planners, validation
and the memory estimate do not branch on engine names. Checkpoint files are written through the
format :func:`make_backend` hands the engine and read by the format their manifest names
(:mod:`memtrain.checkpoint.formats`).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Mapping, Optional

from memtrain.backends.base import Backend
from memtrain.backends.engine import check_engine
from memtrain.checkpoint.formats import format_module, formats_saving
from memtrain.errors import CheckpointError, ConfigError
from memtrain.engine_names import ENGINES
from memtrain.memory.shape import ModelShape

BACKENDS = ENGINES
DEFAULT_ENGINE = "ddp"
"""The engine of ``backend.name auto`` when neither the launcher nor the config names one."""


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
    return DEFAULT_ENGINE


def engine_name(backend) -> str:
    """The engine a ``backend`` section (:class:`memtrain.config.BackendConfig`) runs:
    :func:`infer_backend_name` over every field that decides it."""
    return infer_backend_name(backend.name, backend.deepspeed_config, backend.zero_stage)


def engine_module(name: str) -> ModuleType:
    """The module of engine ``name`` (imported on first use and checked against
    :class:`memtrain.backends.engine.Engine`; DeepSpeed itself is imported only when a DeepSpeed
    engine is built or read).

    Raises:
        ValueError: an unknown engine (names ``backend.name`` and the choices).
        TypeError: the engine's module misses a name it must define.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend.name: '{name}' is not one of {', '.join(BACKENDS)}")
    if name not in _CHECKED:
        _CHECKED[name] = check_engine(importlib.import_module(f"memtrain.backends.{name}"), name)
    return _CHECKED[name]


_CHECKED: dict[str, ModuleType] = {}


def engine_variants(engines: tuple[str, ...] = BACKENDS) -> list:
    """Every :class:`memtrain.backends.spec.EngineVariant` of ``engines``, each engine's own list
    (its module's ``VARIANTS``) in the order of ``engines``: the one list of placements."""
    return [variant for name in engines for variant in engine_module(name).VARIANTS]


def model_state_bytes(engine: str, n_params: int, precision: str, zero_stage: Optional[int] = None,
                      offload: str = "none", world_size: int = 1, offload_optimizer_ratio: float = 1.0,
                      offload_device: str = "cpu", shape: Optional[ModelShape] = None,
                      zero_settings: Optional[Mapping[str, int]] = None, state_dtype: str = "fp32",
                      deferred_reduction: bool = True) -> dict[str, int]:
    """Per-rank bytes of model state for AdamW training under ``engine``: its module's
    ``state_bytes`` (the formulas of :mod:`memtrain.memory.accounting`, ZeRO's of
    :mod:`memtrain.memory.zero_accounting`; ``zero_stage``,
    ``offload_optimizer_ratio``, ``offload_device`` and ``zero_settings`` are DeepSpeed's).

    Args:
        shape: the model's element counts (None: ``ModelShape(n_params)``, no blocks, nothing small).
        state_dtype: ``optimizer.state_dtype`` (DDP and FSDP2; :func:`adam_state_bytes`).
        deferred_reduction: DDP all-reduces after backward (``memory.oom_recovery`` on), not in it.
        zero_settings: DeepSpeed's ``zero_optimization`` buffer sizes in elements where the run's
            config sets them (the user's JSON); the rest are :func:`deepspeed_buffer_settings`.

    Returns:
        ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` and ``buffer_bytes`` (the
        engine's own buffers: ZeRO's reduce bucket and gathered parameters, DDP's gradient
        buckets) on the accelerator (:data:`DEVICE_STATE_KEYS`), ``accumulation_gradient_bytes``
        more on the device while micro-batches accumulate (a plan with gradient accumulation > 1:
        FSDP2's unsharded gradients), ``step_gradient_bytes`` on the device from the end of the
        last backward to the optimizer step, when the activations are freed (ZeRO-2/3's whole
        gradients, DDP's deferred all-reduce bucket: a peak is state + the larger of the
        activations and these),
        ``cpu_offloaded_bytes`` in host memory (``accumulation_host_bytes`` more in plans that
        accumulate: ZeRO-1/2 offload) and
        ``nvme_offloaded_bytes`` in NVMe files (all per rank); DeepSpeed's also the offloaded
        bytes (host and NVMe together) by component: ``offloaded_parameter_bytes``,
        ``offloaded_gradient_bytes``, ``offloaded_optimizer_bytes``, ``offloaded_buffer_bytes``
        (their sum is the two above), ``step_whole_gradient_bytes``, the transient in
        ``step_gradient_bytes`` (the whole gradients' bytes again, or in 16-bit the fp32 copy of
        the gradient partition, the larger), ``step_reduce_copy_bytes``, ZeRO-3's copy of its reduce bucket in
        it, and ``gathered_parameter_bytes``, ZeRO-3's gathered parameters of ``buffer_bytes``
        (``benchmarks/placement_accuracy.py`` compares the components with the tensors DeepSpeed
        holds; these three are peaks inside the step, which MemTracker checks).

    Raises:
        ValueError: an unknown engine.
    """
    return engine_module(engine).state_bytes(
        n_params, precision, zero_stage=zero_stage, offload=offload, world_size=world_size,
        offload_optimizer_ratio=offload_optimizer_ratio, offload_device=offload_device,
        shape=shape or ModelShape(n_params), zero_settings=zero_settings, state_dtype=state_dtype,
        deferred_reduction=deferred_reduction)


def run_format(engine: str, chosen: str) -> str:
    """The name of the checkpoint format a run of engine ``engine`` writes (and reads its own
    checkpoints with) under ``checkpoint.format`` ``chosen``: that one, or under ``auto`` the
    engine's own (its module's ``CHECKPOINT_FORMAT``)."""
    return engine_module(engine).CHECKPOINT_FORMAT if chosen == "auto" else chosen


def writes_format(cfg, engine: str) -> bool:
    """Whether engine ``engine`` can be handed ``cfg.checkpoint.format`` (``auto``, its own: always):
    a known format whose ``SAVES`` holds the model as the engine holds it (its module's
    ``CHECKPOINT_MODEL``). Imports that one format only."""
    try:
        return engine_module(engine).CHECKPOINT_MODEL in format_module(run_format(engine, cfg.checkpoint.format)).SAVES
    except CheckpointError:  # a format no module of memtrain/checkpoint/formats/ is named
        return False


def check_writes_format(cfg, engine: str, why: str = "") -> None:
    """Refuse ``cfg.checkpoint.format`` when engine ``engine`` cannot write it (:func:`writes_format`);
    ``why``: the words after the engine's name saying why that engine runs.

    Raises:
        memtrain.errors.ConfigError: on ``checkpoint.format``, naming ``auto`` and every format
            that saves the engine's model.
    """
    if not writes_format(cfg, engine):
        writable = ", ".join(formats_saving(engine_module(engine).CHECKPOINT_MODEL))
        raise ConfigError("checkpoint.format", f"'{cfg.checkpoint.format}' cannot be written by engine {engine}"
                          f"{why}: choose auto or {writable}")


def make_backend(cfg, spec, process, precision: str, plan) -> Backend:
    """Build the engine ``spec`` (a :class:`memtrain.backends.spec.EngineSpec`) for ``cfg`` (a
    :class:`memtrain.config.Config`) on ``process`` (a :class:`memtrain.distributed.ProcessState`),
    starting with micro-batch ``plan``, and hand it the checkpoint format it writes through
    (``checkpoint_io``, as Lightning Fabric's Strategy takes its ``checkpoint_io``): the module of
    ``cfg.checkpoint.format`` (:func:`run_format`), whose ``SAVES`` holds the model as the engine
    holds it.

    Raises:
        ValueError: unknown engine or an option the engine cannot honour (message names the field).
        memtrain.errors.ConfigError: a DeepSpeed JSON contradicting the memtrain config, or a
            ``checkpoint.format`` the engine cannot write (:func:`check_writes_format`).
    """
    check_writes_format(cfg, spec.name)
    module = engine_module(spec.name)
    backend = module.build(cfg, spec, process, precision, plan)
    backend.checkpoint_io = format_module(run_format(spec.name, cfg.checkpoint.format))
    backend.checkpoint_model = module.CHECKPOINT_MODEL
    return backend


def model_build_context(cfg, spec, precision: str, world_size: int, python_function: bool = False):
    """The context the model is built in for the engine ``spec`` (DeepSpeed ZeRO-3 with
    ``model.pretrained``, or with a Python caller's model function (``python_function``): built
    already partitioned; else none)."""
    return engine_module(spec.name).model_build_context(cfg, spec, precision, world_size, python_function)

