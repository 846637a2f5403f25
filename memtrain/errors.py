"""Errors that several modules raise, kept at the bottom of the import graph (no memtrain imports),
so that an engine can raise a checkpoint error without importing the checkpointer.

Exit codes of the ``memtrain`` command (:func:`memtrain.train.cli`): :class:`ConfigError` (also importable
from :mod:`memtrain.config`) 2, :class:`memtrain.oom.OOMStop` 3, :class:`CheckpointError` (and :class:`OutputError`) 4,
:class:`memtrain.precision.NonFiniteStop` 5.
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
