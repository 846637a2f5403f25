"""DDP through HuggingFace Accelerate (also the single-process case).

Accelerate owns the process group (nccl on GPU, gloo on CPU), the device, autocast and the
fp16 GradScaler; this class adapts it to :class:`memtrain.backends.base.Backend`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn


class DDPBackend:
    """Data parallel: every rank holds the whole model; gradients are averaged by all-reduce
    on the last micro-batch of each step (``no_sync`` on the others).

    Args:
        precision: resolved ``bf16|fp16|fp32``.
        cpu: force CPU even where CUDA is present.
    """

    name = "ddp"

    def __init__(self, precision: str, cpu: bool = False):
        from accelerate import Accelerator

        self.precision = precision
        self.accelerator = Accelerator(cpu=cpu, mixed_precision="no" if precision == "fp32" else precision)
        self.rank = self.accelerator.process_index
        self.world_size = self.accelerator.num_processes
        self.device = self.accelerator.device
        self.is_main = self.accelerator.is_main_process
        # DDP divides the all-reduced gradient sum by world_size
        self.grad_average_factor = float(self.world_size)

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        model = model.to(self.device)
        optimizer = make_optimizer(model)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        return model, optimizer

    def sync_context(self, model: nn.Module, sync: bool):
        return contextlib.nullcontext() if sync else self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_and_step(self, model: nn.Module, optimizer, max_norm: float) -> float:
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def main_process_first(self):
        return self.accelerator.main_process_first()

    def close(self) -> None:
        """Release the Accelerate state (so another run can start in the same process)."""
        self.accelerator.end_training()
