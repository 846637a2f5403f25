"""DeepSpeed's partial optimizer offload (ZeRO-3 ``offload_optimizer.ratio`` < 1, the "Twin-Flow"
of DeepSpeed's ZeRO-Offload++ blog): the glue that makes it train and resume like full offload.

DeepSpeed keeps the first ``1 - ratio`` of each rank's optimizer sub-groups on the device and
steps them with a second optimizer (``backup_optimizer``, torch's AdamW), the rest on the host
with CPU Adam. As of DeepSpeed 0.19 that second optimizer is built once with the first group's
learning rate (a schedule never reaches it) and its state is in no checkpoint (a resume restarts
those Adam moments from zero). memtrain, around DeepSpeed:

- sizes the sub-groups (``zero_optimization.sub_group_size``, :func:`sub_group_size`) so each rank
  has about :data:`SUB_GROUPS` of them: DeepSpeed splits by whole sub-groups (the first
  ``int((1 - ratio) × sub-groups)`` on the device, so the device share is at most ``1 - ratio``,
  less by up to one sub-group and the rounding of the groups' ends at whole parameters), and with
  its default of 1e9 elements a model below a billion parameters per rank has one, and the ratio
  does nothing;
- copies the learning rate and the other hyper-parameters from the CPU Adam's groups to the
  device optimizer's before every step (:func:`sync_hyperparameters`);
- saves the device optimizer's state of each of its sub-groups beside DeepSpeed's checkpoint,
  one file per rank, and restores it (:func:`state_dict`, :func:`load_state_dict`);
- on DeepSpeed's CPU accelerator (no GPU), where both sides would be named ``cpu`` and DeepSpeed's
  own test would send every sub-group to CPU Adam, names the device side ``cpu:0`` (the same
  device), so the run steps the two optimizers exactly as a GPU run does (:func:`prepare`).
"""

from __future__ import annotations

from typing import Any

import torch

SUB_GROUPS = 64
"""Sub-groups per rank memtrain asks DeepSpeed for under partial offload (the ratio's granularity)."""

DEVICE_SIDE_ON_CPU = "cpu:0"


def sub_group_size(n_params: int, world_size: int) -> int:
    """``zero_optimization.sub_group_size`` (elements) giving each rank about :data:`SUB_GROUPS`
    sub-groups of its ``n_params / world_size`` partition."""
    return max(1, -(-n_params // (max(1, world_size) * SUB_GROUPS)))


def is_partial(zero_optimizer) -> bool:
    """Whether ``zero_optimizer`` (DeepSpeed's ZeRO-3 optimizer) keeps part of its state on the device."""
    return hasattr(zero_optimizer, "backup_optimizer") and getattr(zero_optimizer, "partial_offload", 1.0) != 1.0


def device_sub_groups(zero_optimizer) -> list[int]:
    """Indices of the sub-groups DeepSpeed steps on the device (its rule: the first
    ``int((1 - ratio) × sub-groups)``)."""
    n = len(zero_optimizer.fp32_partitioned_groups_flat)
    return [i for i in range(n) if i < int((1 - zero_optimizer.partial_offload) * n)]


def prepare(zero_optimizer, device_type: str) -> tuple[int, int]:
    """After ``deepspeed.initialize``: on the CPU accelerator, name the device side ``cpu:0`` (see
    the module docstring). Returns ``(sub-groups on the device, sub-groups)`` of this rank
    (``(0, 0)`` without partial offload)."""
    if not is_partial(zero_optimizer):
        return 0, 0
    on_device = device_sub_groups(zero_optimizer)
    if device_type == "cpu":
        for i in on_device:
            zero_optimizer.subgroup_to_device[i] = DEVICE_SIDE_ON_CPU
    return len(on_device), len(zero_optimizer.fp32_partitioned_groups_flat)


def sync_hyperparameters(zero_optimizer) -> None:
    """Before each optimizer step: the device optimizer's groups take the CPU Adam's learning rate,
    betas, epsilon and weight decay (the schedule writes only the latter), and hold no parameters.

    DeepSpeed hands the device optimizer one sub-group at a time (``params = [partition]``, then
    ``[]``), and builds its groups after the first from the CPU Adam's own group dicts. Loading a
    checkpoint replaces the CPU Adam's dicts (``Optimizer.load_state_dict``) after DeepSpeed filled
    them with every partition of the group, so the device optimizer would keep a stale list and
    step the host's partitions a second time."""
    if not is_partial(zero_optimizer):
        return
    for device_group, host_group in zip(zero_optimizer.backup_optimizer.param_groups,
                                        zero_optimizer.optimizer.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in host_group:
                device_group[key] = host_group[key]
    for device_group in zero_optimizer.backup_optimizer.param_groups:
        if not any(device_group is g for g in zero_optimizer.optimizer.param_groups):
            device_group["params"] = []


def state_dict(zero_optimizer) -> dict[int, dict[str, Any]]:
    """The device optimizer's state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) of each device
    sub-group of this rank, keyed by sub-group index: references to the live tensors (no copy;
    ``torch.save`` stages one tensor at a time through host memory)."""
    if not is_partial(zero_optimizer):
        return {}
    state = zero_optimizer.backup_optimizer.state
    out = {}
    for i in device_sub_groups(zero_optimizer):
        held = state.get(zero_optimizer.fp32_partitioned_groups_flat[i])
        if held:
            out[i] = dict(held)
    return out


def load_state_dict(zero_optimizer, saved: dict[int, dict[str, Any]]) -> None:
    """Restore :func:`state_dict` into the device optimizer (after DeepSpeed loaded its checkpoint).

    Raises:
        ValueError: ``saved`` holds other sub-groups than this run keeps on the device (another
            ratio or model: a sub-group moved to the device would restart its Adam moments), or the
            sizes differ.
    """
    if not saved:
        return
    device = set(device_sub_groups(zero_optimizer)) if is_partial(zero_optimizer) else set()
    if set(saved) != device:
        raise ValueError(f"the checkpoint holds device-side optimizer state of sub-groups {sorted(saved)}, this run "
                         f"keeps {sorted(device)} on the device (another backend.offload_optimizer_ratio?)")
    state = zero_optimizer.backup_optimizer.state
    for i, held in saved.items():
        param = zero_optimizer.fp32_partitioned_groups_flat[i]
        if held["exp_avg"].numel() != param.numel():
            raise ValueError(f"device-side optimizer state of sub-group {i} has {held['exp_avg'].numel()} elements, "
                             f"the run's sub-group {param.numel()}")
        state[param] = {k: v.to(param.device) if torch.is_tensor(v) and k != "step" else v for k, v in held.items()}
