import numpy as np
import pytest
import torch

from memtrain.data import GlobalBatchSampler, batch_fingerprint
from memtrain.data.sampler import Cursor
from memtrain.plan import Plan


def test_every_sample_once_per_epoch_across_ranks():
    n, gbs, ws = 103, 8, 4
    samplers = [GlobalBatchSampler(n, gbs, seed=7, world_size=ws, rank=r) for r in range(ws)]
    seen = []
    for step in range(samplers[0].steps_per_epoch):
        slices = [s.rank_batch(Cursor(0, step)) for s in samplers]
        # disjoint rank slices that together are exactly the global batch
        assert len(set(np.concatenate(slices).tolist())) == gbs
        np.testing.assert_array_equal(np.concatenate(slices), samplers[0].global_batch(Cursor(0, step)))
        seen.extend(np.concatenate(slices).tolist())
    assert len(seen) == len(set(seen)) == (n // gbs) * gbs  # each once; the partial last batch is dropped
    assert set(seen) <= set(range(n))


def test_global_batch_independent_of_world_size():
    n, gbs = 200, 16
    ref = GlobalBatchSampler(n, gbs, seed=3, world_size=1)
    for ws in (2, 4, 8):
        ranks = [GlobalBatchSampler(n, gbs, seed=3, world_size=ws, rank=r) for r in range(ws)]
        for step in (0, 5, 11, 12, 30):  # crosses epochs (12 steps per epoch)
            c = ref.cursor(step)
            np.testing.assert_array_equal(np.concatenate([s.rank_batch(c) for s in ranks]), ref.global_batch(c))


def test_micro_batch_size_does_not_move_data():
    """The rank batch is the same whatever the plan; the plan only cuts it, in order."""
    s = GlobalBatchSampler(64, 16, seed=1, world_size=2, rank=1)
    rank = s.rank_batch(Cursor(1, 2))
    batch = {"x": torch.as_tensor(rank)}
    for mbs in (1, 2, 4, 8):
        plan = Plan.for_global_batch(16, mbs, 2)
        parts = plan.split(batch)
        assert len(parts) == plan.gradient_accumulation_steps == 8 // mbs
        np.testing.assert_array_equal(torch.cat([p["x"] for p in parts]).numpy(), rank)


def test_epochs_reshuffle_and_seed_matters():
    s = GlobalBatchSampler(64, 16, seed=1)
    assert s.cursor(4) == Cursor(1, 0)
    e0 = np.concatenate([s.global_batch(Cursor(0, i)) for i in range(4)])
    e1 = np.concatenate([s.global_batch(Cursor(1, i)) for i in range(4)])
    assert sorted(e0) == sorted(e1) == list(range(64)) and not np.array_equal(e0, e1)
    other = GlobalBatchSampler(64, 16, seed=2)
    assert batch_fingerprint(other.global_batch(Cursor(0, 0))) != batch_fingerprint(s.global_batch(Cursor(0, 0)))


def test_plan_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="not divisible"):
        Plan.for_global_batch(12, 4, 2)
