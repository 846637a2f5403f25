"""The activation bytes of a candidate plan, traced without allocating: the run's model built on
the meta device with fake parameters (``torch._subclasses.fake_tensor.FakeTensorMode``), the plan's
model levers applied, one micro-batch's forward and backward counted
(:mod:`memtrain.memory.step_trace`); a model of many alike blocks traced at a few depths and
extrapolated where exact (:func:`memtrain.memory.depth.by_depth`). The planner
(:mod:`memtrain.planning.planner`), the placement table and ``memtrain plan`` read these tables."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.backends import engine_module, engine_name
from memtrain.backends.ds_config import linear_saves_weight
from memtrain.backends.spec import user_zero_settings
from memtrain.fingerprint import weight_bytes as fingerprint_weight_bytes
from memtrain.levers import LeverTarget, apply_levers, block_period, lever
from memtrain.levers.activation_offload import moved_bytes
from memtrain.memory import step_trace
from memtrain.memory.zero_accounting import ZERO3_PERSISTENCE_THRESHOLD
from memtrain.memory.depth import by_depth
from memtrain.memory.simulated import SimulatedMemory
from memtrain.memory.step_trace import compute_precision_model, fake_batch
from memtrain.models import ModelSource, repeated_blocks
from memtrain.plan import Plan


def traced_activation_bytes(model: nn.Module, mode, objective, micro_batch: dict[str, torch.Tensor]) -> int:
    """Peak bytes autograd saves for backward in one training forward of ``micro_batch`` (counted
    by :class:`memtrain.memory.simulated.SimulatedMemory`, parameters excluded).

    Args:
        model: a :func:`memtrain.memory.step_trace.fake_model` (AC switched as wanted); mode: its ``FakeTensorMode``.
        objective: the run's objective (:mod:`memtrain.objectives`).
        micro_batch: tensors [B, …] on any device (made fakes on the model's device here).
    """
    counter = SimulatedMemory(2**62, 0, model.parameters())
    with mode:
        batch = fake_batch(mode, micro_batch, next(model.parameters()).device)
        with torch.enable_grad(), counter.context():
            loss = objective.loss_sum(model, batch)
        del loss
    return counter.peak_bytes


def trace_batch(corpus, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """The micro-batch the planner traces: the first samples, or for corpora of varying length
    (speech) the longest ones, so the prediction holds for every step; a corpus of fewer samples
    is repeated, as the sampler's next epoch fills a batch."""
    import numpy as np

    lengths = getattr(corpus.train, "lengths", None)
    n = len(lengths) if lengths is not None else len(corpus.train)
    order = np.arange(n) if lengths is None else np.argsort(lengths, kind="stable")[::-1]
    return corpus.train.batch([int(i) for i in np.resize(order, micro_batch_size)])


def resident_bytes(micro_batch: dict[str, torch.Tensor], gradient_accumulation_steps: int) -> int:
    """Bytes a rank holds through a whole step beside the model state: its batch on the device
    (``gradient_accumulation_steps`` × the bytes of ``micro_batch``'s tensors [B, …]) and the
    data fingerprint's column weights for that micro-batch (:func:`memtrain.fingerprint.weight_bytes`)."""
    micro_bytes = sum(t.nbytes for t in micro_batch.values() if isinstance(t, torch.Tensor))
    return micro_bytes * gradient_accumulation_steps + fingerprint_weight_bytes(micro_batch)


def _peaks_tracer(cfg, simulated: bool) -> Callable[..., tuple[int, ...]]:
    """``(model, mode, objective, batch) -> peaks`` as one flat tuple of bytes: peak, in_block,
    in_backward, in_block_backward, in_block_forward, the made windows
    (``step_trace.MADE_PEAKS``), the kept views. ``simulated``: the simulated device's count,
    saved bytes alone whatever runs (no made windows). The kept views are traced at the
    persistence threshold ZeRO-3 runs with (larger parameters are gathered, and kept through a
    saved view: :class:`memtrain.memory.step_trace.StepPeaks` ``kept``, read only for an engine
    that gathers them), and with DeepSpeed's memory-efficient linear when ``cfg``'s ZeRO
    settings turn it on."""
    zero = user_zero_settings(cfg)
    kept_numel = zero.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE_THRESHOLD)
    saves_weight = linear_saves_weight(zero)

    def trace(*args) -> tuple[int, ...]:  # step_trace.step_peaks read at the call: a test's stand-in is seen
        if simulated:
            saved = traced_activation_bytes(*args)
            return (saved,) * 5 + (0,) * step_trace.MADE_PEAKS + (saved,) * 4
        peaks = step_trace.step_peaks(*args, kept_numel=kept_numel, linear_saves_weight=saves_weight)
        return (*peaks[:3], peaks.in_block_backward, peaks.in_block_forward, *peaks.made, *peaks.kept)

    return trace


def activation_table(cfg, corpus, objective, precision: str, device_type: str,
                     source=None, engine: Optional[str] = None) -> Callable[[Plan], int]:
    """``plan -> traced activation bytes`` of one micro-batch for ``cfg``'s model (built fake here,
    the plan's model levers applied to it as to the real model: :mod:`memtrain.levers`; results
    cached per micro-batch and model-lever settings). ``objective`` is not changed (a copy is traced).
    Its attribute ``offloaded_bytes`` is ``plan -> bytes`` the plan's activation offload moves to
    the host in that micro-batch (each way; 0 without offload), traced alike; ``peaks`` is
    ``plan -> (peak, in_block, in_backward, resident, kept, in_block_backward, in_block_forward, made)`` (:class:`memtrain.memory.step_trace.StepPeaks`,
    ``kept`` traced at the persistence threshold ZeRO-3 runs with; under a simulated device every
    one the peak and nothing resident). ``resident`` is the rank's
    batch on the device (accumulation × the bytes of the traced micro-batch, the longest samples
    of a corpus of varying length, :func:`trace_batch`; not a batch that large built): the loop
    holds it through the whole step, which MemTracker counts (a speech rank batch of 16
    utterances of 2.8 s: 8.6 MB, a third of its peak); and the data fingerprint's column weights
    for that micro-batch, held through the whole run (:func:`memtrain.fingerprint.weight_bytes`).

    The bytes are the peak of the micro-step's forward and backward beyond model state (saved
    activations and transients: :func:`memtrain.memory.step_trace.step_peaks`), except under
    a simulated device (``faults.memory_budget_mib``), which counts what autograd saves and nothing
    else: there they are that count (:func:`traced_activation_bytes`), so the planner predicts
    what the simulated device will count. ``source``: the :class:`memtrain.models.ModelSource`
    (None: ``cfg``'s model). ``engine``: whose mixed precision the trace follows (None: ``cfg``'s,
    :func:`memtrain.backends.engine_name`; its ``AUTOCAST_MIXED_PRECISION``).

    Raises:
        RuntimeError, NotImplementedError: the model cannot be traced with fake tensors.
        memtrain.errors.ConfigError: a lever the model cannot take (chunked cross-entropy).
    """
    source = source or ModelSource.of(cfg, corpus)
    engine = engine or engine_name(cfg.backend)
    autocast = engine_module(engine).AUTOCAST_MIXED_PRECISION
    model, mode, extra = compute_precision_model(source.build_meta, precision, device_type, autocast)
    target = LeverTarget(model, repeated_blocks(model), copy.copy(objective), cfg)
    simulated = cfg.faults.memory_budget_mib > 0
    cache: dict[tuple, tuple[step_trace.StepPeaks, int]] = {}
    batches: dict[int, dict[str, torch.Tensor]] = {}  # by micro-batch size: built once for every lever setting

    def batch_of(micro: int) -> dict[str, torch.Tensor]:
        if micro not in batches:
            batches[micro] = trace_batch(corpus, micro)
        return batches[micro]

    trace = _peaks_tracer(cfg, simulated)

    def traced(plan: Plan) -> tuple[step_trace.StepPeaks, int]:
        settings = {name: setting for name, setting in plan.levers if lever(name).model_lever}
        key = (plan.micro_batch_size, tuple(settings.items()))
        if key not in cache:
            apply_levers(target, settings)
            batch = batch_of(plan.micro_batch_size)
            period = block_period(settings, cfg)

            def traced_once() -> tuple[int, ...]:
                moved_bytes(model)  # from 0 (a shortened trace that raised may have counted)
                return (*trace(model, mode, target.objective, batch), moved_bytes(model))

            *peaks, moved = by_depth(model, target.blocks, period, traced_once)
            kept_at = 5 + step_trace.MADE_PEAKS
            made = tuple(extra + p for p in peaks[5:kept_at]) if peaks[5] else ()
            peaks = [extra + p for p in peaks]
            cache[key] = (step_trace.StepPeaks(*peaks[:3], kept=tuple(peaks[kept_at:]), in_block_backward=peaks[3],
                                               in_block_forward=peaks[4], made=made), moved)
        return cache[key]

    def activation_bytes(plan: Plan) -> int:
        return traced(plan)[0][0]

    activation_bytes.peaks = lambda plan: traced(plan)[0]._replace(
        resident=0 if simulated else resident_bytes(batch_of(plan.micro_batch_size), plan.gradient_accumulation_steps))
    activation_bytes.offloaded_bytes = lambda plan: traced(plan)[1]
    return activation_bytes


def activation_tables(cfg, corpus, objective, precision: str, device_type: str,
                      source=None) -> Callable[[str], Callable[[Plan], int]]:
    """``engine -> plan -> bytes``: :func:`activation_table` per engine, built on first use and shared
    by engines that compute alike (one table in fp32; in bf16/fp16 one for the autocast engines,
    their modules' ``AUTOCAST_MIXED_PRECISION``, one for the rest)."""
    tables: dict[bool, Callable[[Plan], int]] = {}

    def for_engine(engine: str) -> Callable[[Plan], int]:
        autocast = precision in ("bf16", "fp16") and engine_module(engine).AUTOCAST_MIXED_PRECISION
        if autocast not in tables:
            tables[autocast] = activation_table(cfg, corpus, objective, precision, device_type, source, engine)
        return tables[autocast]

    return for_engine
