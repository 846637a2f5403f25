"""The :class:`Lever` protocol: one memory lever as data.

A lever is one way of trading seconds for bytes (activation checkpointing, chunked
cross-entropy, FSDP2's resharding, the DeepSpeed optimizer-offload ratio, ...). A plan
(:class:`memtrain.plan.Plan`) maps each lever of a run to its setting; the planner, the OOM
recovery, grow-back, checkpoints, ``plan.json`` and the metrics read those settings without
knowing which levers exist. Adding a lever is one module of this package, its config field and
its tests (and its name in :data:`memtrain.levers.LEVERS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn


@dataclass
class LeverTarget:
    """What a lever acts on.

    The same target type serves the run (its real model, engine and fault injector) and the
    planner's trace (a fake-tensor model, no engine): a lever's effect on saved activations is
    measured by applying it to the fake model exactly as it is applied to the real one.

    Attributes:
        model: the unwrapped model (the engine's wrapping keeps this object).
        blocks: its repeated blocks (:func:`memtrain.models.repeated_blocks`).
        objective: the run's objective (:mod:`memtrain.objectives`).
        cfg: the validated, frozen :class:`memtrain.config.Config`.
        faults: the fault injector (None when tracing).
        built: settings of the levers fixed when the engine was built (name → setting).
    """

    model: nn.Module
    blocks: list[nn.Module]
    objective: Any
    cfg: Any
    faults: Any = None
    built: dict[str, Any] = field(default_factory=dict)


class Lever:
    """One memory lever. Subclasses set the class attributes and override the methods.

    Attributes:
        name: the plan's key for it (the field name in ``plan.json`` rows and plan events).
        column: its column's heading in ``memtrain plan``'s table.
        config_key: the config field its choices are read from (``section.key``).
        model_lever: it transforms the model, so it is applied before the engine wraps it and
            to the planner's fake model (its effect on saved activations is traced); False =
            an engine setting, whose bytes the engine's accounting reports.
        runtime: it may change between steps (planner, OOM recovery, grow-back); False = fixed
            when the engine is built (a plan asking for another setting is an error).
        escalate_event: the metrics event of moving to its next, more memory-saving choice at
            the micro-batch floor (OOM recovery without a planner).
        on_resume: what a changed ``config_key`` does when a run resumes
            (:mod:`memtrain.checkpoint.compat`): ``restarts_plan`` (the plan restarts with it),
            ``must_match`` (refused: the checkpoint's state depends on it) or ``takes_effect``
            (read when the engine is built, as in a new run).
    """

    name: str = ""
    column: str = ""
    config_key: str = ""
    model_lever: bool = True
    runtime: bool = True
    escalate_event: Optional[str] = None
    on_resume: str = "restarts_plan"

    def applies(self, cfg, spec) -> bool:
        """Whether the run of ``cfg`` on engine ``spec`` (a :class:`memtrain.backends.spec.EngineSpec`)
        has this lever at all (e.g. resharding only under FSDP2)."""
        return True

    def choices(self, cfg, spec) -> tuple:
        """The settings a plan may take, fastest first (the first is where a run starts; each
        later one needs less memory). Raises :class:`memtrain.errors.ConfigError` for a setting
        the run cannot take."""
        raise NotImplementedError

    def apply(self, target: LeverTarget, setting) -> None:
        """Put ``setting`` into effect on ``target`` (idempotent: applying the current setting
        changes nothing)."""
        if not self.runtime and self.name in target.built and setting != target.built[self.name]:
            raise RuntimeError(f"{self.config_key} is fixed when the engine is built "
                               f"({target.built[self.name]!r}); a plan asked for {setting!r}")

    def event_for(self, setting) -> Optional[str]:
        """The metrics event of moving to ``setting`` under out-of-memory recovery (None: the
        caller's generic name)."""
        return self.escalate_event

    def events(self) -> tuple[str, ...]:
        """Every event :meth:`event_for` may name."""
        return (self.escalate_event,) if self.escalate_event else ()

    def restore(self, saved):
        """A setting as a checkpoint of an older memtrain wrote it, as this version names it."""
        return saved

    def recompute_fraction(self, setting, cfg) -> float:
        """Extra forward passes the setting costs per step, as a fraction of one forward (FLOP
        estimates of :func:`memtrain.planning.planner.estimated_step_s`); 0 = none."""
        return 0.0

    def describe(self, setting) -> str:
        """A few words for messages (``+ AC``); empty when the setting is the plain one."""
        return ""

    def stop_words(self, setting) -> str:
        """What the OOM stop message lists as already on (:func:`memtrain.oom.oom_stop_message`);
        empty when ``setting`` (None: the config's default) saves nothing."""
        return ""

    def stop_advice(self, setting, engine) -> str:
        """The change the OOM stop message suggests of this lever when a more memory-saving choice
        is left at ``setting`` on ``engine`` (its module in :mod:`memtrain.backends`); empty = none."""
        return ""

    def floor_note(self, setting, choices: tuple) -> str:
        """What the OOM stop message at the micro-batch floor says of this lever; empty = nothing."""
        return ""
