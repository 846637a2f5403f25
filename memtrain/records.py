"""What the loop reports: one ``metrics.jsonl`` record per optimizer step and the run summary.

The record contract: ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``global_batch_size``, ``samples_seen``, ``<unit>_seen``,
``<unit>_per_s``, ``peak_memory_bytes``, ``elapsed_s``, ``batch_fingerprint``; ``val_<metric>``
on evaluation steps; ``mfu`` (model FLOPs utilisation, :mod:`memtrain.flops`) for a language
model in bf16/fp16 on a GPU of known peak; ``simulated_peak_bytes`` under ``faults.memory_budget_mib``; ``event`` and
``plan_changes`` when something happened. ``<unit>`` is the
objective's: ``tokens`` for a language model, ``characters`` (transcript characters) for CTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memtrain.plan import MicroBatchPlan
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
    plan: MicroBatchPlan
    count: int
    seconds: float
    fingerprint: str
    events: list[dict]


def step_record(state: TrainState, outcome: StepOutcome, global_batch_size: int, unit: str,
                peak_memory_bytes: int, elapsed_s: float) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of the step ``state`` was just advanced to (without events)."""
    return {
        "step": state.step, "epoch": state.epoch, "loss": outcome.loss, "lr": outcome.lr,
        "grad_norm": outcome.grad_norm, "micro_batch_size": outcome.plan.micro_batch_size,
        "gradient_accumulation_steps": outcome.plan.gradient_accumulation_steps,
        "global_batch_size": global_batch_size, "samples_seen": state.samples_seen,
        f"{unit}_seen": state.targets_seen, f"{unit}_per_s": outcome.count / outcome.seconds,
        "peak_memory_bytes": peak_memory_bytes, "elapsed_s": elapsed_s, "batch_fingerprint": outcome.fingerprint,
    }


def attach_events(record: dict[str, Any], events: list[dict]) -> None:
    """Add ``event`` (names joined by commas, in order) and ``plan_changes`` (the dicts) to a record."""
    if events:
        record["event"] = ",".join(e["event"] for e in events)
        record["plan_changes"] = events


def run_summary(state: TrainState, *, records: list[dict], unit: str, session_targets: int, elapsed_s: float,
                resumed_from: Optional[str], preempted: Optional[str], model_dir: Optional[str],
                about: dict[str, Any]) -> dict[str, Any]:
    """The run summary (``summary.json``).

    Args:
        state: the train state after the last step.
        records: this session's step records.
        unit: the objective's unit (``tokens``, ``characters``).
        session_targets: loss targets trained in this session (not before a resume).
        elapsed_s: this session's training time.
        resumed_from, preempted, model_dir: the checkpoint resumed from, the stop signal, the export.
        about: the run's fixed facts (parameters, backend, world_size, precision, final_plan, config).
    """
    return {
        "steps": state.step, "minutes": elapsed_s / 60, "first_loss": state.first_loss, "last_loss": state.last_loss,
        "resumed_from": resumed_from, "preempted": preempted, "initial_val_loss": state.initial_val_loss,
        "final_val_loss": state.val_loss, f"{unit}_per_s": session_targets / elapsed_s,
        "plan_changes": sum(len(r.get("plan_changes", [])) for r in records), "model_dir": model_dir, **about,
    }
