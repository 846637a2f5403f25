"""FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by memtrain itself.

Accelerate does not turn FSDP on for CPU processes, so memtrain shards the model directly —
``fully_shard`` on every repeated block, then on the root, as torchtitan does — over a 1-D
device mesh of all ranks. The same code runs on CPU (gloo) and GPU (nccl); Accelerate still
owns the process group and the device.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.backends.common import ensure_process_group, repeated_blocks

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


class FSDPBackend:
    """Fully sharded data parallel: parameters, gradients and optimizer state are sharded over
    all ranks; blocks are all-gathered for their forward and backward, gradients reduce-scattered.

    Args:
        precision: ``bf16|fp32`` (parameters cast to it for compute; gradients reduced in fp32).
        cpu: run on CPU even where CUDA is present.
        reshard_after_forward: free gathered parameters after forward (less memory).
        offload: ``none`` or anything else = CPUOffloadPolicy (parameters, gradients and
            optimizer state live in CPU memory; the optimizer steps on CPU).

    Raises:
        ValueError: fp16 (needs a sharded GradScaler memtrain does not wire up yet).
    """

    name = "fsdp"

    def __init__(self, precision: str, cpu: bool = False, reshard_after_forward: bool = True, offload: str = "none"):
        from accelerate import PartialState
        from torch.distributed.device_mesh import init_device_mesh

        if precision == "fp16":
            raise ValueError("precision: fp16 is not supported with backend.name fsdp; choose bf16 or fp32")
        self.precision = precision
        self.state = PartialState(cpu=cpu)
        self.rank = self.state.process_index
        self.world_size = self.state.num_processes
        self.device = self.state.device
        self.is_main = self.state.is_main_process
        self.reshard_after_forward = reshard_after_forward
        self.offload = offload
        ensure_process_group(self.device)  # plain `python`: a one-rank group
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self._async_group = None  # process group of background checkpoint writes (made on first use)
        self.grad_average_factor = float(self.world_size)  # reduce-scatter averages over ranks
        self.collectives_in_compute = self.world_size > 1  # all-gather in forward, reduce-scatter in backward

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.offload == "none":
            model = model.to(self.device)
        kwargs = dict(
            mesh=self.mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=_DTYPES[self.precision], reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy() if self.offload != "none" else OffloadPolicy(),
        )
        for block in repeated_blocks(model):
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
        # the root is gathered for the whole step anyway (embeddings, head): no resharding after forward
        fully_shard(model, reshard_after_forward=False, **kwargs)
        return model, make_optimizer(model)

    def sync_context(self, model: nn.Module, sync: bool):
        # non-final micro-batches keep unsharded gradients and skip the reduce-scatter
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def set_plan(self, plan) -> None:
        """Nothing to tell FSDP2: the plan lives in the loop."""

    def reset_after_oom(self, model: nn.Module) -> None:
        """Make the retry legal: reset FSDP2's per-iteration state (reshard, drop in-flight
        reductions; ``FSDPModule.reset_iter_state``), drop partial gradients, free the cache."""
        from torch.distributed.fsdp import FSDPModule

        if hasattr(model, "reset_iter_state"):  # torch >= 2.13
            model.reset_iter_state()
        else:
            _reset_iter_state_before_2_13(model)
        model.set_requires_gradient_sync(True)
        # reset_iter_state keeps the unsharded gradients that no_sync micro-batches accumulated
        # (torch 2.13); a retry must not add the failed attempt's partial sums to its own
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in _param_groups(module._get_fsdp_state()):
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.unsharded_accumulated_grad = None
                        if hasattr(fsdp_param, "_unsharded_param"):
                            fsdp_param._unsharded_param.grad = None
        for p in model.parameters():
            p.grad = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_and_step(self, model: nn.Module, optimizer, max_norm: float, skip: bool = False) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm of the sharded gradients, same on every rank
            norm = norm.full_tensor()
        norm = float(norm)
        if not skip and math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def loss_scale(self):
        return None  # fp16 is refused for FSDP2

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def full_state_dict(self, model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.is_main else None

    checkpoint_format = "dcp"

    def save_state(self, model: nn.Module, optimizer, directory: str, max_shard_size: str = "5GB",
                   async_save: bool = False):
        """torch.distributed.checkpoint into ``directory/dcp``: every rank writes its own shard
        file (``__RANK_0.distcp``), rank 0 the ``.metadata``. ``async_save``: stage to CPU, write in
        a background thread over a separate gloo group, return the future."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        path = os.path.join(directory, "dcp")
        if async_save:
            if self._async_group is None:  # a collective: every rank gets here at the same save
                self._async_group = torch.distributed.new_group(backend="gloo")
            return dcp.async_save(state, checkpoint_id=path, process_group=self._async_group)
        dcp.save(state, checkpoint_id=path)
        return None

    def expected_files(self) -> list[str]:
        return ["dcp/.metadata"] + [f"dcp/__{r}_*.distcp" for r in range(self.world_size)]

    def load_state(self, model: nn.Module, optimizer, directory: str, saved_world_size: int) -> None:
        """Load the DCP shards into this run's sharding; torch.distributed.checkpoint reshards, so
        the saved world size may differ from this one."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def replicated_tensors(self, model: nn.Module):
        return list(model.named_buffers())  # parameters are sharded DTensors

    def barrier(self) -> None:
        torch.distributed.barrier()

    def main_process_first(self):
        return self.state.main_process_first()

    def close(self) -> None:
        """Tear the process group down (left to interpreter exit, communicator threads can abort
        the process: 'terminate called without an active exception'). The run ends with a barrier
        on success; after an error the other ranks' pending collectives fail instead of hanging."""
        if torch.distributed.is_initialized():  # no barrier: after an error on one rank it would hang
            torch.distributed.destroy_process_group()


def _param_groups(state) -> list:
    """An FSDP state's parameter groups (a list from torch 2.13 on, a single optional group before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _reset_iter_state_before_2_13(model: nn.Module) -> None:
    """What ``FSDPModule.reset_iter_state`` (torch 2.13) does, for older torch: wait for and drop
    in-flight collectives, reshard every parameter group, clear the per-iteration trackers."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    root = model._get_fsdp_state()
    comm = root._comm_ctx
    comm.all_gather_state = None
    comm.reduce_scatter_state = None
    for attr in ("reduce_scatter_states",):
        if hasattr(comm, attr):
            getattr(comm, attr).clear()
    if hasattr(comm, "post_forward_order"):
        comm.post_forward_order.clear()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        state._training_state = TrainingState.IDLE
        if hasattr(state, "_modules_to_run_forward"):
            state._modules_to_run_forward.clear()
        for group in _param_groups(state):
            if hasattr(group, "_all_gather_result"):
                group._all_gather_result = None
            if hasattr(group, "_post_reduce_event"):
                group._post_reduce_event = None
            if hasattr(group, "_all_reduce_state"):
                group._all_reduce_state = None
            if hasattr(group, "_partial_reduce_output"):
                group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root._state_ctx.iter_forward_root = None
    root._state_ctx.post_backward_final_callback_queued = False
