"""DDP through HuggingFace Accelerate (also the single-process case).

Accelerate owns the process group (nccl on GPU, gloo on CPU), the device, autocast and the
fp16 GradScaler; this class adapts it to :class:`memtrain.backends.base.Backend`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.backends.base import ComputeCollectives
from memtrain.backends.common import ThroughItsFormat, load_full_state_as_read, refuse_deepspeed_settings
from memtrain.backends.common import fp32_export_bytes as export_bytes_per_parameter  # noqa: F401 (registry)
from memtrain.backends.common import selective_checkpointing_works as takes_selective_checkpointing  # noqa: F401
from memtrain.backends.common import whole_model_build_context as model_build_context  # noqa: F401 (registry)
from memtrain.backends.spec import EngineVariant
from memtrain.checkpoint.formats import WHOLE_MODULE, CheckpointState
from memtrain.distributed import ProcessState
from memtrain.errors import ConfigError
from memtrain.memory.accounting import (DEFERRED_REDUCE_BUCKET_BYTES, ddp_state_bytes, replicated_optimizer_bytes,
                                        with_optimizer_element_bytes)
from memtrain.memory.shape import ModelShape, model_shape

CHECKPOINT_FORMAT = "safetensors"
"""The checkpoint format it writes unless handed another (:mod:`memtrain.checkpoint.formats`)."""
CHECKPOINT_MODEL = WHOLE_MODULE
"""The model its ``checkpoint_state`` hands a format: the user's module, whole on every rank (any
format whose ``SAVES`` holds it can be handed to DDP)."""
VARIANTS = (EngineVariant("ddp", "ddp"),)
"""DDP's one placement: everything replicated on the device."""
LOSSY_OPTIMIZER_STATE = True
"""DDP takes bf16 and int8 optimizer state (:mod:`memtrain.levers.optimizer_state`)."""
SHARDS_OPTIMIZER_STATE = False
"""Every rank holds and steps all of the optimizer state."""
SETTINGS = ()
"""The engine settings that are levers (:mod:`memtrain.levers.engine_settings`): none."""
READS_DEEPSPEED_CONFIG = False
"""Whether ``backend.deepspeed_config`` (the user's DeepSpeed JSON) sets this engine's stage and offload."""
AUTOCAST_MIXED_PRECISION = True
"""Mixed precision as the trace computes it: Accelerate's autocast: fp32 parameters, each matrix cast to the compute dtype on use."""
STEPS_USER_OPTIMIZER = True
"""A Python caller's optimizer (``optimizer_factory``) is stepped as it is, where nothing is offloaded."""
OWN_OPTIMIZER = ""
"""Where it steps an optimizer of its own instead of a caller's: nowhere."""
ASYNC_SAVE = False
"""Its save writes now, never in the background (``checkpoint.async_save`` is warned about, ignored)."""


def variant_label(zero_stage) -> str:
    """The engine's word in a placement's name (``memtrain plan``'s table)."""
    return "ddp"


def validate(cfg) -> None:
    """The ``backend`` settings DDP cannot honour, by name (:func:`memtrain.validation.validate`).

    Raises:
        memtrain.errors.ConfigError: an offload, ``nvme_path`` or a DeepSpeed setting
            (``reshard_after_forward false`` is its lever's: :class:`memtrain.levers.engine_settings.ReshardAfterForward`).
    """
    b = cfg.backend
    if b.offload not in (None, "none", "auto"):
        raise ConfigError("backend.offload", f"'{b.offload}' needs backend.name fsdp or deepspeed (DDP keeps all "
                          "state on the device)")
    if b.name == "ddp" and b.offload == "auto":
        raise ConfigError("backend.offload", "auto chooses where state lives, which DDP cannot change: use "
                          "backend.name auto (every engine), fsdp or deepspeed")
    if b.nvme_path is not None:
        raise ConfigError("backend.nvme_path", "NVMe offload is DeepSpeed's (ZeRO-3); the engine is DDP")
    refuse_deepspeed_settings(b, "ddp")


def state_bytes(n_params: int, precision: str, *, world_size: int, shape: ModelShape, state_dtype: str,
                deferred_reduction: bool, **other) -> dict[str, int]:
    """DDP's bytes of model state per rank (the arguments and keys of
    :func:`memtrain.backends.model_state_bytes`; ``other``, DeepSpeed's settings, unused)."""
    return ddp_state_bytes(n_params, world_size, shape, state_dtype, deferred_reduction)


def optimizer_state_bytes(state_dtype: str, shape: ModelShape, world_size: int) -> int:
    """AdamW's moments per rank with ``state_dtype``: every rank holds them all."""
    return replicated_optimizer_bytes(state_dtype, shape)


def stop_words(context: dict) -> str:
    """The engine in the OOM stop message's "Already on" (:func:`memtrain.oom.oom_stop_message`)."""
    return "engine ddp"


def stop_advice(context: dict) -> list[str]:
    """What the OOM stop message suggests of the engine: sharding, under the engine that takes
    this run's optimizer state dtype."""
    dtype = context.get("optimizer_state_dtype") or "fp32"
    if dtype == "int8":
        return ["backend.name fsdp in a new output_dir (shards the model state; int8 optimizer state does not "
                "resume under another engine)"]
    if dtype == "bf16":
        return ["backend.name fsdp (shards the model state; the same command with --backend.name fsdp resumes "
                "this run's last checkpoint under it; DeepSpeed keeps fp32 optimizer state)"]
    return ["backend.name fsdp, or deepspeed with backend.zero_stage 3 (shards the model state; the same "
            "command with --backend.name fsdp, or --backend.name deepspeed --backend.zero_stage 3, resumes this "
            "run's last checkpoint under that engine)"]

log = logging.getLogger("memtrain")


def skips_layers(model: nn.Module) -> bool:
    """Whether the model drops layers at random in training: a ``layerdrop`` (transformers'
    wav2vec2/WavLM/HuBERT name) or ``layer_drop`` > 0 in its config or on any module, or
    memtrain's :class:`memtrain.layerdrop.AgreedLayerDrop` installed on it."""
    agreed = getattr(model, "memtrain_layerdrop", None)
    if agreed is not None and agreed.probability > 0:
        return True
    for obj in [getattr(model, "config", None), *model.modules()]:
        for attr in ("layerdrop", "layer_drop"):
            value = getattr(obj, attr, None)
            if isinstance(value, (int, float)) and value > 0:
                return True
    return False


class DDPBackend(ThroughItsFormat):
    """Data parallel: every rank holds the whole model; gradients are averaged by all-reduce
    on the last micro-batch of each step (``no_sync`` on the others), or, with the deferred
    reduction, after the step's last backward by memtrain's own bucketed all-reduce: then the
    model is not wrapped in ``DistributedDataParallel`` at all (Accelerate's autocast is kept), so
    no reducer holds a second copy of the gradients in buckets this path never fills (rank 0's
    parameters and buffers reach every rank before, as under every engine).

    Parameters that receive no gradient on some steps (LayerDrop in wav2vec2/WavLM, conditional
    branches) break DDP's default reducer ("Expected to have finished reduction in the prior
    iteration"). With ``find_unused_parameters="auto"`` memtrain turns DDP's unused-parameter
    search on by itself when the model skips layers at random (a ``layerdrop`` > 0 in its config
    or modules), and checks after the first step that every parameter received a gradient on
    every rank; if not, it stops with the parameters' names and the setting to change.

    Args:
        process: the process state (Accelerate's, which owns the device and autocast).
        precision: resolved ``bf16|fp16|fp32``.
        find_unused_parameters: ``auto|true|false``.
        defer_reduction: all-reduce gradients after the last micro-batch's backward instead of
            overlapping with it (the OOM protocol's choice).
    """

    name = "ddp"
    supports_async_save = ASYNC_SAVE
    scheduler_config = None  # memtrain's warmup + cosine

    def __init__(self, process: ProcessState, precision: str, find_unused_parameters: str = "auto",
                 defer_reduction: bool = False, optimizer_state_dtype: str = "fp32"):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        self.process = process
        self.precision = precision
        self.find_unused_parameters = find_unused_parameters
        self.optimizer_state_dtype = optimizer_state_dtype
        self.optimizer_element_bytes: Optional[float] = None
        self.shape: Optional[ModelShape] = None  # the model's element counts (set in prepare)
        self._ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters == "true")
        self._checked_unused = find_unused_parameters != "auto"
        self._skips_layers = False
        self.accelerator = Accelerator(cpu=process.device.type == "cpu",
                                       mixed_precision="no" if precision == "fp32" else precision,
                                       kwargs_handlers=[self._ddp_kwargs])
        self.world_size = process.world_size
        self.device = process.device
        # DDP divides the all-reduced gradient sum by world_size
        self.grad_average_factor = float(self.world_size)
        # With OOM recovery, gradients are all-reduced only after every rank finished all its
        # micro-batches (and agreed nobody ran out of memory): no collective ever runs inside a
        # forward or backward, so an OOM on one rank cannot strand another in DDP's bucket
        # all-reduce. The price: no overlap of that all-reduce with the last backward.
        self.defer_reduction = defer_reduction and self.world_size > 1
        if self.defer_reduction:
            self._checked_unused = find_unused_parameters == "true"

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        self._skips_layers = skips_layers(model)
        if self.find_unused_parameters == "auto" and self.world_size > 1 and self._skips_layers:
            self._checked_unused = True  # dropped layers are expected to leave parameters without gradient
            if not self.defer_reduction:  # DDP's reducer must search for them
                self._ddp_kwargs.find_unused_parameters = True
                log.warning("memtrain: the model skips layers at random (layerdrop > 0): DDP's unused-parameter "
                            "search is on (find_unused_parameters=True)")
        model = model.to(self.device)
        self.shape = model_shape(model)
        optimizer = make_optimizer(model)
        if self.defer_reduction or self.world_size == 1:
            # autocast and the fp16 scaler from Accelerate, no DDP wrapper (Accelerate would wrap a
            # lone CPU process under a launcher too: a reducer with nothing to reduce)
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
            # (rank 0's parameters and buffers are on every rank already: transforms.sync_replicated_state)
            return model, self.accelerator.prepare_optimizer(optimizer)
        return self.accelerator.prepare(model, optimizer)

    def compute_collectives(self, last_micro_batch: bool) -> ComputeCollectives:
        """Deferred: none (the all-reduce follows the step's agreement); else the last
        micro-batch's backward (DDP's bucket all-reduce)."""
        overlapped = last_micro_batch and not self.defer_reduction and self.world_size > 1
        return ComputeCollectives(False, overlapped)

    def reduction_context(self, model: nn.Module, reduce_gradients: bool):
        if reduce_gradients or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()  # unwrapped (deferred reduction, one rank): nothing to hold back
        return self.accelerator.no_sync(model)

    def _all_reduce_gradients(self, model: nn.Module, bucket_bytes: int = DEFERRED_REDUCE_BUCKET_BYTES) -> None:
        """Average gradients over ranks in flat buckets of ~``bucket_bytes``, one alive at a time
        (counted by :func:`memtrain.backends.model_state_bytes`). A gradient missing on
        some ranks counts as zeros there, as in DDP's unused-parameter mode; for a model that drops
        layers, a parameter without gradient on *every* rank keeps none, so the optimizer skips
        it, as DDP's reducer and FSDP2 do (a dropped layer is not updated)."""
        params = [p for p in self.unwrap(model).parameters() if p.requires_grad]
        if self._skips_layers:  # one flag per parameter; the same decision on every rank
            has_grad = torch.tensor([float(p.grad is not None) for p in params], device=self.device)
            torch.distributed.all_reduce(has_grad, op=torch.distributed.ReduceOp.MAX)
            params = [p for p, h in zip(params, has_grad.tolist()) if h]
        if not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket, size = [], 0
        for i, p in enumerate(params):
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= bucket_bytes or i == len(params) - 1 or params[i + 1].grad.dtype != p.grad.dtype:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                torch.distributed.all_reduce(flat)
                flat /= self.world_size
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
                del flat  # freed before the next bucket is made
                bucket, size = [], 0

    def set_plan(self, plan) -> None:
        """Nothing to tell DDP: the plan lives in the loop."""

    def discard_step(self, model: nn.Module) -> None:
        """Drop the failed step's partial gradients and cached blocks."""
        for p in model.parameters():
            p.grad = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_and_step(self, model: nn.Module, optimizer, max_norm: float, skip: bool = False) -> float:
        if not self._checked_unused:
            self._check_all_parameters_used(model)  # before the deferred reduction fills in zeros
        if self.defer_reduction:
            self._all_reduce_gradients(model)
        # unscales first under fp16; the norm of the all-reduced gradients is the same on every rank
        norm = float(self.accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf))
        scaler = getattr(self.accelerator, "scaler", None)
        if not skip and math.isfinite(norm):
            optimizer.step()  # with a scaler: scaler.step + scaler.update
        elif scaler is not None:
            scaler.update()  # an overflow lowers the scale (the inf check was recorded when unscaling)
        optimizer.zero_grad(set_to_none=True)
        return norm

    def loss_scale(self):
        scaler = getattr(self.accelerator, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else None

    def _check_all_parameters_used(self, model: nn.Module) -> None:
        """After the first step's backward: every trainable parameter got a gradient on every rank.

        Raises:
            RuntimeError: naming the parameters without gradient and ``backend.find_unused_parameters``
                (with deferred reduction they are only named in a warning: zeros are reduced for them).
        """
        self._checked_unused = True
        named = [(n, p) for n, p in self.unwrap(model).named_parameters() if p.requires_grad]
        unused = torch.tensor([float(p.grad is None) for _, p in named], device=self.device)
        if self.world_size > 1:
            torch.distributed.all_reduce(unused, op=torch.distributed.ReduceOp.MAX)
        names = [n for (n, _), u in zip(named, unused.tolist()) if u]
        if names and self.defer_reduction:  # reduced explicitly as zeros: correct, but maybe a bug
            log.warning("memtrain: %d parameter(s) received no gradient on step 1: %s (their gradient is reduced "
                        "as zero)", len(names), ", ".join(names[:10]) + (" …" if len(names) > 10 else ""))
        elif names:
            raise RuntimeError(
                f"memtrain: {len(names)} parameter(s) received no gradient on step 1 on some rank: "
                f"{', '.join(names[:10])}{' …' if len(names) > 10 else ''}. DDP cannot reduce them. If they are "
                "used on some steps only, set backend.find_unused_parameters true; if never, freeze them "
                "(requires_grad=False) or remove them.")

    def checkpoint_state(self, model: nn.Module, optimizer, max_shard_size: str = "5GB") -> CheckpointState:
        """The replicated module, the optimizer and the fp16 GradScaler; rank 0 writes them."""
        return CheckpointState(self.unwrap(model), optimizer, getattr(self.accelerator, "scaler", None),
                               writes=self.process.is_main, world_size=self.world_size, max_shard_size=max_shard_size)

    def save_state(self, model: nn.Module, optimizer, directory: str, max_shard_size: str = "5GB",
                   async_save: bool = False) -> None:
        """The run's format writes :meth:`checkpoint_state` (the engine's default,
        :mod:`memtrain.checkpoint.formats.safetensors`: rank 0 writes the replicated weights and
        the optimizer and GradScaler state)."""
        self.checkpoint_io.save(self.checkpoint_state(model, optimizer, max_shard_size), directory)

    def load_state(self, model: nn.Module, optimizer, directory: str, saved_world_size: int) -> None:
        """Every rank reads the full weights and optimizer state (any world size: nothing is sharded)."""
        self.checkpoint_io.load(self.checkpoint_state(model, optimizer), directory)

    def load_full_state(self, model: nn.Module, optimizer, weights, optimizer_state, directory: str) -> None:
        """Another engine's state (:meth:`memtrain.backends.base.Backend.load_full_state`) into the
        replicated module; the fp16 GradScaler, which other engines do not save, starts afresh."""
        load_full_state_as_read(self.unwrap(model), optimizer, weights, optimizer_state)

    def replicated_tensors(self, model: nn.Module):
        module = self.unwrap(model)
        return list(module.named_parameters()) + list(module.named_buffers())

    def unwrap(self, model: nn.Module) -> nn.Module:
        # not accelerator.unwrap_model: it imports DeepSpeed on first use (0.7 s on the CPU machine)
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        return getattr(inner, "_orig_mod", inner)  # a torch.compile'd module

    def full_state_dict(self, model: nn.Module):
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()} if self.process.is_main else None

    def model_state_bytes(self, n_params: int) -> dict[str, int]:
        return with_optimizer_element_bytes(ddp_state_bytes(n_params, self.world_size, self.shape, self.optimizer_state_dtype,
                                                            self.defer_reduction), self.optimizer_element_bytes)

    def close(self) -> None:
        """Nothing beyond the process group, which the process state closes."""


def build(cfg, spec, process: ProcessState, precision: str, plan) -> DDPBackend:
    """The DDP engine for ``cfg`` (``backend.find_unused_parameters``; the deferred reduction
    when ``memory.oom_recovery`` is on)."""
    return DDPBackend(process, precision, find_unused_parameters=spec.find_unused_parameters,
                      defer_reduction=cfg.memory.oom_recovery,
                      optimizer_state_dtype=plan.settings().get("optimizer_state_dtype", "fp32"))

