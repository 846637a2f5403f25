"""The checkpoint directory layout and the rank-0 file operations on it: verify, commit, retain,
choose what to resume. No collectives and no torch state here, so every function runs (and is
tested) in one process.

::

    OUTPUT_DIR/checkpoints/
      step_00000100/
        manifest.json        step, world size, engine, config, model shapes, every file's size and sha256
        trainer_state.json   the JSON states: train state, LR scheduler, plan, evaluator, … (rank 0)
        rank_00000.pt …      each rank's RNG states (Python, NumPy, torch CPU, CUDA)
        …                    the engine's state: model*.safetensors + optimizer.pt (DDP),
                             dcp/ (FSDP2, torch.distributed.checkpoint), zero/ (DeepSpeed)
      latest                 the name of the newest complete checkpoint, replaced atomically
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Optional

from memtrain.config import ConfigError
from memtrain.checkpoint.formats import format_written_by
from memtrain.errors import CheckpointError
from memtrain.folders import ESCAPED_OOM_PREFIX, LOCK_FILE

log = logging.getLogger("memtrain")

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def step_dir_name(step: int) -> str:
    """``step_00000100`` for step 100."""
    return f"step_{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step of a ``step_XXXXXXXX`` directory name, else None."""
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def rank_file(rank: int) -> str:
    """``rank_00003.pt``: rank 3's own state file."""
    return f"rank_{rank:05d}.pt"


def sha256(path: str, chunk: int = 16 * 2**20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync(path: str) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(directory: str) -> list[str]:
    """Every file below ``directory`` (relative paths, sorted)."""
    out = []
    for base, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(base, n), directory) for n in names]
    return sorted(out)


def complete_checkpoints(root: str) -> list[str]:
    """Checkpoint directories under ``root`` that hold a manifest, oldest step first."""
    if not os.path.isdir(root):
        return []
    found = [(s, os.path.join(root, n)) for n in os.listdir(root) if (s := step_of(n)) is not None]
    return [p for _, p in sorted(found) if os.path.isfile(os.path.join(p, MANIFEST))]


def _not_a_checkpoint(path: str) -> str:
    """Why ``path`` (without a manifest) is not a checkpoint, and what was expected instead."""
    if not os.path.isdir(path):
        return f"{path} does not exist (a checkpoint folder OUTPUT_DIR/checkpoints/step_NNNNNNNN is expected)"
    inner = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    found = complete_checkpoints(inner)
    if found:
        kind = "a run folder" if inner != path else "a checkpoints folder"
        return (f"{path} is {kind}, not one checkpoint; give one of its checkpoints (the newest: {found[-1]}), "
                f"or resume auto with output_dir set to the run folder")
    if step_of(os.path.basename(os.path.normpath(path))) is not None:
        return f"{path}: no {MANIFEST}: the save did not finish (incomplete checkpoint)"
    return f"{path} is not a memtrain checkpoint (no {MANIFEST}; expected OUTPUT_DIR/checkpoints/step_NNNNNNNN)"


def read_manifest(path: str) -> dict[str, Any]:
    """The one reader of ``path/manifest.json`` (resume, the placement a resumed run keeps, export,
    the engines' loads), with today's fields filled in for manifests of earlier memtrain versions:
    ``checkpoint_format`` (from the engine that wrote it) and ``engine_spec`` (from its config's
    ``backend`` section). Nothing on disk is changed; the files are not checked (:func:`verify`).

    Raises:
        CheckpointError: no manifest (an unfinished save, or not a checkpoint), or not a JSON object.
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(_not_a_checkpoint(path))
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path} is malformed: not a JSON object")
    if "checkpoint_format" not in manifest and isinstance(manifest.get("backend"), str):
        written = format_written_by(manifest["backend"])  # the format that engine wrote then
        if written is not None:
            manifest["checkpoint_format"] = written
    if "engine_spec" not in manifest and isinstance(manifest.get("config"), dict):
        manifest["engine_spec"] = {**(manifest["config"].get("backend") or {}), "name": manifest.get("backend")}
    return manifest


def verify(path: str) -> dict[str, Any]:
    """Check a checkpoint against its manifest: every listed file present with its size and sha256.

    Returns:
        The manifest (:func:`read_manifest`).

    Raises:
        CheckpointError: no manifest (an unfinished save), or a missing, truncated or corrupt file
            (named in the message).
    """
    manifest = read_manifest(path)
    manifest_path = os.path.join(path, MANIFEST)
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(i, dict) and {"bytes", "sha256"} <= set(i) for i in files.values()):
        raise CheckpointError(f"{manifest_path} is malformed: no file list with sizes and checksums")
    for rel, info in files.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes, {MANIFEST} says {info['bytes']} (truncated or replaced)")
        if sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from {MANIFEST}")
    return manifest


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint ``root/latest`` names (not verified), or None when there is no ``latest``."""
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return os.path.join(root, fh.read().strip())


def choose_resume(root: str, mode: str) -> Optional[str]:
    """The checkpoint to resume from.

    Args:
        root: the run's ``checkpoints`` directory.
        mode: ``never`` → None; a path → that checkpoint, verified; ``auto`` → ``latest`` when it
            verifies, else the newest complete checkpoint that does (each one refused is named in
            a warning); None when there is none.

    Raises:
        CheckpointError: an explicit path that fails verification, or ``auto`` with checkpoints of
            which none verifies.
    """
    if mode == "never":
        return None
    if mode != "auto":
        verify(mode)
        return mode
    candidates = list(reversed(complete_checkpoints(root)))
    named = latest_checkpoint(root)
    if named is not None:
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    refused = []
    for path in candidates:
        try:
            _say_verifying(path)
            verify(path)
            _name_unfinished(root, step_of(os.path.basename(path)))
            return path
        except CheckpointError as exc:
            refused.append(str(exc))
            log.warning("memtrain: not resuming from %s: %s", path, exc)
    if refused:
        raise CheckpointError("no complete checkpoint verifies: " + "; ".join(refused)
                              + ". Fix or remove them, or set resume never to start over")
    if os.path.isdir(root):
        _name_unfinished(root, 0)
    return None


def _say_verifying(path: str) -> None:
    """Say which checkpoint is being verified and loaded (reading a large one takes a while)."""
    try:
        size = sum(f.get("bytes", 0) for f in read_manifest(path).get("files", {}).values())
    except (CheckpointError, OSError, ValueError, AttributeError):
        return  # verify names what is wrong with it
    log.warning("memtrain: resuming: verifying %s (%s: every file's checksum), then loading it", path,
                f"{size / 1e9:.1f} GB" if size >= 10**9 else f"{size / 1e6:.1f} MB")


def _name_unfinished(root: str, resumed_step: int) -> None:
    """Warn about each ``step_XXXXXXXX`` folder newer than ``resumed_step`` without a manifest
    (a save that did not finish, or a manifest deleted): it is skipped, and the log says why."""
    for name in sorted(os.listdir(root)):
        step = step_of(name)
        if step is not None and step > resumed_step and not os.path.isfile(os.path.join(root, name, MANIFEST)):
            log.warning("memtrain: not resuming from %s: it has no %s (its save did not finish, or the file was "
                        "removed); %s", os.path.join(root, name), MANIFEST,
                        f"resuming from step {resumed_step} instead" if resumed_step else "starting from step 0")


def clean_stale(root: str) -> None:
    """Remove the temporary directories a killed save (or commit) left under ``root``, naming each."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            path = os.path.join(root, name)
            log.warning("memtrain: removing %s, left by an unfinished save", path)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:  # .tmp-latest
                os.remove(path)


def commit(tmp: str, root: str, step: int, expected: list[str], manifest: dict[str, Any]) -> tuple[str, int]:
    """Turn the written temporary directory ``tmp`` into checkpoint ``step``: check that every
    expected file is there, write ``manifest.json`` with each file's size and sha256, fsync,
    rename to ``step_XXXXXXXX`` (swapping out an older save of the same step) and replace
    ``latest`` atomically. A crash at any point leaves either the previous state or the new one.

    Args:
        tmp: the directory every rank wrote into.
        root: the ``checkpoints`` directory.
        step: the optimizer step saved.
        expected: glob patterns (relative to ``tmp``) each of which must match a file.
        manifest: the manifest's fields; ``files`` is added here.

    Returns:
        (the checkpoint's path, its total bytes).

    Raises:
        CheckpointError: a pattern of ``expected`` matches nothing.
    """
    missing = [pattern for pattern in expected if not glob.glob(os.path.join(tmp, pattern))]
    if missing:
        raise CheckpointError(f"save of step {step} is incomplete: nothing matches {missing} in {tmp}")
    files = {}
    for rel in files_under(tmp):
        full = os.path.join(tmp, rel)
        fsync(full)
        files[rel] = {"bytes": os.path.getsize(full), "sha256": sha256(full)}
    with open(os.path.join(tmp, MANIFEST), "w") as fh:
        json.dump({**manifest, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    for base, _, _ in os.walk(tmp):
        fsync(base)
    final = os.path.join(root, step_dir_name(step))
    if os.path.exists(final):  # a step saved again (resumed from an older checkpoint): swap it out
        trash = os.path.join(root, TRASH_PREFIX + step_dir_name(step))
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    latest_tmp = os.path.join(root, TMP_PREFIX + LATEST)
    with open(latest_tmp, "w") as fh:
        fh.write(step_dir_name(step) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST))
    fsync(root)
    return final, sum(f["bytes"] for f in files.values())


def retain(root: str, newest: str, keep_last: int, best: Optional[tuple[str, str]] = None) -> list[str]:
    """Delete complete checkpoints older than the newest ``keep_last`` (never ``newest``, never
    one of a later step, which belongs to a timeline this run did not overwrite yet, and never
    the best by ``best`` = ``(metric, "min" | "max")``: :func:`best_checkpoint`).

    Returns:
        The deleted paths.
    """
    step = step_of(os.path.basename(newest))
    kept = best_checkpoint(root, *best) if best is not None else None
    older = [p for p in complete_checkpoints(root) if step_of(os.path.basename(p)) < step]
    doomed = [p for p in older[:max(0, len(older) - (keep_last - 1))] if p != kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def best_checkpoint(root: str, metric: str, mode: str) -> Optional[str]:
    """The complete checkpoint whose manifest's ``metrics`` hold the lowest (``mode`` ``min``) or
    highest (``max``) value of ``metric`` (the earliest of equals); None when none holds it."""
    scored = []
    for path in complete_checkpoints(root):
        value = read_manifest(path).get("metrics", {}).get(metric)
        if isinstance(value, (int, float)) and value == value:  # NaN never wins
            scored.append((value if mode == "min" else -value, step_of(os.path.basename(path)), path))
    return min(scored)[2] if scored else None


RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "plan.json", "placement.json", "checkpoints", "model", "trackers",
               "memory_breakdown", "faults_fired")
"""What a run writes into its output folder (moved aside together by :func:`move_previous_run`)."""


def is_run_folder(output_dir: str) -> bool:
    """``output_dir`` is a memtrain run's: it holds the run lock's file (every run creates it
    first) or a checkpoint (``checkpoints/latest`` or a ``step_`` folder with a manifest: a run
    copied without its hidden files)."""
    root = os.path.join(output_dir, "checkpoints")
    return (os.path.exists(os.path.join(output_dir, LOCK_FILE)) or os.path.isfile(os.path.join(root, LATEST))
            or bool(complete_checkpoints(root)))


def check_run_folder(output_dir: str) -> None:
    """Refuse an existing ``output_dir`` that is no memtrain run's and holds a file or folder of
    the names a run writes (:data:`RUN_OUTPUTS`; ``model`` is checked as an export target): the
    run would overwrite the user's files. Other files of the user's may stay beside a run's.

    Raises:
        memtrain.config.ConfigError: field ``output_dir``, naming what it holds.
    """
    if not os.path.isdir(output_dir) or is_run_folder(output_dir):
        return
    held = [n for n in RUN_OUTPUTS if n != "model" and os.path.lexists(os.path.join(output_dir, n))]
    if held:
        raise ConfigError("output_dir", f"'{output_dir}' holds {', '.join(held)}, which no memtrain run wrote there (it "
                          f"has no {LOCK_FILE} and no checkpoint); a run writes files of those names and would "
                          "overwrite them. Nothing was written: give another output_dir, or move them")


def move_previous_run(output_dir: str) -> Optional[str]:
    """``resume: never`` in a folder a run already used: move that run's outputs into
    ``output_dir/previous_run_<UTC time>/`` (nothing is deleted, and the new run's checkpoints are
    never mixed with the old timeline's). Rank 0 only.

    Returns:
        The folder they were moved to, or None when there was nothing to move.
    """
    import time

    if not os.path.isdir(output_dir):  # a first run: nothing to move
        return None
    present = [n for n in RUN_OUTPUTS if os.path.lexists(os.path.join(output_dir, n))]

    present += sorted(n for n in os.listdir(output_dir) if n.startswith(ESCAPED_OOM_PREFIX + "."))  # a restart's notes
    if not present:
        return None
    target = os.path.join(output_dir, time.strftime("previous_run_%Y%m%dT%H%M%SZ", time.gmtime()))
    suffix = 0
    while os.path.exists(target + (f"_{suffix}" if suffix else "")):
        suffix += 1
    target += f"_{suffix}" if suffix else ""
    os.makedirs(target)
    for name in present:
        os.replace(os.path.join(output_dir, name), os.path.join(target, name))
    return target


def read_summary(run_dir: str) -> Optional[dict[str, Any]]:
    """``RUN_DIR/summary.json``, or None when it is missing or unreadable (a run still going)."""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
            summary = json.load(fh)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def finished_without_checkpoint(output_dir: str) -> Optional[int]:
    """The steps of a finished run in ``output_dir`` (its ``summary.json`` written) that left no
    complete checkpoint to resume from (``checkpoint.every_steps 0``): ``resume auto`` there would
    train it again over its outputs. None when the folder holds no such run (a run that stopped
    before writing its summary, e.g. one its launcher restarts, is not one)."""
    if not os.path.isfile(os.path.join(output_dir, "summary.json")) \
            or complete_checkpoints(os.path.join(output_dir, "checkpoints")):
        return None
    steps = (read_summary(output_dir) or {}).get("steps")  # unreadable: still a finished run's file
    return steps if isinstance(steps, int) else 0
