"""Activation offload (memtrain/levers/activation_offload.py, ``memory.activation_offload``): the same
losses and gradients as without it; what it moves leaves the simulated device for host memory;
the planner predicts the device bytes the simulated device counts and the bytes moved, charges
the copies at the stated bandwidth on a CPU run, and the solver turns it on only under
``memory.levers auto``. Under FSDP2 and ZeRO-3 on 2 ranks: test_backends (with chunked
cross-entropy, against the DDP run)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_ARGS

MiB = 2**20


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=32, vocab_size=64,
                                      resid_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))


def saved_activation_bytes(net, ids) -> int:
    """This test's own count of what the offload should move: bytes of every distinct tensor (the
    same elements of the same memory, saved by several operators, once) autograd saves in
    ``net``'s forward that is 1 KiB or more and neither a parameter nor a view of one."""
    seen = {}

    def pack(t):
        param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        if not param and t.numel() * t.element_size() >= 1024:  # held here: no address is reused
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)] = t
        return t

    net = copy.deepcopy(net).train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(input_ids=ids, labels=ids)
    return sum(t.numel() * t.element_size() for t in seen.values())


def test_offload_keeps_losses_and_gradients_bitwise_and_moves_activations_to_host():
    """GPT-2 with dropout, fp32, activation checkpointing off and on: with the offload on, the loss
    and every gradient are bitwise those without it; the simulated device holds far less, the bytes
    moved are those autograd saves (the test's own count; with AC on only the checkpoints'
    inputs move), and nothing counted outlives backward. Switched off again, nothing moves."""
    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.levers.activation_offload import disable_activation_offload, enable_activation_offload, moved_bytes
    from memtrain.models import repeated_blocks
    from memtrain.memory.simulated import SimulatedMemory

    net = gpt2()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    expected = saved_activation_bytes(net, ids)
    for ac in ("off", "on"):
        results = {}
        for offload in ("off", "on", "off again"):
            probe = copy.deepcopy(net).train()
            if ac == "on":
                enable_activation_checkpointing(probe, repeated_blocks(probe))
            if offload != "off":
                enable_activation_offload(probe)
            if offload == "off again":
                disable_activation_offload(probe)
            memory = SimulatedMemory(2**40, 0, probe.parameters())
            torch.manual_seed(2)  # the same dropout masks in every run
            with memory.context():
                loss = probe(input_ids=ids, labels=ids).loss
            loss.backward()
            results[offload] = (loss.detach(), [p.grad for p in probe.parameters()], memory.peak_bytes,
                                memory.host_peak_bytes, moved_bytes(probe))
            assert memory.saved_bytes == memory.host_bytes == 0  # all released after backward
        off, on, again = results["off"], results["on"], results["off again"]
        assert torch.equal(on[0], off[0]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
        assert on[2] < off[2] / 4 and on[3] > 0 and off[3] == 0
        assert again[2:] == off[2:]  # switched off: nothing moves
        if ac == "off":
            assert on[4] == expected
        else:
            assert 0 < on[4] < expected / 2


def test_model_state_stays_and_a_tensor_saved_twice_moves_once():
    """Under autocast (DDP's bf16) the weight's cast copy is model state and stays on the device;
    an activation that two operators save (one input of two layers) moves once."""
    from memtrain.levers.activation_offload import enable_activation_offload, moved_bytes

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)

        def forward(self, x):
            return self.a(x) + self.b(x)

    net = Two()
    enable_activation_offload(net)
    x = torch.randn(8, 256, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        net(x).float().sum().backward()
    assert moved_bytes(net) == 8 * 256 * 2  # x's bf16 copy, once; neither weight's
    net(x).sum().backward()  # fp32: x itself, saved by both layers
    assert moved_bytes(net) == 8 * 256 * 4


def test_the_planner_predicts_what_the_simulated_device_counts_and_what_moves(cache_dir):
    """The fake trace with the offload on (no memory used) against a real micro-batch of the same
    model on the simulated device: the device bytes equal what that device counts, and the bytes
    the plan moves are what the real hooks moved (never fewer; more by at most one mask per block); both with AC off and on. The trace of the
    whole micro-step (a GPU's count: transients, and each reload while its backward runs) also
    drops with the offload on."""
    from memtrain.levers.activation_offload import enable_activation_offload, moved_bytes
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.models import repeated_blocks
    from memtrain.planning.activations import activation_table, trace_batch
    from memtrain.memory.simulated import SimulatedMemory
    from memtrain.models import build_model
    from memtrain.objectives import make_objective
    from memtrain.plan import Plan

    args = TINY_ARGS + ["--data.cache_dir", cache_dir]
    cfg = parse_args(args + ["--faults.memory_budget_mib", "64"])
    corpus = build_corpus(cfg.data)
    model = build_model(cfg.model, corpus.vocab_size, 0)
    objective = make_objective(model, corpus)
    simulated = activation_table(cfg, corpus, objective, "fp32", "cpu")
    whole = activation_table(parse_args(args), corpus, objective, "fp32", "cpu")
    batch = trace_batch(corpus, 4)
    for ac in ("off", "on"):
        plan = lambda offload: Plan(4, 2, (("activation_checkpointing", ac), ("activation_offload", offload)))  # noqa: E731
        real = copy.deepcopy(model).train()
        if ac == "on":
            enable_activation_checkpointing(real, repeated_blocks(real))
        enable_activation_offload(real)
        memory = SimulatedMemory(2**40, 0, real.parameters())
        with memory.context():
            loss = objective.loss_sum(real, batch)
        assert simulated(plan("on")) == memory.peak_bytes
        # the trace also moves transformers' [B, 1, T, T] attention mask, which a real forward drops
        # (its all-causal check cannot run on fake tensors): over, never under
        moved = moved_bytes(real)
        masks = cfg.model.config["n_layer"] * 4 * 32 * 32 * 4  # one fp32 [4, 1, 32, 32] mask per block at most
        assert 0 < moved <= simulated.offloaded_bytes(plan("on")) <= moved + masks
        assert simulated(plan("on")) < simulated(plan("off")) and simulated.offloaded_bytes(plan("off")) == 0
        assert whole(plan("on")) < whole(plan("off"))
        del loss


def test_the_planner_charges_the_copies_a_cpu_run_cannot_time():
    """On a CPU run (host and device one memory) a probe of an offloading plan is charged its copies
    (2 × bytes moved per micro-batch at the stated rate), so the solver weighs them — a resumed
    run at its own rate; a GPU run's probes are taken as measured; ``memtrain plan``'s estimate
    adds them too."""
    from memtrain.planning.planner import Candidate, Planner, estimated_step_s
    from memtrain.plan import Plan

    def table(rate):
        plain = Candidate(Plan(4, 2, (("activation_offload", "off"),)), 10 * MiB, 8 * MiB)
        moving = Candidate(Plan(4, 2, (("activation_offload", "on"),)), 3 * MiB, 1 * MiB, offloaded_bytes=100 * MiB)
        planner = Planner([plain, moving], None, prober=lambda c, samples: samples / 8,  # a 1 s step
                          copy_bytes_per_s=rate)
        planner.measure([moving, plain])  # offloading first: timed after plain, it would be ruled out
        return plain, moving, planner

    plain, moving, planner = table(1e9)
    assert plain.measured_step_s == 1.0
    assert moving.measured_step_s == pytest.approx(1.0 + 2 * 2 * 100 * MiB / 1e9)
    assert planner.fastest(planner.fitting()) is plain
    plain, moving, planner = table(None)  # a GPU: the probe saw the copies
    assert moving.measured_step_s == 1.0
    no_copies = estimated_step_s(plain, 1000, 32, 1e12, 0.0, 1e-3)
    assert estimated_step_s(moving, 1000, 32, 1e12, 0.0, 1e-3, 2e9) == pytest.approx(no_copies + 2 * 2 * 100 * MiB / 2e9)
    plain, moving, planner = table(1e9)  # a resumed run with another bandwidth charges the copies at its own
    resumed = table(4e9)[2]
    resumed.load_state_dict(planner.state_dict())
    assert resumed.get(moving.plan).measured_step_s == pytest.approx(1.0 + 2 * 2 * 100 * MiB / 4e9)
    assert resumed.get(plain.plan).measured_step_s == 1.0
    older = planner.state_dict()  # a checkpoint from before: its times hold the charge, taken as they are
    del older["copies_apart"]
    older["candidates"] = [[*c[:2], moving.measured_step_s if c[0] == 4 and c[1]["activation_offload"] == "on"
                            else c[2], *c[3:]] for c in older["candidates"]]
    resumed = table(4e9)[2]
    resumed.load_state_dict(older)
    assert resumed.get(moving.plan).measured_step_s == pytest.approx(moving.measured_step_s)


def test_on_cuda_offloaded_activations_must_fit_the_hosts_room(monkeypatch):
    """A GPU run's offloaded activations wait in pinned host memory, which torch rounds up to a power
    of two per block: a plan moving more than half a rank's host room does not fit (every rank
    plans with the smallest room); the room is the available host memory shared by the
    machine's ranks, at most memory.host_memory_gib less their processes; the simulated device
    and a CPU run (one memory, counted by the device budget) have no separate room."""
    import psutil
    import torch

    from memtrain.config import parse_args
    from memtrain.memory.machine import offload_host_room_bytes
    from memtrain.planning.planner import Candidate, Planner
    from memtrain.plan import Plan

    small = Candidate(Plan(2, 4, (("activation_offload", "on"),)), 3 * MiB, 1 * MiB, offloaded_bytes=50 * MiB)
    large = Candidate(Plan(4, 2, (("activation_offload", "on"),)), 5 * MiB, 2 * MiB, offloaded_bytes=100 * MiB)
    planner = Planner([large, small], 8 * MiB)
    planner.restrict_budget(8 * MiB, 150 * MiB)
    assert planner.fitting() == [small] and planner.host_room_bytes == 150 * MiB
    planner.restrict_budget(8 * MiB, None)
    assert planner.fitting() == [large, small]

    cuda, cfg = torch.device("cuda"), parse_args([])
    assert offload_host_room_bytes(cfg, torch.device("cpu")) is None
    assert offload_host_room_bytes(parse_args(["--faults.memory_budget_mib", "64"]), cuda) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert 0 < offload_host_room_bytes(cfg, cuda) <= psutil.virtual_memory().available // 2 + 256 * MiB
    rss = psutil.Process().memory_info().rss
    capped = offload_host_room_bytes(parse_args(["--memory.host_memory_gib", str((2 * rss + 64 * MiB) / 2**30)]), cuda)
    assert capped == pytest.approx(32 * MiB, abs=16 * MiB)  # (the cap - 2 processes) / 2 ranks


def test_the_solver_turns_it_on_only_when_asked():
    """``memory.activation_offload``: on and off are what they say; auto is off, unless
    ``memory.levers auto`` lets the solver choose. A bandwidth that is not positive is refused,
    naming the field."""
    from memtrain.config import parse_args
    from memtrain.errors import ConfigError
    from memtrain.levers import lever
    from memtrain.validation import validate

    offload = lever("activation_offload")
    cfg = lambda value, levers="off": SimpleNamespace(memory=SimpleNamespace(activation_offload=value, levers=levers))  # noqa: E731
    assert offload.choices(cfg("auto"), None) == ("off",)
    assert offload.choices(cfg("auto", "auto"), None) == ("off", "on")
    assert offload.choices(cfg("on"), None) == ("on",) and offload.choices(cfg("off", "auto"), None) == ("off",)
    with pytest.raises(ConfigError, match="memory.activation_offload_bandwidth_gb_s"):
        validate(parse_args(TINY_ARGS + ["--memory.activation_offload_bandwidth_gb_s", "0"]), 1)
