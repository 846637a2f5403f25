"""A fingerprint of the data a step actually trained on.

Every rank hashes the tensors each micro-batch fed through forward in the attempt that completed
the step; the hashes are summed over micro-batches and ranks. The result identifies the *multiset*
of samples trained in the step: it does not depend on the micro-batch split, on the world size, on
the order of samples inside the global batch, or on padding (padding values — 0 in float and
mask tensors, -100 in labels — contribute nothing), but it changes when a sample is skipped,
duplicated, replaced or altered, or when a resume starts at the wrong position.

Each sample (row) is hashed on the device: a weighted sum of its values (random odd 64-bit weights
per column and tensor name, arithmetic modulo 2**64), passed through a 64-bit finaliser
(splitmix64's) so that rows do not cancel. No host synchronisation is needed until the step's
metrics are read.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from memtrain.data import IGNORE_INDEX

_MASK = (1 << 64) - 1
_weights: dict[tuple[str, torch.device], torch.Tensor] = {}
CHUNK_COLUMNS = 4096
"""Columns hashed at once: a row's sum is taken over chunks of this many values, so the int64
copies a chunk makes (its values, their products with the weights) stay this wide whatever a
sample's length (a speech micro-batch of 4 utterances of 4 s: 6 MB at once unchunked, at the
optimizer step's peak)."""


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _column_weights(name: str, width: int, device: torch.device) -> torch.Tensor:
    """Odd random int64 weights [width] for tensor ``name``, the same in every process: the first
    ``width`` of the seeded draw, one tensor per name and device kept at the widest asked (a
    speech batch's width changes with its utterances' lengths)."""
    key = (name, device)
    if key not in _weights or _weights[key].numel() < width:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        w = torch.randint(-(1 << 62), 1 << 62, (width,), generator=g, dtype=torch.int64) * 2 + 1
        _weights[key] = w.to(device)
    return _weights[key][:width]


def release_weights() -> None:
    """Forget the column weights kept so far (the next digest draws them again, the same): a run
    starts without an earlier run's in the same process, and exports without its own (the
    export's moment counts none: :mod:`memtrain.memory.moments`)."""
    _weights.clear()


def weight_bytes(micro_batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the column weights :func:`micro_batch_digest` keeps on the micro-batch's device
    for ``micro_batch`` (tensors [B, …]): int64 [columns] per tensor name (8 bytes per value of a
    sample), kept through the whole run at the widest asked — for a speech batch 16 bytes per
    audio sample of its longest utterance (the values and the attention mask). The planner counts
    them with the rank's batch (:func:`memtrain.planning.activations.activation_table`'s ``resident``)."""
    return sum(8 * t.reshape(t.shape[0], -1).shape[1] for t in micro_batch.values() if isinstance(t, torch.Tensor))


def _as_int64(name: str, t: torch.Tensor) -> torch.Tensor:
    """Values of ``t`` [B, …] as int64 [B, N]: integers shifted so that labels' -100 (padding) is 0
    and every real value is non-zero; floats by their bit pattern (0.0 → 0)."""
    t = t.reshape(t.shape[0], -1)
    if t.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.contiguous().view(bits).to(torch.int64)
    t = t.to(torch.int64)
    if name == "attention_mask":
        return t
    return torch.where(t == IGNORE_INDEX, torch.zeros_like(t), t + 1)


def _finalise(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (logical shifts emulated by masking the sign bits)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def micro_batch_digest(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum over the micro-batch's samples of each sample's hash: an int64 scalar on the
    micro-batch's device (arithmetic modulo 2**64)."""
    rows: Optional[torch.Tensor] = None
    for name in sorted(micro_batch):
        t = micro_batch[name]
        t = t.reshape(t.shape[0], -1)
        weights = _column_weights(name, t.shape[1], t.device)
        for start in range(0, max(1, t.shape[1]), CHUNK_COLUMNS):  # sums modulo 2**64: any split
            end = start + CHUNK_COLUMNS
            part = (_as_int64(name, t[:, start:end]) * weights[start:end]).sum(dim=1)
            rows = part if rows is None else rows + part
    if rows is None:
        raise ValueError("an empty micro-batch has no fingerprint")
    return _finalise(rows).sum()


def hex_of(digest: int) -> str:
    """16 hex digits of a digest already read to the host."""
    return f"{digest & _MASK:016x}"
