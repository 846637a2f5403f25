"""The micro-batch plan: how one rank's share of a global batch is split into micro-batches.

OOM recovery (shrink, escalate, grow back; ../shared/DESIGN.md "The OOM protocol") will change
the plan at run time; the plan is the single place that knows the split, so the loop, the
sampler and the LR schedule never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far, in bytes: CUDA max allocated on a GPU, else the
    process's peak resident set size (``ru_maxrss``)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ---------------------------------------------------------------------------------------------
# OOM detection and the rank-synchronised decision
# ---------------------------------------------------------------------------------------------

_OOM_MESSAGES = ("out of memory", "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED",
                 "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: ``torch.OutOfMemoryError`` or a RuntimeError
    carrying a CUDA/cuDNN/cuBLAS allocation-failure message. Anything else is not (and is re-raised
    untouched by the loop)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


class AgreedOOM(torch.OutOfMemoryError):
    """Raised on every rank once the ranks have agreed that some rank ran out of memory.

    Attributes:
        ranks: the ranks that ran out of memory.
    """

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        super().__init__(f"out of memory on rank(s) {ranks}")


class OOMStop(RuntimeError):
    """Out of memory at the plan floor (micro-batch 1, activation checkpointing on or off by
    request); the message holds the memory report and the settings to change."""


class OOMSync:
    """Agreement points of the OOM protocol.

    Every rank calls :meth:`checkpoint` at the same places (after each micro-batch; and, for
    engines that communicate inside forward/backward, before each block's forward and backward).
    A rank that ran out of memory skips ahead to the loop, which calls :meth:`agree` with
    ``local_oom=True``; that collective pairs with the other ranks' next checkpoint, which then
    raise :class:`AgreedOOM`. Because no engine collective sits between two agreement points,
    nobody is left waiting in one.

    Args:
        world_size: number of ranks; rank: this rank.
        device: where the flag tensor lives (CUDA for nccl, CPU for gloo).
        in_hooks: also agree in the block hooks (engines with collectives inside compute:
            FSDP2's all-gather/reduce-scatter, ZeRO's parameter fetch and gradient partitioning).
        enabled: False = no agreement (memory.oom_recovery off).
    """

    def __init__(self, world_size: int, rank: int, device: torch.device, in_hooks: bool, enabled: bool = True):
        self.world_size, self.rank, self.device = world_size, rank, device
        self.in_hooks = in_hooks
        self.enabled = enabled

    def agree(self, local_oom: bool) -> list[int]:
        """All-reduce one flag per rank; returns the ranks that ran out of memory."""
        if not self.enabled or self.world_size == 1:
            return [self.rank] if local_oom else []
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(local_oom)
        torch.distributed.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def checkpoint(self) -> None:
        """An agreement point on the success path.

        Raises:
            AgreedOOM: another rank ran out of memory since the last agreement point.
        """
        if self.enabled and self.world_size > 1:
            ranks = self.agree(False)
            if ranks:
                raise AgreedOOM(ranks)


def kill(where: str) -> None:
    """End this process at once, the way a preempted or crashed job ends (exit status 137, no
    cleanup, no flushing beyond what is already on disk)."""
    import logging
    import os
    import sys

    logging.getLogger("memtrain").warning("memtrain: faults: killing the process %s", where)
    sys.stderr.flush()
    os._exit(137)


class FaultInjector:
    """Raises a real ``torch.OutOfMemoryError`` from inside the model (``faults.*``), so CPU tests
    walk the same path as a CUDA OOM. Hooks sit on the model's repeated blocks: a forward
    pre-hook of the first block (``oom_in: forward``) or a gradient hook on its output
    (``oom_in: backward``). With ``in_hooks``, every block hook is also an agreement point.

    A micro-batch "holds" ``batch × sequence`` tokens of activations; with activation
    checkpointing on, only one block's activations are live at a time, so the injector counts
    ``tokens / number of blocks`` — the saving activation checkpointing really gives.

    Args:
        faults: the ``faults`` config section.
        sync: the agreement points.
        rank: this rank.
    """

    def __init__(self, faults, sync: OOMSync, rank: int):
        self.faults = faults
        self.sync = sync
        self.rank = rank
        self.step = 0
        self.activation_checkpointing = False
        self.num_blocks = 1

    def _active(self, where: str, tokens: int) -> bool:
        f = self.faults
        if f.oom_above_tokens <= 0 or f.oom_in != where or (f.oom_until_step and self.step > f.oom_until_step):
            return False
        if f.oom_ranks is not None and self.rank not in f.oom_ranks:
            return False
        if f.oom_at_steps is not None and self.step not in f.oom_at_steps:
            return False
        held = tokens / self.num_blocks if self.activation_checkpointing else tokens
        return held > f.oom_above_tokens

    def _at_block(self, where: str, first: bool, shape) -> None:
        if first and self._active(where, int(shape[0]) * (int(shape[1]) if len(shape) > 2 else 1)):
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by memtrain faults.oom_above_tokens={self.faults.oom_above_tokens} "
                f"in {where} on rank {self.rank})")
        if self.sync.in_hooks and where != "eval":  # evaluation agrees once per micro-batch
            self.sync.checkpoint()

    def _poisoned(self) -> bool:
        f = self.faults
        return f.nan_at_step > 0 and f.nan_at_step <= self.step < f.nan_at_step + f.nan_steps

    @staticmethod
    def _poison(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``faults.nan_at_step``: the block's first floating-point input times NaN, so the loss
        and every gradient upstream of the block become NaN, as a real overflow would."""
        args = list(args)
        for container in (args, kwargs):
            keys = range(len(container)) if isinstance(container, list) else list(container)
            for k in keys:
                if isinstance(container[k], torch.Tensor) and container[k].is_floating_point():
                    container[k] = container[k] * float("nan")
                    return tuple(args), kwargs
        return tuple(args), kwargs

    def after_micro_batch(self, index: int) -> None:
        """``faults.kill_at_step`` with ``kill_mid_step``: end the process after the first
        micro-batch's backward of that step (in the middle of gradient accumulation)."""
        f = self.faults
        if f.kill_mid_step and f.kill_at_step == self.step and index == 0:
            kill(f"inside step {self.step}, after micro-batch 1")

    def after_step(self) -> None:
        """``faults.kill_at_step``: end the process right after that optimizer step."""
        f = self.faults
        if f.kill_at_step == self.step and not f.kill_mid_step:
            kill(f"after step {self.step}")

    def install(self, blocks: list) -> None:
        """Register the hooks on ``blocks`` (in forward order) — only when something needs them
        (an OOM or NaN injection, or agreement points inside compute), so a plain DDP run pays
        for no Python hook in its forward or backward."""
        self.num_blocks = max(1, len(blocks))
        f = self.faults
        if not (f.oom_above_tokens > 0 or f.nan_at_step > 0 or (self.sync.enabled and self.sync.in_hooks)):
            return

        def first_tensor(x):
            if isinstance(x, torch.Tensor):
                return x
            if isinstance(x, (tuple, list)) and x:
                return first_tensor(x[0])
            return getattr(x, "last_hidden_state", None) if x is not None else None

        for i, block in enumerate(blocks):
            def pre(module, args, kwargs, first=i == 0):
                h = first_tensor(args) if args else first_tensor(next(iter(kwargs.values()), None))
                if h is not None:
                    self._at_block("forward" if torch.is_grad_enabled() else "eval", first, h.shape)
                if first and torch.is_grad_enabled() and self._poisoned():
                    return self._poison(args, kwargs)
                return None

            def post(module, args, output, first=i == 0):
                h = first_tensor(output)
                if h is not None and h.requires_grad:
                    shape = h.shape
                    h.register_hook(lambda grad: self._at_block("backward", first, shape))

            block.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
            block.register_forward_hook(post, prepend=True)


# ---------------------------------------------------------------------------------------------
# The plan controller: shrink, escalate, grow back
# ---------------------------------------------------------------------------------------------


@dataclass
class PlanChange:
    """One change of the micro-batch plan (logged as a metrics ``event`` and a warning).

    Attributes:
        event: ``oom_shrink``, ``activation_checkpointing_on``, ``grow_back`` or ``grow_back_failed``.
        old, new: plans before and after.
        reason: human-readable cause.
    """

    event: str
    old: MicroBatchPlan
    new: MicroBatchPlan
    reason: str

    def as_dict(self) -> dict:
        return {"event": self.event, "old": str(self.old), "new": str(self.new), "reason": self.reason}


class PlanController:
    """Owns the current micro-batch plan and changes it on OOM or after OOM-free windows.

    Shrinking halves the micro-batch (the largest divisor of the per-rank batch at most half the
    current one) and doubles accumulation, so ``micro × accumulation × world_size`` stays the
    global batch. At micro-batch 1 it turns activation checkpointing on (when the setting is
    ``auto``); past that it raises :class:`OOMStop`. After ``grow_back_window`` OOM-free steps it
    tries the next larger micro-batch (never above the configured one); if that fails, the window
    doubles (exponential back-off, as Composer does for its auto-microbatching).

    Args:
        configured: the plan from the config (the ceiling for grow-back).
        per_rank_batch: samples per rank per step.
        activation_checkpointing: ``off|on|auto``.
        grow_back_window: OOM-free steps before a grow-back try (0 = never).
    """

    def __init__(self, configured: MicroBatchPlan, per_rank_batch: int, activation_checkpointing: str,
                 grow_back_window: int):
        self.configured = configured
        self.plan = configured
        self.per_rank_batch = per_rank_batch
        self.ac_mode = activation_checkpointing
        self.activation_checkpointing = activation_checkpointing == "on"
        self.window = grow_back_window
        self.ok_steps = 0
        self.trying_grow = False

    def _with_micro(self, micro: int) -> MicroBatchPlan:
        return MicroBatchPlan(micro, self.per_rank_batch // micro)

    def capped(self, longest: int, max_frames: int) -> MicroBatchPlan:
        """The plan for a step whose longest sample is ``longest`` frames: the largest micro-batch
        at most the current one with ``micro_batch_size × longest <= max_frames`` (at least 1).
        The same on every rank when ``longest`` is taken over the global batch."""
        fitting = [d for d in self._divisors() if d <= self.plan.micro_batch_size and d * longest <= max_frames]
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
            self.plan = self._with_micro(max(d for d in self._divisors() if d < old.micro_batch_size))
            return PlanChange("grow_back_failed", old, self.plan, f"OOM in {where} at {old}; next try in {self.window} steps")
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

    def on_success(self) -> PlanChange | None:
        """A step completed; returns a grow-back change when the window is full."""
        self.trying_grow = False
        self.ok_steps += 1
        if self.window <= 0 or self.plan.micro_batch_size >= self.configured.micro_batch_size or self.ok_steps < self.window:
            return None
        larger = [d for d in self._divisors() if self.plan.micro_batch_size < d <= self.configured.micro_batch_size]
        old = self.plan
        self.plan = self._with_micro(min(d for d in larger if d >= 2 * old.micro_batch_size) if any(
            d >= 2 * old.micro_batch_size for d in larger) else max(larger))
        self.ok_steps = 0
        self.trying_grow = True
        return PlanChange("grow_back", old, self.plan, f"{self.window} steps without OOM")

    def _divisors(self) -> list[int]:
        return [d for d in range(1, self.per_rank_batch + 1) if self.per_rank_batch % d == 0]

    def state_dict(self) -> dict:
        """The plan state for checkpoints (restored on resume)."""
        return {"micro_batch_size": self.plan.micro_batch_size, "window": self.window, "ok_steps": self.ok_steps,
                "activation_checkpointing": self.activation_checkpointing}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s plan. On another world size the per-rank batch may change:
        the largest micro-batch dividing it, at most the saved one, is taken."""
        self.plan = self._with_micro(max(d for d in self._divisors() if d <= state["micro_batch_size"]))
        self.trying_grow = False
        self.window, self.ok_steps = state["window"], state["ok_steps"]
        self.activation_checkpointing = state["activation_checkpointing"]


def memory_report(model, optimizer) -> dict[str, int]:
    """Bytes held by parameters, gradients and optimizer state on this rank (local shards for
    sharded engines), plus peak memory so far.

    Returns:
        ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes``, ``peak_memory_bytes``.
    """
    def local(t):
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    opt_bytes = 0
    for state in getattr(optimizer, "state", {}).values():
        opt_bytes += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor))
    device = params[0].device if params else torch.device("cpu")
    return {
        "parameter_bytes": sum(local(p) for p in params),
        "gradient_bytes": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": opt_bytes,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
