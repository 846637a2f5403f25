"""Data: corpora, tokenisation, packing and the global-batch sampler."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from memtrain.config import ConfigError
from memtrain.data.corpus import select_files, split_files
from memtrain.data.sampler import Cursor, GlobalBatchSampler, batch_fingerprint
from memtrain.data.speech import build_speech_corpus
from memtrain.data.tokens import TokenizedCorpus, load_or_build

IGNORE_INDEX = -100
"""Label value excluded from the loss and from the token count (as in transformers)."""

__all__ = ["Cursor", "GlobalBatchSampler", "batch_fingerprint", "PackedDataset", "IGNORE_INDEX", "build_corpus"]


class PackedDataset:
    """A token stream cut into fixed-length causal-LM samples.

    Sample ``i`` is ``stream[i*seq_len : i*seq_len + seq_len + 1]``: its first ``seq_len`` tokens
    are the inputs and the last ``seq_len`` the labels (next-token targets). Documents are packed
    back to back, separated by the end-of-text token.

    Args:
        stream: 1-D integer array of token ids (memory-mapped is fine).
        seq_len: tokens per sample.

    Raises:
        ValueError: the stream is shorter than one sample.
    """

    def __init__(self, stream: np.ndarray, seq_len: int):
        self.stream = stream
        self.seq_len = seq_len
        self.num_samples = (len(stream) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError("data.seq_len", f"a split of {len(stream)} tokens is shorter than one sample of "
                              f"data.seq_len {seq_len}; give more data (data.files, data.max_bytes) or a shorter seq_len")

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Collate samples.

        Args:
            indices: sample indices, int [B].

        Returns:
            ``input_ids`` and ``labels``, both int64 [B, seq_len].
        """
        rows = np.stack([np.asarray(self.stream[i * self.seq_len:i * self.seq_len + self.seq_len + 1], dtype=np.int64)
                         for i in indices]) if len(indices) else np.zeros((0, self.seq_len + 1), np.int64)
        t = torch.from_numpy(rows)
        return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


@dataclass
class Corpus:
    """Training and validation data of a run.

    Attributes:
        train: packed training samples.
        validation: packed validation samples.
        tokenized: the token streams and tokenizer behind them.
    """

    train: PackedDataset
    validation: PackedDataset
    tokenized: TokenizedCorpus
    kind: str = "text"
    seq_len: int = 0

    @property
    def eos_id(self) -> int:
        """The end-of-text token id (also the model's bos/eos token id)."""
        return self.tokenized.eos_id

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce."""
        return self.tokenized.vocab_size

    def hf_tokenizer(self):
        """The transformers tokenizer saved with checkpoints and exports."""
        return self.tokenized.hf_tokenizer()

    def describe(self) -> str:
        """One line for the start-of-run message."""
        return f"{len(self.train)} training samples of {self.seq_len} tokens ({len(self.validation)} held out for validation)"


def build_corpus(data_cfg, pretrained_tokenizer=None):
    """Select, split, tokenise (cached) and pack the corpus described by ``data_cfg``; with
    ``data.kind: speech``, synthesise or read the utterances instead
    (:func:`memtrain.data.speech.build_speech_corpus`).

    Args:
        pretrained_tokenizer: a folder holding a pretrained ``tokenizer.json`` (a text
            ``model.pretrained`` that has one): it tokenises instead of a BPE trained here.
        data_cfg: a :class:`memtrain.config.DataConfig`.

    Returns:
        A :class:`Corpus` (text) or :class:`memtrain.data.speech.SpeechCorpus`.

    Raises:
        ConfigError: one file only, a split too small for one ``seq_len`` sample, a file that is not
            ``data.encoding`` text, or a bad speech manifest (the message names the field and file).
    """
    if data_cfg.kind == "speech":
        return build_speech_corpus(data_cfg)

    files = select_files(data_cfg.files, data_cfg.max_bytes, data_cfg.validation_fraction)
    train_files, val_files = split_files(files, data_cfg.validation_fraction)
    if not val_files or not train_files:  # one file lands on either side, by its name's hash

        raise ConfigError("data.files", f"{len(files)} file(s) selected; at least two are needed (whole files are held "
                          "out for validation: data.validation_fraction), or a datasets folder with its own split")
    tok = load_or_build(train_files, val_files, data_cfg.vocab_size, data_cfg.text_field, data_cfg.cache_dir,
                        pretrained_tokenizer, data_cfg.encoding, strict_decoding=data_cfg.files is not None)
    if tok.vocab_size != data_cfg.vocab_size and not pretrained_tokenizer:
        import logging

        reason = ("the byte-level alphabet and special tokens alone need more" if tok.vocab_size > data_cfg.vocab_size
                  else "BPE found no more pairs worth merging in this corpus")
        logging.getLogger("memtrain").warning(
            "memtrain: data.vocab_size %d: the tokenizer has %d tokens (%s); the model's vocabulary is %d",
            data_cfg.vocab_size, tok.vocab_size, reason, tok.vocab_size)
    for side, stream in (("validation", tok.validation), ("training", tok.train)):
        if len(stream) == 0:  # a datasets source's rows are split by hash: a small one can leave a side empty

            raise ConfigError("data.validation_fraction", f"{data_cfg.validation_fraction} left no document on the "
                              f"{side} side (a datasets source's rows go to validation by a hash of its path and "
                              "row index); choose another fraction, give more rows, or a dataset dict with its own "
                              "validation split")
    return Corpus(PackedDataset(tok.train, data_cfg.seq_len), PackedDataset(tok.validation, data_cfg.seq_len), tok,
                  seq_len=data_cfg.seq_len)
