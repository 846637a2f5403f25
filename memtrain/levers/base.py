"""The :class:`Lever` protocol: one memory lever as data.

A lever is one way of trading seconds for bytes (activation checkpointing, chunked
cross-entropy, FSDP2's resharding, the DeepSpeed optimizer-offload ratio, ...). A plan
(:class:`memtrain.plan.Plan`) maps each lever of a run to its setting; the planner, the OOM
recovery, grow-back, checkpoints, ``plan.json`` and the metrics read those settings without
knowing which levers exist. Adding a lever is one module of this package (its config fields
declared in it: :class:`ConfigField`), its name in :data:`memtrain.levers.LEVERS` and its tests;
``python -m memtrain.levers`` then writes its fields into the config and its name into the docs. What a setting costs beyond the bytes
the planner's trace sees and the forwards it recomputes (host bytes, copies) is the lever's own
:meth:`Lever.cost`, which the planner, the placements and ``memtrain plan`` read alike
(:func:`memtrain.planning.planner.lever_cost`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn


PINNED_ROUNDING = 2
"""Host bytes per pinned byte at most: torch's caching host allocator rounds each pinned block up
to a power of two (and keeps it cached for reuse)."""


@dataclass(frozen=True)
class ConfigField:
    """A ``memory`` config field a lever declares: its type, default and help live with the lever,
    and :class:`memtrain.config.MemoryConfig`'s lever fields are generated from them
    (:func:`memtrain.levers.generated.config_source`; ``python -m memtrain.levers`` rewrites them), so the
    config stays free of torch and ``memtrain --help`` instant.

    Attributes:
        name: the key under ``memory`` (the field ``memory.<name>``).
        annotation: its type as Python source (``Literal["off", "on", "auto"]``, ``bool``, ``float``).
        default: its default (a str, bool, int, float or None).
        doc: its help, one paragraph (reST ````literals````); its first sentence is the line
            ``memtrain train --help`` shows.
    """

    name: str
    annotation: str
    default: Any
    doc: str


def choices_annotation(choices) -> str:
    """``Literal[...]`` of ``choices`` (strings) as Python source: a :class:`ConfigField`'s
    ``annotation`` for a setting with those values, e.g. ``Literal["off", "on", "auto"]``."""
    return "Literal[" + ", ".join(f'"{c}"' for c in choices) + "]"


@dataclass(frozen=True)
class PlanFacts:
    """What a lever's cost may depend on: one plan of one rank, as the planner knows it.

    Attributes:
        micro_batch_size: samples per forward/backward on the rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        offloaded_bytes: bytes of saved activations one micro-batch moves to host memory and back
            (activation offload), each way, traced (:func:`memtrain.planning.activations.activation_table`).
        copy_bytes_per_s: the rate host copies are charged at (bytes/s:
            ``memory.activation_offload_bandwidth_gb_s × 10^9``); None = not charged (a GPU
            run's probes time the copies themselves).
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    offloaded_bytes: int = 0
    copy_bytes_per_s: Optional[float] = None


@dataclass(frozen=True)
class LeverCost:
    """What a lever setting costs one rank beyond what the trace of its micro-step counts and the
    forwards it recomputes (:meth:`Lever.recompute_fraction`). Costs add up over a plan's levers.

    Attributes:
        device_bytes: device bytes held at every moment of a step (bytes).
        host_bytes: host bytes held through a step, pageable (bytes).
        pinned_host_bytes: host bytes held through a step in pinned blocks (bytes; a host's room
            for them is checked at :data:`PINNED_ROUNDING` × these).
        seconds: seconds per optimizer step beyond the compute (host copies, synchronisations).
    """

    device_bytes: int = 0
    host_bytes: int = 0
    pinned_host_bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: "LeverCost") -> "LeverCost":
        return LeverCost(self.device_bytes + other.device_bytes, self.host_bytes + other.host_bytes,
                         self.pinned_host_bytes + other.pinned_host_bytes, self.seconds + other.seconds)

    @property
    def held_host_bytes(self) -> int:
        """Host bytes the setting holds (pageable and pinned)."""
        return self.host_bytes + self.pinned_host_bytes

    @property
    def host_room_bytes(self) -> int:
        """Host bytes of room the setting needs, the pinned blocks rounded up at most."""
        return self.host_bytes + PINNED_ROUNDING * self.pinned_host_bytes


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
        config_fields: the ``memory`` fields the lever declares (:class:`ConfigField`); an engine
            setting's field is its engine section's.
        named_as: its name in a sentence naming a plan's levers even when off (``activation
            checkpointing off``: :func:`memtrain.levers.plan_words`); empty = named only when on
            (:meth:`describe`).
        auto_words: what ``memory.levers auto`` may choose through the lever, in words for that
            field's help; empty = the planner does not choose it.
        by_hand: the setting a user turns it on with (``on|selective``), for the README's row of
            levers turned on by hand; empty = not listed there.
    """

    name: str = ""
    column: str = ""
    config_key: str = ""
    model_lever: bool = True
    runtime: bool = True
    escalate_event: Optional[str] = None
    on_resume: str = "restarts_plan"
    config_fields: tuple[ConfigField, ...] = ()
    named_as: str = ""
    auto_words: str = ""
    by_hand: str = ""

    def applies(self, cfg, spec) -> bool:
        """Whether the run of ``cfg`` on engine ``spec`` (a :class:`memtrain.backends.spec.EngineSpec`)
        has this lever at all (e.g. resharding only under FSDP2)."""
        return True

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        """Refuse what the lever's config fields cannot mean, before anything is built
        (:func:`memtrain.validation.validate`; ``python``: what a Python caller passed, e.g.
        ``{"objective"}``). Raises :class:`memtrain.errors.ConfigError` naming the field."""

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

    def block_period(self, setting, cfg) -> int:
        """Blocks per repeat of what ``setting`` does to the model's blocks (activation
        checkpointing of every n-th block: n), for the planner's trace, which extrapolates a
        model's depth from whole periods (:func:`memtrain.memory.depth.by_depth`); 1 = every block alike."""
        return 1

    def cost(self, setting, facts: PlanFacts) -> LeverCost:
        """What ``setting`` costs the plan of ``facts`` beyond its traced bytes and its recompute
        (bytes the trace cannot see, seconds of copies); the default: nothing."""
        return LeverCost()

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
