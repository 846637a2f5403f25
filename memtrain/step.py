"""One optimizer step's forward and backward over a rank's share of the global batch, and the
same step under the OOM protocol (retry at a smaller plan until it fits).

Each micro-batch contributes ``sum of its losses / global count`` (tokens, or transcript
characters for CTC), the count summed over ranks once per step, so the gradient does not depend
on how the global batch was split into micro-batches or ranks.
"""

from __future__ import annotations

import contextlib
import gc
import struct
import time
from contextlib import AbstractContextManager
from typing import Callable, NamedTuple, Optional, Protocol

import torch
from torch import nn

from memtrain.backends.base import Backend
from memtrain.fingerprint import micro_batch_digest
from memtrain.objectives import Objective
from memtrain.errors import OOMStop
from memtrain.oom import AgreedOOM, OOMSync, is_oom, memory_that_ran_out
from memtrain.plan import Plan, PlanChange, PlanController
from memtrain.rng import capture, restore
from memtrain.watchdog import progress


HOST_READS_PER_STEP = 2
"""Host reads of tensors (each a host synchronisation on a GPU) in an optimizer step on one rank:
the step's loss sum, count and fingerprint in one read (:meth:`StepSums.read`), and the gradient
norm the engine's ``clip_and_step`` returns (the non-finite guard needs it before the optimizer
steps). With more ranks the OOM agreement points (:class:`memtrain.oom.OOMSync`) read CPU
tensors only (no device synchronisation), and with OOM recovery on the stop-signal agreement
rides in the step's closing agreement."""


class StepHooks(Protocol):
    """Hook points of a step (fault injection and the simulated memory use them)."""

    def forward_context(self) -> AbstractContextManager:
        """Entered around every micro-batch's forward."""

    def after_micro_batch(self, index: int) -> None:
        """Called with the micro-batch index after its backward."""

    def start_attempt(self) -> None:
        """Called before every attempt of a step (and every timed probe): peaks restart here."""


class StepSums(NamedTuple):
    """What a completed :func:`train_step` returns, summed over all ranks.

    Attributes:
        loss_sum: fp64 scalar, the summed loss (nats) of the global batch.
        count: fp64 scalar, the global normalisation count (tokens or characters).
        digest: int64 scalar, the fingerprint of the data trained (:mod:`memtrain.fingerprint`).
    """

    loss_sum: torch.Tensor
    count: torch.Tensor
    digest: torch.Tensor

    def read(self) -> tuple[float, float, int]:
        """``(loss_sum, count, digest)`` on the host in one read (one host synchronisation on an
        accelerator): the three scalars travel as one int64 tensor, the floats by their bits."""
        packed = torch.stack([self.loss_sum.to(torch.float64).view(torch.int64),
                              self.count.to(torch.float64).view(torch.int64), self.digest.to(torch.int64)])
        loss_bits, count_bits, digest = packed.tolist()
        return _float_of_bits(loss_bits), _float_of_bits(count_bits), digest


def _float_of_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def sum_over_ranks(process, loss_sum: torch.Tensor, digest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global loss sum (fp64) and fingerprint (int64, modulo 2**64) in one float64 all-reduce:
    the digest travels as its high and low 32-bit halves, each sum exact in float64 for fewer than
    2**20 ranks, and is put back together modulo 2**64."""
    if process.world_size == 1:
        return loss_sum, digest
    packed = _pack(loss_sum, digest)
    process.all_reduce_sum(packed)
    return _unpack(packed)


def _pack(loss_sum: torch.Tensor, digest: torch.Tensor) -> torch.Tensor:
    high, low = digest >> 32, digest & 0xFFFFFFFF
    return torch.stack([loss_sum.to(torch.float64), high.to(torch.float64), low.to(torch.float64)])


def _unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[0], (packed[1].to(torch.int64) << 32) + packed[2].to(torch.int64)


def close_step(process, sync: Optional[OOMSync], loss_sum: torch.Tensor, digest: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's closing agreement and its sums over ranks, in as few collectives as the devices
    allow: on the CPU the loss sum and fingerprint travel in the agreement itself (shared memory
    on one host, else its all-reduce); on an accelerator they stay on the device
    (:func:`sum_over_ranks`, no host synchronisation) beside the host-side agreement.

    Raises:
        memtrain.oom.AgreedOOM: another rank ran out of memory in this step.
    """
    if sync is None or not sync.active:
        return sum_over_ranks(process, loss_sum, digest)
    if loss_sum.device.type == "cpu":
        return _unpack(sync.closing_point(_pack(loss_sum, digest))[:3])
    sync.closing_point()
    return sum_over_ranks(process, loss_sum, digest)


def train_step(model: nn.Module, backend: Backend, rank_batch: dict[str, torch.Tensor],
               plan: Plan, objective: Objective, sync: Optional[OOMSync] = None,
               hooks: Optional[StepHooks] = None) -> StepSums:
    """Forward and backward of one rank batch, accumulated over the plan's micro-batches.

    Gradients are left in the parameters (not stepped). Each micro-batch's loss is
    ``loss_sum × grad_average_factor / global_count``, so after the engine's reduction the
    gradient equals that of the mean loss per unit over the whole global batch, whatever the split.

    Args:
        model: the prepared (engine-wrapped) model.
        backend: the engine.
        rank_batch: this rank's share of the global batch, tensors [B_rank, …] on the device.
        plan: the micro-batch plan; B_rank must equal micro_batch_size × accumulation steps.
        objective: the loss and its normalisation count (:mod:`memtrain.objectives`).
        sync: OOM agreement points (in the block hooks and after a micro-batch where the engine
            communicates, :meth:`Backend.compute_collectives`; always at the end); None = none.
        hooks: the step's hook points; None = none.

    Returns:
        The global loss sum, count and data fingerprint; loss_sum / count is the step's mean
        loss per token (or character).
    """
    process = backend.process
    # the global count travels while the first micro-batch runs forward (it scales the first
    # backward) and stays on the device: no host synchronisation (torchtitan keeps the global
    # token count on the device for the same reason)
    counted = process.start_all_reduce_sum(objective.count(rank_batch).to(process.device))
    scale = global_count = None
    micro_batches = plan.split(rank_batch)
    last = len(micro_batches) - 1
    collectives = [backend.compute_collectives(i == last) for i in range(last + 1)]
    loss_sum = torch.zeros((), dtype=torch.float64, device=process.device)
    digest = torch.zeros((), dtype=torch.int64, device=process.device)
    try:
        for i, micro_batch in enumerate(micro_batches):
            progress(f"micro-batch {i + 1} of {len(micro_batches)}, forward and backward")
            if sync is not None:
                sync.expect(collectives[i])  # where the block hooks agree in this micro-batch
            with backend.reduction_context(model, reduce_gradients=i == last):
                with hooks.forward_context() if hooks is not None else contextlib.nullcontext():
                    micro_loss = objective.loss_sum(model, micro_batch)
                digest += micro_batch_digest(micro_batch)  # what went through forward
                if scale is None:
                    global_count = counted()
                    scale = backend.grad_average_factor / global_count.clamp(min=1)
                backend.backward(micro_loss * scale.to(micro_loss.dtype))
            if hooks is not None:
                hooks.after_micro_batch(i)
            loss_sum += micro_loss.detach().to(torch.float64)
            # Agree after a micro-batch when the next one communicates inside compute (a rank that
            # ran out of memory must not strand the others in its collectives); micro-batches
            # without collectives (DDP with deferred reduction, ZeRO-1 before the boundary) run on.
            if sync is not None and i < last and collectives[i + 1].before_first_block:
                sync.compute_point()
    finally:
        if global_count is None:
            counted()  # every rank started it: it completes even when this attempt failed
    loss_total, digest_total = close_step(process, sync, loss_sum, digest)  # the step's last agreement
    return StepSums(loss_total, global_count, digest_total)


def step_with_recovery(model: nn.Module, backend: Backend, rank_batch: dict[str, torch.Tensor],
                       controller: PlanController, sync: OOMSync,
                       on_change: Callable[[PlanChange, list[int]], None], objective: Objective,
                       hooks: Optional[StepHooks] = None, plan_for: Optional[Callable[[], Plan]] = None, *,
                       apply_plan: Callable[[Plan], None]) -> tuple[StepSums, Plan]:
    """:func:`train_step` under the OOM protocol: on an out-of-memory error on any rank, every rank
    discards the partial gradients, adopts the same smaller plan and retries the same rank batch,
    replaying the random streams the failed attempt started with.

    Args:
        on_change: called with each :class:`PlanChange` and the list of ranks that ran out of memory.
        plan_for: this step's plan from the controller's (a capped one, the same on every rank);
            None = the controller's plan.
        apply_plan: puts a plan into effect (:meth:`memtrain.transforms.ModelTransforms.apply_plan`:
            once per change), called with each attempt's plan and, after the step, the controller's.

    Returns:
        (the completed attempt's :class:`StepSums`, the plan that completed the step).

    Raises:
        memtrain.oom.OOMStop: at the plan floor. Any non-OOM error is re-raised untouched.
    """
    streams = capture()
    while True:
        plan = plan_for() if plan_for is not None else controller.plan
        apply_plan(plan)
        try:
            if hooks is not None:
                hooks.start_attempt()
            sums = train_step(model, backend, rank_batch, plan, objective, sync, hooks)
            apply_plan(controller.plan)  # after a capped step: back to the controller's
            return sums, plan
        except BaseException as exc:
            if not sync.enabled or not is_oom(exc):
                raise
            agreed = exc.ranks if isinstance(exc, AgreedOOM) else None
            where = "another rank" if agreed is not None else "backward" if "backward" in str(exc) else "forward"
            memory = memory_that_ran_out(exc, backend.process.device.type)
        # outside the except block: the traceback (and the activations its frames hold) is freed;
        # a rank that ran out of memory itself pairs this with the others' next agreement point
        ranks = agreed if agreed is not None else sync.agree(True)
        gc.collect()  # the failed attempt's graph can sit in reference cycles (frames of the exception)
        backend.discard_step(model)
        restore(streams)
        try:
            change = controller.on_oom(where, tried=plan)
        except OOMStop as stop:
            stop.memory = memory
            raise
        on_change(change, ranks)  # the next attempt applies the new plan


PROBE_REPEATS = 2
"""Runs of a probe (:func:`time_step`): the first also warms up, the faster counts."""


def time_step(model: nn.Module, backend: Backend, rank_batch: dict[str, torch.Tensor], plan: Plan,
              objective: Objective, sync: OOMSync, hooks: Optional[StepHooks] = None, repeats: int = PROBE_REPEATS, *,
              apply_plan: Callable[[Plan], None]) -> Optional[float]:
    """Seconds of the forward and backward of ``rank_batch`` at ``plan`` (every micro-batch and the
    gradient reduction, as in a real step; no optimizer step), the fastest of ``repeats`` (the
    first also warms up), averaged over ranks; the gradients are discarded and the random streams
    replayed, so training is unchanged.

    Returns:
        Seconds (the same on every rank), or None when a rank ran out of memory (every rank agrees,
        as in :func:`step_with_recovery`).

    Raises:
        Any non-OOM error, untouched.
    """
    streams, process = capture(), backend.process
    apply_plan(plan)
    best, agreed, failed = float("inf"), None, False
    try:
        for _ in range(repeats):
            if hooks is not None:
                hooks.start_attempt()
            start = time.perf_counter()
            train_step(model, backend, rank_batch, plan, objective, sync, hooks)
            if process.device.type == "cuda":
                torch.cuda.synchronize(process.device)
            best = min(best, time.perf_counter() - start)
            backend.discard_step(model)
    except BaseException as exc:
        if not sync.enabled or not is_oom(exc):
            raise
        agreed, failed = (exc.ranks if isinstance(exc, AgreedOOM) else None), True
    if failed:
        if agreed is None:
            sync.agree(True)
        gc.collect()
        backend.discard_step(model)
    restore(streams)
    if failed:
        return None
    total = process.all_reduce_sum(torch.tensor(best, dtype=torch.float64, device=process.device))
    return float(total) / process.world_size
