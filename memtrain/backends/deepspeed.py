"""DeepSpeed ZeRO 1/2/3 with optional CPU offload.

memtrain owns the optimizer (AdamW from ``training.*``; DeepSpeedCPUAdam when offloading), the
LR schedule and the accumulation: the engine is told where each accumulation boundary is
(``set_gradient_accumulation_boundary``), ``backward`` runs with ``scale_wrt_gas=False`` because
the loop already divides every micro-batch loss by the global token count,
and ``step`` is called once per global batch.

A user's DeepSpeed JSON is reconciled with the memtrain config by :mod:`memtrain.backends.ds_config`
(``"auto"`` values filled, contradictions an error naming both); its ``optimizer`` section is the
AdamW memtrain builds, its ``scheduler`` section the schedule :mod:`memtrain.optim` builds.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from memtrain.backends import ds_partial_offload
from memtrain.backends.base import ComputeCollectives
from memtrain.backends.common import OffloadTime, ThroughItsFormat, offload_advice, offload_words
from memtrain.backends.common import fp32_export_bytes as export_bytes_per_parameter  # noqa: F401 (registry)
from memtrain.backends.ds_config import (OFFLOAD_DEVICES, ZERO_IN_PLACE_KEYS, build_ds_config, get_path,
                                        linear_saves_weight, zero_buffer_settings)
from memtrain.backends.ds_zero_init import model_build_context  # noqa: F401 (registry)
from memtrain.backends.ds_zero_init import restore_torch_linear, use_memory_efficient_linear
from memtrain.backends.op_locks import clear_stale_locks
from memtrain.backends.spec import EngineVariant
from memtrain.checkpoint.formats import DEEPSPEED_ENGINE, CheckpointState
from memtrain.distributed import ProcessState
from memtrain.errors import CheckpointError, ConfigError
from memtrain.memory.zero_accounting import deepspeed_buffer_settings, zero_state_bytes
from memtrain.memory.shape import ModelShape, model_shape
from memtrain.memory.machine import (HOST_DEVICE_BYTES_PER_S, NVME_BYTES_PER_S, Machine, cpu_adam_built,
                                     deepspeed_op_built)

CHECKPOINT_FORMAT = "deepspeed"
"""The checkpoint format it writes unless handed another (:mod:`memtrain.checkpoint.formats`)."""
CHECKPOINT_MODEL = DEEPSPEED_ENGINE
"""The model its ``checkpoint_state`` hands a format: DeepSpeed's engine (its resharding converts
through DeepSpeed's universal checkpoint, its format's ``to_universal``)."""
VARIANTS = (
    *(EngineVariant(f"zero{s}", "deepspeed", s) for s in (1, 2, 3)),
    *(EngineVariant(f"zero{s}_offload_optimizer", "deepspeed", s, "optimizer") for s in (1, 2, 3)),
    EngineVariant("zero3_offload_optimizer_partial", "deepspeed", 3, "optimizer", 0.5, tune_ratio=True),
    EngineVariant("zero3_offload_all", "deepspeed", 3, "optimizer_and_params"),
    EngineVariant("zero3_offload_optimizer_nvme", "deepspeed", 3, "optimizer", nvme=True),
    EngineVariant("zero3_offload_all_nvme", "deepspeed", 3, "optimizer_and_params", nvme=True),
)
"""DeepSpeed's placements, least offload first. Partial offload appears once (the placement
planner chooses the fraction); NVMe offload only under ZeRO-3 (DeepSpeed's stages 1/2 keep
"nvme" state in host memory) and never partial (DeepSpeed's swapper would take the device
sub-groups too)."""
LOSSY_OPTIMIZER_STATE = False
"""ZeRO keeps its fp32 optimizer partitions: no bf16 or int8 optimizer state."""
SHARDS_OPTIMIZER_STATE = True
"""Each rank holds and steps its partition of the optimizer state (every ZeRO stage)."""
SETTINGS = ("offload_optimizer_ratio",)
"""The engine settings that are levers (:mod:`memtrain.levers.engine_settings`)."""
READS_DEEPSPEED_CONFIG = True
"""Whether ``backend.deepspeed_config`` (the user's DeepSpeed JSON) sets this engine's stage and offload."""
AUTOCAST_MIXED_PRECISION = False
"""Mixed precision as the trace computes it: DeepSpeed's bf16/fp16: 16-bit parameters, fp32 masters in the optimizer."""
STEPS_USER_OPTIMIZER = False
"""A Python caller's optimizer is refused (:data:`OWN_OPTIMIZER`)."""
OWN_OPTIMIZER = "memtrain sizes DeepSpeed's ZeRO partitions for AdamW and steps DeepSpeed's CPU Adam under its offload"
"""Where it steps an optimizer of its own instead of a caller's."""
ASYNC_SAVE = False
"""Its save writes now, never in the background (``checkpoint.async_save`` is warned about, ignored)."""


def offload_ratio(shape: ModelShape, ratio: float) -> float:
    """The share of the optimizer state on the host when ``ratio`` is asked for: ZeRO-3's partial
    offload splits the optimizer's sub-groups, sized from the ratio
    (:func:`memtrain.backends.ds_partial_offload.sub_group_size`), so the ratio itself."""
    return ratio


def variant_label(zero_stage) -> str:
    """The engine's word in a placement's name (``memtrain plan``'s table)."""
    return f"zero{zero_stage}"


def takes_selective_checkpointing(spec) -> bool:
    """Whether torch's selective activation checkpointing works under engine ``spec``: not under
    ZeRO-3 (``spec.zero_stage``: the config's, the placement's or the DeepSpeed JSON's), whose
    parameter gathers inside a block differ between the forward and the recompute."""
    return spec.zero_stage != 3


def state_bytes(n_params: int, precision: str, *, zero_stage: Optional[int], offload: str, world_size: int,
                offload_optimizer_ratio: float, offload_device: str, shape: ModelShape,
                zero_settings: Optional[Mapping[str, int]], **other) -> dict[str, int]:
    """ZeRO's bytes of model state per rank (the arguments and keys of
    :func:`memtrain.backends.model_state_bytes`; ``other`` unused: ZeRO keeps fp32 partitions
    whatever the state dtype, and reduces in backward)."""
    return zero_state_bytes(n_params, precision, zero_stage, offload, world_size, offload_optimizer_ratio,
                            offload_device, shape, zero_settings)


def offload_seconds(p, n_params: int, p_bytes: int, world_size: int, machine: Machine) -> OffloadTime:
    """What a step of placement ``p`` (a :class:`memtrain.planning.placement.Placement` with its
    plan set and an offload) spends on CPU Adam over its host share of the partition, host↔device
    copies (gradients out, weights back; with ``optimizer_and_params`` the partition fetched in
    each micro-batch's forward and backward) and NVMe, none overlapped, at ``machine``'s rates;
    ``p_bytes``: bytes per element of the 16-bit (or fp32) parameters and gradients copied."""
    partition = n_params / world_size
    host_params = partition * p.offload_optimizer_ratio
    cpu = host_params * machine.ranks_per_host / machine.cpu_adam_params_per_s
    copies = (p_bytes * partition + p_bytes * host_params) / HOST_DEVICE_BYTES_PER_S  # gradients out, weights back
    if p.offload == "optimizer_and_params":  # each micro-batch fetches the partition in forward and in backward
        copies += 2 * p_bytes * partition * p.gradient_accumulation_steps / HOST_DEVICE_BYTES_PER_S
    if p.nvme:
        copies += 2 * 12 * host_params / NVME_BYTES_PER_S  # fp32 master + moments read and written
        if p.offload == "optimizer_and_params":
            copies += 2 * p_bytes * partition * p.gradient_accumulation_steps / NVME_BYTES_PER_S
    return OffloadTime(cpu, copies, cpu + copies)


def validate(cfg) -> None:
    """The ``backend`` settings DeepSpeed cannot honour, by name (:func:`memtrain.validation.validate`):
    none beyond what each lever refuses for an engine without it (``reshard_after_forward false``:
    :class:`memtrain.levers.engine_settings.ReshardAfterForward`); the DeepSpeed JSON against the
    config is checked when the engine is built."""


def stop_words(context: dict) -> str:
    """The engine in the OOM stop message's "Already on" (:func:`memtrain.oom.oom_stop_message`)."""
    zero = f" ZeRO-{context['zero_stage']}" if context.get("zero_stage") else ""
    return f"engine deepspeed{zero}" + offload_words(context)


def stop_advice(context: dict) -> list[str]:
    """What the OOM stop message suggests of the engine: ZeRO-3 where the stage is lower, then the
    optimizer state on the host."""
    return (["backend.zero_stage 3"] if (context.get("zero_stage") or 2) < 3 else []) + offload_advice(context)

log = logging.getLogger("memtrain")


class DeepSpeedBackend(ThroughItsFormat):
    """ZeRO data parallel through ``deepspeed.initialize``.

    Args:
        process: the process state (its group is started here when plain ``python`` has none).
        precision: resolved ``bf16|fp16|fp32``; precision_requested: the ``precision`` setting.
        ds_config_path: the user's DeepSpeed JSON's path, or None (named in errors).
        user_json: that JSON as read (:attr:`memtrain.backends.spec.EngineSpec.deepspeed_json`; None or {}: none).
        zero_stage, offload: the spec's (the JSON's folded in); None = from the JSON (defaults 2, none).
        offload_optimizer_ratio: ZeRO-3 partial offload (:mod:`memtrain.backends.ds_partial_offload`).
        nvme_path: offload to NVMe files in this folder (DeepSpeed's async_io op is needed).
        global_batch_size, max_grad_norm: from ``training``.
        plan: the starting micro-batch plan (:class:`memtrain.plan.Plan`).
        training: ``training.*`` for the JSON's optimizer and scheduler sections.

    Attributes:
        scheduler_config: the JSON's resolved ``scheduler`` section (``{"type", "params"}``), or None.
    """

    name = "deepspeed"
    supports_async_save = ASYNC_SAVE

    def __init__(self, process: ProcessState, precision: str, precision_requested: str, ds_config_path: Optional[str],
                 user_json: Optional[dict],
                 zero_stage: Optional[int], offload: Optional[str], global_batch_size: int, max_grad_norm: float,
                 plan, training=None, offload_optimizer_ratio: float = 1.0, nvme_path: Optional[str] = None):
        self.process = process
        self.world_size = process.world_size
        self.device = process.device
        process.ensure_group()  # plain `python`: a one-rank group (and the variables DeepSpeed reads)
        user = copy.deepcopy(dict(user_json)) if user_json else None
        self.ds_config = build_ds_config(
            user, ds_config_path or "the DeepSpeed config", global_batch_size=global_batch_size,
            micro_batch_size=plan.micro_batch_size, gradient_accumulation_steps=plan.gradient_accumulation_steps,
            max_grad_norm=max_grad_norm, precision=precision, precision_requested=precision_requested,
            zero_stage=zero_stage, offload=offload, training=training,
            offload_optimizer_ratio=offload_optimizer_ratio, nvme_path=nvme_path,
        )
        # memtrain builds both (the same AdamW; DeepSpeed's scheduler class, stepped by the loop)
        self.ds_config.pop("optimizer", None)
        self.scheduler_config: Optional[dict] = self.ds_config.pop("scheduler", None)
        self.optimizer_element_bytes: Optional[float] = None  # a user's optimizer is refused (validation.check_user_optimizer_placement)
        self.precision = "bf16" if self.ds_config["bf16"]["enabled"] else "fp16" if self.ds_config["fp16"]["enabled"] else "fp32"
        self.zero_stage = self.ds_config["zero_optimization"]["stage"]
        self.offload_optimizer = get_path(self.ds_config, "zero_optimization.offload_optimizer.device") in OFFLOAD_DEVICES
        self.offload_params = get_path(self.ds_config, "zero_optimization.offload_param.device") in OFFLOAD_DEVICES
        self.offload_ratio = float(get_path(self.ds_config, "zero_optimization.offload_optimizer.ratio") or 1.0)
        self.nvme = "nvme" in (get_path(self.ds_config, "zero_optimization.offload_optimizer.device"),
                               get_path(self.ds_config, "zero_optimization.offload_param.device"))
        if self.nvme:
            _require_async_io()
        self.grad_average_factor = float(self.world_size)  # ZeRO averages gradients over ranks
        self.engine = None
        self._one_bucket = False  # every ZeRO-1/2 gradient fits one reduce bucket (set in prepare)
        self.shape: Optional[ModelShape] = None  # the model's element counts (set in prepare)
        self.zero_settings: dict[str, int] = {}  # zero_optimization's buffer sizes this run uses (set in prepare)

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        import deepspeed

        optimizer = make_optimizer(model)
        self.shape = model_shape(model)  # ZeRO-3-partitioned parameters by their whole size
        trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
        if self.offload_ratio < 1.0 and get_path(self.ds_config, "zero_optimization.sub_group_size") is None:
            self.ds_config["zero_optimization"]["sub_group_size"] = ds_partial_offload.sub_group_size(
                self.shape.parameters, self.world_size)
        self.zero_settings = size_buffers(self.ds_config, self.shape, trainable)
        if self.process.is_main:  # a build stopped earlier would leave DeepSpeed waiting on its lock forever
            clear_stale_locks((["CPUAdamBuilder"] if self.offload_optimizer else [])
                              + (["ShareMemCommBuilder"] if self.device.type == "cpu" else []))
        self.process.barrier()  # no rank waits on a lock rank 0 then removes, to import an op never built
        if self.offload_optimizer:  # ZeRO-Offload steps on CPU with its own Adam kernel (same AdamW math)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            if self.process.is_main and not cpu_adam_built():
                log.warning("memtrain: building DeepSpeed's cpu_adam op for optimizer offload (first run on this "
                            "machine only; a few minutes)")

            groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused", "capturable", "differentiable",
                                                                "maximize", "amsgrad", "decoupled_weight_decay")}
                      for g in optimizer.param_groups]
            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True)
        if self.process.is_main and self.device.type == "cpu":
            if not deepspeed_op_built("ShareMemCommBuilder"):
                log.warning("memtrain: building DeepSpeed's shm_comm op for its collectives on the CPU (first "
                            "DeepSpeed run on this machine only; about a minute)")
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config,
                                                    dist_init_required=False)
        if self.zero_stage == 3 and linear_saves_weight(zero_buffer_settings(get_path(self.ds_config,
                                                                                   "zero_optimization") or {})):
            use_memory_efficient_linear()
        bucket = getattr(self.engine.optimizer, "reduce_bucket_size", None)  # ZeRO-1/2's, in elements
        self._one_bucket = bucket is not None and trainable <= bucket
        on_device, groups = ds_partial_offload.prepare(self.engine.optimizer, self.device.type)
        if groups and self.process.is_main:
            log.warning("memtrain: ZeRO-3 partial offload: %d of %d optimizer sub-groups of rank 0 stepped on the "
                        "device, the rest by CPU Adam on the host (backend.offload_optimizer_ratio %g)", on_device,
                        groups, self.offload_ratio)
        # the LR schedule acts on the client optimizer's param_groups, which ZeRO steps with
        return self.engine, optimizer

    def compute_collectives(self, last_micro_batch: bool) -> ComputeCollectives:
        """ZeRO-3 fetches parameters in forward and backward; ZeRO-2 partitions gradients in every
        backward; ZeRO-1 (and 0) reduce in the backward of the accumulation boundary only
        (DeepSpeed's ``allreduce_gradients``); none communicates in a ZeRO-1/2 forward. ZeRO-1/2
        reduce a gradient bucket when the next gradient would overflow ``reduce_bucket_size``
        elements, and the rest after the last gradient; when all trainable parameters fit one
        bucket, that last reduction is the only one, so only block 0's backward (the last, with
        the embeddings after it) communicates."""
        if self.world_size == 1:
            return ComputeCollectives(False, False)
        backward = self.zero_stage >= 2 or last_micro_batch
        if self.zero_stage < 3 and self._one_bucket:  # reduced once, after the last gradient: in block 0's backward
            return ComputeCollectives(False, backward, frozenset({0}))
        return ComputeCollectives(self.zero_stage >= 3, backward)

    def reduction_context(self, model: nn.Module, reduce_gradients: bool):
        self.engine.set_gradient_accumulation_boundary(reduce_gradients)
        return contextlib.nullcontext()

    def set_plan(self, plan) -> None:
        """Tell the engine the new plan: micro-batch first, then the global batch, so DeepSpeed
        derives accumulation = global / (micro × world_size) and its batch checks hold."""
        self.engine.set_train_micro_batch_size(plan.micro_batch_size)
        self.engine.set_train_batch_size(plan.micro_batch_size * plan.gradient_accumulation_steps * self.world_size)

    def discard_step(self, model: nn.Module) -> None:
        """Drop the failed step's partial gradients (ZeRO buckets included) and free the cache."""
        opt = self.engine.optimizer
        # set_to_none records CUDA streams, which DeepSpeed's CPU accelerator cannot: zero in place there
        opt.zero_grad(set_to_none=self.device.type == "cuda")
        for bucket in getattr(opt, "ipg_buckets", {}).values():  # half-filled reduction buckets
            (bucket.clear_params if hasattr(bucket, "clear_params") else bucket.clear)()
        reduced = getattr(opt, "params_already_reduced", None)  # ZeRO-1/2 (list) and ZeRO-3 (dict)
        for key in (range(len(reduced)) if isinstance(reduced, list) else list(reduced or {})):
            reduced[key] = False
        if hasattr(opt, "_clear_previous_reduced_grads"):
            opt._clear_previous_reduced_grads()
        if getattr(opt, "cpu_offload", False) and hasattr(opt, "micro_step_id"):
            # ZeRO-1/2 with CPU offload accumulate into accumulated_grads_in_cpu once micro_step_id > 0;
            # zero_grad does not reset that count, step() does: reset it the same way, so a discarded
            # attempt (an OOM retry, a planner probe) cannot leak into the next step
            opt.micro_step_id = -1
            if hasattr(opt, "_offload_accumulated_param_ids"):
                opt._offload_accumulated_param_ids = set()
        offload = getattr(opt, "parameter_offload", None)
        if offload is not None:  # ZeRO-3: release gathered parameters, restart the fetch trace
            coordinator = offload.get_param_coordinator()
            coordinator.release_and_reset_all(self.engine.module)
            coordinator.reset_step()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_and_step(self, model: nn.Module, optimizer, max_norm: float, skip: bool = False) -> float:
        if skip:  # a non-finite loss: drop the reduced/partitioned gradients like after an OOM
            self.discard_step(model)
            return float("nan")
        self.engine.set_gradient_accumulation_boundary(True)
        ds_partial_offload.sync_hyperparameters(self.engine.optimizer)
        # clips to gradient_clipping, steps, zeroes gradients; ZeRO itself skips the step when
        # the gradients overflow (and lowers the fp16 loss scale)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm if norm >= 0 else float("inf")  # DeepSpeed reports an overflow as -1

    def loss_scale(self):
        if self.precision != "fp16":
            return None
        scale = getattr(self.engine.optimizer, "loss_scale", None)
        return float(scale) if scale is not None else None

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if hasattr(model, "module") else model

    def full_state_dict(self, model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
        """The whole model in fp32 on rank 0's host (None elsewhere; a collective under ZeRO-3).
        ZeRO-3 gathers one module's own parameters at a time, as DeepSpeed's
        ``_zero3_consolidated_16bit_state_dict`` does, never the whole model on every device
        (:func:`memtrain.memory.moments.zero_moments`). A tied parameter (GPT-2's ``lm_head.weight``
        = ``transformer.wte.weight``) is gathered and copied once, one tensor under each of its
        names (rank 0's host holds it once; the export stores it once)."""
        import deepspeed

        module = self.unwrap(model)
        keys, sd, done = set(module.state_dict().keys()), {}, set()  # the same decisions on every rank
        copies: dict[int, torch.Tensor] = {}  # id(parameter or buffer) → its copy (rank 0's; the ids on every rank)
        for prefix, sub in module.named_modules(remove_duplicate=False):  # a shared module under each name
            own = {f"{prefix}.{name}" if prefix else name: t
                   for name, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None}
            own = {k: t for k, t in own.items() if k in keys and k not in done}
            if not own:
                continue
            done.update(own)
            fresh = {id(t): t for t in own.values() if id(t) not in copies}
            with deepspeed.zero.GatheredParameters([p for p in sub.parameters(recurse=False) if id(p) in fresh],
                                                   modifier_rank=None):
                copies.update((i, _host_copy(t) if self.process.is_main else None) for i, t in fresh.items())
            if self.process.is_main:
                sd.update((k, copies[id(t)]) for k, t in own.items())
        if keys - done:  # entries a module's own state-dict hook makes: the whole model gathered, as before
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                if self.process.is_main:
                    sd.update((k, _host_copy(v)) for k, v in module.state_dict().items() if k in keys - done)
        return sd if self.process.is_main else None

    def save_state(self, model: nn.Module, optimizer, directory: str, max_shard_size: str = "5GB",
                   async_save: bool = False) -> None:
        """The run's format writes :meth:`checkpoint_state` (the engine's default,
        :mod:`memtrain.checkpoint.formats.deepspeed`: DeepSpeed's native checkpoint, every rank its
        own ZeRO partition, the loss scaler and engine counters included); a partial offload's
        device optimizer state beside it, one file per rank."""
        self.checkpoint_io.save(self.checkpoint_state(model, optimizer, max_shard_size), directory)
        if self.offload_ratio < 1.0:  # DeepSpeed does not save the device side of a partial offload
            torch.save(ds_partial_offload.state_dict(self.engine.optimizer), self._device_optimizer_file(directory))

    def _device_optimizer_file(self, directory: str, rank: Optional[int] = None) -> str:
        rank = self.process.rank if rank is None else rank
        return os.path.join(directory, self.checkpoint_io.TAG, f"device_optimizer_rank_{rank}.pt")

    def checkpoint_state(self, model: nn.Module, optimizer, max_shard_size: str = "5GB") -> CheckpointState:
        """DeepSpeed's engine (which holds the optimizer and the loss scaler); every rank writes its partition."""
        return CheckpointState(self.engine, world_size=self.world_size, zero_stage=self.zero_stage,
                               max_shard_size=max_shard_size)

    def expected_files(self) -> list[str]:
        partial = [self._device_optimizer_file("", r).lstrip(os.sep) for r in range(self.world_size)]
        return super().expected_files() + (partial if self.offload_ratio < 1.0 else [])

    def load_state(self, model: nn.Module, optimizer, directory: str, saved_world_size: int) -> None:
        """Load DeepSpeed's checkpoint. ZeRO partitions are tied to the world size that wrote
        them: on another world size the checkpoint is first converted to DeepSpeed's universal
        format (:meth:`_load_universal`).

        Raises:
            CheckpointError: DeepSpeed found no checkpoint, or the conversion failed.
        """
        partial = os.path.exists(self._device_optimizer_file(directory, 0))
        if saved_world_size != self.world_size and self.zero_stage > 0:
            if partial or self.offload_ratio < 1.0 or self.nvme:
                raise CheckpointError(f"{directory}: a ZeRO-3 run with partial or NVMe offload resumes on the world "
                                      f"size that wrote it ({saved_world_size}), not {self.world_size} (DeepSpeed's "
                                      "universal checkpoint has no conversion for it)")
            self._load_universal(directory, saved_world_size)
            return
        self.checkpoint_io.load(self.checkpoint_state(model, optimizer), directory)
        if partial != (self.offload_ratio < 1.0):
            raise CheckpointError(f"{directory}: written {'with' if partial else 'without'} partial optimizer offload, "
                                  f"resumed {'with' if self.offload_ratio < 1.0 else 'without'}: keep "
                                  "backend.offload_optimizer_ratio as it was")
        if partial:
            try:
                ds_partial_offload.load_state_dict(self.engine.optimizer, torch.load(
                    self._device_optimizer_file(directory), map_location="cpu", weights_only=True))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{directory}: {exc}") from exc

    def _load_universal(self, directory: str, saved_world_size: int) -> None:
        """Resume a ZeRO checkpoint written by ``saved_world_size`` ranks through DeepSpeed's
        universal checkpoint (``ds_to_universal``: per-parameter fp32 weights and Adam moments,
        no ranks; :meth:`_load_through_universal`).

        Raises:
            CheckpointError: the conversion or the load failed (names the checkpoint).
        """
        self._load_through_universal(directory, lambda work, _: self.checkpoint_io.to_universal(directory, work),
                                     f"the ZeRO-{self.zero_stage} checkpoint of {saved_world_size} ranks")

    def _load_through_universal(self, directory: str, write: Callable[[str, list[dict]], None], what: str) -> None:
        """Rank 0 writes a universal checkpoint (``write(folder, this run's optimizer group
        settings)``) into ``.tmp-universal-<name>``
        beside ``directory``, every rank loads its new partition from there (DeepSpeed's
        ``load_universal``), and the folder is removed. The checkpoint itself is never modified;
        a folder left by a conversion cut short is removed by the next start like an unfinished save.

        Raises:
            CheckpointError: the conversion or the load failed (names the checkpoint and ``what``).
        """
        import shutil

        work = os.path.join(os.path.dirname(os.path.abspath(directory)), f".tmp-universal-{os.path.basename(directory)}")
        # ZeRO-3's universal load gives every parameter group the first group's settings (its weight
        # decay included, which memtrain keeps off biases and norms): this run's own are restored
        inner = getattr(self.engine.optimizer, "optimizer", None)
        settings = [{k: v for k, v in g.items() if k != "params"} for g in getattr(inner, "param_groups", [])]
        failure = None
        if self.process.is_main:  # rank 0 converts, however long it takes; the others wait patiently
            shutil.rmtree(work, ignore_errors=True)
            try:
                write(work, settings)
            except Exception as exc:  # noqa: BLE001 — DeepSpeed raises assertions and more
                shutil.rmtree(work, ignore_errors=True)
                failure = repr(exc)
        failure = self.process.broadcast_object(failure, patient=True)  # every rank stops alike
        if failure is not None:
            raise CheckpointError(f"{directory}: converting {what} for ZeRO-{self.zero_stage} on {self.world_size} "
                                  f"ranks failed: {failure}")
        self.engine._config.load_universal_checkpoint = True  # DeepSpeed reads the flag at load time
        try:
            path, _ = self.engine.load_checkpoint(work, tag=self.checkpoint_io.TAG, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
        finally:
            self.engine._config.load_universal_checkpoint = False
        for group, own in zip(getattr(inner, "param_groups", []), settings):
            group.update(own)
        for state in getattr(inner, "state", {}).values():
            # ZeRO-3's universal load gives every sub-group one shared step tensor, which torch's
            # AdamW increments in place: once per sub-group and step, skewing the bias correction
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        self.process.barrier()
        if self.process.is_main:
            shutil.rmtree(work, ignore_errors=True)
        if path is None:
            raise CheckpointError(f"{directory}: DeepSpeed found no universal checkpoint in {work}")

    def load_full_state(self, model: nn.Module, optimizer, weights, optimizer_state, directory: str) -> None:
        """Another engine's state (:meth:`memtrain.backends.base.Backend.load_full_state`) into
        the ZeRO partitions: written as DeepSpeed's universal checkpoint
        (:func:`memtrain.checkpoint.formats.deepspeed.write_universal`) and loaded by DeepSpeed's
        own universal loader, as a ZeRO checkpoint on another world size is; buffers are copied
        into the module.

        Raises:
            CheckpointError: partial or NVMe optimizer offload (no universal load for them), or
                the load failed.
        """
        if self.offload_ratio < 1.0 or self.nvme:
            raise CheckpointError(f"{directory}: another engine's checkpoint resumes under ZeRO without partial or "
                                  "NVMe offload only (DeepSpeed's universal checkpoint has no loader for them): "
                                  "resume with backend.offload_optimizer_ratio 1.0 and without backend.nvme_path")
        module = self.unwrap(model)
        buffers = dict(module.named_buffers())
        weights, optimizer_state = _by_first_name(module, weights, optimizer_state)
        self._load_through_universal(directory, lambda work, settings: self.checkpoint_io.write_universal(
            work, weights, optimizer_state, self.zero_stage, settings, frozenset(buffers)), "another engine's checkpoint")
        with torch.no_grad():
            for name, buffer in buffers.items():
                if name in weights:
                    buffer.copy_(weights[name])

    def replicated_tensors(self, model: nn.Module):
        module = self.unwrap(model)
        params = list(module.named_parameters()) if self.zero_stage < 3 else []  # ZeRO-3 partitions parameters
        return params + list(module.named_buffers())

    @property
    def offload(self) -> str:
        """What this engine keeps off the device: ``none``, ``optimizer`` or ``optimizer_and_params``."""
        if not self.offload_optimizer:
            return "none"
        return "optimizer_and_params" if self.offload_params else "optimizer"

    def model_state_bytes(self, n_params: int) -> dict[str, int]:
        return zero_state_bytes(n_params, self.precision, self.zero_stage, self.offload, self.world_size,
                                self.offload_ratio, "nvme" if self.nvme else "cpu", self.shape, self.zero_settings)

    def close(self) -> None:
        """Release the engine (the process group is the process state's), and give the process
        back torch's own ``torch.nn.functional.linear`` (see :func:`restore_torch_linear`)."""
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        restore_torch_linear()


def _by_first_name(module: nn.Module, weights: dict[str, torch.Tensor], optimizer_state: dict) -> tuple[dict, dict]:
    """``weights`` and ``optimizer_state["state"]`` keyed by the name DeepSpeed gives each
    parameter (its first in ``named_parameters``), whichever of a tied parameter's names
    (GPT-2's ``lm_head.weight`` / ``transformer.wte.weight``) the other engine saved it under."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    renamed, state = dict(weights), dict(optimizer_state.get("state", {}))
    for name, canonical in names.items():
        if name != canonical:
            for table in (renamed, state):
                if name in table:
                    table.setdefault(canonical, table.pop(name))
    return renamed, {**optimizer_state, "state": state}


def build(cfg, spec, process: ProcessState, precision: str, plan) -> DeepSpeedBackend:
    """The DeepSpeed engine of ``spec`` (its JSON, ZeRO stage and offload; an Accelerate DeepSpeed
    config's are in the config already, :mod:`memtrain.launcher`) and the batch geometry of ``plan``.

    Raises:
        memtrain.config.ConfigError: the DeepSpeed JSON contradicts the memtrain config.
    """
    t = cfg.training
    return DeepSpeedBackend(process, precision, cfg.precision, ds_config_path=spec.deepspeed_config,
                            user_json=spec.deepspeed_json,
                            zero_stage=spec.zero_stage, offload=spec.offload,
                            global_batch_size=t.global_batch_size, max_grad_norm=t.max_grad_norm, plan=plan,
                            training=t, offload_optimizer_ratio=spec.offload_optimizer_ratio, nvme_path=spec.nvme_path)


def nvme_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) can be built or loaded here (it needs libaio):
    :class:`memtrain.backends.engine.NvmeEngine`."""
    import io

    from deepspeed.ops.op_builder import AsyncIOBuilder

    with contextlib.redirect_stdout(io.StringIO()):
        return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _require_async_io() -> None:
    if not nvme_available():
        raise ConfigError("backend.nvme_path", "NVMe offload needs DeepSpeed's async_io op, which cannot be built on "
                          "this machine (libaio and its headers are missing: apt install libaio-dev); drop "
                          "backend.nvme_path to offload to host memory")


def size_buffers(ds_config: dict, shape: ModelShape, trainable: int) -> dict[str, int]:
    """Write into ``ds_config`` the ``zero_optimization`` buffer sizes and flags it leaves unset or
    ``auto`` (:func:`memtrain.memory.zero_accounting.deepspeed_buffer_settings`, sized from the model;
    under ZeRO-2 ``reduce_scatter`` off), and return every buffer size the run will use, in
    elements (the user's own values kept and counted), and ``reduce_scatter`` and
    ``contiguous_gradients`` (1 or 0: ZeRO-2 and ZeRO-3 reduce a bucket in place only with the
    second and without the first)."""
    zero = ds_config.setdefault("zero_optimization", {})
    for key, value in deepspeed_buffer_settings(shape, trainable, zero.get("stage")).items():
        if zero.get(key) in (None, "auto"):
            zero[key] = bool(value) if key in ZERO_IN_PLACE_KEYS else value
    return {**zero_buffer_settings(zero), **{k: int(bool(zero.get(k, True))) for k in ZERO_IN_PLACE_KEYS}}


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` on the host: a floating one in fp32 (the export's dtype), an integer or
    bool buffer as it is (DDP's and FSDP2's exports keep, e.g., a step count an integer)."""
    return (tensor.detach().float() if tensor.is_floating_point() else tensor.detach()).cpu().clone()
