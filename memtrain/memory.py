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
