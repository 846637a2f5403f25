"""Errors that several modules raise, kept at the bottom of the import graph (no memtrain imports),
so that an engine can raise a checkpoint error without importing the checkpointer.

Exit codes of the ``memtrain`` command (:func:`memtrain.train.cli`): :class:`ConfigError` (also importable
from :mod:`memtrain.config`) 2, :class:`OOMStop` 3, :class:`CheckpointError` (and :class:`OutputError`) 4,
:class:`NonFiniteStop` 5, :class:`CollectiveError` 6.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the valid choices."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"config error in '{field_name}': {message}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or is incomplete, corrupt or incompatible with this run
    (the message names the file or the field)."""


class OutputError(CheckpointError):
    """A file a run writes beside its checkpoints cannot be written — the exported model,
    ``summary.json``, ``metrics.jsonl`` — (a full disk, a failed write); the message names the
    path and, for a full disk, its free bytes. Nothing half-written is left behind."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank stopped, died or hung (exit 6 on the command
    line). Raised from :meth:`memtrain.api.Trainer.fit` in place of the process group's own error,
    whose message (a C++ trace per rank) buries the cause; the message names the rank, the
    operation it was in, ``backend.timeout_s`` and the cause's first line."""


class OOMStop(RuntimeError):
    """Out of memory at the plan floor (micro-batch 1, activation checkpointing on or off by
    request); the message holds the memory report and the settings to change (built by
    :mod:`memtrain.oom`; raised by the plan controller and the loop).

    Attributes:
        memory: ``host`` or ``device``: which memory the last failure ran out of, where known
            (:func:`memtrain.oom.memory_that_ran_out`); None = not known.
    """

    memory = None


class NonFiniteStop(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm (raised by
    :class:`memtrain.precision.NonFiniteGuard`)."""
