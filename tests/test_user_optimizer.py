"""A Python caller's own optimizer and LR schedule (``Trainer(optimizer_factory=...,
scheduler_factory=...)``): the schedule's rates step by step, a resume bitwise, the planner
counting the optimizer's own state, and engines that cannot take it refused by name."""

import json

import pytest
import torch

import memtrain
from memtrain.errors import ConfigError
from memtrain.optim import state_bytes_per_element

EXAMPLES = [{"x": torch.full((4,), float(i % 7) / 7)} for i in range(64)]
N_PARAMS = 4 * 3 + 3  # the Linear(4, 3) below


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def trainer(out, max_steps=6, **factories):
    settings = {"output_dir": str(out), "training": {"global_batch_size": 8, "micro_batch_size": "auto",
                                                     "max_steps": max_steps, "eval_every": 0},
                "checkpoint": {"every_steps": 3}}
    return memtrain.Trainer(settings, model=lambda: torch.nn.Linear(4, 3), train_dataset=EXAMPLES,
                            objective=lambda m, mb: m(mb["x"]).pow(2).sum(), **factories)


def test_the_optimizers_own_state_is_counted_per_element():
    """Counted from the tensors the optimizer keeps (torch's documented state): SGD with momentum
    one buffer, without none, AdamW two moments, Adagrad one sum."""
    assert state_bytes_per_element(lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)) == 4
    assert state_bytes_per_element(lambda g: torch.optim.SGD(g, lr=0.1)) == 0
    assert state_bytes_per_element(lambda g: torch.optim.AdamW(g, lr=0.1)) == 8
    assert state_bytes_per_element(lambda g: torch.optim.Adagrad(g, lr=0.1)) == 4


def test_sgd_and_step_lr_from_the_factories_train_resume_bitwise_and_are_planned(tmp_path, caplog):
    """The rates are StepLR's (0.05 halved every 2 optimizer steps), one per optimizer step; the
    run stopped at step 3 and rerun to 6 gives the uninterrupted run's losses bitwise; the
    planner's table counts SGD's one buffer where AdamW holds two (4 bytes a parameter less)."""
    whole = trainer(tmp_path / "whole", optimizer_factory=sgd, scheduler_factory=step_lr).fit().records
    assert [r["lr"] for r in whole] == [0.05 * 0.5 ** (i // 2) for i in range(6)]
    trainer(tmp_path / "cut", max_steps=3, optimizer_factory=sgd, scheduler_factory=step_lr).fit()
    resumed = trainer(tmp_path / "cut", optimizer_factory=sgd, scheduler_factory=step_lr).fit().records
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert "training.max_steps 3 → 6 (the scheduler_factory's schedule carries on from its saved state)" in caplog.text
    assert [(r["loss"], r["lr"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["lr"], r["grad_norm"])
                                                                       for r in whole[3:]]
    adamw = trainer(tmp_path / "adamw", max_steps=1).fit().records
    assert adamw[0]["lr"] != whole[0]["lr"]  # memtrain's own AdamW and warmup

    def table(out):
        rows = json.loads((out / "plan.json").read_text())["candidates"]
        return {(r["micro_batch_size"], r["activation_checkpointing"]): r["predicted_peak_bytes"] for r in rows}

    mine, theirs = table(tmp_path / "whole"), table(tmp_path / "adamw")
    assert mine.keys() == theirs.keys() and all(theirs[k] - mine[k] == 4 * N_PARAMS for k in mine)


@pytest.mark.parametrize("setting, field, why", [
    ({"backend": {"name": "deepspeed"}}, "backend.name", "DeepSpeed's CPU Adam"),
    ({"backend": {"name": "fsdp", "offload": "optimizer"}}, "backend.offload", "steps its own AdamW on the host"),
    ({"optimizer": {"state_dtype": "bf16"}}, "optimizer.state_dtype", ""),
])
def test_an_engine_or_setting_that_cannot_take_the_users_optimizer_is_refused_by_name(tmp_path, setting, field, why):
    """Refused by the field, with the engine's own words for the optimizer it steps instead."""
    with pytest.raises(ConfigError) as refused:
        memtrain.Trainer({"output_dir": str(tmp_path / "x"), **setting}, model=lambda: torch.nn.Linear(4, 3),
                         train_dataset=EXAMPLES, objective=lambda m, mb: m(mb["x"]).sum(), optimizer_factory=sgd)
    assert refused.value.field == field and "optimizer_factory" in str(refused.value) and why in str(refused.value)
    assert not (tmp_path / "x").exists()


def test_under_fsdp2_the_factory_steps_the_shards_as_ddp_steps_the_whole(tmp_path):
    """FSDP2 hands the factory DTensor shards: SGD and StepLR on them train as on DDP's parameters."""
    def run(engine):
        settings = {"output_dir": str(tmp_path / engine), "precision": "fp32", "backend": {"name": engine},
                    "training": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 4, "eval_every": 0},
                    "checkpoint": {"every_steps": 0}}
        return memtrain.Trainer(settings, model=lambda: torch.nn.Linear(4, 3), train_dataset=EXAMPLES,
                                objective=lambda m, mb: m(mb["x"]).pow(2).sum(), optimizer_factory=sgd,
                                scheduler_factory=step_lr).fit().records

    fsdp, ddp = run("fsdp"), run("ddp")
    assert [r["lr"] for r in fsdp] == [r["lr"] for r in ddp] == [0.05, 0.05, 0.025, 0.025]
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in ddp], rel=1e-5)


def test_a_scheduler_that_steps_on_a_metric_is_refused_before_anything_is_written(tmp_path):
    """ReduceLROnPlateau's ``step(metrics)`` cannot be stepped once per optimizer step: refused by
    the field, naming what its step needs, with no run folder left behind."""
    plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # noqa: E731
    with pytest.raises(ConfigError) as refused:
        trainer(tmp_path / "x", optimizer_factory=sgd, scheduler_factory=plateau).fit()
    assert refused.value.field == "scheduler_factory" and "ReduceLROnPlateau, whose step() needs metrics" in str(
        refused.value)
    assert not (tmp_path / "x").exists()
