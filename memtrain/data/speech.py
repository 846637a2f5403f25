"""Speech data: the embedded synthetic corpus (eSpeak NG reading standard-library prose) or a
user's JSONL manifests, a character vocabulary for CTC, and length-aware collation.

Both sources end in the same cache: per split, one int16 waveform stream at 16 kHz
(``*_audio.npy``, memory-mapped), the utterance lengths and the transcripts, under
``cache_dir/speech-<hash of sources and settings>/``, written to a temporary directory and
renamed (a killed build never leaves half a cache).

Determinism (randomness in data is a pure function of seed, split and index): utterance ``i`` of a split is spoken by the voice,
rate, pitch and random seed of :func:`memtrain.data.espeak.voice_for` ``(seed, i, split)`` — a
pure function — so the same ``(seed, index)`` gives the same samples on every rank and rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from memtrain.config import ConfigError
from memtrain.data.corpus import _unit_hash, split_files, stdlib_files, user_files
from memtrain.data.espeak import ESPEAK_SAMPLE_RATE, normalize_text, sentences_of, synthesize_many, voice_for
from memtrain.data.tokens import building, default_cache_dir

SAMPLE_RATE = 16000
"""Hz; what every waveform is resampled to (the wav2vec 2.0 / WavLM rate)."""

CHARACTERS = ["<pad>", "<unk>", "|", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
"""The CTC vocabulary: id 0 ``<pad>`` is the CTC blank, ``|`` the word delimiter (space), as in
transformers' ``Wav2Vec2CTCTokenizer``."""

BLANK_ID = 0
_CHAR_ID = {c: i for i, c in enumerate(CHARACTERS)}
_CACHE_FORMAT = 2  # bump when synthesis, normalisation or the cache layout changes


def encode_text(text: str) -> list[int]:
    """Character ids of a normalised transcript (space → ``|``; other unknown characters → ``<unk>``)."""
    return [_CHAR_ID.get("|" if c == " " else c, 1) for c in text]


def decode_ids(ids) -> str:
    """Transcript of character ids (no CTC collapsing; blanks and ``<unk>`` dropped)."""
    return "".join(" " if i == 2 else CHARACTERS[i] for i in ids if i > 1).strip()


def hf_processor():
    """A transformers ``Wav2Vec2Processor`` (feature extractor + CTC tokenizer) for this
    vocabulary, saved beside exported models so ``pipeline("automatic-speech-recognition")``
    can load them."""
    from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2Processor

    with tempfile.TemporaryDirectory() as tmp:
        vocab = os.path.join(tmp, "vocab.json")
        with open(vocab, "w") as fh:
            json.dump(_CHAR_ID, fh)
        tokenizer = Wav2Vec2CTCTokenizer(vocab, unk_token="<unk>", pad_token="<pad>", word_delimiter_token="|",
                                         bos_token=None, eos_token=None)
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0,
                                         do_normalize=True, return_attention_mask=True)
    return Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer)


class SpeechDataset:
    """Utterances of one split, collated into padded batches for CTC.

    Args:
        audio: int16 [total samples] waveform stream at 16 kHz (memory-mapped is fine).
        lengths: int64 [N] samples per utterance, in stream order.
        texts: N normalised transcripts.
    """

    def __init__(self, audio: np.ndarray, lengths: np.ndarray, texts: list[str]):
        if len(lengths) != len(texts):
            raise ValueError(f"{len(lengths)} utterances but {len(texts)} transcripts")
        self.audio, self.lengths, self.texts = audio, np.asarray(lengths, dtype=np.int64), texts
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])

    def __len__(self) -> int:
        return len(self.texts)

    def waveform(self, index: int) -> np.ndarray:
        """int16 [samples] of utterance ``index``."""
        return np.asarray(self.audio[self.offsets[index]:self.offsets[index + 1]])

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """Collate utterances, longest first, so micro-batches cut from the result hold utterances
        of similar length (each is trimmed to its own longest by the CTC objective).

        Waveforms are normalised to zero mean and unit variance per utterance (as
        ``Wav2Vec2FeatureExtractor(do_normalize=True)``) and zero-padded.

        Args:
            indices: utterance indices, int [B].

        Returns:
            ``input_values`` float32 [B, S] (S = longest, in samples), ``attention_mask`` int64
            [B, S] (1 = real audio), ``labels`` int64 [B, L] character ids padded with -100.
        """
        indices = sorted((int(i) for i in indices), key=lambda i: (-self.lengths[i], i))
        n = len(indices)
        longest = max((int(self.lengths[i]) for i in indices), default=1)
        values = torch.zeros(n, longest, dtype=torch.float32)
        mask = torch.zeros(n, longest, dtype=torch.int64)
        label_ids = [encode_text(self.texts[i]) for i in indices]
        labels = torch.full((n, max((len(t) for t in label_ids), default=1)), -100, dtype=torch.int64)
        for row, i in enumerate(indices):
            wave = torch.from_numpy(self.waveform(i).astype(np.float32))
            wave = (wave - wave.mean()) / torch.sqrt(wave.var(unbiased=False) + 1e-7)
            values[row, :len(wave)] = wave
            mask[row, :len(wave)] = 1
            labels[row, :len(label_ids[row])] = torch.tensor(label_ids[row], dtype=torch.int64)
        return {"input_values": values, "attention_mask": mask, "labels": labels}


def resample(wave: np.ndarray, rate: int) -> np.ndarray:
    """int16 or float mono [samples] at ``rate`` Hz → int16 at 16 kHz (soxr, high quality)."""
    import soxr

    x = wave.astype(np.float32) / (32768.0 if wave.dtype == np.int16 else 1.0)
    if rate != SAMPLE_RATE:
        x = soxr.resample(x, rate, SAMPLE_RATE)
    return np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16)


def synthetic_sentences(validation_fraction: float, min_words: int, max_words: int) -> tuple[list[str], list[str]]:
    """Train and test sentences from the standard library's docstrings and comments, split by
    source file (memtrain.data.corpus.split_files); each side deduplicated and put in a
    content-hash order (so the first N sample the whole library); test sentences that also occur
    in training are dropped."""
    train_files, test_files = split_files(stdlib_files(), validation_fraction)

    def collect(files) -> list[str]:
        seen = {}
        for f in files:
            with open(f.path, encoding="utf-8", errors="replace") as fh:
                for s in sentences_of(fh.read(), min_words, max_words):
                    seen.setdefault(s, None)
        return sorted(seen, key=lambda s: hashlib.sha1(s.encode()).hexdigest())

    train = collect(train_files)
    known = set(train)
    return train, [s for s in collect(test_files) if s not in known]


def read_manifests(paths: list[str]) -> list[tuple[str, str, str]]:
    """``(audio path, normalised text, audio as written)`` of every line of JSONL manifests
    ``{"audio": path, "text": ...}`` (audio paths relative to the manifest's folder). The path as
    written is what the train/validation split hashes, so a dataset keeps its split when its
    folder moves.

    Raises:
        ConfigError: field ``data.files``: a manifest that is not UTF-8 JSONL, a line without
            ``audio`` or ``text``, a text with nothing left after normalisation, or an audio file
            that does not exist (names the manifest and line).
    """
    items = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except UnicodeDecodeError as exc:
            raise ConfigError("data.files", f"{path}: a speech manifest must be UTF-8 JSONL ({exc.reason} at byte "
                              f"{exc.start})") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError("data.files", f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); a "
                                  "speech manifest holds one {\"audio\": ..., \"text\": ...} object per line") from None
            if not isinstance(obj, dict) or "audio" not in obj or "text" not in obj:
                raise ConfigError("data.files", f"{path}:{lineno}: a speech manifest line needs 'audio' and 'text'")
            audio = os.path.join(os.path.dirname(os.path.abspath(path)), str(obj["audio"]))
            if not os.path.isfile(audio):
                raise ConfigError("data.files", f"{path}:{lineno}: audio file '{audio}' does not exist")
            text = normalize_text(str(obj["text"]))
            if not text:  # nothing to align a CTC path to, and no words to score
                raise ConfigError("data.files", f"{path}:{lineno}: the text {obj['text']!r} has no letters or digits "
                                  "left after normalisation")
            items.append((audio, text, str(obj["audio"])))
    return items


def _read_audio(path: str) -> np.ndarray:
    import soundfile

    wave, rate = soundfile.read(path, dtype="float32", always_2d=True)
    return resample(wave.mean(axis=1), rate)


def _write_split(directory: str, name: str, waves: list[np.ndarray], texts: list[str]) -> None:
    np.save(os.path.join(directory, f"{name}_audio.npy"),
            np.concatenate(waves) if waves else np.zeros(0, np.int16))
    np.save(os.path.join(directory, f"{name}_lengths.npy"), np.array([len(w) for w in waves], dtype=np.int64))
    with open(os.path.join(directory, f"{name}_texts.json"), "w") as fh:
        json.dump(texts, fh)


def _load_split(directory: str, name: str) -> SpeechDataset:
    with open(os.path.join(directory, f"{name}_texts.json")) as fh:
        texts = json.load(fh)
    return SpeechDataset(np.load(os.path.join(directory, f"{name}_audio.npy"), mmap_mode="r"),
                         np.load(os.path.join(directory, f"{name}_lengths.npy")), texts)


@dataclass
class SpeechCorpus:
    """Training and test utterances of a run (the loop's view of any corpus: ``train``,
    ``validation``, ``vocab_size``, ``hf_tokenizer()``, ``describe()``).

    Attributes:
        train: training utterances.
        validation: held-out utterances (evaluation loss, WER and CER).
        directory: the cache directory.
    """

    train: SpeechDataset
    validation: SpeechDataset
    directory: str
    vocab_size: int = len(CHARACTERS)
    kind: str = "speech"

    def hf_tokenizer(self):
        """The processor saved with checkpoints and exports."""
        return hf_processor()

    def describe(self) -> str:
        seconds = float(self.train.lengths.sum()) / SAMPLE_RATE
        return f"{len(self.train)} training utterances ({seconds / 3600:.2f} h of audio)"


def build_speech_corpus(data_cfg, cache_dir: Optional[str] = None) -> SpeechCorpus:
    """Synthesise (or read) and cache the speech corpus ``data_cfg`` describes.

    Args:
        data_cfg: a :class:`memtrain.config.DataConfig` with ``kind: speech``. ``files`` = None:
            the synthetic corpus (``data.speech.*``); else JSONL manifests, split by a hash of
            each audio path with ``validation_fraction``.
        cache_dir: cache root; None = ``data.cache_dir`` or the default cache.

    Returns:
        The corpus, audio memory-mapped.

    Raises:
        ValueError: too few sentences for the requested utterance counts, or a bad manifest.
        RuntimeError: eSpeak NG synthesis failing.
    """
    sp = data_cfg.speech
    if data_cfg.files is None:
        sources: dict = {"synthetic": True, "seed": sp.seed, "train": sp.train_utterances, "test": sp.test_utterances,
                         "words": [sp.min_words, sp.max_words], "validation_fraction": data_cfg.validation_fraction}
    else:
        files = user_files(data_cfg.files)
        sources = {"manifests": [(f.path, os.path.getmtime(f.path), f.size) for f in files],
                   "validation_fraction": data_cfg.validation_fraction}
    key = hashlib.sha256(json.dumps([sources, _CACHE_FORMAT], sort_keys=True).encode()).hexdigest()[:20]
    directory = os.path.join(cache_dir or data_cfg.cache_dir or default_cache_dir(), f"speech-{key}")
    if not os.path.exists(os.path.join(directory, "validation_texts.json")):
        with building(directory) as tmp:
            if data_cfg.files is None:
                train, test = synthetic_sentences(data_cfg.validation_fraction, sp.min_words, sp.max_words)
                if len(train) < sp.train_utterances or len(test) < sp.test_utterances:
                    raise ConfigError("data.speech.train_utterances", f"the standard library gives {len(train)} training and {len(test)} "
                                      f"test sentences of {sp.min_words}-{sp.max_words} words; lower "
                                      "data.speech.train_utterances / test_utterances or widen the word range")
                for split, name, sentences in ((0, "train", train[:sp.train_utterances]),
                                               (1, "validation", test[:sp.test_utterances])):
                    voices = [voice_for(sp.seed, i, split) for i in range(len(sentences))]
                    seeds = [int(np.random.default_rng([sp.seed, i, split, 7]).integers(1, 2**31)) for i in range(len(sentences))]
                    waves = [resample(w, ESPEAK_SAMPLE_RATE) for w in synthesize_many(sentences, voices, seeds)]
                    _write_split(tmp, name, waves, sentences)
            else:
                items = read_manifests([f.path for f in files])
                val = [it for it in items if _unit_hash("split:" + it[2]) < data_cfg.validation_fraction]
                train_items = [it for it in items if _unit_hash("split:" + it[2]) >= data_cfg.validation_fraction]
                if not val or not train_items:
                    raise ConfigError("data.files", f"{len(items)} utterances leave an empty train or validation "
                                      f"split at data.validation_fraction {data_cfg.validation_fraction}")
                for name, part in (("train", train_items), ("validation", val)):
                    _write_split(tmp, name, [_read_audio(a) for a, _, _ in part], [t for _, t, _ in part])
    return SpeechCorpus(_load_split(directory, "train"), _load_split(directory, "validation"), directory)
