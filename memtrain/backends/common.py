"""Engine-independent helpers the backends share (no engine-specific code here)."""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from memtrain.errors import CheckpointError, ConfigError

log = logging.getLogger("memtrain")


class ThroughItsFormat:
    """What every engine answers of its checkpoints from the format it was handed
    (``checkpoint_io``, :func:`memtrain.backends.make_backend`) and its ``checkpoint_state``: a
    mixin of the engines' backends."""

    def expected_files(self) -> list[str]:
        """Glob patterns a complete save of this engine at this world size matches: its format's
        ``expected_files`` of its :class:`memtrain.checkpoint.formats.CheckpointState`."""
        return self.checkpoint_io.expected_files(self.checkpoint_state(None, None))

    def manifest_fields(self) -> dict:
        """``backend`` (the engine's name), ``checkpoint_format`` (its format's ``NAME``),
        ``checkpoint_model`` (what the format saved: the model whole on every rank, sharded over
        the ranks or DeepSpeed's engine, :data:`memtrain.checkpoint.formats.MODEL_KINDS`) and
        ``zero_stage`` (its state's; None outside DeepSpeed)."""
        return {"backend": self.name, "checkpoint_format": self.checkpoint_io.NAME,
                "checkpoint_model": self.checkpoint_model, "zero_stage": self.checkpoint_state(None, None).zero_stage}


def sync_replicated_state(model: nn.Module, device: torch.device) -> list[str]:
    """Make parameters and buffers identical on every rank (rank 0's values win) before training.

    A module built differently on each rank (a frozen random projection, a buffer filled from an
    unseeded RNG) would otherwise train silently wrong (a known SpeechBrain failure). Each
    tensor's (sum, sum of squares) in float64 is compared across ranks with one all-reduce of
    MAX and one of MIN; every tensor is then broadcast from rank 0.

    Args:
        model: the unwrapped module (same structure on every rank).
        device: device to communicate on (CUDA tensors for nccl, CPU for gloo).

    Returns:
        Names of the tensors that differed between ranks (empty on one process). Also logged.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return []
    named = [(f"parameter {n}", p) for n, p in model.named_parameters()] + \
            [(f"buffer {n}", b) for n, b in model.named_buffers()]
    stats = torch.tensor([[t.detach().double().sum().item(), t.detach().double().square().sum().item()]
                          for _, t in named], dtype=torch.float64, device=device).reshape(-1, 2)
    hi, lo = stats.clone(), stats.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    differing = [name for (name, _), h, l in zip(named, hi, lo) if not torch.equal(h, l)]
    with torch.no_grad():
        for _, t in named:
            on_device = t.detach().to(device)
            dist.broadcast(on_device, src=0)
            t.copy_(on_device)
    if differing:
        log.warning("memtrain: %d tensor(s) differed between ranks and were replaced by rank 0's: %s",
                    len(differing), ", ".join(differing[:10]) + (" …" if len(differing) > 10 else ""))
    return differing


def refuse_deepspeed_settings(b, engine: str) -> None:
    """The checks of an engine that is not DeepSpeed (DDP, FSDP2) on a ``backend`` section ``b``:
    DeepSpeed's own settings are refused by name.

    Raises:
        memtrain.errors.ConfigError: ``backend.deepspeed_config`` or ``backend.zero_stage`` is set.
    """
    if b.deepspeed_config is not None and b.name == engine:  # auto with an FSDP launcher: the launcher decides
        raise ConfigError("backend.deepspeed_config", f"is set but backend.name is '{b.name}'; "
                          "use backend.name deepspeed (or auto), or drop the DeepSpeed config")
    if b.zero_stage is not None:
        launcher = "" if b.name != "auto" else " (backend.name auto, launched with an FSDP config)"
        raise ConfigError("backend.zero_stage", f"is a DeepSpeed setting, but the engine is '{engine}'{launcher}; "
                          "use backend.name deepspeed (or auto), or drop backend.zero_stage")


def offload_words(context: dict) -> str:
    """The offload in an engine's ``stop_words`` (``, offload optimizer``); empty without one."""
    return f", offload {context['offload']}" if context.get("offload") not in (None, "none") else ""


def offload_advice(context: dict) -> list[str]:
    """The offload an engine's ``stop_advice`` suggests when its state is all on the device."""
    return ["backend.offload optimizer"] if context.get("offload") in (None, "none") else []


class OffloadTime(NamedTuple):
    """What an offloading placement's step spends beyond the device's compute (an engine's
    ``offload_seconds``), in seconds: ``cpu_s`` stepping the optimizer on the host, ``copy_s``
    moving bytes between host and device (and NVMe), ``added_s`` what the step takes longer for them
    (their sum where nothing overlaps)."""

    cpu_s: float
    copy_s: float
    added_s: float


def fp32_export_bytes(precision: str, offload: str) -> int:
    """``export_bytes_per_parameter`` of the engines whose export holds the whole model in fp32 on
    rank 0's host (DDP's fp32 parameters; DeepSpeed's ``full_state_dict`` casts the gathered 16-bit
    parameters to fp32 there), whatever the precision and offload."""
    return 4


def selective_checkpointing_works(spec) -> bool:
    """``takes_selective_checkpointing`` of the engines under which torch's selective activation
    checkpointing always works (DDP, FSDP2)."""
    return True


def whole_model_build_context(cfg, spec, precision: str, world_size: int, python_function: bool = False):
    """``model_build_context`` of the engines that build the model whole on every rank, then wrap
    it (DDP, FSDP2): no context needed."""
    return contextlib.nullcontext()


def _own_settings(optimizer: torch.optim.Optimizer, optimizer_state: dict) -> dict:
    """``optimizer_state`` with the group settings of ``optimizer`` only (another engine's
    optimizer may have had more).

    Raises:
        memtrain.errors.CheckpointError: the optimizer is torchao's (``optimizer.state_dtype int8``):
            its quantized moments do not cross engines (FSDP2 cannot shard them whole; a DCP
            checkpoint holds them dequantized, which would stay fp32).
    """
    if type(getattr(optimizer, "optimizer", optimizer)).__module__.startswith("torchao"):  # Accelerate's wrapper
        raise CheckpointError("optimizer.state_dtype int8 cannot resume under another engine or checkpoint format: its "
                              "quantized moments do not cross between DDP and FSDP2 or between formats. Resume with "
                              "the engine and checkpoint.format that saved the checkpoint")
    keys = set().union(*(group.keys() for group in optimizer.param_groups))  # this optimizer's settings only
    return {**optimizer_state, "param_groups": [{k: v for k, v in group.items() if k in keys}
                                                for group in optimizer_state["param_groups"]]}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optimizer_state: dict) -> None:
    """Load whole-model ``weights`` and a full, name-keyed ``optimizer_state`` into an FSDP2-sharded
    ``model``, which takes its shards, and its ``optimizer`` through torch's ``set_state_dict``
    (``full_state_dict=True``): the engine switch on resume. Group settings the other engine's
    optimizer had and this one has not are dropped.

    Raises:
        memtrain.errors.CheckpointError: the optimizer is torchao's (:func:`_own_settings`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=_own_settings(optimizer, optimizer_state),
                   options=StateDictOptions(full_state_dict=True))


def load_full_state_as_read(module: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                            optimizer_state: dict) -> None:
    """:func:`load_full_state` without building an optimizer state first, into a plain
    (replicated) ``module`` or an FSDP2-sharded one (parameters that are DTensors): the weights
    copied into the parameters (an FSDP2 module's through torch's ``set_model_state_dict``, which
    cuts each rank's shard), and the name-keyed optimizer state numbered as ``optimizer`` orders
    its parameters (each moment of a sharded parameter cut to this rank's shard, as the parameter
    is) and given to the optimizer's own ``load_state_dict``, which keeps those tensors as its
    state. torch's ``set_state_dict`` first builds an optimizer state by a step on zero gradients
    (``_init_optim_state``) and then replaces it: the rank's moments twice and a zero gradient per
    parameter beside the read state (12 bytes a parameter more at a switch to DDP, fp32 AdamW).

    Raises:
        memtrain.errors.CheckpointError: the optimizer is torchao's (:func:`_own_settings`); the
            weights miss an entry of the module (a tied parameter under one of its names counts)
            or hold one it has not; or the optimizer's parameter groups hold other parameters than
            the checkpoint's (names the first group).
    """
    from torch.distributed.tensor import DTensor

    optimizer_state = _own_settings(optimizer, optimizer_state)
    if any(isinstance(p, DTensor) for p in module.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))
    else:
        _load_weights_strictly(module, weights)
    _load_optimizer_by_name(module, optimizer, optimizer_state)


def _load_weights_strictly(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into a plain ``module``; every entry of its state dict must be there, a
    tied parameter under one of its names (:func:`load_full_state_as_read` raises)."""
    result, entries = module.load_state_dict(weights, strict=False), module.state_dict(keep_vars=True)
    loaded = {entries[k].data_ptr() for k in weights if k in entries}
    missing = [k for k in result.missing_keys if entries[k].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the checkpoint's weights do not match this model: missing {missing[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}")


def _load_optimizer_by_name(module: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict) -> None:
    """Give the name-keyed ``optimizer_state`` to ``optimizer.load_state_dict``, numbered in its
    parameters' order; a moment of a DTensor parameter is cut to this rank's shard (each rank holds
    the whole read state: no communication). Raises as :func:`load_full_state_as_read`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    parameters = dict(module.named_parameters())
    names = {id(p): name for name, p in parameters.items()}
    current = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    saved = [group["params"] for group in optimizer_state["param_groups"]]
    if [sorted(g) for g in current] != [sorted(g) for g in saved]:
        group = next(i for i, (a, b) in enumerate(zip(current, saved + [[]] * len(current))) if sorted(a) != sorted(b))
        raise CheckpointError(f"the checkpoint's optimizer parameter group {group} holds other parameters than this "
                              "run's; resume it with the engine that saved it")

    def as_parameter(name: str, value):
        p = parameters[name]
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.shape == p.shape:
            return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
        return value

    index = {name: i for i, name in enumerate(n for group in current for n in group)}
    state = {index[name]: {k: as_parameter(name, v) for k, v in value.items()}
             for name, value in optimizer_state["state"].items() if name in index}
    groups, start = [], 0
    for group, names_of_group in zip(optimizer_state["param_groups"], current):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(names_of_group)))})
        start += len(names_of_group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
