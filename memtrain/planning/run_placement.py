"""A run's placement, decided before its model is built (:func:`resolve`): ``backend.offload
auto`` chooses it from the placement table (:mod:`memtrain.planning.placement`) that rank 0
plans for this machine (:func:`run_machine`: the device budget, the host's real limit, the
rates measured here) and broadcasts; a placement set by hand is checked to fit the host; a
resumed run keeps its checkpoint's. The chosen row is logged and written to
``OUTPUT_DIR/placement.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Optional

import torch

from memtrain.backends import BACKENDS, check_writes_format, engine_module
from memtrain.backends.spec import backend_view, resolve_engine
from memtrain.config import ConfigError
from memtrain.folders import write_atomic
from memtrain.levers.optimizer_state import planner_dtypes
from memtrain.memory.machine import (Machine, cpu_adam_params_per_s, device_budget_bytes, device_flops_per_s,
                                     optimizer_params_per_s, process_bytes, run_host_limit,
                                     startup_peak_bytes)
from memtrain.backends.optimizer_offload import host_step_params_per_s
from memtrain.memory.accounting import builds_on_device
from memtrain.memory.shape import model_shape
from memtrain.planning.placement import (Placement, allowed_pool, configured_offload, configured_state_bytes,
                                         format_placements, nvme_usable, placement_table, with_state_dtype)
from memtrain.planning.resumed import resume_placement, resume_state_dtype


def run_machine(cfg, device: torch.device, world_size: int) -> Machine:
    """The machine a run plans for: the device budget of :func:`memtrain.memory.machine.device_budget_bytes`,
    the host's real limit (:func:`memtrain.memory.machine.run_host_limit`: the smallest of
    ``memory.host_memory_gib``, the cgroup's, the resource limits and the available memory, named
    in the machine's ``host_source``), this process's resident bytes and its peak so far, the
    device's matmul rate, CPU Adam's rate and the optimizer's per state dtype, measured here."""
    device_type = "cpu" if cfg.faults.memory_budget_mib > 0 else device.type
    host = run_host_limit(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return Machine(device_budget_bytes(cfg, device), host.bytes, host.ranks, device_type, device_flops_per_s(device.type),
                   cpu_adam_params_per_s(), process_bytes(device.type), cfg.backend.nvme_path, optimizer_params_per_s,
                   host_step_params_per_s(), host.source, startup_peak_bytes(device.type),
                   exports=cfg.checkpoint.export)


def configured_spec(cfg, world_size: int, rank: int = 0):
    """The engine ``cfg``'s ``backend`` section configures (the user's DeepSpeed JSON folded in),
    before any placement: the one place every command resolves it (:func:`resolve` for a run,
    ``memtrain plan|memory`` in :mod:`memtrain.estimate`, ``memtrain train --print_config`` in
    :mod:`memtrain.show`), so they cannot disagree on the engine.

    Returns:
        A :class:`memtrain.backends.spec.EngineSpec`.

    Raises:
        memtrain.config.ConfigError: the DeepSpeed JSON cannot be read.
    """
    return resolve_engine(cfg.backend, world_size, rank)


def resolve(cfg, corpus, process, precision: str, source=None, objective=None):
    """Before the model is built: the run's :class:`memtrain.backends.spec.EngineSpec`. With
    ``backend.offload auto`` the placement is chosen here (a resumed run keeps its checkpoint's);
    with an offload set, the host is checked to hold it. Rank 0 plans, every rank takes its answer.
    The config is not changed. ``source``, ``objective``: the user's model and objective
    (:func:`model_facts`); None = the config's.

    Raises:
        memtrain.config.ConfigError: no placement fits (``backend.offload``), or the configured
            one needs more host memory than there is (``memory.host_memory_gib``); the message
            holds the numbers.
    """
    kept = resume_placement(cfg) if cfg.backend.offload == "auto" else None
    if kept is not None:
        check_writes_format(cfg, kept["name"], ", whose placement the resumed checkpoint keeps (backend.offload auto)")
    configured = configured_spec(cfg, process.world_size, process.rank)
    spec = configured.with_placement(kept) if kept is not None else configured
    if kept is not None and process.is_main:
        log_placement(None, "kept from the checkpoint", spec)
    view = planned_view(cfg, spec) if kept is not None else cfg
    chooses = _chooses_state_dtype(cfg, spec.name)
    saved = resume_state_dtype(cfg, chooses) if kept is None else None  # a resumed run keeps its moments' dtype
    choose_dtype = chooses and kept is None and saved is None
    if saved is not None:
        spec = dataclasses.replace(spec, optimizer_state_dtype=saved)
    if not choose_dtype:  # plan (and check the host for) the dtype the run will build
        view = with_state_dtype(view, spec.optimizer_state_dtype or cfg.optimizer.state_dtype)
    if view.backend.offload != "auto" and configured_offload(view)[0] == "none" and not choose_dtype:
        return spec
    answer = _plan_on_main(view, spec, corpus, process, precision, source, objective)
    if answer is None:
        return spec
    answer, host_budget = answer["table"], answer["host_bytes"]
    if view.backend.offload != "auto":  # the user's placement: the host is checked (the device has OOM recovery)
        return _configured_placement(cfg, spec, answer, host_budget, choose_dtype, process.is_main)
    chosen = next((p for p in answer if p.chosen), None)
    if chosen is None:
        raise ConfigError("backend.offload", "auto: no placement fits this model in the device and host memory "
                          "(memory.host_memory_gib, or backend.nvme_path for NVMe offload):\n" + format_placements(answer))
    spec = configured.with_placement({
        "name": chosen.engine, "zero_stage": chosen.zero_stage, "offload": chosen.offload,
        "offload_optimizer_ratio": chosen.offload_optimizer_ratio,
        "nvme_path": cfg.backend.nvme_path if chosen.nvme else None,
        "optimizer_state_dtype": chosen.state_dtype if choose_dtype else None})
    if process.is_main:
        log_placement(chosen, "chosen", spec)
        write_table(cfg.output_dir, answer)
    return spec


def model_build_device(cfg, spec, precision: str, device: torch.device, source) -> Optional[torch.device]:
    """Where a run builds its model: ``device`` when it is a CUDA device and the model is built
    fresh from ``model.config`` or ``model.factory`` (not ``model.pretrained``, not the user's
    module or function) and the whole model in fp32 is no more than the model state ``spec``'s
    engine keeps on each device (:func:`memtrain.memory.accounting.builds_on_device`: the
    placement table counts the same moment); None = in host memory, as the placement's host peak
    counts (one whole fp32 copy a rank: 41 GB for the 10.2B Llama).

    Args:
        spec: the run's resolved engine (:func:`resolve`); source: its :class:`memtrain.models.ModelSource`.
    """
    if device.type != "cuda" or cfg.faults.memory_budget_mib > 0 or source.user is not None or cfg.model.pretrained:
        return None
    shape = model_shape(source.build_meta())
    state = configured_state_bytes(planned_view(cfg, spec), shape, precision, spec.world_size,
                                   spec.optimizer_state_dtype)
    return device if builds_on_device(shape, state, device.type) else None


def _chooses_state_dtype(cfg, engine: str) -> bool:
    """The placement planner chooses the optimizer state's dtype (``memory.allow_lossy_levers``) for
    a run on ``engine`` (under ``backend.offload auto``, for whichever engine it places on)."""
    if cfg.backend.offload == "auto":  # whichever engine it places on: one that takes lossy moments, if any
        engine = next((e for e in BACKENDS if engine_module(e).LOSSY_OPTIMIZER_STATE), engine)
    return len(planner_dtypes(cfg, engine)) > 1


def _configured_placement(cfg, spec, table: list[Placement], host_budget: int, choose_dtype: bool, is_main: bool):
    """The user's placement (``table``: it in each dtype the planner may choose, fp32 first): with
    ``choose_dtype``, ``spec`` with the chosen row's optimizer state dtype (the config's when none
    fits: the OOM recovery has the device); the host checked to hold the row the run takes.

    Raises:
        memtrain.config.ConfigError: that row needs more host memory than ``host_budget``.
    """
    chosen = next((p for p in table if p.chosen), None) if choose_dtype else None  # plan_placements' choice
    row = chosen or table[0]
    if not row.fits_host:
        raise _host_error(cfg, row, host_budget)
    if choose_dtype:
        spec = dataclasses.replace(spec, optimizer_state_dtype=row.state_dtype)
        if is_main:
            log_placement(row, "chosen (memory.allow_lossy_levers)" if chosen else
                          "the config's: no optimizer state dtype is predicted to fit", spec)
            write_table(cfg.output_dir, table)
    return spec


def planned_view(cfg, spec):
    """A copy of ``cfg`` whose ``backend`` section holds ``spec``'s placement (for planning
    functions that read a config); ``cfg`` itself is not changed."""
    return dataclasses.replace(cfg, backend=backend_view(cfg.backend, spec))


def _plan_on_main(cfg, spec, corpus, process, precision: str, source=None, objective=None) -> Optional[dict]:
    """Rank 0's placement table for ``cfg`` and its engine ``spec`` (``{"table", "host_bytes"}``), broadcast to every rank;
    None when the model cannot be traced and the placement is the user's (only warned about).

    Raises:
        memtrain.config.ConfigError: planning failed (the same error on every rank).
    """
    b, answer = cfg.backend, None
    if process.is_main:
        try:
            machine = run_machine(cfg, process.device, process.world_size)
            pool = allowed_pool(cfg, nvme_usable(b.nvme_path))
            table = placement_table(cfg, spec, corpus, process.world_size, machine, precision, pool, source, objective)
            answer = {"table": table, "host_bytes": machine.host_bytes}
        except ConfigError as exc:
            answer = (exc.field, str(exc).split(": ", 1)[1])
        except (RuntimeError, NotImplementedError) as exc:  # a model fake tensors cannot trace
            answer = ("backend.offload", f"auto cannot plan this model ({exc})")
            if b.offload != "auto":
                answer = None
                logging.getLogger("memtrain").warning("memtrain: the host memory of backend.offload %s is not checked: "
                                                      "this model cannot be traced with fake tensors (%s)", b.offload, exc)
    answer = process.broadcast_object(answer, patient=True)  # rank 0 may trace for a while
    if isinstance(answer, tuple):
        raise ConfigError(*answer)
    return answer


def write_table(output_dir: str, table: list[Placement]) -> None:
    """``OUTPUT_DIR/placement.json``: every placement considered, the chosen one marked."""
    out = os.path.expanduser(output_dir)
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "placement.json"), json.dumps({"placements": [p.as_dict() for p in table]}, indent=1))


def _host_error(cfg, p: Placement, budget: int):
    cap = cfg.memory.host_memory_gib
    return ConfigError("memory.host_memory_gib", f"{p.name} needs {_gib(p.host_bytes)} GiB of host memory (the "
                       f"processes, offloaded state, buffers), more than the {_gib(budget)} GiB "
                       f"{'allowed' if cap else 'available'}; offload less, set backend.offload auto, or use "
                       "backend.nvme_path")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def log_placement(p: Optional[Placement], how: str, spec) -> None:
    """One line on the placement a run trains with."""
    what = p.name if p is not None else Placement(spec.name, spec.zero_stage, spec.offload,
                                                   spec.offload_optimizer_ratio, bool(spec.nvme_path),
                                                   state_dtype=spec.optimizer_state_dtype or "fp32").name
    detail = (f" (predicted: device {_gib(p.device_bytes)} GiB per rank, host {_gib(p.host_bytes)} GiB, "
              f"{p.predicted_step_s:.3g} s per step)") if p is not None else ""
    logging.getLogger("memtrain").warning("memtrain: placement %s, %s%s", what, how, detail)
