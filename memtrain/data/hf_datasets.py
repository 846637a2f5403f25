"""Text from HuggingFace ``datasets`` on disk: ``save_to_disk`` folders and parquet/arrow files.

A ``data.files`` entry that is a ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` folder,
or a local ``.parquet`` / ``.arrow`` file, is read with the ``datasets`` library (memory-mapped,
nothing downloaded); each row's ``data.text_field`` is one document. Such a source becomes two
corpus entries, its training rows and its validation rows, so the rest of the pipeline (the
tokenizer, the packed-token cache, the split) works on it as on files:

* a ``DatasetDict`` with a ``validation`` (else ``test``) split: that split is validation, ``train``
  is training;
* otherwise every row is assigned by a hash of (source path, row index): validation when it falls
  below ``data.validation_fraction`` — deterministic on every machine and rank, like the file split.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Iterator

from memtrain.config import ConfigError
from memtrain.extras import require

DATASET_SUFFIXES = (".parquet", ".arrow")
"""Single files read as datasets (a ``.json``/``.jsonl`` file is read directly, one object per line)."""

TRAIN, VALIDATION = "train", "validation"


def is_dataset_source(path: str) -> bool:
    """Whether ``path`` is a ``save_to_disk`` folder or a parquet/arrow file."""
    if os.path.isdir(path):
        return any(os.path.exists(os.path.join(path, n)) for n in ("dataset_dict.json", "state.json"))
    return path.endswith(DATASET_SUFFIXES)


def _row_is_validation(name: str, index: int, validation_fraction: float) -> bool:
    key = hashlib.sha1(f"split:{name}:{index}".encode()).hexdigest()
    return int(key, 16) / 2**160 < validation_fraction


def _load(path: str):
    """The dataset (or dataset dict) at ``path``.

    Raises:
        ConfigError: ``datasets`` cannot read it (field ``data.files``).
    """
    try:
        import datasets

        datasets.disable_progress_bars()
        if os.path.isdir(path):
            return datasets.load_from_disk(path)
        kind = "parquet" if path.endswith(".parquet") else "arrow"
        return datasets.load_dataset(kind, data_files=path, split="train")
    except ImportError:
        require("datasets", "data.files", f"'{path}', a datasets source,")
        raise
    except Exception as exc:  # noqa: BLE001 — datasets raises many kinds; name the file
        raise ConfigError("data.files", f"'{path}' cannot be read as a dataset: {exc}") from None


def _split_names(data) -> tuple[str, str | None]:
    """(training split, validation split or None) of a dataset dict; ('', None) for a dataset."""
    if not hasattr(data, "keys"):
        return "", None
    names = list(data.keys())
    val = next((n for n in (VALIDATION, "test") if n in names), None)
    train = TRAIN if TRAIN in names else next((n for n in names if n != val), None)
    if train is None:
        raise ConfigError("data.files", f"the dataset dict has only the split(s) {', '.join(names)}; it needs a "
                          "training split ('train', or any split besides validation/test)")
    return train, val


def iter_rows(path: str, name: str, part: str, text_field: str, validation_fraction: float) -> Iterator[str]:
    """The documents of one part (``train`` or ``validation``) of the source at ``path``.

    Args:
        path: the folder or file; name: its corpus name (for the row hash and messages).
        part: ``train`` or ``validation``.
        text_field: the column holding the text (``data.text_field``).
        validation_fraction: the row split of a source without a validation split.

    Raises:
        ConfigError: no such column (field ``data.text_field``, names the columns), or a row whose
            value there is not text (names the row).
    """
    data = _load(path)
    train_split, val_split = _split_names(data)
    if train_split:  # a dataset dict: its own splits (rows hashed only when it has no validation split)
        data = data[val_split if part == VALIDATION and val_split else train_split]
    if text_field not in data.column_names:
        raise ConfigError("data.text_field", f"'{path}' has no column '{text_field}'; its columns: "
                          f"{', '.join(data.column_names)}")
    by_hash = not (train_split and val_split)
    index = 0
    for batch in data.select_columns([text_field]).iter(batch_size=1024):  # memory-mapped, a batch at a time
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise ConfigError("data.text_field", f"'{path}' row {index}: column '{text_field}' holds "
                                  f"{type(text).__name__} {str(text)[:40]!r}, not text; choose a text column")
            if text is not None and (not by_hash or _row_is_validation(name, index, validation_fraction)
                                     == (part == VALIDATION)):  # a null row is no document
                yield text
            index += 1


@functools.lru_cache(maxsize=None)
def digest(path: str) -> bytes:
    """sha256 over the names and contents of the source's files (a folder's, sorted), for cache keys."""
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    for f in files:
        h.update(os.path.relpath(f, path).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.digest()


def source_bytes(path: str) -> int:
    """Bytes on disk of a dataset source (all files of a folder)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)
