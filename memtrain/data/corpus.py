"""Text corpora: the embedded default (the Python standard library) or the user's files.

Documents are split into train and validation *by file*, deterministically and by bytes: in the
order of a hash of their paths (relative to the corpus root), files go to validation while it
holds at most ``validation_fraction`` of the bytes (:func:`split_files`). The same files give the
same split on every machine and every rank.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Optional

import memtrain.data.hf_datasets as hf_datasets
from memtrain.config import ConfigError
from memtrain.data.hf_datasets import digest, iter_rows


@dataclass(frozen=True)
class SourceFile:
    """One input file.

    Attributes:
        path: absolute path.
        name: path relative to the corpus root (used for the split hash and in messages).
        size: bytes on disk.
        part: for a HuggingFace ``datasets`` source (:mod:`memtrain.data.hf_datasets`): which
            of its rows this entry holds, ``train`` or ``validation``; None for a file.
        validation_fraction: a ``datasets`` source's row split (when it has no validation split).
    """

    path: str
    name: str
    size: int
    part: Optional[str] = None
    validation_fraction: float = 0.0


def stdlib_files() -> list[SourceFile]:
    """The ``.py`` files of the running interpreter's standard library, test suites and
    site-packages excluded, sorted by relative path.

    Returns:
        Files (about 800 files, 12 MB for CPython 3.11).
    """
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = set(rel_dir.split(os.sep))
        if parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}:
            dirnames[:] = []
            continue
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                p = os.path.join(dirpath, fn)
                out.append(SourceFile(p, os.path.relpath(p, root), os.path.getsize(p)))
    return sorted(out, key=lambda f: f.name)


def user_files(patterns: list[str], validation_fraction: float = 0.0) -> list[SourceFile]:
    """Files matching ``patterns`` (globs, ``**`` allowed), deduplicated, sorted by path. A
    ``datasets`` source (a ``save_to_disk`` folder, a parquet or arrow file) gives two entries,
    its training and its validation rows (:mod:`memtrain.data.hf_datasets`).

    Raises:
        FileNotFoundError: a pattern matches no file.
    """
    paths = set()
    for pattern in patterns:
        matches = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                   if os.path.isfile(p) or hf_datasets.is_dataset_source(p)]
        if not matches:
            raise FileNotFoundError(f"data.files: '{pattern}' matches no file")
        paths.update(os.path.abspath(p) for p in matches)
    folders = [p for p in paths if os.path.isdir(p)]  # save_to_disk folders: their own files are not documents
    paths = {p for p in paths if not any(p.startswith(d + os.sep) for d in folders)}
    out = []
    for p in sorted(paths):
        if hf_datasets.is_dataset_source(p):
            size = hf_datasets.source_bytes(p)
            out += [SourceFile(p, f"{p}::{part}", size, part, validation_fraction)
                    for part in (hf_datasets.TRAIN, hf_datasets.VALIDATION)]
        else:
            _check_text_file(p)
            out.append(SourceFile(p, p, os.path.getsize(p)))
    return out


def _check_text_file(path: str) -> None:
    """Refuse an empty file or one that looks binary (NUL bytes in its first 8 KiB).

    Raises:
        ConfigError: naming ``data.files`` and the file.
    """
    with open(path, "rb") as fh:
        head = fh.read(8192)
    if not head.strip():
        raise ConfigError("data.files", f"'{path}' is empty")
    if b"\0" in head:
        raise ConfigError("data.files", f"'{path}' looks binary (it holds NUL bytes); give text or JSONL files")


def _unit_hash(name: str) -> float:
    """sha1 of ``name`` mapped to [0, 1): a machine-independent pseudo-random key."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) / 2**160


def select_files(files: Optional[list[str]], max_bytes: int = 0, validation_fraction: float = 0.0) -> list[SourceFile]:
    """The corpus for ``data.files`` (None = standard library), cut to ``max_bytes`` (0 = all).

    The cut keeps whole files, taken in hash order of their names, so a small corpus samples the
    whole tree rather than one package; the result is sorted by name. ``validation_fraction`` is
    the row split of ``datasets`` sources without a validation split.
    """
    chosen = stdlib_files() if files is None else user_files(files, validation_fraction)
    if max_bytes and any(f.part is not None for f in chosen):
        raise ConfigError("data.max_bytes", "cuts whole files and cannot cut a datasets source's rows; set it to 0 "
                          "and select rows in datasets (e.g. dataset.select(range(n)).save_to_disk(...))")
    if max_bytes and sum(f.size for f in chosen) > max_bytes:
        picked, acc = [], 0
        for f in sorted(chosen, key=lambda f: _unit_hash(f.name)):
            if acc >= max_bytes:
                break
            picked.append(f)
            acc += f.size
        chosen = sorted(picked, key=lambda f: f.name)
    return chosen


SPLIT_RULE = "bytes"
"""How :func:`split_files` holds files out (recorded in every manifest as ``data_split``): by bytes,
in hash order. Checkpoints without it were saved when a file was held out when its hash alone
fell below the fraction, so their text corpora may differ from today's on the same files."""


def split_files(files: list[SourceFile], validation_fraction: float) -> tuple[list[SourceFile], list[SourceFile]]:
    """Deterministic train/validation split by file, sized by bytes.

    Files are taken in the order of a hash of their names (``sha1("split:" + name)``, the same on
    every machine and rank), and a file goes to validation while the validation side stays within
    ``validation_fraction`` of all the files' bytes; so one large file never becomes the whole
    validation set, whatever its name hashes to. When no file is small enough (a corpus of a few
    large files), the smallest goes to validation (at most half the bytes: the training side
    always keeps most of the data), with a warning when it is more than twice the fraction asked.
    A ``datasets`` source's rows are on their side already.

    Returns:
        (train_files, validation_files), each sorted by name.
    """
    def h(f: SourceFile) -> float:
        # a different salt from select_files' order, so the cut does not bias the split
        return _unit_hash("split:" + f.name)

    parts = [f for f in files if f.part is not None]  # a datasets source's rows: their side is set
    files = sorted((f for f in files if f.part is None), key=h)
    total = sum(f.size for f in files)
    val, held = [], 0
    for f in files:
        if 0 < f.size and held + f.size <= validation_fraction * total:  # an empty file holds no text to hold out
            val.append(f)
            held += f.size
    if not val and validation_fraction > 0 and len(files) >= 2 and not parts:
        smallest = min(files, key=lambda f: (f.size, h(f)))
        val = [smallest]
        if smallest.size > 2 * validation_fraction * total:
            logging.getLogger("memtrain").warning(
                "memtrain: data.validation_fraction %s: whole files are held out for validation and the smallest, "
                "%s, is %.1f%% of the %d files' bytes: validation holds that much (give more, smaller files, or "
                "JSONL with one document per line across several files)", validation_fraction, smallest.name,
                100 * smallest.size / max(1, total), len(files))
    held_out = {f.name for f in val}
    train = [f for f in files if f.name not in held_out] + [f for f in parts if f.part == "train"]
    val += [f for f in parts if f.part == "validation"]
    return sorted(train, key=lambda f: f.name), sorted(val, key=lambda f: f.name)


_undecodable = [0]


def _count_and_replace(exc: UnicodeDecodeError) -> tuple[str, int]:
    """A codec error handler: the bytes that do not decode become U+FFFD, and are counted."""
    _undecodable[0] += exc.end - exc.start
    return "\ufffd", exc.end


codecs.register_error("memtrain.count", _count_and_replace)

MAX_UNDECODABLE_FRACTION = 0.001
"""A file of ``data.files`` with more undecodable bytes than this fraction stops the run (exit 2)."""


def check_decoding(undecodable: dict[str, int], encoding: str, strict: bool) -> list[str]:
    """The warnings for files with bytes that did not decode (one per file, naming it).

    Args:
        undecodable: file path → bytes read as U+FFFD (from :func:`iter_documents`' ``undecodable``).
        encoding: ``data.encoding``.
        strict: the user's files (above :data:`MAX_UNDECODABLE_FRACTION` of a file is an error);
            False for the embedded default corpus.

    Raises:
        ConfigError: field ``data.encoding``, naming the first file over the threshold.
    """
    warnings = []
    for path, bad in sorted(undecodable.items()):
        if not bad:
            continue
        size = max(1, os.path.getsize(path)) if os.path.exists(path) else 1
        if strict and bad / size > MAX_UNDECODABLE_FRACTION:
            raise ConfigError("data.encoding", f"'{path}' is not {encoding} text: {bad:,} of its {size:,} bytes "
                              f"({bad / size:.2%}) cannot be decoded. Set data.encoding to the file's encoding (e.g. "
                              "latin-1, cp1252, utf-16), or convert the file")
        warnings.append(f"data.files: '{path}': {bad:,} of {size:,} bytes are not valid {encoding} and were read "
                        "as U+FFFD (set data.encoding if the file has another encoding)")
    return warnings if strict else []


def iter_documents(files: list[SourceFile], text_field: str = "text", encoding: str = "utf-8",
                   undecodable: Optional[dict[str, int]] = None) -> Iterator[str]:
    """Yield documents: a whole text file is one document; each JSONL line is one; each row of a
    ``datasets`` source's part is one.

    Args:
        files: the files, in order.
        text_field: the JSONL field holding a document.
        encoding: text and JSONL files' encoding (``data.encoding``); bytes that do not decode are
            read as U+FFFD.
        undecodable: filled with file path → bytes that did not decode, for each file read.

    Raises:
        ConfigError: a JSONL line that is not a JSON object (field ``data.files``), has no
            ``text_field`` or a value there that is not a string (field ``data.text_field``); the
            message names file and line.
    """
    for f in files:
        if f.part is not None:
            yield from iter_rows(f.path, f.name.rsplit("::", 1)[0], f.part, text_field, f.validation_fraction)
        elif f.path.endswith((".jsonl", ".json")):
            _undecodable[0] = 0
            with open(f.path, encoding=encoding, errors="memtrain.count") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError("data.files", f"{f.path}:{lineno}: not valid JSON ({exc.msg} at column "
                                          f"{exc.colno}); a JSONL file holds one JSON object per line") from None
                    if not isinstance(obj, dict) or text_field not in obj:
                        raise ConfigError("data.text_field", f"{f.path}:{lineno}: no field '{text_field}' in this line")
                    if not isinstance(obj[text_field], str):
                        raise ConfigError("data.text_field", f"{f.path}:{lineno}: field '{text_field}' is "
                                          f"{json.dumps(obj[text_field])[:40]}, not a string; give the document's "
                                          "text, or drop the line")
                    yield obj[text_field]
            if undecodable is not None:
                undecodable[f.path] = _undecodable[0]
        else:
            _undecodable[0] = 0
            with open(f.path, encoding=encoding, errors="memtrain.count") as fh:
                text = fh.read()
            if undecodable is not None:
                undecodable[f.path] = _undecodable[0]
            yield text


def fingerprint(files: list[SourceFile], *extra) -> str:
    """A hash of the files' names and contents plus ``extra`` (settings), for cache keys."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        if f.part is not None:  # a datasets source: its files, and how its rows are split

            h.update(digest(f.path) + f"{f.validation_fraction!r}".encode())
            continue
        with open(f.path, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]
