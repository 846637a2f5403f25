"""Run output on rank 0: the tqdm progress bar, ``metrics.jsonl`` and the run summary.

``metrics.jsonl`` holds one JSON object per optimizer step (the fields are listed in
:mod:`memtrain.records` and ``docs/design.md``); after any kill and resume each step of the final
trajectory appears once (:class:`MetricsLogger`). With
``logging.log_with``, the same per-step scalars also go to Accelerate's trackers (TensorBoard,
W&B, MLflow, …) under ``output_dir/trackers``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from memtrain.config import ConfigError
from memtrain.errors import OutputError
from memtrain.extras import require
from memtrain.folders import write_atomic, write_error
from memtrain.records import duration_words

log = logging.getLogger("memtrain")

NOT_SCALARS = frozenset({"step", "batch_fingerprint"})
"""Numeric-looking record fields not sent to trackers: the step is the x axis, the fingerprint a hash."""


def tracker_scalars(record: dict[str, Any]) -> dict[str, float | int]:
    """The record's top-level int/float fields (not bools, strings, lists, ``step`` or
    ``batch_fingerprint``): what a tracker logs at ``record["step"]``."""
    return {k: v for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def check_tracker_names(log_with: Sequence[str]) -> list[str]:
    """``log_with`` without repeats, once every name is ``all`` or an Accelerate tracker.

    Raises:
        ConfigError: an unknown name (field ``logging.log_with``, names the choices).
    """
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    names = list(dict.fromkeys(str(n) for n in log_with))
    choices = ", ".join(["all", *sorted(LOGGER_TYPE_TO_CLASS)])
    for name in names:
        if name != "all" and name not in LOGGER_TYPE_TO_CLASS:
            raise ConfigError("logging.log_with", f"unknown tracker {name!r}; choose from {choices}")
    return names


def open_trackers(log_with: Sequence[str], logging_dir: str, run_name: str, purge_step: Optional[int] = None) -> list:
    """Accelerate trackers (``accelerate.tracking.GeneralTracker``) for ``log_with``, constructed
    but not started (nothing written yet); TensorBoard's writer gets ``purge_step`` (its points
    at and after that step in earlier event files are hidden).

    ``all`` means every tracker whose package is installed (at least one must be). Raises
    ConfigError("logging.log_with") for an unknown name or a tracker whose package is missing.
    Accelerate's ``PartialState`` must be up (the loop's :class:`memtrain.distributed.ProcessState`
    starts it): the trackers log through Accelerate's logger.
    """
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, filter_trackers

    names = check_tracker_names(log_with)
    available = [str(t) for t in filter_trackers(names, logging_dir)]
    for name in names:
        if name != "all" and name not in available:
            if name == "tensorboard":
                require("tracking", "logging.log_with", "tracker 'tensorboard'")
            raise ConfigError("logging.log_with", f"tracker {name!r} needs its package: pip install {name}")
    if not available:
        raise ConfigError("logging.log_with", "'all' found no tracker package installed; install one of "
                                              f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    trackers = []
    for name in available:
        cls = LOGGER_TYPE_TO_CLASS[name]
        kwargs = {"purge_step": purge_step} if name == "tensorboard" and purge_step is not None else {}
        tracker = cls(run_name, logging_dir, **kwargs) if cls.requires_logging_directory else cls(run_name)
        tracker.main_process_only = False  # MetricsLogger already runs only on rank 0
        trackers.append(tracker)
    return trackers


@contextlib.contextmanager
def output_error(path: str, doing: str):
    """An ``OSError`` in the block (a full disk, a read-only folder) as
    :class:`memtrain.errors.OutputError` naming ``path`` (and a full disk's free bytes): exit 4."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{doing} {path} failed: {write_error(exc, os.path.dirname(path) or '.')}") from None


def read_records(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The records of a ``metrics.jsonl`` as ``(line, record)`` pairs, in file order (each line
    ending in a newline): every line that is a JSON object with an integer ``step``; a line cut
    short by a kill, or anything else, is skipped. A missing file has none."""
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    out.append((line if line.endswith("\n") else line + "\n", record))
    except FileNotFoundError:
        pass
    return out


def reconcile(found: list[tuple[str, dict]], step: int, carried: Sequence[dict],
              saved_event: Optional[dict] = None) -> tuple[list[tuple[str, dict]], list[int]]:
    """The records of the trajectory that a run resumed from the checkpoint of ``step`` continues.

    Args:
        found: ``metrics.jsonl``'s records (:func:`read_records`).
        step: the checkpoint's step.
        carried: the records the checkpoint carries (:class:`memtrain.records.RecordTail`: the
            steps since the save before it, up to ``step``).
        saved_event: the ``checkpoint_saved`` event of ``step``, added to its record when that
            record comes from ``carried`` (the file lacked it: the run was killed between the
            commit and the record).

    Returns:
        ``(records, missing)``: one ``(line, record)`` per step, in step order — a step recorded
        more than once keeps its last line; records of steps after ``step`` are dropped (the
        resumed run trains those steps again: the same way every time); a step the file lacks
        is taken from ``carried`` — and the steps in ``1..step`` that neither holds (a
        ``metrics.jsonl`` removed or cut outside memtrain).
    """
    by_step: dict[int, tuple[str, dict]] = {}
    for line, record in found:
        if record["step"] <= step:
            by_step[record["step"]] = (line, record)
    for record in carried:
        if record.get("step") not in by_step and isinstance(record.get("step"), int) and record["step"] <= step:
            if record["step"] == step and saved_event is not None:
                events = [*record.get("plan_changes", []), saved_event]
                record = {**record, "event": ",".join(e["event"] for e in events), "plan_changes": events}
            by_step[record["step"]] = (json.dumps(record) + "\n", record)
    missing = [s for s in range(1, step + 1) if s not in by_step]
    return [by_step[s] for s in sorted(by_step)], missing


LINE_EVERY_S = 10.0
"""Away from a terminal (a log file, a job's output), a step line at most this often (seconds)."""


def progress_fields(record: dict[str, Any], unit: str) -> dict[str, str]:
    """What the progress shows of a step record: loss, lr, micro-batch × accumulation, ``unit``
    per second and the validation loss when there is one."""
    fields = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
              "mb×acc": f"{record['micro_batch_size']}×{record['gradient_accumulation_steps']}",
              {"tokens": "tok/s", "characters": "char/s"}.get(unit, f"{unit}/s"): f"{record[unit + '_per_s']:.0f}"}
    if "val_loss" in record:
        fields["val"] = f"{record['val_loss']:.4f}"
    return fields


def step_ranges(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    parts: list[str] = []
    for s in steps:
        if parts and int(parts[-1].rsplit("-", 1)[-1]) == s - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{s}"
        else:
            parts.append(str(s))
    return ", ".join(parts)


class MetricsLogger:
    """Writes metrics on the main process; a no-op elsewhere.

    What ``metrics.jsonl`` promises after any kill and resume: exactly one record per step of the
    final trajectory, no gap, no duplicate. A step's record is appended after the step (and after
    its checkpoint's commit, when it saves); :meth:`sync` makes every earlier line durable before
    each commit; a checkpoint carries the records since the save before it
    (:class:`memtrain.records.RecordTail`); a resumed run rewrites the file atomically as
    :func:`reconcile` says, so the records of steps the resumed checkpoint does not contain (the
    stretch a resume replaces) are dropped, and a record the kill kept from the file is put back.

    Args:
        output_dir: run directory (``metrics.jsonl`` and ``summary.json`` go there).
        enabled: True on rank 0.
        total_steps: progress-bar length (optimizer steps).
        initial_step: steps already done (progress bar start).
        keep_until_step: on resume, the checkpoint's step (:func:`reconcile`). None = a fresh
            run: ``metrics.jsonl`` starts empty.
        unit: what the throughput counts (``tokens``, or ``characters`` for CTC): records carry
            ``<unit>_per_s``.
        log_with: Accelerate tracker names (``logging.log_with``) that also get each record's
            scalars (:func:`tracker_scalars`) at its step, logged under ``output_dir/trackers`` as
            the run named after ``output_dir``. TensorBoard starts with ``purge_step`` at the first
            step this logger writes (TensorBoard hides the points at and after it that earlier
            event files hold), and a resumed run logs every kept record again, so a run's scalars
            hold each step once whatever was flushed before a kill; W&B, MLflow and the others
            start a new run at each start, which holds the whole trajectory so far.
        carried: on resume, the records the checkpoint carries (:class:`memtrain.records.RecordTail`);
            None when the checkpoint is another run folder's (``resume: PATH``): the file starts
            empty (its records were of another trajectory), and the steps before are no gap.
        saved_event: on resume, the resumed checkpoint's ``checkpoint_saved`` event (:func:`reconcile`).
        terminal: show a progress bar (memtrain's warnings printed above it); else a step line now
            and then (:meth:`log_step`). None = whether standard error is a terminal.

    Attributes:
        earlier: the kept records of the segments before this one (rank 0).
        missing: the steps up to ``keep_until_step`` that neither the file nor the checkpoint held.

    Raises:
        ConfigError: ``logging.log_with`` names an unknown tracker or one whose package is
            missing (checked on every rank, before anything is written).
    """

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, initial_step: int = 0,
                 keep_until_step: Optional[int] = None, unit: str = "tokens", log_with: Sequence[str] = (),
                 carried: Optional[Sequence[dict]] = (), saved_event: Optional[dict] = None,
                 terminal: Optional[bool] = None):
        self.enabled = enabled
        self.unit = unit
        self.output_dir = output_dir
        self._file = None
        self.earlier: list[dict[str, Any]] = []
        self.missing: list[int] = []
        self._bar: Optional[tqdm] = None
        self._closing = contextlib.ExitStack()  # what close() undoes besides the bar and the file
        self._trackers: list = []
        run_name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
        logging_dir = os.path.join(output_dir, "trackers")
        if not enabled:
            if log_with:  # the same checks as rank 0's, so every rank stops on a bad tracker
                open_trackers(log_with, logging_dir, run_name)
            return
        path = os.path.join(output_dir, "metrics.jsonl")
        kept: list[tuple[str, dict]] = []
        if keep_until_step is not None and carried is not None:
            kept, self.missing = reconcile(read_records(path), keep_until_step, carried, saved_event)
        self.earlier = [record for _, record in kept]
        if log_with:  # before anything is written
            first = self.earlier[0]["step"] if self.earlier else initial_step + 1
            self._trackers = open_trackers(log_with, logging_dir, run_name, purge_step=first)
        if self.missing:
            log.warning("memtrain: %s holds no record of step(s) %s, nor does the checkpoint of step %d (the file was "
                        "removed or cut outside memtrain): the run goes on without them", path,
                        step_ranges(self.missing), keep_until_step)
        with output_error(path, "rewriting"):
            os.makedirs(output_dir, exist_ok=True)
            write_atomic(path, "".join(line for line, _ in kept))
            self._file = open(path, "a", encoding="utf-8")
        self._terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True,
                         disable=not self._terminal)
        self._line_at, self._steps = time.monotonic(), (initial_step, total_steps)
        if self._terminal and not (logging.getLogger().handlers or log.handlers):  # warnings above the bar, not in it
            self._closing.enter_context(logging_redirect_tqdm([log]))
        for tracker in self._trackers:
            tracker.start()
        for record in self.earlier:  # again: whatever an earlier start's trackers held or lost
            self._log_trackers(record)

    def sync(self) -> None:
        """Make every record written so far durable (flush and fsync ``metrics.jsonl``): called
        right before a checkpoint is committed."""
        if self._file is not None:
            with output_error(self._file.name, "making durable before the commit"):
                self._file.flush()
                os.fsync(self._file.fileno())

    def _log_trackers(self, record: dict[str, Any]) -> None:
        scalars = tracker_scalars(record)
        for tracker in self._trackers:
            tracker.log(scalars, step=record["step"])

    def log_step(self, record: dict[str, Any], show: bool = True) -> None:
        """Append one step's record, and show it: on a terminal the progress bar, redrawn with
        this step's fields (``show``: the fields change, else only the count); elsewhere (a log
        file) one line for the session's first step, then at most every :data:`LINE_EVERY_S`
        seconds, and at evaluations and the last step."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._log_trackers(record)
        if self._terminal:
            if show:
                self._bar.set_postfix(progress_fields(record, self.unit), refresh=False)
            self._bar.update(1)  # drawn with the fields just set
            return
        now = time.monotonic()
        first = record["step"] == self._steps[0] + 1  # training is under way: said at once
        if show and (first or "val_loss" in record or record["step"] == self._steps[1]
                     or now - self._line_at >= LINE_EVERY_S):
            fields = " ".join(f"{k} {v}" for k, v in progress_fields(record, self.unit).items())
            print(f"memtrain: step {record['step']}/{self._steps[1]}: {fields}", file=sys.stderr, flush=True)
            self._line_at = now

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        """Close the progress bar (its line ended), ``metrics.jsonl`` and the trackers; idempotent
        (also after an error, before it is said)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._closing.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.finish()

    def finish(self, summary: dict[str, Any]) -> None:
        """Close the bar and the trackers, write ``summary.json`` and print the one-line summary."""
        if not self.enabled:
            return
        self.close()
        path = os.path.join(self.output_dir, "summary.json")
        with output_error(path, "writing"):
            write_atomic(path, json.dumps(summary, indent=2))
        if summary.get("preempted"):
            line = (f"memtrain: stopped by {summary['preempted']} after step {summary['steps']}, saved; rerun the same "
                    "command to resume")
        else:
            validation = ("val_loss {initial_val_loss:.4f} → {final_val_loss:.4f}, "
                          if summary.get("initial_val_loss") is not None and summary.get("final_val_loss") is not None
                          else "")  # no validation examples: no val_loss
            line = ("memtrain: done — {steps} steps in {took}, loss {first_loss:.4f} → {last_loss:.4f}, "
                    + validation + "{rate:.0f} {unit}/s, "
                    + ("model in {model_dir}" if summary.get("model_dir") else "no export (checkpoint.export false)")).format(
                        **summary, took=duration_words(summary["minutes"]), rate=summary[f"{self.unit}_per_s"],
                        unit=self.unit)
        print(line, flush=True)
