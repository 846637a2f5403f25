"""Activation (gradient) checkpointing: recompute each block's activations in backward instead
of keeping them (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

transformers models use their own switch (non-reentrant); plain modules get their repeated
blocks' ``forward`` wrapped in ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
Module hooks (FSDP2's all-gathers, memtrain's OOM hooks) stay outside the wrapped forward.

*Selective* checkpointing keeps the outputs of the matrix multiplications and attention inside a
checkpointed block and recomputes only the cheap operators between them (pointwise ops, norms,
softmax outside fused attention): torch's selective-checkpoint policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``), the op-level AC of torchtitan
(its ``_save_list``) and of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models". The recompute replays the same operators on the same inputs, so losses and
gradients equal those without checkpointing.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memtrain.memory.simulated import note_kept

MODES = ("on", "selective")
"""What :func:`enable_activation_checkpointing` can do to a block: recompute all of it, or only
what is cheap."""

_aten = torch.ops.aten
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._flash_attention_forward.default, _aten._efficient_attention_forward.default))
"""The operators whose outputs selective checkpointing keeps: the matrix multiplications and
attention kernels (most of a block's FLOPs, little of its activation bytes)."""


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in SAVED_OPS:
        output = getattr(ctx, "op_output", None)  # torch 2.13's context has it; older ones do not
        if output is not None and not ctx.is_recompute:
            note_kept(output)  # the simulated device counts what is kept
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for selective checkpointing."""
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpoint_kwargs(mode: str) -> dict:
    """Keyword arguments of ``torch.utils.checkpoint.checkpoint`` for ``mode`` (one of :data:`MODES`).

    Raises:
        ValueError: another mode.
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}; one of {MODES}")
    return {"use_reentrant": False, **({"context_fn": selective_context} if mode == "selective" else {})}


def enable_activation_checkpointing(model: nn.Module, blocks: list[nn.Module], every: int = 1,
                                    mode: str = "on") -> int:
    """Turn activation checkpointing on for every ``every``-th block (call
    :func:`disable_activation_checkpointing` before changing ``mode``).

    Args:
        model: the unwrapped model.
        blocks: its repeated blocks (see :func:`memtrain.models.repeated_blocks`).
        every: checkpoint blocks 0, every, 2·every, … (transformers models: all blocks).
        mode: ``on`` (recompute the whole block) or ``selective`` (keep matmul and attention outputs).

    Returns:
        Number of blocks checkpointed.

    Raises:
        ValueError: an unknown ``mode``.
    """
    kwargs = checkpoint_kwargs(mode)
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5: every n-th layer
            model.activation_checkpointing_enable(kwargs, every_n_layers=every)
            return len(blocks[::every])
        if every == 1:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            return len(blocks)
    chosen = blocks[::every]
    for block in chosen:
        if not getattr(block, "_memtrain_checkpointed", False):
            block._memtrain_forward_before = block.__dict__.get("forward")  # e.g. a compiled forward
            block.forward = functools.partial(checkpoint, block.forward, **kwargs)
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
