"""Engines behind one interface (:class:`memtrain.backends.base.Backend`)."""

from __future__ import annotations

import os

from memtrain.backends.base import Backend

BACKENDS = ("ddp",)


def infer_backend_name(requested: str) -> str:
    """Resolve ``backend.name``; ``auto`` means the engine the launcher asks for, else DDP.

    Raises:
        ValueError: the launcher asks for an engine this version does not provide.
    """
    if requested != "auto":
        return requested
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise ValueError("backend.name: the launcher asks for FSDP, which this version does not provide; choices: ddp")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        raise ValueError("backend.name: the launcher asks for DeepSpeed, which this version does not provide; choices: ddp")
    return "ddp"


def make_backend(name: str, precision: str, cpu: bool) -> Backend:
    """Build the engine ``name`` (already resolved by :func:`infer_backend_name`)."""
    from memtrain.backends.ddp import DDPBackend

    if name != "ddp":
        raise ValueError(f"backend.name: '{name}' is not one of {', '.join(BACKENDS)}")
    return DDPBackend(precision, cpu=cpu)
