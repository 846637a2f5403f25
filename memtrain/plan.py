"""The micro-batch plan and its controller: how one rank's share of a global batch is split into
micro-batches, and how that split changes on out-of-memory errors (shrink, escalate, grow back).

The plan is the single place that knows the split, so the loop, the sampler and the LR schedule
never do. Both classes are pure state machines (no collectives, no devices): every rank feeds them
the same agreed events and so holds the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from memtrain.memory.accounting import divisors
from memtrain.oom import OOMStop

# memtrain.memory.planner.Planner / Candidate (planner.py imports this module, not the other way round)
Planner = Candidate = Any


@dataclass(frozen=True)
class MicroBatchPlan:
    """``micro_batch_size × gradient_accumulation_steps × world_size = global_batch_size``.

    Attributes:
        micro_batch_size: samples per forward/backward on one rank.
        gradient_accumulation_steps: micro-batches per optimizer step on one rank.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int

    @classmethod
    def for_global_batch(cls, global_batch_size: int, micro_batch_size: int, world_size: int) -> "MicroBatchPlan":
        """The plan with the given micro-batch size.

        Raises:
            ValueError: ``global_batch_size`` not divisible by ``micro_batch_size × world_size``.
        """
        per_rank, rem = divmod(global_batch_size, world_size)
        if rem or per_rank % micro_batch_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by micro_batch_size × world_size "
                f"= {micro_batch_size} × {world_size}"
            )
        return cls(micro_batch_size, per_rank // micro_batch_size)

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

    def __str__(self) -> str:
        return f"{self.micro_batch_size}×{self.gradient_accumulation_steps}"


@dataclass
class PlanChange:
    """One change of the micro-batch plan (logged as a metrics ``event`` and a warning).

    Attributes:
        event: ``plan_chosen``, ``oom_shrink``, ``activation_checkpointing_on``,
            ``activation_checkpointing_off``, ``grow_back`` or ``grow_back_failed``.
        old, new: plans before and after.
        reason: human-readable cause.
        activation_checkpointing: AC after the change (None = the planner is not in use).
        predicted_peak_bytes: the planner's predicted peak of the new plan (None = no planner).
    """

    event: str
    old: MicroBatchPlan
    new: MicroBatchPlan
    reason: str
    activation_checkpointing: Optional[bool] = None
    predicted_peak_bytes: Optional[int] = None

    def as_dict(self) -> dict:
        out = {"event": self.event, "old": str(self.old), "new": str(self.new), "reason": self.reason}
        if self.activation_checkpointing is not None:
            out["activation_checkpointing"] = self.activation_checkpointing
        if self.predicted_peak_bytes is not None:
            out["predicted_peak_bytes"] = self.predicted_peak_bytes
        return out


class PlanController:
    """Owns the current micro-batch plan and changes it on OOM or after OOM-free windows.

    Shrinking halves the micro-batch (the largest divisor of the per-rank batch at most half the
    current one) and doubles accumulation, so ``micro × accumulation × world_size`` stays the
    global batch. At micro-batch 1 it turns activation checkpointing on (when the setting is
    ``auto``); past that it raises :class:`OOMStop`. After ``grow_back_window`` OOM-free steps it
    tries the next larger micro-batch (never above the configured one); if that fails, the window
    doubles (exponential back-off, as Composer does for its auto-microbatching).

    With a :class:`memtrain.memory.planner.Planner` (``planner``), an OOM moves to the fastest plan
    predicted to need less memory than the one that failed (smaller micro-batch, AC on, or both)
    and grow-back tries the next faster measured plan (which may switch AC off again).

    Args:
        configured: the plan from the config (the ceiling for grow-back).
        per_rank_batch: samples per rank per step.
        activation_checkpointing: ``off|on|auto``.
        grow_back_window: OOM-free steps before a grow-back try (0 = never).
        make_planner: builds the run's planner the first time one is needed (returns None when
            the model cannot be planned); None = halving as above.

    Attributes:
        prober: handed to the planner once built (it times candidates on the real engine).
    """

    def __init__(self, configured: MicroBatchPlan, per_rank_batch: int, activation_checkpointing: str,
                 grow_back_window: int, make_planner: Optional[Callable[[], Optional["Planner"]]] = None):
        self.configured = configured
        self.plan = configured
        self.per_rank_batch = per_rank_batch
        self.ac_mode = activation_checkpointing
        self.activation_checkpointing = activation_checkpointing == "on"
        self.window = grow_back_window
        self.ok_steps = 0
        self.trying_grow = False
        self.grown_from = configured
        self.grown_from_ac = self.activation_checkpointing
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
        old = self.plan
        self.plan, self.activation_checkpointing = candidate.plan, candidate.activation_checkpointing
        return PlanChange(event, old, self.plan, reason, candidate.activation_checkpointing,
                          candidate.predicted_peak_bytes)

    def restart(self) -> None:
        """Back to the configured plan and activation checkpointing setting (a resume whose
        ``training.micro_batch_size`` or ``memory.activation_checkpointing`` changed), with a fresh
        grow-back window count."""
        self.plan = self.grown_from = self.configured
        self.activation_checkpointing = self.grown_from_ac = self.ac_mode == "on"
        self.ok_steps, self.trying_grow = 0, False

    def _with_micro(self, micro: int) -> MicroBatchPlan:
        return MicroBatchPlan(micro, self.per_rank_batch // micro)

    def capped(self, longest: int, max_per_micro_batch: int) -> MicroBatchPlan:
        """The plan for a step whose longest sample has length ``longest`` (e.g. audio samples): the
        largest micro-batch at most the current one with ``micro_batch_size × longest <=
        max_per_micro_batch`` (at least 1). The same on every rank when ``longest`` is taken over
        the global batch."""
        fitting = [d for d in self._divisors()
                   if d <= self.plan.micro_batch_size and d * longest <= max_per_micro_batch]
        return self._with_micro(max(fitting, default=1))

    def on_oom(self, where: str, tried: MicroBatchPlan | None = None) -> PlanChange:
        """The step ran out of memory on some rank: the next plan to retry with.

        Args:
            where: forward, backward or another rank (for the message).
            tried: the plan that failed when it was smaller than the current one (a
                :meth:`capped` step); shrinking starts from it.

        Raises:
            OOMStop: already at micro-batch 1 with activation checkpointing on (or ``off`` by request).
        """
        if tried is not None and tried.micro_batch_size < self.plan.micro_batch_size and not self.trying_grow:
            self.plan = tried
        old = self.plan
        self.ok_steps = 0
        if self.trying_grow:  # the larger plan did not fit: back off and wait twice as long
            self.trying_grow = False
            self.window *= 2
            self.plan = self.grown_from  # the plan that worked before the try
            failed_ac, self.activation_checkpointing = self.activation_checkpointing, self.grown_from_ac
            failed = self._planner.get(old.micro_batch_size, failed_ac) if self._planner is not None else None
            if failed is not None:
                self._planner.refute(failed)
            return PlanChange("grow_back_failed", old, self.plan, f"OOM in {where} at {old}; next try in {self.window} steps",
                              self.activation_checkpointing if self._planner is not None else None)
        replanned = self._replan_after_oom(where) if self.planner is not None else None
        if replanned is not None:
            return replanned
        smaller = [d for d in self._divisors() if d <= old.micro_batch_size // 2]
        if smaller:
            self.plan = self._with_micro(max(smaller))
            return PlanChange("oom_shrink", old, self.plan, f"OOM in {where}")
        if self.ac_mode == "auto" and not self.activation_checkpointing:
            self.activation_checkpointing = True
            return PlanChange("activation_checkpointing_on", old, old, f"OOM in {where} at micro-batch 1")
        raise OOMStop(f"out of memory in {where} at micro-batch 1"
                      + (" with activation checkpointing on" if self.activation_checkpointing else
                         " (memory.activation_checkpointing is off)"))

    def _replan_after_oom(self, where: str) -> PlanChange | None:
        """The planner's next plan; None when it predicts nothing smaller fits (halving decides then:
        a prediction must not end a run that a smaller plan could still save)."""
        micro, ac = self.plan.micro_batch_size, self.activation_checkpointing
        nxt = self.planner.after_oom(micro, ac)
        if nxt is None:
            return None
        event = ("oom_shrink" if nxt.micro_batch_size < micro else
                 "activation_checkpointing_on" if nxt.activation_checkpointing and not ac else "oom_replan")
        return self.adopt(nxt, event, f"OOM in {where}; fastest plan predicted to fit: {nxt}")

    def on_success(self) -> PlanChange | None:
        """A step completed; returns a grow-back change when the window is full."""
        if self.trying_grow and self._planner is not None:  # never builds the planner: steps stay free
            grown = self._planner.get(self.plan.micro_batch_size, self.activation_checkpointing)
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
        self.plan = self._with_micro(min(d for d in larger if d >= 2 * old.micro_batch_size) if any(
            d >= 2 * old.micro_batch_size for d in larger) else max(larger))
        self.ok_steps = 0
        self.trying_grow, self.grown_from, self.grown_from_ac = True, old, self.activation_checkpointing
        return PlanChange("grow_back", old, self.plan, f"{self.window} steps without OOM")

    def _planned_grow_back(self) -> PlanChange | None:
        if self.window <= 0 or self.ok_steps < self.window:
            return None
        nxt = self._planner.faster_than(self.plan.micro_batch_size, self.activation_checkpointing)
        if nxt is None:
            return None  # nothing measured is faster: the next larger micro-batch, as without a planner
        self.ok_steps = 0
        self.trying_grow, self.grown_from, self.grown_from_ac = True, self.plan, self.activation_checkpointing
        return self.adopt(nxt, "grow_back", f"{self.window} steps without OOM; trying the faster {nxt}")

    def _divisors(self) -> list[int]:
        return divisors(self.per_rank_batch)

    def state_dict(self) -> dict:
        """The plan state for checkpoints (restored on resume)."""
        return {"micro_batch_size": self.plan.micro_batch_size, "window": self.window, "ok_steps": self.ok_steps,
                "activation_checkpointing": self.activation_checkpointing, "trying_grow": self.trying_grow,
                "grown_from": self.grown_from.micro_batch_size, "grown_from_ac": self.grown_from_ac,
                "planner": self._planner.state_dict() if self._planner is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s plan. On another world size the per-rank batch may change:
        the largest micro-batch dividing it, at most the saved one, is taken."""
        fit = lambda micro: self._with_micro(max(d for d in self._divisors() if d <= micro))  # noqa: E731
        self.plan = fit(state["micro_batch_size"])
        self.trying_grow = state.get("trying_grow", False)  # absent in checkpoints of memtrain 0.1.0
        self.grown_from = fit(state.get("grown_from", self.plan.micro_batch_size))
        self.window, self.ok_steps = state["window"], state["ok_steps"]
        self.activation_checkpointing = state["activation_checkpointing"]
        self.grown_from_ac = state.get("grown_from_ac", self.activation_checkpointing)
        if self.planner is not None and state.get("planner"):
            self.planner.load_state_dict(state["planner"])
