"""Activation offloading as a lever (``memory.activation_offload off|on|auto``): the activations a
training forward saves for backward are kept in host memory until backward
(:mod:`memtrain.activation_offload`). Lossless; its cost is the copies, measured by the planner's
probes on a GPU and charged at ``memory.activation_offload_bandwidth_gb_s`` on a CPU run, whose
host is its device. Switchable between steps: the planner, the OOM recovery and grow-back move it.
"""

from __future__ import annotations

from memtrain.activation_offload import disable_activation_offload, enable_activation_offload
from memtrain.levers.base import Lever, LeverCost, LeverTarget, PlanFacts

CHOICES = {"off": ("off",), "on": ("on",), "auto": ("off",)}
"""The settings a plan may take for each ``memory.activation_offload``, fastest first (``auto``
without the solver: off)."""
SOLVER_CHOICES = ("off", "on")
"""``auto`` under ``memory.levers auto``."""


class ActivationOffload(Lever):
    """Settings: ``off`` or ``on``."""

    name = "activation_offload"
    column = "offload act"
    config_key = "memory.activation_offload"
    escalate_event = "activation_offload_on"

    def choices(self, cfg, spec) -> tuple:
        value = getattr(cfg.memory, "activation_offload", "off")
        if value == "auto" and getattr(cfg.memory, "levers", "off") == "auto":
            return SOLVER_CHOICES
        return CHOICES[value]

    def apply(self, target: LeverTarget, setting) -> None:
        if setting == "on":
            enable_activation_offload(target.model)
        else:
            disable_activation_offload(target.model)

    def cost(self, setting, facts: PlanFacts) -> LeverCost:
        """One micro-batch's offloaded activations wait in pinned host memory; each is copied to
        the host and back (``2 × offloaded_bytes`` per micro-batch), charged at
        ``facts.copy_bytes_per_s`` as if no copy overlapped compute (None: not charged)."""
        if setting != "on":
            return LeverCost()
        rate = facts.copy_bytes_per_s
        copies = facts.gradient_accumulation_steps * 2 * facts.offloaded_bytes / rate if rate else 0.0
        return LeverCost(pinned_host_bytes=facts.offloaded_bytes, seconds=copies)

    def event_for(self, setting) -> str:
        return f"activation_offload_{setting}"

    def events(self) -> tuple[str, ...]:
        return tuple(f"activation_offload_{value}" for value in SOLVER_CHOICES)

    def describe(self, setting) -> str:
        return "+ activation offload" if setting == "on" else ""

    def stop_words(self, setting) -> str:
        return "activation offload" if setting == "on" else ""

    def stop_advice(self, setting, engine) -> str:
        return "" if setting == "on" else "memory.activation_offload on"

    def floor_note(self, setting, choices: tuple) -> str:
        return "" if setting == "on" else "(memory.activation_offload is off)"
