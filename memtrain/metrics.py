"""Run output on rank 0: the tqdm progress bar, ``metrics.jsonl`` and the run summary.

``metrics.jsonl`` holds one JSON object per optimizer step (the fields are listed in
:mod:`memtrain.records` and ``docs/design.md``); after a resume each step appears once. With
``logging.log_with``, the same per-step scalars also go to Accelerate's trackers (TensorBoard,
W&B, MLflow, …) under ``output_dir/trackers``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from tqdm.auto import tqdm

from memtrain.config import ConfigError
from memtrain.records import duration_words

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


def open_trackers(log_with: Sequence[str], logging_dir: str, run_name: str) -> list:
    """Accelerate trackers (``accelerate.tracking.GeneralTracker``) for ``log_with``, constructed
    but not started (nothing written yet).

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
            raise ConfigError("logging.log_with", f"tracker {name!r} needs its package: pip install {name}")
    if not available:
        raise ConfigError("logging.log_with", "'all' found no tracker package installed; install one of "
                                              f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    trackers = []
    for name in available:
        cls = LOGGER_TYPE_TO_CLASS[name]
        tracker = cls(run_name, logging_dir) if cls.requires_logging_directory else cls(run_name)
        tracker.main_process_only = False  # MetricsLogger already runs only on rank 0
        trackers.append(tracker)
    return trackers


class MetricsLogger:
    """Writes metrics on the main process; a no-op elsewhere.

    Args:
        output_dir: run directory (``metrics.jsonl`` and ``summary.json`` go there).
        enabled: True on rank 0.
        total_steps: progress-bar length (optimizer steps).
        initial_step: steps already done (progress bar start).
        keep_until_step: on resume, the checkpoint's step: lines of later steps (written by the
            interrupted run after its last checkpoint) are dropped, so each step appears once.
            None = a fresh run: ``metrics.jsonl`` starts empty.
        unit: what the throughput counts (``tokens``, or ``characters`` for CTC): records carry
            ``<unit>_per_s``.
        log_with: Accelerate tracker names (``logging.log_with``) that also get each record's
            scalars (:func:`tracker_scalars`) at its step, logged under ``output_dir/trackers`` as
            the run named after ``output_dir``. After a resume a tracker gets the later steps again.

    Raises:
        ConfigError: ``logging.log_with`` names an unknown tracker or one whose package is
            missing (checked on every rank, before anything is written).
    """

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, initial_step: int = 0,
                 keep_until_step: Optional[int] = None, unit: str = "tokens", log_with: Sequence[str] = ()):
        self.enabled = enabled
        self.unit = unit
        self.output_dir = output_dir
        self._file = None
        self.earlier: list[dict[str, Any]] = []  # the kept records of the segments before this one (rank 0)
        self._bar: Optional[tqdm] = None
        self._trackers: list = []
        if log_with:
            run_name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
            trackers = open_trackers(log_with, os.path.join(output_dir, "trackers"), run_name)
            self._trackers = trackers if enabled else []
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            path = os.path.join(output_dir, "metrics.jsonl")
            kept = []
            if keep_until_step is not None and os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    for line in fh:
                        try:
                            if json.loads(line)["step"] <= keep_until_step:
                                kept.append(line if line.endswith("\n") else line + "\n")
                        except (ValueError, KeyError):
                            pass  # a line cut short by the kill
            self.earlier = [json.loads(line) for line in kept]
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                fh.writelines(kept)
            os.replace(path + ".tmp", path)
            self._file = open(path, "a", encoding="utf-8")
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)
            for tracker in self._trackers:
                tracker.start()

    def log_step(self, record: dict[str, Any], show: bool = True) -> None:
        """Append one step's record and update the progress bar."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._trackers:
            scalars = tracker_scalars(record)
            for tracker in self._trackers:
                tracker.log(scalars, step=record["step"])
        self._bar.update(1)
        if show:
            postfix = {
                "loss": f"{record['loss']:.4f}",
                "lr": f"{record['lr']:.2e}",
                "mb×acc": f"{record['micro_batch_size']}×{record['gradient_accumulation_steps']}",
                {"tokens": "tok/s", "characters": "char/s"}.get(self.unit, f"{self.unit}/s"):
                    f"{record[self.unit + '_per_s']:.0f}",
            }
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            self._bar.set_postfix(postfix, refresh=False)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def finish(self, summary: dict[str, Any]) -> None:
        """Close the bar and the trackers, write ``summary.json`` and print the one-line summary."""
        if not self.enabled:
            return
        self._bar.close()
        self._file.close()
        for tracker in self._trackers:
            tracker.finish()
        path = os.path.join(self.output_dir, "summary.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        os.replace(path + ".tmp", path)
        if summary.get("preempted"):
            line = f"memtrain: stopped by {summary['preempted']} after step {summary['steps']}; checkpoint saved"
        else:
            validation = ("val_loss {initial_val_loss:.4f} → {final_val_loss:.4f}, "
                          if summary.get("initial_val_loss") is not None and summary.get("final_val_loss") is not None
                          else "")  # no validation examples: no val_loss
            line = ("memtrain: done — {steps} steps in {took}, loss {first_loss:.4f} → {last_loss:.4f}, "
                    + validation + "{rate:.0f} {unit}/s, model in {model_dir}").format(
                        **summary, took=duration_words(summary["minutes"]), rate=summary[f"{self.unit}_per_s"],
                        unit=self.unit)
        print(line, flush=True)
