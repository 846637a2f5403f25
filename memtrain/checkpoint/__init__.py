"""Crash-safe multi-rank checkpoints and exact resume.

* :mod:`memtrain.checkpoint.layout` — the directory layout and rank-0 file operations (verify,
  commit, retention, choosing what to resume);
* :mod:`memtrain.checkpoint.stateful` — what is saved: a ``dict[str, Stateful]``;
* :mod:`memtrain.checkpoint.manager` — :class:`Checkpointer`, the multi-rank save/load protocol.
"""

from memtrain.checkpoint.layout import LATEST, MANIFEST, complete_checkpoints, step_dir_name, verify
from memtrain.checkpoint.manager import Checkpointer
from memtrain.errors import CheckpointError

__all__ = ["Checkpointer", "CheckpointError", "LATEST", "MANIFEST", "complete_checkpoints", "step_dir_name", "verify"]
