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

from memtrain.checkpoint.formats import DEEPSPEED_ENGINE
from memtrain.errors import CheckpointError
from memtrain.memory.zero_accounting import ZERO3_PERSISTENCE_THRESHOLD, zero3_persistent_elements
from memtrain.optim import weight_decay_groups

NAME = "deepspeed"
SAVES = (DEEPSPEED_ENGINE,)
"""The models it saves (:data:`memtrain.checkpoint.formats.MODEL_KINDS`)."""
WRITTEN_BY = "deepspeed"
"""The engine whose manifests meant this format before manifests named their format."""
TAG = "zero"
PARAMETERS_IN_COMPUTE_DTYPE = True
"""Its module weights are saved as the engine holds them: 16-bit under bf16/fp16 (a format without
this name saves fp32 weights: :class:`memtrain.checkpoint.formats.SavedRun`)."""


STAGING_LIMIT_BYTES = 4 * 10**9
"""The largest flat partition DeepSpeed serialises at once (its default sub-group of 1e9 fp32 elements)."""


def staging_bytes(optimizer_bytes: int, largest_tensor_bytes: int = 0, async_save: bool = False) -> int:
    """Host bytes a save stages of ``optimizer_bytes`` of device-resident optimizer state:
    DeepSpeed serialises one flat partition at a time (at most :data:`STAGING_LIMIT_BYTES`;
    ``largest_tensor_bytes`` and ``async_save`` unused: it writes now)."""
    return min(optimizer_bytes, STAGING_LIMIT_BYTES)


def expected_files(state) -> list[str]:
    """Glob patterns a complete save of ``state`` (its ``world_size`` and ``zero_stage``) holds."""
    files = [f"{TAG}/*model_states.pt"]
    if state.zero_stage:
        files += [f"{TAG}/*zero_pp_rank_{r}_mp_rank_*optim_states.pt" for r in range(state.world_size)]
    return files


def save(state, directory: str, process_group=None, async_save: bool = False) -> None:
    """DeepSpeed's native checkpoint under ``directory/TAG``: ``state.model`` is DeepSpeed's engine,
    every rank writes its own ZeRO partition (the loss scaler and engine counters included).
    Written now, whatever ``async_save``."""
    state.model.save_checkpoint(directory, tag=TAG, client_state={}, save_latest=False)
    return None


def load(state, directory: str, process_group=None) -> None:
    """Load DeepSpeed's checkpoint into its engine ``state.model``, on the world size that wrote it
    (another one converts through :func:`to_universal` first, beside the checkpoint).

    Raises:
        CheckpointError: DeepSpeed found no checkpoint under :data:`TAG`.
    """
    path, _ = state.model.load_checkpoint(directory, tag=TAG, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None:
        raise CheckpointError(f"{directory}: DeepSpeed found no checkpoint under tag '{TAG}'")


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


def write_universal(out: str, weights: dict[str, torch.Tensor], optimizer_state: dict, zero_stage: int,
                    param_groups: list[dict], buffers: frozenset = frozenset()) -> None:
    """Write a whole model's fp32 weights and its Adam state (another engine's checkpoint, read
    by :func:`read_full_state` of its format) as DeepSpeed's universal checkpoint under
    ``out/TAG``, which a ZeRO engine of any stage and world size loads into its partitions with
    its own universal loader (``load_universal_checkpoint``).

    The layout is the one ``ds_to_universal`` writes: per parameter ``zero/<name>/fp32.pt``,
    ``exp_avg.pt``, ``exp_avg_sq.pt`` (``{"param": tensor}``, the parameter's full shape) and
    ``step.pt``; ``zero/optimizer_state.pt`` (the step count where ZeRO-3 reads it, the group
    settings); and the engine's model-states file with its counters (``global_steps`` = the Adam
    step count).

    Args:
        out: a new folder.
        weights: parameter (and buffer) name → tensor, fp32.
        optimizer_state: ``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, ...}``; a
            parameter without state (never stepped) gets zero moments.
        zero_stage: 1, 2 or 3 (names the model-states file as that engine looks for it).
        param_groups: the loading optimizer's own group settings, without ``params``.
        buffers: names in ``weights`` that are buffers, not parameters (skipped here).
    """
    import deepspeed

    folder = os.path.join(out, TAG, "zero")
    state = optimizer_state.get("state", {})
    steps = {float(s["step"]) for s in state.values() if "step" in s}
    step = steps.pop() if len(steps) == 1 else 0.0  # AdamW steps every parameter together
    for name, tensor in weights.items():
        if name in buffers:
            continue
        own = state.get(name, {})
        os.makedirs(os.path.join(folder, name))
        for key, value in (("fp32", tensor), ("exp_avg", own.get("exp_avg")), ("exp_avg_sq", own.get("exp_avg_sq"))):
            value = torch.zeros_like(tensor) if value is None else value.reshape(tensor.shape)
            torch.save({"param": value.detach().float().contiguous(), "cat_dim": 0},
                       os.path.join(folder, name, f"{key}.pt"))
        torch.save(torch.tensor(step), os.path.join(folder, name, "step.pt"))
    torch.save({"ds_version": deepspeed.__version__, "param_groups": param_groups,
                "optimizer_state_dict": {"state": {0: {"step": torch.tensor(step)}}, "param_groups": param_groups}},
               os.path.join(folder, "optimizer_state.pt"))
    states = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "buffer_names": [], "global_steps": int(step), "skipped_steps": 0,
                "dp_world_size": 1, "mp_world_size": 1, "ds_version": deepspeed.__version__},
               os.path.join(out, TAG, states))


def full_state_read_bytes(shape, saved) -> tuple[int, int]:
    """What :func:`read_full_state` returns and holds at most (bytes; ``shape``: a
    :class:`memtrain.memory.shape.ModelShape`; ``saved``: a :class:`memtrain.checkpoint.formats.SavedRun`).

    It returns the fp32 weights and fp32 AdamW moments of the universal checkpoint (12 bytes per
    trained parameter, 4 per frozen one), and holds at most the larger of: that and one parameter's
    copy as it is read (the largest, fp32); and ``ds_to_universal``'s conversion, which reads the
    module's weights from the model-states file (ZeRO-1/2: every parameter in the saved dtype;
    ZeRO-3: the persistent ones it keeps whole) and one rank's optimizer file at a time (its fp32
    master partition and two moments: 12 bytes per trained parameter over the saving ranks)."""
    read = 4 * shape.parameters + 8 * shape.trained
    module = shape.parameters if (saved.zero_stage or 0) < 3 else zero3_persistent_elements(
        shape.numels, ZERO3_PERSISTENCE_THRESHOLD)
    conversion = saved.parameter_element_bytes * module + 12 * shape.trained // max(1, saved.world_size)
    return read, max(read + 4 * shape.largest_parameter, conversion)


def read_full_state(path: str, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's fp32 weights and the optimizer state keyed by parameter name, from
    DeepSpeed's universal checkpoint made in a temporary folder (removed again; the checkpoint is
    not touched): each parameter's ``fp32`` / ``exp_avg`` / ``exp_avg_sq``, the step count of the
    saved optimizer, and its parameter groups in the order memtrain built them
    (:func:`memtrain.optim.weight_decay_groups`); the module's buffers from its model-states file.
    ``module`` is this run's model (names and shapes). The weights are read one parameter at a
    time, not by :func:`read_full_weights` (DeepSpeed's ``zero_to_fp32``, which loads every
    rank's optimizer partition and holds them beside the weights it builds)."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="memtrain-universal-")
    try:
        to_universal(path, work)
        folder = os.path.join(work, TAG, "zero")
        saved = torch.load(os.path.join(folder, "optimizer_state.pt"), map_location="cpu", weights_only=False)
        # ZeRO-3 keeps the step count in its optimizer state, ZeRO-1/2 in each parameter's folder
        steps = [s["step"] for s in (saved.get("optimizer_state_dict") or {}).get("state", {}).values() if "step" in s]
        saved_groups = saved["param_groups"]
        del saved  # ZeRO-3's holds rank 0's whole optimizer partition: not beside the tensors read next
        names = {id(p): name for name, p in module.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in weight_decay_groups(module, 0.0)]
        state, weights = {}, _buffers(path, {name for name, _ in module.named_buffers()})
        for name, param in module.named_parameters():
            shape = getattr(param, "ds_shape", param.shape)
            read = lambda key: _universal_tensor(os.path.join(folder, name, f"{key}.pt"))  # noqa: E731
            weights[name] = read("fp32").reshape(shape).clone()
            step = read("step") if os.path.exists(os.path.join(folder, name, "step.pt")) else (steps[0] if steps else 0.0)
            state[name] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                           "exp_avg": read("exp_avg").reshape(shape).clone(),
                           "exp_avg_sq": read("exp_avg_sq").reshape(shape).clone()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    param_groups = [{k: v for k, v in g.items() if k != "params"} | {"params": names_of_group}
                    for g, names_of_group in zip(saved_groups, groups)]
    return weights, {"state": state, "param_groups": param_groups}


def _buffers(path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The module's buffers ``names`` from the checkpoint's model-states file (copies: the file
    is read mapped, its parameters never loaded)."""
    if not names:
        return {}
    import glob

    files = sorted(glob.glob(os.path.join(path, TAG, "*model_states.pt")))
    saved = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)["module"]
    return {name: saved[name].clone() for name in names if name in saved}


def _universal_tensor(file: str) -> torch.Tensor:
    """One tensor of a universal checkpoint's parameter folder (saved bare, or as ``{"param": tensor}``),
    detached: ``ds_to_universal`` saves the fp32 weights as tensors that require gradients, and a
    copy made of one would keep the read tensor alive through its autograd graph."""
    value = torch.load(file, map_location="cpu", weights_only=False)
    return (value["param"] if isinstance(value, dict) else value).detach()
