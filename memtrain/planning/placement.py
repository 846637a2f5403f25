"""Where model state lives: the placement planner (``backend.offload: auto``, ``memtrain plan``).

For a model and a machine (device memory per rank, host memory, optionally an NVMe folder) every
placement an engine offers is sized and timed before anything is allocated:

- DDP; FSDP2 with and without CPU offload; DeepSpeed ZeRO-1/2/3, ZeRO-1/2/3 with the optimizer
  state on the host, ZeRO-3 with only a fraction of it there (DeepSpeed's partial offload,
  ``offload_optimizer.ratio``: the smallest fraction, in steps of :data:`RATIO_STEP`, whose device
  share fits), ZeRO-3 with the parameters on the host too, and with an NVMe folder the same
  offloads into files.
- **Device bytes** per rank: the engine's model state (``model_state_bytes``) + the activations of
  the best micro-batch / activation-checkpointing plan (traced with fake tensors,
  :mod:`memtrain.planning.planner`) + the CUDA headroom (DeepSpeed's buffers — the reduce bucket
  memtrain sizes, ZeRO-3's gathered parameters at DeepSpeed's limits — are in the engine's accounting).
- **Host bytes**, all ranks of the machine together, the larger of two moments: training — each
  rank's process (libraries, the CUDA context, data: :func:`memtrain.memory.machine.process_bytes`)
  + offloaded state + DeepSpeed's pinned NVMe swap buffers + the checkpoint staging of a save
  (DeepSpeed serialises one flat partition at a time: the largest device-side sub-group; a
  synchronous DCP save one tensor) — and the export at the end, which gathers the whole model on
  rank 0's host beside the processes and the offloaded state. On a CPU run the device is host
  memory too.
- **Step seconds**: ``6 × parameters × tokens`` at the device's FLOP rate (the micro-batch
  planner's estimate), plus — nothing overlapped, as DeepSpeed's default runs — CPU Adam over
  the host-side parameters at the rate measured on this machine (:func:`memtrain.memory.machine.cpu_adam_params_per_s`;
  the host's cores are shared by its ranks), the host↔device copies (16-bit gradients out and
  16-bit parameters back per step; offloaded parameters in twice per micro-batch) at
  :data:`memtrain.memory.machine.HOST_DEVICE_BYTES_PER_S`, and NVMe reads and writes at
  :data:`memtrain.memory.machine.NVME_BYTES_PER_S` (each offloading engine's ``offload_seconds``).

The fastest placement that fits both budgets is chosen; ties go to the one that offloads less.
The byte accounting follows ZeRO (Rajbhandari et al. 2020) and ZeRO-Offload (Ren et al. 2021);
partial offload is DeepSpeed's "Twin-Flow" (ZeRO-Offload++).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from memtrain.backends import (BACKENDS, DEFAULT_ENGINE, engine_module, engine_variants, model_state_bytes,
                               run_format, writes_format)
from memtrain.backends.spec import configured_engine, user_zero_settings
from memtrain.checkpoint.formats import format_module
from memtrain.config import ConfigError
from memtrain.levers import allowed_by, describe, lever_choices, offered_choices
from memtrain.levers.optimizer_state import (BF16_MAX_BETA2, LOSSY, STATE_DTYPES, choose_charging_steps,
                                             fastest_fitting, planner_dtypes)
from memtrain.memory.accounting import build_bytes, builds_on_device, device_state_bytes
from memtrain.memory.moments import largest_moment_bytes, parameter_element_bytes
from memtrain.memory.peak import peak_terms
from memtrain.memory.shape import ModelShape, model_shape
from memtrain.memory.machine import Machine
from memtrain.planning.activations import activation_tables
from memtrain.planning.planner import (Candidate, candidate_peak_bytes, estimated_plan_s, lever_cost, make_candidates,
                                      moment_fit_bytes)
from memtrain.models import ModelSource
from memtrain.objectives import make_objective

RATIO_STEP = 0.01
"""Granularity of the partial-offload fraction the planner tries."""
RATIO_MARGIN = 0.025
"""A partial offload whose fraction the planner tunes leaves this share of the device budget free
beyond the allocator headroom (2 GiB of 80): the ratio is the one knob that trades device bytes for
host seconds, and a prediction a little low must not take the run to an OOM at its first step."""
BOUND_SHARE = 0.05
"""An offload's added seconds above this share of the compute make a step ``host``- or ``copies``-bound."""
NVME_SWAP_BUFFERS_BYTES = 4 * 10**8 * 4 + 5 * 10**8 * 2
"""DeepSpeed's pinned NVMe swap buffers (optimizer: 4 × 1e8 fp32 elements; parameters: 5 × 1e8 16-bit)."""


@dataclasses.dataclass
class Placement:
    """One placement with its best micro-batch plan and predictions (bytes; seconds per optimizer step).

    ``offload_optimizer_ratio`` is the fraction of the optimizer state on the host (``tune_ratio``:
    the planner chooses it); ``nvme``: the offloaded state is in files. ``device_bytes`` is per
    rank, ``host_bytes`` for all ranks of a machine, ``nvme_bytes`` per rank; ``state_dtype`` is
    ``optimizer.state_dtype`` (DDP and FSDP2 take bf16 and int8); ``state_dtype_s``, in
    ``predicted_step_s``, its measured step beyond fp32 moments' (None: not measured);
    ``deferred_reduction``: ``memory.oom_recovery`` (DDP then holds no reducer buckets);
    ``async_save``: ``checkpoint.async_save`` and ``checkpoint_format``: ``checkpoint.format``
    (what a save stages on the host: its format's ``staging_bytes``);
    ``device_s``: the plan's compute; ``host_step_s`` and ``copy_s``: the offload's CPU step and
    host↔device (and NVMe) copies per step (:class:`memtrain.backends.common.OffloadTime`);
    ``bound``: what the step waits for —
    ``device`` (its compute), or, when the offload adds over :data:`BOUND_SHARE` of that, ``host``
    (the CPU step is the larger part) or ``copies``."""

    engine: str
    zero_stage: Optional[int]
    offload: str
    offload_optimizer_ratio: float = 1.0
    nvme: bool = False
    tune_ratio: bool = False
    micro_batch_size: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    activation_checkpointing: Optional[str] = None
    device_bytes: int = 0
    host_bytes: int = 0
    nvme_bytes: int = 0
    predicted_step_s: Optional[float] = None
    fits_device: bool = False
    fits_host: bool = False
    chosen: bool = False
    state_dtype: str = "fp32"
    state_dtype_s: Optional[float] = None
    levers: dict = dataclasses.field(default_factory=dict)  # the plan's other model levers: {name: setting}
    deferred_reduction: bool = True
    async_save: bool = False
    checkpoint_format: str = "auto"
    device_s: float = 0.0
    host_step_s: float = 0.0
    copy_s: float = 0.0
    bound: str = "device"

    @property
    def name(self) -> str:
        engine = engine_module(self.engine).variant_label(self.zero_stage)
        if self.state_dtype != "fp32":
            engine += f" {self.state_dtype} states"
        if self.offload == "none":
            return engine
        where = "nvme" if self.nvme else "host"
        what = "optimizer" if self.offload == "optimizer" else "optimizer+params"
        share = f" {self.offload_optimizer_ratio:.0%}" if self.offload_optimizer_ratio < 1 else ""
        return f"{engine} {what}{share}→{where}"

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def as_dict(self) -> dict:  # a JSON row: an infinite time (moments that cannot step here) as null
        fields = {k: None if v == float("inf") else v for k, v in dataclasses.asdict(self).items()}
        return {"name": self.name, **fields, "fits": self.fits}


def variants(engines: tuple[str, ...], zero_stages: tuple[int, ...], nvme: bool,
             state_dtype: str = "fp32", deferred_reduction: bool = True, async_save: bool = False,
             checkpoint_format: str = "auto") -> list[Placement]:
    """Every placement of ``engines`` (ZeRO stages restricted to ``zero_stages``; NVMe ones only
    with ``nvme``), least offload first: the engines' own variants
    (:func:`memtrain.backends.engine_variants`), with optimizer states in ``state_dtype``."""
    return [Placement(v.engine, v.zero_stage, v.offload, v.offload_optimizer_ratio, v.nvme, v.tune_ratio,
                      state_dtype=state_dtype, deferred_reduction=deferred_reduction, async_save=async_save,
                      checkpoint_format=checkpoint_format)
            for v in engine_variants(engines)
            if (v.zero_stage is None or v.zero_stage in zero_stages) and (nvme or not v.nvme)
            and (not v.state_dtypes or state_dtype in v.state_dtypes)]


def state_bytes(p: Placement, shape: ModelShape, precision: str, world_size: int,
                zero_settings: Optional[dict] = None) -> dict[str, int]:
    """The engine's model-state accounting of ``p`` (:func:`memtrain.backends.model_state_bytes`;
    DeepSpeed's buffers as memtrain sizes them, except those the user's JSON sets: ``zero_settings``,
    :func:`user_zero_settings`)."""
    return model_state_bytes(p.engine, shape.parameters, precision, p.zero_stage, p.offload, world_size,
                             p.offload_optimizer_ratio, "nvme" if p.nvme else "cpu", shape, state_dtype=p.state_dtype,
                             deferred_reduction=p.deferred_reduction, zero_settings=zero_settings)


def _size(p: Placement, c: Candidate, shape: ModelShape, precision: str, world_size: int,
          machine: Machine, zero_settings: Optional[dict] = None) -> None:
    """Fill ``p``'s bytes and seconds for micro-batch plan ``c`` (``zero_settings``: :func:`state_bytes`)."""
    state = state_bytes(p, shape, precision, world_size, zero_settings)
    n_params = shape.parameters
    p_bytes = parameter_element_bytes(precision)
    device = max(candidate_peak_bytes(c, device_state_bytes(state), peak_terms(state), machine.device_type),
                 moment_fit_bytes(largest_moment_bytes(state, machine.device_type), machine.device_type))
    optimizer_on_device = state["optimizer_bytes"]
    engine = engine_module(p.engine)
    async_save = p.async_save and engine.ASYNC_SAVE  # an engine that cannot writes now
    largest = 4 * shape.largest_module // (world_size if engine.SHARDS_OPTIMIZER_STATE else 1)  # a rank's tensor
    staging = format_module(run_format(p.engine, p.checkpoint_format)).staging_bytes(
        optimizer_on_device, largest_tensor_bytes=largest, async_save=async_save)
    if machine.device_type == "cpu" and not async_save:
        staging = 0  # a CPU run's state is host memory already: a synchronous save writes it from there
    per_rank_host = machine.process_bytes + state["cpu_offloaded_bytes"] + staging
    per_rank_host += state["accumulation_host_bytes"] if c.gradient_accumulation_steps > 1 else 0
    per_rank_host += NVME_SWAP_BUFFERS_BYTES if p.nvme else 0
    per_rank_host += device if machine.device_type == "cpu" else 0
    per_rank_host += lever_cost(c).held_host_bytes  # e.g. one micro-batch's offloaded activations
    if machine.device_type == "cuda":  # torch's pinned allocator rounds a block up to a power of two
        per_rank_host += pinned_rounding_bytes(state.get("pinned_block_bytes", 0))
    p.micro_batch_size, p.gradient_accumulation_steps = c.micro_batch_size, c.gradient_accumulation_steps
    p.activation_checkpointing = c.plan.lever("activation_checkpointing")
    p.levers = {name: value for name, value in c.plan.levers if name != "activation_checkpointing"}
    p.device_bytes, p.host_bytes = device, max(per_rank_host * machine.ranks_per_host,
                                               _export_host_bytes(p, state, n_params, precision, machine)
                                               if machine.exports else 0,
                                               _build_host_bytes(shape, state, machine),
                                               machine.startup_peak_bytes * machine.ranks_per_host)
    p.nvme_bytes = state["nvme_offloaded_bytes"]
    margin = int(RATIO_MARGIN * machine.device_bytes) if p.tune_ratio and machine.device_bytes else 0
    p.fits_device = machine.device_bytes is None or device + margin <= machine.device_bytes
    p.fits_host = machine.host_bytes is None or p.host_bytes <= machine.host_bytes
    p.predicted_step_s, p.device_s, p.host_step_s, p.copy_s, p.bound = (c.predicted_step_s, c.predicted_step_s, 0.0,
                                                                        0.0, "device")
    if p.offload != "none":
        time = engine_module(p.engine).offload_seconds(p, n_params, p_bytes, world_size, machine)
        p.host_step_s, p.copy_s = time.cpu_s, time.copy_s
        if time.added_s > BOUND_SHARE * c.predicted_step_s:
            p.bound = "host" if time.cpu_s >= time.copy_s else "copies"
        p.predicted_step_s += time.added_s


def pinned_rounding_bytes(block: int) -> int:
    """Host bytes torch's caching host allocator adds to a pinned block of ``block`` bytes (it
    rounds each block up to a power of two)."""
    return (1 << (block - 1).bit_length()) - block if block > 0 else 0


def _build_host_bytes(shape: ModelShape, state: dict, machine: Machine) -> int:
    """Host bytes of the machine while every rank builds the model whole in host memory (none
    when it is built on the device: :func:`memtrain.memory.accounting.builds_on_device`)."""
    if builds_on_device(shape, state, machine.device_type):
        return 0
    return (machine.process_bytes + build_bytes(shape)) * machine.ranks_per_host


def _export_host_bytes(p: Placement, state: dict, n_params: int, precision: str, machine: Machine) -> int:
    """Host bytes of the machine while the run's export gathers the whole model on rank 0's host
    (in the engine's ``export_bytes_per_parameter``) beside every rank's process and offloaded
    state (less what the engine frees for it: ``export_released_bytes``; the checkpoint staging,
    the accumulation buffers and the activations are gone by then)."""
    per_rank = machine.process_bytes + state["cpu_offloaded_bytes"] - state.get("export_released_bytes", 0)
    per_rank += NVME_SWAP_BUFFERS_BYTES if p.nvme else 0
    per_rank += device_state_bytes(state) if machine.device_type == "cpu" else 0  # a CPU run's model state
    return per_rank * machine.ranks_per_host + engine_module(p.engine).export_bytes_per_parameter(
        precision, p.offload) * n_params


def plan_placements(candidates, pool: list[Placement], shape: ModelShape,
                    precision: str, world_size: int, machine: Machine,
                    zero_settings: Optional[dict] = None) -> list[Placement]:
    """Size and time every placement of ``pool`` at its best micro-batch plan and choose.

    Args:
        candidates: the micro-batch plans of a rank's share with ``activation_bytes`` and
            ``predicted_step_s`` set (:func:`micro_batch_candidates`): a list, or
            ``placement -> list`` (each engine's traced as it computes).
        pool: from :func:`variants`; a partial-offload entry takes the smallest fitting ratio.
        shape: the model's element counts (:func:`memtrain.memory.shape.model_shape`).
        precision: ``bf16|fp16|fp32``; world_size: ranks; machine: the budgets and rates.
        zero_settings: the DeepSpeed buffer sizes the user's JSON sets (:func:`user_zero_settings`).

    Returns:
        ``pool``, each with its best plan (the fastest that fits, else the smallest); the one
        :func:`choose` takes (lossier moments charged their measured step) has ``chosen`` set.
    """
    plans_of = candidates if callable(candidates) else lambda p: candidates
    for p in pool:
        best = None
        ratios = _ratios(p, shape)
        for ratio in ratios:
            trial = dataclasses.replace(p, offload_optimizer_ratio=ratio, state_dtype_s=None)
            for c in plans_of(p):
                _size(trial, c, shape, precision, world_size, machine, zero_settings)
                if best is None or _better(trial, best):
                    best = dataclasses.replace(trial)
        for field in dataclasses.fields(Placement):
            setattr(p, field.name, getattr(best, field.name))
    best = choose_charging_steps(pool, choose, shape.parameters, world_size, machine)
    if best is not None:
        best.chosen = True
    return pool


def _ratios(p: Placement, shape: ModelShape) -> list[float]:
    """The host shares of the optimizer state to try for ``p``: its own, or for a partial offload
    (``tune_ratio``) each fraction below 1 by :data:`RATIO_STEP` as its engine can hold it (the
    engine module's ``offload_ratio``: FSDP2's offload holds whole parameters), distinct and below
    1 — so the placement planned, its name and the run's split are one ratio."""
    if not p.tune_ratio:
        return [p.offload_optimizer_ratio]
    held = engine_module(p.engine).offload_ratio
    ratios = sorted({r for r in (held(shape, round(i * RATIO_STEP, 4)) for i in range(1, round(1 / RATIO_STEP)))
                     if 0 < r < 1})
    return ratios or [held(shape, p.offload_optimizer_ratio)]  # no share below 1 (a model of one parameter)


LOSSY_MARGIN = 0.05
"""A lossier optimizer state dtype is chosen only when predicted this much faster (a fraction of the
step, its measured slower optimizer step counted: :func:`memtrain.levers.optimizer_state.choose_charging_steps`)
than the fastest fitting placement with less lossy moments: a larger micro-batch it lets fit saves little."""


def choose(table: list[Placement]) -> Optional[Placement]:
    """The placement a run takes from ``table`` (sized by :func:`plan_placements`): the fastest
    that fits (the first of equals), where rows with less lossy optimizer moments (fp32, then bf16,
    then int8) win unless a lossier one is more than :data:`LOSSY_MARGIN` faster; None when
    nothing fits."""
    fastest = fastest_fitting(table)
    if fastest is None:
        return None
    for dtype in STATE_DTYPES[:STATE_DTYPES.index(fastest.state_dtype)]:
        rows = [p for p in table if p.fits and p.state_dtype == dtype]  # an infinite time never passes the test
        if rows and min(p.predicted_step_s for p in rows) <= fastest.predicted_step_s * (1 + LOSSY_MARGIN):
            return min(rows, key=lambda p: p.predicted_step_s)
    return fastest


def _better(a: Placement, b: Placement) -> bool:
    """``a`` is a better plan than ``b``: fits where ``b`` does not, else faster (if both fit) or
    smaller (if neither does)."""
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return a.predicted_step_s < b.predicted_step_s
    return a.device_bytes + a.host_bytes < b.device_bytes + b.host_bytes


def format_placements(table: list[Placement]) -> str:
    """``table`` as text, one row per placement (GiB; seconds per step and what it waits for: device
    compute, the host's CPU step or the copies; the plan's levers besides AC last)."""
    header = f"{'placement':<32} {'micro':>5} {'AC':>9} {'device GiB':>10} {'host GiB':>9} {'step s':>9} {'bound':>7}"
    rows = [header + f" {'fits':<11} chosen other levers"]
    for p in table:
        fits = "yes" if p.fits else "no (device)" if not p.fits_device else "no (host)"
        rows.append(f"{p.name:<32} {p.micro_batch_size:>5} {p.activation_checkpointing or '-':>9} "
                    f"{p.device_bytes / 2**30:>10.1f} {p.host_bytes / 2**30:>9.1f} {p.predicted_step_s:>9.3f} {p.bound:>7} "
                    f"{fits:<11} {'*' if p.chosen else ' ':<6} {describe(p.levers).strip() or '-'}")
    return "\n".join(rows)


def nvme_usable(path: Optional[str]) -> bool:
    """Whether NVMe offload can be planned: a folder is given and an engine with NVMe placements
    can run its file I/O here (its ``nvme_available``: DeepSpeed's async_io op loads)."""
    if not path:
        return False
    return os.path.isdir(os.path.expanduser(path)) and any(
        engine_module(e).nvme_available() for e in BACKENDS if any(v.nvme for v in engine_module(e).VARIANTS))


def micro_batch_candidates(cfg, per_rank_batch: int, activation_bytes, n_params: int, tokens_per_sample: int,
                           device_flops: float, choices: Optional[dict] = None) -> list[Candidate]:
    """The plans (micro-batch and model-lever settings: ``choices``, None =
    :func:`memtrain.levers.lever_choices`) of a rank's share with their traced activation bytes and
    FLOP-estimated seconds (1 ms per micro-batch for launches and reduction)."""
    choices = lever_choices(cfg, None) if choices is None else choices
    candidates = make_candidates(per_rank_batch, choices, 0, activation_bytes, "cpu", None)
    for c in candidates:
        c.predicted_step_s = estimated_plan_s(c, cfg, n_params, tokens_per_sample, device_flops)
    return candidates


def tokens_per_sample(cfg, corpus) -> int:
    """Tokens (frames for speech: the longest utterance) one sample holds, for FLOP estimates."""
    return cfg.data.seq_len if corpus.kind != "speech" else int(max(corpus.train.lengths))


def model_facts(cfg, corpus, source=None, objective=None) -> tuple[ModelShape, object]:
    """``(element counts, objective)`` of the model of ``source`` (a :class:`memtrain.models.ModelSource`;
    None: ``cfg``'s), built on the meta device (nothing allocated); ``objective``: the user's, or
    None for the corpus's (:func:`memtrain.objectives.make_objective`)."""
    meta = (source or ModelSource.of(cfg, corpus)).build_meta()
    return model_shape(meta), objective or make_objective(meta, corpus)


def plan_model(cfg, spec, activation_tables, shape: ModelShape, tokens: int, world_size: int,
               machine: Machine, precision: str, pool: list[Placement], choices: Optional[dict] = None) -> list[Placement]:
    """:func:`plan_placements` over the micro-batch plans of ``cfg`` (a numeric
    ``training.micro_batch_size`` is kept; ``auto`` lets each placement take its best).

    Args:
        spec: the run's :class:`memtrain.backends.spec.EngineSpec` as configured; each placement
            is planned with its own engine and stage over it (:meth:`~memtrain.backends.spec.EngineSpec.with_placement`).
        activation_tables: ``engine -> plan -> bytes`` (:func:`memtrain.planning.activations.activation_tables`).
        shape: the model's element counts (:func:`memtrain.memory.shape.model_shape`).
        tokens: tokens per sample (:func:`tokens_per_sample`).
        choices: the model levers' choices (None: :func:`memtrain.levers.lever_choices`).
    """
    t, choices = cfg.training, lever_choices(cfg, None) if choices is None else choices
    by_table: dict[tuple, list[Candidate]] = {}

    def candidates(p: Placement) -> list[Candidate]:  # the model levers as its engine takes them
        options = allowed_by(choices, cfg, spec.with_placement({"name": p.engine, "zero_stage": p.zero_stage}))
        table = activation_tables(p.engine)
        key = (id(table), tuple(options.items()))
        if key not in by_table:
            plans = micro_batch_candidates(cfg, t.global_batch_size // world_size, table, shape.parameters, tokens,
                                           machine.device_flops, options)
            by_table[key] = [c for c in plans if t.micro_batch_size in ("auto", c.micro_batch_size)]
        return by_table[key]

    return plan_placements(candidates, pool, shape, precision, world_size, machine, user_zero_settings(cfg))


def placement_table(cfg, spec, corpus, world_size: int, machine: Machine, precision: str,
                    pool: list[Placement], source=None, objective=None) -> list[Placement]:
    """Plan ``pool`` for ``cfg``'s model (or ``source``'s, with ``objective``: :func:`model_facts`;
    :func:`plan_model`, ``spec`` the engine as configured), tracing it with fake tensors.

    Raises:
        RuntimeError, NotImplementedError: the model cannot be traced with fake tensors.
    """
    user_objective = objective
    shape, objective = model_facts(cfg, corpus, source, objective)
    tables = activation_tables(cfg, corpus, objective, precision, machine.device_type, source)
    return plan_model(cfg, spec, tables, shape, tokens_per_sample(cfg, corpus), world_size, machine, precision, pool,
                      offered_choices(cfg, None, source, user_objective))


def planning_pool(cfg, nvme: bool) -> list[Placement]:
    """Every placement ``cfg`` leaves open: the engine of ``backend.name`` (or of the launcher or
    the DeepSpeed JSON; every engine that can write ``checkpoint.format`` when nothing names one),
    the ZeRO stage of ``backend.zero_stage`` or the JSON (all three when neither sets one).

    Raises:
        memtrain.config.ConfigError: ``backend.offload auto`` with a DeepSpeed JSON that sets an
            offload of its own (two answers to one question).
    """
    b, configured = cfg.backend, configured_engine(cfg.backend)
    engine, stage = configured.name, configured.zero_stage
    if b.offload == "auto" and configured.json_offload != "none":
        raise ConfigError("backend.offload", f"auto, but {b.deepspeed_config} sets an offload of its own: drop one")
    engines = (engine,) if b.name != "auto" or engine != DEFAULT_ENGINE else BACKENDS  # auto with no launcher's: all
    dtype = cfg.optimizer.state_dtype
    if dtype in LOSSY:  # DeepSpeed keeps fp32 optimizer partitions (memtrain/levers/optimizer_state.py)
        engines = tuple(e for e in engines if engine_module(e).LOSSY_OPTIMIZER_STATE)
    engines = tuple(e for e in engines if writes_format(cfg, e))  # checkpoint.format: the engines that write it
    pool = []
    for d in dict.fromkeys(d for e in engines for d in planner_dtypes(cfg, e)):  # the least lossy first: it wins ties
        pool += variants(tuple(e for e in engines if d in planner_dtypes(cfg, e)), (stage,) if stage else (1, 2, 3),
                         nvme, d, cfg.memory.oom_recovery, cfg.checkpoint.async_save, cfg.checkpoint.format)
    if cfg.model.lora_rank:  # LoRA trains without offload (memtrain.validation._validate_lora)
        pool = [p for p in pool if p.offload == "none"]
    return pool


def allowed_pool(cfg, nvme: bool) -> list[Placement]:
    """The placements a run may take: under ``backend.offload auto`` :func:`planning_pool`,
    otherwise the one placement the config (and its DeepSpeed JSON) names, in each optimizer
    state dtype the planner may choose (:func:`memtrain.levers.optimizer_state.planner_dtypes`)."""
    if cfg.backend.offload == "auto":
        return planning_pool(cfg, nvme)
    c = configured_engine(cfg.backend)
    return [Placement(c.name, c.built_zero_stage, c.offload, c.offload_optimizer_ratio, nvme=c.offload_device == "nvme",
                      state_dtype=d,
                      deferred_reduction=cfg.memory.oom_recovery, async_save=cfg.checkpoint.async_save,
                      checkpoint_format=cfg.checkpoint.format)
            for d in planner_dtypes(cfg, c.name)]


def configured_offload(cfg) -> tuple[str, float, bool]:
    """``(offload, optimizer fraction on the host, NVMe)`` a run will use: ``backend.*``, else its
    DeepSpeed JSON's (:func:`memtrain.backends.spec.configured_engine`)."""
    c = configured_engine(cfg.backend)
    return c.offload, c.offload_optimizer_ratio, c.offload_device == "nvme"


def configured_state_bytes(cfg, shape: ModelShape, precision: str, world_size: int,
                           state_dtype: Optional[str] = None) -> dict[str, int]:
    """The model-state bytes per rank (:func:`memtrain.backends.model_state_bytes`) of the engine
    and placement ``cfg`` configures (:func:`configured_offload`), moments in ``state_dtype``
    (None: ``optimizer.state_dtype``)."""
    c = configured_engine(cfg.backend)
    return model_state_bytes(c.name, shape.parameters, precision, c.built_zero_stage, c.offload, world_size,
                             offload_optimizer_ratio=c.offload_optimizer_ratio, offload_device=c.offload_device,
                             shape=shape, state_dtype=state_dtype or cfg.optimizer.state_dtype,
                             deferred_reduction=cfg.memory.oom_recovery, zero_settings=c.zero_settings)


def with_state_dtype(cfg, dtype: str):
    """A copy of ``cfg`` planning only optimizer moments in ``dtype`` (a resumed run's, the
    config's, or the one the placement planner chose); ``cfg`` itself is not changed.

    Raises:
        memtrain.config.ConfigError: bf16 moments with ``training.adam_beta2`` above what they keep
            (a resumed run whose planner chose bf16, given a larger beta2 now).
    """
    if dtype == "bf16" and cfg.training.adam_beta2 > BF16_MAX_BETA2:
        raise ConfigError("training.adam_beta2", f"{cfg.training.adam_beta2}, but the checkpoint's optimizer moments "
                          f"are bf16 (chosen under memory.allow_lossy_levers), which lose a decay above "
                          f"{BF16_MAX_BETA2}: keep adam_beta2 <= {BF16_MAX_BETA2}, or start a new output_dir")
    if dtype == cfg.optimizer.state_dtype and not cfg.memory.allow_lossy_levers:
        return cfg
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, state_dtype=dtype),
                               memory=dataclasses.replace(cfg.memory, allow_lossy_levers=False))
