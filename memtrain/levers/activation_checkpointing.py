"""Activation checkpointing as a lever (``memory.activation_checkpointing off|on|auto``):
recompute each checkpointed block's activations in backward instead of keeping them (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"; the wrapping is :mod:`memtrain.activation`).
Switchable between steps: the planner, the OOM recovery and grow-back turn it on and off."""

from __future__ import annotations

from memtrain.activation import disable_activation_checkpointing, enable_activation_checkpointing
from memtrain.levers.base import Lever, LeverTarget

CHOICES = {"off": (False,), "on": (True,), "auto": (False, True)}


class ActivationCheckpointing(Lever):
    """Settings: bool (on for every ``memory.activation_checkpointing_every_n_blocks``-th block)."""

    name = "activation_checkpointing"
    config_key = "memory.activation_checkpointing"
    escalate_event = "activation_checkpointing_on"

    def choices(self, cfg, spec) -> tuple:
        return CHOICES[cfg.memory.activation_checkpointing]

    def apply(self, target: LeverTarget, setting) -> None:
        on = getattr(target.model, "_memtrain_activation_checkpointing", False)
        if setting and not on:
            enable_activation_checkpointing(target.model, target.blocks,
                                            target.cfg.memory.activation_checkpointing_every_n_blocks)
        elif on and not setting:
            disable_activation_checkpointing(target.model, target.blocks)
        target.model._memtrain_activation_checkpointing = bool(setting)
        if target.faults is not None:
            target.faults.activation_checkpointing = bool(setting)

    def recompute_fraction(self, setting, cfg) -> float:
        return 1 / cfg.memory.activation_checkpointing_every_n_blocks if setting else 0.0

    def describe(self, setting) -> str:
        return "+ AC" if setting else ""

    def floor_note(self, setting, choices: tuple) -> str:
        return "with activation checkpointing on" if setting else "(memory.activation_checkpointing is off)"
