"""Model transforms, applied in one fixed order for every engine (torchtitan's order):

1. ``torch.compile`` of each repeated block's ``forward`` (``training.compile``; regional
   compilation, as torchtitan does), before the engine wraps the blocks, so the engines' and
   memtrain's module hooks stay outside the compiled code;
2. activation checkpointing wrappers on the repeated blocks (when the plan starts with it on).
   torchtitan wraps before compiling; here the checkpoint wraps the compiled forward, because the
   OOM protocol and the planner switch checkpointing on and off during the run and the block must
   stay compiled either way;
3. replicated state made identical on every rank, then the engine wraps the model and builds
   the optimizer (DDP, FSDP2 ``fully_shard`` per block then root, DeepSpeed ``initialize``);
4. OOM agreement hooks, then fault-injection hooks, registered ahead of the engine's own hooks.

Activation checkpointing can also be switched on later, by the OOM protocol, on the wrapped
model (:meth:`ModelTransforms.enable_activation_checkpointing`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from memtrain.activation import disable_activation_checkpointing, enable_activation_checkpointing
from memtrain.backends.base import Backend
from memtrain.backends.common import repeated_blocks, sync_replicated_state
from memtrain.faults import FaultInjector
from memtrain.oom import OOMSync


class ModelTransforms:
    """Owns the model's repeated blocks and the transforms applied to them.

    Args:
        model: the freshly built, unwrapped model (identical structure on every rank).
        every_n_blocks: activation checkpointing on every n-th block (``memory.activation_checkpointing_every_n_blocks``).
        faults: the fault injector (told when activation checkpointing is on).
        compile_blocks: ``training.compile``: compile each block's forward (:func:`compile_forwards`).

    Attributes:
        blocks: the repeated blocks, found before the engine wraps (and renames) them.
        activation_checkpointing: whether it is on.
    """

    def __init__(self, model: nn.Module, every_n_blocks: int, faults: FaultInjector, compile_blocks: bool = False):
        self.blocks = repeated_blocks(model)
        self.every_n_blocks = every_n_blocks
        self.faults = faults
        self.compile_blocks = compile_blocks
        self.activation_checkpointing = False

    def enable_activation_checkpointing(self, unwrapped: nn.Module) -> None:
        """Recompute the blocks' activations in backward from now on (before or after wrapping;
        a second call changes nothing)."""
        if self.activation_checkpointing:
            return
        enable_activation_checkpointing(unwrapped, self.blocks, self.every_n_blocks)
        self.activation_checkpointing = self.faults.activation_checkpointing = True

    def set_activation_checkpointing(self, unwrapped: nn.Module, on: bool) -> None:
        """Switch activation checkpointing on or off (the planner's plans include it)."""
        if on:
            self.enable_activation_checkpointing(unwrapped)
        elif self.activation_checkpointing:
            disable_activation_checkpointing(unwrapped, self.blocks)
            self.activation_checkpointing = self.faults.activation_checkpointing = False

    def apply(self, model: nn.Module, engine: Backend, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
              sync: OOMSync, activation_checkpointing: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Transform ``model`` in the fixed order above.

        Returns:
            (the engine-wrapped model, its optimizer).
        """
        if self.compile_blocks:
            compile_forwards(self.blocks)
        if activation_checkpointing:
            self.enable_activation_checkpointing(model)
        sync_replicated_state(model, engine.process.device)
        model, optimizer = engine.prepare(model, make_optimizer)
        sync.install(self.blocks, engine.compute_collectives(True))  # the last micro-batch's: the most
        self.faults.install(self.blocks)  # after the agreement hooks: an injected OOM comes first, as a real one would
        return model, optimizer


def compiled_graph_count() -> int:
    """Graphs ``torch.compile`` has made in this process so far: every compile and recompile,
    training and evaluation forwards alike (TorchDynamo's ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_forwards(blocks: list[nn.Module], backend: str = "inductor") -> None:
    """``torch.compile`` each block's ``forward`` in place (regional compilation: one compiled
    region per block, shared code for identical blocks, as torchtitan compiles per block).

    The block's own hooks (FSDP2's all-gathers, the OOM agreement points, fault injection) run
    outside the compiled function; ZeRO-3's parameter fetches hook every submodule inside the
    block, which DeepSpeed keeps out of compiled code (``torch.compiler.disable``), so under ZeRO-3
    each block compiles in several pieces. Shapes start static; micro-batches of new sizes (a plan
    change, evaluation) recompile until the batch dimension is dynamic (torch's automatic dynamic
    shapes), so later plan changes reuse it. Switching activation checkpointing on compiles once
    more (the forward then runs inside the checkpoint). ``backend`` is ``torch.compile``'s.
    """
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
