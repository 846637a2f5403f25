"""Saving and restoring a ``dict[str, Stateful]`` with an atomic multi-rank commit.

The commit protocol (the one torchtitan and Orbax use, made explicit): every rank writes into
``.tmp-step_XXXXXXXX``; every rank learns whether any rank failed (an all-gather of errors); rank 0
alone checks that every expected file is there, writes ``manifest.json`` with sizes and
checksums, fsyncs, renames the directory to ``step_XXXXXXXX`` and replaces ``latest``
(:func:`memtrain.checkpoint.layout.commit`); then rank 0 broadcasts success or the error, so all
ranks agree. The rank-0-only part calls no collective, so it cannot deadlock. A directory
without a manifest is never loaded, and a killed save leaves only a ``.tmp-`` directory, removed
on the next start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

import memtrain
import memtrain.checkpoint.layout as layout
from memtrain.checkpoint.stateful import FileStateful
from memtrain.distributed import ProcessState
from memtrain.folders import write_error
from memtrain.errors import CheckpointError

log = logging.getLogger("memtrain")

FORMAT = 2
"""Manifest format: 2 = ``trainer_state.json`` holds one entry per Stateful (1: a flat dict)."""


@dataclass
class PendingSave:
    """A save whose files are (being) written but not yet committed."""

    tmp: str
    step: int
    futures: list[Future]
    manifest: dict[str, Any]
    expected: list[str]
    start: float
    blocked_s: float
    error: Optional[str] = None


@dataclass
class Checkpointer:
    """Saves and restores the training state; every method is called by every rank at the same
    point of the loop.

    Args:
        process: the process state (rank-0 work, broadcasts, error gathering).
        root: the ``checkpoints`` directory.
        keep_last: complete checkpoints to keep.
        keep_best: ``(metric, "min" | "max")``: the checkpoint of the best value is never deleted
            (``checkpoint.keep_best``; each manifest carries its step's evaluation metrics); None = off.
        async_save: let :class:`FileStateful` entries that can write in the background do so.
        manifest_extras: fields every manifest carries (config, vocabulary size).
        after_write: called on every rank with ``(step, tmp directory)`` once the files are
            written (fault injection); an exception there fails the save.
        report: where "saved …" lines go.
        before_commit: called on rank 0 right before a save is committed (the step records written
            so far are made durable there: :meth:`memtrain.metrics.MetricsLogger.sync`).

    Attributes:
        events: ``checkpoint_saved`` events not yet written to metrics (the loop drains them).
    """

    process: ProcessState
    root: str
    keep_last: int = 2
    keep_best: Optional[tuple[str, str]] = None
    async_save: bool = False
    manifest_extras: dict[str, Any] = field(default_factory=dict)
    after_write: Optional[Callable[[int, str], None]] = None
    report: Callable[[str], None] = log.info
    before_commit: Optional[Callable[[], None]] = None
    events: list[dict] = field(default_factory=list, init=False)
    _pending: Optional[PendingSave] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self._on_main(layout.clean_stale, self.root)

    def _on_main(self, fn, *args) -> Any:
        """Run ``fn`` on rank 0 only (it must not call collectives), then let every rank raise its
        error or get its result."""
        result = None
        if self.process.is_main:
            try:
                result = ("ok", fn(*args))
            except Exception as exc:  # noqa: BLE001 — any failure must reach the other ranks, or they hang
                result = ("error", str(exc) if isinstance(exc, (CheckpointError, OSError))
                          else f"{type(exc).__name__}: {exc}")
        status, value = self.process.broadcast_object(result, patient=True)  # rank 0 may have hashed for long
        if status == "error":
            raise CheckpointError(value)
        return value

    # -- resume ------------------------------------------------------------------------------
    def resume_path(self, mode: str) -> Optional[str]:
        """The checkpoint to resume from (``resume``: ``auto|never|PATH``), agreed by all ranks;
        rank 0 verifies it (:func:`memtrain.checkpoint.layout.choose_resume`).

        Raises:
            CheckpointError: as :func:`~memtrain.checkpoint.layout.choose_resume`.
        """
        return self._on_main(layout.choose_resume, self.root, mode)

    def load(self, path: str, states: dict[str, Any]) -> None:
        """Restore every entry of ``states`` from the verified checkpoint ``path``, in dict order.

        Raises:
            CheckpointError: an entry that does not fit this run, or a state the checkpoint lacks
            (an entry whose ``optional`` attribute is true may be absent).
        """
        manifest = layout.read_manifest(path)
        with open(os.path.join(path, layout.TRAINER_STATE)) as fh:
            saved = json.load(fh)
        if manifest.get("format", 1) == 1:
            saved = _upgrade_format_1(saved)
        for name, obj in states.items():
            if isinstance(obj, FileStateful):
                obj.load_files(path, manifest)
            elif name in saved:
                obj.load_state_dict(saved[name])
            elif not getattr(obj, "optional", False):  # an optional entry is absent from older checkpoints
                raise CheckpointError(f"{path}: {layout.TRAINER_STATE} has no '{name}' state")

    # -- save --------------------------------------------------------------------------------
    def writing(self) -> bool:
        """Whether an asynchronous save is still being written on some rank (a collective while
        one is pending, else free)."""
        if self._pending is None:
            return False
        local = any(not f.done() for f in self._pending.futures)
        return self.process.any_rank(local)

    def poll(self) -> None:
        """Commit a pending asynchronous save once every rank finished writing it (all ranks call)."""
        if self._pending is not None and not self.writing():
            self.finish()

    def save(self, step: int, states: dict[str, Any], metrics: Optional[dict[str, float]] = None) -> None:
        """Save ``states`` after optimizer step ``step`` (all ranks call). Committed at once, or,
        when an entry writes in the background, at :meth:`poll` / :meth:`finish`. ``metrics``:
        the step's evaluation metrics (``{"val_loss": …}``), written into the manifest.

        Raises:
            CheckpointError: an entry refused to be saved, or the commit failed (the previous
                complete checkpoint and ``latest`` are untouched).
        """
        self.finish()  # an earlier asynchronous save is committed first
        files = [obj for obj in states.values() if isinstance(obj, FileStateful)]
        manifest: dict[str, Any] = {"metrics": dict(metrics)} if metrics else {}
        for obj in files:
            manifest.update(obj.prepare_save(step))
        tmp = os.path.join(self.root, layout.TMP_PREFIX + layout.step_dir_name(step))

        def make_tmp():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._on_main(make_tmp)  # doubles as the barrier before anyone writes
        pending = PendingSave(tmp, step, [], manifest, [p for obj in files for p in obj.expected_files()]
                              + [layout.TRAINER_STATE], time.perf_counter(), 0.0)
        try:
            for obj in files:
                future = obj.save_files(tmp, self.async_save)
                if future is not None:
                    pending.futures.append(future)
            if self.after_write is not None:
                self.after_write(step, tmp)
            if self.process.is_main:
                with open(os.path.join(tmp, layout.TRAINER_STATE), "w") as fh:
                    json.dump({name: obj.state_dict() for name, obj in states.items()
                               if not isinstance(obj, FileStateful)}, fh, indent=1)
        except Exception as exc:  # noqa: BLE001 — reported to every rank in finish(), never left hanging
            pending.error = f"rank {self.process.rank}: {write_error(exc, tmp)}"
        pending.blocked_s = time.perf_counter() - pending.start
        self._pending = pending
        if not pending.futures:
            self.finish()

    def finish(self) -> None:
        """Commit the pending save (waiting for a background write first); all ranks call.

        Raises:
            CheckpointError: some rank failed to write, or the commit failed.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        wait_start = time.perf_counter()
        error = pending.error
        for future in pending.futures:
            if error is None:
                try:
                    future.result()
                except Exception as exc:  # noqa: BLE001
                    error = f"rank {self.process.rank}: background write failed: {write_error(exc, pending.tmp)}"
        errors = [e for e in self.process.all_gather_object(error) if e]  # every rank learns of any failure
        if errors:
            if self.process.is_main:  # give the space back; the next start would remove it anyway
                shutil.rmtree(pending.tmp, ignore_errors=True)
            raise CheckpointError(f"saving step {pending.step} failed ({'; '.join(errors)}); the last complete "
                                  f"checkpoint and {layout.LATEST} are untouched")
        path, size = self._on_main(self._commit, pending)
        now = time.perf_counter()
        blocked = pending.blocked_s + now - wait_start  # the loop waits in save() and here, not while writing
        self.events.append({"event": "checkpoint_saved", "step": pending.step, "path": path, "bytes": size,
                            "save_s": now - pending.start, "blocked_s": blocked, "async": bool(pending.futures)})
        self.report(f"memtrain: saved {path} ({size / 2**20:.1f} MiB) in {now - pending.start:.2f} s "
                    f"(training blocked {blocked:.2f} s)")

    def _commit(self, pending: PendingSave) -> tuple[str, int]:
        """Rank 0 only, no collectives: the records made durable, manifest, commit, retention."""
        if self.before_commit is not None:
            self.before_commit()
        manifest = {"format": FORMAT, "memtrain_version": memtrain.__version__, "torch_version": torch.__version__,
                    "step": pending.step, "world_size": self.process.world_size, "created_unix_s": time.time(),
                    **pending.manifest, **self.manifest_extras}
        final, size = layout.commit(pending.tmp, self.root, pending.step, pending.expected, manifest)
        layout.retain(self.root, final, self.keep_last, self.keep_best)
        return final, size


def _upgrade_format_1(flat: dict[str, Any]) -> dict[str, Any]:
    """A format-1 ``trainer_state.json`` (one flat dict) as format 2's entries."""
    train = {k: flat[k] for k in ("step", "epoch", "samples_seen", "first_loss", "last_loss", "initial_val_loss",
                                  "val_loss")}
    return {"scheduler": flat["scheduler"], "plan": flat["plan"], "train": {**train, "targets_seen": flat["tokens_seen"]},
            "evaluator": {"micro_batch_size": flat["eval_micro_batch_size"]},
            "nonfinite": {"streak": flat.get("nonfinite_streak", 0)}}
