"""The optimizer's state dtype as a lever (``optimizer.state_dtype fp32|bf16|int8``): AdamW's two
moments in fp32 (8 bytes per parameter), bf16 (4) or torchao's block-wise int8 (about 2;
:func:`memtrain.optim.make_optimizer`). Fixed when the engine is built; the engine's accounting
(:func:`memtrain.memory.accounting.adam_state_bytes`) counts its bytes. Lossy below fp32: a
plan never moves it once the engine is built; the config sets it, or, with
``memory.allow_lossy_levers``, the placement planner before the build (:func:`planner_dtypes`;
``memtrain plan`` shows what each setting would save)."""

from __future__ import annotations

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
    (torchao installed), outside DeepSpeed (which keeps fp32 partitions)."""
    import importlib.util

    dtype, m = cfg.optimizer.state_dtype, cfg.memory
    if not (m.allow_lossy_levers and m.levers == "auto" and dtype == "fp32") or engine == "deepspeed":
        return (dtype,)
    lossy = (("bf16",) if cfg.training.adam_beta2 <= BF16_MAX_BETA2 else ())
    return (dtype,) + lossy + (("int8",) if importlib.util.find_spec("torchao") is not None else ())


class OptimizerStateDtype(EngineSetting):
    """Settings: ``fp32``, ``bf16`` or ``int8``."""

    name = "optimizer_state_dtype"
    column = "optimizer state"
    config_key = "optimizer.state_dtype"

    def choices(self, cfg, spec) -> tuple:
        dtype = getattr(spec, "optimizer_state_dtype", None) or cfg.optimizer.state_dtype  # the planner's, else the config's
        if spec is not None and spec.name == "deepspeed" and dtype in LOSSY:
            raise ConfigError("optimizer.state_dtype", f"{dtype} is for ddp and fsdp: DeepSpeed ZeRO keeps its fp32 "
                              "optimizer partitions (and steps them with DeepSpeedCPUAdam under offload); use fp32 "
                              "there, or backend.name ddp/fsdp")
        return (dtype,)

    def describe(self, setting) -> str:
        return "" if setting == "fp32" else f"{setting} optimizer state"
