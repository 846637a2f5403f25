"""FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by memtrain itself.

Accelerate does not turn FSDP on for CPU processes, so memtrain shards the model directly —
``fully_shard`` on every repeated block, then on the root, as torchtitan does — over a 1-D
device mesh of all ranks. The same code runs on CPU (gloo) and GPU (nccl); Accelerate still
owns the process group and the device.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.backends.base import ComputeCollectives
from memtrain.backends.common import (OffloadTime, ThroughItsFormat, load_full_state, load_full_state_as_read,
                                      offload_advice, offload_words, refuse_deepspeed_settings)
from memtrain.backends.common import selective_checkpointing_works as takes_selective_checkpointing  # noqa: F401
from memtrain.backends.common import whole_model_build_context as model_build_context  # noqa: F401 (registry)
from memtrain.backends.spec import EngineVariant
from memtrain.checkpoint.formats import SHARDED_MODULE, CheckpointState
from memtrain.distributed import ProcessState
from memtrain.errors import ConfigError
from memtrain.memory.accounting import (fsdp_state_bytes, offloaded_parameter_count, sharded_optimizer_bytes,
                                        with_optimizer_element_bytes)
from memtrain.memory.moments import parameter_element_bytes
from memtrain.memory.shape import ModelShape, model_shape
from memtrain.memory.machine import HOST_DEVICE_BYTES_PER_S, Machine
from memtrain.models import repeated_blocks
from memtrain.backends.optimizer_offload import from_optimizer

CHECKPOINT_FORMAT = "dcp"
"""The checkpoint format it writes unless handed another (:mod:`memtrain.checkpoint.formats`)."""
CHECKPOINT_MODEL = SHARDED_MODULE
"""The model its ``checkpoint_state`` hands a format: ``fully_shard``'s module of DTensors."""
OFFLOAD_STATE_DTYPES = ("fp32", "bf16")
"""The optimizer state dtypes the optimizer offload keeps (:mod:`memtrain.backends.optimizer_offload`)."""
VARIANTS = (EngineVariant("fsdp", "fsdp"),
            EngineVariant("fsdp_offload_optimizer", "fsdp", offload="optimizer", state_dtypes=OFFLOAD_STATE_DTYPES),
            EngineVariant("fsdp_offload_optimizer_partial", "fsdp", offload="optimizer", offload_optimizer_ratio=0.5,
                          tune_ratio=True, state_dtypes=OFFLOAD_STATE_DTYPES),
            EngineVariant("fsdp_offload", "fsdp", offload="optimizer_and_params"))
"""FSDP2's placements: sharded on the device; the optimizer state on the host, all of it or the
fraction the placement planner chooses (:mod:`memtrain.backends.optimizer_offload`); everything on the host
(``CPUOffloadPolicy``)."""
LOSSY_OPTIMIZER_STATE = True
"""FSDP2 takes bf16 and int8 optimizer state (:mod:`memtrain.levers.optimizer_state`)."""
SHARDS_OPTIMIZER_STATE = True
"""Each rank holds and steps its shard of the optimizer state."""
SETTINGS = ("reshard_after_forward",)
"""The engine settings that are levers (:mod:`memtrain.levers.engine_settings`)."""
READS_DEEPSPEED_CONFIG = False
"""Whether ``backend.deepspeed_config`` (the user's DeepSpeed JSON) sets this engine's stage and offload."""
AUTOCAST_MIXED_PRECISION = False
"""Mixed precision as the trace computes it: FSDP2's ``MixedPrecisionPolicy``: parameters gathered in the compute dtype."""
STEPS_USER_OPTIMIZER = True
"""A Python caller's optimizer (``optimizer_factory``) is stepped as it is, where nothing is offloaded
(:data:`OWN_OPTIMIZER`)."""
OWN_OPTIMIZER = "FSDP2's optimizer offload steps its own AdamW on the host"
"""Where it steps an optimizer of its own instead of a caller's."""
ASYNC_SAVE = True
"""Its save can write in the background (``checkpoint.async_save``: ``dcp.async_save``)."""


def offload_ratio(shape: ModelShape, ratio: float) -> float:
    """The share of the optimizer state's elements on the host when ``ratio`` is asked for: memtrain's
    optimizer offload holds whole parameters, the last of the model
    (:func:`memtrain.memory.accounting.offloaded_parameter_count` of ``shape.numels``), so the
    share is what those hold (``ratio`` itself when the shape has no per-parameter counts)."""
    if not shape.numels:
        return ratio
    count = offloaded_parameter_count(list(shape.numels), ratio)
    return sum(shape.numels[len(shape.numels) - count:]) / sum(shape.numels) if count else 0.0


def variant_label(zero_stage) -> str:
    """The engine's word in a placement's name (``memtrain plan``'s table)."""
    return "fsdp"


def validate(cfg) -> None:
    """The ``backend`` settings FSDP2 cannot honour, by name (:func:`memtrain.validation.validate`).

    Raises:
        memtrain.errors.ConfigError: an NVMe offload, ``offload_optimizer_ratio`` without
            ``offload optimizer``, int8 moments under it, or a DeepSpeed setting.
    """
    b = cfg.backend
    if b.offload == "optimizer" and cfg.optimizer.state_dtype not in OFFLOAD_STATE_DTYPES:
        raise ConfigError("optimizer.state_dtype", f"{cfg.optimizer.state_dtype} cannot be offloaded by FSDP2's optimizer "
                          f"offload (backend.offload optimizer): choose {' or '.join(OFFLOAD_STATE_DTYPES)}")
    if b.nvme_path:
        raise ConfigError("backend.nvme_path", "NVMe offload is DeepSpeed's (ZeRO-3); FSDP2 offloads to host memory")
    if b.offload_optimizer_ratio != 1.0 and b.offload not in ("optimizer", "auto"):
        raise ConfigError("backend.offload_optimizer_ratio", f"is the share of the optimizer state on the host under "
                          f"backend.offload optimizer, but backend.offload is {b.offload}")
    refuse_deepspeed_settings(b, "fsdp")


def state_bytes(n_params: int, precision: str, *, offload: str, world_size: int, shape: ModelShape, state_dtype: str,
                offload_optimizer_ratio: float = 1.0, **other) -> dict[str, int]:
    """FSDP2's bytes of model state per rank (the arguments and keys of
    :func:`memtrain.backends.model_state_bytes`; ``other``, DeepSpeed's settings and DDP's
    ``deferred_reduction``, unused)."""
    return fsdp_state_bytes(n_params, precision, offload, world_size, shape, state_dtype, offload_optimizer_ratio)


def optimizer_state_bytes(state_dtype: str, shape: ModelShape, world_size: int) -> int:
    """AdamW's moments per rank with ``state_dtype``: each rank holds its shard."""
    return sharded_optimizer_bytes(state_dtype, shape, world_size)


FORWARD_SHARE = 1 / 3
"""The forward's share of a step's compute (its backward computes twice as much): the time the host
part's CPU step can run beside the next forward."""


def export_bytes_per_parameter(precision: str, offload: str) -> int:
    """Bytes per parameter of the whole model the export gathers on rank 0's host: the sharded
    parameters' dtype (fp32, or the compute dtype under the optimizer offload)."""
    return parameter_element_bytes(precision) if offload == "optimizer" else 4


def offload_seconds(p, n_params: int, p_bytes: int, world_size: int, machine: Machine) -> OffloadTime:
    """What a step of placement ``p`` (a :class:`memtrain.planning.placement.Placement` with its
    plan set, ``predicted_step_s`` its compute, and an offload) spends beyond the device's compute;
    ``p_bytes``: bytes per element copied (the compute dtype's).

    - ``optimizer_and_params`` (``CPUOffloadPolicy``): torch's AdamW on the host at the machine's
      CPU Adam rate, parameters to the device and gradients back each micro-batch; nothing overlapped.
    - ``optimizer`` (:mod:`memtrain.backends.optimizer_offload`): the host part (``offload_optimizer_ratio``
      of the rank's shard) stepped at ``machine.host_step_params_per_s`` (the machine's ranks share
      its cores), its gradients out and parameters back; up to the next forward's time
      (:data:`FORWARD_SHARE` of the compute over the accumulation steps: the first micro-batch's)
      of it overlaps that forward, unit by unit, on a GPU
      (``backend.host_step_overlap``'s default there; on a CPU device nothing overlaps).
    """
    shard = n_params / world_size
    if p.offload != "optimizer":
        cpu = shard * machine.ranks_per_host / machine.cpu_adam_params_per_s
        copies = 3 * p_bytes * shard * p.gradient_accumulation_steps / HOST_DEVICE_BYTES_PER_S
        return OffloadTime(cpu, copies, cpu + copies)
    host = shard * p.offload_optimizer_ratio
    rate = machine.host_step_params_per_s or machine.cpu_adam_params_per_s
    cpu = host * machine.ranks_per_host / rate
    copies = 2 * p_bytes * host / HOST_DEVICE_BYTES_PER_S
    # the overlap's default: on a GPU, behind the next step's first forward (of its first micro-batch)
    hidden = p.predicted_step_s * FORWARD_SHARE / p.gradient_accumulation_steps if machine.device_type == "cuda" else 0.0
    return OffloadTime(cpu, copies, max(0.0, cpu + copies - hidden))


def stop_words(context: dict) -> str:
    """The engine in the OOM stop message's "Already on" (:func:`memtrain.oom.oom_stop_message`)."""
    return "engine fsdp" + offload_words(context)


def stop_advice(context: dict) -> list[str]:
    """What the OOM stop message suggests of the engine: the model state on the host."""
    return offload_advice(context)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


class FSDPBackend(ThroughItsFormat):
    """Fully sharded data parallel: parameters, gradients and optimizer state are sharded over
    all ranks; blocks are all-gathered for their forward and backward, gradients reduce-scattered.

    Args:
        process: the process state (its group is started here when plain ``python`` has none).
        precision: ``bf16|fp32`` (parameters cast to it for compute; gradients reduced in fp32).
        reshard_after_forward: free gathered parameters after forward (less memory).
        offload: ``none``; ``optimizer``: memtrain's optimizer offload
            (:class:`memtrain.backends.optimizer_offload.PartialOffloadAdamW`, ``offload_optimizer_ratio`` of
            it on the host, its CPU step overlapped with the next forward with ``host_step_overlap``);
            ``optimizer_and_params``: CPUOffloadPolicy (parameters, gradients and optimizer state
            live in CPU memory; the optimizer steps on CPU).

    Raises:
        ValueError: fp16 (needs a sharded GradScaler memtrain does not wire up yet).
    """

    name = "fsdp"
    supports_async_save = ASYNC_SAVE
    scheduler_config = None  # memtrain's warmup + cosine

    def __init__(self, process: ProcessState, precision: str, reshard_after_forward: bool = True,
                 offload: str = "none", optimizer_state_dtype: str = "fp32", offload_optimizer_ratio: float = 1.0,
                 host_step_overlap: bool = True):
        from torch.distributed.device_mesh import init_device_mesh

        if precision == "fp16":
            raise ValueError("precision: fp16 is not supported with backend.name fsdp; choose bf16 or fp32")
        self.process = process
        self.precision = precision
        self.world_size = process.world_size
        self.device = process.device
        self.reshard_after_forward = reshard_after_forward
        self.optimizer_state_dtype = optimizer_state_dtype
        self.optimizer_element_bytes: Optional[float] = None
        self.offload = offload
        self.offload_optimizer_ratio, self.host_step_overlap = offload_optimizer_ratio, host_step_overlap
        self.offload_optimizer = None  # memtrain's optimizer offload (offload optimizer), set in prepare
        process.ensure_group()  # plain `python`: a one-rank group
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self._async_group = None  # process group of background checkpoint writes (made on first use)
        self.shape: Optional[ModelShape] = None  # the model's element counts (set in prepare)
        self.grad_average_factor = float(self.world_size)  # reduce-scatter averages over ranks

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        """Shard every repeated block, then the root, as torchtitan does; ``offload optimizer``:
        the parameters in the compute dtype and :class:`memtrain.backends.optimizer_offload.PartialOffloadAdamW`
        over them, waiting in each unit's forward for the unit's host-stepped parameters."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.shape = model_shape(model)
        lean = self.offload == "optimizer"
        if self.offload == "none" or lean:
            model = model.to(self.device)
        if lean and _DTYPES[self.precision] is not None:  # 16-bit shards; the fp32 master is the optimizer's
            for p in model.parameters():  # parameters only: buffers (a rotary embedding's frequencies) keep fp32
                if p.is_floating_point():
                    p.data = p.data.to(_DTYPES[self.precision])
        kwargs = dict(
            mesh=self.mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=None if lean else _DTYPES[self.precision],
                                           reduce_dtype=torch.float32),
            # pinned host memory needs an accelerator: a CPU run's offloaded state is plain memory
            offload_policy=(CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                            if self.offload == "optimizer_and_params" else OffloadPolicy()),
        )
        blocks = repeated_blocks(model)
        for block in blocks:
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
        # the root is gathered for the whole step anyway (embeddings, head): no resharding after forward
        fully_shard(model, reshard_after_forward=False, **kwargs)
        optimizer = make_optimizer(model)
        if lean:
            optimizer = self.offload_optimizer = from_optimizer(optimizer, model, self.offload_optimizer_ratio,
                                                                self.host_step_overlap)
            optimizer.attach([model, *blocks])
            if self.process.is_main:
                logging.getLogger("memtrain").warning("memtrain: optimizer offload: %s", optimizer.describe())
        return model, optimizer

    def _settle(self) -> None:
        """Every parameter holds its updated value (the host part's step in flight finished)."""
        if self.offload_optimizer is not None:
            self.offload_optimizer.synchronize()

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Under the optimizer offload every micro-batch reduce-scatters its gradients and adds them
        to the sharded ones (in the parameters' dtype: 16 bits under bf16), so accumulating holds no
        whole-model gradient; otherwise only the last micro-batch reduces, the others keeping the
        unsharded gradients in fp32 (4 bytes per parameter: ``accumulation_gradient_bytes``)."""
        return self.offload == "optimizer"

    def compute_collectives(self, last_micro_batch: bool) -> ComputeCollectives:
        """All-gathers in every forward; in backward the re-gather of resharded blocks and the
        reduce-scatter: on the last micro-batch (``set_requires_gradient_sync`` skips it before),
        on every one under the optimizer offload (:attr:`reduces_every_micro_batch`)."""
        if self.world_size == 1:
            return ComputeCollectives(False, False)
        reduces = last_micro_batch or self.reduces_every_micro_batch
        return ComputeCollectives(True, reduces or self.reshard_after_forward)

    def reduction_context(self, model: nn.Module, reduce_gradients: bool):
        # non-final micro-batches keep unsharded gradients and skip the reduce-scatter, unless
        # every micro-batch reduces into the sharded gradients
        model.set_requires_gradient_sync(reduce_gradients or self.reduces_every_micro_batch)
        return contextlib.nullcontext()

    def set_plan(self, plan) -> None:
        """Nothing to tell FSDP2: the plan lives in the loop."""

    def discard_step(self, model: nn.Module) -> None:
        """Make the retry legal: reset FSDP2's per-iteration state (reshard, drop in-flight
        reductions; ``FSDPModule.reset_iter_state``), drop partial gradients, free the cache."""
        from torch.distributed.fsdp import FSDPModule

        model.reset_iter_state()  # torch >= 2.13 (pinned)
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

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def full_state_dict(self, model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._settle()
        if self.offload_optimizer is not None:  # room on the host for the whole model (the export's)
            self.offload_optimizer.release_buffers()
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.process.is_main else None

    def save_state(self, model: nn.Module, optimizer, directory: str, max_shard_size: str = "5GB",
                   async_save: bool = False):
        """The run's format writes :meth:`checkpoint_state` (the engine's default,
        :mod:`memtrain.checkpoint.formats.dcp`: every rank writes its own shard). ``async_save``:
        stage to CPU, write in a background thread over a separate gloo group, return the future."""
        self._settle()
        if async_save and self._async_group is None:  # a collective: every rank gets here at the same save
            self._async_group = torch.distributed.new_group(backend="gloo")
        return self.checkpoint_io.save(self.checkpoint_state(model, optimizer, max_shard_size), directory,
                                       self._async_group if async_save else None, async_save=async_save)

    def checkpoint_state(self, model: nn.Module, optimizer, max_shard_size: str = "5GB") -> CheckpointState:
        """The sharded module and its optimizer; every rank writes its shard."""
        return CheckpointState(model, optimizer, world_size=self.world_size, max_shard_size=max_shard_size)

    def load_state(self, model: nn.Module, optimizer, directory: str, saved_world_size: int) -> None:
        """Load the DCP shards into this run's sharding; torch.distributed.checkpoint reshards, so
        the saved world size may differ from this one."""
        self._settle()
        self.checkpoint_io.load(self.checkpoint_state(model, optimizer), directory)

    def load_full_state(self, model: nn.Module, optimizer, weights, optimizer_state, directory: str) -> None:
        """Another engine's state (:meth:`memtrain.backends.base.Backend.load_full_state`): every
        rank keeps its shard of the whole weights and optimizer state; without offload the read
        moments are cut and given to the optimizer as they are (no optimizer state built first:
        :func:`memtrain.backends.common.load_full_state_as_read`), with it through torch's
        ``set_state_dict``."""
        self._settle()
        if self.offload == "none" and self.offload_optimizer is None:
            load_full_state_as_read(model, optimizer, weights, optimizer_state)
        else:
            load_full_state(model, optimizer, weights, optimizer_state)
        if self.offload_optimizer is not None and not any("master" in s for s in optimizer_state.get("state", {}).values()):
            self.offload_optimizer.masters_from_parameters()  # another engine's AdamW keeps no master

    def replicated_tensors(self, model: nn.Module):
        return list(model.named_buffers())  # parameters are sharded DTensors

    def model_state_bytes(self, n_params: int) -> dict[str, int]:
        return with_optimizer_element_bytes(fsdp_state_bytes(n_params, self.precision, self.offload, self.world_size,
                                                             self.shape, self.optimizer_state_dtype,
                                                             self.offload_optimizer_ratio), self.optimizer_element_bytes)

    def close(self) -> None:
        """The optimizer offload's thread and hooks (the process group is the process state's)."""
        if self.offload_optimizer is not None:
            self.offload_optimizer.close()


def build(cfg, spec, process: ProcessState, precision: str, plan) -> FSDPBackend:
    """The FSDP2 engine of ``spec`` (its resharding and offload; an Accelerate FSDP config's are
    in the config already, :mod:`memtrain.launcher`).

    Raises:
        ValueError: fp16.
    """
    return FSDPBackend(process, precision, reshard_after_forward=spec.reshard_after_forward,
                       offload=spec.offload,
                       optimizer_state_dtype=plan.settings().get("optimizer_state_dtype", "fp32"),
                       offload_optimizer_ratio=spec.offload_optimizer_ratio,
                       host_step_overlap=(cfg.backend.host_step_overlap if cfg.backend.host_step_overlap is not None
                                          else process.device.type == "cuda"))


def _param_groups(state) -> list:
    """An FSDP state's parameter groups (torch 2.13's list; empty for a module without parameters)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    return list(groups) if groups is not None else []
