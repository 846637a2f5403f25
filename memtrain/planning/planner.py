"""The planner: which plan — micro-batch size and lever settings (:mod:`memtrain.levers`:
activation checkpointing (AC), chunked cross-entropy, ...) — a run trains with.

Candidates are every micro-batch size that divides the rank's share of the global batch, each
with every combination of the levers' choices (``memory.activation_checkpointing auto``: AC off
and on). For each the planner predicts the peak device memory and measures the step time:

- **Peak bytes, without allocating.** The model is built on the meta device with fake parameters
  (``torch._subclasses.fake_tensor.FakeTensorMode``) and one micro-batch is traced while
  its forward and backward are counted (:mod:`memtrain.memory.step_trace`: saved activations and
  the transients beside them, e.g. the logits' gradient; under a simulated device only what
  autograd saves, which is all it counts). A model of many alike blocks is traced at a few depths
  and extrapolated where the growth per block is exact (:func:`memtrain.memory.depth.by_depth`).
  Planning a 10B-parameter model takes seconds and no memory. The prediction is model state (the
  engine's accounting, ``model_state_bytes``, its buffers included) + that peak (+ on CUDA, a
  headroom for the allocator: :func:`memtrain.memory.accounting.with_allocator_headroom`);
  ``benchmarks/memory_accuracy.py`` checks it against torch's ``MemTracker`` on real runs. On
  CUDA a candidate whose offloaded activations need more pinned host memory than a rank has
  (:func:`memtrain.memory.machine.offload_host_room_bytes`) does not fit either.
- **Step time, measured.** A run times the forward and backward of the first samples of a rank
  batch (every micro-batch of them and the gradient reduction, no optimizer step) at each
  candidate predicted to fit, on the real engine and data, and scales the seconds to the whole
  rank batch (:meth:`Planner.probe_samples`: one micro-batch of the largest fitting plan, the
  same samples for every candidate, so a probe costs a fraction of a step when that micro-batch
  is a fraction of the rank batch); the seconds are averaged over ranks, so every rank holds
  the same table and takes the same decision; largest micro-batch first, for at most
  :func:`probe_budget_steps` step times a choice. AC's recompute cost and each engine's cost per
  micro-batch (ZeRO-3's gathers, DDP's single reduction) are in that time.
  ``memtrain plan`` (no run) estimates seconds from FLOPs instead (:func:`estimated_step_s`).

:class:`Planner` holds the table of a run: the choice before step 1 (``training.micro_batch_size:
auto``), the next plan after an out-of-memory error (the fastest candidate predicted to need less
than the plan that failed), and the next faster plan for grow-back. The idea of choosing the
micro-batch by trying follows Composer's auto-microbatching; predicting from a traced
micro-batch follows torch's ``FakeTensorMode``-based memory estimators.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from memtrain.levers import LeverCost, PlanFacts, plan_cost, recompute_fraction, restore_settings
from memtrain.levers import copy_bytes_per_s as charged_copy_rate  # its parameters' name
from memtrain.memory.accounting import device_state_bytes, divisors, with_allocator_headroom
from memtrain.memory.moments import largest_moment_bytes
from memtrain.memory.peak import peak_tensor_bytes, peak_terms, plan_terms
from memtrain.memory.machine import offload_host_room_bytes, run_device_budget
from memtrain.plan import Plan
from memtrain.planning.activations import activation_table
from memtrain.step import PROBE_REPEATS

CONTENDER_RATIO = 1.5
"""A candidate whose first probe took at most this × the fastest first probe is timed again: the
first probes of a process (or after an OOM) run while the machine and the engine warm up, and a
step time varies by tens of percent on a busy host, so one probe cannot rule it out."""

PROBE_MICRO_BATCHES = 1
"""A probe runs this many micro-batches of the largest plan it may time: fewer samples than the
rank batch when that plan accumulates, and every smaller candidate accumulates over the same
samples (:meth:`Planner.probe_samples`), so each probe ends with one gradient reduction and that
reduction weighs the same in every candidate's time scaled to the rank batch."""
CLOSE_RATIO = 1.25
"""Candidates whose best of two probes is within this × the fastest are timed a third time (a
plan still slowed by the warm-up after an OOM was measured 1.2–1.6× its settled time)."""


PROBE_BUDGET_STEPS = 16
"""One choice of plan (before step 1, or after an out-of-memory error) probes for at most this
many step times of the fastest plan timed so far; past it the choice is among the plans timed.
Without a limit a rank batch of 256 tiny-recipe samples, each probe a whole step, spent 10
minutes timing 18 plans after one out-of-memory error."""
PROBE_RUN_FRACTION = 0.05
"""... and for at most this fraction of the run's steps (``training.max_steps``), ..."""
PROBE_MIN_STEPS = 4
"""... but always this many: the first plan's warm-up and its timed probe when each probe is a
whole step (:data:`memtrain.step.PROBE_REPEATS` runs each)."""


def probe_budget_steps(max_steps: int) -> float:
    """Step times one choice of plan may spend probing in a run of ``max_steps`` steps:
    :data:`PROBE_RUN_FRACTION` of them, at least :data:`PROBE_MIN_STEPS`, at most
    :data:`PROBE_BUDGET_STEPS`."""
    return min(PROBE_BUDGET_STEPS, max(PROBE_MIN_STEPS, PROBE_RUN_FRACTION * max_steps))


@dataclass
class Candidate:
    """One plan the planner considers.

    Attributes:
        plan: the :class:`memtrain.plan.Plan` (split and lever settings).
        predicted_peak_bytes: model state + activation bytes (+ CUDA headroom), bytes per rank.
        activation_bytes: the peak bytes one micro-batch's forward and backward hold beyond model
            state (traced: :func:`activation_table`).
        offloaded_bytes: bytes of saved activations one micro-batch moves to host memory and back
            (activation offload; traced), each way.
        in_block_bytes, in_backward_bytes: the peak of ``activation_bytes``'s kind while a
            repeated block runs, and from the first parameter gradient on (traced:
            :class:`memtrain.memory.step_trace.StepPeaks`); None = ``activation_bytes``.
        predicted_step_s: seconds of an optimizer step's forward and backward estimated from its
            FLOPs and its host copies (``memtrain plan``); None = not estimated.
        measured_step_s: the same, measured: the fastest timed probe on the run's engine (on a CPU
            run, plus the charged host copies: :class:`Planner`'s ``copy_bytes_per_s``); None =
            not timed.
        fits: predicted to fit the budget and not refuted by an out-of-memory error.
        chosen: the plan taken.
        resident_bytes: the rank's batch on the device, held through the whole step, and the
            data fingerprint's weights (:class:`memtrain.memory.step_trace.StepPeaks`).
        kept_peaks: the three peaks with the gathered parameters a saved view keeps
            (``StepPeaks.kept``; () = not traced), read for an engine that gathers them.
        in_block_backward_bytes: the peak while a repeated block runs its backward
            (``StepPeaks.in_block_backward``); None = ``in_block_bytes``.
        in_block_forward_bytes: the peak while a repeated block runs its forward
            (``StepPeaks.in_block_forward``); None = ``in_block_bytes``.
        made_peaks: the backward's peaks with the gradients made so far (``StepPeaks.made``;
            () = not traced), read for a plan that does not accumulate.
        moment_bytes: the run's largest moment outside its steps, with the allocator's headroom
            (a resume's checkpoint load, the export: :mod:`memtrain.memory.moments`); the same for
            every plan, so it decides whether a plan fits, never which plan is smaller or faster.
    """

    plan: Plan
    predicted_peak_bytes: int
    activation_bytes: int
    offloaded_bytes: int = 0
    in_block_bytes: Optional[int] = None
    in_backward_bytes: Optional[int] = None
    predicted_step_s: Optional[float] = None
    measured_step_s: Optional[float] = None
    fits: bool = True
    chosen: bool = False
    resident_bytes: int = 0
    kept_peaks: tuple = ()
    in_block_backward_bytes: Optional[int] = None
    moment_bytes: int = 0
    in_block_forward_bytes: Optional[int] = None
    made_peaks: tuple = ()

    @property
    def planned_bytes(self) -> int:
        """What the plan must fit: its step's peak and the run's moments outside the steps."""
        return max(self.predicted_peak_bytes, self.moment_bytes)

    @property
    def micro_batch_size(self) -> int:
        return self.plan.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.plan.gradient_accumulation_steps

    @property
    def step_s(self) -> Optional[float]:
        """The step time decisions use: measured where timed, else predicted (None: neither)."""
        return self.measured_step_s if self.measured_step_s is not None else self.predicted_step_s

    def as_dict(self) -> dict:
        """A ``plan.json`` row: the split, each lever's setting under its name, the predictions."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        return {"micro_batch_size": self.micro_batch_size, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                **self.plan.settings(), **fields}

    def __str__(self) -> str:
        return self.plan.describe()


def lever_combinations(choices: Mapping[str, tuple]) -> list[dict[str, Any]]:
    """Every combination of the levers' ``choices``, fastest first (the first lever varies slowest)."""
    names = list(choices)
    return [dict(zip(names, combo)) for combo in itertools.product(*(choices[n] for n in names))]


def moment_fit_bytes(moments: int, device_type: str) -> int:
    """The device bytes a plan must fit for the run's largest moment outside its steps
    (``moments``: :func:`memtrain.memory.moments.largest_moment_bytes`, bytes), with the
    allocator's headroom on ``device_type``; 0 where there is none."""
    return with_allocator_headroom(moments, device_type) if moments else 0


def state_terms(state: Mapping[str, int], device_type: str, simulated: bool) -> tuple[Optional[dict], int]:
    """``(terms, moments)`` :func:`make_candidates` takes from a ``model_state_bytes`` dict: its
    peak terms (:func:`memtrain.memory.peak.peak_terms`) and its largest moment outside the
    steps; ``(None, 0)`` on a simulated device, which counts state and saved bytes alone."""
    return (None, 0) if simulated else (peak_terms(state), largest_moment_bytes(state, device_type))


def make_candidates(per_rank_batch: int, choices: Mapping[str, tuple], state_bytes: int,
                    activation_bytes: Callable[[Plan], int], device_type: str,
                    budget_bytes: Optional[int], terms: Optional[Mapping[str, int]] = None,
                    moments: int = 0) -> list[Candidate]:
    """Every candidate plan with its predicted peak.

    Args:
        per_rank_batch: samples per rank per optimizer step.
        choices: ``{lever: settings, fastest first}`` (:func:`memtrain.levers.lever_choices`).
        state_bytes: the engine's model state on a rank (bytes on the device).
        activation_bytes: ``plan -> bytes`` one micro-batch saves (e.g. :func:`activation_table`).
        device_type: ``cuda`` or ``cpu``.
        budget_bytes: device bytes a rank may use; None = unbounded.
        terms: the engine's other terms of the peak (:func:`memtrain.memory.peak.peak_terms`
            of its state): more state in plans that accumulate (gradient_accumulation_steps > 1),
            more at the optimizer step, and the parts of ``state_bytes`` held only while a repeated
            block runs or only in backward, counted beside ``activation_bytes.peaks``
            (:func:`memtrain.memory.peak.peak_tensor_bytes`). None: none (a simulated
            device counts state and saved bytes alone).
        moments: the device bytes of the run's largest moment outside its steps (a resume's
            checkpoint load, the export: :func:`memtrain.memory.moments.largest_moment_bytes`),
            which a plan must fit beside its peak (``Candidate.moment_bytes``); 0 = none.

    Returns:
        Candidates, largest micro-batch first, then the levers' combinations fastest first.
    """
    out = []
    for micro in reversed(divisors(per_rank_batch)):
        for settings in lever_combinations(choices):
            plan = Plan(micro, per_rank_batch // micro, tuple(settings.items()))
            acts = activation_bytes(plan)
            moved = activation_bytes.offloaded_bytes(plan) if hasattr(activation_bytes, "offloaded_bytes") else 0
            peaks = activation_bytes.peaks(plan) if hasattr(activation_bytes, "peaks") else (acts, None, None)
            c = Candidate(plan, 0, acts, moved, *peaks[1:3], resident_bytes=peaks[3] if len(peaks) > 3 else 0,
                          kept_peaks=tuple(peaks[4]) if len(peaks) > 4 else (),
                          in_block_backward_bytes=peaks[5] if len(peaks) > 5 else None,
                          in_block_forward_bytes=peaks[6] if len(peaks) > 6 else None,
                          made_peaks=tuple(peaks[7]) if len(peaks) > 7 else ())
            c.predicted_peak_bytes = candidate_peak_bytes(c, state_bytes, terms or {}, device_type)
            c.moment_bytes = moment_fit_bytes(moments, device_type)
            c.fits = budget_bytes is None or c.planned_bytes <= budget_bytes
            out.append(c)
    return out


def lever_cost(candidate: Candidate, copy_bytes_per_s: Optional[float] = None) -> LeverCost:
    """What ``candidate``'s lever settings cost beyond its traced bytes and recompute
    (:meth:`memtrain.levers.Lever.cost`), host copies charged at ``copy_bytes_per_s`` (bytes/s;
    None: not charged)."""
    facts = PlanFacts(candidate.micro_batch_size, candidate.gradient_accumulation_steps, candidate.offloaded_bytes,
                      copy_bytes_per_s)
    return plan_cost(candidate.plan.settings(), facts)


def candidate_peak_bytes(candidate: Candidate, device_state: int, terms: Mapping[str, int], device_type: str) -> int:
    """A rank's predicted device peak for ``candidate`` beside ``device_state`` bytes of model
    state: :func:`memtrain.memory.peak.peak_tensor_bytes` of its traced peaks and the
    engine's ``terms`` (:func:`memtrain.memory.peak.peak_terms`, for a plan that accumulates
    or not: :func:`memtrain.memory.peak.plan_terms`), plus the device bytes its levers add
    (:func:`lever_cost`), plus the allocator's headroom on ``device_type`` — the one composition
    the planner, the placements and ``memtrain plan`` use (bytes)."""
    peaks = (candidate.activation_bytes, candidate.in_block_bytes, candidate.in_backward_bytes,
             candidate.resident_bytes, candidate.kept_peaks, candidate.in_block_backward_bytes,
             candidate.in_block_forward_bytes, candidate.made_peaks)
    tensors = peak_tensor_bytes(device_state, peaks, **plan_terms(terms, candidate.gradient_accumulation_steps > 1))
    return with_allocator_headroom(tensors + lever_cost(candidate).device_bytes, device_type)


def estimated_step_s(candidate: Candidate, n_params: int, tokens_per_sample: int, flops_per_s: float,
                     recompute: float, micro_batch_overhead_s: float, copy_bytes_per_s: Optional[float] = None) -> float:
    """A step time without running: ``6 × parameters × tokens`` FLOPs for forward and backward
    (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1), plus the forwards the
    levers recompute (``2 × parameters × tokens × recompute``: activation checkpointing's
    checkpointed fraction of blocks; :func:`memtrain.levers.recompute_fraction`), plus a fixed
    cost per micro-batch (launch and gradient reduction), plus the seconds its levers cost beyond
    that (:func:`lever_cost`: activation offload's host copies at ``copy_bytes_per_s``, as if none
    overlapped compute; None: not counted)."""
    tokens = candidate.micro_batch_size * tokens_per_sample
    flops = (6 + 2 * recompute) * n_params * tokens
    extra = lever_cost(candidate, copy_bytes_per_s).seconds
    return candidate.gradient_accumulation_steps * (flops / flops_per_s + micro_batch_overhead_s) + extra


def estimated_plan_s(candidate: Candidate, cfg, n_params: int, tokens_per_sample: int, flops_per_s: float) -> float:
    """:func:`estimated_step_s` of ``candidate`` under ``cfg``: its levers' recompute, 1 ms per
    micro-batch (launches and reduction: ties go to fewer micro-batches) and its host copies at
    ``memory.activation_offload_bandwidth_gb_s`` (``memtrain plan`` and the placement table)."""
    return estimated_step_s(candidate, n_params, tokens_per_sample, flops_per_s,
                            recompute_fraction(candidate.plan.settings(), cfg), 1e-3,
                            charged_copy_rate(cfg))


class Planner:
    """The candidate table of a run and the decisions taken from it.

    Every rank builds the same table (a deterministic trace) and measures with seconds averaged
    over ranks, so every rank takes the same decision without another collective.

    Args:
        candidates: from :func:`make_candidates`.
        budget_bytes: device bytes a rank may use (None = unbounded).
        prober: ``prober(candidate, samples) -> seconds or None``: times the forward and backward
            of the first ``samples`` of a rank batch (a multiple of the candidate's micro-batch)
            at the candidate on the real engine (None when it ran out of memory); set by the
            loop. None = no timing.
        shortlist: time fewer candidates (``memory.levers auto``, whose lever combinations
            multiply them): the largest fitting micro-batch of each combination, then the other
            micro-batches of the fastest combination only (:meth:`measure_shortlist`).
        copy_bytes_per_s: charge each probe the host copies of offloaded activations at this
            rate (:func:`lever_cost`; bytes/s), where the probe cannot show them (a CPU run, whose
            host is its device); None = the probe's time as measured (a GPU run's copies are in it).
        probe_budget_steps: step times of the fastest plan timed that one choice (:meth:`initial`,
            :meth:`after_oom`) may spend probing (:func:`probe_budget_steps`), counted from the
            probes' agreed seconds (× :data:`memtrain.step.PROBE_REPEATS`), so every rank stops at
            the same probe; None = every plan worth timing is timed.

    Attributes:
        bound_bytes: the budget as learned: after an out-of-memory error, at most the predicted
            peak of the plan that failed, minus one byte.
        host_room_bytes: host bytes a rank's offloaded activations may take (None = unbounded).
        budget_source: what sets ``budget_bytes`` on a CPU run, whose device is the host
            (:attr:`memtrain.memory.host_limit.HostLimit.source`: ``RLIMIT_DATA``, a cgroup, …);
            None = the device (or unbounded).
        probes: ``(probes, seconds)`` the last choice spent timing (seconds as agreed by the ranks).

    A candidate is not timed when one of the same micro-batch whose every lever is at a setting
    at least as fast (the levers' choices are fastest first) is timed and fits: it cannot be the
    faster (e.g. activation checkpointing on where it is off fits).
    """

    def __init__(self, candidates: list[Candidate], budget_bytes: Optional[int],
                 prober: Optional[Callable[[Candidate], Optional[float]]] = None, shortlist: bool = False,
                 copy_bytes_per_s: Optional[float] = None, probe_budget_steps: Optional[float] = None):
        self.candidates = candidates
        self.probe_budget_steps = probe_budget_steps
        self.probes: tuple[int, float] = (0, 0.0)
        self._speed: dict[str, dict[Any, int]] = {}  # lever -> setting -> rank, fastest 0 (make_candidates' order)
        for c in candidates:
            for name, setting in c.plan.levers:
                self._speed.setdefault(name, {}).setdefault(setting, len(self._speed[name]))
        self.copy_bytes_per_s = copy_bytes_per_s
        self.budget_bytes = self.bound_bytes = budget_bytes
        self.host_room_bytes: Optional[int] = None
        self.budget_source: Optional[str] = None
        self.prober = prober
        self.shortlist = shortlist
        self._warmed_up = False  # the process's first probe runs twice (cold start)
        self._probe_unit: Optional[int] = None  # fixed at the first probe: see probe_samples

    def restrict_budget(self, budget_bytes: Optional[int], host_room_bytes: Optional[int] = None) -> None:
        """Plan for ``budget_bytes`` (e.g. the smallest of all ranks' budgets) and ``host_room_bytes``
        (host bytes a rank's offloaded activations may take, None = unbounded:
        :func:`memtrain.memory.machine.offload_host_room_bytes`): candidates above either no
        longer fit (the host bytes of each candidate's levers, :attr:`memtrain.levers.LeverCost.host_room_bytes`)."""
        self.budget_bytes = self.bound_bytes = budget_bytes
        self.host_room_bytes = host_room_bytes
        for c in self.candidates:
            c.fits = ((budget_bytes is None or c.planned_bytes <= budget_bytes)
                      and (host_room_bytes is None or lever_cost(c).host_room_bytes <= host_room_bytes))

    def get(self, plan: Plan) -> Optional[Candidate]:
        """The candidate of ``plan``, or None."""
        return next((c for c in self.candidates if c.plan == plan), None)

    def fitting(self, below: Optional[int] = None) -> list[Candidate]:
        """Candidates predicted to fit the learned bound (and need less than ``below`` bytes)."""
        return [c for c in self.candidates if self._open(c) and (below is None or c.predicted_peak_bytes < below)]

    def measure(self, pool: list[Candidate]) -> None:
        """Time each not yet measured candidate of ``pool`` (largest micro-batch first), then
        again the contenders, each keeping its best time: once more each within
        :data:`CONTENDER_RATIO` × the fastest (at least the two fastest), and a third time each
        still within :data:`CLOSE_RATIO` × the fastest when two or more are. A probe is a step,
        or part of one (:meth:`probe_samples`), on a machine whose step times vary by tens of
        percent, and the first probes, which are of the largest (usually fastest) micro-batches,
        run while the process still warms up (after an OOM, for several steps). The process's
        first probe runs twice too (its first run pays for the allocator and the engine's
        set-up). A candidate that runs out of memory no longer fits and lowers the bound."""
        if self.prober is None:
            return
        timed = []
        for c in pool:
            if c.measured_step_s is not None or not self._open(c):
                continue  # known, or needs more than something that just failed
            if self._dominated(c):
                continue
            if self._spent():
                break
            if not self._warmed_up:
                self._warmed_up = True
                if not self._time(c):
                    continue
            if self._time(c):
                timed.append(c)
        self._time_again(timed, CONTENDER_RATIO, at_least=2)
        self._time_again(timed, CLOSE_RATIO, at_least=1)

    def _time_again(self, timed: list[Candidate], ratio: float, at_least: int) -> None:
        """One more probe of each of ``timed`` (fastest first) within ``ratio`` × the fastest's
        time, or among the ``at_least`` fastest; none when that leaves fewer than two."""
        ranked = sorted((c for c in timed if c.fits), key=lambda c: c.step_s)
        if len(ranked) < 2:
            return
        limit = ratio * ranked[0].step_s
        contenders = [c for i, c in enumerate(ranked) if i < at_least or c.step_s <= limit]
        if len(contenders) > 1:
            for c in contenders:
                if self._spent():
                    return
                self._time(c)

    def _dominated(self, c: Candidate) -> bool:
        """A timed candidate of ``c``'s micro-batch that may still be chosen has every lever at a setting at least as fast."""
        return any(t is not c and self._open(t) and t.measured_step_s is not None and t.micro_batch_size == c.micro_batch_size
                   and all(self._speed[n][t.plan.lever(n)] <= self._speed[n][s] for n, s in c.plan.levers)
                   for t in self.candidates)

    def _spent(self) -> bool:
        """This choice's probes used :attr:`probe_budget_steps` step times of the fastest plan timed."""
        timed = [c.measured_step_s for c in self.candidates if self._open(c) and c.measured_step_s is not None]
        return (self.probe_budget_steps is not None and bool(timed)
                and self.probes[1] >= self.probe_budget_steps * min(timed))

    def _open(self, c: Candidate) -> bool:
        """``c`` may still be chosen: predicted to fit, and to need no more than the learned bound."""
        return c.fits and (self.bound_bytes is None or c.predicted_peak_bytes <= self.bound_bytes)

    def _begin_choice(self) -> None:
        self.probes = (0, 0.0)

    def probe_samples(self, c: Candidate) -> int:
        """Samples a probe of ``c`` times: :data:`PROBE_MICRO_BATCHES` × the least common multiple
        of the micro-batches that fit at the table's first probe (the largest of them when they
        are powers of two), or that multiple once when the product does not divide the rank
        batch; never more than the rank batch. The same for every candidate of the table (a later
        candidate whose micro-batch does not divide it gets a multiple of both), so scaled times
        compare alike.

        Returns:
            Samples (a multiple of ``c.micro_batch_size`` dividing the rank batch).
        """
        per_rank = self._per_rank_batch()
        if self._probe_unit is None:
            self._probe_unit = math.lcm(*(f.micro_batch_size for f in self.fitting()), c.micro_batch_size)
        unit = math.lcm(self._probe_unit, c.micro_batch_size)
        return unit * PROBE_MICRO_BATCHES if per_rank % (unit * PROBE_MICRO_BATCHES) == 0 else unit

    def _time(self, c: Candidate) -> bool:
        """One probe of ``c``, scaled to a whole rank batch: keeps its best time so far; False (and
        refuted) when it ran out of memory."""
        samples = self.probe_samples(c)
        seconds = self.prober(c, samples)
        self.probes = (self.probes[0] + 1, self.probes[1] + PROBE_REPEATS * (seconds or 0.0))
        if seconds is None:
            self.refute(c)
            return False
        seconds *= self._per_rank_batch() / samples
        if self.copy_bytes_per_s is not None:
            seconds += lever_cost(c, self.copy_bytes_per_s).seconds
        c.measured_step_s = seconds if c.measured_step_s is None else min(seconds, c.measured_step_s)
        return True

    def refute(self, failed: Candidate) -> None:
        """``failed`` ran out of memory: it does not fit, and neither does anything predicted to need as much."""
        failed.fits = False
        bound = failed.predicted_peak_bytes - 1
        self.bound_bytes = bound if self.bound_bytes is None else min(self.bound_bytes, bound)

    def fastest(self, pool: list[Candidate]) -> Optional[Candidate]:
        """The fastest candidate of ``pool`` that still fits: by measured time where measured,
        else the fewest micro-batches, the levers' fastest settings first (the order of
        :func:`make_candidates`)."""
        pool = [c for c in pool if c.fits]
        if not pool:
            return None
        timed = [c for c in pool if c.step_s is not None]
        best = min(timed, key=lambda c: c.step_s) if timed else pool[0]
        for c in self.candidates:
            c.chosen = c is best
        return best

    def initial(self) -> Optional[Candidate]:
        """The plan before step 1: the fastest candidate predicted to fit (all fitting ones timed,
        or a shortlist of them)."""
        self._begin_choice()
        (self.measure_shortlist if self.shortlist else self.measure)(self.fitting())
        return self.fastest(self.fitting())

    def measure_shortlist(self, pool: list[Candidate]) -> None:
        """Time the largest micro-batch of ``pool`` in each lever combination (what each lever
        costs, measured), then every micro-batch of the fastest combination; a combination whose
        probe ran out of memory is tried again at its next micro-batch."""
        combos: dict[tuple, list[Candidate]] = {}
        for c in pool:  # largest micro-batch first (make_candidates' order)
            combos.setdefault(c.plan.levers, []).append(c)
        firsts = []
        for options in combos.values():
            for c in options:
                self.measure([c])
                if c.fits and c.measured_step_s is not None:
                    firsts.append(c)
                    break
        self._time_again(firsts, CONTENDER_RATIO, at_least=2)  # one probe each is noisy: the close ones again
        firsts = [c for c in firsts if c in self.fitting()]  # a later probe may have refuted it or lowered the bound
        if firsts:
            self.measure(combos[min(firsts, key=lambda c: c.step_s).plan.levers])

    def after_oom(self, plan: Plan) -> Optional[Candidate]:
        """The plan to retry with after ``plan`` ran out of memory: the fastest candidate
        predicted to need less; None = nothing left."""
        failed = self.get(plan)
        if failed is None:
            return None
        self.refute(failed)
        self._begin_choice()
        pool = self.fitting(below=failed.predicted_peak_bytes)
        (self.measure_shortlist if self.shortlist else self.measure)(pool)
        return self.fastest(self.fitting(below=failed.predicted_peak_bytes))

    def faster_than(self, plan: Plan) -> Optional[Candidate]:
        """For grow-back: among measured candidates faster than ``plan``, the one needing the
        least memory above it (the smallest step up); None = none."""
        current = self.get(plan)
        if current is None or current.step_s is None:
            return None
        faster = [c for c in self.candidates if c.step_s is not None
                  and c.step_s < current.step_s
                  and c.predicted_peak_bytes > current.predicted_peak_bytes]
        return min(faster, key=lambda c: c.predicted_peak_bytes, default=None)

    def confirm(self, candidate: Candidate) -> None:
        """``candidate`` completed a step after a grow-back: it fits, whatever the bound said."""
        candidate.fits = True
        if self.bound_bytes is not None and candidate.predicted_peak_bytes > self.bound_bytes:
            self.bound_bytes = candidate.predicted_peak_bytes

    def state_dict(self) -> dict:
        """What was learned (the bound, measured times without the charged copies, refuted
        candidates), for checkpoints."""
        return {"bound_bytes": self.bound_bytes, "per_rank_batch": self._per_rank_batch(), "copies_apart": True,
                "candidates": [[c.micro_batch_size, c.plan.settings(), None if c.step_s is None else
                                c.step_s - self._charged(c), c.measured_step_s is not None, c.fits]
                               for c in self.candidates]}

    def _charged(self, c: Candidate) -> float:
        """The lever seconds (copies) charged to ``c``'s measured time at this planner's rate (0 when
        not measured)."""
        return lever_cost(c, self.copy_bytes_per_s).seconds if self.copy_bytes_per_s and c.measured_step_s is not None else 0.0

    def _per_rank_batch(self) -> int:
        return self.candidates[0].micro_batch_size * self.candidates[0].gradient_accumulation_steps if self.candidates else 0

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` on top of this device's predictions: the bound is the smaller
        of the saved one and this device's budget, a candidate fits if it did then and is predicted
        to now, a measured time is charged its copies at this run's rate (a table saved before
        the charge was kept apart keeps its times as saved). A saved table of another
        per-rank batch (another world size) is ignored. Tables written before levers existed name
        activation checkpointing by a bool."""
        if state.get("per_rank_batch") != self._per_rank_batch():
            return
        saved = state.get("bound_bytes")
        if saved is not None:
            self.bound_bytes = saved if self.bound_bytes is None else min(saved, self.bound_bytes)
        for micro, settings, seconds, measured, fits in state.get("candidates", []):
            settings = restore_settings(settings)
            c = next((c for c in self.candidates if c.micro_batch_size == micro
                      and all(c.plan.lever(k) == v for k, v in settings.items())), None)
            if c is not None:
                c.fits = fits and c.fits
                if measured:
                    c.measured_step_s = seconds
                    c.measured_step_s += self._charged(c) if state.get("copies_apart") else 0.0  # at today's rate
                else:
                    c.predicted_step_s = seconds


def build_planner(cfg, corpus, objective, precision: str, device: torch.device, state: Mapping[str, int],
                  per_rank_batch: int, choices: Mapping[str, tuple], source=None,
                  engine: Optional[str] = None) -> Planner:
    """The run's planner: candidates of ``per_rank_batch`` and the levers' ``choices``, with peaks
    predicted from a fake trace of ``cfg``'s model, against :func:`memtrain.memory.machine.run_device_budget`
    (a CPU run's device is the host: its budget is a rank's share of the host's real limit, whose
    source the planner's ``budget_source`` names).

    Args:
        state: the engine's model state on this rank (a ``model_state_bytes`` dict, bytes).
        source: the :class:`memtrain.models.ModelSource` (None: ``cfg``'s model).
        engine: the run's engine (``ddp|fsdp|deepspeed``, its mixed precision traced; None: ``cfg``'s).
    """
    # the simulated device counts state + saved bytes exactly (no CUDA headroom even on a GPU host,
    # the state one constant: no accumulation term)
    simulated = cfg.faults.memory_budget_mib > 0
    device_type = "cpu" if simulated else device.type
    acts = activation_table(cfg, corpus, objective, precision, device_type, source, engine)
    candidates = make_candidates(per_rank_batch, choices, device_state_bytes(state), acts, device_type, None,
                                 *state_terms(state, device_type, simulated))
    # read after the trace: on a CPU what the trace leaves in the process (17 MiB on the tiny GPT-2 of
    # tests/test_host_oom.py) stays for the run and is not the plan's to use
    budget, host = run_device_budget(cfg, device, state_bytes=device_state_bytes(state))  # a CPU's: the host limit
    planner = Planner(candidates, budget, shortlist=cfg.memory.levers == "auto",
                      copy_bytes_per_s=charged_copy_rate(cfg) if device.type == "cpu" else None,
                      probe_budget_steps=probe_budget_steps(cfg.training.max_steps))
    planner.restrict_budget(budget, offload_host_room_bytes(cfg, device))  # build.py: every rank's smallest rules
    planner.budget_source = host.source if host is not None else None
    return planner
