"""Whether a checkpoint can be resumed by this run without skipping or repeating data.

The data position in a checkpoint is a cursor ``(epoch, step)`` into a permutation of the
training samples (:mod:`memtrain.data.sampler`). It means the same samples only if the samples,
their order and the step size are the same: the data (files and their contents, tokenizer,
``seq_len``), ``training.seed`` and ``training.global_batch_size``. A run that changes any of
them is refused by name (exit 2) instead of continuing from a position that now points elsewhere.
The world size, the micro-batch plan, the engine and ``max_steps`` may change.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from memtrain.config import ConfigError

DATA_POSITION_KEYS = ("training.global_batch_size", "training.seed", "data.seq_len", "data.kind")
"""Settings the meaning of a saved data position depends on."""
DATA_KEYS = ("data.files", "data.max_bytes", "data.vocab_size", "data.text_field", "data.validation_fraction",
             "data.speech")
"""Settings that choose the data: compared when the corpus identity of either side is not known
(the identity, a hash of the files' names and contents and these settings, is the finer test)."""


def data_identity(corpus) -> Optional[str]:
    """The corpus cache's name (a hash of the files' contents and the tokenizer settings), or None."""
    directory = getattr(getattr(corpus, "tokenized", None), "directory", None) or getattr(corpus, "directory", None)
    return os.path.basename(os.path.normpath(directory)) if directory else None


def _get(config: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        config = config.get(part, {}) if isinstance(config, dict) else {}
    return config if config != {} else None


def check_resumable(path: str, manifest: dict, config: dict, identity: Optional[str]) -> None:
    """Refuse to resume ``path`` when a setting its data position depends on has changed.

    Args:
        path: the checkpoint (for the message).
        manifest: its manifest (``config`` and ``data_identity`` as saved).
        config: this run's config as a dict (:func:`memtrain.config.to_dict`).
        identity: :func:`data_identity` of this run's corpus.

    Raises:
        ConfigError: naming the changed setting, the saved and the current value.
    """
    saved = manifest.get("config") or {}
    saved_identity = manifest.get("data_identity")
    known = saved_identity is not None and identity is not None
    for key in DATA_POSITION_KEYS + (() if known else DATA_KEYS):
        before, now = _get(saved, key), _get(config, key)
        if before != now:
            raise ConfigError(key, f"is {now!r} but checkpoint {path} was saved with {before!r}; resuming would "
                              "skip or repeat samples. Use the saved value, or start a new run (resume never, or "
                              "another output_dir)")
    if known and saved_identity != identity:
        raise ConfigError("data.files", f"the data differs from what checkpoint {path} was trained on (corpus "
                          f"{identity}, saved {saved_identity}: a file's contents or the tokenizer changed); resuming would "
                          "continue at a position in other data. Restore the data, or start a new run")
