"""Format ``deepspeed``: DeepSpeed's own checkpoint under the tag folder ``zero`` (module states,
one ZeRO optimizer partition per rank, and under partial offload memtrain's file of the
device-side optimizer, which DeepSpeed does not save). Saving and loading need the DeepSpeed
engine (:class:`memtrain.backends.deepspeed.DeepSpeedBackend`); the whole model's weights are
read without one by DeepSpeed's ``zero_to_fp32``."""

from __future__ import annotations

import torch

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
