"""What a checkpoint holds: a ``dict[str, Stateful]`` (as in torchtitan's ``CheckpointManager``).

Two kinds of entries:

* :class:`Stateful` — ``state_dict()`` / ``load_state_dict()`` of JSON-serialisable data (train
  state, LR scheduler, plan controller, evaluator, non-finite guard). Rank 0 writes them all into
  ``trainer_state.json`` under their names; every rank reads them back.
* :class:`FileStateful` — state that writes its own files: the engine's model and optimizer
  (:class:`EngineState`), each rank's random states (:class:`RNGState`), the tokenizer.

Adding state to checkpoints means adding one entry to the dict; the checkpointer never knows what
is inside.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future
from typing import Any, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from memtrain.checkpoint.formats import read_full_state
from memtrain.checkpoint.layout import rank_file
from memtrain.config import ConfigError
from memtrain.errors import CheckpointError
from memtrain.rng import capture, from_saveable, restore, to_saveable


@runtime_checkable
class Stateful(Protocol):
    """JSON-serialisable state (``trainer_state.json``)."""

    def state_dict(self) -> dict[str, Any]:
        """The state, as JSON-serialisable data."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


@runtime_checkable
class FileStateful(Protocol):
    """State that writes its own files into the checkpoint directory (every rank calls each method)."""

    def prepare_save(self, step: int) -> dict[str, Any]:
        """Before anything is written (a collective point): check that the state can be saved and
        return fields for the manifest.

        Raises:
            CheckpointError: the state must not be saved (the message says why).
        """

    def save_files(self, directory: str, async_save: bool) -> Optional[Future]:
        """Write into ``directory``; may return a future when writing in the background."""

    def expected_files(self) -> list[str]:
        """Glob patterns (relative to the checkpoint directory) a complete save matches."""

    def load_files(self, directory: str, manifest: dict[str, Any]) -> None:
        """Restore from a verified checkpoint.

        Raises:
            CheckpointError: the checkpoint does not fit this run (the message names the field).
        """


def model_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Parameter name → global shape (ZeRO-3's partitioned parameters report ``ds_shape``)."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def _tensor_digest(t: torch.Tensor) -> int:
    """A 63-bit hash of a tensor's bytes."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def divergent_tensors(backend, model: nn.Module) -> list[str]:
    """Names of replicated tensors (``Backend.replicated_tensors``) whose bytes differ between
    ranks: a hash per tensor, all-reduced with MAX and with MIN (a collective; every rank calls).

    Returns:
        ``parameter NAME`` / ``buffer NAME`` entries in module order (empty on one rank).
    """
    process = backend.process
    if process.world_size == 1:
        return []
    named = backend.replicated_tensors(model)
    if not named:
        return []
    params = {id(p) for _, p in backend.unwrap(model).named_parameters()}
    hi = torch.tensor([_tensor_digest(t) for _, t in named], dtype=torch.int64, device=process.device)
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return [("parameter " if id(t) in params else "buffer ") + n
            for (n, t), a, b in zip(named, hi.tolist(), lo.tolist()) if a != b]


class EngineState:
    """The model and optimizer, saved and loaded by the engine through the format it was handed
    (its ``checkpoint_io``: :mod:`memtrain.checkpoint.formats`).

    Args:
        backend: the engine; model, optimizer: as the engine prepared them.
        max_shard_size: largest safetensors shard (DDP).
    """

    def __init__(self, backend, model: nn.Module, optimizer, max_shard_size: str = "5GB"):
        self.backend, self.model, self.optimizer = backend, model, optimizer
        self.max_shard_size = max_shard_size

    def prepare_save(self, step: int) -> dict[str, Any]:
        """Refuse to save when a replicated parameter differs between ranks (a buffer is only
        warned about: rank 0's copy is saved); the manifest gets the engine and model shapes."""
        import logging

        divergent = divergent_tensors(self.backend, self.model)
        if divergent:
            more = (f" (also {', '.join(divergent[1:4])}{' …' if len(divergent) > 4 else ''})"
                    if len(divergent) > 1 else "")
            msg = f"at step {step}: {len(divergent)} replicated tensor(s) differ between ranks, first: {divergent[0]}{more}"
            if divergent[0].startswith("parameter"):
                raise CheckpointError(msg + "; the ranks no longer train the same model, refusing to save")
            logging.getLogger("memtrain").warning("memtrain: %s; rank 0's copy is saved", msg)
        return {**self.backend.manifest_fields(), "model_shapes": model_shapes(self.backend.unwrap(self.model)),
                "replicated_mismatch": divergent}

    def save_files(self, directory: str, async_save: bool) -> Optional[Future]:
        return self.backend.save_state(self.model, self.optimizer, directory, self.max_shard_size, async_save)

    def expected_files(self) -> list[str]:
        return self.backend.expected_files()

    def load_files(self, directory: str, manifest: dict[str, Any]) -> None:
        """Load after checking every parameter's shape (and the ZeRO stage) against the manifest.
        A checkpoint of another engine, or in another format than this engine writes, is converted
        (:meth:`_load_from_another_engine`).

        Raises:
            ConfigError: another ZeRO stage (field ``backend.zero_stage``).
            CheckpointError: another model shape, a world size the engine cannot reshard to, or
                another engine whose state cannot be converted to this one's yet.
        """
        if manifest["backend"] != self.backend.name or manifest.get("checkpoint_format") != self.backend.checkpoint_io.NAME:
            self._check_shapes(directory, manifest)
            self._load_from_another_engine(directory, manifest)
            return
        stage, saved_stage = self.backend.manifest_fields().get("zero_stage"), manifest.get("zero_stage")
        if stage != saved_stage:
            raise ConfigError("backend.zero_stage", f"is {stage} but {directory} was written under ZeRO stage "
                              f"{saved_stage}: DeepSpeed's partitions differ. Resume with backend.zero_stage "
                              f"{saved_stage}, or start a new run (--resume never, or another --output_dir)")
        self._check_shapes(directory, manifest)
        self.backend.load_state(self.model, self.optimizer, directory, manifest["world_size"])

    def _check_shapes(self, directory: str, manifest: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model, naming the ``model.config`` keys the checkpoint's
        run set to other values than this model has (:func:`changed_model_settings`) and the first
        parameter whose shape differs."""
        model = self.backend.unwrap(self.model)
        shapes, saved = model_shapes(model), manifest["model_shapes"]
        if saved != shapes:
            diff = next((k for k in sorted(set(shapes) | set(saved)) if shapes.get(k) != saved.get(k)), None)
            keys = changed_model_settings(manifest, model)
            raise CheckpointError(
                f"{directory}: the model differs from the checkpoint's"
                + (f" ({'; '.join(keys)})" if keys else "")
                + f", first at parameter {diff}: checkpoint {_shape_words(saved.get(diff))}, this run "
                  f"{_shape_words(shapes.get(diff))}; resume with the checkpoint's model, or start a new run "
                  "(--resume never, or another --output_dir)")

    def _load_from_another_engine(self, directory: str, manifest: dict[str, Any]) -> None:
        """The engine switch: the checkpoint's format gives the whole weights and the optimizer
        state keyed by parameter name, this engine takes its share
        (:meth:`memtrain.backends.base.Backend.load_full_state`)."""
        weights, optimizer_state = read_full_state(directory, manifest, self.backend.unwrap(self.model))
        self.backend.load_full_state(self.model, self.optimizer, weights, optimizer_state, directory)


def changed_model_settings(manifest: dict[str, Any], model: nn.Module) -> list[str]:
    """``model.config.KEY: checkpoint A, this run B`` for each key the checkpoint's run set in
    ``model.config`` (its manifest's ``config``) that ``model``'s transformers config holds at
    another value; [] for a model without one (a ``model.factory`` module) or a manifest without
    the config."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    saved = (config.get("model") or {}).get("config") or {}
    current = getattr(model, "config", None)
    if not hasattr(current, "to_dict") or not isinstance(saved, dict):
        return []
    now = current.to_dict()  # values as a config.json holds them (a dtype as its name), as the manifest does
    return [f"model.config.{key}: checkpoint {value!r}, this run {now[key]!r}"
            for key, value in saved.items() if key != "model_type" and key in now and now[key] != value]


def _shape_words(shape) -> str:
    """A parameter's shape as the refusal says it (``none`` where the model has no such parameter)."""
    return "none (no such parameter)" if shape is None else str(shape)


def rng_state() -> dict[str, Any]:
    """This process's random states (every stream of :mod:`memtrain.rng`), loadable with
    ``torch.load(weights_only=True)``."""
    return to_saveable(capture())


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    restore(from_saveable(state))


class RNGState:
    """Each rank's random states, one file per rank (``rank_XXXXX.pt``). On another world size,
    a rank without a file of its own takes rank 0's.

    Args:
        rank, world_size: this process's.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def prepare_save(self, step: int) -> dict[str, Any]:
        return {}

    def save_files(self, directory: str, async_save: bool) -> None:
        torch.save(rng_state(), os.path.join(directory, rank_file(self.rank)))

    def expected_files(self) -> list[str]:
        return [rank_file(r) for r in range(self.world_size)]

    def load_files(self, directory: str, manifest: dict[str, Any]) -> None:
        import logging

        saved = manifest["world_size"]
        own = self.rank if self.rank < saved else 0
        if saved != self.world_size and self.rank == 0:
            logging.getLogger("memtrain").warning(
                "memtrain: resuming a %d-rank checkpoint on %d ranks: data order and plan carry over; %s", saved,
                self.world_size, f"ranks {saved}..{self.world_size - 1} have no random state of their own and take "
                "rank 0's (their dropout masks differ from a run that never stopped)" if self.world_size > saved else
                f"the random states of ranks {self.world_size}..{saved - 1} are not used")
        set_rng_state(torch.load(os.path.join(directory, rank_file(own)), weights_only=True))


class TokenizerFiles:
    """The run's ``transformers`` tokenizer, saved by rank 0 into ``tokenizer/`` for ``memtrain
    export`` (not loaded back: the data cache holds it).

    Args:
        tokenizer: the tokenizer, or None (nothing is written).
        is_main: rank 0.
    """

    def __init__(self, tokenizer, is_main: bool):
        self.tokenizer, self.is_main = tokenizer, is_main

    def prepare_save(self, step: int) -> dict[str, Any]:
        return {}

    def save_files(self, directory: str, async_save: bool) -> None:
        if self.is_main and self.tokenizer is not None:
            self.tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))

    def expected_files(self) -> list[str]:
        return []

    def load_files(self, directory: str, manifest: dict[str, Any]) -> None:
        """Nothing to restore."""


class SchedulerState:
    """The LR scheduler as a :class:`Stateful`. Loading also writes the scheduler's learning rates
    into the optimizer's groups (the engine's optimizer state may carry another group lr). A rate
    kept as a tensor (torchao's optimizers) is saved as a float and filled in place on loading.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler; optimizer: the one it drives.
    """

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def state_dict(self) -> dict[str, Any]:
        plain = lambda v: float(v) if isinstance(v, torch.Tensor) else v  # noqa: E731 - JSON
        return {k: [plain(x) for x in v] if isinstance(v, list) else plain(v)
                for k, v in self.scheduler.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = float(lr)
