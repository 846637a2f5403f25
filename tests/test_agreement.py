"""The OOM protocol's agreement points, in one process: where a step agrees for each engine's
pattern of collectives, that an OOM on another rank is still caught at the next point, and that
the step's sums and the stop flag ride in the closing agreement.

The other rank is simulated: ``torch.distributed.all_reduce`` is replaced by a function that adds
what rank 1 would contribute (the same sums, and an OOM flag or a stop flag when a test asks).
"""

import pytest
import torch
from torch import nn

from memtrain.backends.base import ComputeCollectives
from memtrain.objectives import CausalLM
from memtrain.config import FaultsConfig
from memtrain.oom import AgreedOOM, OOMSync, agrees_inside_compute, is_oom
from memtrain.plan import Plan
from memtrain.step import train_step

WORLD = 2


class Blocks(nn.Module):
    """Embedding → two residual MLP blocks → head: input_ids [B, T] → logits [B, T, V]."""

    def __init__(self, vocab: int = 32, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


class Process:
    world_size, rank, device = WORLD, 0, torch.device("cpu")

    def all_reduce_sum(self, tensor):
        return tensor.mul_(WORLD)  # rank 1 holds the same numbers

    def start_all_reduce_sum(self, tensor):
        summed = self.all_reduce_sum(tensor)
        return lambda: summed


class Engine:
    """A stand-in engine whose collectives lie where ``pattern(last)`` says."""

    def __init__(self, pattern):
        self.pattern, self.process, self.grad_average_factor = pattern, Process(), float(WORLD)

    def compute_collectives(self, last_micro_batch):
        return ComputeCollectives(*self.pattern(last_micro_batch))

    def reduction_context(self, model, reduce_gradients):
        return torch.enable_grad()

    def backward(self, loss):
        loss.backward()


class OtherRank:
    """Replaces ``torch.distributed.all_reduce``: adds rank 1's contribution (its OOM flag at the
    call numbered ``oom_at``, its stop flag, and the same payload as rank 0) and counts calls."""

    def __init__(self, oom_at=None, stop=False):
        self.calls, self.oom_at, self.stop = 0, oom_at, stop

    def __call__(self, buffer, op=None, group=None):
        self.calls += 1
        other = buffer.clone()
        other[:WORLD] = 0
        other[1] = float(self.calls == self.oom_at)
        if self.stop:
            other[-1] = 1.0
        buffer += other


PATTERNS = {  # engine → (forward, backward) collectives on a non-last / the last micro-batch
    "ddp_deferred": lambda last: (False, False),
    "zero1": lambda last: (False, last),
    "zero2": lambda last: (False, True),
    "zero2_one_bucket": lambda last: (False, True, frozenset({0})),  # every gradient fits one reduce bucket
    "fsdp_or_zero3": lambda last: (True, True),
}
MICRO_BATCHES, BLOCKS = 3, 2
EXPECTED = {  # agreements per step: hooks before block forwards, before and after block backwards
    # (before the engine's post-backward collectives), between micro-batches, closing
    "ddp_deferred": 1,
    "zero1": 1 + 2 * BLOCKS + 1,  # before the last micro-batch, its backward hooks, closing
    "zero2": MICRO_BATCHES * 2 * BLOCKS + (MICRO_BATCHES - 1) + 1,
    "zero2_one_bucket": 2 * MICRO_BATCHES + 1,  # around block 0's backward in each micro-batch, closing
    "fsdp_or_zero3": MICRO_BATCHES * 3 * BLOCKS + (MICRO_BATCHES - 1) + 1,
}


def _step(pattern, other, monkeypatch, sync=None):
    monkeypatch.setattr(torch.distributed, "all_reduce", other)
    model, engine = Blocks(), Engine(PATTERNS[pattern])
    sync = sync or OOMSync(WORLD, 0)
    sync.install(list(model.layers), engine.compute_collectives(True))
    ids = torch.randint(0, 32, (MICRO_BATCHES * 2, 6), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    return train_step(model, engine, batch, Plan(2, MICRO_BATCHES), CausalLM(), sync), sync, model


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_a_step_agrees_only_where_the_engine_communicates(pattern, monkeypatch):
    other = OtherRank()
    _, sync, _ = _step(pattern, other, monkeypatch)
    assert other.calls == sync.agreements == EXPECTED[pattern]


@pytest.mark.parametrize("pattern", ["zero2", "zero2_one_bucket", "fsdp_or_zero3", "ddp_deferred"])
def test_another_ranks_oom_is_caught_at_the_next_point(pattern, monkeypatch):
    """Rank 1 ran out of memory before the last agreement of the step: rank 0 raises there and
    makes no agreement after it."""
    other = OtherRank(oom_at=EXPECTED[pattern])
    with pytest.raises(AgreedOOM) as caught:
        _step(pattern, other, monkeypatch)
    assert caught.value.ranks == [1] and other.calls == EXPECTED[pattern]


def test_the_closing_agreement_carries_the_sums_and_the_stop_flag(monkeypatch):
    """The loss sum and fingerprint are summed over ranks in the closing all-reduce (no
    collective of their own), equal to what a separate all-reduce gives; a stop signal on rank 1
    only reaches rank 0 through it."""
    sums, sync, _ = _step("ddp_deferred", OtherRank(stop=True), monkeypatch)
    assert sync.agreements == 1 and sync.stop_agreed
    alone, _, _ = _step("ddp_deferred", OtherRank(), monkeypatch, sync=OOMSync(WORLD, 0, enabled=False))
    assert sums.loss_sum.item() == alone.loss_sum.item() and sums.digest.item() == alone.digest.item()
    assert sums.count.item() == alone.count.item()


def test_recovery_off_makes_no_agreement(monkeypatch):
    other = OtherRank()
    _step("fsdp_or_zero3", other, monkeypatch, sync=OOMSync(WORLD, 0, enabled=False))
    assert other.calls == 0  # the count and the sums go through the process's own all-reduce


@pytest.mark.parametrize("pattern", ["zero2", "fsdp_or_zero3"])
def test_without_points_inside_compute_a_step_agrees_once_and_still_hears_an_oom(pattern, monkeypatch):
    """``inside_compute`` off (a CPU run without injected faults): no block hook and no point
    between micro-batches agrees, only the closing one, where another rank's OOM still arrives."""
    other = OtherRank()
    _step(pattern, other, monkeypatch, sync=OOMSync(WORLD, 0, inside_compute=False))
    assert other.calls == 1
    with pytest.raises(AgreedOOM) as caught:
        _step(pattern, OtherRank(oom_at=1), monkeypatch, sync=OOMSync(WORLD, 0, inside_compute=False))
    assert caught.value.ranks == [1]


def test_points_inside_compute_are_made_where_an_oom_can_be_raised_there():
    """A GPU raises out-of-memory errors; on the CPU a failed allocation is one too (checked here,
    not assumed), but without a resource limit the kernel's OOM killer usually acts first: the
    points are made on a CPU run under a limit past which allocations fail, under injected
    faults, or at the benchmark's request."""
    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**62, dtype=torch.uint8)  # beyond any address space: fails whatever the overcommit mode
    assert is_oom(failed.value)
    assert agrees_inside_compute("cuda", FaultsConfig())
    assert not agrees_inside_compute("cpu", FaultsConfig())
    assert agrees_inside_compute("cpu", FaultsConfig(), host_limited=True)
    for faults in (FaultsConfig(oom_above_tokens=32), FaultsConfig(memory_budget_mib=64.0),
                   FaultsConfig(arm_oom_agreements=True)):
        assert agrees_inside_compute("cpu", faults)
