"""The optimizer and the learning-rate schedule, built from ``training.*``."""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.errors import CheckpointError, ConfigError


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def make_optimizer(model: nn.Module, tcfg, state_dtype: str = "fp32") -> torch.optim.Optimizer:
    """AdamW (``training.lr``, ``adam_beta1/2``, ``adam_eps``, ``weight_decay``); weight decay on matrices only
    (not biases, norms or other 1-D parameters). When every parameter is a float tensor on a CUDA
    device or the CPU the fused kernel steps them (``fused=True``: one kernel for every tensor, as
    torchtitan does on CUDA; on the CPU, 0.43 ms instead of 2.4 ms per step for a 0.27M-parameter
    GPT-2 and 9 ms instead of 46 ms for 14M, one core); DeepSpeed builds its optimizer from this
    one (ZeRO-1/2/3 step it on their flat partitions; offload steps with DeepSpeed's own CPU Adam).

    Args:
        state_dtype: ``optimizer.state_dtype``: ``fp32`` (torch's AdamW), ``bf16``
            (:class:`AdamWBf16States`) or ``int8`` (torchao's ``AdamW8bit``).

    Raises:
        memtrain.errors.ConfigError: ``int8`` without torchao installed.
    """
    groups = weight_decay_groups(model, tcfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    hyper = dict(lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2), eps=tcfg.adam_eps)
    if state_dtype == "bf16":
        return AdamWBf16States(groups, **hyper)
    if state_dtype == "int8":
        return _adamw_8bit(groups, hyper)
    fused = bool(params) and all(p.device.type in ("cuda", "cpu") and p.dtype in _FUSED_DTYPES for p in params)
    return torch.optim.AdamW(groups, **hyper, fused=fused or None)


PROBE_ELEMENTS = 4096
"""Elements of the probe tensor :func:`state_bytes_per_element` steps a user's optimizer on."""


def user_optimizer(factory: Callable[[list[dict]], torch.optim.Optimizer], model: nn.Module,
                   tcfg) -> torch.optim.Optimizer:
    """A Python caller's ``optimizer_factory(param_groups)`` (:class:`memtrain.api.Trainer`) over
    ``model``'s trainable parameters in :func:`weight_decay_groups` (matrices decayed by
    ``training.weight_decay``, the rest not), called after the engine has moved, wrapped or
    sharded the model (under FSDP2 the parameters are DTensor shards).

    Raises:
        memtrain.errors.ConfigError: the factory returned no ``torch.optim.Optimizer`` (field ``optimizer_factory``).
    """
    return _called(factory, weight_decay_groups(model, tcfg.weight_decay))


def _called(factory: Callable[[list[dict]], torch.optim.Optimizer], groups: list[dict]) -> torch.optim.Optimizer:
    """``factory(groups)``, checked to be a ``torch.optim.Optimizer`` (else ConfigError ``optimizer_factory``)."""
    optimizer = factory(groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("optimizer_factory", f"returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


def state_bytes_per_element(factory: Callable[[list[dict]], torch.optim.Optimizer]) -> float:
    """Bytes of state ``factory``'s optimizer keeps per parameter element: built over one fp32 probe
    tensor of :data:`PROBE_ELEMENTS` elements on the CPU, stepped twice, and the state tensors it
    keeps of the probe's size counted (scalars such as Adam's step count are not per element):
    SGD with momentum 4 (its buffer), AdamW 8 (two moments), SGD without momentum 0. What the
    planner counts for a Python caller's optimizer.

    Raises:
        memtrain.errors.ConfigError: the factory returned no ``torch.optim.Optimizer``.
    """
    probe = nn.Parameter(torch.zeros(PROBE_ELEMENTS))
    optimizer = _called(factory, [{"params": [probe], "weight_decay": 0.0}])
    for _ in range(2):
        probe.grad = torch.full_like(probe, 1e-3)
        optimizer.step()
    held = [t for t in optimizer.state[probe].values() if isinstance(t, torch.Tensor) and t.numel() == probe.numel()]
    return sum(t.numel() * t.element_size() for t in held) / probe.numel()


def user_scheduler(factory: Callable, optimizer: torch.optim.Optimizer):
    """A Python caller's ``scheduler_factory(optimizer)``: a ``torch.optim.lr_scheduler``
    scheduler, stepped once per optimizer step and saved with its state in checkpoints.

    Raises:
        memtrain.errors.ConfigError: what it returned lacks a scheduler's methods (field ``scheduler_factory``).
    """
    scheduler = factory(optimizer)
    missing = [m for m in ("step", "state_dict", "load_state_dict", "get_last_lr")
               if not callable(getattr(scheduler, m, None))]
    if missing:
        raise ConfigError("scheduler_factory", f"returned {type(scheduler).__name__} without {', '.join(missing)} "
                          "(a torch.optim.lr_scheduler.LRScheduler has them)")
    try:
        needed = [p.name for p in inspect.signature(scheduler.step).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # a step whose signature Python cannot read (built in C): taken as it is
        needed = []
    if needed:  # ReduceLROnPlateau's step(metrics)
        raise ConfigError("scheduler_factory", f"returned {type(scheduler).__name__}, whose step() needs "
                          f"{', '.join(needed)}; memtrain steps the schedule once per optimizer step with no "
                          "argument: return a step-based scheduler (LambdaLR, StepLR, CosineAnnealingLR, …)")
    return scheduler


def _adamw_8bit(groups: list[dict], hyper: dict) -> torch.optim.Optimizer:
    """torchao's 8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
    Quantization": each moment in blocks of 256 int8 codes with one fp32 scale; tensors under 4096
    elements stay fp32). Its learning rate is a tensor, which torch's LR schedulers fill in place.

    Raises:
        memtrain.errors.ConfigError: torchao is not installed.
    """
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ConfigError("optimizer.state_dtype", f"int8 needs torchao ({e}): pip install 'memtrain[lowbit]', "
                          "or choose fp32 or bf16") from None
    return AdamW8bit(groups, **hyper)


class AdamWBf16States(torch.optim.AdamW):
    """AdamW whose two moments are kept in bf16: 4 bytes per parameter instead of 8. Each step
    reads them into fp32, updates them and the parameter in fp32 (torch's AdamW math: decoupled
    weight decay, bias correction) and stores them rounded to nearest; the parameters stay in
    their own dtype. ``state_dict`` is torch's; ``load_state_dict`` keeps the moments in bf16
    (torch's casts them to the parameter's dtype). Lossy: the moments lose 16 bits of mantissa
    every step, so a decay 1 - ``beta2`` below half a bf16 step is lost (validation refuses
    ``adam_beta2`` above 0.99). The idea of bf16 optimizer states as in torchao's low-bit
    optimizers; the update here is torch's, in fp32.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then the moments back in bf16."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, self.state[p], lr, beta1, beta2, eps, decay)
        return loss

    @staticmethod
    def _step_one(p, state: dict, lr: float, beta1: float, beta2: float, eps: float, decay: float) -> None:
        """One parameter's AdamW update with bf16 moments (``state`` initialised on first use), on
        its local tensors (an FSDP2 DTensor's shard), :data:`BF16_STEP_CHUNK` elements at a time."""
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        scale = (lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step))
        tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
        if not all(t.is_contiguous() for t in tensors):
            return _adamw_bf16(*tensors, lr * decay, beta1, beta2, eps, scale)
        flat = [t.view(-1) for t in tensors]
        for i in range(0, flat[0].numel(), BF16_STEP_CHUNK):
            _adamw_bf16(*(t[i:i + BF16_STEP_CHUNK] for t in flat), lr * decay, beta1, beta2, eps, scale)


BF16_STEP_CHUNK = 1 << 24
"""Elements :class:`AdamWBf16States` updates at once: its fp32 temporaries (about 12 bytes per
element) are those of one chunk (192 MiB), not of the largest parameter (an embedding of 128k ×
4096 would need 6 GiB)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (its storage: in-place updates reach it), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _adamw_bf16(p, grad, exp_avg, exp_avg_sq, lr_decay: float, beta1: float, beta2: float, eps: float,
                scale: tuple[float, float]) -> None:
    """torch's AdamW update of ``p`` in fp32 with bf16 moments stored rounded to nearest
    (``scale``: the step size over the first bias correction, the square root of the second)."""
    grad = grad.float()
    m = exp_avg.float().lerp_(grad, 1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    update = m.div_(v.sqrt_().div_(scale[1]).add_(eps)).mul_(scale[0])
    p.mul_(1 - lr_decay).sub_(update.to(p.dtype))


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two optimizer groups: matrices (ndim ≥ 2) with ``weight_decay``,
    then biases, norms and other 1-D parameters without (the usual AdamW recipe: nanoGPT,
    transformers' Trainer). ZeRO keeps one flat partition per group. A parameter ZeRO-3 has
    partitioned already (``model.pretrained`` built under ``zero.Init``) is judged by its full shape
    (``ds_shape``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = lambda p: len(getattr(p, "ds_shape", p.shape)) >= 2  # noqa: E731 - a ZeRO-3 partition is flat
    return [{"params": [p for p in params if matrix(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not matrix(p)], "weight_decay": 0.0}]


def apply_hyperparameters(optimizer, tcfg) -> None:
    """Write this run's ``adam_beta1/2``, ``adam_eps`` and ``weight_decay`` into a restored
    optimizer's groups (``load_state_dict`` brings back the checkpoint's): the first group is the
    decayed one (:func:`weight_decay_groups`; DeepSpeed keeps the order), the others keep none.
    A DeepSpeed JSON's optimizer section sets its own values, filled from these where ``auto``."""
    for i, group in enumerate(optimizer.param_groups):
        if "betas" in group:
            group["betas"] = (tcfg.adam_beta1, tcfg.adam_beta2)
        if "eps" in group:
            group["eps"] = tcfg.adam_eps
        if "weight_decay" in group:
            group["weight_decay"] = tcfg.weight_decay if i == 0 else 0.0


def lr_lambda(tcfg):
    """Multiplier of the peak LR after ``step`` optimizer steps: linear warmup over
    ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def f(step: int) -> float:
        if step < tcfg.warmup_steps:
            return (step + 1) / tcfg.warmup_steps
        progress = min(1.0, (step - tcfg.warmup_steps) / max(1, tcfg.max_steps - tcfg.warmup_steps))
        return tcfg.min_lr_ratio + (1 - tcfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def make_scheduler(optimizer: torch.optim.Optimizer, tcfg, deepspeed_scheduler: Optional[dict] = None):
    """The LR schedule, stepped once per optimizer step: memtrain's warmup + cosine
    (:func:`lr_lambda`), or the ``scheduler`` section of the user's DeepSpeed JSON
    (``{"type": ..., "params": {...}}``, resolved by :mod:`memtrain.backends.ds_config`) as
    :class:`DeepSpeedSchedule`."""
    if deepspeed_scheduler is not None:
        return DeepSpeedSchedule(optimizer, deepspeed_scheduler)
    return WarmupCosine(optimizer, lr_lambda(tcfg))


class WarmupCosine(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` over :func:`lr_lambda` whose restored state takes this run's schedule.

    ``LambdaLR.load_state_dict`` brings back the saved run's peak rates (``base_lrs``) and last
    rates; a resume that changes ``training.lr``, ``warmup_steps``, ``min_lr_ratio`` or
    ``max_steps`` (allowed: :mod:`memtrain.checkpoint.compat`) would train on at the old schedule.
    Here only the step count is restored, and the rates are this run's schedule at that step.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count; the peak rates and the rates are this run's schedule's.

        Raises:
            CheckpointError: the state is a DeepSpeed JSON schedule's (the schedule changed).
        """
        if "last_batch_iteration" in state_dict:
            raise CheckpointError("the checkpoint's LR schedule is the DeepSpeed JSON's scheduler section, this run's "
                                  "is memtrain's warmup + cosine: resume with the same DeepSpeed JSON")
        base_lrs = list(self.base_lrs)
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs
        self._last_lr = [base * f(self.last_epoch) for base, f in zip(self.base_lrs, self.lr_lambdas)]


class DeepSpeedSchedule:
    """One of DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` from
    ``deepspeed.runtime.lr_schedules``) with the interface of a torch LR scheduler.

    DeepSpeed's classes set the optimizer's learning rates when built (iteration -1: the warmup's
    start) and on ``step()``; their state is the iteration count. ``load_state_dict`` here also
    writes the restored iteration's rates into the optimizer (DeepSpeed's own does not), so a
    resumed run's first step uses the same rate as the run that never stopped.

    Args:
        optimizer: the optimizer whose ``param_groups`` the schedule sets.
        spec: ``{"type": name, "params": {...}}`` with every value resolved (no ``"auto"``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, spec: dict):
        import logging

        from deepspeed.runtime import lr_schedules

        ds_logger = logging.getLogger("DeepSpeed")
        level = ds_logger.level
        ds_logger.setLevel(logging.ERROR)  # "getting the learning rate before it has started": by design here
        try:
            self.schedule = getattr(lr_schedules, spec["type"])(optimizer, **spec.get("params", {}))
        finally:
            ds_logger.setLevel(level)
        self.optimizer = optimizer

    def step(self) -> None:
        """Advance one optimizer step (sets the optimizer's rates)."""
        self.schedule.step()

    def get_last_lr(self) -> list[float]:
        """The rate of each parameter group for the coming optimizer step."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        """``{"last_batch_iteration": n}`` (DeepSpeed's own state)."""
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration and write its rates into the optimizer.

        Raises:
            CheckpointError: the state is memtrain's warmup + cosine schedule's (the schedule changed).
        """
        if "last_batch_iteration" not in state:
            raise CheckpointError("the checkpoint's LR schedule is memtrain's warmup + cosine, this run's is the "
                                  "DeepSpeed JSON's scheduler section: resume without it, or start a new run")
        self.schedule.load_state_dict(state)
        if state["last_batch_iteration"] >= 0:
            self.schedule.step(state["last_batch_iteration"])  # writes that iteration's rates
