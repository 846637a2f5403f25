"""What a resumed run keeps of the placement its checkpoint was written with (the engine, ZeRO
stage, offload and the optimizer state dtype the placement planner chose): read from the
manifest of the checkpoint the run will resume, before the model is built
(:func:`memtrain.planning.run_placement.resolve`)."""

from __future__ import annotations

import os
from typing import Optional

from memtrain.backends import BACKENDS, engine_module, run_format
from memtrain.checkpoint.formats import full_state_read_bytes, saved_state_dtype
from memtrain.checkpoint.layout import complete_checkpoints, latest_checkpoint, read_manifest
from memtrain.errors import CheckpointError, ConfigError
from memtrain.memory.moments import with_switch


def resumed_manifest(cfg) -> Optional[dict]:
    """The manifest of the checkpoint the run will resume (``resume``: auto takes the newest
    complete one); None when there is none or it cannot be read (the resume itself says why)."""
    if cfg.resume == "never":
        return None
    root = os.path.join(os.path.expanduser(cfg.output_dir), "checkpoints")
    path = cfg.resume if cfg.resume != "auto" else latest_checkpoint(root) or (complete_checkpoints(root) or [None])[-1]
    try:
        return read_manifest(path)
    except (CheckpointError, KeyError, TypeError):
        return None


def resume_placement(cfg) -> Optional[dict]:
    """A resumed ``offload: auto`` run takes the placement its checkpoint was written with
    (another one could not load its optimizer state): its manifest's ``engine_spec`` (checkpoints
    written before the spec existed: its config's ``backend`` section). None when there is none."""
    saved = (resumed_manifest(cfg) or {}).get("engine_spec")
    if not saved or saved.get("offload") in (None, "auto"):
        return None
    return {"name": saved["name"], "zero_stage": saved.get("zero_stage"), "offload": saved["offload"],
            "offload_optimizer_ratio": saved.get("offload_optimizer_ratio", 1.0), "nvme_path": saved.get("nvme_path"),
            "optimizer_state_dtype": saved.get("optimizer_state_dtype")}


def resume_state_dtype(cfg, chooses: bool) -> Optional[str]:
    """The optimizer state dtype a resumed run keeps where the placement planner chose it, in the
    checkpoint's run or in this one (``chooses``: ``memory.allow_lossy_levers`` applies): the
    checkpoint's engine spec's choice, else its config's. None when there is no checkpoint to
    resume, or neither run let the planner choose (``optimizer.state_dtype`` is then the config's,
    and must match).

    Raises:
        memtrain.errors.ConfigError: kept int8 moments with ``logging.memory_breakdown_step`` (MemTracker
            cannot count their compiled step).
    """
    manifest = resumed_manifest(cfg)
    if manifest is None:
        return None
    chosen, dtype = saved_state_dtype(manifest)
    if chosen is None and not chooses:
        return None
    if dtype == "int8" and cfg.logging.memory_breakdown_step > 0:
        raise ConfigError("logging.memory_breakdown_step", "cannot count this run: the checkpoint it resumes has "
                          "int8 optimizer moments (chosen under memory.allow_lossy_levers), whose compiled step "
                          "torch.compile refuses to run under MemTracker; set it to 0")
    return dtype


def switch_read(cfg, shape) -> Optional[tuple[tuple[str, str], int, int]]:
    """``((the engine that wrote it, its format), read_bytes, read_peak_bytes)`` of the checkpoint
    the run will resume, as another engine would read it (its format's ``full_state_read_bytes``,
    for a model of ``shape``: a :class:`memtrain.memory.shape.ModelShape`); None when there is
    none or its manifest names no known format. A manifest written before manifests named their
    ``checkpoint_model`` is read with the one its engine hands every format (its module's
    ``CHECKPOINT_MODEL``)."""
    manifest = resumed_manifest(cfg)
    if not manifest or not manifest.get("backend"):
        return None
    if "checkpoint_model" not in manifest and manifest["backend"] in BACKENDS:
        manifest = {**manifest, "checkpoint_model": engine_module(manifest["backend"]).CHECKPOINT_MODEL}
    try:
        return ((manifest["backend"], manifest.get("checkpoint_format")), *full_state_read_bytes(manifest, shape))
    except CheckpointError:
        return None


def with_resumed_switch(state: dict, cfg, engine: str, switch: Optional[tuple[tuple[str, str], int, int]]) -> dict:
    """``state`` (engine ``engine``'s ``model_state_bytes`` dict) with the engine switch's resume
    moment when the checkpoint ``switch`` describes (:func:`switch_read`) was written by another
    engine or in another format than the run's (:func:`memtrain.backends.run_format`: either is read whole, as
    another engine's; :func:`memtrain.memory.moments.with_switch`); else ``state`` itself."""
    if switch is None or switch[0] == (engine, run_format(engine, cfg.checkpoint.format)) or "held_bytes" not in state:
        return state
    return with_switch(state, switch[1], switch[2])
