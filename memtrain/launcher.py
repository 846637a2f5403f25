"""The user's ``accelerate launch --config_file`` settings, honoured or refused — never ignored.

``accelerate launch`` turns the user's Accelerate YAML into environment variables of the
processes it starts (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``,
``ACCELERATE_DEEPSPEED_*``, ``FSDP_*``, …; see ``accelerate/utils/launch.py``). Each one memtrain
knows is, before anything runs:

* **applied** to memtrain's config where memtrain's own setting is at its default (precision
  ``auto``, ``micro_batch_size`` at its default, ``max_grad_norm`` at its default,
  ``activation_checkpointing`` ``auto``, ``zero_stage``/``offload`` unset);
* **checked**: a memtrain setting the user gave that contradicts it is a ``ConfigError`` naming
  both (exit 2);
* or, when memtrain does the thing its own way, **named in a warning** that says what memtrain
  does instead (e.g. ``fsdp_state_dict_type``: memtrain's checkpoints are always sharded).

The engine modules still read the variables that choose and shape the engine
(``ACCELERATE_USE_FSDP``/``_DEEPSPEED``, the DeepSpeed JSON, FSDP resharding and offload); this
module reconciles the rest with the config, and the engine-shaping ones with explicit settings.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

from memtrain.config import BackendConfig, Config, ConfigError, MemoryConfig, TrainingConfig

_TRUE = ("1", "true", "yes")

NOT_NEEDED = {
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": ("zero3_init_flag", "true", "memtrain builds the model once per rank and "
                                        "ZeRO-3 partitions it when the engine starts"),
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": ("zero3_save_16bit_model", "true", "memtrain always writes the "
                                                    "full model to output_dir/model (safetensors) at the end"),
    "FSDP_FORWARD_PREFETCH": ("fsdp_forward_prefetch", "true", "FSDP2 prefetches the next block's parameters itself"),
    "FSDP_USE_ORIG_PARAMS": ("fsdp_use_orig_params", "false", "FSDP2 always keeps the original parameters"),
}
"""Variables memtrain does not need: (the YAML key, the value that would ask for something, what
memtrain does instead)."""


def _value(environ: Mapping[str, str], name: str) -> Optional[str]:
    value = environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _contradiction(field: str, setting: str, theirs, ours) -> ConfigError:
    return ConfigError(field, f"the Accelerate config (accelerate launch) sets {setting} = {theirs}, which contradicts "
                       f"{field} = {ours}; make them agree or remove one")


def _precision(cfg: Config, environ: Mapping[str, str]) -> None:
    mp = (_value(environ, "ACCELERATE_MIXED_PRECISION") or "no").lower()
    if mp == "no":  # also accelerate's default: not a request for fp32
        return
    if mp not in ("bf16", "fp16"):
        raise ConfigError("precision", f"the Accelerate config sets mixed_precision = {mp}; memtrain supports bf16, "
                          "fp16 or no")
    if cfg.precision == "auto":
        cfg.precision = mp
    elif cfg.precision != mp:
        raise _contradiction("precision", "mixed_precision", mp, cfg.precision)


def _accumulation(cfg: Config, world_size: int, environ: Mapping[str, str], warn) -> None:
    value = _value(environ, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if value is None:
        return
    t, field = cfg.training, "training.micro_batch_size"
    gas = _number(value, "gradient_accumulation_steps", int)
    share = t.global_batch_size // max(1, world_size)
    if t.micro_batch_size == "auto":
        warn(f"the Accelerate config's gradient_accumulation_steps = {gas} is not used: training.micro_batch_size "
             "auto lets the planner choose the micro-batch and accumulation")
        return
    if t.micro_batch_size == TrainingConfig.micro_batch_size:  # memtrain's default: the user's accumulation wins
        if gas <= 0 or share % gas:
            raise ConfigError(field, f"the Accelerate config's gradient_accumulation_steps = {gas} does not divide the "
                              f"rank's share of training.global_batch_size ({t.global_batch_size} / {world_size} ranks "
                              f"= {share} samples)")
        t.micro_batch_size = share // gas
    elif share != gas * t.micro_batch_size:
        raise _contradiction(field, "gradient_accumulation_steps", gas,
                             f"{t.micro_batch_size} (accumulation {share} / {t.micro_batch_size} on {world_size} "
                             "rank(s))")


def _clipping(cfg: Config, environ: Mapping[str, str]) -> None:
    value = _value(environ, "ACCELERATE_GRADIENT_CLIPPING")
    if value is None or value.lower() == "none":
        return
    norm = _number(value, "gradient_clipping", float)
    if cfg.training.max_grad_norm == TrainingConfig.max_grad_norm:
        cfg.training.max_grad_norm = norm
    elif cfg.training.max_grad_norm != norm:
        raise _contradiction("training.max_grad_norm", "gradient_clipping", norm, cfg.training.max_grad_norm)


def _apply(cfg_section, name: str, field: str, setting: str, theirs) -> None:
    """``theirs`` (not None) becomes ``cfg_section.name`` when that is unset (None); a different
    value already there is a contradiction."""
    ours = getattr(cfg_section, name)
    if ours is None:
        setattr(cfg_section, name, theirs)
    elif ours != theirs:
        raise _contradiction(field, setting, theirs, ours)


def _engine(cfg: Config, environ: Mapping[str, str]) -> None:
    b = cfg.backend
    wanted = "fsdp" if (_value(environ, "ACCELERATE_USE_FSDP") or "").lower() in _TRUE else \
        "deepspeed" if (_value(environ, "ACCELERATE_USE_DEEPSPEED") or "").lower() in _TRUE else None
    if wanted is None:
        return
    if b.name not in ("auto", wanted):
        raise _contradiction("backend.name", "distributed_type", wanted.upper(), b.name)
    if wanted == "fsdp":
        _fsdp(cfg, environ)
        return
    path = _value(environ, "ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path is not None:
        if b.deepspeed_config is not None and os.path.abspath(b.deepspeed_config) != os.path.abspath(path):
            raise _contradiction("backend.deepspeed_config", "deepspeed_config_file", path, b.deepspeed_config)
        b.deepspeed_config = path
        return
    stage = _value(environ, "ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None:
        _apply(b, "zero_stage", "backend.zero_stage", "zero_stage", _number(stage, "zero_stage", int))
    env_offload = "optimizer_and_params" if _value(environ, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE") == "cpu" \
        else "optimizer" if _value(environ, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE") == "cpu" else None
    if env_offload is not None:
        _apply(b, "offload", "backend.offload", "offload_optimizer_device/offload_param_device", env_offload)


def _fsdp(cfg: Config, environ: Mapping[str, str]) -> None:
    if (_value(environ, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD") or "").lower() in _TRUE:
        raise ConfigError("memory.activation_checkpointing", "the Accelerate config sets "
                          "fsdp_activation_checkpointing_offload = true; memtrain recomputes activations instead "
                          "of offloading them: set it to false")
    if (_value(environ, "FSDP_ACTIVATION_CHECKPOINTING") or "").lower() in _TRUE:
        m = cfg.memory
        if m.activation_checkpointing == MemoryConfig.activation_checkpointing:
            m.activation_checkpointing = "on"
        elif m.activation_checkpointing == "off":
            raise _contradiction("memory.activation_checkpointing", "fsdp_activation_checkpointing", "true", "off")
    if (_value(environ, "FSDP_OFFLOAD_PARAMS") or "").lower() in _TRUE:
        _apply(cfg.backend, "offload", "backend.offload", "fsdp_offload_params", "optimizer_and_params")
    reshard = _value(environ, "FSDP_RESHARD_AFTER_FORWARD")
    strategy = _value(environ, "FSDP_SHARDING_STRATEGY")
    if reshard is None and strategy is not None:  # fsdp_version 1 names: SHARD_GRAD_OP (2) keeps them gathered
        reshard = "false" if strategy.upper() in ("SHARD_GRAD_OP", "2") else "true"
    if reshard is not None and (reshard.lower() in _TRUE) != cfg.backend.reshard_after_forward:
        if cfg.backend.reshard_after_forward != BackendConfig.reshard_after_forward:  # the user's own choice
            raise _contradiction("backend.reshard_after_forward", "fsdp_reshard_after_forward", reshard,
                                 cfg.backend.reshard_after_forward)
        cfg.backend.reshard_after_forward = reshard.lower() in _TRUE


MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS")
"""Variables an MPI launcher sets in each process it starts (Open MPI, MPICH / Intel MPI)."""


def _one_process_of_several(environ: Mapping[str, str], world_size: int) -> None:
    """``accelerate launch`` with an Accelerate config asking for several CPU processes
    (``distributed_type: MULTI_CPU``) starts them only through ``mpirun`` (``mpirun_hostfile``);
    without it, Accelerate's simple launcher starts this one process, with ``MASTER_ADDR`` set
    for a group nobody else will join. Training on alone would be a different run than the one
    asked for: refused, with how to launch instead.

    Raises:
        ConfigError: launched by Accelerate for several processes (``MASTER_ADDR`` set) as one
            process, without a torchrun/DeepSpeed (``WORLD_SIZE``) or MPI world.
    """
    by_accelerate = "ACCELERATE_MIXED_PRECISION" in environ
    if (not by_accelerate or "MASTER_ADDR" not in environ or "WORLD_SIZE" in environ or world_size > 1
            or any(name in environ for name in MPI_SIZE_VARIABLES)):
        return
    raise ConfigError("accelerate launch", "the Accelerate config asks for several processes, but its launcher "
                      "started this one alone (distributed_type MULTI_CPU starts CPU processes only through mpirun, "
                      "with mpirun_hostfile); launch them with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
                      "--num_processes N memtrain/train.py ...` (torchrun underneath) or `torchrun --nproc_per_node N "
                      "memtrain/train.py ...`")


def _number(value: str, setting: str, kind):
    """``kind(value)``, or a ConfigError naming the Accelerate setting."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError("accelerate launch", f"the Accelerate config's {setting} = {value!r} is not a "
                          f"{'whole ' if kind is int else ''}number") from None


def _fsdp_notes(environ: Mapping[str, str], warn) -> None:
    if _value(environ, "FSDP_VERSION") == "1":
        warn("the Accelerate config sets fsdp_version = 1: memtrain runs FSDP2 (fully_shard per block), with the same "
             "sharding")
    policy = (_value(environ, "FSDP_AUTO_WRAP_POLICY") or "TRANSFORMER_BASED_WRAP").upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        warn(f"the Accelerate config's fsdp_auto_wrap_policy = {policy} is not used: memtrain shards each transformer "
             "block, then the root")
    state_dict = (_value(environ, "FSDP_STATE_DICT_TYPE") or "SHARDED_STATE_DICT").upper()
    if state_dict != "SHARDED_STATE_DICT":
        warn(f"the Accelerate config's fsdp_state_dict_type = {state_dict} is not used: memtrain's checkpoints are "
             "sharded (torch.distributed.checkpoint); the full model is written to output_dir/model at the end")


def apply_accelerate_settings(cfg: Config, world_size: int, environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Reconcile ``cfg`` with the Accelerate launcher's settings (see the module docstring).

    Args:
        cfg: the parsed config; applied settings are written into it.
        world_size: number of ranks (for the accumulation ↔ micro-batch arithmetic).
        environ: the environment (default ``os.environ``).

    Returns:
        The warnings (also logged once, on rank 0): settings memtrain does not use, and why.

    Raises:
        ConfigError: a setting contradicts one memtrain's config gives (names both), or asks for
            something memtrain does not do (fp8, ``dynamo_backend``, activation offload).
    """
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    _one_process_of_several(environ, world_size)
    _precision(cfg, environ)
    _accumulation(cfg, world_size, environ, warnings.append)
    _clipping(cfg, environ)
    _engine(cfg, environ)
    dynamo = (_value(environ, "ACCELERATE_DYNAMO_BACKEND") or "NO").upper()
    if dynamo != "NO":
        raise ConfigError("training.compile", f"the Accelerate config sets dynamo_backend = {dynamo}; memtrain does "
                          "not compile through Accelerate: set dynamo_backend: 'NO' and use training.compile true")
    for name, (setting, value, instead) in NOT_NEEDED.items():
        if (_value(environ, name) or "").lower() == value:
            warnings.append(f"the Accelerate config's {setting} = {value} is not needed: {instead}")
    if (_value(environ, "ACCELERATE_USE_FSDP") or "").lower() in _TRUE:
        _fsdp_notes(environ, warnings.append)
    if int(environ.get("RANK", "0")) == 0:
        for message in warnings:
            logging.getLogger("memtrain").warning("memtrain: %s", message)
    return warnings
