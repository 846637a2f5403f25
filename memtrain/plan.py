"""The plan and its controller: how one rank's share of a global batch is split into
micro-batches, which memory levers are set how (:mod:`memtrain.levers`), and how that changes on
out-of-memory errors (shrink, escalate a lever, grow back).

The plan is the single place that knows the split and the lever settings, so the loop, the
sampler and the LR schedule never do. Both classes are pure state machines (no collectives, no
devices): every rank feeds them the same agreed events and so holds the same plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from memtrain.levers import describe, lever, restore_settings, saved_plan_levers
from memtrain.memory.accounting import divisors
from memtrain.oom import OOMStop

# memtrain.planning.planner.Planner / Candidate (planner.py imports this module, not the other way round)
Planner = Candidate = Any


@dataclass(frozen=True)
class Plan:
    """``micro_batch_size × gradient_accumulation_steps × world_size = global_batch_size``, and
    the setting of each memory lever of the run.

    Attributes:
        micro_batch_size: samples per forward/backward on one rank.
        gradient_accumulation_steps: micro-batches per optimizer step on one rank.
        levers: ``((lever name, setting), ...)`` in :data:`memtrain.levers.LEVERS` order
            (hashable, so a plan is a dictionary key); read with :meth:`lever` / :meth:`settings`.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    levers: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def for_global_batch(cls, global_batch_size: int, micro_batch_size: int, world_size: int,
                         levers: Mapping[str, Any] | None = None) -> "Plan":
        """The plan with the given micro-batch size (and lever settings).

        Raises:
            ValueError: ``global_batch_size`` not divisible by ``micro_batch_size × world_size``.
        """
        per_rank, rem = divmod(global_batch_size, world_size)
        if rem or per_rank % micro_batch_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by micro_batch_size × world_size "
                f"= {micro_batch_size} × {world_size}"
            )
        return cls(micro_batch_size, per_rank // micro_batch_size, tuple((levers or {}).items()))

    @property
    def sizes(self) -> tuple[int, int]:
        """``(micro_batch_size, gradient_accumulation_steps)``."""
        return self.micro_batch_size, self.gradient_accumulation_steps

    def lever(self, name: str, default: Any = None) -> Any:
        """The setting of lever ``name`` (``default`` when the run does not have it)."""
        return dict(self.levers).get(name, default)

    def settings(self) -> dict[str, Any]:
        """``{lever name: setting}``."""
        return dict(self.levers)

    def with_levers(self, **settings: Any) -> "Plan":
        """This plan with some lever settings replaced."""
        merged = {**self.settings(), **settings}
        return dataclasses.replace(self, levers=tuple(merged.items()))

    def with_micro_batch(self, micro_batch_size: int) -> "Plan":
        """The same samples per rank and levers, split into micro-batches of ``micro_batch_size``."""
        per_rank = self.micro_batch_size * self.gradient_accumulation_steps
        return dataclasses.replace(self, micro_batch_size=micro_batch_size,
                                   gradient_accumulation_steps=per_rank // micro_batch_size)

    def split(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Cut a rank batch (tensors with leading dim ``micro_batch_size × accumulation``) into
        ``gradient_accumulation_steps`` micro-batches, in order.

        Raises:
            ValueError: the batch's leading dimension does not match the plan.
        """
        n = next(iter(batch.values())).shape[0]
        if n != self.micro_batch_size * self.gradient_accumulation_steps:
            raise ValueError(f"rank batch of {n} samples does not match plan {self}")
        return [{k: v[i:i + self.micro_batch_size] for k, v in batch.items()}
                for i in range(0, n, self.micro_batch_size)]

    def describe(self) -> str:
        """The split and the levers in words (``4×2 + AC``)."""
        return f"{self}{describe(self.settings())}"

    def __str__(self) -> str:
        return f"{self.micro_batch_size}×{self.gradient_accumulation_steps}"


@dataclass
class PlanChange:
    """One change of the plan (logged as a metrics ``event`` and a warning).

    Attributes:
        event: ``plan_chosen``, ``oom_shrink``, ``oom_replan``, ``grow_back``, ``grow_back_failed``
            or a lever's own (``activation_checkpointing_on``).
        old, new: plans before and after.
        reason: human-readable cause.
        predicted_peak_bytes: the planner's predicted peak of the new plan (None = no planner).
    """

    event: str
    old: Plan
    new: Plan
    reason: str
    predicted_peak_bytes: Optional[int] = None

    def as_dict(self) -> dict:
        """The event's fields: ``old``/``new`` splits (``4×2``), the new plan's lever settings
        under their names, and the prediction when there is one."""
        out = {"event": self.event, "old": str(self.old), "new": str(self.new), "reason": self.reason,
               **self.new.settings()}
        if self.predicted_peak_bytes is not None:
            out["predicted_peak_bytes"] = self.predicted_peak_bytes
        return out


class PlanController:
    """Owns the current plan and changes it on OOM or after OOM-free windows.

    Shrinking halves the micro-batch (the largest divisor of the per-rank batch at most half the
    current one) and doubles accumulation, so ``micro × accumulation × world_size`` stays the
    global batch. At micro-batch 1 it moves the first lever with a more memory-saving choice left
    to that choice (activation checkpointing on, under ``auto``); past that it raises
    :class:`OOMStop`. After ``grow_back_window`` OOM-free steps it tries the next larger
    micro-batch (never above the configured one); if that fails, the window doubles (exponential
    back-off, as Composer does for its auto-microbatching).

    With a :class:`memtrain.planning.planner.Planner` (``planner``), an OOM moves to the fastest plan
    predicted to need less memory than the one that failed (any micro-batch and lever settings)
    and grow-back tries the next faster measured plan (which may switch a lever off again).

    Args:
        configured: the plan from the config (the ceiling for grow-back; its lever settings are
            each lever's first choice).
        per_rank_batch: samples per rank per step.
        grow_back_window: OOM-free steps before a grow-back try (0 = never).
        choices: ``{lever name: settings a plan may take, fastest first}``
            (:func:`memtrain.levers.lever_choices`); levers not named keep their setting.
        make_planner: builds the run's planner the first time one is needed (returns None when
            the model cannot be planned); None = halving as above.

    Attributes:
        plan: the current :class:`Plan`.
        prober: handed to the planner once built (it times candidates on the real engine).
    """

    def __init__(self, configured: Plan, per_rank_batch: int, grow_back_window: int,
                 choices: Optional[Mapping[str, tuple]] = None,
                 make_planner: Optional[Callable[[], Optional["Planner"]]] = None):
        self.configured = configured
        self.plan = configured
        self.per_rank_batch = per_rank_batch
        self.choices = dict(choices or {})
        self.window = grow_back_window
        self.ok_steps = 0
        self.trying_grow = False
        self.grown_from = configured
        self._make_planner, self._planner = make_planner, None
        self.prober = None

    @property
    def planner(self) -> Optional["Planner"]:
        """The planner, built on first use (None without one)."""
        if self._planner is None and self._make_planner is not None:
            self._planner, self._make_planner = self._make_planner(), None
            if self._planner is not None and self.prober is not None:
                self._planner.prober = self.prober
        return self._planner

    def adopt(self, candidate: "Candidate", event: str, reason: str) -> PlanChange:
        """Take the planner's ``candidate`` as the current plan; returns the change."""
        old, self.plan = self.plan, candidate.plan
        return PlanChange(event, old, self.plan, reason, candidate.predicted_peak_bytes)

    def restart(self) -> None:
        """Back to the configured plan (a resume whose ``training.micro_batch_size`` or a lever's
        setting changed), with a fresh grow-back window count."""
        self.plan = self.grown_from = self.configured
        self.ok_steps, self.trying_grow = 0, False

    def capped(self, longest: int, max_per_micro_batch: int) -> Plan:
        """The plan for a step whose longest sample has length ``longest`` (e.g. audio samples): the
        largest micro-batch at most the current one with ``micro_batch_size × longest <=
        max_per_micro_batch`` (at least 1). The same on every rank when ``longest`` is taken over
        the global batch."""
        fitting = [d for d in self._divisors()
                   if d <= self.plan.micro_batch_size and d * longest <= max_per_micro_batch]
        return self.plan.with_micro_batch(max(fitting, default=1))

    def on_oom(self, where: str, tried: Plan | None = None) -> PlanChange:
        """The step ran out of memory on some rank: the next plan to retry with.

        Args:
            where: forward, backward or another rank (for the message).
            tried: the plan that failed when it was smaller than the current one (a
                :meth:`capped` step); shrinking starts from it.

        Raises:
            OOMStop: already at micro-batch 1 with no lever left to move.
        """
        if tried is not None and tried.micro_batch_size < self.plan.micro_batch_size and not self.trying_grow:
            self.plan = tried
        old = self.plan
        self.ok_steps = 0
        if self.trying_grow:  # the larger plan did not fit: back off and wait twice as long
            self.trying_grow = False
            self.window *= 2
            self.plan = self.grown_from  # the plan that worked before the try
            failed = self._planner.get(old) if self._planner is not None else None
            if failed is not None:
                self._planner.refute(failed)
            return PlanChange("grow_back_failed", old, self.plan, f"OOM in {where} at {old}; next try in {self.window} steps")
        replanned = self._replan_after_oom(where) if self.planner is not None else None
        if replanned is not None:
            return replanned
        smaller = [d for d in self._divisors() if d <= old.micro_batch_size // 2]
        if smaller:
            self.plan = self.plan.with_micro_batch(max(smaller))
            return PlanChange("oom_shrink", old, self.plan, f"OOM in {where}")
        return self._escalate(old, where)

    def _escalate(self, old: Plan, where: str) -> PlanChange:
        """At micro-batch 1: the first lever with a more memory-saving choice left moves to it."""
        for name, options in self.choices.items():
            x, setting = lever(name), old.lever(name)
            if x.runtime and setting in options and options.index(setting) + 1 < len(options):
                saving = options[options.index(setting) + 1]
                self.plan = old.with_levers(**{name: saving})
                return PlanChange(x.event_for(saving) or f"{name}_changed", old, self.plan,
                                  f"OOM in {where} at micro-batch 1")
        notes = [lever(name).floor_note(old.lever(name), options) for name, options in self.choices.items()]
        raise OOMStop(f"out of memory in {where} at micro-batch 1" + "".join(f" {n}" for n in notes if n))

    def _replan_after_oom(self, where: str) -> PlanChange | None:
        """The planner's next plan; None when it predicts nothing smaller fits (halving decides then:
        a prediction must not end a run that a smaller plan could still save)."""
        old = self.plan
        nxt = self.planner.after_oom(old)
        if nxt is None:
            return None
        moved = [name for name, setting in nxt.plan.levers if setting != old.lever(name)]
        event = ("oom_shrink" if nxt.micro_batch_size < old.micro_batch_size else
                 (lever(moved[0]).event_for(nxt.plan.lever(moved[0])) or "oom_replan") if moved else "oom_replan")
        return self.adopt(nxt, event, f"OOM in {where}; fastest plan predicted to fit: {nxt} "
                                      f"({self.planner.probes[0]} probes, {self.planner.probes[1]:.1f} s)")

    def on_success(self) -> PlanChange | None:
        """A step completed; returns a grow-back change when the window is full."""
        if self.trying_grow and self._planner is not None:  # never builds the planner: steps stay free
            grown = self._planner.get(self.plan)
            if grown is not None:
                self._planner.confirm(grown)
        self.trying_grow = False
        self.ok_steps += 1
        planned = self._planned_grow_back() if self._planner is not None else None
        if planned is not None:
            return planned
        if self.window <= 0 or self.plan.micro_batch_size >= self.configured.micro_batch_size or self.ok_steps < self.window:
            return None
        larger = [d for d in self._divisors() if self.plan.micro_batch_size < d <= self.configured.micro_batch_size]
        old = self.plan
        self.plan = self.plan.with_micro_batch(min(d for d in larger if d >= 2 * old.micro_batch_size) if any(
            d >= 2 * old.micro_batch_size for d in larger) else max(larger))
        self.ok_steps = 0
        self.trying_grow, self.grown_from = True, old
        return PlanChange("grow_back", old, self.plan, f"{self.window} steps without OOM")

    def _planned_grow_back(self) -> PlanChange | None:
        if self.window <= 0 or self.ok_steps < self.window:
            return None
        nxt = self._planner.faster_than(self.plan)
        if nxt is None:
            return None  # nothing measured is faster: the next larger micro-batch, as without a planner
        self.ok_steps = 0
        self.trying_grow, self.grown_from = True, self.plan
        return self.adopt(nxt, "grow_back", f"{self.window} steps without OOM; trying the faster {nxt}")

    def _divisors(self) -> list[int]:
        return divisors(self.per_rank_batch)

    def state_dict(self) -> dict:
        """The plan state for checkpoints (restored on resume)."""
        return {"micro_batch_size": self.plan.micro_batch_size, "levers": self.plan.settings(), "window": self.window,
                "ok_steps": self.ok_steps, "trying_grow": self.trying_grow,
                "grown_from": self.grown_from.micro_batch_size, "grown_from_levers": self.grown_from.settings(),
                "planner": self._planner.state_dict() if self._planner is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s plan. On another world size the per-rank batch may change:
        the largest micro-batch dividing it, at most the saved one, is taken. A saved lever setting
        this run cannot take (its config changed) is replaced by the configured one; checkpoints
        written before levers existed are read too (:func:`memtrain.levers.saved_plan_levers`)."""
        levers, grown_levers = saved_plan_levers(state)
        self.plan = self._restored(state["micro_batch_size"], levers)
        self.trying_grow = state.get("trying_grow", False)  # absent in checkpoints of memtrain 0.1.0
        self.grown_from = self._restored(state.get("grown_from", self.plan.micro_batch_size),
                                         levers if grown_levers is None else grown_levers)
        self.window, self.ok_steps = state["window"], state["ok_steps"]
        if self.planner is not None and state.get("planner"):
            self.planner.load_state_dict(state["planner"])

    def _restored(self, micro: int, saved: dict) -> Plan:
        """The plan of a checkpoint: the largest micro-batch dividing this run's per-rank batch, at
        most ``micro``; each lever's saved setting where this run may take it, else the configured."""
        settings, saved = {}, restore_settings(saved)
        for name, configured in self.configured.levers:
            value = saved.get(name, configured)
            settings[name] = value if value in self.choices.get(name, (value,)) else configured
        fit = max(d for d in self._divisors() if d <= micro)
        return Plan(fit, self.per_rank_batch // fit, tuple(settings.items()))
