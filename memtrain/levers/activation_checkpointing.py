"""Activation checkpointing as a lever (``memory.activation_checkpointing off|on|selective|auto``):
recompute each checkpointed block's activations in backward instead of keeping them (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"), all of them (``on``) or only the cheap
ones (``selective``: matmul and attention outputs kept; the wrapping is :mod:`memtrain.activation`).
Switchable between steps: the planner, the OOM recovery and grow-back move it.

Settings are the strings ``off``, ``selective``, ``on`` (plan rows, ``plan.json``, checkpoints and
``metrics.jsonl`` carry them); a plan state written when the setting was a bool reads as
``on``/``off`` (:func:`setting`).
"""

from __future__ import annotations

from memtrain.activation import disable_activation_checkpointing, enable_activation_checkpointing
from memtrain.backends import engine_module
from memtrain.errors import ConfigError
from memtrain.levers.base import Lever, LeverTarget

CHOICES = {"off": ("off",), "on": ("on",), "selective": ("selective",), "auto": ("off", "on")}
"""The settings a plan may take for each ``memory.activation_checkpointing``, fastest first."""
SOLVER_CHOICES = ("off", "selective", "on")
"""``auto`` under ``memory.levers auto``."""

RECOMPUTE = {"off": 0.0, "selective": 0.1, "on": 1.0}
"""Extra forward FLOPs per checkpointed block, as a fraction of its forward (selective recomputes
the pointwise ops and norms, a small share of a block's FLOPs; an estimate the planner's timed
probes replace)."""


def setting(value) -> str:
    """The setting ``value`` as the lever names it (a bool of older plan states: ``on``/``off``)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class ActivationCheckpointing(Lever):
    """Settings: ``off``, ``selective`` or ``on`` (on every
    ``memory.activation_checkpointing_every_n_blocks``-th block)."""

    name = "activation_checkpointing"
    column = "AC"
    config_key = "memory.activation_checkpointing"
    escalate_event = "activation_checkpointing_on"

    def choices(self, cfg, spec) -> tuple:
        ac = cfg.memory.activation_checkpointing
        options = SOLVER_CHOICES if ac == "auto" and getattr(cfg.memory, "levers", "off") == "auto" else CHOICES[ac]
        if spec is not None and not engine_module(spec.name).takes_selective_checkpointing(spec):
            if ac == "selective":
                raise ConfigError("memory.activation_checkpointing", "selective is not supported under DeepSpeed "
                                  "ZeRO-3: its parameter gathers inside a block differ between the forward and the "
                                  "recompute, which torch's selective checkpointing refuses; use on (or off)")
            options = tuple(o for o in options if o != "selective")
        return options

    def apply(self, target: LeverTarget, value) -> None:
        value = setting(value)
        now = getattr(target.model, "_memtrain_activation_checkpointing", "off")
        if value != now:
            if now != "off":
                disable_activation_checkpointing(target.model, target.blocks)
            if value != "off":
                enable_activation_checkpointing(target.model, target.blocks,
                                                target.cfg.memory.activation_checkpointing_every_n_blocks, value)
        target.model._memtrain_activation_checkpointing = value
        if target.faults is not None:
            target.faults.activation_checkpointing = value == "on"

    def event_for(self, value) -> str:
        return f"activation_checkpointing_{setting(value)}"  # _on, _selective (and _off for a move back)

    def events(self) -> tuple[str, ...]:
        return tuple(f"activation_checkpointing_{value}" for value in SOLVER_CHOICES)

    def restore(self, saved):
        return setting(saved)

    def recompute_fraction(self, value, cfg) -> float:
        return RECOMPUTE[setting(value)] / cfg.memory.activation_checkpointing_every_n_blocks

    def describe(self, value) -> str:
        return {"off": "", "selective": "+ selective AC", "on": "+ AC"}[setting(value)]

    def stop_words(self, value) -> str:
        value = setting(value or "off")
        return {"off": "", "selective": "selective activation checkpointing", "on": "activation checkpointing"}[value]

    def stop_advice(self, value, engine) -> str:
        value = setting(value or "off")
        return {"off": "memory.activation_checkpointing selective (or on)",
                "selective": "memory.activation_checkpointing on", "on": ""}[value]

    def floor_note(self, value, choices: tuple) -> str:
        value = setting(value)
        if value == "off":
            return "(memory.activation_checkpointing is off)"
        return f"with {'selective ' if value == 'selective' else ''}activation checkpointing on"
