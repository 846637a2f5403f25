"""Activation (gradient) checkpointing: recompute each block's activations in backward instead
of keeping them (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

transformers models use their own switch (non-reentrant); plain modules get their repeated
blocks' ``forward`` wrapped in ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
Module hooks (FSDP2's all-gathers, memtrain's OOM hooks) stay outside the wrapped forward.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def enable_activation_checkpointing(model: nn.Module, blocks: list[nn.Module], every: int = 1) -> int:
    """Turn activation checkpointing on for every ``every``-th block.

    Args:
        model: the unwrapped model.
        blocks: its repeated blocks (see :func:`memtrain.backends.common.repeated_blocks`).
        every: checkpoint blocks 0, every, 2·every, … (transformers models: all blocks).

    Returns:
        Number of blocks checkpointed.
    """
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5: every n-th layer
            model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)
            return len(blocks[::every])
        if every == 1:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return len(blocks)
    chosen = blocks[::every]
    for block in chosen:
        if not getattr(block, "_memtrain_checkpointed", False):
            block._memtrain_forward_before = block.__dict__.get("forward")  # e.g. a compiled forward
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            block._memtrain_checkpointed = True
    return len(chosen)


def disable_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Undo :func:`enable_activation_checkpointing`: every block keeps its activations again (the
    planner switches activation checkpointing off when a faster plan without it fits)."""
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
    for block in blocks:
        if getattr(block, "_memtrain_checkpointed", False):
            before = block._memtrain_forward_before
            if before is None:
                del block.forward  # the instance attribute: the class's forward again
            else:
                block.forward = before  # the compiled forward it wrapped
            block._memtrain_checkpointed = False
