"""In-process tests of the micro-batch plan and its controller (memtrain/plan.py): pure state
machines, so every rule is checked here without launching ranks."""

from __future__ import annotations

import pytest
import torch

from memtrain.oom import OOMStop
from memtrain.levers.activation_checkpointing import CHOICES
from memtrain.plan import Plan, PlanController


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def controller(per_rank: int = 12, micro: int | None = None, ac: str = "auto", window: int = 2) -> PlanController:
    micro = per_rank if micro is None else micro
    choices = {"activation_checkpointing": CHOICES[ac]}
    configured = Plan(micro, per_rank // micro, (("activation_checkpointing", CHOICES[ac][0]),))
    return PlanController(configured, per_rank, window, choices)


def succeed(ctl: PlanController, n: int) -> list:
    """``n`` successful steps; the changes ``on_success`` returned (None for none)."""
    return [ctl.on_success() for _ in range(n)]


def shrink_to(ctl: PlanController, micro: int) -> None:
    while ctl.plan.micro_batch_size > micro:
        ctl.on_oom("forward")
    assert ctl.plan.micro_batch_size == micro


# -- Plan --------------------------------------------------------------------------

def test_for_global_batch_builds_plan_covering_global_batch():
    """for_global_batch: micro × accumulation × world_size equals the global batch."""
    plan = Plan.for_global_batch(24, 3, 2)
    assert plan.sizes == (3, 4)
    assert plan.micro_batch_size * plan.gradient_accumulation_steps * 2 == 24


@pytest.mark.parametrize("global_batch, micro, world", [(24, 5, 2), (25, 1, 2)])
def test_for_global_batch_divisibility_error_names_numbers(global_batch, micro, world):
    """for_global_batch refuses a global batch not divisible by micro × world, naming all three."""
    with pytest.raises(ValueError) as info:
        Plan.for_global_batch(global_batch, micro, world)
    message = str(info.value)
    assert f"global_batch_size {global_batch}" in message
    assert f"{micro} × {world}" in message


def test_split_returns_ordered_micro_batches_covering_the_rank_batch():
    """split cuts every tensor into accumulation micro-batches of micro rows, in order, covering it."""
    plan = Plan(3, 4)
    batch = {"input_ids": torch.arange(24).reshape(12, 2), "labels": torch.arange(12) * 10}
    parts = plan.split(batch)
    assert len(parts) == plan.gradient_accumulation_steps
    for part in parts:
        assert set(part) == set(batch)
        assert all(v.shape[0] == plan.micro_batch_size for v in part.values())
    for key, value in batch.items():
        assert torch.equal(torch.cat([p[key] for p in parts]), value)


def test_split_refuses_mismatched_batch():
    """split raises ValueError when the batch's leading dimension is not micro × accumulation."""
    with pytest.raises(ValueError, match="11 samples"):
        Plan(3, 4).split({"input_ids": torch.zeros(11, 2)})


# -- shrinking on OOM ------------------------------------------------------------------------

def test_on_oom_halves_to_largest_divisor_at_most_half():
    """Each OOM picks the largest divisor of the per-rank batch at most half the micro-batch (12→6→3→1)."""
    per_rank = 12
    ctl = controller(per_rank)
    seen = [ctl.plan.micro_batch_size]
    while ctl.plan.micro_batch_size > 1:
        old = ctl.plan
        change = ctl.on_oom("backward")
        expected = max(d for d in divisors(per_rank) if d <= old.micro_batch_size // 2)
        assert change.event == "oom_shrink" and change.old == old and change.new == ctl.plan
        assert ctl.plan.micro_batch_size == expected
        assert ctl.plan.micro_batch_size * ctl.plan.gradient_accumulation_steps == per_rank
        seen.append(ctl.plan.micro_batch_size)
    assert seen == [12, 6, 3, 1]


def test_on_oom_at_micro_one_with_auto_turns_on_activation_checkpointing_then_stops():
    """With activation_checkpointing auto, micro-batch 1 first turns AC on (same plan); the next OOM stops."""
    ctl = controller(12, ac="auto")
    shrink_to(ctl, 1)
    assert ctl.plan.lever("activation_checkpointing") == "off"
    change = ctl.on_oom("forward")
    assert change.event == "activation_checkpointing_on"
    assert change.old.sizes == change.new.sizes == (1, 12)
    assert change.old.lever("activation_checkpointing") == "off" and change.new.lever("activation_checkpointing") == "on"
    assert ctl.plan.lever("activation_checkpointing") == "on"
    with pytest.raises(OOMStop, match="activation checkpointing on"):
        ctl.on_oom("forward")


def test_on_oom_at_micro_one_with_off_stops_directly():
    """With activation_checkpointing off, an OOM at micro-batch 1 raises OOMStop without turning AC on."""
    ctl = controller(12, ac="off")
    shrink_to(ctl, 1)
    with pytest.raises(OOMStop, match="activation_checkpointing is off"):
        ctl.on_oom("forward")
    assert ctl.plan.lever("activation_checkpointing") == "off"


@pytest.mark.parametrize("ac", ["on", "selective"])
def test_on_oom_at_micro_one_with_on_stops_directly(ac):
    """With activation_checkpointing on (or selective) from the start, an OOM at micro-batch 1
    raises OOMStop at once, naming the setting."""
    ctl = controller(12, ac=ac)
    assert ctl.plan.lever("activation_checkpointing") == ac
    shrink_to(ctl, 1)
    with pytest.raises(OOMStop, match=f"with {'selective ' if ac == 'selective' else ''}activation checkpointing on"):
        ctl.on_oom("forward")


def test_on_oom_shrinks_from_a_smaller_tried_plan():
    """An OOM of a smaller (capped) plan shrinks from that plan, not from the controller's."""
    ctl = controller(12)
    change = ctl.on_oom("forward", tried=ctl.plan.with_micro_batch(4))
    assert change.old.sizes == (4, 3)
    assert ctl.plan.sizes == (2, 6)


# -- growing back ----------------------------------------------------------------------------

def test_grow_back_after_window_to_next_divisor_at_least_double():
    """After grow_back_window successes the plan grows to the smallest divisor >= 2× (never above configured)."""
    per_rank, window = 12, 2
    ctl = controller(per_rank, window=window)
    shrink_to(ctl, 1)
    sizes = [1]
    while ctl.plan.micro_batch_size < per_rank:
        old = ctl.plan
        changes = succeed(ctl, window)
        assert changes[:-1] == [None] * (window - 1)
        grow = changes[-1]
        expected = min(d for d in divisors(per_rank) if d >= 2 * old.micro_batch_size)
        assert grow.event == "grow_back" and grow.old == old and grow.new == ctl.plan
        assert ctl.plan.sizes == (expected, per_rank // expected)
        sizes.append(expected)
    assert sizes == [1, 2, 4, 12]
    assert succeed(ctl, 3 * window) == [None] * (3 * window)  # at the configured plan: no further growth
    assert ctl.plan.sizes == (12, 1)


def test_grow_back_never_exceeds_configured_micro_batch():
    """Grow-back stops at the configured micro-batch even when larger divisors exist."""
    ctl = controller(12, micro=4, window=1)
    shrink_to(ctl, 1)
    while succeed(ctl, 1)[0] is not None:
        assert ctl.plan.micro_batch_size <= 4
    assert ctl.plan.sizes == (4, 3)
    assert succeed(ctl, 5) == [None] * 5


def test_grow_back_failure_backs_off_and_doubles_window():
    """An OOM on the grown plan returns grow_back_failed, restores the previous plan and doubles the window."""
    window = 2
    ctl = controller(12, window=window)
    shrink_to(ctl, 1)
    before = ctl.plan
    grow = succeed(ctl, window)[-1]
    assert grow.event == "grow_back"
    change = ctl.on_oom("forward")
    assert change.event == "grow_back_failed"
    assert change.old == grow.new and change.new == before and ctl.plan == before
    assert ctl.window == 2 * window
    changes = succeed(ctl, 2 * window)
    assert changes[:-1] == [None] * (2 * window - 1)  # the old window is not enough any more
    assert changes[-1].event == "grow_back"


def test_grow_back_failure_restores_the_plan_that_worked_when_divisors_lie_between():
    """A failed grow-back 3→6 (per-rank 12) backs off to 3, not to the untried divisor 4 between them."""
    ctl = controller(12, window=1)
    shrink_to(ctl, 3)
    grow = succeed(ctl, 1)[0]
    assert grow.new.micro_batch_size == 6
    change = ctl.on_oom("forward")
    assert change.event == "grow_back_failed"
    assert ctl.plan.sizes == (3, 4)


def test_success_after_grow_back_ends_the_trial():
    """A success on the grown plan ends the trial: a later OOM is an ordinary shrink and the window stays."""
    window = 2
    ctl = controller(12, window=window)
    shrink_to(ctl, 1)
    grow = succeed(ctl, window)[-1]
    assert grow.event == "grow_back"
    assert succeed(ctl, 1) == [None]  # the grown plan fits
    change = ctl.on_oom("forward")
    assert change.event == "oom_shrink" and change.old == grow.new
    assert ctl.window == window


def test_grow_back_window_zero_never_grows():
    """grow_back_window 0 keeps the shrunk plan however many steps succeed."""
    ctl = controller(12, window=0)
    shrink_to(ctl, 3)
    assert succeed(ctl, 50) == [None] * 50
    assert ctl.plan.sizes == (3, 4)


# -- capped plans ----------------------------------------------------------------------------

def test_capped_largest_divisor_fitting_the_budget():
    """capped picks the largest divisor <= current micro with micro × longest <= budget, without changing the plan."""
    per_rank, longest, budget = 12, 100, 450
    ctl = controller(per_rank)
    plan = ctl.capped(longest, budget)
    expected = max(d for d in divisors(per_rank) if d * longest <= budget)
    assert plan.sizes == (expected, per_rank // expected)
    assert plan.micro_batch_size * longest <= budget
    assert ctl.plan.sizes == (12, 1)


def test_capped_never_above_current_plan_and_at_least_one():
    """capped never exceeds the current micro-batch, and falls back to 1 when even one sample exceeds the budget."""
    ctl = controller(12)
    shrink_to(ctl, 3)
    assert ctl.capped(1, 10**9).sizes == (3, 4)
    assert ctl.capped(1000, 10).sizes == (1, 12)


# -- state -----------------------------------------------------------------------------------

def test_state_dict_round_trip():
    """load_state_dict restores plan, window, ok_steps and activation_checkpointing; the copy behaves alike."""
    ctl = controller(12, ac="auto", window=3)
    shrink_to(ctl, 1)
    ctl.on_oom("forward")  # activation checkpointing on
    succeed(ctl, 3)  # grow 1 → 2
    ctl.on_oom("forward")  # grow-back failed: window 6
    succeed(ctl, 2)
    state = ctl.state_dict()
    assert state == {"micro_batch_size": 1, "window": 6, "ok_steps": 2, "levers": {"activation_checkpointing": "on"},
                     "trying_grow": False, "grown_from": 1, "grown_from_levers": {"activation_checkpointing": "on"},
                     "planner": None}

    restored = controller(12, ac="auto", window=3)
    restored.load_state_dict(state)
    assert restored.plan == ctl.plan
    assert restored.state_dict() == state
    assert succeed(restored, 3) == [None] * 3  # 2 + 3 = 5 < 6
    assert succeed(restored, 1)[0].event == "grow_back"


def test_state_saved_during_a_grow_back_try_keeps_the_try():
    """A checkpoint taken at the step that announced a grow-back resumes inside that try: an OOM
    then is a failed grow-back (back to the plan that worked, window doubled), as without the stop."""
    ctl = controller(12, window=2)
    shrink_to(ctl, 3)
    assert succeed(ctl, 2)[1].event == "grow_back"
    restored = controller(12, window=2)
    restored.load_state_dict(ctl.state_dict())
    for c in (ctl, restored):
        change = c.on_oom("forward")
        assert change.event == "grow_back_failed" and c.plan.sizes == (3, 4) and c.window == 4


def test_load_state_dict_at_another_per_rank_batch():
    """Loading a state saved at another per-rank batch takes the largest divisor at most the saved micro-batch."""
    saved = controller(12, window=2)
    saved.on_oom("forward")  # 12 → 6
    state = saved.state_dict()
    assert state["micro_batch_size"] == 6
    ctl = controller(8, window=2)
    ctl.load_state_dict(state)
    expected = max(d for d in divisors(8) if d <= 6)
    assert ctl.plan.sizes == (expected, 8 // expected)


def run_events(ctl: PlanController, events: str) -> list:
    """Feed ``o`` (OOM) / ``s`` (success) events; the changes, and ``stop`` where OOMStop ended it."""
    out = []
    for e in events:
        try:
            change = ctl.on_oom("another rank") if e == "o" else ctl.on_success()
        except OOMStop:
            out.append("stop")
            break
        out.append(change.as_dict() if change else None)
    return out


def test_same_events_give_same_state():
    """Two controllers fed the same events return the same changes and end in the same state."""
    events = "osssoss" + "s" * 6 + "o" + "s" * 9 + "oooso" + "s" * 4 + "oooo"
    a, b = controller(24, window=2), controller(24, window=2)
    changes = run_events(a, events)
    assert changes == run_events(b, events)
    kinds = {c["event"] for c in changes if isinstance(c, dict)}
    assert kinds == {"oom_shrink", "grow_back", "grow_back_failed", "activation_checkpointing_on"}
    assert changes[-1] == "stop"
    assert a.state_dict() == b.state_dict() and a.plan == b.plan and a.trying_grow == b.trying_grow


# -- levers ------------------------------------------------------------------------------------

def two_lever_controller(ac: str = "auto") -> PlanController:
    choices = {"activation_checkpointing": CHOICES[ac], "chunked_cross_entropy": (False,)}
    configured = Plan(4, 1, tuple((name, options[0]) for name, options in choices.items()))
    return PlanController(configured, 4, 2, choices)


def test_a_plan_is_one_frozen_hashable_value_holding_its_levers():
    """The plan carries the lever settings; changing the micro-batch keeps them; it is immutable."""
    plan = Plan(4, 2, (("activation_checkpointing", "on"),))
    assert plan.with_micro_batch(2) == Plan(2, 4, (("activation_checkpointing", "on"),))
    assert plan.with_levers(activation_checkpointing="off").lever("activation_checkpointing") == "off"
    assert {plan: 1}[Plan(4, 2, (("activation_checkpointing", "on"),))] == 1
    assert plan.describe() == "4×2 + AC" and str(plan) == "4×2"
    assert plan.with_levers(activation_checkpointing="selective").describe() == "4×2 + selective AC"
    with pytest.raises(AttributeError):
        plan.micro_batch_size = 1


def test_the_floor_moves_levers_generically_and_the_stop_names_each_lever():
    """At micro-batch 1 the first lever with a memory-saving choice left moves (here AC; chunked
    cross-entropy has one choice); the stop message then names both levers' state."""
    ctl = two_lever_controller("auto")
    shrink_to(ctl, 1)
    change = ctl.on_oom("forward")
    assert change.event == "activation_checkpointing_on"
    assert change.as_dict()["activation_checkpointing"] == "on" and change.as_dict()["chunked_cross_entropy"] is False
    with pytest.raises(OOMStop, match="activation checkpointing on.*chunked_cross_entropy is off"):
        ctl.on_oom("forward")


def test_checkpoints_from_before_levers_resume_their_activation_checkpointing():
    """A plan state of the format before levers (``activation_checkpointing`` / ``grown_from_ac``
    bools), and one of levers whose AC setting was a bool, restore AC as ``on``; a saved setting
    this run may not take falls back to the configured one."""
    old = {"micro_batch_size": 2, "window": 4, "ok_steps": 1, "activation_checkpointing": True,
           "trying_grow": False, "grown_from": 2, "grown_from_ac": True, "planner": None}
    bool_levers = {"micro_batch_size": 2, "window": 4, "ok_steps": 1, "levers": {"activation_checkpointing": True},
                   "trying_grow": False, "grown_from": 2, "grown_from_levers": {"activation_checkpointing": True},
                   "planner": None}
    for state in (old, bool_levers):
        ctl = two_lever_controller("auto")
        ctl.load_state_dict(state)
        assert ctl.plan == Plan(2, 2, (("activation_checkpointing", "on"), ("chunked_cross_entropy", False)))
        assert ctl.grown_from == ctl.plan and ctl.window == 4
    off = two_lever_controller("off")
    off.load_state_dict(old)
    assert off.plan.lever("activation_checkpointing") == "off" and off.plan.sizes == (2, 2)


def test_the_floor_under_levers_auto_names_each_move():
    """``memory.levers auto`` at micro-batch 1: AC goes off → selective → on, then chunked
    cross-entropy turns on, each change named by what it moved to; then the run stops."""
    from memtrain.levers.activation_checkpointing import SOLVER_CHOICES

    choices = {"activation_checkpointing": SOLVER_CHOICES, "chunked_cross_entropy": (False, True)}
    ctl = PlanController(Plan(1, 4, (("activation_checkpointing", "off"), ("chunked_cross_entropy", False))), 4, 2,
                         choices)
    events = [ctl.on_oom("forward").event for _ in range(3)]
    assert events == ["activation_checkpointing_selective", "activation_checkpointing_on", "chunked_cross_entropy_on"]
    assert ctl.plan.settings() == {"activation_checkpointing": "on", "chunked_cross_entropy": True}
    with pytest.raises(OOMStop):
        ctl.on_oom("forward")
