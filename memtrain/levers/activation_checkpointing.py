"""Activation checkpointing as a lever (``memory.activation_checkpointing off|on|selective|auto``):
recompute each checkpointed block's activations in backward instead of keeping them (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"), all of them (``on``) or only the cheap
ones (``selective``: matmul and attention outputs kept). Switchable between steps: the planner,
the OOM recovery and grow-back move it. The declaration (:class:`ActivationCheckpointing`) and
the mechanism (:func:`enable_activation_checkpointing`) are this one module.

Settings are the strings ``off``, ``selective``, ``on`` (plan rows, ``plan.json``, checkpoints and
``metrics.jsonl`` carry them); a plan state written when the setting was a bool reads as
``on``/``off`` (:func:`setting`).

Activation (gradient) checkpointing: recompute each block's activations in backward instead
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

from memtrain.backends import engine_module
from memtrain.errors import ConfigError
from memtrain.levers.base import ConfigField, Lever, LeverTarget, choices_annotation
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


CHOICES = {"off": ("off",), "on": ("on",), "selective": ("selective",), "auto": ("off", "on")}
"""The settings a plan may take for each ``memory.activation_checkpointing``, fastest first."""
SOLVER_CHOICES = ("off", "selective", "on")
"""``auto`` under ``memory.levers auto``."""

RECOMPUTE = {"off": 0.0, "selective": 0.1, "on": 1.0}
"""Extra forward FLOPs per checkpointed block, as a fraction of its forward (selective recomputes
the pointwise ops and norms, a small share of a block's FLOPs; an estimate the planner's timed
probes replace)."""


def setting(value) -> str:
    """The setting ``value`` as the lever names it (a bool of older plan states: ``on``/``off``)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class ActivationCheckpointing(Lever):
    """Settings: ``off``, ``selective`` or ``on`` (on every
    ``memory.activation_checkpointing_every_n_blocks``-th block)."""

    name = "activation_checkpointing"
    column = "AC"
    config_key = "memory.activation_checkpointing"
    escalate_event = "activation_checkpointing_on"
    config_fields = (
        ConfigField("activation_checkpointing", choices_annotation(CHOICES), "auto",
                    "Recompute block activations in backward: on = all of each block's; selective = keep the matmul "
                    "and attention outputs, recompute pointwise ops and norms (same losses as off, less than half of "
                    "off's activation memory on GPT-2); auto = off until an OOM at micro-batch 1 asks for on."),
        ConfigField("activation_checkpointing_every_n_blocks", "int", 1,
                    "With activation checkpointing on: recompute every n-th block (1 = all; 2 = half the blocks, less "
                    "recompute, more memory)."),
        ConfigField("checkpoint_every", "Optional[int]", None,
                    "Deprecated name of ``activation_checkpointing_every_n_blocks``."))
    named_as = "activation checkpointing"
    auto_words = "activation checkpointing off, selective or on (when memory.activation_checkpointing is auto)"
    by_hand = "on|selective"

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        every = cfg.memory.activation_checkpointing_every_n_blocks
        if every < 1:
            raise ConfigError("memory.activation_checkpointing_every_n_blocks",
                              f"must be >= 1 (1 = every block), got {every}")

    def choices(self, cfg, spec) -> tuple:
        ac = cfg.memory.activation_checkpointing
        options = SOLVER_CHOICES if ac == "auto" and getattr(cfg.memory, "levers", "off") == "auto" else CHOICES[ac]
        if spec is not None and not engine_module(spec.name).takes_selective_checkpointing(spec):
            if ac == "selective":
                raise ConfigError("memory.activation_checkpointing", "selective is not supported under DeepSpeed "
                                  "ZeRO-3: its parameter gathers inside a block differ between the forward and the "
                                  "recompute, which torch's selective checkpointing refuses; use on (or off)")
            options = tuple(o for o in options if o != "selective")
        return options

    def apply(self, target: LeverTarget, value) -> None:
        value = setting(value)
        now = getattr(target.model, "_memtrain_activation_checkpointing", "off")
        if value != now:
            if now != "off":
                disable_activation_checkpointing(target.model, target.blocks)
            if value != "off":
                enable_activation_checkpointing(target.model, target.blocks,
                                                target.cfg.memory.activation_checkpointing_every_n_blocks, value)
        target.model._memtrain_activation_checkpointing = value
        if target.faults is not None:
            target.faults.keeps_one_block = value == "on"

    def event_for(self, value) -> str:
        return f"activation_checkpointing_{setting(value)}"  # _on, _selective (and _off for a move back)

    def events(self) -> tuple[str, ...]:
        return tuple(f"activation_checkpointing_{value}" for value in SOLVER_CHOICES)

    def restore(self, saved):
        return setting(saved)

    def block_period(self, value, cfg) -> int:
        return cfg.memory.activation_checkpointing_every_n_blocks if setting(value) != "off" else 1

    def recompute_fraction(self, value, cfg) -> float:
        return RECOMPUTE[setting(value)] / cfg.memory.activation_checkpointing_every_n_blocks

    def describe(self, value) -> str:
        return {"off": "", "selective": "+ selective AC", "on": "+ AC"}[setting(value)]

    def stop_words(self, value) -> str:
        value = setting(value or "off")
        return {"off": "", "selective": "selective activation checkpointing", "on": "activation checkpointing"}[value]

    def stop_advice(self, value, engine) -> str:
        value = setting(value or "off")
        return {"off": "memory.activation_checkpointing selective (or on)",
                "selective": "memory.activation_checkpointing on", "on": ""}[value]

    def floor_note(self, value, choices: tuple) -> str:
        value = setting(value)
        if value == "off":
            return "(memory.activation_checkpointing is off)"
        return f"with {'selective ' if value == 'selective' else ''}activation checkpointing on"
