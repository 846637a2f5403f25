"""The training loop: cursor → rank batch → step (with OOM recovery) → optimizer → metrics →
checkpoint → export. The mechanisms live elsewhere; :meth:`TrainingLoop.run` reads as the outline.

Three rules hold it together:

* one optimizer step per global batch, the LR scheduler steps once per optimizer step;
* each micro-batch contributes ``sum of losses / global count``, the count summed over ranks once
  per step, so the gradient does not depend on how the batch was split (:mod:`memtrain.step`);
* the data position is the cursor ``(epoch, step)``, never a micro-batch counter.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from torch import nn

from memtrain.backends.base import Backend
from memtrain.callbacks import Callbacks, TrainerState
from memtrain.checkpoint import Checkpointer
from memtrain.checkpoint.layout import read_manifest, step_dir_name
from memtrain.checkpoint.compat import ResumeRules, data_identity
from memtrain.collector import StepCollector
from memtrain.config import Config, ConfigError, to_dict
from memtrain.data import GlobalBatchSampler
from memtrain.distributed import ProcessState
from memtrain.evaluate import Evaluator
from memtrain.faults import FaultInjector
from memtrain.folders import write_atomic
from memtrain.fingerprint import hex_of, release_weights
from memtrain.flops import mfu
from memtrain.metrics import MetricsLogger
from memtrain.models import count_parameters
from memtrain.objectives import Objective
from memtrain.optim import apply_hyperparameters
from memtrain.outputs import RunOutputs
from memtrain.oom import (OOMStop, OOMSync, is_oom, memory_report, memory_that_ran_out, oom_stop_message,
                          peak_memory_bytes, record_escaped_oom, take_escaped_ooms)
from memtrain.levers import lever, plan_words, resume_rules
from memtrain.plan import Plan, PlanChange, PlanController
from memtrain.precision import NonFiniteGuard
from memtrain.preemption import Preemption
from memtrain.records import StepOutcome, attach_events, parameter_words, run_summary, step_record, trained_words
from memtrain.state import TrainState
from memtrain.step import step_with_recovery, time_step
from memtrain.transforms import ModelTransforms, compiled_graph_count
from memtrain.watchdog import progress

log = logging.getLogger("memtrain")


@dataclass
class RunResult:
    """What :meth:`TrainingLoop.run` returns (for tests and callers embedding memtrain).

    Attributes:
        model: the user's module (unwrapped) after training.
        records: the per-step metric records (on every rank, not only rank 0).
        summary: the run summary written to ``summary.json`` (rank 0's, the same on every rank).
    """

    model: nn.Module
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingLoop(RunOutputs):
    """Everything a run is made of, built by :func:`memtrain.build.build_trainer`, and the loop.

    ``checkpoint_states`` is what checkpoints hold (:mod:`memtrain.checkpoint.stateful`): the engine's model
    and optimizer, the LR scheduler, the plan controller, the train state, the evaluator, the
    non-finite guard, each rank's random states and the tokenizer.
    """

    cfg: Config
    process: ProcessState
    engine: Backend
    model: nn.Module
    optimizer: Any
    scheduler: Any
    corpus: Any
    objective: Objective
    sampler: GlobalBatchSampler
    controller: PlanController
    sync: OOMSync
    faults: FaultInjector
    transforms: ModelTransforms
    evaluator: Evaluator
    guard: NonFiniteGuard
    checkpointer: Checkpointer
    checkpoint_states: dict[str, Any]
    state: TrainState
    n_params: int
    spec: Any  # memtrain.backends.spec.EngineSpec: the resolved engine
    layerdrop: Any = None
    flops_per_token: Optional[float] = None  # for mfu (memtrain.flops); None = not reported
    peak_flops: Optional[float] = None
    pending_events: list[dict] = field(default_factory=list)  # plan events of the next step
    probe_batch: Optional[dict] = None  # the rank batch the planner's probes time
    breakdown: Any = None  # memtrain.memory.breakdown.MemoryBreakdown (logging.memory_breakdown_step)
    host_limit: Any = None  # memtrain.memory.host_limit.HostLimit: the host memory the run's ranks here may use
    callbacks: Callbacks = field(default_factory=Callbacks)  # the user's (memtrain.Trainer(callbacks=...))
    last_metrics: dict = field(default_factory=dict)  # the last evaluation's, for the callbacks' state
    user_schedule: bool = False  # the LR schedule is a Python caller's (scheduler_factory), not training.*'s

    def run(self) -> RunResult:
        """Train to ``training.max_steps`` (resuming from a checkpoint when ``resume`` finds one),
        then export to ``output_dir/model`` (unless ``checkpoint.export`` is false). A stop signal
        ends the run after a saved step, without export.

        Raises:
            OOMStop: out of memory at micro-batch 1 (with the memory report in the message).
            memtrain.errors.CheckpointError: a checkpoint cannot be resumed or saved.
            memtrain.precision.NonFiniteStop: ``training.max_nonfinite_steps`` skipped steps in a row.
        """
        t = self.cfg.training
        preemption = Preemption()  # a stop signal from here on ends the run after a saved step
        self.sync.stop_source = lambda: preemption.requested  # agreed in each step's closing agreement
        collector = StepCollector(t.gc_every_steps)  # no automatic collection inside steps and probes
        metrics = None
        release_weights()  # an earlier run's in this process (their width its widest batch's)
        try:
            try:
                collector.start()
                self.controller.prober = self._probe
                resumed = self._resume()
                if resumed is not None and self.state.step >= t.max_steps:
                    return self._already_finished(resumed[0])
                if t.micro_batch_size == "auto" and (resumed is None or "training.micro_batch_size" in resumed[2]):
                    self._choose_plan()
                self._shrink_after_escaped_oom()
                metrics = self._open_metrics(resumed)
                if resumed is None and self.evaluator.active:
                    self.state.initial_val_loss = self.state.val_loss = self.evaluator(self.model)["loss"]
                session_start_targets, run_start = self.state.targets_seen, time.perf_counter()
                self._cpu_start = time.process_time()
                self._callback("on_train_begin")
                records, stopped_by = self._train(metrics, resumed, preemption, collector, run_start)
            finally:
                collector.stop()
                preemption.close()
            self.checkpointer.finish()
            elapsed = time.perf_counter() - run_start
            self.probe_batch = None  # the export's moment holds neither the last rank batch nor the digest's weights
            release_weights()
            model_dir = None if stopped_by or not self.cfg.checkpoint.export else self._export_or_save()
            summary = run_summary(self.state, records=records, unit=self.objective.unit,
                                  session_targets=self.state.targets_seen - session_start_targets, elapsed_s=elapsed,
                                  resumed_from=resumed[0] if resumed else None, preempted=stopped_by,
                                  model_dir=model_dir, about=self._about(), earlier=metrics.earlier)
            summary = self.process.broadcast_object(summary)  # rank 0's (it holds every segment's records) on all
            metrics.finish(summary)
            self._callback("on_train_end", records[-1] if records else None)
        except BaseException:
            if metrics is not None:
                metrics.close()  # the progress bar ends its line before the error is said
            raise
        return RunResult(self.engine.unwrap(self.model), records, summary)

    def _train(self, metrics: MetricsLogger, resumed, preemption: Preemption, collector: StepCollector,
               run_start: float) -> tuple[list[dict], Optional[str]]:
        """The steps from the one after the state's to ``training.max_steps``, or to the step a
        stop signal ended; returns (this session's records, the signal's name or None)."""
        t = self.cfg.training
        first_step, records, stopped_by = self.state.step + 1, [], None
        for step in range(first_step, t.max_steps + 1):
            try:
                if self.breakdown is not None:
                    self.breakdown.before_step(step)
                outcome = self._optimizer_step(step, run_start)
                if self.breakdown is not None:
                    self.breakdown.after_step(step)
            except BaseException as exc:  # an OOM the agreement did not catch: leave a note for a restart
                if is_oom(exc) and not isinstance(exc, OOMStop):
                    record_escaped_oom(self.cfg.output_dir, self.process.rank, step, str(self.controller.plan))
                raise
            record = self._record(outcome, run_start)
            evaluated = step == t.max_steps or (t.eval_every and step % t.eval_every == 0)
            if evaluated:
                self._evaluate(record)
            stop_asked = self._step_callbacks(record, evaluated)
            events = self._drain_events(step, outcome.events, resumed if step == first_step else None)
            attach_events(record, events)
            self.checkpoint_states["records"].add(record)  # carried by the next checkpoint
            stopped_by = self._save_if_due(step, preemption, stop_asked, record)  # all ranks agree on stopping and saving
            # the step's events and its checkpoint commits (its own save, or an earlier asynchronous one)
            attach_events(record, events + _drain(self.checkpointer.events, step))
            records.append(record)
            metrics.log_step(record, show=step % t.log_every == 0 or "val_loss" in record)
            self.faults.after_step()
            collector.after_step(step)
            if stopped_by:  # said once, by the summary's line
                break
        return records, stopped_by

    # -- the steps of run(), in order ----------------------------------------------------------
    def _resume(self) -> Optional[tuple[str, float, dict]]:
        """Load the checkpoint ``resume`` points at, if any; returns (its path, seconds to load, the
        settings changed since it was saved: :meth:`memtrain.checkpoint.compat.ResumeRules.changed`)."""
        path = self.checkpointer.resume_path(self.cfg.resume)
        if path is None:
            return None
        start = time.perf_counter()
        progress(f"resuming from {path}", timed=False, context="")
        manifest = read_manifest(path)
        rules = ResumeRules.with_levers(resume_rules())
        rules.check(path, manifest, to_dict(self.cfg), data_identity(self.corpus))
        switched = manifest.get("backend") != self.engine.name  # written by another engine: converted on load
        if switched and self.process.is_main:
            log.warning("memtrain: resuming a %s checkpoint under %s: the weights and the optimizer state are "
                        "converted; the schedule, data position, plan and random streams carry over as they are",
                        manifest.get("backend"), self.engine.name)
        self.checkpointer.load(path, self.checkpoint_states)
        changed = rules.changed(manifest, to_dict(self.cfg))
        if switched:  # named in the resume event
            changed["backend.name"] = [manifest.get("backend"), self.engine.name]
        if any(key in changed for key in ("training.weight_decay", "training.adam_beta1", "training.adam_beta2",
                                          "training.adam_eps")):
            apply_hyperparameters(self.optimizer, self.cfg.training)
        if ("training.micro_batch_size" in changed or "memory.levers" in changed
                or any(lever(name).config_key in changed for name in self.controller.choices)):
            self.controller.restart()
        if changed and self.process.is_main:
            rule = rules.words(self.user_schedule)  # other keys: as in a new run
            log.warning("memtrain: resuming %s with changed settings: %s", path, "; ".join(
                f"{key} {old!r} → {new!r} ({rule.get(key, 'takes effect')})" for key, (old, new) in changed.items()))
        self._apply_plan()  # the checkpoint's (AC may have been switched on by an OOM before it)
        return path, time.perf_counter() - start, changed

    def evaluate(self, examples=None):
        """The checkpoint ``resume`` finds (the run's last) evaluated on the validation examples as
        the run evaluates (with the caller's ``compute_metrics``), training and writing nothing; with
        ``examples`` (an :class:`memtrain.data.examples.ExampleDataset`), its outputs for them instead.

        Returns:
            ``{"step": the checkpoint's step, "val_loss": …, "val_<metric>": …}`` (the same on every
            rank); with ``examples``, :meth:`memtrain.evaluate.Evaluator.predict`'s list.

        Raises:
            memtrain.config.ConfigError: no validation examples, or no checkpoint to evaluate.
        """
        if examples is None and not self.evaluator.active:
            raise ConfigError("eval_dataset", "gives no validation examples to evaluate (at least one per rank)")
        if self._resume() is None:
            raise ConfigError("output_dir", f"{self.cfg.output_dir} holds no checkpoint to evaluate (checkpoint."
                              "every_steps > 0 saves one every that many steps and after the last)")
        if examples is not None:
            return self.evaluator.predict(self.model, examples)
        return {"step": self.state.step, **{f"val_{k}": v for k, v in self.evaluator(self.model).items()}}

    def _already_finished(self, path: str) -> RunResult:
        """A resumed run with nothing left to train (its checkpoint is at or past
        ``training.max_steps``): say so and change nothing, except that a finished run whose
        export or summary is missing or belongs to another step (a kill or a full disk at the end)
        gets them made from the checkpoint."""
        t, step = self.cfg.training, self.state.step
        summary, missing = self.process.broadcast_object(self._unfinished_outputs() if self.process.is_main else None)
        if step == t.max_steps and missing:
            return self._finish_outputs(path, missing)
        if self.process.is_main:
            if step == t.max_steps:
                log.warning("memtrain: %s already finished at step %d (training.max_steps %d): nothing to train, "
                            "nothing changed. Raise --training.max_steps to train further, or start a new run "
                            "(--resume never, or another --output_dir)", self.cfg.output_dir, step, t.max_steps)
            else:
                log.warning("memtrain: checkpoint %s is at step %d, past training.max_steps %d: nothing to train, "
                            "nothing changed. Raise --training.max_steps above %d to train further, or start a new "
                            "run (--resume never, or another --output_dir)", path, step, t.max_steps, step)
        return RunResult(self.engine.unwrap(self.model), [], summary or {})

    def _finish_outputs(self, path: str, missing: list[str]) -> RunResult:
        """The export and the summary of a run that finished training (its last checkpoint
        ``path``) but not its outputs: made as the run's end would have made them."""
        if self.process.is_main:
            log.warning("memtrain: %s finished training at step %d, but its %s %s missing or from another step: "
                        "making %s from %s", self.cfg.output_dir, self.state.step, " and ".join(missing),
                        "is" if len(missing) == 1 else "are", "it" if len(missing) == 1 else "them", path)
        model_dir = (self._export(path) if "export" in missing else
                     os.path.join(self.cfg.output_dir, "model") if self.cfg.checkpoint.export else None)
        metrics = self._open_metrics((path, 0.0, {}), quiet=True)
        summary = run_summary(self.state, records=[], unit=self.objective.unit, session_targets=0, elapsed_s=0.0,
                              resumed_from=path, preempted=None, model_dir=model_dir, about=self._about(),
                              earlier=metrics.earlier)
        summary = self.process.broadcast_object(summary)
        metrics.finish(summary)
        return RunResult(self.engine.unwrap(self.model), [], summary)

    def _shrink_after_escaped_oom(self) -> None:
        """A previous attempt of this run (restarted by its launcher) ran out of memory outside the
        agreement and noted it (:func:`memtrain.oom.record_escaped_oom`): start one plan smaller,
        as the OOM protocol would have. Rank 0 reads and removes the notes; every rank adopts the
        same plan."""
        notes = self.process.broadcast_object(take_escaped_ooms(self.cfg.output_dir) if self.process.is_main else None)
        if not notes:
            return
        where = f"step {notes[0]['step']} of the attempt before this restart"
        if self.layerdrop is not None:
            self.layerdrop.set_step(self.state.step + 1)
        self.probe_batch = self._rank_batch(self.sampler.cursor(self.state.step))  # what a planner would time
        change = self.controller.on_oom(where)
        self._on_plan_change(self.pending_events, self.state.step + 1, time.perf_counter(), change,
                             [n["rank"] for n in notes])

    def _choose_plan(self) -> None:
        """``training.micro_batch_size: auto``: before step 1, the planner's fastest plan predicted
        to fit (every fitting candidate timed on step 1's data); the table goes to ``plan.json``.

        Raises:
            OOMStop: no candidate is predicted to fit.
        """
        planner = self.controller.planner
        if planner is None:
            log.warning("memtrain: training.micro_batch_size auto without a planner: starting at plan %s",
                        self.controller.plan)
            return
        if self.layerdrop is not None:
            self.layerdrop.set_step(1)
        self.probe_batch = self._rank_batch(self.sampler.cursor(0))
        if self.process.is_main:  # the timing takes a while (a minute on the tiny recipe on 2 CPU cores)
            log.warning("memtrain: training.micro_batch_size auto: timing plans predicted to fit (%d of %d "
                        "candidates) on step 1's data before training", len(planner.fitting()), len(planner.candidates))
        chosen = planner.initial()
        if chosen is None:
            budget = planner.budget_bytes / 2**20 if planner.budget_bytes is not None else float("nan")
            where = (f"host memory: this rank's share of the host limit ({planner.budget_source}) less what its process "
                     "holds" if planner.budget_source else "the device")
            raise OOMStop(f"no plan is predicted to fit {where} ({budget:.1f} MiB); the smallest needs "
                          f"{min(c.predicted_peak_bytes for c in planner.candidates) / 2**20:.1f} MiB")
        decisions = self.process.all_gather_object(str(chosen))
        if len(set(decisions)) != 1:
            raise RuntimeError(f"memtrain: the ranks' planners chose different plans: {decisions}")
        change = self.controller.adopt(chosen, "plan_chosen", f"fastest of {len(planner.fitting())} plans "
                                       f"predicted to fit, of {len(planner.candidates)} ({planner.probes[0]} "
                                       f"probes, {planner.probes[1]:.1f} s)")
        self._apply_plan(chosen_before_step_1=True)
        self.pending_events.append({**change.as_dict(), "ranks": []})
        if self.process.is_main:
            os.makedirs(self.cfg.output_dir, exist_ok=True)
            write_atomic(os.path.join(self.cfg.output_dir, "plan.json"), json.dumps(
                {"budget_bytes": planner.budget_bytes, "budget_source": planner.budget_source,
                 "candidates": [c.as_dict() for c in planner.candidates]}, indent=1))

    def _probe(self, candidate, samples: int) -> Optional[float]:
        """The planner's prober: the forward and backward of the current rank batch's first
        ``samples`` at ``candidate``'s micro-batch and levers, timed (seconds; None = out of memory)."""
        batch = {k: v[:samples] for k, v in self.probe_batch.items()}
        plan = replace(candidate.plan, gradient_accumulation_steps=samples // candidate.micro_batch_size)
        return time_step(self.model, self.engine, batch, plan, self.objective, self.sync, self.faults,
                         apply_plan=self.transforms.apply_plan)

    def _rank_batch(self, cursor) -> dict:
        return {k: v.to(self.process.device) for k, v in self.corpus.train.batch(self.sampler.rank_batch(cursor)).items()}

    def _open_metrics(self, resumed: Optional[tuple[str, float, dict]], quiet: bool = False) -> MetricsLogger:
        """The metrics writer (``metrics.jsonl`` reconciled with the resumed checkpoint's records)
        and, unless ``quiet``, the lines that say what the run resumed from and will do."""
        saved_event, carried = None, None
        if resumed is not None and os.path.dirname(os.path.realpath(resumed[0])) == os.path.realpath(
                self.checkpointer.root):  # this run's: its records since the save before, and the step's event
            files = read_manifest(resumed[0]).get("files", {})
            saved_event = {"event": "checkpoint_saved", "step": self.state.step, "path": resumed[0],
                           "bytes": sum(f.get("bytes", 0) for f in files.values())}
            carried = self.checkpoint_states["records"].loaded
        metrics = MetricsLogger(self.cfg.output_dir, self.process.is_main, self.cfg.training.max_steps,
                                initial_step=self.state.step, keep_until_step=self.state.step if resumed else None,
                                unit=self.objective.unit, log_with=self.cfg.logging.log_with,
                                carried=carried, saved_event=saved_event)
        self.checkpointer.report = metrics.message
        self.checkpointer.before_commit = metrics.sync  # every record before a commit is on disk
        if quiet:
            return metrics
        if resumed is not None:
            metrics.message(f"memtrain: resumed from {resumed[0]} at step {self.state.step} (loaded in "
                            f"{resumed[1]:.2f} s), plan {self.controller.plan}")
        t = self.cfg.training
        plan = self.controller.plan
        per_step = (f"{t.global_batch_size * self.cfg.data.seq_len:,} tokens" if self.corpus.kind == "text"
                    else f"{t.global_batch_size} utterances" if self.corpus.kind == "speech" else "")
        epochs = t.max_steps * t.global_batch_size / max(1, len(self.corpus.train))
        trained = trained_words(self.n_params, count_parameters(self.engine.unwrap(self.model), trainable=True))
        metrics.message(f"memtrain: {self.engine.name} × {self.process.world_size} rank(s) on {self.process.device}, "
                        f"{self.engine.precision}, {parameter_words(self.n_params)} parameters{trained}; plan {plan} (micro-batch × "
                        f"accumulation), {plan_words(dict(plan.levers))}; steps {self.state.step + 1}–{t.max_steps}"
                        f" of {t.global_batch_size} samples{f' ({per_step})' if per_step else ''} each, {epochs:.3g} "
                        f"epochs of {self.corpus.describe()}; "
                        + (f"{self.host_limit.describe()}; " if self.host_limit is not None else "")
                        + f"outputs in {self.cfg.output_dir}")
        return metrics

    def _optimizer_step(self, step: int, run_start: float) -> StepOutcome:
        """Data of ``step`` → forward/backward with OOM recovery → optimizer step → state advanced."""
        t = self.cfg.training
        step_start = time.perf_counter()
        progress("reading its batch", context=f"step {step}")
        cursor = self.sampler.cursor(step - 1)
        rank_batch = self._rank_batch(cursor)
        lr = float(self.scheduler.get_last_lr()[0])  # a tensor when the optimizer keeps one (torchao)
        self.faults.step = step
        rank_batch = self.faults.perturb(rank_batch)
        if self.layerdrop is not None:
            self.layerdrop.set_step(step)  # the same layers on every rank and micro-batch
        events, self.pending_events = [{**e, "step": step} for e in self.pending_events], []
        self.probe_batch = rank_batch
        on_change = functools.partial(self._on_plan_change, events, step, run_start)
        try:
            sums, plan = step_with_recovery(self.model, self.engine, rank_batch, self.controller, self.sync, on_change,
                                            self.objective, self.faults, self._capped_plan(cursor),
                                            apply_plan=self.transforms.apply_plan)
        except OOMStop as exc:
            report = memory_report(self.model, self.optimizer)
            context = {**self._oom_context(), "memory": "device" if self.faults.memory is not None else
                       exc.memory or memory_that_ran_out(None, self.process.device.type)}
            raise OOMStop(oom_stop_message(exc, step, self.process.rank, report, context)) from None
        progress("gradient clipping and optimizer step")
        self.faults.before_optimizer_step()
        loss_sum, global_count, digest = sums.read()  # the step's one read of its sums
        loss, count = loss_sum / global_count if global_count else float("nan"), int(global_count)
        # the non-finite guard: loss and norm are global, so every rank skips the same steps
        grad_norm = self.engine.clip_and_step(self.model, self.optimizer, t.max_grad_norm, skip=not math.isfinite(loss))
        if self.guard.update(step, loss, grad_norm):
            events.append({"event": "nonfinite_skip", "step": step, "loss": loss, "grad_norm": grad_norm,
                           "consecutive": self.guard.streak})
            if self.process.is_main:  # loss and norm are global: every rank skips the same step
                log.warning("memtrain: step %d: non-finite loss %s / grad_norm %s: optimizer step skipped on every "
                            "rank (%d in a row)", step, loss, grad_norm, self.guard.streak)
        self.scheduler.step()
        grown = self.controller.on_success()
        if grown is not None:
            on_change(grown, [])
        s = self.state
        s.step, s.epoch, s.samples_seen = step, cursor.epoch, step * t.global_batch_size
        s.targets_seen += count
        s.first_loss = loss if s.first_loss is None else s.first_loss
        s.last_loss = loss
        return StepOutcome(loss, lr, grad_norm, plan, count, time.perf_counter() - step_start, hex_of(digest), events)

    def _oom_context(self) -> dict[str, Any]:
        """What :func:`memtrain.oom.oom_stop_message` says was on, and the budget that was hit."""
        simulated = self.faults.memory
        return {"engine": self.spec.name, "zero_stage": self.spec.zero_stage, "offload": self.spec.offload,
                **self.controller.plan.settings(), "device_type": self.process.device.type,
                "budget_bytes": self._budget_bytes(), "host_limit": self.host_limit,
                "simulated_peak_bytes": simulated.peak_bytes if simulated is not None else None}

    def _budget_bytes(self) -> Optional[int]:
        """The memory budget a rank runs under: the simulated device's or the CUDA cap (None: the device's own)."""
        m = self.cfg.memory
        return (int(self.cfg.faults.memory_budget_mib * 2**20) if self.cfg.faults.memory_budget_mib else
                int(m.cuda_memory_cap_gib * 2**30) if m.cuda_memory_cap_gib and self.process.device.type == "cuda"
                else None)

    def _record(self, outcome: StepOutcome, run_start: float) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` record (:mod:`memtrain.records`), without events yet."""
        record = step_record(self.state, outcome, self.cfg.training.global_batch_size, self.objective.unit,
                             peak_memory_bytes(self.process.device), time.perf_counter() - run_start,
                             time.process_time() - self._cpu_start)
        utilisation = mfu(record[f"{self.objective.unit}_per_s"], self.flops_per_token, self.peak_flops,
                          self.process.world_size)
        if utilisation is not None:
            record["mfu"] = utilisation
        if self.layerdrop is not None:
            record["layers_dropped"] = list(self.layerdrop.dropped)
        if self.engine.loss_scale() is not None:
            record["loss_scale"] = self.engine.loss_scale()
        if self.faults.memory is not None:
            record["simulated_peak_bytes"] = self.faults.memory.peak_bytes
            if self.faults.memory.host_peak_bytes:
                record["simulated_host_peak_bytes"] = self.faults.memory.host_peak_bytes
            self.faults.memory.reset_peak()
        budget = self._budget_bytes()
        if budget:
            record["memory_budget_bytes"] = budget
        if self.state.step == 1 and self.state.initial_val_loss is not None:
            record["initial_val_loss"] = self.state.initial_val_loss
        self._prediction_error(outcome, record.get("simulated_peak_bytes", record["peak_memory_bytes"]))
        return record

    def _prediction_error(self, outcome: StepOutcome, measured: int) -> None:
        """The planner's plan change that this step completed at gets ``measured_peak_bytes`` and
        ``prediction_error`` (predicted / measured − 1): how good the memory model is."""
        if self.faults.memory is None and self.process.device.type != "cuda":
            return  # the host's peak resident size is no measure of one plan
        done = [e for e in outcome.events if e.get("predicted_peak_bytes") and e["event"] != "grow_back"
                and e["new"] == str(outcome.plan)]
        if done:
            done[-1]["measured_peak_bytes"] = measured
            done[-1]["prediction_error"] = round(done[-1]["predicted_peak_bytes"] / max(1, measured) - 1, 4)

    def _capped_plan(self, cursor) -> Optional[Callable[[], Plan]]:
        """Speech with ``data.speech.max_audio_samples_per_micro_batch``: the step's plan capped by
        the global batch's longest utterance (the same on every rank); else None."""
        cap = self.cfg.data.speech.max_audio_samples_per_micro_batch
        if self.corpus.kind != "speech" or not cap:
            return None
        longest = int(self.corpus.train.lengths[self.sampler.global_batch(cursor)].max())
        return lambda: self.controller.capped(longest, cap)

    def _on_plan_change(self, events: list[dict], step: int, run_start: float, change: PlanChange,
                        ranks: list[int]) -> None:
        events.append({**change.as_dict(), "step": step, "ranks": ranks, "elapsed_s": time.perf_counter() - run_start})
        if self.process.is_main:  # every rank agreed on the same change: said once, naming the ranks it came from
            log.warning("memtrain: step %d: %s on rank(s) %s: plan %s → %s (%s)", step, change.event, ranks,
                        change.old, change.new, change.reason)
        self._apply_plan()

    def _apply_plan(self, chosen_before_step_1: bool = False) -> None:
        """The controller's plan into effect: the engine and the levers through
        :meth:`memtrain.transforms.ModelTransforms.apply_plan` (the one function that applies a
        plan, once per change), and the evaluator (whose micro-batch starts at the plan the
        planner chooses before step 1, then changes only on its own OOM)."""
        plan = self.controller.plan
        self.transforms.apply_plan(plan)
        if chosen_before_step_1:
            self.evaluator.micro_batch_size = plan.micro_batch_size

    def _evaluate(self, record: dict[str, Any]) -> None:
        if not self.evaluator.active:  # no validation examples given, or fewer than ranks (warned at start)
            return
        for name, value in self.evaluator(self.model).items():
            record[f"val_{name}"] = value
        self.state.val_loss = record["val_loss"]

    def _save_if_due(self, step: int, preemption: Preemption, stop_asked: Optional[str] = None,
                     record: Optional[dict] = None) -> Optional[str]:
        """Save when ``checkpoint.every_steps`` divides ``step``, at the last step (when periodic
        saving is on), on a stop signal that reached any rank and on a callback's stop
        (``stop_asked``: its words, agreed by every rank); returns what stopped the run, or None."""
        progress("checkpoint save", timed=False)  # file-system work: the others' collectives time it
        # every rank's flag as of the step's closing agreement (one all-reduce fewer), else its own all-reduce
        signal = self.sync.stop_agreed if self.sync.active else self.process.any_rank(preemption.requested)
        stop = signal or stop_asked is not None
        self.checkpointer.poll()  # commit an asynchronous save every rank finished writing
        last = step == self.cfg.training.max_steps
        every = self.cfg.checkpoint.every_steps
        if stop or (every and (step % every == 0 or last)):
            self.checkpointer.save(step, self.checkpoint_states,
                                   {k: v for k, v in (record or {}).items() if k.startswith("val_")})
            self.checkpoint_states["records"].saved()
            if self.callbacks:
                self.checkpointer.finish()  # the hook is told of a committed checkpoint
                self._callback("on_save", record, os.path.join(self.checkpointer.root, step_dir_name(step)))
        if stop or last:
            self.checkpointer.finish()  # nothing left to overlap a background write with
        if signal:
            return preemption.signal_name or "a stop signal on another rank"
        return stop_asked

    def _callback(self, hook: str, record: Optional[dict] = None, *args) -> bool:
        """Run the callbacks' ``hook`` on every rank (:meth:`memtrain.callbacks.Callbacks.call`);
        whether one asked to stop."""
        if not self.callbacks:
            return False
        state = TrainerState.of(self.state.step, self.state.epoch, self.controller.plan, record, self.last_metrics)
        return self.callbacks.call(hook, state, *args, process=self.process)

    def _step_callbacks(self, record: dict, evaluated: bool) -> Optional[str]:
        """The step's hooks (``on_evaluate`` when it evaluated, then ``on_step_end``); what asked to
        stop (said in the summary as a stop signal is), or None."""
        if not self.callbacks:
            return None
        if evaluated and "val_loss" in record:
            self.last_metrics = {k: v for k, v in record.items() if k.startswith("val_")}
            if self._callback("on_evaluate", record, dict(self.last_metrics)):
                return "a callback (on_evaluate)"
        return "a callback (on_step_end)" if self._callback("on_step_end", record) else None

    def _drain_events(self, step: int, events: list[dict], resumed: Optional[tuple[str, float]]) -> list[dict]:
        """The step's events before its save: the resume (first resumed step), plan changes, then
        evaluation events (including the evaluation before step 1)."""
        if resumed is not None:
            events.insert(0, {"event": "resume", "step": step, "from": resumed[0], "load_s": resumed[1],
                              **({"changed": resumed[2]} if resumed[2] else {})})
            if "backend.name" in resumed[2]:  # the checkpoint was written by another engine
                old, new = resumed[2]["backend.name"]
                events.insert(1, {"event": "engine_switch", "step": step, "from": old, "to": new})
        return events + _drain(self.evaluator.events, step)

    def _about(self) -> dict[str, Any]:
        return {"parameters": self.n_params, "backend": self.engine.name, "world_size": self.process.world_size,
                "precision": self.engine.precision, "final_plan": str(self.controller.plan),
                "final_levers": self.controller.plan.settings(),
                "oom_agreements": {"transport": self.sync.transport, "points": self.sync.agreements},
                **({"compiled_graphs": compiled_graph_count()} if self.cfg.training.compile else {}),
                "engine_spec": self.spec.as_dict(), "config": to_dict(self.cfg)}


def _drain(source: list[dict], step: int) -> list[dict]:
    """The events waiting in ``source`` (an evaluator's, the checkpointer's), stamped with
    ``step``, the record they join; ``source`` is left empty."""
    events = [{**e, "step": step} for e in source]
    source.clear()
    return events
