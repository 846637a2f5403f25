"""Tokenizer training and the cached token streams.

A byte-level BPE tokenizer (HuggingFace ``tokenizers``, the GPT-2 scheme) is trained on the
training split only. Each split is encoded once into a flat memory-mapped ``.npy`` array of
token ids (documents joined by the end-of-text token). Both live in
``cache_dir/<hash of files and settings>/``, written to a temporary directory and renamed, so a
killed build never leaves a half cache and a second run starts in seconds.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from memtrain.config import ConfigError
from memtrain.data.corpus import SourceFile, check_decoding, fingerprint, iter_documents
from memtrain.folders import is_disk_full, write_error

EOS_TOKEN = "<|endoftext|>"
_CACHE_FORMAT = 1  # bump when the cache layout or tokenisation changes
PRETRAINED_DIR = "pretrained_tokenizer"
"""Cache subfolder holding a pretrained model's tokenizer files, as found in ``model.pretrained``."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_SPECIAL = "special_tokens.json"  # {"eos_token": ...}; absent = EOS_TOKEN (the trained BPE)
UNDECODABLE = "undecodable_bytes.json"
"""Cache file: data file → bytes that did not decode in ``data.encoding`` (reported again on reuse)."""


@dataclass
class TokenizedCorpus:
    """Token streams of both splits and the tokenizer that made them.

    Attributes:
        directory: the cache directory holding ``tokenizer.json``, ``train.npy``, ``validation.npy``.
        train: 1-D array (uint16 when the vocabulary fits, else uint32) of token ids, memory-mapped.
        validation: the same for the validation split.
        vocab_size: number of token ids the tokenizer can produce.
        eos_id: id of the end-of-text token separating documents.
    """

    directory: str
    train: np.ndarray
    validation: np.ndarray
    vocab_size: int
    eos_id: int
    decode_warnings: tuple[str, ...] = ()
    """One line per data file with bytes that did not decode (:func:`memtrain.data.corpus.check_decoding`)."""

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.directory, "tokenizer.json")

    def hf_tokenizer(self):
        """The tokenizer as a ``transformers`` tokenizer (for ``save_pretrained``): a pretrained
        model's own (its files copied into the cache), or the trained BPE."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        pretrained = os.path.join(self.directory, PRETRAINED_DIR)
        if os.path.isdir(pretrained):
            return AutoTokenizer.from_pretrained(pretrained, local_files_only=True)
        return PreTrainedTokenizerFast(
            tokenizer_file=self.tokenizer_path, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=EOS_TOKEN
        )


def default_cache_dir() -> str:
    """``$MEMTRAIN_CACHE`` or ``~/.cache/memtrain``."""
    return os.environ.get("MEMTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "memtrain")


def cache_setting(path: str) -> str:
    """The setting an error about the cache folder ``path`` names: ``MEMTRAIN_CACHE`` when the
    folder lies in that variable's, else ``data.cache_dir`` (also for the default, which it overrides)."""
    env = os.environ.get("MEMTRAIN_CACHE")
    if env:
        root, real = os.path.realpath(os.path.expanduser(env)), os.path.realpath(os.path.expanduser(path))
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return "MEMTRAIN_CACHE"
    return "data.cache_dir"


@contextlib.contextmanager
def building(directory: str) -> Iterator[str]:
    """Build a cache directory atomically: yields a fresh temporary directory beside
    ``directory``, renamed to it when the block ends without error and removed when it raises.

    Several processes may build the same directory at once: the first rename wins and the
    others' copies are discarded, so a reader never sees a half-written cache.

    Raises:
        ConfigError: the folder cannot be created or written (a full disk named with its free
            bytes), naming ``MEMTRAIN_CACHE`` or ``data.cache_dir``: exit 2, the setting to change.
    """
    parent = os.path.dirname(directory)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError as exc:
        raise ConfigError(cache_setting(parent), f"the data cache '{parent}' cannot be written ({exc.strerror}); "
                          "point MEMTRAIN_CACHE or data.cache_dir at a writable folder") from None
    try:
        yield tmp
        try:
            os.rename(tmp, directory)
        except OSError:  # another process finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:
        import errno

        shutil.rmtree(tmp, ignore_errors=True)
        filename = getattr(exc, "filename", None)
        in_cache = bool(filename) and os.path.realpath(str(filename)).startswith(os.path.realpath(parent))
        if not (is_disk_full(exc) or (isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES)
                                      and in_cache)):  # a data file the user cannot read is not the cache's
            raise

        setting = cache_setting(parent)  # a full disk, a quota: the folder, its free bytes, the setting
        raise ConfigError(setting, f"building the data cache failed: {write_error(exc, parent, setting)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _encode(tokenizer, docs, eos_id: int, dtype) -> np.ndarray:
    chunks, batch = [], []

    def flush():
        for enc in tokenizer.encode_batch(batch):
            chunks.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) >= 256:
            flush()
    flush()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def pretrained_eos_token(folder: str) -> str:
    """The end-of-text token a pretrained tokenizer names (``tokenizer_config.json``, else
    ``special_tokens_map.json``), else ``<|endoftext|>`` when its vocabulary has it.

    Raises:
        ConfigError: none of these (field ``model.pretrained``).
    """
    import json

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                eos = json.load(fh).get("eos_token")
            if eos:
                return eos["content"] if isinstance(eos, dict) else str(eos)
    from tokenizers import Tokenizer

    if Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).token_to_id(EOS_TOKEN) is not None:
        return EOS_TOKEN
    raise ConfigError("model.pretrained", f"the tokenizer in '{folder}' names no eos_token (tokenizer_config.json), "
                      "which separates documents in the packed stream")


def _train_tokenizer(tmp: str, train_files, vocab_size: int, text_field: str, encoding: str):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        iter_documents(train_files, text_field, encoding), vocab_size=vocab_size, min_frequency=2,
        special_tokens=[EOS_TOKEN], show_progress=False,
    )
    tok.save(os.path.join(tmp, "tokenizer.json"))
    return tok, EOS_TOKEN


def _copy_pretrained_tokenizer(tmp: str, folder: str):
    import json

    from tokenizers import Tokenizer

    os.makedirs(os.path.join(tmp, PRETRAINED_DIR))
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(folder, name)):
            shutil.copy(os.path.join(folder, name), os.path.join(tmp, PRETRAINED_DIR, name))
    shutil.copy(os.path.join(folder, "tokenizer.json"), os.path.join(tmp, "tokenizer.json"))
    eos = pretrained_eos_token(folder)
    with open(os.path.join(tmp, _SPECIAL), "w", encoding="utf-8") as fh:
        json.dump({"eos_token": eos}, fh)
    return Tokenizer.from_file(os.path.join(tmp, "tokenizer.json")), eos


def _build(directory: str, train_files, val_files, vocab_size: int, text_field: str,
           pretrained_tokenizer: str | None = None, encoding: str = "utf-8", strict_decoding: bool = False) -> None:
    """Build the cache folder; a user's file over the undecodable-bytes threshold stops it
    (nothing is kept) with :class:`memtrain.config.ConfigError`."""
    import json

    with building(directory) as tmp:
        if pretrained_tokenizer:
            tok, eos = _copy_pretrained_tokenizer(tmp, pretrained_tokenizer)
        else:
            tok, eos = _train_tokenizer(tmp, train_files, vocab_size, text_field, encoding)
        eos_id = tok.token_to_id(eos)
        dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32
        undecodable: dict[str, int] = {}
        for split, files in (("train", train_files), ("validation", val_files)):
            arr = _encode(tok, iter_documents(files, text_field, encoding, undecodable), eos_id, dtype)
            np.save(os.path.join(tmp, f"{split}.npy"), arr)
        check_decoding(undecodable, encoding, strict_decoding)  # over the threshold: raises, the cache is dropped
        with open(os.path.join(tmp, UNDECODABLE), "w", encoding="utf-8") as fh:
            json.dump({"encoding": encoding, "strict": strict_decoding,
                       "files": {p: n for p, n in undecodable.items() if n}}, fh, indent=1)


def load_or_build(
    train_files: list[SourceFile], val_files: list[SourceFile], vocab_size: int,
    text_field: str = "text", cache_dir: str | None = None, pretrained_tokenizer: str | None = None,
    encoding: str = "utf-8", strict_decoding: bool = False,
) -> TokenizedCorpus:
    """Return the tokenized corpus for these files and settings, building it if not cached.

    Safe to call from several processes at once (each build goes to its own temporary
    directory; the first rename wins), but the loop calls it on the main process first so the
    others only read.

    Args:
        train_files: files the tokenizer is trained on and the training stream comes from.
        val_files: files of the validation stream.
        vocab_size: BPE vocabulary size (including the end-of-text token).
        text_field: JSONL field holding the text.
        cache_dir: cache root; None = :func:`default_cache_dir`.
        pretrained_tokenizer: a folder with a pretrained ``tokenizer.json`` (``model.pretrained``):
            used instead of training BPE (``vocab_size`` is then unused).
        encoding: ``data.encoding`` (part of the cache key unless utf-8, so older caches stay valid).
        strict_decoding: the user's files: a file with undecodable bytes is named in
            ``decode_warnings``, and one above the threshold stops the build.

    Returns:
        The corpus with memory-mapped streams.

    Raises:
        ConfigError: a file of ``data.files`` is not ``encoding`` text (field ``data.encoding``).
    """
    import json

    tokenizer_key = vocab_size
    if pretrained_tokenizer:
        with open(os.path.join(pretrained_tokenizer, "tokenizer.json"), "rb") as fh:
            tokenizer_key = "pretrained:" + hashlib.sha256(fh.read()).hexdigest()
    key = fingerprint(train_files + val_files, len(train_files), tokenizer_key, text_field, _CACHE_FORMAT,
                      *([encoding] if codecs.lookup(encoding).name != "utf-8" else []))
    directory = os.path.join(cache_dir or default_cache_dir(), f"corpus-{key}")
    if not os.path.exists(os.path.join(directory, "validation.npy")):
        files = train_files + val_files
        logging.getLogger("memtrain").warning(
            "memtrain: building the data cache: %s and the token streams of %d file(s), %.1f MB, into %s (once for "
            "these files and settings; later runs read it)", "copying the pretrained tokenizer" if pretrained_tokenizer
            else f"training a {vocab_size}-token BPE tokenizer", len(files), sum(f.size for f in files) / 1e6, directory)
        _build(directory, train_files, val_files, vocab_size, text_field, pretrained_tokenizer, encoding,
               strict_decoding)
    warnings: list[str] = []
    if os.path.exists(os.path.join(directory, UNDECODABLE)):
        with open(os.path.join(directory, UNDECODABLE), encoding="utf-8") as fh:
            warnings = check_decoding(json.load(fh)["files"], encoding, strict_decoding)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    eos = EOS_TOKEN
    if os.path.exists(os.path.join(directory, _SPECIAL)):
        with open(os.path.join(directory, _SPECIAL), encoding="utf-8") as fh:
            eos = json.load(fh)["eos_token"]
    return TokenizedCorpus(
        directory=directory,
        train=np.load(os.path.join(directory, "train.npy"), mmap_mode="r"),
        validation=np.load(os.path.join(directory, "validation.npy"), mmap_mode="r"),
        vocab_size=tok.get_vocab_size(),
        eos_id=tok.token_to_id(eos),
        decode_warnings=tuple(warnings),
    )
