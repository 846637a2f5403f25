"""What an engine module must define: the registry checks it when the module is first loaded
(:func:`memtrain.backends.engine_module`), so an engine that misses a name the planner, the
validation or the OOM message asks for fails by name at once, not in the middle of a plan.

An engine is a module ``memtrain.backends.NAME`` (its name in :data:`memtrain.engine_names.ENGINES`)
satisfying :class:`Engine`; one whose ``VARIANTS`` offload state also satisfies
:class:`OffloadingEngine` (:class:`NvmeEngine` too where one offloads to NVMe files), and one that
takes lossy optimizer state :class:`LossyStateEngine`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Protocol, runtime_checkable

from memtrain.checkpoint.formats import MODEL_KINDS, format_module


@runtime_checkable
class Engine(Protocol):
    """The names every engine module defines (see :mod:`memtrain.backends.ddp` for their meaning).

    Attributes:
        CHECKPOINT_FORMAT: the checkpoint format it writes unless handed another
            (:func:`memtrain.backends.make_backend`).
        CHECKPOINT_MODEL: the model its ``checkpoint_state`` hands a format, one of
            :data:`memtrain.checkpoint.formats.MODEL_KINDS`: it can be handed every format whose
            ``SAVES`` holds it.
        VARIANTS: its placements (:class:`memtrain.backends.spec.EngineVariant`).
        LOSSY_OPTIMIZER_STATE: it takes bf16/int8 optimizer state.
        SHARDS_OPTIMIZER_STATE: each rank holds a shard of the optimizer state.
        SETTINGS: its engine settings that are levers (:mod:`memtrain.levers.engine_settings`).
        READS_DEEPSPEED_CONFIG: ``backend.deepspeed_config`` sets its stage and offload.
        AUTOCAST_MIXED_PRECISION: its bf16/fp16 is Accelerate's autocast (fp32 parameters, each
            matrix cast on use), not parameters held in the compute dtype — how the planner's
            trace computes (:func:`memtrain.memory.step_trace.compute_precision_model`).
        STEPS_USER_OPTIMIZER: it steps a Python caller's optimizer (``optimizer_factory``) as it
            is where nothing is offloaded (:func:`memtrain.validation.check_user_optimizer_placement`).
        OWN_OPTIMIZER: where it steps an optimizer of its own instead (words for the refusal; ``""``
            where nowhere).
        ASYNC_SAVE: its save can write in the background under ``checkpoint.async_save`` (its
            backend's ``supports_async_save``; the placement planner stages what such a save copies).
    """

    CHECKPOINT_FORMAT: str
    CHECKPOINT_MODEL: str
    VARIANTS: tuple
    LOSSY_OPTIMIZER_STATE: bool
    SHARDS_OPTIMIZER_STATE: bool
    SETTINGS: tuple
    READS_DEEPSPEED_CONFIG: bool
    AUTOCAST_MIXED_PRECISION: bool
    STEPS_USER_OPTIMIZER: bool
    OWN_OPTIMIZER: str
    ASYNC_SAVE: bool
    build: Callable[..., Any]
    model_build_context: Callable[..., Any]
    state_bytes: Callable[..., dict]
    validate: Callable[[Any], None]
    variant_label: Callable[[Any], str]
    stop_words: Callable[..., str]
    stop_advice: Callable[..., str]
    takes_selective_checkpointing: Callable[..., bool]
    export_bytes_per_parameter: Callable[..., int]


@runtime_checkable
class OffloadingEngine(Protocol):
    """What an engine with offloading placements adds: the host share of the optimizer state it can
    hold for a ratio asked for, and the seconds a step of an offloading placement spends beyond
    the device's compute."""

    offload_ratio: Callable[..., float]
    offload_seconds: Callable[..., Any]


@runtime_checkable
class NvmeEngine(Protocol):
    """What an engine with a placement in NVMe files (a variant with ``nvme``) adds: whether its
    file I/O can run on this machine, asked by the placement planner before it offers one."""

    nvme_available: Callable[[], bool]


@runtime_checkable
class LossyStateEngine(Protocol):
    """What an engine that takes lossy optimizer state adds: AdamW's moments per rank in each dtype."""

    optimizer_state_bytes: Callable[..., int]


def check_engine(module: ModuleType, name: str) -> ModuleType:
    """``module`` if it defines what engine ``name`` must.

    Raises:
        TypeError: naming the engine and every missing name.
    """
    required = [Engine]
    if any(v.offload != "none" for v in getattr(module, "VARIANTS", ())):
        required.append(OffloadingEngine)
    if any(v.nvme for v in getattr(module, "VARIANTS", ())):
        required.append(NvmeEngine)
    if getattr(module, "LOSSY_OPTIMIZER_STATE", False):
        required.append(LossyStateEngine)
    missing = [member for protocol in required for member in protocol.__annotations__ if not hasattr(module, member)]
    if missing:
        raise TypeError(f"engine '{name}' ({module.__name__}) does not define {', '.join(missing)} "
                        "(memtrain/backends/engine.py)")
    if module.CHECKPOINT_MODEL not in MODEL_KINDS:
        raise TypeError(f"engine '{name}': CHECKPOINT_MODEL {module.CHECKPOINT_MODEL!r} is not one of "
                        f"{', '.join(MODEL_KINDS)}")
    if module.CHECKPOINT_MODEL not in format_module(module.CHECKPOINT_FORMAT).SAVES:
        raise TypeError(f"engine '{name}': its CHECKPOINT_FORMAT {module.CHECKPOINT_FORMAT!r} does not save its "
                        f"CHECKPOINT_MODEL {module.CHECKPOINT_MODEL!r}")
    return module
