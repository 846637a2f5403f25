"""A user's own data from Python (:class:`memtrain.api.Trainer`): a map-style dataset of examples
(anything with ``__len__`` and ``__getitem__(int)``, a ``datasets.Dataset`` included) and an
optional collate function, behind the same interface as the built-in corpora: the global-batch
sampler draws sample indices, ``batch(indices)`` collates them.

Its identity (what a resumed run is compared by, as the built-in corpora's file hashes are) is a
hash of the number of examples and of up to :data:`IDENTITY_SAMPLES` examples spread evenly over
the dataset: a different dataset, or one reordered, resized or with other content at those
examples, is refused on resume.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import torch

from memtrain.data import IGNORE_INDEX
from memtrain.errors import ConfigError
from memtrain.rng import capture, restore

IDENTITY_SAMPLES = 1024
"""Examples of each split the dataset identity hashes (evenly spaced, first and last included)."""


class ExampleDataset:
    """Examples collated into batches on demand.

    Args:
        examples: map-style dataset; a ``datasets.Dataset`` without a collate function is read
            in torch format (each column a tensor).
        collate_fn: ``list of examples -> dict[str, Tensor]`` (each tensor [B, …]); None =
            ``torch.utils.data.default_collate``.
        name: the argument the examples came from, as errors name it (``train_dataset``, …).

    Raises:
        memtrain.errors.ConfigError: ``examples`` is a dict of columns, not a dataset of examples
            (field ``name``).
    """

    def __init__(self, examples, collate_fn: Optional[Callable[[list], dict]] = None, name: str = "train_dataset"):
        if collate_fn is None and hasattr(examples, "with_format") and getattr(examples, "format", {}).get("type") is None:
            examples = examples.with_format("torch")
        if isinstance(examples, Mapping):
            raise ConfigError(name, f"is a dict of columns ({', '.join(map(str, list(examples)[:4]))}), not a dataset "
                              "of examples: give a list of examples, each a dict of tensors, e.g. [dict(zip(columns, "
                              "row)) for row in zip(*columns.values())], or a datasets.Dataset")
        self.examples, self.name = examples, name
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.shift_labels = False

    def unshifted_labels(self, n: int = 64) -> bool:
        """Whether the first ``n`` examples' ``labels`` equal their ``input_ids`` wherever a label
        is not -100 — transformers' convention, where the model shifts the labels itself — and
        could not be labels shifted already: some kept label differs from the next input id. Where
        every kept label also equals the next id (e.g. one token repeated) both readings agree
        with the examples, and labels are never shifted on such evidence."""
        if len(self) == 0:
            return False
        batch = self.batch(range(min(n, len(self))))
        ids, labels = batch.get("input_ids"), batch.get("labels")
        if ids is None or labels is None or ids.shape != labels.shape or ids.dim() < 2:
            return False
        kept = labels != IGNORE_INDEX
        if not bool(kept.any()) or not torch.equal(labels[kept], ids[kept]):
            return False
        inner = kept[:, :-1]  # a label whose next input id exists
        return not torch.equal(labels[:, :-1][inner], ids[:, 1:][inner])

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """The collated examples ``indices`` (int sequence [B]).

        Raises:
            memtrain.errors.ConfigError: the collate function gives no dict of tensors (field
                ``collate_fn``; the dataset's name where no collate function was given: its
                examples are not dicts of tensors).
        """
        examples = [self.examples[int(i)] for i in indices]
        out = self.collate_fn(examples)
        if not isinstance(out, dict) or not out or not all(isinstance(v, torch.Tensor) for v in out.values()):
            got = {k: type(v).__name__ for k, v in out.items()} if isinstance(out, dict) else type(out).__name__
            if self.collate_fn is torch.utils.data.default_collate:
                raise ConfigError(self.name, f"its examples are {type(examples[0]).__name__}, collated into {got}; "
                                  "a batch must be a dict of tensors [batch, ...]: give each example as a dict "
                                  "{name: tensor} (the objective reads the names), or a collate_fn that makes one")
            raise ConfigError("collate_fn", f"a batch must be a dict of tensors [batch, ...]; got {got}")
        if self.shift_labels:  # labels[t] becomes the token after input_ids[t], as memtrain's causal LM reads it
            labels = out["labels"]
            out = {**out, "labels": torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], 1)}
        return out


class ExampleCorpus:
    """A user's training (and validation) examples, in place of a built-in corpus.

    Args:
        train, validation: :class:`ExampleDataset`; an empty validation set turns evaluation off.
        tokenizer: a ``transformers`` tokenizer saved with checkpoints and exports, or None.
        validation_sets: several validation sets by name (``validation`` is the first); None = one.
    """

    kind = "examples"

    def __init__(self, train: ExampleDataset, validation: ExampleDataset, tokenizer: Any = None,
                 validation_sets: Optional[dict[str, ExampleDataset]] = None):
        if len(train) == 0:
            raise ConfigError("train_dataset", "has no examples")
        self.train, self.validation, self.tokenizer = train, validation, tokenizer
        self.validation_sets = validation_sets
        self.vocab_size = len(tokenizer) if tokenizer is not None else 0
        extra = [s for s in (validation_sets or {}).values() if s is not validation]
        self.identity = "examples-" + dataset_identity(train, validation, *extra)

    def hf_tokenizer(self):
        """The tokenizer given with the data (None: nothing saved)."""
        return self.tokenizer

    def describe(self) -> str:
        """One line for the start-of-run message."""
        return f"{len(self.train)} training examples"


def dataset_identity(*splits: ExampleDataset) -> str:
    """16 hex digits of sha256 over each split's length and its sampled examples' collated
    tensors (names, dtypes, shapes, bytes). Read under fixed seeds of Python's, NumPy's and
    torch's generators, put back afterwards: an example or collate function that draws (an
    augmentation) hashes the same in every launch, and the run's random streams are untouched."""
    import random

    streams = capture()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    try:
        return _hash_splits(splits)
    finally:
        restore(streams)


def _hash_splits(splits) -> str:
    digest = hashlib.sha256()
    for split in splits:
        n = len(split)
        digest.update(f"split of {n}".encode())
        for i in sorted(set(np.linspace(0, n - 1, min(n, IDENTITY_SAMPLES)).round().astype(int).tolist())) if n else []:
            for name, value in sorted(split.batch([i]).items()):
                value = value.detach().cpu().contiguous()
                digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
                digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()[:16]


def named_sets(eval_dataset) -> dict:
    """``eval_dataset`` as ``{name: dataset}``: a mapping as given (names of letters, digits and
    ``_``), one dataset as ``{"": it}``, None as none.

    Raises:
        ConfigError: ``eval_dataset``: an empty mapping, or a name that cannot be part of a record's key.
    """
    if eval_dataset is None:
        return {}
    if not isinstance(eval_dataset, Mapping):
        return {"": eval_dataset}
    if not eval_dataset:
        raise ConfigError("eval_dataset", "is an empty dict: give {name: dataset, ...} or one dataset")
    for name in eval_dataset:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ConfigError("eval_dataset", f"name {name!r}: a set's name is part of its records' keys "
                              "(val_<name>_loss): letters, digits and _ only")
    return dict(eval_dataset)
