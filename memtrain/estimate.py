"""What a run will need, before it runs: the planner's candidate plans (:mod:`memtrain.planning.planner`)
with predicted peak bytes and step seconds, and bytes of parameters, gradients and optimizer
state per engine, ZeRO stage and offload. Nothing is allocated: activations are traced with fake
tensors, so planning a 10B-parameter model takes seconds on a laptop.

    memtrain plan --config recipes/code_lm_350m.yaml [--world_size 8] [--gpu_memory_gib 80]
                  [--host_memory_gib 128] [--nvme_path DIR] [--json]
    memtrain memory --config recipes/code_lm_350m.yaml [--world_size 8]    # the same report, one JSON object

``plan`` is the code a run with ``training.micro_batch_size: auto`` calls, minus the timing, and
the placement planner of ``backend.offload: auto`` (:mod:`memtrain.planning.placement`): where model
state lives, with device and host bytes. Model state is counted by :mod:`memtrain.memory.accounting`
(each engine's formula, following the ZeRO paper, Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", §3.1 and §5; ZeRO's reduce bucket and
ZeRO-3's whole small parameters included). A micro-step's activations are the peak of its traced
forward and backward (:mod:`memtrain.memory.step_trace`). Not counted in the candidates: one
gathered block under FSDP2/ZeRO-3 (the placements add it) and DDP's flat all-reduce bucket, which
lives after backward, when the activations are gone.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
from typing import Optional

import torch
from torch import nn

from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
from memtrain.backends import engine_module, engine_name, engine_variants, model_state_bytes, writes_format
from memtrain.models import repeated_blocks
from memtrain.config import ConfigError, parse_args
from memtrain.data import build_corpus
from memtrain.distributed import prepare_libraries
from memtrain.launcher import apply_accelerate_settings
from memtrain.levers import LEVERS, first_settings, lever_choices, plan_words
from memtrain.levers.activation_checkpointing import setting
from memtrain.levers.optimizer_state import STATE_DTYPES, choose_charging_steps
from memtrain.memory.accounting import device_state_bytes
from memtrain.memory.peak import state_peak_tensor_bytes
from memtrain.memory.machine import (DEFAULT_GPU_FLOPS, Machine, PLAN_PROCESS_BYTES, REFERENCE_CPU_ADAM_PARAMS_PER_S,
                                     cpu_adam_params_per_s, device_flops_per_s, optimizer_params_per_s, process_bytes,
                                     run_device_budget, run_host_limit)
from memtrain.planning.placement import (Placement, allowed_pool, choose, configured_state_bytes, format_placements,
                                       model_facts, nvme_usable, plan_model, planning_pool, tokens_per_sample,
                                       with_state_dtype)
from memtrain.planning.activations import activation_tables
from memtrain.planning.resumed import switch_read, with_resumed_switch
from memtrain.planning.run_placement import configured_spec
from memtrain.planning.planner import Planner, estimated_plan_s, make_candidates, state_terms
from memtrain.memory.simulated import SimulatedMemory
from memtrain.objectives import CausalLM
from memtrain.backends.optimizer_offload import host_step_params_per_s
from memtrain.plan import Plan
from memtrain.precision import resolve_precision
from memtrain.validation import validate


def activation_bytes(model: nn.Module, micro_batch: dict[str, torch.Tensor], activation_checkpointing="off",
                     every_n_blocks: int = 1, objective=None) -> int:
    """Bytes of activations one training forward keeps for backward (a copy of ``model`` is used).

    Args:
        model: the unwrapped model (not modified).
        micro_batch: ``input_ids`` and ``labels`` int64 [B, T] (or what ``objective`` takes).
        activation_checkpointing: ``off``, ``selective`` or ``on`` (a bool: on/off).
        every_n_blocks: checkpoint every n-th block when on or selective.
        objective: a :mod:`memtrain.objectives` objective; None = causal LM.

    Returns:
        Bytes saved for backward by the forward and the loss.
    """
    objective = objective or CausalLM()
    probe = copy.deepcopy(model).train()
    mode = setting(activation_checkpointing)
    if mode != "off":
        enable_activation_checkpointing(probe, repeated_blocks(probe), every_n_blocks, mode)
    counter = SimulatedMemory(2**62, 0, probe.parameters())
    with torch.enable_grad(), counter.context():
        loss = objective.loss_sum(probe, micro_batch)
    del loss
    return counter.peak_bytes


NOTE = ("activations: the peak of a micro-step's forward and backward traced with fake tensors (no memory used); step "
        "seconds estimated from FLOPs at this machine's matmul speed (a run with training.micro_batch_size auto measures "
        "them); gathered blocks are in the placements only")
"""The report's ``note``: how its numbers were made."""


def plan_report(cfg, world_size: int, gpu_memory_gib: Optional[float] = None,
                host_memory_gib: Optional[float] = None, nvme_path: Optional[str] = None,
                cpu_adam_params_per_s: Optional[float] = None, nodes: int = 1,
                gpu_tflops: Optional[float] = None) -> dict:
    """The planner's view of a config before it runs, without allocating the model: the
    candidate plans of ``training.global_batch_size / world_size`` samples per rank with their
    predicted peak bytes and step seconds, and the model state of every engine variant.

    Args:
        world_size: ranks the run will have.
        gpu_memory_gib: the GPU memory of a rank (a GPU run is planned: CUDA headroom applies);
            None = this machine's (``faults.memory_budget_mib``, the CUDA memory or its cap).
        host_memory_gib: host memory of the machine (its ranks together); None =
            ``memory.host_memory_gib``, else this machine's available memory.
        nvme_path: a folder for NVMe offload placements.
        cpu_adam_params_per_s: the target host's CPU Adam rate (parameters/s, all cores); None =
            :data:`memtrain.memory.machine.REFERENCE_CPU_ADAM_PARAMS_PER_S` when another machine is
            described (``gpu_memory_gib`` or ``host_memory_gib`` given), else measured here (the
            report's ``cpu_adam_source`` says which).
        nodes: machines the ranks are spread over (``world_size / nodes`` ranks share a host).
        gpu_tflops: the target GPU's rate for step seconds (:func:`_target_flops`).

    Returns:
        A JSON-serialisable dict: ``parameters``, ``precision``, ``world_size``, ``engine``,
        ``budget_bytes``, ``candidates`` (:class:`memtrain.planning.planner.Candidate` dicts),
        ``model_state_bytes`` (per engine variant), ``activation_bytes`` (``training.micro_batch_size``'s,
        or under ``auto`` the chosen one's: off/on), ``placements`` (:class:`memtrain.planning.placement.Placement`
        dicts, the fastest fitting one ``chosen``) and the ``machine`` they were planned for.
    """
    device_type = "cuda" if torch.cuda.is_available() or gpu_memory_gib else "cpu"
    precision = _planned_precision(cfg.precision, device_type)
    corpus = build_corpus(cfg.data)
    shape, objective = model_facts(cfg, corpus)  # on the meta device: nothing allocated
    n = shape.parameters
    spec = configured_spec(cfg, world_size)
    choices = lever_choices(cfg, spec, model_only=True)  # engine's: state bytes
    budget, host_limit = ((int(gpu_memory_gib * 2**30), None) if gpu_memory_gib else
                          run_device_budget(cfg, torch.device(device_type), world_size // nodes))
    tables = activation_tables(cfg, corpus, objective, precision, device_type)
    flops = _target_flops(gpu_tflops, device_type)
    tokens = tokens_per_sample(cfg, corpus)
    adam, adam_source = _cpu_adam_rate(cpu_adam_params_per_s, gpu_memory_gib is not None or host_memory_gib is not None)
    machine, placements = _placements(cfg, spec, shape, n, precision, world_size, device_type, budget, flops, tables, tokens,
                                      host_memory_gib, nvme_path, gpu_memory_gib is not None, adam, nodes)
    run = next((p for p in placements if p.chosen), None)  # its optimizer state dtype, where the planner chose it
    cfg = with_state_dtype(cfg, run.state_dtype) if run is not None and run.state_dtype != cfg.optimizer.state_dtype else cfg
    engines, engine, state = _model_states(cfg, shape, precision, world_size)
    acts, per_rank, state_on_device = tables(engine), cfg.training.global_batch_size // world_size, device_state_bytes(state)
    terms = state_terms(state, device_type, simulated=cfg.faults.memory_budget_mib > 0)
    planner = Planner(make_candidates(per_rank, choices, state_on_device, acts, device_type, budget, *terms), budget)
    for c in planner.candidates:
        c.predicted_step_s = estimated_plan_s(c, cfg, n, tokens, flops)
    chosen = run_plan(planner, cfg, choices)
    micro = chosen.micro_batch_size if chosen is not None else (
        cfg.training.micro_batch_size if cfg.training.micro_batch_size != "auto" else 1)
    ac_bytes = {ac: peaks[0] for ac, peaks in _activation_bytes_by_ac(acts, choices, micro, per_rank).items()}
    return {
        "parameters": n, "trained_parameters": shape.trained, "precision": precision, "world_size": world_size,
        "engine": engine,
        "micro_batch_given": cfg.training.micro_batch_size != "auto", "device": device_type, "budget_bytes": budget,
        "seq_len": cfg.data.seq_len, "micro_batch_size": micro,
        "candidates": [c.as_dict() for c in planner.candidates],
        "activation_bytes": ac_bytes,
        "model_state_bytes": engines,
        "placements": [p.as_dict() for p in placements],
        "machine": machine.as_dict(),
        "cpu_adam_source": adam_source, "placement_decides": cfg.backend.offload == "auto",
        "budget_source": host_limit.source if host_limit is not None else "the GPU given" if gpu_memory_gib else "the device",
        "per_rank_total_bytes": _per_rank_totals(engines, tables, choices, micro, per_rank),
        "optimizer_state_dtype": cfg.optimizer.state_dtype,
        "optimizer_state_bytes": {d: engine_module(engine).optimizer_state_bytes(d, shape, world_size)
                                  for d in STATE_DTYPES} if engine_module(engine).LOSSY_OPTIMIZER_STATE else {},
        "note": NOTE,
    }


def _model_states(cfg, shape, precision: str, world_size: int) -> tuple[dict, str, dict]:
    """``(model state bytes per engine variant, the run's engine, its model state bytes)`` with the
    config's ``optimizer.state_dtype`` (DeepSpeed's variants keep fp32); the variants of the engines
    that can write ``checkpoint.format`` only."""
    n, dtype, deferred = shape.parameters, cfg.optimizer.state_dtype, cfg.memory.oom_recovery
    switch = switch_read(cfg, shape)  # a resume from another engine's (or format's) checkpoint: its resume moment
    engines = {v.name: with_resumed_switch(
        model_state_bytes(v.engine, n, precision, v.zero_stage, v.offload, world_size, shape=shape,
                          state_dtype=dtype if engine_module(v.engine).LOSSY_OPTIMIZER_STATE else "fp32",
                          deferred_reduction=deferred), cfg, v.engine, switch)
               for v in engine_variants() if not v.tune_ratio and not v.nvme and writes_format(cfg, v.engine)}
    engine, state = engine_name(cfg.backend), configured_state_bytes(cfg, shape, precision, world_size)
    return engines, engine, with_resumed_switch(state, cfg, engine, switch)


def _cpu_adam_rate(given: Optional[float], target: bool) -> tuple[Optional[float], str]:
    """``(rate, source)``: the CPU Adam rate a plan assumes, parameters/s — the one ``given``, else
    for another machine (``target``) the reference rate, else None (measured here)."""
    if given:
        return given, "given"
    return (REFERENCE_CPU_ADAM_PARAMS_PER_S, "reference") if target else (None, "measured on this machine")


def run_plan(planner, cfg, choices: dict):
    """The candidate the run will start with, marked ``chosen``: with a fixed
    ``training.micro_batch_size``, that micro-batch with each lever's configured (first) setting,
    as :func:`memtrain.build.make_controller` starts it, whether or not it is predicted to fit;
    under ``auto``, the fastest fitting candidate (:meth:`memtrain.planning.planner.Planner.fastest`)."""
    micro = cfg.training.micro_batch_size
    if micro == "auto":
        return planner.fastest(planner.fitting())

    run = next((c for c in planner.candidates if c.micro_batch_size == micro
                and all(c.plan.lever(k) == v for k, v in first_settings(choices).items())), None)
    for c in planner.candidates:
        c.chosen = c is run
    return run


def _planned_precision(precision: str, device_type: str) -> str:
    """``precision`` resolved for ``device_type`` (bf16 for ``auto`` when planning a GPU run on a
    machine without one)."""
    try:
        return resolve_precision(precision, device_type)
    except Exception:  # planning a GPU run on a machine without one
        return "bf16" if precision == "auto" else precision


def _per_rank_totals(engines: dict, tables, choices: dict, micro: int, per_rank: int) -> dict[str, dict[str, int]]:
    """``{variant: {"off"|"on": bytes}}``: each engine variant's device state and its engine's traced
    activations (AC off / on) at their peak (:func:`memtrain.memory.peak.state_peak_tensor_bytes`)
    in the plan of ``micro``-sample micro-batches, which accumulates where ``micro < per_rank``."""
    engine_of = {v.name: v.engine for v in engine_variants()}
    acts = functools.lru_cache(lambda engine: _activation_bytes_by_ac(tables(engine), choices, micro, per_rank))
    accumulating = per_rank // micro > 1
    return {name: {ac: state_peak_tensor_bytes(e, acts(engine_of[name])[ac], accumulating=accumulating)
                   for ac in ("off", "on")} for name, e in engines.items()}


def _activation_bytes_by_ac(acts, choices: dict, micro: int, per_rank: int) -> dict[str, tuple[int, int, int]]:
    """``{"off"|"selective"|"on": (peak, in_block, in_backward)}``: one micro-batch of ``micro``
    samples traced with each activation checkpointing setting (the other levers at their first
    choice): its peaks in bytes (``acts.peaks``, :class:`memtrain.memory.step_trace.StepPeaks`)."""
    first = first_settings(choices)
    plans = {ac: Plan(micro, per_rank // micro, tuple({**first, "activation_checkpointing": ac}.items()))
             for ac in ("off", "selective", "on")}
    return {ac: acts.peaks(plan) for ac, plan in plans.items()}


def _placements(cfg, spec, shape, n: int, precision: str, world_size: int, device_type: str, budget, flops: float,
                tables, tokens: int, host_memory_gib: Optional[float], nvme_path: Optional[str], gpu_given: bool,
                cpu_adam: Optional[float] = None, nodes: int = 1):
    """The placement table (:mod:`memtrain.planning.placement`) of :func:`plan_report`: every placement of
    :func:`memtrain.planning.placement.planning_pool` (and the config's own, when it names one the
    pool lacks; ``spec`` the engine as configured), the one the run will use marked ``chosen``: the fastest fitting under
    ``backend.offload auto``, else the config's (fitting or not). A GPU given without its host's memory
    (``gpu_given``, no ``host_memory_gib`` here or in the config) plans an unbounded host: each
    placement shows the host memory it needs. ``cpu_adam``: the target's CPU Adam rate (None:
    measured here); ``nodes``: machines sharing the ranks."""
    gpu_here = torch.cuda.is_available()
    if host_memory_gib:
        host, source = int(host_memory_gib * 2**30), "--host_memory_gib"
    elif gpu_given and not cfg.memory.host_memory_gib:
        host, source = None, None  # another machine's GPU, its host not given: show what each placement needs
    else:
        limit = run_host_limit(cfg, world_size // nodes)
        host, source = limit.bytes, limit.source
    here = device_type == "cpu" or gpu_here  # the planned device is this machine's: its rates are measured
    machine = Machine(budget, host, world_size // nodes, device_type, flops, cpu_adam or cpu_adam_params_per_s(),
                      process_bytes(device_type) if here else PLAN_PROCESS_BYTES, nvme_path,
                      optimizer_params_per_s if here and not gpu_given else None,  # a GPU given: maybe another
                      None if cpu_adam else host_step_params_per_s(), source, exports=cfg.checkpoint.export)
    pool = planning_pool(cfg, nvme_usable(nvme_path))
    own = allowed_pool(cfg, nvme_usable(nvme_path))
    names = {p.name for p in pool if not p.tune_ratio}  # a tuned row's name changes with the ratio it takes
    extra = [p for p in own if p.name not in names and not p.tune_ratio]  # auto: own is the pool
    table = plan_model(cfg, spec, tables, shape, tokens, world_size, machine, precision, pool + extra)
    if cfg.backend.offload != "auto":  # the run takes the config's placement (the dtype it chooses), whatever is faster
        own_names = {p.name for p in own}
        rows = [p for p in table if any(p is q for q in extra) or (p.name in own_names and not p.tune_ratio)]
        run = choose_charging_steps(rows, choose, shape.parameters, world_size, machine) or rows[0]
        for p in table:
            p.chosen = p is run
    return machine, table


def _pop_option(argv: list[str], name: str, default=None, flag: bool = False):
    if name not in argv:
        return default
    i = argv.index(name)
    if flag:
        del argv[i]
        return True
    if i + 1 >= len(argv):
        raise ValueError(f"{name} needs a value")
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def format_table(report: dict) -> str:
    """The candidates of :func:`plan_report` as a text table."""
    levers = [(x.name, x.column) for x in LEVERS if any(x.name in c for c in report["candidates"])]
    width = {name: max(len(column), 9) for name, column in levers}
    rows = [f"{'micro':>5} {'accum':>5} " + "".join(f"{column:>{width[name]}} " for name, column in levers)
            + f"{'peak MiB':>10} {'step s':>9} {'fits':>4}  chosen"]
    for c in report["candidates"]:
        step = f"{c['predicted_step_s']:.4f}" if c["predicted_step_s"] is not None else "-"
        settings = "".join(f"{_setting_word(c.get(name)):>{width[name]}} " for name, _ in levers)
        rows.append(f"{c['micro_batch_size']:>5} {c['gradient_accumulation_steps']:>5} {settings}"
                    f"{c['predicted_peak_bytes'] / 2**20:>10.1f} "
                    f"{step:>9} {'yes' if c['fits'] else 'no':>4}  {'*' if c['chosen'] else ''}")
    budget, source = report["budget_bytes"], report.get("budget_source")
    trained = report.get("trained_parameters", report["parameters"])
    train = f" ({trained / 1e6:.2f}M of them train)" if trained != report["parameters"] else ""
    head = (f"{report['parameters'] / 1e6:.1f}M parameters{train}, {report['engine']} × {report['world_size']}, "
            f"{report['precision']}, " + (f"budget {budget / 2**20:.1f} MiB per rank ({source})" if budget
                                          else "unbounded budget"))
    fields = set(Placement.__dataclass_fields__)
    placements = [Placement(**{k: v for k, v in p.items() if k in fields}) for p in report.get("placements", [])]
    host, host_source = ((report.get("machine") or {}).get(k) for k in ("host_bytes", "host_source"))
    return (head + "\n" + "\n".join(rows) + "\n\nplacements (host " +
            (f"{host / 2**30:.1f} GiB, {host_source}," if host else "memory not given: each row shows what it needs") +
            f" for the {(report.get('machine') or {}).get('ranks_per_host') or report['world_size']} rank(s) of a "
            f"machine):\n" + format_placements(placements) + "\n\n" + _optimizer_state_line(report) + verdict(report))


def _optimizer_state_line(report: dict) -> str:
    """What each ``optimizer.state_dtype`` keeps per rank (lossy ones are set by the user, or chosen by
    the placement planner only under ``memory.allow_lossy_levers``)."""
    sizes = report.get("optimizer_state_bytes") or {}
    if not sizes:
        return ""
    size = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"  # noqa: E731
    cells = ", ".join(f"{d} {size(b)}" + (" (this run)" if d == report["optimizer_state_dtype"] else "")
                      for d, b in sizes.items())
    return (f"optimizer state per rank (optimizer.state_dtype): {cells}; bf16 and int8 round the moments every "
            "step (lossy), so only the config, or memory.allow_lossy_levers, turns them on\n")


def _setting_word(value) -> str:
    """A lever's setting in a table cell (``on``/``off`` for a bool)."""
    return ("on" if value else "off") if isinstance(value, bool) else "-" if value is None else str(value)


def verdict(report: dict) -> str:
    """One paragraph in words: what the run will use (under ``backend.offload auto`` the chosen
    placement and its plan; otherwise the marked micro-batch plan on the config's placement), the
    host memory it needs when the host was not given, the CPU Adam rate its step time assumes, or
    what to change when nothing fits."""
    placed = next((p for p in report.get("placements", []) if p.get("chosen")), None)
    if report.get("placement_decides"):
        if placed is None or not placed["fits"]:
            return ("verdict: no placement fits; give a larger --host_memory_gib or --gpu_memory_gib, more ranks, "
                    "--nvme_path, memory.activation_checkpointing selective or on, or a shorter data.seq_len")
        return (f"verdict: backend.offload auto places model state as {placed['name']}, micro-batch "
                f"{placed['micro_batch_size']} × accumulation {placed['gradient_accumulation_steps']} per rank, "
                f"{plan_words({**(placed.get('levers') or {}), 'activation_checkpointing': placed['activation_checkpointing']})}"
                f", about {placed['predicted_step_s']:.2f} s per step" + _bound(placed) + _where(report, placed))
    chosen = next((c for c in report["candidates"] if c["chosen"]), None)
    budget = report["budget_bytes"]
    if chosen is None:
        return ("verdict: no micro-batch plan fits " + (f"{budget / 2**30:.1f} GiB per rank" if budget else "") +
                " with this engine; try another engine or offload (the placements above), more ranks, "
                "memory.activation_checkpointing selective or on, or a shorter data.seq_len")
    words = (f"verdict: micro-batch {chosen['micro_batch_size']} × accumulation {chosen['gradient_accumulation_steps']}"
             f" per rank, {plan_words({x.name: chosen[x.name] for x in LEVERS if x.name in chosen})}"
             f"{' (the config fixes the micro-batch)' if report.get('micro_batch_given') else ''}, predicted "
             f"peak {chosen['predicted_peak_bytes'] / 2**30:.2f} GiB per rank")
    if not chosen["fits"]:
        words += (" — more than fits: the run would start there and recover from the out-of-memory error to a "
                  "smaller plan; set training.micro_batch_size auto to start at the fastest plan that fits")
    words += _where(report, placed) if placed is not None else ""
    if placed is not None and not placed.get("fits_host", True):
        words += ("; nothing fits: a run refuses this placement before building the model (exit 2; plan exits 3): "
                  "give more host memory, offload less, set backend.offload auto, or use backend.nvme_path")
    faster = [p for p in report.get("placements", []) if p["fits"] and placed is not None
              and p["predicted_step_s"] < 0.95 * placed["predicted_step_s"]]
    if faster:
        best = min(faster, key=lambda p: p["predicted_step_s"])
        words += (f"; {best['name']} is predicted faster ({best['predicted_step_s']:.3g} s per step against "
                  f"{placed['predicted_step_s']:.3g}): backend.offload auto lets the run choose the placement")
    return words


def _bound(placed: dict) -> str:
    """The verdict's words on what a placement's step waits for beyond its compute (``bound``)."""
    if placed.get("bound", "device") == "device":
        return ""
    what = "the host's optimizer step" if placed["bound"] == "host" else "the host↔device copies"
    return (f", bound by {what} (compute {placed['device_s']:.2f} s, CPU step {placed['host_step_s']:.2f} s, "
            f"copies {placed['copy_s']:.2f} s)")


def _where(report: dict, placed: dict) -> str:
    """The verdict's words on the placement ``placed``: its device and host memory (the smallest
    host that runs it when the host was not given) and the CPU Adam rate its step time assumes."""
    machine = report.get("machine") or {}
    ranks = machine.get("ranks_per_host") or report["world_size"]
    words = (f"; model state {placed['name']}: {placed['device_bytes'] / 2**30:.1f} GiB GPU per rank, "
             f"{placed['host_bytes'] / 2**30:.1f} GiB host for the {ranks} rank(s) of a machine"
             + (" (the smallest host that runs it; give --host_memory_gib to check one)" if not machine.get("host_bytes")
                else "" if placed["fits_host"] else " — more than the host has"))
    if placed.get("offload", "none") != "none":  # its step time holds the host's CPU Adam
        rate = machine.get("cpu_adam_params_per_s") or 0
        words += (f"; its step time counts CPU Adam at {rate / 1e9:.2g}G parameters/s, " + {
            "given": "given",
            "reference": "the reference rate of an assumed server host (give the target's with --cpu_adam_params_per_s)",
        }.get(report.get("cpu_adam_source"), "measured on this machine (give the target's with --cpu_adam_params_per_s)"))
    return words


WHAT = {
    "plan": """The planner's view of a config before it runs (nothing is trained), as tables: the micro-batch plans
with their predicted peak bytes and step seconds, and where model state can live. `memtrain memory`
prints the same as one JSON object.""",
    "memory": """The planner's report of a config before it runs (nothing is trained), as one JSON object for scripts:
the model's parameters, the machine planned for, every micro-batch plan (predicted peak bytes, step
seconds, fits) and every placement of model state. `memtrain plan` prints the same as tables.""",
}
"""The first paragraph of ``memtrain plan --help`` and ``memtrain memory --help``."""

PLAN_HELP = """usage: memtrain {command} --config RECIPE.yaml [options] [--section.key value ...]

{what}
Any config key may follow as --section.key value (memtrain train --help lists them).

options:
  --world_size N        ranks the run will have (default: the launcher's WORLD_SIZE, else 1)
  --gpu_memory_gib G    device memory of one rank, in GiB (a GPU run is planned; default: this machine's)
  --host_memory_gib H   host memory of the ranks of one machine together, in GiB (default: available here)
  --nodes M             machines the ranks are spread over, world_size / M per machine (default 1)
  --nvme_path DIR       a folder for NVMe offload (placements that use it are planned)
  --gpu_tflops T        the target GPU's achieved dense bf16 rate in TFLOP/s, for step seconds (default 400
                        when no GPU is here, else measured here; e.g. about 400 for an H100 SXM, 200 for an
                        A100, 120 for an L40S: the datasheet's dense peak times the achieved fraction)
  --cpu_adam_params_per_s R  the target host's CPU Adam rate, parameters per second with all its cores
                        (times the optimizer of offloading placements; default: a reference rate of
                        3.3e9 when --gpu_memory_gib or --host_memory_gib describe another machine,
                        else measured on this machine)
  --json                one JSON object per plan, then one per placement (plan only)

exit code: 0 the run has a plan to start at, 3 nothing fits (the report says what to change),
2 a bad input"""


def _target_flops(gpu_tflops: Optional[float], device_type: str) -> float:
    """FLOP/s step seconds are estimated at: ``gpu_tflops`` (the target GPU's achieved dense
    bf16/fp16 rate, TFLOP/s) when given, else :data:`memtrain.memory.machine.DEFAULT_GPU_FLOPS`
    for a GPU planned on a machine without one, else measured on this machine's device. The
    report's ``machine`` names the rate used."""
    if gpu_tflops:
        return gpu_tflops * 1e12
    return DEFAULT_GPU_FLOPS if device_type == "cuda" and not torch.cuda.is_available() else device_flops_per_s(device_type)


def _plan_micro_batch_for_target(cfg, world_size: int, given: bool, command: str, target: bool = False) -> None:
    """A recipe's fixed ``training.micro_batch_size`` is replaced by ``auto`` (the planner chooses),
    and said so, when it cannot divide a rank's share of the global batch on the target's
    ``world_size``, or when another machine is planned (``target``: its GPU given), whose
    micro-batch the recipe could not have been written for; one ``given`` on the command line is
    kept (and refused by validation if wrong)."""
    t = cfg.training
    share = t.global_batch_size // max(1, world_size)
    if given or t.micro_batch_size == "auto":
        return
    if share > 0 and share % t.micro_batch_size == 0:
        if not target:
            return
        why = "another machine is planned"
    else:
        why = (f"it does not divide a rank's share of the global batch ({t.global_batch_size} / {world_size} ranks "
               f"= {share})")
    print(f"memtrain {command}: the recipe's training.micro_batch_size {t.micro_batch_size} is not planned: {why}; "
          "planning the micro-batch instead (training.micro_batch_size auto; give one on the command line to fix it)",
          file=sys.stderr)
    t.micro_batch_size = "auto"


def main(argv: Optional[list[str]] = None, command: str = "memory") -> int:
    """``memtrain plan|memory [--world_size N] [--gpu_memory_gib G] [--host_memory_gib H]
    [--nvme_path DIR] [--json] --config ... [--section.key value ...]``: ``plan`` prints the
    candidate and placement tables (with ``--json`` one JSON object per micro-batch candidate, then
    one per placement with ``"placement": true`` and the model's ``parameters``), ``memory`` the
    whole report as one JSON object. N defaults to
    the launcher's ``WORLD_SIZE``, else 1. Exit 2 on a config error, :data:`NOTHING_FITS` (3)
    when nothing fits (:func:`something_fits`; the report is printed first), else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(PLAN_HELP.format(command=command, what=WHAT[command]))
        return 0
    prepare_libraries(torch.cuda.is_available())
    try:
        world_size = int(_pop_option(argv, "--world_size", os.environ.get("WORLD_SIZE", "1")))
        gib = _pop_option(argv, "--gpu_memory_gib")
        gib = float(gib) if gib is not None else None
        host = _pop_option(argv, "--host_memory_gib")
        host = float(host) if host is not None else None
        adam = _pop_option(argv, "--cpu_adam_params_per_s")
        adam = float(adam) if adam is not None else None
        tflops = _pop_option(argv, "--gpu_tflops")
        tflops = float(tflops) if tflops is not None else None
        nvme = _pop_option(argv, "--nvme_path")
        nodes = int(_pop_option(argv, "--nodes", "1"))
    except ValueError as exc:
        print(f"memtrain {command}: --world_size and --nodes are integers, --gpu_memory_gib, --host_memory_gib, "
              f"--gpu_tflops and --cpu_adam_params_per_s numbers ({exc})", file=sys.stderr)
        return 2
    as_json = _pop_option(argv, "--json", flag=True)
    try:
        if world_size < 1:
            raise ConfigError("--world_size", f"must be at least 1, got {world_size}")
        if nodes < 1 or world_size % nodes:
            raise ConfigError("--nodes", f"must divide --world_size {world_size} (ranks per machine), got {nodes}")
        for name, value in (("--gpu_memory_gib", gib), ("--host_memory_gib", host), ("--cpu_adam_params_per_s", adam),
                            ("--gpu_tflops", tflops)):
            if value is not None and not value > 0:
                raise ConfigError(name, f"must be > 0, got {value}")
        for name, value in (("--gpu_memory_gib", gib), ("--host_memory_gib", host)):
            if value is not None and value > MAX_MEMORY_GIB:
                raise ConfigError(name, f"{value:g} GiB is more than any machine holds (at most {MAX_MEMORY_GIB:g} "
                                  "GiB, a pebibyte): give the memory of one GPU, or of one machine's host, in GiB")
        if nvme is not None and not os.path.isdir(os.path.expanduser(nvme)):
            raise ConfigError("--nvme_path", f"'{nvme}' is not a folder")
        cfg = parse_args(argv)
        apply_accelerate_settings(cfg, world_size)
        _plan_micro_batch_for_target(cfg, world_size, "--training.micro_batch_size" in argv, command, gib is not None)
        validate(cfg, world_size)
    except ConfigError as exc:
        print(f"memtrain {command}: {exc}", file=sys.stderr)
        return 2
    try:
        report = plan_report(cfg, world_size, gib, host, nvme, adam, nodes, tflops)
    except (ConfigError, ValueError) as exc:  # data or model settings that cannot work (named in the message)
        print(f"memtrain {command}: {exc}", file=sys.stderr)
        return 2
    if command == "memory":
        print(json.dumps(report, indent=1))
    elif as_json:
        for c in report["candidates"]:
            print(json.dumps(c))
        for p in report["placements"]:
            print(json.dumps({"placement": True, "parameters": report["parameters"], **p}))
    else:
        print(format_table(report))
    return 0 if something_fits(report) else NOTHING_FITS


MAX_MEMORY_GIB = float(2**20)
"""The largest ``--gpu_memory_gib`` / ``--host_memory_gib`` planned for (1 PiB): a larger figure is
a typo (bytes given for GiB), refused with exit 2 rather than planned without a word."""

NOTHING_FITS = 3
"""``memtrain plan|memory``'s exit code when the run would have nothing to start from: the code a
run exits with when it is out of memory at the plan floor."""


def something_fits(report: dict) -> bool:
    """Whether the run of :func:`plan_report`'s ``report`` has a plan to start at: under
    ``backend.offload auto`` a placement that fits; otherwise a chosen micro-batch plan (one the
    config fixes counts even where it is predicted not to fit: the run recovers from there) on a
    placement whose host memory suffices (a run refuses one that does not)."""
    placed = next((p for p in report.get("placements", []) if p.get("chosen")), None)
    if report.get("placement_decides"):
        return placed is not None and placed["fits"]
    return any(c["chosen"] for c in report["candidates"]) and (placed is None or placed.get("fits_host", True))


if __name__ == "__main__":
    sys.exit(main())
