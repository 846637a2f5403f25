"""The engine a run trains with, resolved once and frozen: :class:`EngineSpec`.

The config says what the user asked for (``backend.name: auto``, ``backend.offload: auto``, a
DeepSpeed JSON); the spec says what the run does, after the launcher's settings, the DeepSpeed
JSON and the placement planner (``backend.offload auto``, or the placement a resumed run's
checkpoint was written with) have been taken into account. The config is never written back:
engines, the model build context, checkpoints and ``summary.json`` read the spec.

The user's DeepSpeed JSON is read in one place, :func:`configured_engine`: its stage, offload
and buffer sizes are folded into what the ``backend`` section configures, so no field of a spec
means "whatever the JSON says".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from memtrain.backends import engine_module, engine_name
from memtrain.backends.ds_config import (get_path, offload_in_json, read_user_json, resolve_zero_stage,
                                         zero_buffer_settings)


@dataclass(frozen=True)
class ConfiguredEngine:
    """What a ``backend`` section configures, with its DeepSpeed JSON folded in (the engines that
    read one: ``READS_DEEPSPEED_CONFIG``; the others ignore it).

    Attributes:
        name: the engine (:func:`memtrain.backends.engine_name`; never ``auto``).
        zero_stage: ``backend.zero_stage``, else the JSON's stage (1, 2 or 3); None = left open
            (DeepSpeed's default, 2, when a run builds it; every stage for the placement planner).
        offload: ``backend.offload`` (``auto`` included), else the JSON's (``none`` without one).
        json_offload: the JSON's own offload (``none`` without one).
        offload_optimizer_ratio: ``backend.offload_optimizer_ratio`` where it is not 1.0, else the JSON's.
        offload_device: ``nvme`` where ``backend.nvme_path`` or the JSON offloads to files, else ``cpu``.
        zero_settings: the ``zero_optimization`` buffer sizes and in-place flags the JSON sets
            (:func:`memtrain.backends.ds_config.zero_buffer_settings`; elements, or 1/0).
        deepspeed_json: the JSON itself ({} without one, or for another engine).

    Raises (from :func:`configured_engine`):
        memtrain.config.ConfigError: the JSON cannot be read or parsed (``backend.deepspeed_config``).
    """

    name: str
    zero_stage: Optional[int]
    offload: str
    json_offload: str
    offload_optimizer_ratio: float
    offload_device: str
    zero_settings: Mapping[str, int]
    deepspeed_json: Mapping[str, Any]

    @property
    def built_zero_stage(self) -> Optional[int]:
        """The stage a DeepSpeed run builds (:attr:`zero_stage`, else 2; a JSON's ``auto`` is 2);
        None on another engine."""
        if not engine_module(self.name).READS_DEEPSPEED_CONFIG:
            return None
        return resolve_zero_stage(self.zero_stage, dict(self.deepspeed_json))


def configured_engine(backend_cfg) -> ConfiguredEngine:
    """The one reader of the user's DeepSpeed JSON: what ``backend_cfg`` (a
    :class:`memtrain.config.BackendConfig`) configures, the JSON folded in (:class:`ConfiguredEngine`).

    Raises:
        memtrain.config.ConfigError: ``backend.deepspeed_config`` cannot be read or parsed.
    """
    b = backend_cfg
    name = engine_name(b)
    user = read_user_json(b.deepspeed_config) if engine_module(name).READS_DEEPSPEED_CONFIG else {}
    json_offload, json_ratio, json_nvme = offload_in_json(user)
    json_stage = get_path(user, "zero_optimization.stage")
    return ConfiguredEngine(
        name=name, zero_stage=b.zero_stage if b.zero_stage is not None else json_stage if json_stage in (1, 2, 3) else None,
        offload=b.offload if b.offload is not None else json_offload, json_offload=json_offload,
        offload_optimizer_ratio=b.offload_optimizer_ratio if b.offload_optimizer_ratio != 1.0 else json_ratio,
        offload_device="nvme" if b.nvme_path or json_nvme else "cpu",
        zero_settings=zero_buffer_settings(get_path(user, "zero_optimization") or {}), deepspeed_json=user)


def user_zero_settings(cfg) -> dict[str, int]:
    """The ``zero_optimization`` buffer sizes and in-place flags the run's DeepSpeed JSON sets
    (:attr:`ConfiguredEngine.zero_settings`; {} without one, or on another engine), counted by
    the plan as the engine counts them."""
    return dict(configured_engine(cfg.backend).zero_settings)


@dataclass(frozen=True)
class EngineSpec:
    """A run's resolved engine.

    Attributes:
        name: ``ddp``, ``fsdp`` or ``deepspeed`` (never ``auto``).
        zero_stage: the DeepSpeed ZeRO stage the engine builds: the placement's, the config's, the
            DeepSpeed JSON's, else 2 (None outside DeepSpeed).
        offload: ``none``, ``optimizer`` or ``optimizer_and_params``: the placement's, the config's,
            else the DeepSpeed JSON's (``none`` before ``backend.offload auto`` has chosen).
        offload_optimizer_ratio: the fraction of the optimizer state on the host (the JSON's where
            the config leaves it at 1.0).
        nvme_path: NVMe offload folder, or None.
        deepspeed_config: the user's DeepSpeed JSON path, or None.
        deepspeed_json: that JSON as read ({} without one; not in :meth:`as_dict`).
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
    deepspeed_json: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``summary.json``'s ``engine_spec``, checkpoint manifests; not the JSON)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "deepspeed_json"}

    def with_placement(self, placement: Mapping[str, Any]) -> "EngineSpec":
        """This spec with ``placement``'s :data:`PLACEMENT_FIELDS` over it (chosen by the placement
        planner or kept from the checkpoint being resumed) and its ``optimizer_state_dtype``
        (None where it has none). A DeepSpeed placement without a stage builds the JSON's, else 2."""
        fields = {k: placement[k] for k in PLACEMENT_FIELDS if k in placement}
        reads_json = engine_module(fields.get("name", self.name)).READS_DEEPSPEED_CONFIG
        stage = fields.get("zero_stage", self.zero_stage)
        fields["zero_stage"] = resolve_zero_stage(stage, dict(self.deepspeed_json)) if reads_json else None
        return dataclasses.replace(self, **fields, optimizer_state_dtype=placement.get("optimizer_state_dtype"))


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
            (``memory.allow_lossy_levers``; :meth:`EngineSpec.with_placement`); None = the config's own.

    Raises:
        memtrain.config.ConfigError: the DeepSpeed JSON cannot be read (:func:`configured_engine`).
    """
    b, c = backend_cfg, configured_engine(backend_cfg)
    spec = EngineSpec(name=c.name, zero_stage=c.built_zero_stage,
                      offload=c.json_offload if c.offload == "auto" else c.offload,
                      offload_optimizer_ratio=c.offload_optimizer_ratio, nvme_path=b.nvme_path,
                      deepspeed_config=b.deepspeed_config, reshard_after_forward=b.reshard_after_forward,
                      find_unused_parameters=b.find_unused_parameters, world_size=world_size, rank=rank,
                      data_parallel_size=world_size, data_parallel_rank=rank, deepspeed_json=c.deepspeed_json)
    return spec.with_placement(placement) if placement is not None else spec


def backend_view(backend_cfg, spec: EngineSpec):
    """A copy of the ``backend`` section with the spec's resolved fields (for code that plans
    from a config, such as the placement table); the run's own config is left as it is."""
    return dataclasses.replace(backend_cfg, **{k: getattr(spec, k) for k in PLACEMENT_FIELDS})
