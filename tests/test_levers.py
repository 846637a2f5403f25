"""Memory levers as data (memtrain/levers/): a lever is read generically by the planner, the plan
controller and plan events, so a new one needs no change there; the real levers take effect on
the model and are undone; a lever fixed when the engine was built refuses another setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import memtrain.levers as levers
from memtrain.config import MemoryConfig
from memtrain.levers import Lever, LeverCost, LeverTarget, apply_levers, lever, lever_choices
from memtrain.levers.base import ConfigField
from memtrain.memory.shape import ModelShape
from memtrain.memory.machine import Machine
from memtrain.planning.placement import Placement, _size
from memtrain.planning.planner import Planner, estimated_step_s, make_candidates
from memtrain.oom import OOMStop
from memtrain.plan import Plan, PlanController

MiB = 2**20


class HalveActivations(Lever):
    """A stand-in lever, registered only in these tests: halves a micro-batch's activation bytes."""

    name = "halve_activations"
    config_key = "memory.halve_activations"
    escalate_event = "halve_activations_on"
    config_fields = (ConfigField("halve_activations", "bool", False, "Halve each micro-batch's activations (a "
                                 "stand-in lever of the tests)."),)
    auto_words = "halved activations (when memory.halve_activations is false)"
    by_hand = "true"

    def choices(self, cfg, spec):
        return (False, True)

    def apply(self, target, setting):
        target.model.halved = setting


@pytest.fixture
def with_stand_in(monkeypatch):
    """The registry with the stand-in lever last; returns the registry without it."""
    registered = levers.LEVERS
    monkeypatch.setattr(levers, "LEVERS", registered + (HalveActivations(),))
    return registered


def cfg(ac: str = "auto", chunked: bool = False):
    """A config with the ``memory`` section's defaults (every lever's field, however many) but these."""
    return SimpleNamespace(memory=MemoryConfig(activation_checkpointing=ac, chunked_cross_entropy=chunked),
                           data=SimpleNamespace(kind="text"), optimizer=SimpleNamespace(state_dtype="fp32"))


def test_a_new_lever_is_planned_recovered_and_logged_without_other_changes(with_stand_in):
    """Registering one lever class: its choices join the run's, the planner's candidates cover
    every combination, the fastest fitting one is taken, recovery at the floor moves it, and plan
    events carry its setting."""
    choices = lever_choices(cfg("off"), None)
    with pytest.MonkeyPatch.context() as registry:  # the levers registered before it (however many)
        registry.setattr(levers, "LEVERS", with_stand_in)
        before = lever_choices(cfg("off"), None)
    assert before["activation_checkpointing"] == ("off",) and "halve_activations" not in before
    assert choices == {**before, "halve_activations": (False, True)}

    def acts(plan: Plan) -> int:
        return plan.micro_batch_size * MiB // (2 if plan.lever("halve_activations") else 1)

    candidates = make_candidates(4, choices, MiB, acts, "cpu", 3 * MiB)
    assert [(c.micro_batch_size, c.plan.lever("halve_activations")) for c in candidates] == [
        (m, h) for m in (4, 2, 1) for h in (False, True)]
    assert candidates[1].as_dict()["halve_activations"] is True
    seconds = {False: 1.0, True: 1.1}  # per micro-batch; halving costs a tenth more
    planner = Planner(candidates, 3 * MiB, lambda c, samples: seconds[c.plan.lever("halve_activations")] *
                      (samples // c.micro_batch_size))
    chosen = planner.initial()
    assert (chosen.micro_batch_size, chosen.plan.lever("halve_activations")) == (4, True)  # 3 MiB: 4 only halved

    first = {name: options[0] for name, options in choices.items()}
    ctl = PlanController(Plan(1, 4, tuple(first.items())), 4, 0, choices)
    change = ctl.on_oom("forward")
    assert change.event == "halve_activations_on" and change.as_dict()["halve_activations"] is True
    with pytest.raises(OOMStop):
        ctl.on_oom("forward")


def test_a_new_levers_config_field_help_and_docs_rows_are_written_from_its_declaration(with_stand_in, tmp_path,
                                                                                        monkeypatch):
    """The stand-in's declared field, rewritten into a copy of memtrain/config.py by the levers'
    generator, is a config key the command line parses (type and default as declared, its help
    line from its declaration), ``memory.levers``' help names it, and the resume table's and the
    README's rows list it; the repository's own files hold what the real levers declare."""
    import importlib.util
    import sys
    from pathlib import Path

    from memtrain.levers.generated import rewrites, stale

    repo = Path(__file__).resolve().parents[1]
    assert stale(repo) == ["memtrain/config.py", "docs/checkpoints.md", "README.md"]  # the stand-in is missing
    path = tmp_path / "rewritten_config.py"
    path.write_text(rewrites()["memtrain/config.py"]((repo / "memtrain/config.py").read_text()))
    spec = importlib.util.spec_from_file_location("rewritten_config", path)
    config = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rewritten_config", config)
    spec.loader.exec_module(config)
    assert config.MemoryConfig().halve_activations is False
    args = ["--model.config.model_type", "gpt2"]
    assert config.parse_args(args + ["--memory.halve_activations", "true"]).memory.halve_activations is True
    with pytest.raises(config.ConfigError, match="memory.halve_activations"):
        config.parse_args(args + ["--memory.halve_activations", "sometimes"])
    from memtrain.cli_help import field_docs

    docs = field_docs(config.Config)
    assert docs["memory.halve_activations"].startswith("Halve each micro-batch's activations")
    assert "halved activations (when memory.halve_activations is false)" in " ".join(docs["memory.levers"].split())
    checkpoints = rewrites()["docs/checkpoints.md"]((repo / "docs/checkpoints.md").read_text())
    readme = rewrites()["README.md"]((repo / "README.md").read_text())
    assert "`memory.halve_activations` | the plan restarts" in checkpoints
    assert "`--memory.halve_activations true`, … |" in readme
    monkeypatch.setattr(levers, "LEVERS", with_stand_in)
    assert stale(repo) == [], "python -m memtrain.levers rewrites them"


class PinBuffers(Lever):
    """A stand-in lever with costs the trace cannot see: ``on`` holds 1 MiB more on the device, a
    2 MiB pageable and a micro-batch × 1 MiB pinned host buffer, and a quarter second of copies
    per micro-batch where copies are charged."""

    name = "pin_buffers"
    config_key = "memory.pin_buffers"

    def choices(self, cfg, spec):
        return ("off", "on")

    def cost(self, setting, facts):
        if setting != "on":
            return LeverCost()
        seconds = facts.gradient_accumulation_steps * 0.25 if facts.copy_bytes_per_s else 0.0
        return LeverCost(device_bytes=MiB, host_bytes=2 * MiB, pinned_host_bytes=facts.micro_batch_size * MiB,
                         seconds=seconds)


def test_a_lever_declares_its_costs_and_every_prediction_counts_them(monkeypatch):
    """A lever's own :meth:`Lever.cost` reaches the planner's peak and host room, the FLOP
    estimate's and the CPU probe's seconds and the placement's device and host bytes, with no other
    change: each "on" candidate differs from its "off" twin by exactly the declared cost."""
    monkeypatch.setattr(levers, "LEVERS", levers.LEVERS + (PinBuffers(),))
    choices = {"pin_buffers": ("off", "on")}
    candidates = make_candidates(4, choices, MiB, lambda plan: plan.micro_batch_size * MiB, "cpu", None)
    pairs = [(off, on) for off, on in zip(candidates[::2], candidates[1::2])]
    assert [(off.micro_batch_size, on.plan.lever("pin_buffers")) for off, on in pairs] == [(4, "on"), (2, "on"), (1, "on")]
    for off, on in pairs:
        assert on.predicted_peak_bytes - off.predicted_peak_bytes == MiB
        extra = [estimated_step_s(c, 1000, 8, 1e9, 0.0, 1e-3, copy_bytes_per_s=1e9) for c in (off, on)]
        assert extra[1] - extra[0] == pytest.approx(0.25 * on.gradient_accumulation_steps)
        assert estimated_step_s(on, 1000, 8, 1e9, 0.0, 1e-3) == estimated_step_s(off, 1000, 8, 1e9, 0.0, 1e-3)
    planner = Planner(candidates, None, lambda c, samples: 1.0)
    planner.restrict_budget(None, host_room_bytes=2 * MiB + 2 * 2 * MiB)  # pinned blocks at twice their bytes
    assert [c.fits for c in candidates] == [True, False, True, True, True, True]
    shape = ModelShape(1000, largest_block=100, largest_module=100)
    for device_type in ("cpu", "cuda"):
        machine = Machine(None, None, 1, device_type, 1e12, 1e9, 0)
        sized = []
        for c in pairs[1]:
            p = Placement("ddp", None, "none")
            _size(p, c, shape, "fp32", 1, machine)
            sized.append(p)
        device = sized[1].device_bytes - sized[0].device_bytes  # on CUDA with the allocator's headroom
        assert device == MiB if device_type == "cpu" else MiB < device < 1.1 * MiB
        # a CPU run's device is host memory: its device MiB is host memory too
        assert sized[1].host_bytes - sized[0].host_bytes == (2 + 2) * MiB + (MiB if device_type == "cpu" else 0)


def test_activation_checkpointing_lever_wraps_and_unwraps_the_blocks():
    """The lever's setting takes effect on the model (blocks wrapped in checkpoint, selective with
    torch's selective-checkpoint context, the fault injector told) and switching it off restores
    the plain forward, with the same output."""
    from toy_models import make_stack

    from memtrain.levers.activation_checkpointing import selective_context
    from memtrain.models import repeated_blocks

    model = make_stack(32)
    blocks = repeated_blocks(model)
    faults = SimpleNamespace(keeps_one_block=False)
    target = LeverTarget(model, blocks, None, cfg("auto"), faults)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval()
    before = model(ids)
    apply_levers(target, {"activation_checkpointing": "on"})
    assert all(b._memtrain_checkpointed for b in blocks) and faults.keeps_one_block
    assert all("context_fn" not in b.forward.keywords for b in blocks)
    apply_levers(target, {"activation_checkpointing": "selective"})
    assert all(b.forward.keywords["context_fn"] is selective_context for b in blocks)
    assert not faults.keeps_one_block  # the injected-OOM model divides tokens only under full AC
    assert torch.equal(model(ids), before)
    apply_levers(target, {"activation_checkpointing": "off"})
    assert not any(b._memtrain_checkpointed for b in blocks) and not faults.keeps_one_block
    assert all("forward" not in b.__dict__ for b in blocks)
    assert torch.equal(model(ids), before)


def test_an_engine_lever_is_fixed_when_the_engine_is_built():
    """FSDP2's resharding is a lever of FSDP runs only, and a plan cannot change it after the build."""
    spec = SimpleNamespace(name="fsdp", reshard_after_forward=True)
    assert lever_choices(cfg(), spec)["reshard_after_forward"] == (True,)
    assert lever_choices(cfg(), spec)["optimizer_state_dtype"] == ("fp32",)
    assert "reshard_after_forward" not in lever_choices(cfg(), SimpleNamespace(name="ddp"))
    target = LeverTarget(torch.nn.Linear(1, 1), [], None, cfg(), built={"reshard_after_forward": True})
    lever("reshard_after_forward").apply(target, True)
    with pytest.raises(RuntimeError, match="backend.reshard_after_forward is fixed"):
        lever("reshard_after_forward").apply(target, False)


def test_zero3_refuses_selective_checkpointing_and_the_solver_leaves_it_out():
    """DeepSpeed ZeRO-3 gathers parameters inside a block, differently in the forward and in the
    recompute, which torch's selective checkpointing refuses at run time: asked for, it is a config
    error naming the field; under ``memory.levers auto`` it is not offered; FSDP2 keeps it."""
    from memtrain.errors import ConfigError

    zero3 = SimpleNamespace(name="deepspeed", zero_stage=3, deepspeed_config=None)
    solver = cfg("auto")
    solver.memory.levers = "auto"
    ac = levers.lever("activation_checkpointing")
    with pytest.raises(ConfigError, match="'memory.activation_checkpointing'.*ZeRO-3"):
        ac.choices(cfg("selective"), zero3)
    assert ac.choices(solver, zero3) == ("off", "on")
    assert ac.choices(solver, SimpleNamespace(name="fsdp")) == ("off", "selective", "on")
    # memtrain plan offers the model levers as the configured engine takes them
    solver.model = SimpleNamespace(kind="gpt2")
    assert lever_choices(solver, zero3, model_only=True)["activation_checkpointing"] == ("off", "on")
    assert "optimizer_state_dtype" not in lever_choices(solver, zero3, model_only=True)
    # a ZeRO-3 placement of another engine's config (the placement table) drops selective too
    fsdp_choices = lever_choices(solver, SimpleNamespace(name="fsdp"), model_only=True)
    assert levers.allowed_by(fsdp_choices, solver, zero3) == {**fsdp_choices, "activation_checkpointing": ("off", "on")}
    asked = cfg("selective")
    asked.model = solver.model
    assert levers.allowed_by({"activation_checkpointing": ("selective",)}, asked, zero3) == {
        "activation_checkpointing": ("selective",)}  # the config's own ask: its run names the field
