"""Model transforms, applied in one fixed order for every engine (torchtitan's order):

1. ``torch.compile`` of each repeated block's ``forward`` (``training.compile``; regional
   compilation, as torchtitan does), before the engine wraps the blocks, so the engines' and
   memtrain's module hooks stay outside the compiled code;
2. the plan's model levers (:mod:`memtrain.levers`: activation checkpointing wrappers on the
   repeated blocks, the chunked cross-entropy output layer). torchtitan wraps before compiling;
   here the checkpoint wraps the compiled forward, because the OOM protocol and the planner
   switch checkpointing on and off during the run and the block must stay compiled either way;
3. replicated state made identical on every rank, then the engine wraps the model and builds
   the optimizer (DDP, FSDP2 ``fully_shard`` per block then root, DeepSpeed ``initialize``);
   the plan's engine levers (FSDP2 resharding, the offload ratio) were given to the engine when
   it was built;
4. OOM agreement hooks, then fault-injection hooks, registered ahead of the engine's own hooks.

Later plans (the planner's choice, the OOM protocol, grow-back, a probe's or a capped step's
plan) take effect in one function, :meth:`ModelTransforms.apply_plan`, once per change: the
engine's micro-batch and accumulation, then the model levers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from memtrain.backends.base import Backend
from memtrain.backends.common import sync_replicated_state
from memtrain.levers import LeverTarget, apply_levers
from memtrain.oom import OOMSync
from memtrain.plan import Plan


class ModelTransforms:
    """Owns the model's repeated blocks and the transforms applied to them.

    Args:
        target: the freshly built, unwrapped model with its repeated blocks (found before the
            engine wraps and renames them), objective, config and fault injector.
        compile_blocks: ``training.compile``: compile each block's forward (:func:`compile_forwards`).
    """

    def __init__(self, target: LeverTarget, compile_blocks: bool = False):
        self.target = target
        self.blocks = target.blocks
        self.compile_blocks = compile_blocks
        self.engine: Optional[Backend] = None
        self.plan: Optional[Plan] = None  # the plan in effect

    def apply_plan(self, plan: Plan) -> None:
        """The one place a plan takes effect after the build: the engine's micro-batch and
        accumulation (:meth:`memtrain.backends.base.Backend.set_plan`), then the lever settings
        (engine levers fixed at build are checked, not changed). Nothing is done when ``plan`` is
        already in effect, so each change is applied once however many callers pass it on."""
        if plan == self.plan:
            return
        self.engine.set_plan(plan)
        apply_levers(self.target, plan.settings())
        self.plan = plan

    def apply(self, model: nn.Module, engine: Backend, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
              sync: OOMSync, plan: Plan) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Transform ``model`` (the target's) in the fixed order above for the starting ``plan``.

        Returns:
            (the engine-wrapped model, its optimizer).
        """
        if self.compile_blocks:
            compile_forwards(self.blocks)
        apply_levers(self.target, plan.settings(), model_levers=True)
        self.target.built = {name: setting for name, setting in plan.levers}  # engine levers are fixed from here
        sync_replicated_state(model, engine.process.device)
        model, optimizer = engine.prepare(model, make_optimizer)
        self.engine, self.plan = engine, plan  # the engine was built with the starting plan
        sync.install(self.blocks, engine.compute_collectives(True), model)  # the last micro-batch's: the most
        self.target.faults.install(self.blocks)  # after the agreement hooks: an injected OOM comes first, as a real one would
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
