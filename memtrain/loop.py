"""The training loop: cursor → rank batch → micro-batches → step → metrics → export.

It reads top to bottom; the mechanisms live elsewhere (sampler in data/, plan in memory.py,
engine in backends/). Three rules from ../shared/DESIGN.md hold it together:

* one optimizer step per global batch, the LR scheduler steps once per optimizer step;
* each micro-batch contributes ``sum of token losses / global token count``, the count summed
  over ranks once per step, so the gradient does not depend on how the batch was split;
* the data position is the cursor ``(epoch, step)``, never a micro-batch counter.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from memtrain.backends.base import Backend
from memtrain.backends.common import sync_replicated_state
from memtrain.config import Config, to_dict
from memtrain.data import GlobalBatchSampler, batch_fingerprint
from memtrain.activation import enable_activation_checkpointing
from memtrain.backends.common import repeated_blocks
from memtrain.memory import (AgreedOOM, FaultInjector, MicroBatchPlan, OOMStop, OOMSync, PlanChange, PlanController,
                             is_oom, memory_report, peak_memory_bytes)
from memtrain.checkpoint import Checkpointer
from memtrain.export import export_model
from memtrain.metrics import MetricsLogger
from memtrain.models import count_parameters
from memtrain.objectives import Objective, make_objective
from memtrain.precision import NonFiniteGuard

log = logging.getLogger("memtrain")


def train_step(model: nn.Module, backend: Backend, rank_batch: dict[str, torch.Tensor],
               plan: MicroBatchPlan, objective: Objective, sync: Optional[OOMSync] = None,
               after_micro_batch: Optional[Callable[[int], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one rank batch, accumulated over the plan's micro-batches.

    Gradients are left in the parameters (not stepped). Each micro-batch's loss is
    ``loss_sum × grad_average_factor / global_count`` (tokens, or transcript characters for
    CTC), so after the engine's reduction the gradient equals that of the mean loss per unit over
    the whole global batch, whatever the split.

    Args:
        model: the prepared (engine-wrapped) model.
        backend: the engine.
        rank_batch: this rank's share of the global batch, tensors [B_rank, …] on the device.
        plan: the micro-batch plan; B_rank must equal micro_batch_size × accumulation steps.
        objective: the loss and its normalisation count (:mod:`memtrain.objectives`).
        sync: OOM agreement points (after every micro-batch for engines with collectives inside
            compute, else after the last); None = none.
        after_micro_batch: called with the micro-batch index after its backward (fault injection).

    Returns:
        (global loss sum, global count): fp64 scalars summed over all ranks; their ratio is the
        step's mean loss per token (or character).
    """
    global_tokens = backend.all_reduce_sum(objective.count(rank_batch).to(backend.device))
    scale = backend.grad_average_factor / global_tokens.clamp(min=1).item()
    micro_batches = plan.split(rank_batch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=backend.device)
    for i, micro_batch in enumerate(micro_batches):
        with backend.sync_context(model, sync=i == len(micro_batches) - 1):
            micro_loss = objective.loss_sum(model, micro_batch)
            backend.backward(micro_loss * scale)
        if after_micro_batch is not None:
            after_micro_batch(i)
        # Agree after every micro-batch where the engine communicates inside compute (a rank
        # that ran out of memory must not strand the others in the next micro-batch's
        # collectives); otherwise (DDP with deferred reduction) once, after the last one.
        if sync is not None and (sync.in_hooks or i == len(micro_batches) - 1):
            sync.checkpoint()
        loss_sum += micro_loss.detach().to(torch.float64)
    return backend.all_reduce_sum(loss_sum), global_tokens


def step_with_recovery(model, backend: Backend, rank_batch, controller: PlanController, sync: OOMSync,
                       on_change, objective: Objective, after_micro_batch: Optional[Callable[[int], None]] = None,
                       plan_for: Optional[Callable[[], MicroBatchPlan]] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, MicroBatchPlan]:
    """:func:`train_step` under the OOM protocol: on an out-of-memory error on any rank, every rank
    discards the partial gradients, adopts the same smaller plan and retries the same rank batch.

    Args:
        on_change: called with each :class:`PlanChange` and the list of ranks that ran out of memory.
        plan_for: this step's plan from the controller's (a frame-capped one, the same on every
            rank); None = the controller's plan.

    Returns:
        (global loss sum, global count, the plan that completed the step).

    Raises:
        OOMStop: at the plan floor. Any non-OOM error is re-raised untouched.
    """
    # a retry replays the same random streams (dropout masks; SpecAugment's masks come from NumPy)
    # as the failed attempt started with
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
           np.random.get_state())
    while True:
        plan = plan_for() if plan_for is not None else controller.plan
        if plan != controller.plan:
            backend.set_plan(plan)
        try:
            loss_sum, count = train_step(model, backend, rank_batch, plan, objective, sync, after_micro_batch)
            if plan != controller.plan:
                backend.set_plan(controller.plan)
            return loss_sum, count, plan
        except BaseException as exc:
            if not sync.enabled or not is_oom(exc):
                raise
            agreed = exc.ranks if isinstance(exc, AgreedOOM) else None
            where = "another rank" if agreed is not None else "backward" if "backward" in str(exc) else "forward"
        # outside the except block: the traceback (and the activations its frames hold) is freed
        # a rank that ran out of memory itself pairs this with the others' next agreement point
        ranks = agreed if agreed is not None else sync.agree(True)
        backend.reset_after_oom(model)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        np.random.set_state(rng[2])
        change = controller.on_oom(where, tried=plan)
        backend.set_plan(controller.plan)
        on_change(change, ranks)


class Evaluator:
    """Mean loss per token (or character; nats) over the first ``num_samples`` validation samples,
    and the objective's metrics (WER and CER for CTC). Returns ``{"loss": …, "wer": …, …}``.

    The samples are cut to a multiple of ``world_size`` and dealt round-robin, so every rank runs
    the same number of forwards (the engines' collectives stay matched). Evaluation has its own
    micro-batch size: an OOM here halves it (all ranks agree after every micro-batch) and never
    touches the training plan.
    """

    def __init__(self, backend: Backend, corpus, objective: Objective, num_samples: int, micro_batch_size: int,
                 sync: OOMSync):
        self.backend, self.corpus, self.objective, self.sync = backend, corpus, objective, sync
        n = min(num_samples, len(corpus.validation))
        self.mine = list(range(backend.rank, n - n % backend.world_size, backend.world_size))
        self.micro_batch_size = micro_batch_size
        self.events: list[dict] = []
        """Evaluation plan changes not yet written to metrics (the loop drains them)."""

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            while True:
                try:
                    totals = self._run(model)
                    break
                except BaseException as exc:
                    if not self.sync.enabled or not is_oom(exc) or self.micro_batch_size == 1:
                        raise
                    agreed = exc.ranks if isinstance(exc, AgreedOOM) else None
                ranks = agreed if agreed is not None else self.sync.agree(True)
                if self.backend.device.type == "cuda":
                    torch.cuda.empty_cache()
                old, self.micro_batch_size = self.micro_batch_size, self.micro_batch_size // 2
                self.events.append({"event": "eval_oom_shrink", "old": old, "new": self.micro_batch_size,
                                    "ranks": ranks, "reason": "out of memory in evaluation"})
                log.warning("memtrain: rank %d: OOM in evaluation on rank(s) %s; evaluation micro-batch %d → %d",
                            self.backend.rank, ranks, old, self.micro_batch_size)
        finally:
            model.train(was_training)
        self.backend.all_reduce_sum(totals)
        return self.objective.finish(totals.tolist())

    def _run(self, model: nn.Module) -> torch.Tensor:
        totals = torch.zeros(2 + 2 * len(self.objective.eval_metrics), dtype=torch.float64, device=self.backend.device)
        for i in range(0, len(self.mine), self.micro_batch_size):
            ids = self.mine[i:i + self.micro_batch_size]
            batch = {k: v.to(self.backend.device) for k, v in self.corpus.validation.batch(ids).items()}
            totals += torch.tensor(self.objective.eval_sums(model, batch), dtype=torch.float64, device=self.backend.device)
            self.sync.checkpoint()
        return totals


def make_optimizer(model: nn.Module, tcfg) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not biases, norms or other 1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2),
    )


def lr_lambda(tcfg):
    """Multiplier of the peak LR after ``step`` optimizer steps: linear warmup over
    ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def f(step: int) -> float:
        if step < tcfg.warmup_steps:
            return (step + 1) / tcfg.warmup_steps
        progress = min(1.0, (step - tcfg.warmup_steps) / max(1, tcfg.max_steps - tcfg.warmup_steps))
        return tcfg.min_lr_ratio + (1 - tcfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


@dataclass
class RunResult:
    """What :func:`run` returns (for tests and callers embedding memtrain).

    Attributes:
        model: the user's module (unwrapped) after training.
        records: the per-step metric records (on every rank, not only rank 0).
        summary: the run summary written to ``summary.json``.
    """

    model: nn.Module
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def run(cfg: Config, backend: Backend, model: nn.Module, corpus) -> RunResult:
    """Train ``model`` on ``corpus`` as ``cfg`` says (resuming from a checkpoint when
    ``cfg.resume`` finds one), then export it to ``output_dir/model``. A stop signal ends the run
    after a saved step, without export.

    Args:
        cfg: the validated config.
        backend: the engine (process group already up).
        model: freshly built model (identical on every rank).
        corpus: the data (:func:`memtrain.data.build_corpus`: packed tokens, or speech utterances).

    Returns:
        The trained model, the step records and the summary.

    Raises:
        OOMStop: out of memory at micro-batch 1 (with the memory report in the message).
        memtrain.checkpoint.CheckpointError: a checkpoint cannot be resumed or saved.
        memtrain.precision.NonFiniteStop: ``training.max_nonfinite_steps`` skipped steps in a row.
    """
    t = cfg.training
    speech = cfg.data.speech if corpus.kind == "speech" else None
    lengths = corpus.train.lengths if speech is not None else None
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch_size, t.seed, backend.world_size, backend.rank,
                                 lengths=lengths, bucket_batches=speech.bucket_batches if speech is not None else 0)
    controller = PlanController(
        MicroBatchPlan.for_global_batch(t.global_batch_size, t.micro_batch_size, backend.world_size),
        t.global_batch_size // backend.world_size, cfg.memory.activation_checkpointing, cfg.memory.grow_back_window)
    n_params = count_parameters(model)
    objective = make_objective(model, corpus)
    layerdrop = getattr(model, "memtrain_layerdrop", None)  # memtrain.layerdrop.AgreedLayerDrop
    blocks = repeated_blocks(model)  # found before the engine wraps (and renames) them
    sync_replicated_state(model, backend.device)
    model, optimizer = backend.prepare(model, lambda m: make_optimizer(m, t))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    sync = OOMSync(backend.world_size, backend.rank, backend.device, backend.collectives_in_compute,
                   enabled=cfg.memory.oom_recovery)
    faults = FaultInjector(cfg.faults, sync, backend.rank)
    faults.install(blocks)  # after wrapping, so its agreement hooks run before the engine's collectives

    def set_activation_checkpointing() -> None:
        enable_activation_checkpointing(backend.unwrap(model), blocks, cfg.memory.checkpoint_every)
        faults.activation_checkpointing = True

    evaluate = Evaluator(backend, corpus, objective, t.eval_samples, t.micro_batch_size, sync)
    checkpointer = Checkpointer(cfg, backend, corpus.vocab_size, corpus.hf_tokenizer())
    resume_from = checkpointer.resume_path()
    start_step, state = 0, {}
    if resume_from is not None:
        load_start = time.perf_counter()
        state = checkpointer.load(resume_from, model, optimizer, scheduler, controller)
        load_seconds = time.perf_counter() - load_start
        start_step = state["step"]
        evaluate.micro_batch_size = state["eval_micro_batch_size"]
    if controller.activation_checkpointing:
        set_activation_checkpointing()
    metrics = MetricsLogger(cfg.output_dir, backend.is_main, t.max_steps, initial_step=start_step,
                            keep_until_step=start_step if resume_from is not None else None)
    checkpointer.report = metrics.message
    if resume_from is not None:
        metrics.message(f"memtrain: resumed from {resume_from} at step {start_step} (loaded in {load_seconds:.2f} s), "
                        f"plan {controller.plan}")
    metrics.message(f"memtrain: {backend.name} × {backend.world_size} rank(s) on {backend.device}, {backend.precision}, "
                    f"{n_params / 1e6:.2f}M parameters, {corpus.describe()}, plan {controller.plan} "
                    "(micro-batch × accumulation)")
    if resume_from is None:
        initial_val_loss = val_loss = evaluate(model)["loss"]
        tokens_seen, first_loss, last_loss = 0, None, None
    else:
        initial_val_loss, val_loss = state["initial_val_loss"], state["val_loss"]
        tokens_seen, first_loss, last_loss = state["tokens_seen"], state["first_loss"], state["last_loss"]
    records: list[dict[str, Any]] = []
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    guard.streak = state.get("nonfinite_streak", 0)
    preempted = None
    run_start = time.perf_counter()
    for step in range(start_step + 1, t.max_steps + 1):
        step_start = time.perf_counter()
        cursor = sampler.cursor(step - 1)
        rank_batch = {k: v.to(backend.device) for k, v in corpus.train.batch(sampler.rank_batch(cursor)).items()}
        lr = scheduler.get_last_lr()[0]
        faults.step = step
        if layerdrop is not None:
            layerdrop.set_step(step)  # the same layers on every rank and micro-batch
        plan_for = None
        if speech is not None and speech.max_frames_per_micro_batch:  # same longest on every rank
            longest = int(lengths[sampler.global_batch(cursor)].max())
            plan_for = lambda: controller.capped(longest, speech.max_frames_per_micro_batch)  # noqa: E731
        events: list[dict] = []

        def on_change(change: PlanChange, ranks: list[int]) -> None:
            events.append({**change.as_dict(), "step": step, "ranks": ranks,
                           "elapsed_s": time.perf_counter() - run_start})
            log.warning("memtrain: rank %d, step %d: %s on rank(s) %s: plan %s → %s (%s)", backend.rank, step,
                        change.event, ranks, change.old, change.new, change.reason)
            if change.event == "activation_checkpointing_on":
                set_activation_checkpointing()

        try:
            loss_sum, tokens, plan = step_with_recovery(model, backend, rank_batch, controller, sync, on_change,
                                                        objective, faults.after_micro_batch, plan_for)
        except OOMStop as exc:
            report = memory_report(model, optimizer)
            raise OOMStop(f"{exc} at step {step} (rank {backend.rank}). Memory on this rank: "
                          + ", ".join(f"{k} = {v / 2**20:.1f} MiB" for k, v in report.items())
                          + ". To fit: use backend.name deepspeed with backend.zero_stage 3 or backend.name fsdp, "
                          "backend.offload optimizer, memory.activation_checkpointing on/auto, or a shorter "
                          "data.seq_len.") from None
        loss = float(loss_sum / tokens)
        # the non-finite guard: loss and norm are global, so every rank skips the same steps
        grad_norm = backend.clip_and_step(model, optimizer, t.max_grad_norm, skip=not math.isfinite(loss))
        if guard.update(step, loss, grad_norm):
            events.append({"event": "nonfinite_skip", "step": step, "loss": loss, "grad_norm": grad_norm,
                           "consecutive": guard.streak})
            log.warning("memtrain: rank %d, step %d: non-finite loss %s / grad_norm %s: optimizer step skipped "
                        "(%d in a row)", backend.rank, step, loss, grad_norm, guard.streak)
        scheduler.step()
        tokens_seen += int(tokens)
        grown = controller.on_success()
        if grown is not None:
            backend.set_plan(controller.plan)
            on_change(grown, [])

        record = {
            "step": step, "epoch": cursor.epoch, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "micro_batch_size": plan.micro_batch_size, "gradient_accumulation_steps": plan.gradient_accumulation_steps,
            "global_batch_size": t.global_batch_size, "samples_seen": step * t.global_batch_size,
            "tokens_seen": tokens_seen, "tokens_per_s": float(tokens) / (time.perf_counter() - step_start),
            "peak_memory_bytes": peak_memory_bytes(backend.device), "elapsed_s": time.perf_counter() - run_start,
            "batch_fingerprint": batch_fingerprint(sampler.global_batch(cursor)),
        }
        if layerdrop is not None:
            record["layers_dropped"] = list(layerdrop.dropped)
        if backend.loss_scale() is not None:
            record["loss_scale"] = backend.loss_scale()
        if step == t.max_steps or (t.eval_every and step % t.eval_every == 0):
            for name, value in evaluate(model).items():
                record[f"val_{name}"] = value
            val_loss = record["val_loss"]
        first_loss = record["loss"] if first_loss is None else first_loss
        last_loss = record["loss"]

        # all ranks agree on stopping and saving; what is saved is the state after this step
        preempted = checkpointer.after_step(step, step == t.max_steps, model, optimizer, scheduler, controller, {
            "step": step, "epoch": cursor.epoch, "samples_seen": record["samples_seen"],
            "tokens_seen": tokens_seen, "first_loss": first_loss, "last_loss": last_loss,
            "initial_val_loss": initial_val_loss, "val_loss": val_loss,
            "eval_micro_batch_size": evaluate.micro_batch_size, "nonfinite_streak": guard.streak})

        if step == start_step + 1 and resume_from is not None:
            events.insert(0, {"event": "resume", "step": step, "from": resume_from, "load_s": load_seconds})
        for source in (evaluate.events, checkpointer.events):  # incl. the evaluation before step 1
            events += [{**e, "step": step} for e in source]
            source.clear()
        if events:
            record["event"] = ",".join(e["event"] for e in events)
            record["plan_changes"] = events
        records.append(record)
        metrics.log_step(record, show=step % t.log_every == 0 or "val_loss" in record)
        faults.after_step()
        if preempted:
            metrics.message(f"memtrain: {preempted}: saved step {step} and stopping; rerun the same command to resume")
            break
    checkpointer.close()

    elapsed = time.perf_counter() - run_start
    model_dir = os.path.join(cfg.output_dir, "model")
    if not preempted:
        state_dict = backend.full_state_dict(model)  # a collective for sharded engines
        if backend.is_main:
            export_model(backend.unwrap(model), state_dict, model_dir, corpus.hf_tokenizer(),
                         cfg.checkpoint.max_shard_size)
        backend.barrier()
    summary = {
        "steps": records[-1]["step"] if records else start_step, "minutes": elapsed / 60,
        "first_loss": first_loss, "last_loss": last_loss, "resumed_from": resume_from, "preempted": preempted,
        "initial_val_loss": initial_val_loss, "final_val_loss": val_loss,
        "tokens_per_s": (tokens_seen - state.get("tokens_seen", 0)) / elapsed,  # this session's
        "parameters": n_params,
        "backend": backend.name, "world_size": backend.world_size, "precision": backend.precision,
        "final_plan": str(controller.plan), "plan_changes": sum(len(r.get("plan_changes", [])) for r in records),
        "model_dir": None if preempted else model_dir, "config": to_dict(cfg),
    }
    metrics.finish(summary)
    return RunResult(backend.unwrap(model), records, summary)
