"""An independent count of one optimizer step's memory (``logging.memory_breakdown_step``).

torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a ``TorchDispatchMode``) sees
every tensor storage an operator creates and frees, whoever calls it: the model, autograd, the
engine (DDP's buckets, FSDP2's gathered parameters, DeepSpeed's partitions and reduce buffers)
and the optimizer. It is entered before the model is built, so model state and engine buffers
created at start-up are counted; its peak is restarted when the chosen step begins, and the
step's peak (forward, backward and optimizer update of every micro-batch) is written per rank to
``OUTPUT_DIR/memory_breakdown/rank_XXXXX.json``. Nothing here comes from memtrain's own
accounting: ``benchmarks/memory_accuracy.py`` sets the two side by side.

What it does not see (torch's limits): memory allocated outside torch's operators (a C++
library's own buffers, pinned host staging of DeepSpeed's CPU Adam), and on CUDA the caching
allocator's fragmentation (``torch.cuda.max_memory_allocated`` is written beside it there).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from memtrain.folders import write_atomic

_TOTAL = "Total"


class MemoryBreakdown:
    """Counts step ``step``'s peak tensor bytes on this rank (0 = off: every method does nothing).

    Args:
        step: the optimizer step to count (1-based); 0 = off.
        output_dir: the run folder (``memory_breakdown/`` is written in it).
        rank: this process's global rank.
    """

    def __init__(self, step: int, output_dir: str, rank: int):
        self.step, self.output_dir, self.rank = step, output_dir, rank
        self._tracker = None

    def start(self) -> "MemoryBreakdown":
        """Enter the tracker (before the model is built)."""
        if self.step > 0:
            self._tracker = _tracker()
            self._tracker.__enter__()
        return self

    def before_step(self, step: int) -> None:
        """Restart the peak when ``step`` is the counted one (MemTracker keeps its peak since
        it was entered; its two peak fields are reset to the current count)."""
        if self._tracker is None or step != self.step:
            return
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        tracker = self._tracker
        tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
        tracker._peak_mem = {device: snap[_TOTAL] for device, snap in tracker._peak_mem_snap.items()}
        self._before = tracker.get_tracker_snapshot("current")

    def after_step(self, step: int) -> Optional[dict]:
        """When ``step`` is the counted one: write and return its record, and stop tracking
        (later steps run without the tracker's overhead).

        Returns:
            ``{"step", "rank", "peak_bytes", "peak_by_category", "before_step_bytes",
            "cuda_max_memory_allocated"}`` (bytes; categories are MemTracker's: Parameter,
            Buffer, Gradient, Activation, Temp, Optimstate, Other), or None.
        """
        if self._tracker is None or step != self.step:
            return None
        peak = self._tracker.get_tracker_snapshot("peak")
        self.close()
        device = max(peak, key=lambda d: peak[d][_TOTAL]) if peak else None
        record = {"step": step, "rank": self.rank, "device": str(device),
                  "peak_bytes": int(peak[device][_TOTAL]) if device is not None else 0,
                  "peak_by_category": {getattr(k, "value", str(k)): int(v)
                                     for k, v in (peak.get(device) or {}).items() if k != _TOTAL},
                  "before_step_bytes": int((self._before.get(device) or {}).get(_TOTAL, 0)),
                  "cuda_max_memory_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
        folder = os.path.join(self.output_dir, "memory_breakdown")
        os.makedirs(folder, exist_ok=True)
        write_atomic(os.path.join(folder, f"rank_{self.rank:05d}.json"), json.dumps(record, indent=1))
        return record

    def close(self) -> None:
        """Leave the tracker (idempotent)."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)


class _NoHook:
    """Stands for the gradient hooks a frozen parameter does not get (removing it does nothing)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _tracker():
    """A ``MemTracker`` that counts a whole run: it forgets its per-module statistics when the
    root module is called again (each micro-batch, each evaluation), where the stock one stops
    with ``NotImplementedError``; tensor counts, categories and peaks are untouched."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class RunTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # a frozen parameter (a LoRA model's base) gets no gradient hook: the stock tracker
            # registers one on every parameter, which torch refuses for these
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the root module's next call: a new iteration
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

    return RunTracker()
