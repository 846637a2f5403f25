"""The global-batch sampler and its ``(epoch, step)`` cursor (docs/design.md, "The global batch is the unit of work").

Global batch ``step`` of ``epoch`` is block ``step`` of a permutation of the dataset seeded by
``(seed, epoch)``, cut into consecutive blocks of ``global_batch_size`` (the last partial block
is dropped). Rank ``r`` of ``world_size`` takes the ``r``-th contiguous slice of each block.
Nothing depends on the micro-batch size, and the global batch does not depend on the world
size, so OOM re-planning and resume on another world size never move the data position.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cursor:
    """Position in the data: global batch ``step`` (0-based) of ``epoch`` (0-based)."""

    epoch: int
    step: int


class GlobalBatchSampler:
    """Sample indices of each global batch and of each rank's share of it.

    Args:
        num_samples: dataset size (samples).
        global_batch_size: samples per optimizer step over all ranks.
        seed: data-order seed.
        world_size: number of ranks.
        rank: this process's rank.
        lengths: int [num_samples] sample lengths, for length-aware batching; None = off.
        bucket_batches: with ``lengths``: sort each run of this many global batches of the
            permutation by length (ties by index), then shuffle the batches' order, so a global
            batch holds samples of similar length (fairseq / ESPnet style bucketing). Still a pure
            function of ``(seed, epoch)``: the cursor rules do not change. 0 = off.

    Raises:
        ValueError: ``global_batch_size`` not divisible by ``world_size``, or larger than the
            dataset (not one full batch per epoch).
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, world_size: int = 1, rank: int = 0,
                 lengths: np.ndarray | None = None, bucket_batches: int = 0):
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size {global_batch_size} not divisible by world_size {world_size}")
        if num_samples < global_batch_size:
            raise ValueError(
                f"the training split has {num_samples} samples, fewer than training.global_batch_size "
                f"{global_batch_size}: add data (data.files / data.max_bytes) or lower the batch"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.bucket_batches = bucket_batches if lengths is not None else 0
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch."""
        return self.num_samples // self.global_batch_size

    def cursor(self, global_step: int) -> Cursor:
        """The cursor of the ``global_step``-th optimizer step (0-based, counted over epochs)."""
        return Cursor(global_step // self.steps_per_epoch, global_step % self.steps_per_epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            if self.bucket_batches > 0:
                self._perm = self._bucketed(self._perm, epoch)
            self._perm_epoch = epoch
        return self._perm

    def _bucketed(self, perm: np.ndarray, epoch: int) -> np.ndarray:
        gbs, steps = self.global_batch_size, self.steps_per_epoch
        bucket = self.bucket_batches * gbs
        used = perm[:steps * gbs]
        chunks = [used[i:i + bucket] for i in range(0, len(used), bucket)]
        ordered = np.concatenate([c[np.lexsort((c, self.lengths[c]))] for c in chunks]).reshape(steps, gbs)
        order = np.random.default_rng([self.seed, epoch, 1]).permutation(steps)
        return np.concatenate([ordered[order].reshape(-1), perm[steps * gbs:]])

    def global_batch(self, cursor: Cursor) -> np.ndarray:
        """Sample indices of the global batch at ``cursor``: int64 [global_batch_size]."""
        if not 0 <= cursor.step < self.steps_per_epoch:
            raise IndexError(f"step {cursor.step} outside epoch of {self.steps_per_epoch} steps")
        start = cursor.step * self.global_batch_size
        return self._permutation(cursor.epoch)[start:start + self.global_batch_size]

    def rank_batch(self, cursor: Cursor) -> np.ndarray:
        """This rank's slice of the global batch: int64 [global_batch_size // world_size]."""
        per_rank = self.global_batch_size // self.world_size
        return self.global_batch(cursor)[self.rank * per_rank:(self.rank + 1) * per_rank]


def batch_fingerprint(indices: np.ndarray) -> str:
    """A 16-hex-digit hash of a global batch's sample indices (order-sensitive)."""
    return hashlib.sha1(np.ascontiguousarray(indices, dtype=np.int64).tobytes()).hexdigest()[:16]
