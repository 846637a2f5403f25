"""The planner in-process: its decisions from a candidate table (no ranks needed), the fake-tensor
trace against the bytes a real forward saves, and the plan controller driven by a planner."""

import json

import pytest

from conftest import TINY_ARGS
from memtrain.levers.activation_checkpointing import CHOICES, setting
from memtrain.plan import Plan, PlanController
from memtrain.planning.planner import (PROBE_BUDGET_STEPS, PROBE_MIN_STEPS, PROBE_RUN_FRACTION, Candidate, Planner,
                                      make_candidates, probe_budget_steps)
from memtrain.oom import OOMStop

MiB = 2**20


def P(micro: int, ac, per_rank: int = 8) -> Plan:
    """The plan of micro-batch ``micro`` with activation checkpointing ``ac`` (a setting, or a
    bool: on/off)."""
    return Plan(micro, per_rank // micro, (("activation_checkpointing", setting(ac)),))


def key(c: Candidate) -> tuple[int, bool]:
    """``(micro-batch, AC on)``."""
    return c.micro_batch_size, c.plan.lever("activation_checkpointing") == "on"


def AC(mode: str) -> dict:
    """The lever choices of ``memory.activation_checkpointing MODE``."""
    return {"activation_checkpointing": CHOICES[mode]}


def by_ac(f):
    """``f(micro, ac)`` as the planner's ``plan -> bytes``."""
    return lambda plan: f(plan.micro_batch_size, plan.lever("activation_checkpointing") == "on")


def controller(micro: int, per_rank: int, mode: str, window: int, planner) -> PlanController:
    return PlanController(P(micro, CHOICES[mode][0], per_rank), per_rank, window, AC(mode), make_planner=lambda: planner)


def table(budget=None):
    """Per-rank share 8; activations 1 MiB per sample without AC, 0.25 MiB with; state 1 MiB."""
    return make_candidates(8, AC("auto"), MiB, by_ac(lambda micro, ac: micro * MiB // (4 if ac else 1)), "cpu", budget)


def timed(seconds: dict):
    """A prober returning the seconds of the samples it is asked to time (micro-batches ×
    micro-batch seconds) per (micro, ac), recording the calls and the samples asked."""
    calls = []

    def prober(c: Candidate, samples: int):
        calls.append(key(c))
        prober.samples.append(samples)
        return None if key(c) not in seconds else seconds[key(c)] * (samples // c.micro_batch_size)

    prober.calls, prober.samples = calls, []
    return prober


# micro-batch seconds: big micro-batches are more efficient; AC costs a quarter more. Step seconds
# (accumulation × micro) and predicted peaks (MiB) of the table:
#   8 off 0.9 / 9    8 AC 1.125 / 3    4 off 1.0 / 5    4 AC 1.25 / 2
#   2 off 1.2 / 3    2 AC 1.5 / 1.5    1 off 1.6 / 2    1 AC 2.0 / 1.25
SECONDS = {(m, ac): (0.1 + 0.1 * m) * (1.25 if ac else 1) for m in (1, 2, 4, 8) for ac in (False, True)}


def test_candidates_and_predicted_fit():
    cands = table(budget=4 * MiB)
    assert [key(c) for c in cands] == [
        (8, False), (8, True), (4, False), (4, True), (2, False), (2, True), (1, False), (1, True)]
    assert all(c.micro_batch_size * c.gradient_accumulation_steps == 8 for c in cands)
    assert {key(c) for c in cands if c.fits} == {(8, True), (4, True), (2, False), (2, True), (1, False), (1, True)}


def test_initial_times_every_fitting_candidate_a_faster_setting_does_not_rule_out_and_takes_the_fastest():
    planner = Planner(table(budget=4 * MiB), 4 * MiB, timed(SECONDS))
    chosen = planner.initial()
    assert key(chosen) == (8, True) and chosen.chosen and chosen.measured_step_s == pytest.approx(1.125)
    # the first candidate is probed twice (the process's cold first step), every fitting one once
    # except (2, AC) and (1, AC): AC off fits at their micro-batch, so AC on cannot be faster;
    # then, fastest first, each within 1.5× of the fastest (1.6875 s) once more, then each
    # within 1.25× (1.406 s) a third time
    calls = planner.prober.calls
    assert calls[0] == calls[1] == (8, True)
    assert calls[1:5] == [(8, True), (4, True), (2, False), (1, False)]
    assert calls[5:] == [(8, True), (2, False), (4, True), (1, False), (8, True), (2, False), (4, True)]
    assert sum(c.chosen for c in planner.candidates) == 1
    assert planner.probes[0] == len(calls)
    # the same table when AC off at micro-batch 2 runs out of memory in its probe: AC on is timed then
    oom = Planner(table(budget=4 * MiB), 4 * MiB, timed({k: v for k, v in SECONDS.items() if k != (2, False)}))
    oom.initial()
    assert (2, True) in oom.prober.calls and (1, True) not in oom.prober.calls


def test_one_choice_probes_within_its_budget_of_step_times_the_same_on_every_rank():
    """A probe that is a whole step (the largest fitting plan is the rank batch) costs two step
    times (its two runs): within a budget of 6 step times the first plan's warm-up and probe and
    one more plan are timed, and the choice is among them; an OOM's choice gets a budget of its
    own. The spending is counted from the agreed seconds the prober returns, never a rank's clock."""
    planner = Planner(table(), None, timed(SECONDS), probe_budget_steps=6)
    chosen = planner.initial()  # (8, off) 0.9 s: warm-up 1.8 + probe 1.8; (4, off) 2.0: 5.6 >= 6 × 0.9
    assert planner.prober.calls == [(8, False), (8, False), (4, False)]  # (8, AC) and (4, AC): AC off fits
    assert key(chosen) == (8, False) and planner.probes == (3, pytest.approx(2 * (0.9 + 0.9 + 1.0)))
    planner.prober.calls.clear()
    nxt = planner.after_oom(P(8, False))  # a budget of its own: 6 × 1.0 s ((4, off), the fastest that fits)
    assert planner.prober.calls == [(8, True), (2, False), (1, False)]  # 2.25 + 2.4 + 3.2 s, then no re-time
    assert key(nxt) == (4, False) and planner.probes == (3, pytest.approx(2 * (1.125 + 1.2 + 1.6)))
    unbounded = Planner(table(), None, timed(SECONDS))
    unbounded.initial()
    assert len(unbounded.prober.calls) == 1 + 4 + 3 + 2  # warm-up, 4 not ruled out, 3 within 1.5×, 2 within 1.25×
    assert probe_budget_steps(3) == PROBE_MIN_STEPS and probe_budget_steps(10**6) == PROBE_BUDGET_STEPS
    assert probe_budget_steps(200) == 200 * PROBE_RUN_FRACTION


def test_a_probe_times_one_micro_batch_of_the_largest_fitting_plan_and_scales_to_the_step():
    """When the largest plan that fits accumulates, a probe is part of a step: every candidate is
    timed on the same samples, one micro-batch of that plan (here 2 of the rank's 8), and its
    time scaled to the whole rank batch is the step's (micro-batches × micro-batch seconds)."""
    cands = make_candidates(8, AC("off"), MiB, by_ac(lambda micro, ac: micro * MiB), "cpu", 3 * MiB)
    planner = Planner(cands, 3 * MiB, timed(SECONDS))
    assert key(planner.initial()) == (2, False)
    assert set(planner.prober.samples) == {2} and set(planner.prober.calls) == {(2, False), (1, False)}
    for m in (2, 1):
        assert planner.get(P(m, False)).measured_step_s == pytest.approx(SECONDS[(m, False)] * 8 / m)
    everything = Planner(table(), None, timed(SECONDS))  # the largest fitting plan is the rank batch
    everything.initial()
    assert set(everything.prober.samples) == {8}


def test_the_first_probe_is_a_warm_up_whose_time_is_not_kept():
    """A cold first step (allocator, engine set-up) must not make the first candidate look slow:
    the better of its two probes counts."""
    seconds = iter([10.0, 1.0, 1.2, 1.1, 1.3, 1.1, 1.3])  # cold, then warm: (8, AC) is the faster plan

    def prober(c, samples):
        return next(seconds)

    planner = Planner(table()[1::2][:2], None, prober)  # (8, AC) and (4, AC)
    assert key(planner.initial()) == (8, True)


def test_contenders_are_timed_again_and_keep_their_best_time():
    """One noisy probe must not decide a close race: each candidate within 1.5× of the fastest is
    probed once more and keeps its best time, so a plan that was slow once by chance still wins;
    one further off is not probed again."""
    seconds = iter([1.0, 1.0, 1.6, 1.2, 1.3, 0.9, 0.95, 1.1])  # (8, AC): warm-up, 1.0; (4, AC) 1.6,
    # (2, AC) 1.2; the two within 1.5× again: (8, AC) 1.3, (2, AC) 0.9; within 1.25× a third time
    planner = Planner(table()[1::2][:3], None, lambda c, samples: next(seconds))  # (8, AC), (4, AC), (2, AC)
    chosen = planner.initial()
    assert key(chosen) == (2, True) and chosen.measured_step_s == 0.9  # 1.2, then 0.9 on its second probe
    assert planner.get(P(8, True)).measured_step_s == 1.0 and planner.get(P(4, True)).measured_step_s == 1.6


def test_a_plan_slowed_by_the_warm_up_is_timed_again_and_wins():
    """The first probes of a process (or right after an OOM) run slow for longer than one step,
    and they are of the largest, usually fastest, micro-batch: its slow first time must not rule
    it out when it is within 1.5× of the fastest."""
    true_s = {(8, True): 1.0, (4, True): 1.2, (2, True): 1.3}
    calls = []

    def prober(c, samples):  # the first two probes run 1.4× slow
        calls.append(key(c))
        return true_s[key(c)] * (1.4 if len(calls) <= 2 else 1.0)

    planner = Planner(table()[1::2][:3], None, prober)  # (8, AC), (4, AC), (2, AC)
    assert key(planner.initial()) == (8, True) and planner.get(P(8, True)).measured_step_s == 1.0


def test_close_contenders_still_slowed_after_an_oom_get_a_third_probe():
    """After an OOM the warm-up lasts several steps (ZeRO-3 on 2 CPU ranks: the largest plan's
    first three probes 1.2–1.6× its settled time): the plans within 1.25× after two probes are
    timed a third time, and the fastest wins."""
    true_s = {(8, True): 1.0, (4, True): 1.2, (2, True): 1.5}
    slow = {0: 1.6, 1: 1.6, 6: 1.3}  # by call: (8, AC)'s warm-up and first probe, its second probe
    calls = []

    def prober(c, samples):
        calls.append(key(c))
        return true_s[key(c)] * slow.get(len(calls) - 1, 1.0)

    planner = Planner(table()[1::2][:3], None, prober)  # (8, AC), (4, AC), (2, AC)
    assert key(planner.initial()) == (8, True) and planner.get(P(8, True)).measured_step_s == 1.0
    assert calls[4:7] == [(4, True), (2, True), (8, True)]  # after these (8, AC) had 1.3 s, (4, AC) 1.2 s
    assert calls[7:] == [(4, True), (8, True), (2, True)]  # all within 1.25 × 1.2 s: the third probe decides


def test_oom_moves_to_the_fastest_plan_predicted_to_need_less():
    planner = Planner(table(), None, timed(SECONDS))
    nxt = planner.after_oom(P(8, False))  # 9 MiB did not fit
    assert planner.bound_bytes == 9 * MiB - 1 and not planner.get(P(8, False)).fits
    assert key(nxt) == (4, False) and nxt.measured_step_s == pytest.approx(1.0)  # halving beats AC here


def test_oom_turns_activation_checkpointing_on_when_that_is_faster():
    planner = Planner(table(), None, timed({**SECONDS, (8, True): 0.95}))  # cheap recompute
    assert key(planner.after_oom(P(8, False))) == (8, True)


def test_probe_out_of_memory_refutes_and_lowers_the_bound():
    seconds = {k: v for k, v in SECONDS.items() if k != (8, True)}  # None: the probe ran out of memory
    planner = Planner(table(), None, timed(seconds))
    nxt = planner.after_oom(P(8, False))
    assert not planner.get(P(8, True)).fits and planner.bound_bytes == 3 * MiB - 1
    assert key(nxt) == (4, True)  # 4 without AC needs 5 MiB: more than what just failed, so not even timed
    assert (4, False) not in planner.prober.calls


def test_nothing_left_is_none():
    planner = Planner(make_candidates(1, AC("off"), MiB, by_ac(lambda m, ac: MiB), "cpu", None), None, timed({(1, False): 1.0}))
    assert planner.get(P(1, False, 1)) is not None and planner.after_oom(P(1, False, 1)) is None


def test_grow_back_tries_the_next_faster_plan_and_confirms_it():
    planner = Planner(table(), None, timed(SECONDS))
    planner.measure(planner.candidates)
    assert key(planner.faster_than(P(1, False))) == (2, False)  # the smallest step up in memory that is faster
    planner.bound_bytes = 2 * MiB
    planner.confirm(planner.get(P(2, False)))
    assert planner.bound_bytes == planner.get(P(2, False)).predicted_peak_bytes


def test_controller_with_planner_oom_grow_back_and_state():
    per_rank = 8
    planner = Planner(table(), None, timed({**SECONDS, (8, True): 0.95}))
    ctl = controller(8, per_rank, "auto", 2, planner)
    change = ctl.on_oom("forward")
    assert change.event == "activation_checkpointing_on" and ctl.plan.lever("activation_checkpointing") == "on" \
        and ctl.plan.micro_batch_size == 8
    assert change.as_dict()["predicted_peak_bytes"] == planner.get(P(8, True)).predicted_peak_bytes
    change = ctl.on_oom("forward")  # 8 + AC fails as well: the fastest of what needs less than 3 MiB
    assert change.event == "oom_shrink" and (ctl.plan.micro_batch_size, ctl.plan.lever("activation_checkpointing")) == (4, "on")
    assert ctl.on_success() is None
    grow = ctl.on_success()  # the window is full: the faster plan needing the least more memory
    assert grow.event == "grow_back" and (ctl.plan.micro_batch_size, ctl.plan.lever("activation_checkpointing")) == (8, "on")
    failed = ctl.on_oom("forward")
    assert failed.event == "grow_back_failed" and (ctl.plan.micro_batch_size, ctl.plan.lever("activation_checkpointing")) == (4, "on")
    assert failed.new.lever("activation_checkpointing") == "on" and ctl.window == 4
    state = json.loads(json.dumps(ctl.state_dict()))
    again = controller(8, per_rank, "auto", 2, Planner(table(), None))
    again.load_state_dict(state)
    assert again.plan == ctl.plan and again.plan.lever("activation_checkpointing") == ctl.plan.lever("activation_checkpointing")
    assert again.planner.bound_bytes == planner.bound_bytes
    assert [c.fits for c in again.planner.candidates] == [c.fits for c in planner.candidates]


def test_controller_halves_when_the_planner_predicts_nothing_fits_then_stops():
    """A prediction never ends a run that halving could save: with every probe out of memory the
    controller halves, turns AC on at micro-batch 1, and only then stops."""
    planner = Planner(make_candidates(2, AC("auto"), MiB, by_ac(lambda m, ac: m * MiB), "cpu", None), None, lambda c, samples: None)
    ctl = controller(2, 2, "auto", 0, planner)
    assert ctl.on_oom("forward").event == "oom_shrink" and ctl.plan.micro_batch_size == 1
    assert ctl.on_oom("forward").event == "activation_checkpointing_on"
    with pytest.raises(OOMStop):
        ctl.on_oom("forward")


def test_fixed_plan_grows_back_without_measurements():
    """A run at a fixed micro-batch has no timed candidates: grow-back goes to the next larger
    micro-batch as without a planner."""
    cands = make_candidates(8, AC("off"), MiB, by_ac(lambda micro, ac: micro * MiB), "cpu", None)
    ctl = controller(8, 8, "off", 2, Planner(cands, None))
    assert ctl.on_oom("forward").event == "oom_shrink"  # untimed: the first candidate predicted to need less
    ctl.on_success()
    grow = ctl.on_success()
    assert grow is not None and grow.event == "grow_back" and ctl.plan.micro_batch_size == 8


def test_restored_state_keeps_this_devices_predictions():
    planner = Planner(table(), None)
    planner.after_oom(P(8, False))
    state = planner.state_dict()
    smaller = Planner(table(budget=4 * MiB), 4 * MiB)
    smaller.load_state_dict(state)
    assert smaller.bound_bytes == 4 * MiB and not smaller.get(P(4, False)).fits  # 5 MiB: not on this device
    other = Planner(make_candidates(4, AC("auto"), MiB, by_ac(lambda m, ac: m * MiB), "cpu", None), None)
    other.load_state_dict(state)  # another per-rank batch: nothing restored
    assert other.bound_bytes is None and all(c.fits for c in other.candidates)


def test_decisions_are_a_function_of_the_table():
    """Every rank holds the same predictions and rank-averaged seconds, so the same decisions."""
    a, b = Planner(table(3 * MiB), 3 * MiB, timed(SECONDS)), Planner(table(3 * MiB), 3 * MiB, timed(SECONDS))
    assert key(a.initial()) == key(b.initial())
    assert key(a.after_oom(a.initial().plan)) == key(b.after_oom(b.initial().plan))


def memtracker_micro_step_bytes(model, objective, batch) -> int:
    """MemTracker's peak of a real accumulation micro-step (forward and backward of ``batch`` with
    the gradients already there) above the parameters and gradients, bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters + gradients
    objective.loss_sum(model, batch).backward()  # the gradients exist, as in accumulation
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        objective.loss_sum(model, batch).backward()
    return max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()) - state


def test_fake_trace_predicts_what_memtracker_counts_in_a_real_micro_step(cache_dir):
    """The fake-tensor trace (no memory) against torch's MemTracker on a real forward and backward
    of the same model and micro-batch (an accumulation micro-step: gradients already exist and are
    model state): the bytes above parameters and gradients agree within 10%, with activation
    checkpointing off, selective and on; under a simulated device the trace is what autograd saves, which is
    all that device counts (less)."""
    from memtrain.levers.activation_checkpointing import disable_activation_checkpointing, enable_activation_checkpointing
    from memtrain.models import repeated_blocks
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table, trace_batch

    cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir])
    corpus = build_corpus(cfg.data)
    model = build_model(cfg.model, corpus.vocab_size, 0)
    objective = make_objective(model, corpus)
    traced = activation_table(cfg, corpus, objective, "fp32", "cpu")
    for ac in ("off", "selective", "on"):
        if ac != "off":
            disable_activation_checkpointing(model, repeated_blocks(model))
            enable_activation_checkpointing(model, repeated_blocks(model), mode=ac)
        for micro in (4, 8):
            batch = trace_batch(corpus, micro)
            real = memtracker_micro_step_bytes(model, objective, batch)
            assert traced(P(micro, ac, 8)) == pytest.approx(real, rel=0.10), (micro, ac)
    assert traced(P(4, "on", 8)) < traced(P(4, "selective", 8)) < traced(P(4, "off", 8))
    simulated = activation_table(parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--faults.memory_budget_mib",
                                                         "64"]), corpus, objective, "fp32", "cpu")
    assert simulated(P(4, False, 8)) < traced(P(4, False, 8))


def test_a_mixture_of_experts_model_in_fp32_is_traced_as_memtracker_counts_it(cache_dir):
    """A Mixtral model (transformers' fused experts, ``grouped_mm``) in fp32: torch's meta kernel of
    ``aten._grouped_mm`` takes bf16 only (the CUDA kernel's rule), so the trace failed on a model the
    CPU trains; its micro-step now agrees with MemTracker's count of the real one within 10%, with
    activation checkpointing off and on."""
    from conftest import TINY_BASE_ARGS
    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model, repeated_blocks
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table, trace_batch

    moe = json.dumps({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                      "num_experts_per_tok": 2, "max_position_embeddings": 32})
    cfg = parse_args(TINY_BASE_ARGS + ["--data.cache_dir", cache_dir, "--model.config", moe])
    corpus = build_corpus(cfg.data)
    model = build_model(cfg.model, corpus.vocab_size, 0)
    objective = make_objective(model, corpus)
    traced = activation_table(cfg, corpus, objective, "fp32", "cpu")
    for ac in ("off", "on"):
        if ac == "on":
            enable_activation_checkpointing(model, repeated_blocks(model), mode=ac)
        batch = trace_batch(corpus, 4)
        assert traced(P(4, ac, 8)) == pytest.approx(memtracker_micro_step_bytes(model, objective, batch), rel=0.10), ac


def test_the_trace_finds_the_peaks_inside_blocks_and_in_backward_that_memtracker_counts(cache_dir):
    """The trace's peaks while a block runs and from the first parameter gradient on
    (``StepPeaks.in_block``, ``in_backward``: where FSDP2 and ZeRO-3 hold gathered parameters and
    ZeRO-2 its reduce bucket) against MemTracker on the real micro-step: the largest of the blocks'
    forward and backward peaks, and the peak from the first gradient's hook on (the tracker's
    peak restarted there), above parameters and gradients, within 10%, with activation
    checkpointing off and on. The tiny model's peak is the loss's (its 512-token logits), which
    both MemTracker and the trace put outside the blocks and before the first gradient."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model, repeated_blocks
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table, trace_batch

    cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir])
    corpus = build_corpus(cfg.data)
    model = build_model(cfg.model, corpus.vocab_size, 0)
    objective = make_objective(model, corpus)
    traced = activation_table(cfg, corpus, objective, "fp32", "cpu")
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters + gradients
    for ac in ("off", "on"):
        if ac == "on":
            enable_activation_checkpointing(model, repeated_blocks(model), mode="on")
        batch = trace_batch(corpus, 8)
        objective.loss_sum(model, batch).backward()  # the gradients exist, as in accumulation
        tracker = MemTracker()
        tracker.track_external(model)
        backward_peak = []

        def restart_peak(_param):
            if not backward_peak:  # the first gradient: count the peak from here on
                backward_peak.append(True)
                tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
                tracker._peak_mem = {d: snap["Total"] for d, snap in tracker._peak_mem_snap.items()}

        hooks = [p.register_post_accumulate_grad_hook(restart_peak) for p in model.parameters()]
        with tracker:
            objective.loss_sum(model, batch).backward()
        for hook in hooks:
            hook.remove()
        in_backward = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values()) - state
        in_block = max(snap[device]["Total"] for block in repeated_blocks(model)
                       for phase in (_ModState.PEAK_FW, _ModState.PEAK_BW)
                       for snap in tracker.memory_tracking[block].snapshots.get(phase, []) for device in snap) - state
        peaks = traced.peaks(P(8, ac, 8))
        assert peaks.in_block == pytest.approx(in_block, rel=0.10), ac
        assert peaks.in_backward == pytest.approx(in_backward, rel=0.10), ac
        assert peaks.in_block < peaks.peak and peaks.in_backward < peaks.peak, ac  # the loss's peak


def test_a_gpu_planned_without_one_traces_attention_as_a_fused_kernel_holds_it(cache_dir):
    """A CUDA run planned on this CPU machine traces on the meta device, where attention stands in
    for a GPU's fused kernel: without dropout its bytes equal the CPU trace's, which runs torch's
    own fused CPU kernel (an independent count); attention dropout adds nothing (the kernel draws
    its mask again), where the meta device's math path saved the weights and the mask."""
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table

    traced = {}
    for dropout in ("0.0", "0.1"):
        cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--model.config.attn_pdrop", dropout])
        corpus = build_corpus(cfg.data)
        objective = make_objective(build_model(cfg.model, corpus.vocab_size, 0), corpus)
        for device in ("cpu", "cuda"):
            traced[dropout, device] = activation_table(cfg, corpus, objective, "fp32", device)(P(8, "off", 8))
    assert traced["0.0", "cuda"] == traced["0.0", "cpu"] == traced["0.1", "cuda"]
    assert traced["0.1", "cpu"] > traced["0.0", "cpu"]  # the CPU's fused kernel has no dropout: the math path


def test_a_bf16_trace_holds_what_autocast_holds(cache_dir):
    """bf16 under Accelerate's autocast (DDP: fp32 parameters, each matrix cast on use and its copy
    saved for backward, the outputs in fp32) against MemTracker on the real model run that way
    (``torch.autocast`` around its forward, outputs made fp32 as ``accelerate.utils.convert_outputs_to_fp32``
    does): within 10% with activation checkpointing off and on. The sharded engines, which compute
    with parameters held in bf16, are traced without the cast copies: less."""
    import types

    import torch

    from accelerate.utils import convert_outputs_to_fp32

    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.models import repeated_blocks
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table, activation_tables, trace_batch

    cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--precision", "bf16"])
    corpus = build_corpus(cfg.data)
    traced = activation_table(cfg, corpus, make_objective(build_model(cfg.model, corpus.vocab_size, 0), corpus),
                              "bf16", "cpu", engine="ddp")
    sharded = activation_table(cfg, corpus, make_objective(build_model(cfg.model, corpus.vocab_size, 0), corpus),
                               "bf16", "cpu", engine="fsdp")
    for ac in ("off", "on"):
        model = build_model(cfg.model, corpus.vocab_size, 0)
        objective = make_objective(model, corpus)
        if ac == "on":
            enable_activation_checkpointing(model, repeated_blocks(model), mode="on")
        model.forward = types.MethodType(convert_outputs_to_fp32(torch.autocast("cpu", torch.bfloat16)(
            type(model).forward)), model)
        for micro in (4, 8):
            batch = trace_batch(corpus, micro)
            real = memtracker_micro_step_bytes(model, objective, batch)
            assert traced(P(micro, ac, 8)) == pytest.approx(real, rel=0.10), (micro, ac)
            assert sharded(P(micro, ac, 8)) < traced(P(micro, ac, 8))
    # the placement planner and `memtrain plan` price each engine with its own trace (one per way of computing)
    tables = activation_tables(cfg, corpus, objective, "bf16", "cpu")
    assert tables("fsdp") is tables("deepspeed") is not tables("ddp")
    assert tables("ddp")(P(4, "off", 8)) == traced(P(4, "off", 8)) and tables("fsdp")(P(4, "off", 8)) == sharded(P(4, "off", 8))
    fp32 = activation_tables(cfg, corpus, objective, "fp32", "cpu")
    assert fp32("ddp") is fp32("fsdp")


def test_plan_cli_prints_the_candidates(cache_dir, capsys):
    """``memtrain plan --json``: one object per candidate, the chosen one (``auto``: the planner's) fits, then the
    placements; a world size that does not divide the global batch is exit 2 naming the field."""
    from memtrain.estimate import main

    args = TINY_ARGS + ["--data.cache_dir", cache_dir, "--faults.memory_budget_mib", "1",
                        "--training.micro_batch_size", "auto"]
    assert main(["--world_size", "2", "--json", *args], command="plan") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in lines if not r.get("placement")]
    placements = [r for r in lines if r.get("placement")]  # then the placement table, one row per placement
    assert {p["engine"] for p in placements} == {"ddp", "fsdp", "deepspeed"}
    assert sum(p["chosen"] for p in placements) <= 1
    assert {(r["micro_batch_size"], r["activation_checkpointing"]) for r in rows} == {
        (m, ac) for m in (1, 2, 4) for ac in ("off", "on")}
    (chosen,) = [r for r in rows if r["chosen"]]
    assert chosen["fits"] and chosen["predicted_peak_bytes"] <= 2**20
    assert not any(r["fits"] for r in rows if r["predicted_peak_bytes"] > 2**20)
    assert main(["--world_size", "3", *args], command="plan") == 2
    assert "training.global_batch_size" in capsys.readouterr().err


def test_the_solver_shortlist_times_fewer_plans_and_finds_the_fastest():
    """``memory.levers auto``: with AC off, selective and on, the planner times the largest fitting
    micro-batch of each setting, then the fastest setting's other micro-batches — fewer probes
    than timing every fitting plan, and the same choice as timing them all (here selective AC at
    micro-batch 4: off fits only at 2, and full AC's recompute costs more than selective's)."""
    from memtrain.levers.activation_checkpointing import SOLVER_CHOICES

    per_sample = {"off": MiB, "selective": MiB // 2, "on": MiB // 4}
    cands = lambda: make_candidates(8, {"activation_checkpointing": SOLVER_CHOICES}, MiB,  # noqa: E731
                                    lambda plan: plan.micro_batch_size * per_sample[plan.lever("activation_checkpointing")],
                                    "cpu", 3 * MiB)
    cost = {"off": 1.0, "selective": 1.05, "on": 1.3}
    seconds = {(m, ac): (0.1 + 0.1 * m) * cost[ac] for m in (1, 2, 4, 8) for ac in SOLVER_CHOICES}
    calls = []

    def prober(c, samples):
        calls.append(c)
        return seconds[(c.micro_batch_size, c.plan.lever("activation_checkpointing"))] * (samples // c.micro_batch_size)

    every = Planner(cands(), 3 * MiB, prober)
    best = every.initial()
    probes_every, calls[:] = len(calls), []
    short = Planner(cands(), 3 * MiB, prober, shortlist=True)
    chosen = short.initial()
    assert (chosen.micro_batch_size, chosen.plan.lever("activation_checkpointing")) == (4, "selective")
    assert (best.micro_batch_size, best.plan.lever("activation_checkpointing")) == (4, "selective")
    assert len(calls) < probes_every
    assert {(c.micro_batch_size, c.plan.lever("activation_checkpointing")) for c in calls} >= {
        (2, "off"), (4, "selective"), (8, "on")}  # each setting's largest fitting micro-batch


def test_a_deep_model_is_traced_at_a_few_depths_and_extrapolated_exactly(cache_dir, monkeypatch):
    """The planner traces a 14-block GPT-2 at 1, 2 and 3 blocks (2, 4 and 6 under activation
    checkpointing of every second block) and extrapolates: the bytes (the peak, in a block and in
    backward) equal those of tracing all 14 blocks, for every AC setting; an AC pattern that does not divide the depth (every third
    block) is traced whole."""
    import memtrain.planning.activations as activations
    import memtrain.memory.step_trace as step_trace
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import ModelSource
    from memtrain.objectives import make_objective

    depths = []
    trace = step_trace.step_peaks

    def spy(model, mode, objective, batch, **kw):
        depths.append(len(model.transformer.h))
        return trace(model, mode, objective, batch, **kw)

    monkeypatch.setattr(step_trace, "step_peaks", spy)
    for every, settings, shortened in ((1, ("off", "selective", "on"), {2, 3, 4}), (2, ("on",), {4, 6, 8}),
                                       (3, ("on",), set())):
        cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--model.config.n_layer", "14",
                                      "--memory.activation_checkpointing_every_n_blocks", str(every)])
        corpus = build_corpus(cfg.data)
        objective = make_objective(ModelSource.of(cfg, corpus).build_meta(), corpus)
        fast = activations.activation_table(cfg, corpus, objective, "fp32", "cpu")
        with monkeypatch.context() as whole:
            whole.setattr(activations, "by_depth", lambda model, blocks, period, run: run())
            slow = activations.activation_table(cfg, corpus, objective, "fp32", "cpu")
            expected = {ac: slow.peaks(P(4, ac)) for ac in settings}
        depths.clear()
        assert {ac: fast.peaks(P(4, ac)) for ac in settings} == expected, every
        assert set(depths) == (shortened or {14}), (every, depths)  # AC every third block: traced whole


def test_depth_extrapolation_falls_back_to_the_whole_model():
    """``by_depth`` with a stand-in trace (bytes as a function of the blocks present): a linear
    growth is extrapolated from 2, 3 and 4 blocks; a growth that is not, blocks of different kinds
    in the config (``layer_types``), and a model that fails shortened are traced whole, and the
    block list is always restored."""
    from types import SimpleNamespace

    from torch import nn

    from memtrain.memory.depth import by_depth

    def model(kinds=None):
        m = nn.Module()
        m.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))
        m.config = SimpleNamespace(layer_types=kinds)
        return m

    for m, bytes_of, whole_only in (
            (model(), lambda d: 100 + 7 * d, False),
            (model(), lambda d: d * d, True),                           # not linear: the whole model
            (model(["full", "sliding"] * 4), lambda d: 100 + 7 * d, True),  # kinds differ
            (model(), lambda d: 1 / (d // 8), True)):                  # fails shortened (ZeroDivisionError)
        seen, full = [], m.layers
        blocks = list(full)

        def trace():
            seen.append(len(m.layers))
            return bytes_of(len(m.layers))

        assert by_depth(m, blocks, 1, trace) == bytes_of(8)
        assert m.layers is full and (seen[-1] == 8) == whole_only and (8 not in seen) == (not whole_only)


def test_the_traced_batch_repeats_a_corpus_smaller_than_the_batch():
    """A rank batch larger than the corpus (the sampler's next epoch fills it) is traced whole: the
    samples repeated in order, the longest first for a corpus of varying length."""
    import types

    import numpy as np
    import torch

    from memtrain.planning.activations import trace_batch

    class Split:
        def __init__(self, lengths=None):
            self.lengths = None if lengths is None else np.asarray(lengths)

        def __len__(self):
            return 3

        def batch(self, indices):
            return {"index": torch.tensor(indices)}

    fixed = types.SimpleNamespace(train=Split())
    assert trace_batch(fixed, 5)["index"].tolist() == [0, 1, 2, 0, 1]
    varying = types.SimpleNamespace(train=Split([7, 9, 8]))
    assert trace_batch(varying, 2)["index"].tolist() == [1, 2]
    assert trace_batch(varying, 4)["index"].tolist() == [1, 2, 0, 1]


def test_the_trace_keeps_a_parameter_while_autograd_holds_a_view_of_it():
    """``step_peaks``' kept peaks (ZeRO-3's gathered parameters, which a saved view keeps past their
    release): an expert's slice of a fused weight keeps its whole parameter counted until backward
    frees the view, and so does a linear layer's transposed weight where torch's linear runs
    (``linear_saves_weight`` False; DeepSpeed's memory-efficient linear saves the weight itself);
    a parameter saved as itself (``addmm``'s matrix), or one at or under the threshold, is not
    kept. The expected bytes are the parameters' sizes, from their shapes."""
    import torch
    from torch import nn

    from memtrain.memory.step_trace import fake_model, step_peaks

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.Parameter(torch.zeros(4, 64, 64))  # 16,384 elements: used through a slice
            self.head = nn.Linear(64, 256, bias=False)  # 16,384: F.linear saves weight.t()
            self.direct = nn.Parameter(torch.zeros(64, 64))  # 4,096: torch.addmm saves it as itself
            self.bias = nn.Parameter(torch.zeros(64))  # 64: scales the input, so it needs a gradient

        def forward(self, x):
            x = torch.addmm(self.bias, (x * self.bias) @ self.experts[1], self.direct)
            return self.head(x).sum()

    class Loss:
        def loss_sum(self, model, batch):
            return model(batch["x"])

    batch = {"x": torch.zeros(512, 64)}  # the head's output and its gradient make the peak, views kept
    model, mode = fake_model(Experts)
    plain = step_peaks(model, mode, Loss(), batch)
    assert plain.kept == ()
    kept = step_peaks(model, mode, Loss(), batch, kept_numel=4_096, linear_saves_weight=False)
    assert kept[:3] == plain[:3]
    assert kept.kept[0] - plain.peak == 4 * (16_384 + 16_384)  # the slice's and the transpose's parameters
    everything = step_peaks(model, mode, Loss(), batch, kept_numel=0, linear_saves_weight=False)
    assert everything.kept[0] == kept.kept[0]  # the directly saved one and the bias: never kept
    assert step_peaks(model, mode, Loss(), batch, kept_numel=16_384).kept[0] == plain.peak
    # DeepSpeed's linear: the head's weight is saved as itself, the experts' slice still kept
    assert step_peaks(model, mode, Loss(), batch, kept_numel=4_096).kept[0] - plain.peak == 4 * 16_384
    # the engine and the trace read a DeepSpeed JSON's setting alike: 0 and false are off (as
    # DeepSpeed's own config reads them), unset is on
    from memtrain.backends.ds_config import linear_saves_weight, zero_buffer_settings

    assert [linear_saves_weight(zero_buffer_settings(z)) for z in (
        {}, {"memory_efficient_linear": 0}, {"memory_efficient_linear": False}, {"memory_efficient_linear": True})] == [
        True, False, False, True]


def test_the_trace_holds_a_parameter_until_its_module_has_run_its_forward():
    """``StepPeaks.kept``'s forward peak: ZeRO-3's coalesced prefetch copies every parameter out
    of its buffer when the first is claimed, and a module's forward releases its own; so in
    forward the trace holds each parameter over the threshold until its module's forward ends.
    Two 64×64 linear layers in a row on 512 rows: at the second's output both outputs (512×64 fp32
    each) and the second's weight are held. The expected bytes are from the shapes."""
    import torch
    from torch import nn

    from memtrain.memory.step_trace import fake_model, step_peaks

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return self.second(self.first(x)).sum()

    class Loss:
        def loss_sum(self, model, batch):
            return model(batch["x"])

    model, mode = fake_model(Two)
    batch = {"x": torch.zeros(512, 64)}
    held = step_peaks(model, mode, Loss(), batch, kept_numel=1_000).kept[3]
    whole = step_peaks(model, mode, Loss(), batch, kept_numel=4_096).kept[3]  # at the threshold: whole anyway
    assert held == 2 * 4 * 512 * 64 + 4 * 64 * 64  # the second's weight beside both outputs
    assert 2 * 4 * 512 * 64 <= whole < held


def test_the_trace_counts_a_blocks_backward_after_another_blocks_ended(cache_dir):
    """``StepPeaks.in_block_backward``, the moment FSDP2 holds the block before's reduce-scatter:
    the peak while a block runs its backward once another block's backward has ended — none in a
    one-block model (its only block's backward is the first), at most the in-block peak in one of
    two blocks, and at least what that second block's backward holds (above the one-block model's
    whole-step floor: the first block's saved activations are still there)."""
    import memtrain.planning.activations as activations
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import ModelSource
    from memtrain.objectives import make_objective

    peaks = {}
    for layers in (1, 2):
        cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--model.config.n_layer", str(layers)])
        corpus = build_corpus(cfg.data)
        objective = make_objective(ModelSource.of(cfg, corpus).build_meta(), corpus)
        peaks[layers] = activations.activation_table(cfg, corpus, objective, "fp32", "cpu").peaks(P(4, "off"))
    assert peaks[1].in_block_backward == 0
    assert 0 < peaks[2].in_block_backward <= peaks[2].in_block
