"""Engines behind one interface (:class:`memtrain.backends.base.Backend`): DDP, FSDP2, DeepSpeed."""

from __future__ import annotations

import os
from typing import Optional

from memtrain.backends.base import Backend

BACKENDS = ("ddp", "fsdp", "deepspeed")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def infer_backend_name(requested: str, deepspeed_config: Optional[str] = None) -> str:
    """Resolve ``backend.name``. ``auto`` follows the launcher: ``accelerate launch`` with an FSDP
    config (``ACCELERATE_USE_FSDP``) → fsdp; with a DeepSpeed config (``ACCELERATE_USE_DEEPSPEED``)
    or the DeepSpeed launcher's ``--deepspeed FILE`` → deepspeed; otherwise ddp."""
    if requested != "auto":
        return requested
    if _env_true("ACCELERATE_USE_FSDP"):
        return "fsdp"
    if deepspeed_config or _env_true("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    return "ddp"


def _accelerate_deepspeed_settings() -> tuple[Optional[str], Optional[int], Optional[str]]:
    """(config file, zero stage, offload) from ``accelerate launch``'s DeepSpeed environment."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    opt = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
    par = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
    offload = "optimizer_and_params" if par == "cpu" else "optimizer" if opt == "cpu" else None
    return path, int(stage) if stage and not path else None, offload if not path else None


def _accelerate_fsdp_settings() -> tuple[Optional[bool], Optional[str]]:
    """(reshard_after_forward, offload) from ``accelerate launch``'s FSDP environment."""
    if "FSDP_RESHARD_AFTER_FORWARD" in os.environ:  # fsdp_version 2
        reshard = _env_true("FSDP_RESHARD_AFTER_FORWARD")
    else:  # fsdp_version 1 names: SHARD_GRAD_OP (2) keeps parameters gathered between forward and backward
        strategy = os.environ.get("FSDP_SHARDING_STRATEGY")
        reshard = None if strategy is None else strategy.upper() not in ("SHARD_GRAD_OP", "2")
    offload = "optimizer_and_params" if _env_true("FSDP_OFFLOAD_PARAMS") else None
    return reshard, offload


def make_backend(cfg, precision: str, cpu: bool) -> Backend:
    """Build the engine for ``cfg`` (a :class:`memtrain.config.Config`).

    Raises:
        ValueError: unknown engine or an option the engine cannot honour (message names the field).
        memtrain.config.ConfigError: a DeepSpeed JSON contradicting the memtrain config.
    """
    b, t = cfg.backend, cfg.training
    name = infer_backend_name(b.name, b.deepspeed_config)
    if name == "ddp":
        from memtrain.backends.ddp import DDPBackend

        return DDPBackend(precision, cpu=cpu, find_unused_parameters=b.find_unused_parameters,
                          defer_reduction=cfg.memory.oom_recovery)
    if name == "fsdp":
        from memtrain.backends.fsdp import FSDPBackend

        reshard, env_offload = _accelerate_fsdp_settings() if b.name == "auto" else (None, None)
        return FSDPBackend(precision, cpu=cpu,
                           reshard_after_forward=b.reshard_after_forward if reshard is None else reshard,
                           offload=b.offload or env_offload or "none")
    if name == "deepspeed":
        from memtrain.backends.deepspeed import DeepSpeedBackend

        path, stage, offload = b.deepspeed_config, b.zero_stage, b.offload
        if path is None and b.name == "auto":
            env_path, env_stage, env_offload = _accelerate_deepspeed_settings()
            path, stage, offload = env_path, stage or env_stage, offload or env_offload
        return DeepSpeedBackend(precision, cfg.precision, cpu=cpu, ds_config_path=path, zero_stage=stage,
                                offload=offload, global_batch_size=t.global_batch_size,
                                micro_batch_size=t.micro_batch_size, max_grad_norm=t.max_grad_norm)
    raise ValueError(f"backend.name: '{name}' is not one of {', '.join(BACKENDS)}")
