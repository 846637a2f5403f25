"""The optimizer's state dtype as a lever (``optimizer.state_dtype fp32|bf16|int8``): AdamW's two
moments in fp32 (8 bytes per parameter), bf16 (4) or torchao's block-wise int8 (about 2;
:func:`memtrain.optim.make_optimizer`). Fixed when the engine is built; the engine's accounting
(:func:`memtrain.memory.accounting.adam_state_bytes`) counts its bytes. Lossy below fp32: a
plan never moves it, only the user's config sets it (``memtrain plan`` shows what each setting
would save)."""

from __future__ import annotations

from memtrain.errors import ConfigError
from memtrain.levers.engine_settings import EngineSetting

LOSSY = ("bf16", "int8")
"""Settings that round the moments every step."""
STATE_DTYPES = ("fp32",) + LOSSY
"""Every setting of ``optimizer.state_dtype``."""


class OptimizerStateDtype(EngineSetting):
    """Settings: ``fp32``, ``bf16`` or ``int8``."""

    name = "optimizer_state_dtype"
    column = "optimizer state"
    config_key = "optimizer.state_dtype"

    def choices(self, cfg, spec) -> tuple:
        dtype = cfg.optimizer.state_dtype
        if spec is not None and spec.name == "deepspeed" and dtype in LOSSY:
            raise ConfigError("optimizer.state_dtype", f"{dtype} is for ddp and fsdp: DeepSpeed ZeRO keeps its fp32 "
                              "optimizer partitions (and steps them with DeepSpeedCPUAdam under offload); use fp32 "
                              "there, or backend.name ddp/fsdp")
        return (dtype,)

    def describe(self, setting) -> str:
        return "" if setting == "fp32" else f"{setting} optimizer state"
