"""Format ``deepspeed``: DeepSpeed's own checkpoint under the tag folder ``zero`` (module states,
one ZeRO optimizer partition per rank, and under partial offload memtrain's file of the
device-side optimizer, which DeepSpeed does not save). Saving and loading need the DeepSpeed
engine (:class:`memtrain.backends.deepspeed.DeepSpeedBackend`); the whole model's weights are
read without one by DeepSpeed's ``zero_to_fp32``."""

from __future__ import annotations

import contextlib
import io
import os

import torch
from torch import nn

NAME = "deepspeed"
TAG = "zero"


def expected_files(world_size: int, zero_stage: int = 0, partial_offload: bool = False) -> list[str]:
    """Glob patterns a complete save holds."""
    files = [f"{TAG}/*model_states.pt"]
    if zero_stage > 0:
        files += [f"{TAG}/*zero_pp_rank_{r}_mp_rank_*optim_states.pt" for r in range(world_size)]
    if partial_offload:
        files += [f"{TAG}/device_optimizer_rank_{r}.pt" for r in range(world_size)]
    return files


def read_full_weights(path: str) -> dict[str, torch.Tensor]:
    """fp32 weights consolidated from the ZeRO partitions with DeepSpeed's ``zero_to_fp32``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(path, tag=TAG))


def to_universal(path: str, out: str) -> None:
    """Convert the ZeRO checkpoint ``path`` (any world size) into DeepSpeed's universal checkpoint
    under ``out/TAG`` (``ds_to_universal``: per-parameter fp32 weights and Adam moments, no ranks).

    Raises:
        Exception: whatever DeepSpeed raises for a checkpoint it cannot convert.
    """
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as convert

    args = argparse.Namespace(input_folder=os.path.join(path, TAG), output_folder=os.path.join(out, TAG),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress goes to stdout
        convert(args)


def read_full_state(path: str, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's fp32 weights (:func:`read_full_weights`) and the optimizer state keyed by
    parameter name, from DeepSpeed's universal checkpoint made in a temporary folder (removed
    again; the checkpoint is not touched): each parameter's ``exp_avg`` / ``exp_avg_sq``, the step
    count of the saved optimizer, and its parameter groups in the order memtrain built them
    (:func:`memtrain.optim.weight_decay_groups`). ``module`` is this run's model (names and shapes)."""
    import shutil
    import tempfile

    from memtrain.optim import weight_decay_groups

    work = tempfile.mkdtemp(prefix="memtrain-universal-")
    try:
        to_universal(path, work)
        folder = os.path.join(work, TAG, "zero")
        saved = torch.load(os.path.join(folder, "optimizer_state.pt"), map_location="cpu", weights_only=False)
        # ZeRO-3 keeps the step count in its optimizer state, ZeRO-1/2 in each parameter's folder
        steps = [s["step"] for s in (saved.get("optimizer_state_dict") or {}).get("state", {}).values() if "step" in s]
        names = {id(p): name for name, p in module.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in weight_decay_groups(module, 0.0)]
        state = {}
        for name, param in module.named_parameters():
            shape = getattr(param, "ds_shape", param.shape)
            read = lambda key: _universal_tensor(os.path.join(folder, name, f"{key}.pt"))  # noqa: E731
            step = read("step") if os.path.exists(os.path.join(folder, name, "step.pt")) else (steps[0] if steps else 0.0)
            state[name] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                           "exp_avg": read("exp_avg").reshape(shape).clone(),
                           "exp_avg_sq": read("exp_avg_sq").reshape(shape).clone()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    param_groups = [{k: v for k, v in g.items() if k != "params"} | {"params": names_of_group}
                    for g, names_of_group in zip(saved["param_groups"], groups)]
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints its progress
        weights = read_full_weights(path)
    return weights, {"state": state, "param_groups": param_groups}


def _universal_tensor(file: str) -> torch.Tensor:
    """One tensor of a universal checkpoint's parameter folder (saved bare, or as ``{"param": tensor}``)."""
    value = torch.load(file, map_location="cpu", weights_only=False)
    return value["param"] if isinstance(value, dict) else value
