"""The process state: who this process is (rank, world size, device) and the few collectives the
loop itself needs, separate from the engine that trains the model.

It is built first, before data and model (the engine is chosen later, once the model exists).
Accelerate's ``PartialState`` starts the process group from the launcher's environment (torchrun,
``accelerate launch``, the DeepSpeed launcher: nccl on GPU, gloo on CPU); plain ``python`` is a
one-process run with no group until an engine that needs one asks for it (:meth:`ensure_group`).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist


class ProcessState:
    """Rank, world size and device of this process, and its collectives.

    Args:
        cpu: run on CPU even where CUDA is present.

    Attributes:
        rank: 0 … world_size-1.
        world_size: number of processes.
        device: where the model and batches live (``cuda:LOCAL_RANK`` or ``cpu``).
        is_main: rank 0 (writes metrics, commits checkpoints, exports).
    """

    def __init__(self, cpu: bool = False):
        from accelerate import PartialState

        self._state = PartialState(cpu=cpu)
        self.rank: int = self._state.process_index
        self.world_size: int = self._state.num_processes
        self.device: torch.device = self._state.device
        self.is_main: bool = self._state.is_main_process

    def ensure_group(self) -> None:
        """Start a one-process group when none is up (plain ``python`` with a sharded engine, which
        needs a group even alone); also sets the launcher variables DeepSpeed reads."""
        if dist.is_initialized():
            return
        kwargs = {}
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            kwargs["device_id"] = torch.device("cuda", index)
        dist.init_process_group("gloo" if self.device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0,
                                world_size=1, **kwargs)
        for var, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(var, value)

    def cap_cuda_memory(self, gib: float) -> None:
        """Limit this process's CUDA memory to ``gib`` GiB (``torch.cuda.set_per_process_memory_fraction``),
        to reproduce a smaller GPU. No-op for ``gib <= 0`` or on CPU."""
        if gib <= 0 or self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)

    # -- collectives (every rank calls them at the same point) ----------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one all-reduce of MAX)."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait for all ranks."""
        if self.world_size > 1:
            dist.barrier()

    def main_process_first(self) -> AbstractContextManager:
        """Run the body on rank 0 first, then on the others (for building caches)."""
        return self._state.main_process_first()

    def close(self) -> None:
        """Tear the process group down. Left to interpreter exit, communicator threads can abort the
        process ('terminate called without an active exception'). No barrier: after an error on one
        rank it would hang; the others' pending collectives fail instead."""
        if dist.is_initialized():
            dist.destroy_process_group()
