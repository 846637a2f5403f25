"""Offline speech synthesis with eSpeak NG, and the English sentences it reads.

eSpeak NG comes as a shared library plus voice data in the PyPI package ``espeakng-loader``; it is
driven through ``ctypes`` in synchronous mode (``espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS)``, a
synth callback that collects int16 samples at 22,050 Hz). Formant synthesis has no randomness:
the same text, voice, rate and pitch give the same samples, so a corpus synthesised from
``(seed, sample_index)`` is deterministic.

The sentences are real English that ships with the machine: docstrings and comments of the
Python standard library, normalised to lower-case letters, digits, apostrophe and space.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import io
import json
import os
import re
import sys
import tokenize
from dataclasses import dataclass

import numpy as np

ESPEAK_SAMPLE_RATE = 22050
"""Hz; what eSpeak NG synthesises at."""

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_PARAM_RATE, _PARAM_PITCH = 1, 3

VOICES = ("en-us+m1", "en-us+m3", "en-us+m7", "en-us+f1", "en-us+f3", "en+m2", "en+f2", "en+f4")
"""Voices (language + eSpeak NG variant) an utterance's voice is drawn from."""


@dataclass(frozen=True)
class Voice:
    """How one utterance is spoken.

    Attributes:
        name: eSpeak NG voice name with variant, e.g. ``en-us+f3``.
        rate: words per minute (eSpeak's 80–450; 175 default).
        pitch: base pitch 0–100 (50 default).
    """

    name: str
    rate: int
    pitch: int


def voice_for(seed: int, index: int, split: int = 0) -> Voice:
    """The voice of sample ``index`` of split ``split`` (0 train, 1 test): a pure function of
    its arguments (NumPy's ``default_rng`` seeded by them), so every rank and rerun hears the
    same speaker."""
    rng = np.random.default_rng([seed, index, split, 0x5EEC])
    return Voice(VOICES[int(rng.integers(len(VOICES)))], int(rng.integers(145, 196)), int(rng.integers(30, 71)))


class _ESpeak:
    """eSpeak NG through ``ctypes``, initialised once in a synthesis worker process."""

    def __init__(self):
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.libc = ctypes.CDLL(None)
        rate = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
        if rate != ESPEAK_SAMPLE_RATE:
            raise RuntimeError(f"eSpeak NG did not initialise (returned {rate})")
        self.chunks: list[np.ndarray] = []
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

        def collect(wav, num_samples, events):
            if num_samples > 0:
                self.chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
            return 0  # 0 = go on synthesising

        self.callback = callback_type(collect)  # kept alive: the library holds the pointer
        self.lib.espeak_SetSynthCallback(self.callback)

    def synthesize(self, text: str, voice: Voice, seed: int) -> np.ndarray:
        """int16 [samples] at 22,050 Hz. Run in a fresh fork (see :func:`synthesize_many`)."""
        if self.lib.espeak_SetVoiceByName(voice.name.encode()) != 0:
            raise RuntimeError(f"eSpeak NG has no voice '{voice.name}'")
        self.lib.espeak_SetParameter(_PARAM_RATE, voice.rate, 0)
        self.lib.espeak_SetParameter(_PARAM_PITCH, voice.pitch, 0)
        # pitch flutter and noise come from eSpeak's generator and libc's rand()
        self.lib.espeak_ng_SetRandSeed(seed)
        self.libc.srand(seed)
        data = text.encode("utf-8")
        status = self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if status != 0:
            raise RuntimeError(f"espeak_Synth failed with status {status} for {text!r}")
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)


def _worker(jobs_path: str, out_path: str) -> None:
    """Synthesis worker (``python espeak.py JOBS.json OUT.npz``): each utterance in a fresh fork.

    eSpeak NG keeps synthesis state between calls (filter memories, flutter phase), so the same
    text spoken twice in one process differs; a child forked from a process that has initialised
    but never spoken starts from the same state every time, which makes each utterance a pure
    function of its text, voice and seed.
    """
    with open(jobs_path) as fh:
        jobs = json.load(fh)
    engine = _ESpeak()
    waves = []
    for job in jobs:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child speaks once and exits
            status = 0
            try:
                os.close(read_fd)
                wave = engine.synthesize(job["text"], Voice(**job["voice"]), job["seed"])
                with os.fdopen(write_fd, "wb") as fh:
                    fh.write(wave.tobytes())
            except BaseException as exc:  # noqa: BLE001 - reported through the exit status
                print(f"espeak worker: {exc}", file=sys.stderr)
                status = 1
            finally:
                os._exit(status)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as fh:
            data = fh.read()
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"synthesis of {job['text']!r} failed (status {status})")
        waves.append(np.frombuffer(data, dtype=np.int16))
    lengths = np.array([len(w) for w in waves], dtype=np.int64)
    np.savez(out_path, audio=np.concatenate(waves) if waves else np.zeros(0, np.int16), lengths=lengths)


def synthesize_many(texts: list[str], voices: list[Voice], seeds: list[int], workers: int = 2) -> list[np.ndarray]:
    """Speak every text with eSpeak NG, in ``workers`` worker processes.

    Args:
        texts: what to say (normalised English).
        voices: one :class:`Voice` per text.
        seeds: one random seed per text (eSpeak's pitch flutter and noise).
        workers: parallel worker processes.

    Returns:
        One int16 [samples] waveform at :data:`ESPEAK_SAMPLE_RATE` Hz per text, each a pure function
        of its (text, voice, seed).

    Raises:
        RuntimeError: ``espeakng-loader`` missing, an unknown voice, or a worker failing (its
            stderr in the message).
    """
    import subprocess
    import tempfile

    jobs = [{"text": t, "voice": dataclasses.asdict(v), "seed": int(s)} for t, v, s in zip(texts, voices, seeds)]
    if not jobs:
        return []
    per_worker = -(-len(jobs) // max(1, workers))
    with tempfile.TemporaryDirectory(prefix="memtrain-espeak-") as tmp:
        procs = []
        for w, start in enumerate(range(0, len(jobs), per_worker)):
            jobs_path, out_path = os.path.join(tmp, f"jobs{w}.json"), os.path.join(tmp, f"out{w}.npz")
            with open(jobs_path, "w") as fh:
                json.dump(jobs[start:start + per_worker], fh)
            # by file path, not -m: the worker needs NumPy and ctypes only, never torch
            procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), jobs_path, out_path],
                                           stderr=subprocess.PIPE, text=True), out_path))
        waves = []
        for proc, out_path in procs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"eSpeak NG synthesis failed (exit {proc.returncode}): {err.strip()[-2000:]}")
            with np.load(out_path) as out:
                audio, lengths = out["audio"], out["lengths"]
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            waves += [audio[bounds[i]:bounds[i + 1]].copy() for i in range(len(lengths))]
    return waves


_NOT_ALLOWED = re.compile(r"[^a-z0-9' ]+")


def normalize_text(text: str) -> str:
    """Lower-case; anything but letters, digits and apostrophes becomes a word break; apostrophes
    only inside words (``don't`` stays, ``'quoted'`` loses them); single spaces."""
    words = _NOT_ALLOWED.sub(" ", text.lower().replace("\u2019", "'")).split()
    return " ".join(w for w in (w.strip("'") for w in words) if w)


_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n\s*\n")


def _prose(source: str) -> list[str]:
    """Docstrings (module, class, function) and comments of one Python source file."""
    pieces = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                pieces.append(doc)
    try:
        comments = [tok.string.lstrip("#").strip() for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        comments = []
    pieces.append("\n\n".join(comments))
    return pieces


def sentences_of(source: str, min_words: int = 3, max_words: int = 12) -> list[str]:
    """English sentences of a Python file's docstrings and comments, normalised.

    A sentence is kept when it has ``min_words``–``max_words`` words, no digits (eSpeak would say
    "forty two" for ``42``, which a character transcript cannot match) and no code-like token
    (underscores, brackets, ``=`` or a dotted name) before normalisation.

    Returns:
        Normalised sentences in source order, duplicates included.
    """
    out = []
    for piece in _prose(source):
        for raw in _SENTENCE_END.split(piece):
            raw = " ".join(raw.split())
            if not raw or re.search(r"[0-9_=(){}\[\]<>|\\/@$%^*~`#]|\w\.\w", raw):
                continue
            text = normalize_text(raw)
            if min_words <= len(text.split()) <= max_words:
                out.append(text)
    return out


if __name__ == "__main__":  # the synthesis worker of synthesize_many
    _worker(sys.argv[1], sys.argv[2])
