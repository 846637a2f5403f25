"""What the loop reports: one ``metrics.jsonl`` record per optimizer step and the run summary.

The record contract: ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``global_batch_size``, ``samples_seen``, ``<unit>_seen``,
``<unit>_per_s``, ``peak_memory_bytes``, ``elapsed_s``, ``cpu_s``, ``batch_fingerprint``; ``val_<metric>``
on evaluation steps; ``mfu`` (model FLOPs utilisation, :mod:`memtrain.flops`) for a language
model in bf16/fp16 on a GPU of known peak; ``simulated_peak_bytes`` under ``faults.memory_budget_mib`` (and
``simulated_host_peak_bytes``: the activations offloaded to host memory, where any were);
``memory_budget_bytes`` under a budget (the simulated device's, or ``memory.cuda_memory_cap_gib``);
``initial_val_loss`` (before step 1) in step 1's record; ``event`` and ``plan_changes`` when something happened. ``<unit>`` is the
objective's: ``tokens`` for a language model, ``characters`` (transcript characters) for CTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memtrain.plan import Plan
from memtrain.state import TrainState


@dataclass
class StepOutcome:
    """What one completed optimizer step produced.

    Attributes:
        loss: mean loss per unit over the global batch (nats); lr: the learning rate it used.
        grad_norm: global gradient L2 norm before clipping.
        plan: the micro-batch plan that completed the step.
        count: loss targets in the global batch (tokens or characters).
        seconds: wall time of the step (data, forward/backward with retries, optimizer).
        fingerprint: the data the step trained, over all ranks (:mod:`memtrain.fingerprint`).
        events: plan changes and other events of the step (dicts with ``event``).
    """

    loss: float
    lr: float
    grad_norm: float
    plan: Plan
    count: int
    seconds: float
    fingerprint: str
    events: list[dict]


def step_record(state: TrainState, outcome: StepOutcome, global_batch_size: int, unit: str,
                peak_memory_bytes: int, elapsed_s: float, cpu_s: float = 0.0) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of the step ``state`` was just advanced to (without events);
    the plan that completed it: its split and each lever's setting under the lever's name.
    ``elapsed_s`` and ``cpu_s``: wall and process CPU seconds (every thread of this rank's process,
    ``time.process_time``) since this session's training began."""
    return {
        "step": state.step, "epoch": state.epoch, "loss": outcome.loss, "lr": outcome.lr,
        "grad_norm": outcome.grad_norm, "micro_batch_size": outcome.plan.micro_batch_size,
        "gradient_accumulation_steps": outcome.plan.gradient_accumulation_steps, **outcome.plan.settings(),
        "global_batch_size": global_batch_size, "samples_seen": state.samples_seen,
        f"{unit}_seen": state.targets_seen, f"{unit}_per_s": outcome.count / outcome.seconds,
        "peak_memory_bytes": peak_memory_bytes, "elapsed_s": elapsed_s, "cpu_s": cpu_s,
        "batch_fingerprint": outcome.fingerprint,
    }


def attach_events(record: dict[str, Any], events: list[dict]) -> None:
    """Add ``event`` (names joined by commas, in order) and ``plan_changes`` (the dicts) to a record."""
    if events:
        record["event"] = ",".join(e["event"] for e in events)
        record["plan_changes"] = events


class RecordTail:
    """The step records a checkpoint carries: those of the steps since the previous save, up to
    and including the saved step (a :class:`~memtrain.checkpoint.stateful.Stateful` entry).

    A step's record reaches ``metrics.jsonl`` after its checkpoint is committed (the commit's
    ``checkpoint_saved`` event is part of it), and every earlier line is made durable before
    that commit (:meth:`memtrain.metrics.MetricsLogger.sync`). So a kill between the commit and
    the record loses no record: a run resumed from the checkpoint takes the missing ones from
    here (:func:`memtrain.metrics.reconcile`). The saved step's record is carried as it was
    before its save (without its own ``checkpoint_saved`` event).

    Attributes:
        records: the records since the last save (the loop adds each step's, the save clears them).
        loaded: the records of the checkpoint a run resumed from.
    """

    optional = True  # a checkpoint written before records were carried loads without them

    def __init__(self):
        self.records: list[dict[str, Any]] = []
        self.loaded: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        """A completed step's record (its events so far attached)."""
        self.records.append(record)

    def saved(self) -> None:
        """A save holding :attr:`records` was written (its commit may follow later)."""
        self.records = []

    def state_dict(self) -> dict[str, Any]:
        return {"records": self.records}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded, self.records = list(state.get("records", [])), []


NOT_PLAN_CHANGES = ("checkpoint_saved", "resume", "engine_switch", "nonfinite_skip")
"""Events that change no plan (every other event — a shrink, a grow-back, a lever switched — does)."""


def events_by_kind(records: list[dict]) -> dict[str, int]:
    """How many events of each kind ``records`` hold (``plan_changes`` entries), sorted by kind."""
    counts: dict[str, int] = {}
    for r in records:
        for e in r.get("plan_changes", []):
            counts[e["event"]] = counts.get(e["event"], 0) + 1
    return dict(sorted(counts.items()))


def training_minutes(records: list[dict]) -> float:
    """Minutes of training behind ``records`` (every segment of a resumed run, in file order): each
    segment's ``elapsed_s`` restarts at its ``resume``, so the segments' last values are added."""
    total, last = 0.0, 0.0
    for r in records:
        if "resume" in r.get("event", "").split(","):
            total, last = total + last, 0.0
        last = r.get("elapsed_s", last)
    return (total + last) / 60


def duration_words(minutes: float) -> str:
    """``minutes`` as a person reads them: ``0.4 s``, ``8 s`` under a minute, else ``2.5 min``."""
    seconds = minutes * 60
    return f"{minutes:.1f} min" if minutes >= 1 else f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"


def parameter_words(n: int) -> str:
    """A parameter count as the field writes it: ``0.27M``, or the number itself under 100,000."""
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"


def trained_words(total: int, trained: int) -> str:
    """`` (N of them train)`` when fewer than the ``total`` parameters train (``trained``: a LoRA
    model's adapters); empty when all do."""
    return "" if trained == total else f" ({parameter_words(trained)} of them train)"


def run_summary(state: TrainState, *, records: list[dict], unit: str, session_targets: int, elapsed_s: float,
                resumed_from: Optional[str], preempted: Optional[str], model_dir: Optional[str],
                about: dict[str, Any], earlier: Optional[list[dict]] = None) -> dict[str, Any]:
    """The run summary (``summary.json``): totals over every segment of the run.

    Args:
        state: the train state after the last step.
        records: this session's step records.
        unit: the objective's unit (``tokens``, ``characters``).
        session_targets: loss targets trained in this session (not before a resume).
        elapsed_s: this session's training time.
        resumed_from, preempted, model_dir: the checkpoint resumed from, the stop signal, the export.
        about: the run's fixed facts (parameters, backend, world_size, precision, final_plan, config).
        earlier: the records of the segments before this one (``metrics.jsonl`` as resumed).

    Returns:
        Totals of every segment: ``minutes``, ``samples_seen``, ``<unit>_seen``, ``<unit>_per_s``
        (``<unit>_seen`` over the training seconds), ``events`` (kind → count) and ``plan_changes``
        (how many of those changed a plan); this session's ``session_minutes`` and
        ``session_<unit>_per_s``; the losses, and ``about``.
    """
    every = (earlier or []) + records
    events = events_by_kind(every)
    minutes = training_minutes(every)
    return {
        "steps": state.step, "minutes": minutes, "session_minutes": elapsed_s / 60,
        "samples_seen": state.samples_seen, f"{unit}_seen": state.targets_seen,
        f"{unit}_per_s": state.targets_seen / (minutes * 60) if minutes > 0 else 0.0,
        f"session_{unit}_per_s": session_targets / elapsed_s if elapsed_s > 0 else 0.0,
        "first_loss": state.first_loss, "last_loss": state.last_loss,
        "resumed_from": resumed_from, "preempted": preempted, "initial_val_loss": state.initial_val_loss,
        "final_val_loss": state.val_loss, "events": events,
        "plan_changes": sum(n for kind, n in events.items() if kind not in NOT_PLAN_CHANGES), "model_dir": model_dir,
        **about,
    }
