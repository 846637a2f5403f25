"""The optimizer's state dtype as a lever (``optimizer.state_dtype fp32|bf16|int8``): AdamW's two
moments in fp32 (8 bytes per parameter), bf16 (4) or torchao's block-wise int8 (about 2;
:func:`memtrain.optim.make_optimizer`). Fixed when the engine is built; the engine's accounting
(:func:`memtrain.memory.accounting.adam_state_bytes`) counts its bytes. Lossy below fp32: a
plan never moves it once the engine is built; the config sets it, or, with
``memory.allow_lossy_levers``, the placement planner before the build (:func:`planner_dtypes`;
``memtrain plan`` shows what each setting would save), which charges a lossier dtype's optimizer
step at the rate measured on the run's machine (:func:`choose_charging_steps`; on 2 CPU ranks
the tiny recipe's int8 step is charged 74 ms against the 91 ms measured: docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

from memtrain.backends import engine_module, engine_name
from memtrain.errors import ConfigError
from memtrain.levers.engine_settings import EngineSetting

LOSSY = ("bf16", "int8")
"""Settings that round the moments every step."""
STATE_DTYPES = ("fp32",) + LOSSY
"""Every setting of ``optimizer.state_dtype``."""
BF16_MAX_BETA2 = 0.99
"""The largest ``training.adam_beta2`` bf16 moments take: a decay 1 - beta2 must be well above half
a bf16 step (2^-9 ≈ 0.002) for round-to-nearest to keep it."""


def planner_dtypes(cfg, engine: str) -> tuple[str, ...]:
    """The ``optimizer.state_dtype`` settings the placement planner may give ``engine``'s runs, least
    lossy first: the config's, and with ``memory.allow_lossy_levers`` (``memory.levers auto``,
    ``state_dtype`` fp32) also bf16 (``adam_beta2`` at most 0.99, as validation asks) and int8
    (torchao installed; not under ``logging.memory_breakdown_step``, whose MemTracker torch.compile
    refuses), outside DeepSpeed (which keeps fp32 partitions)."""
    dtype, m = cfg.optimizer.state_dtype, cfg.memory
    lossy_allowed = m.allow_lossy_levers and m.levers == "auto" and dtype == "fp32"
    if not lossy_allowed or not engine_module(engine).LOSSY_OPTIMIZER_STATE:
        return (dtype,)
    lossy = (("bf16",) if cfg.training.adam_beta2 <= BF16_MAX_BETA2 else ())
    int8 = importlib.util.find_spec("torchao") is not None and cfg.logging.memory_breakdown_step == 0
    return (dtype,) + lossy + (("int8",) if int8 else ())


def step_seconds_over_fp32(p, n_params: int, world_size: int, machine) -> float:
    """Seconds per optimizer step placement ``p``'s AdamW takes beyond the same step with fp32
    moments (negative where faster), at ``machine``'s measured rates
    (:func:`memtrain.memory.machine.optimizer_params_per_s`): a rank steps every parameter under
    DDP, its 1/``world_size`` shard under FSDP2; on the device, or on the host under CPU offload,
    where the machine's ranks, each with this process's threads, share its cores."""
    import os

    import torch

    device = machine.device_type if p.offload == "none" else "cpu"
    stepped = n_params / (world_size if engine_module(p.engine).SHARDS_OPTIMIZER_STATE else 1)
    if device == "cpu":
        stepped *= max(1.0, machine.ranks_per_host * torch.get_num_threads() / (os.cpu_count() or 1))
    rate = machine.optimizer_params_per_s
    return stepped * (1 / rate(p.state_dtype, device) - 1 / rate("fp32", device))


def fastest_fitting(table: list):
    """The fastest placement row of ``table`` (:class:`memtrain.planning.placement.Placement`) that
    fits and whose optimizer can step here (a finite ``predicted_step_s``), the first of equals;
    None when there is none: the reference of the planner's lossy margin."""
    return min((p for p in table if p.fits and p.predicted_step_s < math.inf), key=lambda p: p.predicted_step_s,
               default=None)


def choose_charging_steps(table: list, choose, n_params: int, world_size: int, machine):
    """``choose(table)`` (the placement planner's choice) with the measured step of each lossier
    state dtype charged before a row of it may decide the choice: while the chosen row or the
    fastest fitting one (the reference of :data:`memtrain.planning.placement.LOSSY_MARGIN`) has bf16
    or int8 moments not yet charged, :func:`step_seconds_over_fp32` is added to the predicted step
    of every row with those moments (and kept in its ``state_dtype_s``) and the choice made again.
    A dtype is measured only where it would otherwise decide (int8's first step compiles); one
    that cannot step here (its measurement raised once) is charged infinity, which ``choose``
    never takes. Without rates (``machine.optimizer_params_per_s`` None: another machine's plan)
    this is ``choose(table)``."""
    if machine.optimizer_params_per_s is None:
        return choose(table)
    while True:
        best, fastest = choose(table), fastest_fitting(table)
        pending = {p.state_dtype for p in (best, fastest) if p is not None and p.state_dtype in LOSSY
                   and p.state_dtype_s is None}
        if not pending:
            return best
        for dtype in pending:
            rows = [p for p in table if p.state_dtype == dtype]
            try:
                seconds = [step_seconds_over_fp32(p, n_params, world_size, machine) for p in rows]
            except Exception:  # noqa: BLE001 - it cannot step here (int8 without a C++ compiler): never chosen
                seconds = [math.inf] * len(rows)
            for p, charge in zip(rows, seconds):
                p.state_dtype_s = charge
                p.predicted_step_s += charge


class OptimizerStateDtype(EngineSetting):
    """Settings: ``fp32``, ``bf16`` or ``int8``."""

    name = "optimizer_state_dtype"
    column = "optimizer state"
    config_key = "optimizer.state_dtype"
    on_resume = "must_match"
    by_hand = "bf16|int8"

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        """bf16 with ``adam_beta2`` at most :data:`BF16_MAX_BETA2`; int8 needs torchao and is not
        counted by MemTracker; ``memory.allow_lossy_levers`` only under ``memory.levers auto``; a
        Python caller's ``optimizer_factory`` keeps its own state (fp32 here, nothing lossy chosen)."""
        self.choices(cfg, SimpleNamespace(name=engine_name(cfg.backend)))  # what the engine cannot take, first
        dtype, m = cfg.optimizer.state_dtype, cfg.memory
        if "optimizer_factory" in python and dtype != "fp32":
            raise ConfigError("optimizer.state_dtype", f"{dtype} is memtrain's AdamW's; an optimizer_factory's "
                              "optimizer keeps its own state (set fp32)")
        if "optimizer_factory" in python and m.allow_lossy_levers:
            raise ConfigError("memory.allow_lossy_levers", "would choose memtrain's AdamW's state dtype; an "
                              "optimizer_factory's optimizer keeps its own state (set false)")
        if dtype == "bf16" and cfg.training.adam_beta2 > BF16_MAX_BETA2:
            raise ConfigError("optimizer.state_dtype", f"bf16 with training.adam_beta2 {cfg.training.adam_beta2}: each "
                              f"step decays the second moment by 1 - beta2, less than half a bf16 step (2^-9), which "
                              f"rounding to nearest loses, so the moment stops decaying; use adam_beta2 <= "
                              f"{BF16_MAX_BETA2}, or fp32 or int8 (block-scaled)")
        if dtype == "int8" and importlib.util.find_spec("torchao") is None:
            raise ConfigError("optimizer.state_dtype", "int8 is torchao's 8-bit AdamW, which is not installed: pip "
                              "install 'memtrain[lowbit]', or choose fp32 or bf16")
        if dtype == "int8" and cfg.logging.memory_breakdown_step > 0:
            raise ConfigError("logging.memory_breakdown_step", "cannot count a run with optimizer.state_dtype int8: "
                              "torchao's 8-bit AdamW compiles its step, and torch.compile refuses to run under "
                              "MemTracker's dispatch mode; set it to 0, or count the step with fp32 or bf16 moments")
        if m.allow_lossy_levers and m.levers != "auto":
            raise ConfigError("memory.allow_lossy_levers", "true lets the planner of memory.levers auto choose lossy "
                              "levers, but memory.levers is off: set memory.levers auto, or choose "
                              "optimizer.state_dtype yourself")

    def choices(self, cfg, spec) -> tuple:
        dtype = getattr(spec, "optimizer_state_dtype", None) or cfg.optimizer.state_dtype  # the planner's, else the config's
        if spec is not None and not engine_module(spec.name).LOSSY_OPTIMIZER_STATE and dtype in LOSSY:
            raise ConfigError("optimizer.state_dtype", f"{dtype} is for ddp and fsdp: DeepSpeed ZeRO keeps its fp32 "
                              "optimizer partitions (and steps them with DeepSpeedCPUAdam under offload); use fp32 "
                              "there, or backend.name ddp/fsdp")
        return (dtype,)

    def describe(self, setting) -> str:
        return "" if setting == "fp32" else f"{setting} optimizer state"

    def stop_words(self, setting) -> str:
        return self.describe(setting or "fp32")

    def stop_advice(self, setting, engine) -> str:
        if (setting or "fp32") != "fp32" or not engine.LOSSY_OPTIMIZER_STATE:
            return ""
        return ("optimizer.state_dtype bf16 or int8 in a new output_dir (half or a quarter of the optimizer state; "
                "lossy; it must match on resume)")
