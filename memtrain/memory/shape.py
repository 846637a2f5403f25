"""A model's element counts, the facts the engines' formulas of model-state bytes
(:mod:`memtrain.memory.accounting`) need beyond its size, read from a real, meta or
ZeRO-3-partitioned module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memtrain.models import repeated_blocks


@dataclass(frozen=True)
class ModelShape:
    """The element counts of a model the engines' formulas need beyond its size.

    Attributes:
        parameters: all parameters (a tied one once).
        largest_block: parameters of the largest repeated block (FSDP2's unit: two of them are
            gathered at once); 0 = no repeated blocks.
        largest_module: parameters one submodule owns directly, at most (what ZeRO-3 gathers for
            one call: a Linear, an Embedding).
        root: parameters outside the repeated blocks (FSDP2's root unit: embeddings, head, final norm).
        numels: each parameter's elements (ZeRO-3 keeps the small ones whole); empty = none small.
        trainable: each parameter's elements that requires gradients (a LoRA model's adapters:
            the gradients and optimizer state are theirs alone); None = every parameter trains.
        frozen_bytes: bytes of the parameters that do not require gradients, in their dtype.
        first_module_numels: each parameter's elements of the first module that owns parameters
            (in registration order, the one a forward uses first: the input embeddings), the last
            one backward uses; () = unknown.
        tied: elements a state dict holds again under another name (a tied parameter's later
            names: GPT-2's output head, the input embeddings).
        blocks: how many repeated blocks (0 = none, or not known).
    """

    parameters: int
    largest_block: int = 0
    largest_module: int = 0
    root: int = 0
    numels: tuple[int, ...] = ()
    trainable: Optional[tuple[int, ...]] = None
    frozen_bytes: int = 0
    first_module_numels: tuple[int, ...] = ()
    tied: int = 0
    blocks: int = 0

    @property
    def trained(self) -> int:
        """Elements of the parameters that train (all of them unless ``trainable`` says otherwise)."""
        return self.parameters if self.trainable is None else sum(self.trainable)

    @property
    def trained_numels(self) -> tuple[int, ...]:
        """Each training parameter's elements (``numels`` when all train; ``(parameters,)`` when unknown)."""
        if self.trainable is not None:
            return self.trainable
        return self.numels or (self.parameters,)

    @property
    def largest_parameter(self) -> int:
        """Elements of the largest parameter (``largest_module`` when ``numels`` is not known: a
        module's parameters are at least its largest one)."""
        return max(self.numels or (self.largest_module,))

    @property
    def frozen(self) -> int:
        """Elements of the parameters that do not train."""
        return self.parameters - self.trained


def model_shape(model) -> ModelShape:
    """The :class:`ModelShape` of ``model`` (a real, meta or ZeRO-3-partitioned module: a
    partitioned parameter counts its whole ``ds_numel``)."""
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    unique = {id(p): p for p in model.parameters()}
    named = [p for _, p in model.named_parameters(remove_duplicate=False)]
    params = {i: numel(p) for i, p in unique.items()}
    blocks = [{id(p) for p in b.parameters()} for b in repeated_blocks(model)]
    in_blocks = set().union(*blocks) if blocks else set()
    own = (sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules())
    frozen = [p for p in unique.values() if not p.requires_grad]
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    return ModelShape(parameters=sum(params.values()),
                      largest_block=max((sum(params[i] for i in b) for b in blocks), default=0),
                      largest_module=max(own, default=0),
                      root=sum(n for i, n in params.items() if i not in in_blocks),
                      numels=tuple(params.values()),
                      trainable=tuple(numel(p) for p in unique.values() if p.requires_grad) if frozen else None,
                      frozen_bytes=sum(numel(p) * p.element_size() for p in frozen),
                      first_module_numels=tuple(numel(p) for p in first.parameters(recurse=False)) if first else (),
                      tied=sum(numel(p) for p in named) - sum(params.values()), blocks=len(blocks))
