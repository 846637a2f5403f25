"""A user's DeepSpeed JSON, reconciled with memtrain's config.

``"auto"`` values are filled from memtrain's settings the way transformers' DeepSpeed integration
fills them from its ``TrainingArguments`` (batch sizes, accumulation, clipping, precision, and the
``optimizer`` and ``scheduler`` sections' learning rate, betas, eps, weight decay, warmup and total
steps); a concrete value that contradicts memtrain's is an error naming both.

The ``optimizer`` section may name ``Adam`` or ``AdamW`` (AdamW math, DeepSpeed's default
``adam_w_mode``): memtrain builds that optimizer itself from ``training.*`` (DeepSpeedCPUAdam under
optimizer offload, as DeepSpeed would), so the accumulation boundaries and OOM retries stay
memtrain's. The ``scheduler`` section may name ``WarmupLR``, ``WarmupDecayLR`` or
``WarmupCosineLR``: DeepSpeed's own class is built (:mod:`memtrain.optim`) and stepped once per
optimizer step. Both sections are removed from what ``deepspeed.initialize`` sees.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Any, Mapping, Optional

from memtrain.config import ConfigError, TrainingConfig

OPTIMIZERS = ("Adam", "AdamW")
"""DeepSpeed optimizer types memtrain builds (both are AdamW with ``adam_w_mode`` on, its default)."""

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""DeepSpeed scheduler types memtrain builds (DeepSpeed's own classes, ``deepspeed.runtime.lr_schedules``)."""


def get_path(d: dict, path: str):
    """``d["a"]["b"]`` for ``path`` ``"a.b"``; None when a key is missing."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def set_path(d: dict, path: str, value) -> None:
    """Set ``d["a"]["b"] = value`` for ``path`` ``"a.b"``, creating the sections on the way."""
    keys = path.split(".")
    for key in keys[:-1]:
        d = d.setdefault(key, {})
    d[keys[-1]] = value


def _same(theirs, ours) -> bool:
    if isinstance(ours, (list, tuple)):
        return isinstance(theirs, (list, tuple)) and len(theirs) == len(ours) and all(
            _same(a, b) for a, b in zip(theirs, ours))
    if isinstance(ours, float) and isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        return abs(float(theirs) - ours) <= 1e-12 * max(1.0, abs(ours))
    return theirs == ours


class _Reconciler:
    """Fills ``"auto"``/missing values of ``cfg`` with memtrain's and rejects contradictions."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def __call__(self, path: str, ours, field: str, default_from_json: bool = False):
        theirs = get_path(self.cfg, path)
        if theirs is None or theirs == "auto":
            set_path(self.cfg, path, list(ours) if isinstance(ours, tuple) else ours)
        elif not _same(theirs, ours):
            if default_from_json:
                return theirs
            raise ConfigError(field, f"{self.source} sets {path} = {theirs!r}, which contradicts {field} = {ours!r}; "
                              "set one of them to agree, or use \"auto\" in the JSON")
        return get_path(self.cfg, path)

    def fill(self, path: str, value) -> None:
        """A setting memtrain has no field for: ``"auto"``/missing becomes ``value``."""
        if get_path(self.cfg, path) in (None, "auto"):
            set_path(self.cfg, path, value)


def _section_type(reconcile: _Reconciler, name: str, choices: tuple[str, ...], instead: str) -> Optional[str]:
    """The ``type`` of the JSON's section ``name`` (None without the section).

    Raises:
        ConfigError: a type outside ``choices`` (names them and ``instead``, what memtrain offers).
    """
    section = reconcile.cfg.get(name)
    if section is None:
        return None
    kind = section.get("type")
    if kind not in choices:
        raise ConfigError("backend.deepspeed_config", f"{reconcile.source}: {name} type {kind!r} is not supported; "
                          f"choices: {', '.join(choices)}{instead}")
    return kind


def _reconcile_optimizer(reconcile: _Reconciler, t: TrainingConfig) -> None:
    if _section_type(reconcile, "optimizer", OPTIMIZERS, " (memtrain builds AdamW from training.*)") is None:
        return
    params = reconcile.cfg["optimizer"].get("params") or {}
    for key, want in (("adam_w_mode", True), ("bias_correction", True), ("amsgrad", False)):
        if params.get(key, want) not in (want, "auto"):
            raise ConfigError("backend.deepspeed_config", f"{reconcile.source} sets optimizer.params.{key} = "
                              f"{params[key]!r}; memtrain's AdamW needs {key} = {want}")
    reconcile("optimizer.params.lr", t.lr, "training.lr")
    reconcile("optimizer.params.betas", (t.adam_beta1, t.adam_beta2), "training.adam_beta1/adam_beta2")
    reconcile("optimizer.params.eps", t.adam_eps, "training.adam_eps")
    reconcile("optimizer.params.weight_decay", t.weight_decay, "training.weight_decay")


def _reconcile_scheduler(reconcile: _Reconciler, t: TrainingConfig) -> None:
    kind = _section_type(reconcile, "scheduler", SCHEDULERS, ", or remove the section for memtrain's warmup + "
                         "cosine schedule (training.warmup_steps, training.min_lr_ratio)")
    if kind is None:
        return
    reconcile("scheduler.params.warmup_num_steps", t.warmup_steps, "training.warmup_steps")
    if kind != "WarmupLR":
        reconcile("scheduler.params.total_num_steps", t.max_steps, "training.max_steps")
    if kind == "WarmupCosineLR":
        reconcile.fill("scheduler.params.warmup_min_ratio", 0.0)
        reconcile("scheduler.params.cos_min_ratio", t.min_lr_ratio, "training.min_lr_ratio")
    else:
        reconcile.fill("scheduler.params.warmup_min_lr", 0.0)
        reconcile("scheduler.params.warmup_max_lr", t.lr, "training.lr")


def build_ds_config(user: Optional[dict], source: str, *, global_batch_size: int, micro_batch_size: int,
                    gradient_accumulation_steps: int, max_grad_norm: float, precision: str,
                    precision_requested: str, zero_stage: Optional[int], offload: Optional[str],
                    training: Optional[TrainingConfig] = None, offload_optimizer_ratio: float = 1.0,
                    nvme_path: Optional[str] = None) -> dict[str, Any]:
    """The DeepSpeed config for this run: the user's JSON (or an empty one), ``"auto"`` values
    filled from memtrain's settings, contradictions rejected.

    Args:
        user: the parsed DeepSpeed JSON, or None.
        source: its file name (for messages).
        global_batch_size, micro_batch_size, gradient_accumulation_steps: the batch plan (samples).
        max_grad_norm: clipping threshold (0 = none).
        precision: resolved precision; precision_requested: the setting (``auto`` defers to the JSON).
        zero_stage, offload: ``backend.zero_stage`` / ``backend.offload``; None = take the JSON's
            (defaults 2 / none).
        offload_optimizer_ratio, nvme_path: ``backend.*`` (partial offload, NVMe offload folder).
        training: ``training.*`` (lr, betas, eps, weight decay, warmup, max steps) for the
            ``optimizer`` and ``scheduler`` sections; None = the defaults.

    Returns:
        A complete DeepSpeed config dict; its ``optimizer`` and ``scheduler`` sections, when the
        JSON has them, are resolved (no ``"auto"`` left) and still present: the engine removes
        them before ``deepspeed.initialize``.

    Raises:
        ConfigError: a JSON value contradicts memtrain's (names both), or the JSON names an
            optimizer or scheduler type memtrain does not build (names the choices).
    """
    cfg = copy.deepcopy(user or {})
    reconcile = _Reconciler(cfg, source)
    t = training or TrainingConfig()
    _reconcile_optimizer(reconcile, t)
    _reconcile_scheduler(reconcile, t)
    reconcile("train_batch_size", global_batch_size, "training.global_batch_size")
    reconcile("train_micro_batch_size_per_gpu", micro_batch_size, "training.micro_batch_size")
    reconcile("gradient_accumulation_steps", gradient_accumulation_steps, "training.micro_batch_size")
    reconcile("gradient_clipping", float(max_grad_norm), "training.max_grad_norm")

    stage = reconcile("zero_optimization.stage", resolve_zero_stage(zero_stage, cfg), "backend.zero_stage")
    if stage not in (1, 2, 3):
        raise ConfigError("backend.zero_stage", f"{source}: zero_optimization.stage = {stage!r}; choices: 1, 2, 3")
    _reconcile_offload(cfg, reconcile, source, stage, offload, offload_optimizer_ratio, nvme_path)
    _reconcile_precision(cfg, source, precision, precision_requested)
    cfg.setdefault("steps_per_print", 2**31 - 1)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def read_user_json(path: Optional[str]) -> dict:
    """The DeepSpeed JSON at ``path`` ({} without one).

    Raises:
        ConfigError: field ``backend.deepspeed_config``: unreadable, or not a JSON object (the
            message names the file, line and column: JSON has no comments or trailing commas).
    """
    if not path:
        return {}
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise ConfigError("backend.deepspeed_config", f"{path} cannot be read: {exc}") from None
    return copy.deepcopy(_parsed_json(path, stat.st_mtime_ns, stat.st_size))  # callers may fill it in


@functools.lru_cache(maxsize=8)
def _parsed_json(path: str, mtime_ns: int, size: int) -> dict:
    """The JSON at ``path``, parsed once per process for each version of the file (validation,
    placement and the engine all read it)."""
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = json.load(fh)
    except json.JSONDecodeError as exc:
        lines = exc.doc.splitlines()
        shown = lines[exc.lineno - 1].strip() if 0 < exc.lineno <= len(lines) else ""
        raise ConfigError("backend.deepspeed_config", f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno} ({shown!r}); JSON allows no comments and no trailing commas") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("backend.deepspeed_config", f"{path} cannot be read: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError("backend.deepspeed_config", f"{path} holds a JSON {type(loaded).__name__}, not an object of "
                          "DeepSpeed settings")
    return loaded


def resolve_zero_stage(zero_stage: Optional[int], user: dict):
    """The ZeRO stage of a run: ``backend.zero_stage``, else the JSON's, else 2."""
    json_stage = get_path(user, "zero_optimization.stage")
    return zero_stage if zero_stage is not None else json_stage if json_stage not in (None, "auto") else 2


OFFLOAD_DEVICES = ("cpu", "nvme")


ZERO_BUFFER_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_reuse_distance",
                    "stage3_param_persistence_threshold")
"""The ``zero_optimization`` buffer sizes (elements) the accounting counts as a JSON sets them."""
ZERO_IN_PLACE_KEYS = ("reduce_scatter", "contiguous_gradients")
"""The ``zero_optimization`` flags that decide whether ZeRO-2 and ZeRO-3 reduce a bucket in place (1 or 0)."""
ZERO_LINEAR_KEY = "memory_efficient_linear"
"""The ``zero_optimization`` flag (default on) by which ZeRO-3 runs its own linear, which saves a
layer's weight itself for backward, not a view that would keep it gathered
(:func:`memtrain.backends.ds_zero_init.use_memory_efficient_linear`)."""


def linear_saves_weight(settings: Mapping[str, int]) -> bool:
    """Whether ZeRO-3 runs DeepSpeed's memory-efficient linear (:data:`ZERO_LINEAR_KEY`: on unless
    the section turns it off; ``0`` and ``false`` alike), from :func:`zero_buffer_settings`' output:
    the one reading the engine and the plan's trace share."""
    return bool(settings.get(ZERO_LINEAR_KEY, 1))


def zero_buffer_settings(zero: dict) -> dict[str, int]:
    """The buffer sizes (:data:`ZERO_BUFFER_KEYS`, elements) and flags (:data:`ZERO_IN_PLACE_KEYS`,
    :data:`ZERO_LINEAR_KEY`; 1 or 0) a ``zero_optimization`` section sets; unset or ``auto``
    ones are left out (the accounting's own sizes, DeepSpeed's defaults, stand for them)."""
    return {**{k: int(float(zero[k])) for k in ZERO_BUFFER_KEYS if zero.get(k) not in (None, "auto")},
            **{k: int(bool(zero[k])) for k in (*ZERO_IN_PLACE_KEYS, ZERO_LINEAR_KEY) if zero.get(k) is not None}}


def offload_in_json(user: dict) -> tuple[str, float, bool]:
    """What a DeepSpeed JSON offloads: ``(none|optimizer|optimizer_and_params, the optimizer
    state's fraction on the host, whether to NVMe)``."""
    devices = [get_path(user, f"zero_optimization.{k}.device") for k in ("offload_optimizer", "offload_param")]
    optimizer, params = (d in OFFLOAD_DEVICES for d in devices)
    offload = "optimizer_and_params" if optimizer and params else "optimizer" if optimizer else "none"
    ratio = get_path(user, "zero_optimization.offload_optimizer.ratio")
    return offload, float(ratio) if isinstance(ratio, (int, float)) else 1.0, "nvme" in devices


def _reconcile_offload(cfg: dict, reconcile: "_Reconciler", source: str, stage: int, offload: Optional[str],
                       ratio: float, nvme_path: Optional[str]) -> None:
    """``backend.offload``, ``offload_optimizer_ratio`` and ``nvme_path`` written into the JSON's
    ``zero_optimization.offload_*`` sections (a JSON offload memtrain's settings contradict is an
    error naming both; memtrain's defaults defer to the JSON)."""
    json_offload = offload_in_json(cfg)[0]
    if offload is None:
        offload = json_offload
    elif offload != json_offload and json_offload != "none":
        raise ConfigError("backend.offload", f"{source} offloads '{json_offload}', which contradicts backend.offload = "
                          f"'{offload}'")
    if offload == "auto":
        raise ConfigError("backend.offload", "auto is resolved by the placement planner before the engine is built")
    if offload == "optimizer_and_params" and stage != 3:
        raise ConfigError("backend.offload", f"optimizer_and_params needs ZeRO stage 3, got stage {stage}")
    sections = {"optimizer": ["offload_optimizer"], "optimizer_and_params": ["offload_optimizer", "offload_param"]}
    for section in sections.get(offload, []):
        json_device = get_path(cfg, f"zero_optimization.{section}.device")
        device = "nvme" if nvme_path else json_device if json_device in OFFLOAD_DEVICES else "cpu"
        set_path(cfg, f"zero_optimization.{section}.device", device)
        if nvme_path:
            reconcile(f"zero_optimization.{section}.nvme_path", nvme_path, "backend.nvme_path")
    if nvme_path and offload in (None, "none"):
        raise ConfigError("backend.nvme_path", "is set but nothing is offloaded: set backend.offload to optimizer or "
                          "optimizer_and_params (or drop backend.nvme_path)")
    nvme = "nvme" in (get_path(cfg, "zero_optimization.offload_optimizer.device"),
                      get_path(cfg, "zero_optimization.offload_param.device"))
    if nvme and stage != 3:
        raise ConfigError("backend.nvme_path", f"NVMe offload needs ZeRO stage 3 (DeepSpeed's stages 1/2 keep the "
                          f"state in host memory), got stage {stage}")
    if offload in ("optimizer", "optimizer_and_params"):
        reconcile.fill("zero_optimization.offload_optimizer.ratio", ratio)
    json_ratio = get_path(cfg, "zero_optimization.offload_optimizer.ratio")
    if nvme and (ratio != 1.0 or json_ratio not in (None, 1.0)):
        raise ConfigError("backend.offload_optimizer_ratio", "partial offload cannot be combined with NVMe offload "
                          "(DeepSpeed's swapper would take the device's share too): drop one")
    if ratio != 1.0 or json_ratio not in (None, 1.0):
        shown = ratio if ratio != 1.0 else json_ratio
        if offload not in ("optimizer", "optimizer_and_params") or stage != 3:
            raise ConfigError("backend.offload_optimizer_ratio", f"partial optimizer offload (ratio {shown}) needs "
                              f"ZeRO stage 3 with backend.offload optimizer or optimizer_and_params, got stage {stage} "
                              f"and offload '{offload}'")
        if ratio != 1.0:
            reconcile("zero_optimization.offload_optimizer.ratio", ratio, "backend.offload_optimizer_ratio")


def _reconcile_precision(cfg: dict, source: str, precision: str, precision_requested: str) -> None:
    for name in ("bf16", "fp16"):
        if precision_requested == "auto" and get_path(cfg, f"{name}.enabled") is True:
            precision = name  # "auto" defers to an explicit choice in the JSON
    if precision == "fp16" and precision_requested == "auto":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("backend.deepspeed_config", f"{source} sets fp16.enabled = true, which needs a CUDA GPU "
                              "(fp16 with loss scaling); on the CPU set fp16.enabled to false or \"auto\" in it, or "
                              "use precision bf16 or fp32")
    for name in ("bf16", "fp16"):
        enabled = get_path(cfg, f"{name}.enabled")
        want = precision == name
        if enabled in (None, "auto"):
            set_path(cfg, f"{name}.enabled", want)
        elif bool(enabled) != want:
            raise ConfigError("precision", f"{source} sets {name}.enabled = {enabled}, which contradicts precision = "
                              f"{precision_requested} (resolved: {precision})")
