"""The engine a run trains with, resolved once and frozen: :class:`EngineSpec`.

The config says what the user asked for (``backend.name: auto``, ``backend.offload: auto``, a
DeepSpeed JSON); the spec says what the run does, after the launcher's settings, the DeepSpeed
JSON and the placement planner (``backend.offload auto``, or the placement a resumed run's
checkpoint was written with) have been taken into account. The config is never written back:
engines, the model build context, checkpoints and ``summary.json`` read the spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from memtrain.backends import engine_name


@dataclass(frozen=True)
class EngineSpec:
    """A run's resolved engine.

    Attributes:
        name: ``ddp``, ``fsdp`` or ``deepspeed`` (never ``auto``).
        zero_stage: the DeepSpeed ZeRO stage given by the config or the placement (None: the
            DeepSpeed JSON's, else 2; None outside DeepSpeed).
        offload: ``none``, ``optimizer`` or ``optimizer_and_params``; None = the DeepSpeed JSON's.
        offload_optimizer_ratio: the fraction of the optimizer state on the host (ZeRO-3).
        nvme_path: NVMe offload folder, or None.
        deepspeed_config: the user's DeepSpeed JSON path, or None.
        reshard_after_forward: FSDP2's resharding after forward.
        find_unused_parameters: DDP's ``auto|true|false``.
        world_size, rank: the process group's.
        data_parallel_size, data_parallel_rank: the ranks the global batch is split over (equal
            to ``world_size`` and ``rank`` until tensor parallelism exists).
        optimizer_state_dtype: the AdamW moments' dtype the placement planner chose
            (``memory.allow_lossy_levers``) or a resumed run kept; None = ``optimizer.state_dtype``.
    """

    name: str
    zero_stage: Optional[int] = None
    offload: Optional[str] = None
    offload_optimizer_ratio: float = 1.0
    nvme_path: Optional[str] = None
    deepspeed_config: Optional[str] = None
    reshard_after_forward: bool = True
    find_unused_parameters: str = "auto"
    world_size: int = 1
    rank: int = 0
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    optimizer_state_dtype: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``summary.json``'s ``engine_spec``, checkpoint manifests)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineVariant:
    """One way an engine can hold model state: a row of the placement table (``backend.offload
    auto``, ``memtrain plan``) and of ``memtrain memory``'s model-state report. Each engine module
    lists its own (``VARIANTS``); :func:`memtrain.backends.engine_variants` joins them.

    Attributes:
        name: the report's key (``ddp``, ``zero3_offload_optimizer``, ...).
        engine: ``ddp``, ``fsdp`` or ``deepspeed``.
        zero_stage: DeepSpeed's ZeRO stage (None elsewhere).
        offload: ``none``, ``optimizer`` or ``optimizer_and_params``.
        offload_optimizer_ratio: the fraction of the optimizer state on the host.
        tune_ratio: partial offload whose fraction the placement planner chooses.
        nvme: the offloaded state lives in files (``backend.nvme_path``).
        state_dtypes: the ``optimizer.state_dtype`` settings it takes (empty: every one its engine takes).
    """

    name: str
    engine: str
    zero_stage: Optional[int] = None
    offload: str = "none"
    offload_optimizer_ratio: float = 1.0
    tune_ratio: bool = False
    nvme: bool = False
    state_dtypes: tuple = ()


PLACEMENT_FIELDS = ("name", "zero_stage", "offload", "offload_optimizer_ratio", "nvme_path")
"""The fields a placement (``backend.offload auto``, or a checkpoint's) decides."""


def resolve_engine(backend_cfg, world_size: int, rank: int, placement: Optional[dict] = None) -> EngineSpec:
    """The run's engine from the ``backend`` section, with the placement's fields over it.

    Args:
        backend_cfg: the validated :class:`memtrain.config.BackendConfig` (not changed).
        world_size, rank: the process group's.
        placement: :data:`PLACEMENT_FIELDS` chosen by the placement planner or kept from the
            checkpoint being resumed, and ``optimizer_state_dtype`` where the planner chose one
            (``memory.allow_lossy_levers``); None = the config's own.
    """
    b = backend_cfg
    fields = {"name": engine_name(b), "zero_stage": b.zero_stage,
              "offload": None if b.offload == "auto" else b.offload, "offload_optimizer_ratio": b.offload_optimizer_ratio,
              "nvme_path": b.nvme_path}
    if placement is not None:
        fields.update({k: placement[k] for k in PLACEMENT_FIELDS if k in placement})
    if fields["name"] != "deepspeed":
        fields["zero_stage"] = None
    return EngineSpec(**fields, deepspeed_config=b.deepspeed_config, reshard_after_forward=b.reshard_after_forward,
                      find_unused_parameters=b.find_unused_parameters, world_size=world_size, rank=rank,
                      data_parallel_size=world_size, data_parallel_rank=rank,
                      optimizer_state_dtype=(placement or {}).get("optimizer_state_dtype"))


def backend_view(backend_cfg, spec: EngineSpec):
    """A copy of the ``backend`` section with the spec's resolved fields (for code that plans
    from a config, such as the placement table); the run's own config is left as it is."""
    return dataclasses.replace(backend_cfg, **{k: getattr(spec, k) for k in PLACEMENT_FIELDS})
