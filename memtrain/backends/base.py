"""The engine interface every backend implements (a ``typing.Protocol``, as in torchtune).

The loop talks only to this interface, never to DDP, FSDP or DeepSpeed directly, so switching
engines is one config key (``backend.name``) and the loop never branches on the engine. Who this
process is (rank, device, collectives) is not the engine's business: that is
:class:`memtrain.distributed.ProcessState`, built before the engine and shared with it.

Besides the class, each engine module defines what the registry (:mod:`memtrain.backends`)
reads without building an engine:

* ``build(cfg, spec, process, precision, plan) -> Backend`` (:func:`memtrain.backends.make_backend`
  calls it and hands the backend its ``checkpoint_io``);
* ``model_build_context(cfg, spec, precision, world_size, python_function)``: the context the model
  is built in (ZeRO-3 builds a pretrained model, or a Python caller's model function, already partitioned);
* ``VARIANTS``: its :class:`memtrain.backends.spec.EngineVariant` placements (the placement
  planner's and ``memtrain memory``'s rows).

An engine's bytes of model state come from :func:`memtrain.backends.model_state_bytes`;
its checkpoint files are written and read by a format (:mod:`memtrain.checkpoint.formats`).
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from memtrain.distributed import ProcessState

if TYPE_CHECKING:
    from memtrain.checkpoint.formats import CheckpointState


class ComputeCollectives(NamedTuple):
    """Whether an engine's collectives run inside a micro-batch's forward and inside its backward
    (:meth:`Backend.compute_collectives`). The OOM protocol agrees before every block's forward
    where ``forward`` is set, before the backward of the blocks ``backward_blocks`` names (forward
    order; None = every block) where ``backward`` is set, and after a micro-batch when the next
    one communicates before its first block hook (in forward, or in a backward whose collectives
    are not confined to named blocks).

    Attributes:
        backward_blocks: indices of the blocks inside whose backward (up to the next block's, or
            the end of the micro-batch for block 0) every backward collective lies; None = any.
    """

    forward: bool
    backward: bool
    backward_blocks: Optional[frozenset] = None

    @property
    def any(self) -> bool:
        return self.forward or self.backward

    @property
    def before_first_block(self) -> bool:
        """Collectives may run before the first block hook of the micro-batch (the root's or
        the embeddings' gather in forward, the head's gradients in backward)."""
        return self.forward or (self.backward and self.backward_blocks is None)


@runtime_checkable
class Backend(Protocol):
    """One distributed engine.

    Attributes:
        name: ``ddp``, ``fsdp`` or ``deepspeed``.
        process: the process state (rank, world size, device, collectives).
        precision: resolved ``bf16|fp16|fp32``.
        grad_average_factor: the number the engine divides summed gradients by when it reduces
            them across ranks (world_size for DDP-style averaging). The loop multiplies each
            micro-batch loss by it so the reduced gradient is ``sum of token losses / global
            token count``.
        supports_async_save: :meth:`save_state` can write in the background.
        scheduler_config: the LR schedule the user's engine config names (DeepSpeed JSON's
            ``scheduler`` section, ``{"type", "params"}``), or None for memtrain's own.
        optimizer_element_bytes: state bytes per parameter element of a Python caller's optimizer
            (:func:`memtrain.optim.state_bytes_per_element`), counted by :meth:`model_state_bytes`
            in place of AdamW's; None = memtrain's AdamW (set by the build before the planner runs).
        checkpoint_io: the module of the checkpoint format it writes and reads through, handed to it
            when it is built (:func:`memtrain.backends.make_backend`; the engine imports no format):
            ``save``/``load``/``expected_files`` of a :class:`memtrain.checkpoint.formats.CheckpointState`.
        checkpoint_model: what its ``checkpoint_state`` hands the format, one of
            :data:`memtrain.checkpoint.formats.MODEL_KINDS` (its module's ``CHECKPOINT_MODEL``, set
            with ``checkpoint_io``), written into the manifest: how the saved tensors are split.
    """

    name: str
    process: ProcessState
    precision: str
    grad_average_factor: float
    supports_async_save: bool
    scheduler_config: Optional[dict]
    optimizer_element_bytes: Optional[float]
    checkpoint_io: ModuleType
    checkpoint_model: str

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model for the engine and build its optimizer (on the wrapped parameters)."""

    def compute_collectives(self, last_micro_batch: bool) -> "ComputeCollectives":
        """Where the engine communicates inside a micro-batch's compute (FSDP2's all-gathers and
        reduce-scatters, ZeRO's parameter fetches and gradient partitioning, DDP's overlapped
        bucket all-reduce), so the OOM protocol agrees at those block boundaries and nowhere else;
        ``last_micro_batch``: the step's last (the one that reduces gradients)."""

    def reduction_context(self, model: nn.Module, reduce_gradients: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward+backward; ``reduce_gradients=False`` skips the
        gradient reduction (non-final micro-batches of an accumulation)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a scalar loss (with loss scaling where the precision needs it)."""

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                      skip: bool = False) -> float:
        """Clip gradients to ``max_norm`` (0 = no clipping), step the optimizer, zero gradients.

        The optimizer step is skipped (gradients and the engine's per-step state discarded) when
        ``skip`` is set (a non-finite loss) or the global gradient norm is not finite; the
        norm is the same on every rank, so all ranks skip together. An fp16 loss scaler still
        updates its scale.

        Returns:
            The global gradient L2 norm before clipping (nan when skipped before computing it).
        """

    def loss_scale(self) -> Optional[float]:
        """The fp16 dynamic loss scale, or None when no loss scaling is used."""

    def set_plan(self, plan) -> None:
        """Adopt a new micro-batch plan (engines that track accumulation themselves)."""

    def discard_step(self, model: nn.Module) -> None:
        """Discard a step's partial gradients and the engine's per-step state, so that the same
        batch can be trained again: after every rank agreed on an OOM, and after each timed probe
        of the planner; free cached memory."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the engine's wrapper."""

    def full_state_dict(self, model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
        """The whole model's state dict on CPU, on rank 0 (None elsewhere). A collective: every
        rank must call it (sharded engines gather here)."""

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                   max_shard_size: str = "5GB", async_save: bool = False) -> Optional[Future]:
        """Write model and optimizer state (and the engine's loss-scaler state) into ``directory``
        through :attr:`checkpoint_io`.

        Every rank calls it; the format decides who writes what from :meth:`checkpoint_state`
        (its ``writes``), and no two ranks write the same file. With ``async_save`` an engine that can (``supports_async_save``) returns a future
        whose ``result()`` every rank must wait for before the checkpoint is committed; others
        return None.
        """

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                         max_shard_size: str = "5GB") -> "CheckpointState":
        """What :attr:`checkpoint_io` saves and loads: the training state as this engine holds it
        (:class:`memtrain.checkpoint.formats.CheckpointState`; ``model``, ``optimizer`` as the
        engine prepared them, None when only the files are asked for)."""

    def expected_files(self) -> list[str]:
        """Glob patterns, relative to the checkpoint directory, that a complete save of this
        engine at this world size matches (each at least once)."""

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                   saved_world_size: int) -> None:
        """Load what :meth:`save_state` wrote (every rank calls it).

        Raises:
            memtrain.errors.CheckpointError: the engine cannot load a checkpoint written by
                ``saved_world_size`` ranks on this many.
        """

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                        optimizer_state: dict[str, Any], directory: str) -> None:
        """Load a checkpoint written by another engine, given as the whole model's weights and the
        full optimizer state keyed by parameter name (``torch.distributed.checkpoint.state_dict``'s
        layout; :func:`memtrain.checkpoint.formats.read_full_state`). ``directory`` is the
        checkpoint (an engine may convert beside it, never in it). Every rank calls it.

        Raises:
            memtrain.errors.CheckpointError: the engine cannot take another engine's state.
        """

    def manifest_fields(self) -> dict[str, Any]:
        """What a checkpoint manifest records about the engine: ``backend`` (the name),
        ``checkpoint_format`` (``safetensors``, ``dcp`` or ``deepspeed``), ``checkpoint_model``
        (what the format saved: :data:`memtrain.checkpoint.formats.MODEL_KINDS`), ``zero_stage``
        (None outside DeepSpeed)."""

    def model_state_bytes(self, n_params: int) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this engine holds per rank for a
        model of ``n_params`` parameters, by its own accounting (its module's ``model_state_bytes``
        with this engine's precision, stage and offload): ``parameter_bytes``, ``gradient_bytes``,
        ``optimizer_bytes`` on the device and ``cpu_offloaded_bytes`` in host memory."""

    def replicated_tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The named tensors every rank holds a full identical copy of (parameters under DDP and
        ZeRO-1/2, buffers everywhere), for the save-time divergence check."""

    def close(self) -> None:
        """Release what the engine holds (not the process group: the process state owns it)."""
