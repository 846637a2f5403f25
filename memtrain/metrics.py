"""Run output on rank 0: the tqdm progress bar, ``metrics.jsonl`` and the run summary.

``metrics.jsonl`` holds one JSON object per optimizer step (the fields are listed in
:mod:`memtrain.records` and ``docs/design.md``); after a resume each step appears once.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from tqdm.auto import tqdm


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
    """

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, initial_step: int = 0,
                 keep_until_step: Optional[int] = None, unit: str = "tokens"):
        self.enabled = enabled
        self.unit = unit
        self.output_dir = output_dir
        self._file = None
        self._bar: Optional[tqdm] = None
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
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                fh.writelines(kept)
            os.replace(path + ".tmp", path)
            self._file = open(path, "a", encoding="utf-8")
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)

    def log_step(self, record: dict[str, Any], show: bool = True) -> None:
        """Append one step's record and update the progress bar."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
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
        """Close the bar, write ``summary.json`` and print the one-line summary."""
        if not self.enabled:
            return
        self._bar.close()
        self._file.close()
        path = os.path.join(self.output_dir, "summary.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        os.replace(path + ".tmp", path)
        if summary.get("preempted"):
            line = f"memtrain: stopped by {summary['preempted']} after step {summary['steps']}; checkpoint saved"
        else:
            line = ("memtrain: done — {steps} steps in {minutes:.2f} min, loss {first_loss:.4f} → {last_loss:.4f}, "
                    "val_loss {initial_val_loss:.4f} → {final_val_loss:.4f}, {rate:.0f} {unit}/s, "
                    "model in {model_dir}").format(**summary, rate=summary[f"{self.unit}_per_s"], unit=self.unit)
        print(line, flush=True)
