"""The optimizer and the learning-rate schedule, built from ``training.*``."""

from __future__ import annotations

import math

import torch
from torch import nn


def make_optimizer(model: nn.Module, tcfg) -> torch.optim.Optimizer:
    """AdamW (``training.lr``, ``adam_beta1/2``, ``weight_decay``); weight decay on matrices only
    (not biases, norms or other 1-D parameters). When every parameter is on a CUDA device (DDP,
    FSDP2) the fused kernel steps them (``fused=True``, one launch instead of one per tensor
    group, as torchtitan does); DeepSpeed builds its optimizer from this one on CPU and steps with
    its own kernels."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    params = decay + no_decay
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2), fused=fused or None,
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


def make_scheduler(optimizer: torch.optim.Optimizer, tcfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The warmup + cosine schedule (:func:`lr_lambda`), stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg))
