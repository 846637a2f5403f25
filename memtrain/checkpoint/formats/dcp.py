"""Format ``dcp``: torch.distributed.checkpoint under ``dcp/`` — every rank writes its own shard
file (``__RANK_0.distcp``), rank 0 the ``.metadata``; loading reshards to any world size (FSDP2).
The model and optimizer are saved through ``torch.distributed.checkpoint.state_dict`` (whose
keys do not depend on the wrapping)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from memtrain.checkpoint.formats import SHARDED_MODULE, WHOLE_MODULE
from memtrain.errors import CheckpointError

NAME = "dcp"
SAVES = (WHOLE_MODULE, SHARDED_MODULE)
"""The models it saves (:data:`memtrain.checkpoint.formats.MODEL_KINDS`)."""
WRITTEN_BY = "fsdp"
"""The engine whose manifests meant this format before manifests named their format."""
FOLDER = "dcp"


COPY_AHEAD_BYTES = 10_000_000
"""torch.distributed.checkpoint's ``FileSystemWriter`` copies device tensors this many bytes ahead
of writing them (``per_thread_copy_ahead``)."""


def staging_bytes(optimizer_bytes: int, largest_tensor_bytes: int = 0, async_save: bool = False) -> int:
    """Host bytes a save stages of ``optimizer_bytes`` of device-resident optimizer state: all of it
    with ``async_save`` (``dcp.async_save`` copies the state to the CPU first); a synchronous
    ``dcp.save`` copies one tensor at a time (the largest, ``largest_tensor_bytes``, and
    :data:`COPY_AHEAD_BYTES`)."""
    return optimizer_bytes if async_save else min(optimizer_bytes, largest_tensor_bytes + COPY_AHEAD_BYTES)


def expected_files(state) -> list[str]:
    """Glob patterns a complete save of ``state.world_size`` ranks holds."""
    return [f"{FOLDER}/.metadata"] + [f"{FOLDER}/__{r}_*.distcp" for r in range(state.world_size)]


def save(state, directory: str, process_group=None, async_save: bool = False):
    """Save ``state.model`` and ``state.optimizer`` (a collective over ``process_group``, None =
    the default group; ``state``: a :class:`memtrain.checkpoint.formats.CheckpointState`). With
    ``async_save``, in a background thread after staging to the CPU (``process_group``: a group
    of its own, gloo), returning its future; else None."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _no_scaler(state)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    saved = {"model": model_sd, "optim": optim_sd}
    path = os.path.join(directory, FOLDER)
    if async_save:
        return dcp.async_save(saved, checkpoint_id=path, process_group=process_group)
    dcp.save(saved, checkpoint_id=path, process_group=process_group)
    return None


def _no_scaler(state) -> None:
    """Refuse a state with an fp16 GradScaler, whose state this format does not keep.

    Raises:
        CheckpointError: ``state.scaler`` is set (names the format that keeps it)."""
    if state.scaler is not None:
        raise CheckpointError("checkpoint format dcp keeps no fp16 GradScaler state: write this engine's "
                              "fp16 run in safetensors")


def load(state, directory: str, process_group=None) -> None:
    """Load into this run's sharding (a collective; any saved world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _no_scaler(state)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    saved = {"model": model_sd, "optim": optim_sd}
    dcp.load(saved, checkpoint_id=os.path.join(directory, FOLDER), process_group=process_group)
    set_state_dict(state.model, state.optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optim"])


def full_state_read_bytes(shape, saved) -> tuple[int, int]:
    """What :func:`read_full_state` returns and holds at most (bytes): the fp32 weights, a tied
    parameter under each of its names (FSDP2's full state dict gives every name its own copy), and
    AdamW's two moments of each trained parameter; while reading, two stored pieces more:
    ``dcp_to_torch_save`` fills the whole state dict one stored piece at a time, and torch's
    ``FileSystemReader.read_data`` still holds the piece it copied last while ``torch.load`` reads
    the next. Saved whole (``saved.sharded`` False), two whole fp32 parameters, the largest;
    saved sharded, two of its shards, counted as one whole parameter (exact on 2 ranks, where
    MemTracker counted it; an upper bound on more, whose shards are smaller, and within one row
    of a parameter with an odd number of rows, which FSDP2 shards unevenly). ``shape``: a
    :class:`memtrain.memory.shape.ModelShape`; ``saved``: a
    :class:`memtrain.checkpoint.formats.SavedRun`."""
    read = 4 * (shape.parameters + shape.tied) + 2 * saved.state_element_bytes * shape.trained
    return read, read + 4 * shape.largest_parameter * (1 if saved.sharded else 2)


def read_full_state(path: str, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's weights and the full optimizer state keyed by parameter name, read in
    this process without a process group (torch's ``dcp_to_torch_save`` into a temporary file in
    the system's temporary folder, removed again; the checkpoint is not touched). ``module`` is
    not needed: the keys are names already."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fd, file = tempfile.mkstemp(prefix="memtrain-full-state-", suffix=".pt")
    os.close(fd)
    try:
        dcp_to_torch_save(os.path.join(path, FOLDER), file)
        state = torch.load(file, map_location="cpu", weights_only=True)
    finally:
        os.remove(file)
    return state["model"], state["optim"]


def read_full_weights(path: str, prefix: Optional[str] = "model.") -> dict[str, torch.Tensor]:
    """The model entries of the shards, read without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(os.path.join(path, FOLDER)).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=os.path.join(path, FOLDER), no_dist=True)
    return {key[len(prefix):]: value for key, value in state.items()}
